"""Packing (lora_bench.lora.packed_layer, lora_bench.classifier.packed_classifier, lora_bench.train.pack, a run of
several points through lora_bench.train.run): a packed
point trains as its solo run does. Its initial head and adapters are its solo run's, bit for bit;
a packed layer computes each adapter's solo layer; and on the tiny model each point's per-step
losses, periodic losses and accuracies match its solo run's, as far as another rounding order of
the same function can move them from the float64 evaluation of the solo run
(numerics.same_function_tol), with mixed ranks, alphas, learning rates and weight decays."""

from __future__ import annotations

import copy
import json
import re
import textwrap

import pandas as pd
import pytest
import torch
import torch.nn as nn
from numerics import assert_same_function, float64_runs
from rich.console import Console
from tiny import SAMPLE, TINY_BASE, UNTIL_SIGNAL, interrupt_sweep

from lora_bench.classifier.book import build_classifier
from lora_bench.classifier.packed_classifier import build_packed_classifier
from lora_bench.config import TrainConfig
from lora_bench.errors import UsageError
from lora_bench.lora import LinearWithLoRA
from lora_bench.lora.packed_layer import PackedLoRALinear, point_state_dict
from lora_bench.sweep.spec import load_sweep
from lora_bench.train.pack import pack_problem
from lora_bench.train.points import Point
from lora_bench.train.run import execute, execute_run

BASE = dict(model_size="tiny", weights="random", trainable_layers="lora", device="cpu", data_file=str(SAMPLE),
            num_epochs=2, eval_freq=4, eval_iter=2, warmup_steps=1)  # two epochs of the sample's batches
# mixed ranks (4, 8, 4: the rank-4 group is not every point), alphas, learning rates, weight decays
POINTS = [dict(lora_rank=4, lora_alpha=8.0, learning_rate=5e-4, weight_decay=0.1),
          dict(lora_rank=8, lora_alpha=16.0, learning_rate=1e-3, weight_decay=0.0),
          dict(lora_rank=4, lora_alpha=2.0, learning_rate=2e-4, weight_decay=0.5)]


def cfgs(points=POINTS, **kw) -> list[TrainConfig]:
    return [TrainConfig(**{**BASE, **kw, **p}) for p in points]


def test_packed_points_start_from_their_solo_weights(cache_dir):
    """Every tensor of each point, under its solo model's names, equals its solo model's bit for
    bit; the trainable ones are exactly the solo model's trainable ones."""
    points = cfgs()
    packed = build_packed_classifier(points, cache_dir=cache_dir, progress=False)
    for p, cfg in enumerate(points):
        solo = build_classifier(cfg, cache_dir=cache_dir, progress=False)
        mine = point_state_dict(packed, p)
        theirs = solo.state_dict(keep_vars=True)
        assert mine.keys() == theirs.keys()
        for name, t in theirs.items():
            assert torch.equal(mine[name], t), name
            assert mine[name].requires_grad == t.requires_grad, name
    # what trains is the packed layers' stacked tensors, each holding every point along its first axis
    assert {id(t) for t in packed.parameters() if t.requires_grad} == {
        id(t) for m in packed.modules() if isinstance(m, PackedLoRALinear)
        for t in (m.A, m.B, m.weight, m.bias) if t is not None and t.requires_grad}


def test_mixed_ranks_are_stored_padded_and_the_padding_stays_zero_while_they_train(cache_dir):
    """Ranks 4, 8, 4 in one pack: every adapter stored at rank 8, its extra columns of A and rows
    of B zero; after the pack's training steps (AdamW with weight decay 0.1, 0 and 0.5) they are
    still exactly zero while the rest moved; each point counts its solo model's trainable
    parameters, not the padding."""
    from lora_bench.timing import PhaseTimer
    from lora_bench.train.context import RunContext
    from lora_bench.train.loop import train_classifier

    points = cfgs(max_steps=4, eval_freq=0)
    ctx = RunContext(points, cache_dir=cache_dir, progress=False)
    layers = [m for m in ctx.model.modules() if isinstance(m, PackedLoRALinear)]
    before = [layer.A.detach().clone() for layer in layers]
    timer = PhaseTimer(ctx.cfg.timing, ctx.device, warmup_steps=ctx.cfg.warmup_steps)
    train_classifier(ctx.forward_model, ctx.loaders.train, ctx.loaders.val, ctx.optimizer, ctx.device,
                     settings=ctx.loop_settings(), timer=timer, points=len(points))
    for layer, old in zip(layers, before):
        assert layer.ranks == [4, 8, 4] and layer.A.shape[2] == 8 and layer.B.shape[1] == 8
        for p, r in enumerate(layer.ranks):
            assert not layer.A[p, :, r:].any() and not layer.B[p, r:].any()
            assert not torch.equal(layer.A[p, :, :r], old[p, :, :r])  # the adapter itself trained
    for p, cfg in enumerate(points):
        solo = build_classifier(cfg, cache_dir=cache_dir, progress=False)
        assert ctx.trainable_params[p] == sum(t.numel() for t in solo.parameters() if t.requires_grad)


