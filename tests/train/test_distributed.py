"""lora_bench.train.distributed / lora_bench.train.torchrun on the CPU (gloo, two processes, a tiny GPT-2): DDP on
slices of the global batch trains exactly as one process on the whole batch, the all-reduce timer
sees every bucket, an indivisible batch is refused, and a rank that raises stops the job with its
error named (no hang)."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from numerics import assert_same_function, float64_runs, without_key_bias

from lora_bench.config import TrainConfig
from lora_bench.errors import UsageError
from lora_bench.train.distributed import (
    NO_MULTICAST_ENV,
    AllReduceTimer,
    DataParallel,
    RankEnv,
    _union,
    check_global_batch,
    rank_env,
    rank_slice,
)
from lora_bench.train.torchrun import (
    launch_environ,
    rank_failures,
    root_cause,
    run_torchrun,
    strip_option,
    torchrun_command,
)
from paths import FIXTURES, ROOT

GLOBAL_BATCH, SEQ, STEPS = 8, 12, 5
LR, BETAS = 5e-4, (0.9, 0.999)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model():
    from lora_bench.classifier.book import build_classifier

    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="all", device="cpu", seed=123)
    torch.manual_seed(0)
    return build_classifier(cfg, cache_dir=Path("/nonexistent"), progress=False)


def batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 50257, (GLOBAL_BATCH, SEQ), generator=g), torch.randint(0, 2, (GLOBAL_BATCH,), generator=g))
            for _ in range(STEPS)]


def train(model, step_model, shard, timer):
    """The loop's step (data, forward, backward, optimizer) on the given batches."""
    from lora_bench.train.evaluate import calc_loss_batch

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=0.1)
    for i, (x, y) in enumerate(batches()):
        timer.begin(step=i, epoch=1)
        x, y = shard(x, y)
        timer.mark("data")
        loss = calc_loss_batch(x, y, step_model)
        timer.mark("forward")
        loss.backward()
        timer.mark("backward")
        opt.step()
        opt.zero_grad()
        timer.mark("optimizer")
        timer.end(loss, tokens=x.numel())


