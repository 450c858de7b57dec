"""DoRA's norms formed ahead (:mod:`lora_bench.kernels.dora_ahead`, ``dora_norm_launch: ahead``).

Under Triton's CPU interpreter: the norm alone (``dora_norm``) then the scale alone (``dora_scale``)
give ``dora_forward``'s outputs bit for bit (the same sums in the same order), one layer and three
side by side, with a bias and without; a tiny GPT-2 classifier of fused DoRA layers, query, key and
value grouped, gives with its norms formed ahead the loss and every gradient of the same model with
its norms inline, bit for bit, exact and detached norm, every norm formed once and used once; a
parameter changed after its norm was formed (by a hook inside the forward) is not used stale: the
layer forms its own and the result is still the inline model's; under the fused plan every call's LoRA
GEMM scales its output in its epilogue (``lora_fwd_scaled``, which gives ``lora_fwd`` then
``dora_scale``'s y, z and h bit for bit), no scale launched apart. The setting's rules and its column.
GPU (``-m gpu``): GPT-2-shaped blocks under bfloat16 autocast, eager and captured in CUDA graphs
(forward and backward, the norms on the side stream inside the captured forward), replayed on fresh
batches, against the inline model: the loss and the input gradients bit for bit (no atomics on their
path), A's and B's gradients within float32's bound for their sums over the rows (their split sums
add with atomics, in an order that varies)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from numerics import dot_tol, fresh, interpreted_runs, rel_err

# (out per layer, in, r, layers side by side, rows, dtype, bias)
SPLIT_CASES = [(53, 37, 7, 1, 9, "fp32", True), (48, 40, 16, 3, 17, "fp32", False), (33, 100, 3, 1, 5, "fp16", True),
               (32, 29, 64, 3, 1, "fp16", True)]
DTYPE = {"fp32": torch.float32, "fp16": torch.float16}


def _split_case(out: int, k: int, r: int, S: int, rows: int, dt: str, bias: bool) -> dict[str, bool]:
    from lora_bench.kernels import dora_triton

    dtype = DTYPE[dt]
    w = fresh(S * out, k, device="cpu", dtype=dtype, scale=k ** -0.5)
    a = fresh(S, k, r, device="cpu", dtype=dtype, scale=k ** -0.5)
    b = fresh(S, r, out, device="cpu", dtype=dtype, scale=r ** -0.5)
    if S == 1:
        a, b = a[0], b[0]
    m = (torch.rand(S * out) + 0.5).to(dtype)
    z = fresh(rows, S * out, device="cpu", dtype=dtype)
    bb = fresh(S * out, device="cpu", dtype=torch.float32) if bias else None
    y, *norm = dora_triton.dora_forward(z, w, a, b, m, bb, 1.5)
    outs = dora_triton.norm_outputs(w, r)
    dora_triton.dora_norm(w, a, b, m, 1.5, outs)
    y2 = dora_triton.dora_scale(z, outs[1], bb)
    names = ("y", "n", "g", "cn", "vt")
    return {name: bool(torch.equal(p, q)) for name, p, q in zip(names, (y, *norm), (y2, *outs))}


# the LoRA GEMM scaled in its epilogue: (rows, out per layer, in, r, layers side by side, dtype, bias)
EPILOGUE_CASES = [(37, 53, 41, 7, 1, "fp32", True), (17, 48, 40, 16, 3, "fp32", False), (5, 33, 100, 3, 1, "fp16", True),
                  (9, 32, 29, 64, 2, "fp16", True)]


def _epilogue_case(rows: int, out: int, k: int, r: int, S: int, dt: str, bias: bool) -> dict[str, bool]:
    """``lora_fwd_scaled`` (one launch) against ``lora_fwd`` then ``dora_scale`` (two): y, z and h."""
    from lora_bench.kernels import dora_triton, lora_triton, lora_triton_scaled

    dtype = DTYPE[dt]
    x = fresh(rows, k, device="cpu", dtype=dtype)
    w = fresh(S * out, k, device="cpu", dtype=dtype, scale=k ** -0.5)
    a = fresh(*((S,) if S > 1 else ()), k, r, device="cpu", dtype=dtype, scale=k ** -0.5)
    b = fresh(*((S,) if S > 1 else ()), r, out, device="cpu", dtype=dtype, scale=r ** -0.5)
    g = torch.rand(S * out) + 0.5
    bb = fresh(S * out, device="cpu", dtype=torch.float32) if bias else None
    lora_triton.POISON_OUTPUTS = True
    try:
        if S > 1:
            y, z, h = lora_triton_scaled.lora_fwd_scaled_segments(x, w, a, b, g, bb, 1.5)
            z2, h2 = lora_triton.lora_fwd_segments(x, w, a, b, None, 1.5)
        else:
            y, z, h = lora_triton_scaled.lora_fwd_scaled(x, w, a, b, g, bb, 1.5)
            z2, h2 = lora_triton.lora_fwd(x, w, a, b, None, 1.5)
        y2 = dora_triton.dora_scale(z2, g, bb)
    finally:
        lora_triton.POISON_OUTPUTS = False
    return {name: bool(torch.equal(p, q)) for name, p, q in (("y", y, y2), ("z", z, z2), ("h", h, h2))}


def _classifier(norm: str, ahead: bool, seed: int):
    """The tiny classifier of fused DoRA layers (``norm``), query, key and value grouped, its adapters
    and magnitudes moved off their start by the same draws for every ``ahead``; ahead: its norms formed
    ahead (``install_norms_ahead``). Returns (model, how many norms form per forward)."""
    from lora_bench.classifier.book import build_classifier
    from lora_bench.config import TrainConfig
    from lora_bench.lora.kernel import group_qkv, install_norms_ahead

    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora-kernel", lora_variant="dora",
                      dora_norm=norm, device="cpu")
    torch.manual_seed(seed)
    model = build_classifier(cfg, cache_dir=None)
    assert group_qkv(model) == 2
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    units = install_norms_ahead(model) if ahead else 0
    return model, units


def _model_run(model, idx, target) -> dict:
    """The loss and the gradients of every trainable parameter, under the fused plan (the grouped
    layers' path), and the plan log's DoRA notes."""
    from lora_bench.kernels.policy import Plan, PlanPolicy, record_plans, use_policy

    from lora_bench.kernels import triton_launch

    params = [p for p in model.parameters() if p.requires_grad]
    with use_policy(PlanPolicy(forced=Plan.FUSED)), record_plans() as log:
        with triton_launch.recording() as fwd:
            loss = nn.functional.cross_entropy(model(idx)[:, -1, :], target)
        grads = torch.autograd.grad(loss, params)
    return {"loss": loss, "grads": grads, "dora": sorted(log.dora), "forward": [rec[0] for rec in fwd]}


def _model_case(norm: str, stale: bool) -> dict:
    """The tiny classifier with its norms ahead against inline: whether the loss and every gradient
    are equal, and how many norms were formed and used. ``stale``: a hook on the first block's
    attention changes its value layer's m (in both models) after the norms were formed."""
    from lora_bench.kernels import dora_ahead

    inline, _ = _classifier(norm, False, 3)
    ahead, units = _classifier(norm, True, 3)
    if stale:
        for model in (inline, ahead):
            att = next(m for m in model.modules() if hasattr(m, "qkv"))
            att.register_forward_pre_hook(lambda mod, args: _bump(mod))
    idx = torch.randint(0, 50257, (2, 7))
    target = torch.tensor([0, 1])
    want = _model_run(inline, idx, target)
    before = dict(dora_ahead.COUNTS)
    got = _model_run(ahead, idx, target)
    counts = {k: dora_ahead.COUNTS[k] - before[k] for k in before}
    return dict(norm=norm, stale=stale, units=units, counts=counts, dora=got["dora"], forward=got["forward"],
                loss=bool(torch.equal(got["loss"], want["loss"])),
                grads=[bool(torch.equal(p, q)) for p, q in zip(got["grads"], want["grads"])])


def _bump(att) -> None:
    """Change the value layer's m in place, as an autograd-visible write (its version moves)."""
    with torch.no_grad():
        att.W_value.m.mul_(1.01)


def _interp_main() -> None:
    """Run with TRITON_INTERPRET=1: one JSON line per split case and per model case."""
    for i, case in enumerate(SPLIT_CASES):
        print(json.dumps(dict(split_case=i, equal=_split_case(*case))), flush=True)
    for i, case in enumerate(EPILOGUE_CASES):
        print(json.dumps(dict(epilogue_case=i, equal=_epilogue_case(*case))), flush=True)
    for norm in ("exact", "detached"):
        for stale in (False, True):
            print(json.dumps(dict(model_case=True, **_model_case(norm, stale))), flush=True)


@pytest.fixture(scope="module")
def interp_runs():
    runs = interpreted_runs(__file__)
    assert len(runs) == len(SPLIT_CASES) + len(EPILOGUE_CASES) + 4, runs
    return runs


@pytest.mark.parametrize("i", range(len(SPLIT_CASES)))
def test_the_norm_then_the_scale_give_the_one_launch_outputs_under_the_triton_interpreter(interp_runs, i):
    (run,) = [r for r in interp_runs if r.get("split_case") == i]
    assert all(run["equal"].values()), run


@pytest.mark.parametrize("i", range(len(EPILOGUE_CASES)))
def test_the_lora_gemm_scaled_in_its_epilogue_gives_the_two_launch_outputs_under_the_triton_interpreter(interp_runs, i):
    (run,) = [r for r in interp_runs if r.get("epilogue_case") == i]
    assert all(run["equal"].values()), run


def test_a_model_with_its_norms_ahead_computes_what_it_computes_inline_under_the_triton_interpreter(interp_runs):
    runs = [r for r in interp_runs if r.get("model_case") and not r["stale"]]
    assert {r["norm"] for r in runs} == {"exact", "detached"}
    for run in runs:
        # two grouped blocks (one norm each), two attention outputs, four MLP layers, the head
        assert run["units"] == 2 + 2 + 4 + 1, run
        assert run["counts"] == {"formed": run["units"], "used": run["units"]}, run
        assert run["loss"] and run["grads"] and all(run["grads"]), run
        assert "triton: the norm formed ahead" in run["dora"], run
        # under the fused plan every call's LoRA GEMM scales its output: no scale launched apart
        assert "triton: the norm formed ahead, the scale in the LoRA GEMM" in run["dora"], run
        assert run["forward"].count("mm_scale") == run["units"] and "dora_scale" not in run["forward"], run


def test_a_norm_whose_parameters_changed_is_not_used_under_the_triton_interpreter(interp_runs):
    runs = [r for r in interp_runs if r.get("model_case") and r["stale"]]
    assert len(runs) == 2
    for run in runs:
        assert run["counts"] == {"formed": run["units"], "used": run["units"] - 1}, run
        assert run["loss"] and all(run["grads"]), run


def test_the_setting_is_refused_where_it_would_do_nothing():
    from lora_bench.config.declaration import DEFAULTS
    from lora_bench.config.setting_rules import settings_problems

    def problems(**kw):
        base = dict(DEFAULTS, trainable_layers="lora-kernel", lora_variant="dora")
        return [p.render() for p in settings_problems({**base, **kw})]

    assert problems(dora_norm_launch="ahead") == []
    assert any("dora_norm_launch=ahead is only used with lora_variant=dora" in p
               for p in problems(dora_norm_launch="ahead", lora_variant="lora"))
    assert any("only used with trainable_layers=lora-kernel" in p
               for p in problems(dora_norm_launch="ahead", trainable_layers="lora"))
    assert any("with compile is refused" in p for p in problems(dora_norm_launch="ahead", compile=True))
    assert any("dora_norm_launch" in p and "ahead" in p and "inline" in p for p in problems(dora_norm_launch="soon"))


def test_the_command_line_takes_it_and_records_it(run_cli, tmp_path):
    """``--dora-norm-launch ahead`` trains a tiny run on the CPU (torch ops there: nothing is formed
    ahead, the run is the inline run) and is recorded, with where its norms formed and why
    (``dora_norms``); a bad value exits 2 naming the allowed ones."""
    import pandas as pd
    from tiny import SAMPLE

    args = ["train", "--device", "cpu", "--weights", "random", "--model-size", "tiny", "--data-file", SAMPLE,
            "--trainable-layers", "lora-kernel", "--lora-variant", "dora", "--num-epochs", "1", "--max-steps", "2",
            "--warmup-steps", "1", "--eval-freq", "0", "--skip-final-eval"]
    code, out = run_cli(*args, "--dora-norm-launch", "ahead", "--results-dir", tmp_path)
    assert code == 0, out
    row = pd.read_csv(tmp_path / "runs.csv").iloc[0]
    assert row["status"] == "done" and row["cfg_dora_norm_launch"] == "ahead"
    assert row["dora_norms"] == "torch: the CPU", row["dora_norms"]
    code, out = run_cli(*args, "--dora-norm-launch", "later", "--results-dir", tmp_path / "bad")
    assert code == 2 and "later" in out and "ahead" in out and "Traceback" not in out


# ----------------------------------------------------------------------------------- GPU
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_model(norm: str, ahead: bool, size: str):
    """A random-weights GPT-2 classifier of fused DoRA layers on the GPU (``size``: tiny, or 124M's
    widths with 2 blocks), query, key and value grouped, frozen weights in bf16 as best mode keeps
    them; adapters and magnitudes moved off their start by the same draws; ahead: norms formed ahead."""
    from lora_bench.classifier.book import build_classifier
    from lora_bench.config import TrainConfig
    from lora_bench.lora.kernel import group_qkv, install_norms_ahead

    extra = {} if size == "tiny" else {"n_layers": 2}
    cfg = TrainConfig(model_size=size, weights="random", trainable_layers="lora-kernel", lora_variant="dora",
                      dora_norm=norm, device="cuda", **extra)
    torch.manual_seed(5)
    model = build_classifier(cfg, cache_dir=None)
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and not mod.weight.requires_grad:
            mod.to(torch.bfloat16)
    model.cuda()
    assert group_qkv(model) > 0
    gen = torch.Generator(device="cuda").manual_seed(6)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen, device="cuda", dtype=p.dtype))
    if ahead:
        assert install_norms_ahead(model) > 0
    return model