@pytest.mark.parametrize("ranks, shared", [((3, 5, 3), True), ((4, 4), True), ((2, 6), False)])
def test_packed_layer_computes_each_solo_layer(ranks, shared):
    """Output and every gradient of a packed layer, per point, against that point's own
    LinearWithLoRA (float32), within another rounding order's distance from float64."""
    torch.manual_seed(0)
    k, n_out, rows, t = 12, 10, 3, 5
    base = nn.Linear(k, n_out)
    solos = []
    for p, r in enumerate(ranks):
        layer = LinearWithLoRA(copy.deepcopy(base) if shared else nn.Linear(k, n_out), r, 1.5 + p)
        layer.lora.B.data.normal_()
        layer.linear.requires_grad_(not shared)
        solos.append(layer)
    adapters = [copy.deepcopy(s.lora) for s in solos]
    packed = (PackedLoRALinear(adapters, linear=copy.deepcopy(base).requires_grad_(False)) if shared
              else PackedLoRALinear(adapters, heads=[copy.deepcopy(s.linear) for s in solos]))
    x = torch.randn(len(ranks) * rows, t, k, requires_grad=True)
    g = torch.randn(len(ranks) * rows, t, n_out)
    y = packed(x)
    y.backward(g)
    for p, solo in enumerate(solos):
        own = slice(p * rows, (p + 1) * rows)
        results = {}
        for name, layer, dtype in (("want", solo, torch.float32), ("ref", copy.deepcopy(solo).double(), torch.float64)):
            xp = x[own].detach().to(dtype).requires_grad_()
            yp = layer(xp)
            yp.backward(g[own].to(dtype))
            results[name] = {"y": yp, "x": xp.grad, "A": layer.lora.A.grad, "B": layer.lora.B.grad,
                             **({} if shared else {"W": layer.linear.weight.grad, "b": layer.linear.bias.grad})}
        r, ga, gb = ranks[p], packed.A.grad[p], packed.B.grad[p]
        assert not ga[:, r:].any() and not gb[r:].any()  # the padding's gradients: exactly zero
        got = {"y": y[own], "x": x.grad[own], "A": ga[:, :r], "B": gb[:r],
               **({} if shared else {"W": packed.weight.grad[p], "b": packed.bias.grad[p]})}
        assert_same_function(got, results["want"], results["ref"], what=f"point {p} (rank {ranks[p]})")


def _solo(cfg, tmp_path, cache_dir, run_id, context=None):
    results = tmp_path / "solo"
    if context is None:
        execute_run(cfg, results_dir=results, run_id=run_id, console=Console(quiet=True), progress=False,
                    cache_dir=cache_dir)
    else:
        with context:
            execute_run(cfg, results_dir=results, run_id=run_id, console=Console(quiet=True), progress=False,
                        cache_dir=cache_dir)
    record = json.loads((results / run_id / "run.json").read_text())
    steps = pd.read_csv(results / run_id / "steps.csv")
    return record, steps


def _trajectory(record, steps) -> torch.Tensor:
    """Every loss a run measured, in float64: its per-step training losses, then its periodic ones."""
    return torch.tensor(list(steps["loss"]) + record["train_losses"] + record["val_losses"], dtype=torch.float64)


def test_packed_points_train_as_their_solo_runs(tmp_path, cache_dir):
    points = cfgs()
    ids = [f"p{i}" for i in range(len(points))]
    rows = execute([Point(c, i) for c, i in zip(points, ids)], results_dir=tmp_path / "pack",
                   console=Console(quiet=True), progress=False, cache_dir=cache_dir)
    assert [r["status"] for r in rows] == ["done"] * len(points)
    table = pd.read_csv(tmp_path / "pack" / "runs.csv").set_index("run_id")
    assert set(table["pack_size"]) == {len(points)} and table["pack_id"].nunique() == 1
    for i, (cfg, run_id) in enumerate(zip(points, ids)):
        want, want_steps = _solo(cfg, tmp_path, cache_dir, f"s{i}")
        ref, ref_steps = _solo(cfg, tmp_path, cache_dir, f"d{i}", float64_runs())
        got = json.loads((tmp_path / "pack" / run_id / "run.json").read_text())
        got_steps = pd.read_csv(tmp_path / "pack" / run_id / "steps.csv")
        assert list(got_steps["step"]) == list(want_steps["step"])
        assert list(got_steps["epoch"]) == list(want_steps["epoch"]) and set(want_steps["epoch"]) == {1, 2}
        assert_same_function(_trajectory(got, got_steps), _trajectory(want, want_steps), _trajectory(ref, ref_steps),
                             what=f"point {i} ({cfg.lora_rank=}, {cfg.learning_rate=}, {cfg.weight_decay=}) losses")
        assert got["train_accs"] == want["train_accs"] and got["val_accs"] == want["val_accs"]
        row = table.loc[run_id]
        for col in ("train_acc", "val_acc", "test_acc", "steps", "trainable_params", "total_params", "lora_rank"):
            assert row[col] == want["row"][col], col
        assert (got_steps["share_step_ms"] * len(points) - got_steps["step_ms"]).abs().max() < 1e-9
        assert row["share_step_ms_median"] == pytest.approx(row["step_ms_median"] / len(points), rel=1e-12)
        assert row["host_op_us"] > 0 and row["torch_threads"] == torch.get_num_threads()  # as a solo run records