def _rank_main(rank: int, world: int, port: int, out: str, bucket_mb: float = 25.0) -> None:
    torch.set_num_threads(1)
    env = rank_env({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dp = DataParallel.start(env, device="cpu", batch_size=GLOBAL_BATCH, timeout_s=60)
    model = tiny_model()
    ddp = dp.wrap(model, bucket_mb=bucket_mb)
    timer = dp.phase_timer("events", warmup_steps=1)
    train(model, ddp, dp.shard, timer)
    extra = dp.gather(timer)
    rows = timer.step_rows("r")
    from lora_bench.train.evaluate import calc_loss_batch

    calc_loss_batch(*dp.shard(*batches()[0]), ddp).backward()  # one more backward, to look at its gradients
    views = [p.grad is not None and p.grad._base is not None for p in model.parameters()]
    if dp.is_main:
        torch.save({"losses": [r["loss"] for r in rows], "rows": rows, "extra": extra, "views": views,
                    "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "env": {k: os.environ.get(k) for k in NO_MULTICAST_ENV}}, out)
    dp.close()


def run_ranks(out: Path, *, bucket_mb: float = 25.0) -> dict:
    ctx = mp.start_processes(_rank_main, args=(2, free_port(), str(out), bucket_mb), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline, "DDP ranks did not finish"
    return torch.load(out, weights_only=True)


def one_process(dtype: torch.dtype) -> dict:
    """The losses and parameters of the same training in one process on the whole batch, the model
    built as always and then cast to ``dtype``."""
    from lora_bench.timing import PhaseTimer

    model = tiny_model().to(dtype)
    timer = PhaseTimer("events", torch.device("cpu"), warmup_steps=1)
    train(model, model, lambda x, y: (x, y), timer)
    return {"losses": torch.tensor([r["loss"] for r in timer.step_rows("r")], dtype=torch.float64),
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def adam_drift(steps: int, lr: float = LR, betas: tuple[float, float] = BETAS) -> float:
    """How far apart two AdamW runs from the same start can move a parameter whatever its gradients:
    by Cauchy-Schwarz, m_t = (1-β1)·Σ β1^(t-i)·g_i against v_t = (1-β2)·Σ β2^(t-i)·g_i² gives
    |m̂_t| / √v̂_t ≤ (1-β1)/(1-β1^t) · √((1-β2^t)/(1-β2)) · √(Σ_{j<t} (β1²/β2)^j) =: B_t, so each
    step moves either run at most lr·B_t (weight decay only shrinks the difference): 2·lr·Σ B_t."""
    b1, b2 = betas
    total = 0.0
    for t in range(1, steps + 1):
        total += ((1 - b1) / (1 - b1 ** t) * math.sqrt((1 - b2 ** t) / (1 - b2))
                  * math.sqrt(sum((b1 * b1 / b2) ** j for j in range(t))))
    return 2 * lr * total


def test_ddp_on_slices_equals_one_process_on_the_global_batch(tmp_path):
    """fp32, 5 AdamW steps: DDP (two half-batch means averaged) and one process (one mean) differ
    only in the order of floating-point reductions, so the DDP losses and parameters are as close to
    a float64 one-process run as the float32 one-process run is (numerics.same_function_tol)."""
    got = run_ranks(tmp_path / "ddp.pt")
    want, ref = one_process(torch.float32), one_process(torch.float64)
    assert len(got["losses"]) == STEPS and ref["params"]["tok_emb.weight"].dtype == torch.float64
    assert_same_function(torch.tensor(got["losses"], dtype=torch.float64), want["losses"], ref["losses"],
                         what="losses")
    assert want["losses"][0] != want["losses"][-1]  # it trained: the comparison is not of constants
    assert_same_function(*(without_key_bias(r["params"]) for r in (got, want, ref)), what="parameters")
    # the key biases' gradients are rounding noise (numerics.without_key_bias), which AdamW
    # normalises into lr-sized steps in either run: they stay within AdamW's largest drift
    for name in set(want["params"]) - set(without_key_bias(want["params"])):
        assert (got["params"][name] - want["params"][name]).abs().max() <= adam_drift(STEPS), name
    # the all-reduce timer saw every step's buckets; the extra columns are rank 0's
    assert all(r["allreduce_buckets"] >= 1 and r["allreduce_ms"] > 0 for r in got["rows"])
    assert all(0 <= r["allreduce_exposed_ms"] <= r["allreduce_ms"] + 1e-6 for r in got["rows"])
    assert all(r["allreduce_ms"] <= r["backward_ms"] for r in got["rows"])  # DDP waits for them in backward
    extra = got["extra"]
    assert extra["world_size"] == 2 and extra["allreduce_buckets"] >= 1
    assert 0 < extra["rank_step_ms_min"] <= extra["rank_step_ms_max"]
    assert got["env"] == NO_MULTICAST_ENV


@pytest.mark.slow
def test_the_bucket_size_sets_how_many_all_reduces_a_step_makes(tmp_path):
    """ddp_bucket_mb is DDP's bucket cap: the tiny model's 6.4 MiB of gradients fit one 25 MiB bucket,
    and 0.01 MiB buckets split them into many all-reduces; the losses do not depend on it, and the gradients are views
    into the buckets (gradient_as_bucket_view)."""
    few, many = run_ranks(tmp_path / "few.pt"), run_ranks(tmp_path / "many.pt", bucket_mb=0.01)
    assert few["extra"]["allreduce_buckets"] == 1 and many["extra"]["allreduce_buckets"] >= 5
    # as close to a float64 one-process run as one bucket is (numerics.same_function_tol)
    assert_same_function(*(torch.tensor(r["losses"], dtype=torch.float64) for r in (many, few)),
                         one_process(torch.float64)["losses"], what="losses")
    assert all(many["views"]) and all(few["views"])


def test_indivisible_global_batch_is_refused():
    check_global_batch(8, 4)
    with pytest.raises(UsageError, match=r"--batch-size 10 does not split over 4 processes.*one of 1, 2, 5, 10"):
        check_global_batch(10, 4)
    env = RankEnv(rank=1, world_size=4, local_rank=1, local_world_size=4, master_addr="x", master_port=1)
    assert rank_slice(8, env) == slice(2, 4)
    with pytest.raises(UsageError, match="does not split"):
        DataParallel.start(env, device="cpu", batch_size=6)  # refused before joining any group


def test_rank_env_from_torchrun_variables():
    assert rank_env({}) is None
    base = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    env = rank_env(base)
    assert (env.rank, env.world_size, env.local_world_size, env.is_main) == (1, 2, 2, False)
    with pytest.raises(UsageError, match="MASTER_PORT is not"):
        rank_env({**base, "MASTER_PORT": ""})
    with pytest.raises(UsageError, match="RANK='x' is not a whole number"):
        rank_env({**base, "RANK": "x"})
    with pytest.raises(UsageError, match="do not fit"):
        rank_env({**base, "RANK": "2"})


def test_union_of_bucket_intervals_and_exposed_time():
    assert _union([(0, 2), (1, 3), (5, 6)]) == 4
    t = AllReduceTimer(device=torch.device("cpu"), world_size=2)
    t.begin_step(0)
    ref = t.steps[0].ref
    t.steps[0].buckets = [[ref + 0.001, ref + 0.004], [ref + 0.003, ref + 0.006]]
    ms, exposed, n = t.step_stats()[0]
    assert n == 2 and ms == pytest.approx(5.0) and exposed == pytest.approx(3.0)


def test_launcher_command_and_environment():
    cmd = torchrun_command(2, ["-m", "lora_bench", "train"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc-per-node=2" in cmd
    assert "--standalone" in cmd and "--max-restarts=0" in cmd and cmd[-3:] == ["-m", "lora_bench", "train"]
    env = launch_environ({"PATH": "/bin", "NCCL_NVLS_ENABLE": "1"}, errors_dir=Path("/e"))
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["LORA_BENCH_RANK_ERRORS"] == "/e" and env["PATH"] == "/bin"
    assert strip_option(["train", "--nproc", "2", "--lr", "1", "--nproc=4"], "--nproc") == ["train", "--lr", "1"]


RANK_SCRIPT = """\
import sys, time
import torch, torch.distributed as dist
from lora_bench.train.distributed import DataParallel, rank_env, rank_errors
env = rank_env()
with rank_errors(env):
    dp = DataParallel.start(env, device="cpu", batch_size=2, timeout_s=120)
    x = torch.ones(1)
    dist.all_reduce(x)  # both ranks are up
    if env.rank == 1:
        raise ValueError("boom on purpose")
    for _ in range(600):  # rank 0 keeps communicating: it must be stopped, not hang
        dist.all_reduce(x)
        time.sleep(0.1)
"""


def test_a_failing_rank_stops_the_job_with_its_error(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    errors = tmp_path / "errors"
    errors.mkdir()
    env = launch_environ({**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, errors_dir=errors)
    t0 = time.monotonic()
    launched = run_torchrun(torchrun_command(2, [str(script)]), env=env, timeout_s=90)
    assert time.monotonic() - t0 < 90, "the job hung"
    assert launched.returncode != 0 and launched.signum is None
    failures = rank_failures(errors)
    cause = root_cause(failures)
    assert cause["rank"] == 1 and cause["error"] == "ValueError: boom on purpose", failures
    assert {f["rank"] for f in failures} <= {0, 1}


# -- `lora-bench train --nproc N`: the real command, end to end -------------------------------------
SAMPLE = FIXTURES / "sms_spam_sample.tsv"
REPO = ROOT


def train_args(results: Path, cache: Path, *extra: str) -> list[str]:
    return ["train", "--model-size", "tiny", "--weights", "random", "--trainable-layers", "all", "--device", "cpu",
            "--data-file", str(SAMPLE), "--max-steps", "5", "--batch-size", "8", "--eval-freq", "2", "--eval-iter", "1",
            "--skip-final-eval", "--warmup-steps", "1", "--lr", "5e-4", "--results-dir", str(results),
            "--cache-dir", str(cache), "--no-progress", *extra]


def float64_run(run_cli, results: Path, args: list[str]):
    """The one-process run of ``args`` evaluated in float64 (numerics.float64_runs), into ``results``:
    its steps.csv."""
    import pandas as pd

    with float64_runs() as built:
        code, out = run_cli(*args, "--run-id", "f64")
    assert code == 0, out
    assert len(built) == 1 and {p.dtype for p in built[0].parameters()} == {torch.float64}
    return pd.read_csv(results / "f64" / "steps.csv")


def assert_same_losses(got, want, ref, what: str = "losses") -> None:
    """Loss columns: ``got`` as close to the float64 run's as ``want`` (numerics.same_function_tol)."""
    assert len(got) == len(want) == len(ref) > 0
    assert_same_function(*(torch.tensor(list(c), dtype=torch.float64) for c in (got, want, ref)), what=what)


@pytest.fixture
def ranks_import_this_tree(monkeypatch):
    """The rank processes import the lora_bench of this checkout."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def test_nproc_2_trains_as_one_process_and_records_the_ranks(tmp_path, run_cli, ranks_import_this_tree):
    code, out = run_cli(*train_args(tmp_path / "one", tmp_path / "cache", "--run-id", "one"))
    assert code == 0, out
    code, out = run_cli(*train_args(tmp_path / "ddp", tmp_path / "cache", "--nproc", "2", "--run-id", "two"))
    assert code == 0, out
    import pandas as pd

    one = pd.read_csv(tmp_path / "one" / "one" / "steps.csv")
    two = pd.read_csv(tmp_path / "ddp" / "two" / "steps.csv")
    f64 = float64_run(run_cli, tmp_path / "f64", train_args(tmp_path / "f64", tmp_path / "cache"))
    assert_same_losses(two["loss"], one["loss"], f64["loss"])
    assert (two["tokens"] == one["tokens"]).all()  # the global batch's tokens
    assert (two["allreduce_buckets"] >= 1).all() and (two["allreduce_ms"] > 0).all()
    row = pd.read_csv(tmp_path / "ddp" / "runs.csv").iloc[0]
    assert row["run_id"] == "two" and row["status"] == "done" and row["world_size"] == 2
    assert row["rank_step_ms_max"] >= row["rank_step_ms_min"] > 0 and row["allreduce_ms_median"] > 0
    ref = pd.read_csv(tmp_path / "one" / "runs.csv").iloc[0]
    ref64 = pd.read_csv(tmp_path / "f64" / "runs.csv").iloc[0]
    assert_same_losses(*([r["final_train_loss"]] for r in (row, ref, ref64)), what="evaluations")
    assert len(pd.read_csv(tmp_path / "ddp" / "runs.csv")) == 1  # rank 1 wrote nothing


def test_nproc_2_trains_the_fused_lora_layer_as_one_process(tmp_path, run_cli, ranks_import_this_tree):
    """lora-kernel under DDP (its CPU path on gloo): only the adapters are DDP's parameters, and the
    losses are as close to the one-process run's float64 evaluation as its float32 ones."""
    layers = ("--trainable-layers", "lora-kernel", "--lora-rank", "4")
    code, out = run_cli(*train_args(tmp_path / "r", tmp_path / "cache", *layers, "--run-id", "one"))
    assert code == 0, out
    code, out = run_cli(*train_args(tmp_path / "r", tmp_path / "cache", *layers, "--nproc", "2", "--run-id", "two"))
    assert code == 0, out
    import pandas as pd

    one, two = (pd.read_csv(tmp_path / "r" / k / "steps.csv") for k in ("one", "two"))
    f64 = float64_run(run_cli, tmp_path / "f64", train_args(tmp_path / "f64", tmp_path / "cache", *layers))
    assert_same_losses(two["loss"], one["loss"], f64["loss"])
    assert one["loss"].iloc[0] != one["loss"].iloc[-1]
    runs = pd.read_csv(tmp_path / "r" / "runs.csv").set_index("run_id")
    assert runs.loc["two", "cfg_trainable_layers"] == "lora-kernel" and runs.loc["two", "world_size"] == 2
    assert runs.loc["two", "trainable_params"] == runs.loc["one", "trainable_params"]


def test_nproc_refuses_an_indivisible_batch_before_starting(tmp_path, run_cli):
    code, out = run_cli(*train_args(tmp_path / "r", tmp_path / "cache", "--nproc", "3"))
    assert code == 2 and "--batch-size 8 does not split over 3 processes" in out and "Traceback" not in out
    assert not (tmp_path / "r" / "runs.csv").exists()


def test_nproc_a_failing_rank_is_named_in_the_failed_row(tmp_path, run_cli, ranks_import_this_tree, monkeypatch):
    hook = tmp_path / "hook"
    hook.mkdir()
    # test-only failure: rank 1's optimizer raises at its third step
    (hook / "sitecustomize.py").write_text(textwrap.dedent("""\
        import os
        if os.environ.get("RANK") == "1":
            import torch
            real, calls = torch.optim.AdamW.step, []
            def step(self, *a, **k):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("injected failure on rank 1")
                return real(self, *a, **k)
            torch.optim.AdamW.step = step
        """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ["PYTHONPATH"]]))
    t0 = time.monotonic()
    code, out = run_cli(*train_args(tmp_path / "r", tmp_path / "cache", "--nproc", "2", "--max-steps", "400",
                                    "--run-id", "bad"))
    assert time.monotonic() - t0 < 120, "the job hung"
    assert code == 1, out
    import pandas as pd

    row = pd.read_csv(tmp_path / "r" / "runs.csv").iloc[0]
    assert row["run_id"] == "bad" and row["status"] == "failed"
    assert row["error"].startswith("rank 1 failed: RuntimeError: injected failure on rank 1"), row["error"]
    record = json.loads((tmp_path / "r" / "bad" / "run.json").read_text())["row"]
    assert record["status"] == "failed" and record["error"] == row["error"]


@pytest.mark.gpu
def test_nproc_2_on_two_gpus_trains_as_one_gpu_and_times_the_allreduce(tmp_path, run_cli, ranks_import_this_tree):
    """NCCL: the losses of one GPU (fp32, TF32 off) and the CUDA-event all-reduce timer."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    args = [a if a != "cpu" else "cuda" for a in train_args(tmp_path / "r", tmp_path / "cache")]
    assert run_cli(*args, "--run-id", "one")[0] == 0
    code, out = run_cli(*args, "--nproc", "2", "--run-id", "two")
    assert code == 0, out
    import pandas as pd

    steps = {k: pd.read_csv(tmp_path / "r" / k / "steps.csv") for k in ("one", "two")}
    f64 = float64_run(run_cli, tmp_path / "f64", [a if a != "cpu" else "cuda" for a in train_args(
        tmp_path / "f64", tmp_path / "cache")])
    assert_same_losses(steps["two"]["loss"], steps["one"]["loss"], f64["loss"])
    two = steps["two"]
    assert (two["allreduce_ms"] > 0).all() and (two["allreduce_exposed_ms"] <= two["allreduce_ms"] + 1e-3).all()
    assert (two["allreduce_ms"] <= two["backward_ms"] + 1e-3).all()


@pytest.mark.gpu
def test_nproc_2_with_cuda_graphs_replays_the_one_gpu_step(tmp_path, run_cli, ranks_import_this_tree):
    """DDP captured with its all-reduces in the backward graph: the losses of the one-GPU graphed run
    (fp32, TF32 off; the two differ in the order of reductions) and of the eager two-GPU run, in
    one bucket and in many."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    args = [a if a != "cpu" else "cuda" for a in train_args(tmp_path / "r", tmp_path / "cache", "--max-steps", "16")]
    assert run_cli(*args, "--cuda-graphs", "--run-id", "one")[0] == 0
    # the fused LoRA layer's graph plan under DDP, bf16 (its kernels round differently from fp32: its
    # own one-GPU run is the reference)
    fused = ("--trainable-layers", "lora-kernel", "--precision", "bf16", "--cuda-graphs")
    assert run_cli(*args, *fused, "--run-id", "k1")[0] == 0
    code, out = run_cli(*args, *fused, "--nproc", "2", "--run-id", "k2")
    assert code == 0, out
    for run_id, extra in (("two", ()), ("many", ("--ddp-bucket-mb", "0.01"))):
        code, out = run_cli(*args, "--cuda-graphs", "--nproc", "2", *extra, "--run-id", run_id)
        assert code == 0, out
    code, out = run_cli(*args, "--nproc", "2", "--run-id", "eager")
    assert code == 0, out
    import pandas as pd

    steps = {k: pd.read_csv(tmp_path / "r" / k / "steps.csv") for k in ("one", "two", "many", "eager", "k1", "k2")}
    # the one-GPU run eagerly in float64: the reference of the fp32 runs (numerics.same_function_tol)
    f64 = float64_run(run_cli, tmp_path / "f64", [a if a != "cpu" else "cuda" for a in train_args(
        tmp_path / "f64", tmp_path / "cache", "--max-steps", "16")])
    for k in ("two", "many", "eager"):
        assert_same_losses(steps[k]["loss"], steps["one"]["loss"], f64["loss"], what=k)
    torch.testing.assert_close(torch.tensor(steps["k2"]["loss"].values), torch.tensor(steps["k1"]["loss"].values),
                               rtol=2e-2, atol=0)  # bf16: a few units of its 8-bit mantissa over 16 steps
    assert steps["one"]["loss"].iloc[0] != steps["one"]["loss"].iloc[-1]
    runs = pd.read_csv(tmp_path / "r" / "runs.csv").set_index("run_id")
    assert runs.loc["two", "world_size"] == 2 and runs.loc["two", "cfg_cuda_graphs"]
    assert pd.isna(runs.loc["two", "allreduce_ms_median"])  # no per-bucket events inside a capture
    row = pd.read_csv(tmp_path / "r" / "runs.csv").set_index("run_id").loc["two"]
    assert row["world_size"] == 2 and row["device"] == "cuda:0" and row["timing_clock"] == "cuda_events"


# -- nproc as a setting, the launcher's run-id check, sweeps --------------------------------------
def test_nproc_setting_rules_and_run_ids():
    from lora_bench.config import render
    from lora_bench.train.identity import settings_hash

    assert settings_hash(TrainConfig(nproc=1)) == settings_hash(TrainConfig())  # one process: ids unchanged
    assert settings_hash(TrainConfig(nproc=2)) != settings_hash(TrainConfig())  # the measurement differs
    text = " | ".join(render(TrainConfig(nproc=3, batch_size=8, device="cuda:1", cuda_graphs=True).problems()))
    assert "batch_size 8 does not split over 3 processes (nproc=3)" in text and "nproc one of 1, 2, 4, 8" in text
    assert "device='cuda:1' with nproc=3" in text and "cuda_graphs" not in text  # a captured DDP step is allowed
    assert TrainConfig(nproc=2, batch_size=8).problems() == []
    assert TrainConfig(nproc=2, batch_size=8, device="cuda", cuda_graphs=True, ddp_bucket_mb=1000).problems() == []
    assert "ddp_bucket_mb" in " ".join(render(TrainConfig(nproc=2, batch_size=8, ddp_bucket_mb=0).problems()))


def test_rank_settings_take_the_world_size():
    from lora_bench.train.setup import rank_settings

    env = RankEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, master_addr="x", master_port=1)
    assert rank_settings(TrainConfig(), env).nproc == 2  # a job started by torchrun itself records its size
    assert rank_settings(TrainConfig(nproc=2), env).nproc == 2
    with pytest.raises(UsageError, match="nproc=3 but torchrun started 2 processes"):
        rank_settings(TrainConfig(nproc=3, batch_size=6), env)
    with pytest.raises(UsageError, match="lora-bench train --nproc 2"):
        rank_settings(TrainConfig(nproc=2), None)


def test_launcher_checks_the_run_id_and_follows_overwrite(tmp_path):
    from lora_bench.results.claims import try_claim
    from lora_bench.train.torchrun import check_run_id

    run_dir = tmp_path / "x"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"row": {"run_id": "x", "status": "done", "started_at": "t"}}))
    with pytest.raises(UsageError, match="run id 'x' already exists.*--overwrite"):
        check_run_id(tmp_path, "x", overwrite=False)
    assert (run_dir / "run.json").exists()
    check_run_id(tmp_path, "x", overwrite=True)  # replaced: the old record goes before any rank starts
    assert not (run_dir / "run.json").exists()
    with try_claim(run_dir):
        with pytest.raises(UsageError, match="running in another process"):
            check_run_id(tmp_path, "x", overwrite=True)


def test_a_sweep_refuses_data_parallel_runs(tmp_path):
    from rich.console import Console

    from lora_bench.sweep.runner import run_sweep
    from lora_bench.sweep.spec import load_sweep

    path = tmp_path / "s.yaml"
    path.write_text(f"name: p\nbase:\n  model_size: tiny\n  weights: random\n  device: cpu\n  data_file: {SAMPLE}\n"
                    "  max_steps: 2\n  warmup_steps: 1\ngrid:\n  nproc: [1, 2]\n")
    with pytest.raises(UsageError, match="nproc=2: a sweep runs each run in one process"):
        run_sweep(load_sweep(path), results_dir=tmp_path / "r", console=Console(), progress=False)
    assert not (tmp_path / "r" / "runs.csv").exists()


def test_the_scaling_table_joins_each_one_gpu_run_with_its_data_parallel_runs():
    """benchmarks/ddp_table.py on the committed two-GPU study: every 1558M row finds its 2-GPU runs at
    both global batches (settings are text in runs.csv), and the speed-up is the ratio of tokens/s."""
    from benchmarks import ddp_table

    results = ROOT / "results" / "scaling" / "ddp-2gpu"
    if not (results / "ddp" / "runs.csv").is_file():
        pytest.skip("the committed two-GPU study is not in this checkout")
    t = ddp_table.table(results)
    big = t[t["size"] == "1558M"]
    assert sorted(big["layers"]) == ["all", "all", "lora", "lora", "lora-kernel", "lora-kernel"]  # × 2 modes
    assert big[["one_gpu_tok_s", "b16_tok_s", "b8_tok_s"]].notna().all().all()
    for batch in (16, 8):
        assert (abs(big[f"b{batch}_x"] - big[f"b{batch}_tok_s"] / big["one_gpu_tok_s"].astype(float)) < 1e-9).all()