def _gpu_step(model, idx, target):
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        loss = nn.functional.cross_entropy(model(idx)[:, -1, :].float(), target)
    return (loss, *torch.autograd.grad(loss, params))


def _gpu_compare(got, want, rows: int, names) -> None:
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    bound = dot_tol(torch.float32, rows)
    for name, p, q in zip(names, got[1:], want[1:]):
        if name.endswith(("lora.A", "lora.B")):  # summed over the rows with atomics
            assert rel_err(p, q) <= bound, (name, rel_err(p, q), bound)
        else:
            assert torch.equal(p, q), name


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("norm", ["exact", "detached"])
@pytest.mark.parametrize("size", ["tiny", "124M"])
def test_gpu_norms_ahead_eager_and_replayed_from_cuda_graphs(norm, size):
    from lora_bench.kernels import dora_ahead
    from lora_bench.kernels.policy import Plan, PlanPolicy, use_policy
    from lora_bench.train.graphs import warm_up

    inline, ahead = _gpu_model(norm, False, size), _gpu_model(norm, True, size)
    names = [n for n, p in ahead.named_parameters() if p.requires_grad]
    rows = 8 * 120
    batch = lambda: (torch.randint(0, 50257, (8, 120), device="cuda"), torch.randint(0, 2, (8,), device="cuda"))
    with use_policy(PlanPolicy(forced=Plan.FUSED)):
        idx, target = batch()
        before = dora_ahead.COUNTS["used"]
        _gpu_compare(_gpu_step(ahead, idx, target), _gpu_step(inline, idx, target), rows, names)
        assert dora_ahead.COUNTS["used"] > before
        static_idx, static_target = idx.clone(), target.clone()
        warm_up(lambda: _gpu_step(ahead, static_idx, static_target), 2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _gpu_step(ahead, static_idx, static_target)
        for _ in range(3):
            idx, target = batch()
            static_idx.copy_(idx)
            static_target.copy_(target)
            for t in outs:
                t.fill_(float("nan"))
            graph.replay()
            _gpu_compare([t.clone() for t in outs], _gpu_step(inline, idx, target), rows, names)