# The columns in which a packed point's row may differ from its solo run's in being filled: the
# pack's own (its size, its id, the point's share of its step time), which a solo row leaves empty.
PACK_COLUMNS = ("pack_size", "pack_id", "share_step_ms_median")
# The columns whose values a packed point's row shares with its solo run's: what the run says of
# the model it built and where it ran, not what it measured.
SAME_VALUE = ("trainable_params", "total_params", "base_weight_mib", "backend", "device", "world_size", "steps",
              "timing_clock", "torch_threads")


def _masked(line: str) -> str:
    """A log line with its numbers masked: a packed point's losses round otherwise than its solo run's."""
    return re.sub(r"\d+(\.\d+)?", "#", line)


def test_a_packed_points_row_carries_every_column_of_its_solo_row(tmp_path, cache_dir):
    """Every column a solo run's row fills, its packed point's row fills too (PACK_COLUMNS aside,
    the packed row's own), with the same value where it describes the model built and the place it
    ran (SAME_VALUE); and every line of the solo run's log (what its context said of how it was
    built, its evaluations) is in the packed point's log."""
    points = cfgs(POINTS[:2], max_steps=3, eval_freq=2)
    ids = [f"p{i}" for i in range(len(points))]
    execute([Point(c, i) for c, i in zip(points, ids)], results_dir=tmp_path / "pack", console=Console(quiet=True),
            progress=False, cache_dir=cache_dir)
    for i, cfg in enumerate(points):
        execute_run(cfg, results_dir=tmp_path / "solo", run_id=f"s{i}", console=Console(quiet=True), progress=False,
                    cache_dir=cache_dir)
    packed = pd.read_csv(tmp_path / "pack" / "runs.csv", dtype=str, keep_default_na=False).set_index("run_id")
    solo = pd.read_csv(tmp_path / "solo" / "runs.csv", dtype=str, keep_default_na=False).set_index("run_id")
    for i, run_id in enumerate(ids):
        got, want = packed.loc[run_id], solo.loc[f"s{i}"]
        missing = [c for c in solo.columns if want[c] != "" and got.get(c, "") == "" and c not in PACK_COLUMNS]
        assert not missing, f"point {i}: its packed row leaves out what its solo row records: {missing}"
        assert all(got[c] != "" for c in PACK_COLUMNS) and all(want[c] == "" for c in PACK_COLUMNS)
        assert want["base_weight_mib"] != "" and want["status"] == got["status"] == "done"
        for col in SAME_VALUE:
            assert got[col] == want[col], (i, col)
        logs = [json.loads((tmp_path / folder / "run.json").read_text())["log"]
                for folder in (f"pack/{run_id}", f"solo/s{i}")]
        assert set(map(_masked, logs[1])) <= set(map(_masked, logs[0])), (logs[1], logs[0])


def test_the_points_losses_differ_from_each_other(tmp_path, cache_dir):
    """The comparison above is not vacuous: the points' settings move their losses apart."""
    points = cfgs(max_steps=6, eval_freq=0, skip_final_eval=True)
    execute([Point(c, f"p{i}") for i, c in enumerate(points)], results_dir=tmp_path,
            console=Console(quiet=True), progress=False, cache_dir=cache_dir)
    losses = [tuple(pd.read_csv(tmp_path / f"p{i}" / "steps.csv")["loss"]) for i in range(len(points))]
    assert len(set(losses)) == len(points)


def test_incompatible_runs_do_not_pack(tmp_path, cache_dir):
    a, b = cfgs(POINTS[:2])
    assert pack_problem([a, b]) is None
    assert "batch_size" in pack_problem([a, b.replace(batch_size=4)])
    assert "lora-kernel" in pack_problem([a, b.replace(trainable_layers="lora-kernel")])
    with pytest.raises(UsageError, match="cannot train as one pack.*seed"):
        execute([Point(a, "x"), Point(b.replace(seed=7), "y")], results_dir=tmp_path,
                console=Console(quiet=True), progress=False, cache_dir=cache_dir)
    assert not (tmp_path / "runs.csv").exists()


def test_a_failing_pack_marks_every_point_failed(tmp_path, cache_dir, monkeypatch):
    import lora_bench.train.run as run_mod

    def broken(*args, **kwargs):
        raise RuntimeError("the step broke")

    monkeypatch.setattr(run_mod, "train_classifier", broken)
    with pytest.raises(RuntimeError, match="the step broke"):
        execute([Point(c, f"p{i}") for i, c in enumerate(cfgs())], results_dir=tmp_path,
                console=Console(quiet=True), progress=False, cache_dir=cache_dir)
    table = pd.read_csv(tmp_path / "runs.csv")
    assert sorted(table["run_id"]) == ["p0", "p1", "p2"] and set(table["status"]) == {"failed"}
    assert all("its pack of 3 runs failed: RuntimeError: the step broke" in e for e in table["error"])


# -- sweeps ---------------------------------------------------------------------------------------
def _sweep_file(tmp_path, body: str, name: str = "s.yaml"):
    path = tmp_path / name
    path.write_text(f"# lora-bench sweep {name}\n" + textwrap.dedent(body))
    return path


def _rows(results) -> pd.DataFrame:
    return pd.read_csv(results / "runs.csv", dtype=str, keep_default_na=False)


PACKED_SWEEP = "name: pk\nbase:\n" + TINY_BASE + "  trainable_layers: lora\n" + textwrap.dedent("""\
    pack: 3
    runs:
      - {label: a, lora_rank: 4}
      - {label: b, lora_rank: 8, learning_rate: 0.001}
      - {label: c, lora_rank: 2, weight_decay: 0.0}
      - {label: d, lora_rank: 4, lora_alpha: 2.0}
      - {label: k, trainable_layers: lora-kernel}
      - {label: big, batch_size: 4}
    """)


@pytest.mark.slow
def test_a_sweep_packs_what_packs_and_says_why_the_rest_runs_alone(tmp_path, run_cli):
    """Process isolation: a, b, c train as one pack (pack: 3), each with its own row and steps.csv;
    d (no partner left), the lora-kernel run and the one with another batch size run alone, and
    the sweep says why."""
    path = _sweep_file(tmp_path, PACKED_SWEEP)
    results = tmp_path / "res"
    code, out = run_cli("sweep", path, "--results-dir", results, "--cache-dir", tmp_path / "cache", "--no-progress")
    assert code == 0, out
    flat = " ".join(out.split())
    assert "3 runs in 1 pack(s)" in flat
    assert "1 run(s) train alone" in flat and "lora-kernel's op runs one adapter per call" in flat
    assert "2 run(s) train alone" in flat and "no other run left to do shares its settings" in flat
    df = _rows(results).set_index("sweep_label")
    assert set(df["status"]) == {"done"} and len(df) == 6
    assert set(df.loc[["a", "b", "c"], "pack_size"]) == {"3"} and df.loc[["a", "b", "c"], "pack_id"].nunique() == 1
    assert set(df.loc[["d", "k", "big"], "pack_size"]) == {""} and set(df.loc[["d", "k", "big"], "pack_id"]) == {""}
    losses = {}
    for label in "abc":
        steps = pd.read_csv(results / df.loc[label, "run_id"] / "steps.csv")
        assert list(steps["step"]) == [0, 1] and steps["share_step_ms"].notna().all()
        losses[label] = tuple(steps["loss"])
        assert (results / df.loc[label, "run_id"] / "worker.log").is_file()
    assert len(set(losses.values())) == 3  # each its own losses (the second step's differ)
    # the same points, each run alone: the same first-step losses (the same initial weights and batch)
    solo = _rows(results).set_index("sweep_label")
    assert pd.read_csv(results / solo.loc["d", "run_id"] / "steps.csv")["loss"][0] == losses["a"][0]


def test_a_failing_pack_in_a_sweep_fails_each_of_its_runs(tmp_path, run_cli):
    path = _sweep_file(tmp_path, "name: pf\nbase:\n" + TINY_BASE.replace(str(SAMPLE), "missing.tsv")
                       + "  trainable_layers: lora\ngrid:\n  lora_rank: [2, 4]\n")
    results = tmp_path / "res"
    code, out = run_cli("sweep", path, "--pack", "2", "--results-dir", results, "--cache-dir", tmp_path / "cache",
                        "--no-progress")
    assert code == 1, out
    df = _rows(results)
    assert len(df) == 2 and set(df["status"]) == {"failed"} and set(df["pack_size"]) == {"2"}
    assert all("its pack of 2 runs failed" in e and "data file not found" in e for e in df["error"]), list(df["error"])
    assert "0 done, 2 failed" in out


def test_pack_flag_and_key_usage(tmp_path, run_cli):
    path = _sweep_file(tmp_path, PACKED_SWEEP)
    code, out = run_cli("sweep", path, "--dry-run", "--pack", "2", "--results-dir", tmp_path / "r")
    assert code == 0, out
    assert "4 runs in 2 pack(s)" in " ".join(out.split())  # a+b, c+d
    code, out = run_cli("sweep", path, "--pack", "0", "--results-dir", tmp_path / "r")
    assert code == 2 and "--pack 0" in out and "Traceback" not in out
    code, out = run_cli("sweep", path, "--workers", "1", "--results-dir", tmp_path / "r")
    assert code == 2 and "not on a Dask cluster" in out and "drop --workers 1" in out
    bad = _sweep_file(tmp_path, PACKED_SWEEP.replace("pack: 3", "pack: many"), "bad.yaml")
    code, out = run_cli("validate", bad)
    assert code == 2 and "pack='many'" in out


@pytest.mark.slow
def test_sigint_mid_pack_then_resume_repacks_what_is_left(tmp_path, monkeypatch, run_cli):
    """SIGINT while a pack trains: both of its runs are recorded interrupted, the finished run
    stays, the run after is not started; the resumed sweep packs the two again and runs the rest:
    every run once in runs.csv, none lost."""
    path = _sweep_file(tmp_path, "name: pi\nbase:\n" + TINY_BASE + "  trainable_layers: lora\n" + textwrap.dedent(f"""\
        pack: 2
        runs:
          - {{label: quick, batch_size: 4}}
          - {{label: slow1, lora_rank: 2, {UNTIL_SIGNAL}}}
          - {{label: slow2, lora_rank: 4, {UNTIL_SIGNAL}}}
          - {{label: after, seed: 7}}
        """))
    results = tmp_path / "res"
    ids = {r.label: r.run_id for r in load_sweep(path).runs}
    code, out = interrupt_sweep(path, results, tmp_path / "cache", once=results / ids["slow1"] / "job.json",
                                timeout=120)  # into the pack
    assert code == 130, out
    df = _rows(results)
    assert sorted(df["run_id"]) == sorted([ids["quick"], ids["slow1"], ids["slow2"]]), out
    status = dict(zip(df["run_id"], df["status"]))
    assert status == {ids["quick"]: "done", ids["slow1"]: "interrupted", ids["slow2"]: "interrupted"}, out
    assert set(df.set_index("run_id").loc[[ids["slow1"], ids["slow2"]], "pack_size"]) == {"2"}

    import lora_bench.train.run as run_mod

    packs, solos = [], []
    real = run_mod.execute

    def short(points, **kw):  # rerun for real, a few steps only (the ids stay the sweep's)
        if len(points) > 1:
            packs.append([p.run_id for p in points])
        else:
            solos.append(points[0].run_id)
        return real([Point(p.cfg.replace(max_steps=2), p.run_id, p.extra) for p in points], **kw)

    monkeypatch.setattr(run_mod, "execute", short)
    code, out = run_cli("sweep", path, "--results-dir", results, "--cache-dir", tmp_path / "cache",
                        "--isolation", "inline", "--no-progress")
    assert code == 0, out
    assert packs == [[ids["slow1"], ids["slow2"]]] and solos == [ids["after"]]
    df = _rows(results)
    assert len(df) == 4 and df["run_id"].is_unique and set(df["status"]) == {"done"}
    assert "1 skipped" in out


def test_a_pack_point_without_room_leaves_the_others_recorded(tmp_path, monkeypatch, run_cli):
    """The folder takes no steps.csv of the pack's second run: that run is recorded failed (not
    saved in full) and named when the sweep stops; the pack's first and third runs are recorded
    done in full, each tried on its own."""
    import errno
    import os

    from lora_bench import fileio

    path = _sweep_file(tmp_path, "name: pd\nbase:\n" + TINY_BASE + "  trainable_layers: lora\n" + textwrap.dedent("""\
        pack: 3
        runs:
          - {label: a, lora_rank: 2}
          - {label: b, lora_rank: 4}
          - {label: c, lora_rank: 8}
        """))
    ids = {r.label: r.run_id for r in load_sweep(path).runs}
    real = fileio.atomic_write_bytes

    def write(dest, data):
        if dest.name == "steps.csv" and dest.parent.name == ids["b"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dest))
        real(dest, data)

    monkeypatch.setattr(fileio, "atomic_write_bytes", write)
    results = tmp_path / "res"
    code, out = run_cli("sweep", path, "--results-dir", results, "--cache-dir", tmp_path / "cache",
                        "--isolation", "inline", "--no-progress")
    assert code == 4, out
    df = _rows(results).set_index("sweep_label")
    assert dict(df["status"]) == {"a": "done", "b": "failed", "c": "done"}, out
    assert "not saved in full" in df.loc["b", "error"]
    assert (results / ids["a"] / "steps.csv").is_file() and (results / ids["c"] / "steps.csv").is_file()
    assert f"stopped: run {ids['b']} could not be saved in full" in " ".join(out.split())


# -- execution modes ------------------------------------------------------------------------------
BEST_CPU = dict(precision="bf16", attention="sdpa", ops="fused", optimizer="fused")  # best mode less CUDA graphs


def _assert_points_train_as_solo(points, tmp_path, cache_dir, *, solo_mode: dict, dtype, what: str,
                                 ref_mode: dict | None = None) -> list[dict]:
    """Train ``points`` as one pack; each point's losses (per step, then periodic) are as close to
    the float64 evaluation of its solo run (in ``ref_mode``: float32 where the pack runs bf16) as
    another rounding order of its solo run in ``solo_mode`` can be (numerics.same_function_tol, in
    ``dtype``'s units); returns the pack's rows."""
    ids = [f"p{i}" for i in range(len(points))]
    rows = execute([Point(c, i) for c, i in zip(points, ids)], results_dir=tmp_path / "pack",
                   console=Console(quiet=True), progress=False, cache_dir=cache_dir)
    assert [r["status"] for r in rows] == ["done"] * len(points)
    for i, (cfg, run_id) in enumerate(zip(points, ids)):
        want, want_steps = _solo(cfg.replace(**solo_mode), tmp_path, cache_dir, f"s{i}")
        ref, ref_steps = _solo(cfg.replace(**{**solo_mode, **(ref_mode or {})}), tmp_path, cache_dir, f"d{i}",
                               float64_runs())
        got = json.loads((tmp_path / "pack" / run_id / "run.json").read_text())
        got_steps = pd.read_csv(tmp_path / "pack" / run_id / "steps.csv")
        assert list(got_steps["step"]) == list(want_steps["step"]) and len(got_steps) > 1
        assert_same_function(_trajectory(got, got_steps), _trajectory(want, want_steps), _trajectory(ref, ref_steps),
                             dtype=dtype, what=f"{what}: point {i} ({cfg.lora_rank=}, {cfg.learning_rate=}) losses")
    return rows


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_packed_points_train_as_their_solo_runs_in_bf16_with_sdpa_and_fused_ops(tmp_path, cache_dir, variant):
    """bf16 autocast, SDPA, fused LayerNorm and GELU, fused AdamW, of LoRA and of DoRA: each point
    against its solo run in the same mode, within another bf16 rounding order's distance from the
    float64 evaluation of the solo run's float32 function."""
    _assert_points_train_as_solo(cfgs(**BEST_CPU, lora_variant=variant), tmp_path, cache_dir, solo_mode={},
                                 dtype=torch.bfloat16, ref_mode=dict(precision="fp32"),
                                 what=f"bf16, sdpa, fused, {variant}")


def test_packed_points_train_as_their_solo_runs_in_bf16_true(tmp_path, cache_dir):
    """bf16-true: the pack's stacked adapters in bfloat16, its packed AdamW over float32 master copies
    (train.master_weights), as each solo run's AdamW is; each point within another bf16 rounding
    order's distance of the float64 evaluation of its solo run's float32 function."""
    from lora_bench.train.build import build_model, build_optimizer
    from lora_bench.train.master_weights import MasterWeights

    points = cfgs(precision="bf16-true")
    built = build_model(points, torch.device("cpu"), cache_dir=cache_dir, progress=False)
    trainable = [t for t in built.model.parameters() if t.requires_grad]
    assert trainable and {t.dtype for t in trainable} == {torch.bfloat16}
    opt = build_optimizer(built.model, points)
    assert isinstance(opt, MasterWeights) and {m.dtype for m in opt.masters} == {torch.float32}
    assert [m.shape for m in opt.masters] == [t.shape for t in trainable]  # each stacked: every point's slice
    rows = _assert_points_train_as_solo(points, tmp_path, cache_dir, solo_mode={}, dtype=torch.bfloat16,
                                        ref_mode=dict(precision="fp32"), what="bf16-true")
    assert all(r["cfg_precision"] == "bf16-true" for r in rows)


@pytest.mark.slow
def test_compiled_packed_points_train_as_their_solo_runs(tmp_path, cache_dir):
    """torch.compile (each block, as compile_scope=blocks compiles it) on the pack's model: each
    point against its eager solo run (the compiled kernels: another rounding order)."""
    points = cfgs(POINTS[:2], num_epochs=1, max_steps=3, eval_freq=0, skip_final_eval=True, compile=True,
                  compile_scope="blocks")
    _assert_points_train_as_solo(points, tmp_path, cache_dir, solo_mode=dict(compile=False, compile_scope="model"),
                                 dtype=torch.float32, what="compiled")


def test_modes_pack_and_the_reasons_to_train_alone_stay(tmp_path, cache_dir):
    """Compile and CUDA graphs pack (nothing tells such a run to train alone); what cannot pack still
    says why."""
    from lora_bench.config import solo_reason

    best = TrainConfig(**{**BASE, **BEST_CPU, "device": "cuda", "cuda_graphs": True})
    assert solo_reason(best) is None and solo_reason(best.replace(compile=True)) is None
    assert pack_problem([best, best.replace(lora_rank=16, learning_rate=1e-4)]) is None
    assert "lora-kernel" in solo_reason(best.replace(trainable_layers="lora-kernel"))
    assert "differs from run 1 in compile" in pack_problem([best, best.replace(compile=True)])
    eager = best.replace(cuda_graphs=False)
    assert all(solo_reason(eager.replace(profile=p)) is None for p in ("line", "torch", "kernels"))
    profiled = eager.replace(profile="kernels")
    assert "differs from run 1 in profile" in pack_problem([profiled, eager.replace(lora_rank=4)])


# -- profiles -------------------------------------------------------------------------------------
def test_a_packed_sweeps_profile_is_the_packs_step_in_every_points_folder(tmp_path, run_cli):
    """profile=kernels on a packed sweep: each point's folder has the pack's kernel summaries
    (one profile of the pack's step, marked with its pack_size), counting the top-level aten ops
    of every phase; and the points train as the unprofiled pack's do, bit for bit (a profiler
    only watches)."""
    body = ("name: pp\nbase:\n" + TINY_BASE.replace("max_steps: 2", "max_steps: 3") + "  trainable_layers: lora\n"
            + "{profile}grid:\n  lora_rank: [2, 4]\n")
    out = {}
    for profile in ("none", "kernels"):
        path = _sweep_file(tmp_path, body.format(profile=f"  profile: {profile}\n"), f"{profile}.yaml")
        results = tmp_path / profile
        code, text = run_cli("sweep", path, "--pack", "2", "--results-dir", results, "--cache-dir", tmp_path / "cache",
                             "--isolation", "inline", "--no-progress")
        assert code == 0, text
        out[profile] = (results, _rows(results).set_index("cfg_lora_rank"))
    (plain, plain_rows), (profiled, rows) = out["none"], out["kernels"]
    assert set(rows["pack_size"]) == {"2"} and rows["pack_id"].nunique() == 1 and set(rows["status"]) == {"done"}
    summaries = []
    for rank, row in rows.iterrows():
        folder = profiled / row["run_id"]
        kernels = pd.read_csv(folder / "kernels_by_phase.csv").set_index("phase")
        assert {"data", "forward", "backward", "optimizer"} <= set(kernels.index), rank
        assert (kernels.loc[["data", "forward", "backward", "optimizer"], "launches_per_step"] > 0).all(), rank
        assert set(kernels["pack_size"]) == {2} and set(kernels["unit"]) == {"top-level aten ops (CPU)"}
        assert set(pd.read_csv(folder / "top_kernels.csv")["pack_size"]) == {2}
        summaries.append((folder / "kernels_by_phase.csv").read_bytes())
        assert not (plain / plain_rows.loc[rank, "run_id"] / "kernels_by_phase.csv").exists()
        want = plain / plain_rows.loc[rank, "run_id"]
        got_steps = pd.read_csv(folder / "steps.csv", dtype=str)["loss"]
        assert len(got_steps) == 3 and list(got_steps) == list(pd.read_csv(want / "steps.csv", dtype=str)["loss"])
        got, ref = (json.loads((f / "run.json").read_text()) for f in (folder, want))
        assert got["train_accs"] == ref["train_accs"] and got["val_accs"] == ref["val_accs"]
    assert summaries[0] == summaries[1]  # one profile: the pack's


def test_a_line_profile_of_a_pack_follows_the_packs_loop(tmp_path, cache_dir):
    points = cfgs(POINTS[:2], profile="line", max_steps=3, eval_freq=0, skip_final_eval=True)
    execute([Point(c, f"p{i}") for i, c in enumerate(points)], results_dir=tmp_path,
            console=Console(quiet=True), progress=False, cache_dir=cache_dir)
    texts = [(tmp_path / f"p{i}" / "line_profile.txt").read_text() for i in range(len(points))]
    assert texts[0] == texts[1]
    assert "Function: train_classifier" in texts[0] and "Function: point_losses" in texts[0]
    assert "obj.objective(loss).backward()" in texts[0] and "F.cross_entropy(per_point[p]" in texts[0]


def test_a_pack_is_not_line_profiled_under_cuda_graphs(tmp_path, cache_dir, run_cli):
    """As a solo run: line_profiler sees no Python lines inside a replayed graph, so the pack is
    refused before anything is recorded, and a sweep file that asks for it does not validate."""
    from lora_bench.errors import ConfigError

    points = cfgs(POINTS[:2], device="cuda", cuda_graphs=True, profile="line")
    with pytest.raises(ConfigError, match="profile=line cannot see inside a replayed CUDA graph"):
        execute([Point(c, f"p{i}") for i, c in enumerate(points)], results_dir=tmp_path / "r",
                console=Console(quiet=True), progress=False, cache_dir=cache_dir)
    assert not (tmp_path / "r").exists()
    path = _sweep_file(tmp_path, "name: pg\nbase:\n" + TINY_BASE.replace("device: cpu", "device: cuda")
                       + "  trainable_layers: lora\n  cuda_graphs: true\n  profile: line\npack: 2\n"
                       + "grid:\n  lora_rank: [2, 4]\n")
    code, out = run_cli("validate", path)
    assert code == 2 and "profile=line cannot see inside a replayed CUDA graph" in " ".join(out.split()), out
    assert "Traceback" not in out


# -- GPU (marked; run on the device) ---------------------------------------------------------------
BEST = dict(device="cuda", cuda_graphs=True, precision="bf16", attention="sdpa", ops="fused", optimizer="fused")


@pytest.mark.gpu
@pytest.mark.parametrize("compiled, precision, variant", [(False, "bf16", "lora"), (True, "bf16", "lora"),
                                                       (False, "bf16-true", "lora"), (False, "bf16", "dora")])
def test_packed_points_train_as_their_solo_runs_in_best_mode_on_cuda(tmp_path, cache_dir, compiled, precision,
                                                                     variant):
    """Best mode (CUDA graphs, bf16 or bf16-true, SDPA, fused ops, fused AdamW; and torch.compile), of
    LoRA and of DoRA (PackedDoRALinear, its norms formed in the captured step): each point's
    per-step and periodic losses against its solo run in the same mode (compiled: the same mode
    less torch.compile, another rounding order), within another bf16
    rounding order's distance from the float64 evaluation of the solo run's eager float32
    function (its periodic losses come from graph-replayed evaluations); the pack's rows carry the
    captured graphs' columns and the final accuracies, also from replayed forwards."""
    mode = {**BEST, "precision": precision, "lora_variant": variant}
    if compiled:  # two points, one epoch; the solo runs eager: compiling each run costs tens of seconds
        points = cfgs(POINTS[:2], **mode, compile=True, num_epochs=1, eval_freq=3, skip_final_eval=False)
        solo_mode = dict(compile=False)
    else:
        points, solo_mode = cfgs(**mode, skip_final_eval=False), {}
    rows = _assert_points_train_as_solo(points, tmp_path, cache_dir, solo_mode=solo_mode, dtype=torch.bfloat16,
                                        ref_mode=dict(precision="fp32", cuda_graphs=False, compile=False),
                                        what=f"best mode, {precision}, {variant}" + (", compiled" if compiled else ""))
    for row in rows:
        assert row["graph_capture_s"] > 0 and row["graph_kernels_forward"] > 0 and row["graph_kernels_optimizer"] >= 1
        assert all(0 <= row[f"{name}_acc"] <= 100 for name in ("train", "val", "test"))


def test_the_graphed_pack_steps_forward_and_objective_are_the_eager_steps(cache_dir):
    """What GraphedStep captures for a pack — its forward (the points' losses on the stacked batch)
    and its objective (their sum) — run eagerly on the CPU as the loop's step function, trains the
    pack as the loop's own eager step does, bit for bit (the same operations on the same values);
    and the loop's evaluations call ``eval_model``."""
    from lora_bench.timing import PhaseTimer
    from lora_bench.train.context import RunContext
    from lora_bench.train.graphs import GraphedStep
    from lora_bench.train.loop import train_classifier

    class EagerGraphStep(GraphedStep):  # the captured phases, run as they are captured
        def __call__(self, inputs, targets, update, timer):
            self.static_in, self.static_tgt = inputs, targets
            self.optimizer.zero_grad(set_to_none=True)
            loss = self._forward()
            timer.mark("forward")
            self._objective(loss).backward()
            timer.mark("backward")
            self.optimizer.step()
            timer.mark("optimizer")
            return loss.detach().clone()

    points = cfgs(max_steps=5, eval_freq=2)
    results = []
    for graphed in (False, True):
        ctx = RunContext(points, cache_dir=cache_dir, progress=False)
        timer = PhaseTimer(ctx.cfg.timing, ctx.device, warmup_steps=ctx.cfg.warmup_steps)
        calls = []

        def ev(x, model=ctx.forward_model):
            calls.append(x.shape)
            return model(x)

        ev.eval, ev.train = ctx.forward_model.eval, ctx.forward_model.train
        step_fn = EagerGraphStep(ctx, timer=timer) if graphed else None
        res = train_classifier(ctx.forward_model, ctx.loaders.train, ctx.loaders.val, ctx.optimizer, ctx.device,
                               settings=ctx.loop_settings(), timer=timer, points=len(points), step_fn=step_fn,
                               eval_model=ev)
        assert calls and all(s[0] % len(points) == 0 for s in calls)  # evaluations: the stacked batch, through ev
        results.append(res)
    eager, graphed = results
    assert eager.steps == graphed.steps == 5
    assert torch.equal(torch.stack(eager.step_losses), torch.stack(graphed.step_losses))
    assert eager.train_losses == graphed.train_losses and eager.val_losses == graphed.val_losses
    assert len(set(eager.point_step_losses()[0])) > 1  # the points trained: their losses moved
