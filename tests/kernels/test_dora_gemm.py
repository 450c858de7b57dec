"""DoRA's norm formed in the LoRA GEMM (``dora_norm_launch: gemm``; ``lora_triton.dora_fwd`` and
``dora_fwd_segments``, ``kernels.dora.GemmNorm``).

Under Triton's CPU interpreter: the one-launch kernel (z, h, and from the GEMM's own W and A tiles n,
g, cn, vᵀ and y = g ⊙ z + b) on fresh random operands of odd shapes (K tails, rows and columns past
the last tile), ranks 1 to 64, one layer and three side by side, float32 and float16 operands and bf16
mode's mix (a 16-bit W and x, A rounded to their dtype by the caller, B, m and the bias float32, read
unrounded), outputs NaN-poisoned, against float64 on the same values; z and h equal to the LoRA GEMM's
own bit for bit. A tiny GPT-2 classifier of fused DoRA layers, query, key and value grouped, under the
fused plan: its forward launches one kernel per layer (the head, whose W is trained, forms its norm
inline and the plan log says why), and its loss and every gradient lie as close to the same model in
float64 as the inline model's do (``same_function_tol``: only the norm's order of sums differs). The
command line (the setting's rules: tests/kernels/test_dora_ahead.py). GPU (``-m gpu``): the kernel at GPT-2 124M's and 1558M's shapes
in bfloat16 against float64; a 124M-wide model under bf16 autocast, eager and replayed from a CUDA
graph on fresh batches, against the inline model (the same bound, the float64 model as reference).

Tolerances (tests/numerics.py): z and h as the LoRA kernel's (``kernel_tol``'s derivations: float32
``dot_tol`` over k + r + 2 terms, 16-bit ``rounded_input_tol`` with x·A, B and the output rounded);
n, g, cn, vᵀ and y as the two-launch kernel's, whose chains these sums repeat (tests/kernels/
test_dora_norm.py, ``_fwd_bounds``), y against float64 from the kernel's own (rounded) z.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
from numerics import assert_within, dot_tol, fresh, interpreted_runs, rel_err, rounded_input_tol, same_function_tol

DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "fp16w": torch.float16}
NAMES = ("y", "z", "h", "n", "g", "cn", "vt")
# (rows, out per layer, in, r, layers side by side, dtype, bias): odd sizes, K tails, 32 × 32 tiles
# in the interpreter (rows and outputs past the last tile), ranks 1 to 64 (S·r up to the kernels' 128)
CASES = [(37, 53, 41, 7, 1, "fp32", True), (5, 33, 100, 3, 1, "fp32", False), (64, 70, 45, 64, 1, "fp16", True),
         (17, 48, 40, 16, 3, "fp32", False), (9, 32, 29, 1, 3, "fp16w", True), (40, 96, 64, 16, 1, "fp16w", True),
         (33, 16, 70, 33, 3, "fp32", True)]
SCALE = 1.5


def _operands(rows, out, k, r, S, dt, bias):
    """x, W (S·out × k) and A in the compute dtype; B, m, the bias in it too, or float32 in bf16
    mode's mix (``fp16w``); ‖W_j‖² in float32."""
    dtype = DTYPE[dt]
    adt = torch.float32 if dt == "fp16w" else dtype
    x = fresh(rows, k, device="cpu", dtype=dtype)
    w = fresh(S * out, k, device="cpu", dtype=dtype, scale=k ** -0.5)
    a = fresh(*((S,) if S > 1 else ()), k, r, device="cpu", dtype=dtype, scale=k ** -0.5)
    b = fresh(*((S,) if S > 1 else ()), r, out, device="cpu", dtype=adt, scale=r ** -0.5)
    m = (torch.rand(S * out) + 0.5).to(adt)
    bb = fresh(S * out, device="cpu", dtype=adt) if bias else None
    return x, w, a, b, m, w.float().pow(2).sum(1), bb


def _float64(x, w, a, b, m, bias, z, S):
    """z, h, n, g, cn, vᵀ of the layers in float64 on the same values, and y from the kernel's z."""
    X, W, A, B, M = (t.double() for t in (x, w, a, b, m))
    As, Bs = (A, B) if S > 1 else (A[None], B[None])
    out = B.shape[-1]
    parts = {"z": [], "h": [], "n": [], "vt": []}
    for i in range(S):
        Wi = W[i * out:(i + 1) * out]
        parts["h"].append(X @ As[i])
        parts["z"].append(X @ Wi.t() + SCALE * (X @ As[i]) @ Bs[i])
        parts["n"].append((Wi + SCALE * (As[i] @ Bs[i]).t()).norm(dim=1))
        parts["vt"].append((2 * SCALE * (Wi @ As[i]) + 2 * SCALE ** 2 * (Bs[i].t() @ (As[i].t() @ As[i]))).t())
    want = {name: torch.cat(v, 1 if name in ("z", "h", "vt") else 0) for name, v in parts.items()}
    want["g"] = M / want["n"]
    want["cn"] = -M / (2 * want["n"] ** 3)
    want["y"] = z.double() * want["g"] + (0 if bias is None else bias.double())
    return want


def _kernel_case(rows, out, k, r, S, dt, bias) -> dict:
    from lora_bench.kernels import lora_triton

    x, w, a, b, m, wsq, bb = _operands(rows, out, k, r, S, dt, bias)
    lora_triton.POISON_OUTPUTS = True
    try:
        fwd = lora_triton.dora_fwd_segments if S > 1 else lora_triton.dora_fwd
        got = dict(zip(NAMES, fwd(x, w, a, b, m, wsq, bb, SCALE, exact=True)))
        detached = fwd(x, w, a, b, m, wsq, bb, SCALE, exact=False)
        lora = lora_triton.lora_fwd_segments if S > 1 else lora_triton.lora_fwd
        z, h = lora(x, w, a, b.to(x.dtype), None, SCALE)
    finally:
        lora_triton.POISON_OUTPUTS = False
    want = _float64(x, w, a, b, m, bb, got["z"], S)
    return dict(errs={name: rel_err(got[name], want[name]) for name in NAMES},
                dtypes={name: str(got[name].dtype) for name in NAMES},
                same_as_lora=bool(torch.equal(got["z"], z) and torch.equal(got["h"], h)),
                detached_same=[bool(torch.equal(p, q)) for p, q in zip(detached[:5], (got[n] for n in NAMES[:5]))],
                detached_none=detached[5] is None and detached[6] is None)


def _bounds(k: int, r: int, dt: str, S: int) -> dict[str, float]:
    """The module docstring's: z and h over the LoRA chain, the norm's outputs over the two-launch
    kernel's chains (r: the rank S layers side by side hold, R = S·r, in AᵀA's sums)."""
    dtype = DTYPE[dt]
    R = S * r
    chains = {"n": k + 2 * R + 4, "g": k + 2 * R + 5, "cn": k + 2 * R + 7, "vt": k + R + 2, "y": k + 2 * R + 7}
    bounds = {name: dot_tol(torch.float32, chain) for name, chain in chains.items()}
    if dtype is torch.float32:
        bounds.update(z=dot_tol(torch.float32, k + r + 2), h=dot_tol(torch.float32, k))
    else:
        bounds["y"] += rounded_input_tol(dtype, 1)
        # h: one rounding; z: x·A rounded, B rounded in the product (the mix), the output rounded
        bounds.update(z=rounded_input_tol(dtype, 3 + (dt == "fp16w")), h=rounded_input_tol(dtype, 1))
    return bounds


def _classifier(norm: str, gemm: bool, seed: int):
    """The tiny classifier of fused DoRA layers (``norm``), query, key and value grouped, its adapters
    and magnitudes moved off their start by the same draws; ``gemm``: its norms formed in the GEMM."""
    from lora_bench.classifier.book import build_classifier
    from lora_bench.config import TrainConfig
    from lora_bench.lora.kernel import form_norms_in_gemm, group_qkv

    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora-kernel", lora_variant="dora",
                      dora_norm=norm, device="cpu")
    torch.manual_seed(seed)
    model = build_classifier(cfg, cache_dir=None)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    f64 = copy.deepcopy(model).double()  # ungrouped, torch ops: the reference
    assert group_qkv(model) == 2
    if gemm:
        assert form_norms_in_gemm(model) == 13  # 4 per block and the head
    return model, f64


def _model_run(model, idx, target, fused: bool = True) -> dict:
    """The loss and the gradients of every trainable parameter (under the fused plan where
    ``fused``), the Triton launches of the forward and the plan log's DoRA notes."""
    from lora_bench.kernels import triton_launch
    from lora_bench.kernels.policy import Plan, PlanPolicy, record_plans, use_policy

    params = [p for p in model.parameters() if p.requires_grad]
    with use_policy(PlanPolicy(forced=Plan.FUSED if fused else None)), record_plans() as log:
        with triton_launch.recording() as fwd:
            loss = nn.functional.cross_entropy(model(idx)[:, -1, :], target)
        grads = torch.autograd.grad(loss, params)
    return {"loss": loss, "grads": grads, "dora": sorted(log.dora), "forward": [rec[0] for rec in fwd]}


def _model_case(norm: str) -> dict:
    """The tiny classifier with its norms in the GEMM and inline, against its float64 copy: each
    one's root-mean-square relative error over the loss and the gradients, and the launches."""
    from numerics import rms_rel_err

    gemm, f64 = _classifier(norm, True, 3)
    inline, _ = _classifier(norm, False, 3)
    idx = torch.randint(0, 50257, (2, 7))
    target = torch.tensor([0, 1])
    got, want = _model_run(gemm, idx, target), _model_run(inline, idx, target)
    ref = _model_run(f64, idx, target, fused=False)

    def flat(run):
        return {"loss": run["loss"], **{f"g{i}": t for i, t in enumerate(run["grads"])}}

    return dict(norm=norm, dora=got["dora"], forward=got["forward"], inline_forward=want["forward"],
                err=rms_rel_err(flat(got), flat(ref)),
                bound=same_function_tol(flat(want), flat(ref)))


def _interp_main() -> None:
    """Run with TRITON_INTERPRET=1: one JSON line per kernel case and per model case."""
    for i, case in enumerate(CASES):
        print(json.dumps(dict(kernel_case=i, **_kernel_case(*case))), flush=True)
    for norm in ("exact", "detached"):
        print(json.dumps(dict(model_case=True, **_model_case(norm))), flush=True)


@pytest.fixture(scope="module")
def interp_runs():
    runs = interpreted_runs(__file__)
    assert len(runs) == len(CASES) + 2, runs
    return runs


@pytest.mark.parametrize("i", range(len(CASES)))
def test_the_one_launch_kernel_against_float64_under_the_triton_interpreter(interp_runs, i):
    rows, out, k, r, S, dt, bias = CASES[i]
    (run,) = [r_ for r_ in interp_runs if r_.get("kernel_case") == i]
    want_dt = str(DTYPE[dt])
    assert run["dtypes"] == {"y": want_dt, "z": want_dt, "h": want_dt, "n": "torch.float32", "g": "torch.float32",
                             "cn": "torch.float32", "vt": "torch.float32"}, run
    assert_within(run["errs"], _bounds(k, r, dt, S), run)
    assert run["same_as_lora"], run  # z and h: the LoRA GEMM's own, bit for bit
    assert all(run["detached_same"]) and run["detached_none"], run  # detached: cn and vᵀ neither formed nor stored


@pytest.mark.parametrize("norm", ["exact", "detached"])
def test_a_model_with_its_norms_in_the_gemm_under_the_triton_interpreter(interp_runs, norm):
    (run,) = [r for r in interp_runs if r.get("model_case") and r["norm"] == norm]
    # two grouped blocks (one launch each), two attention outputs, four MLP layers: one launch a layer;
    # the head (a trained W) its LoRA op and the norm's two launches, inline
    assert run["forward"] == ["dora_mm"] * 8 + ["mm", "dora_fwd", "dora_fwd_scale"], run
    assert run["inline_forward"] == ["mm", "dora_fwd", "dora_fwd_scale"] * 9, run
    assert "triton: the norm formed in the LoRA GEMM" in run["dora"], run
    assert any("not in the LoRA GEMM (its W is trained" in note for note in run["dora"]), run
    assert run["err"] <= run["bound"], run


def test_the_command_line_takes_it_records_it_and_says_where_the_norms_formed(run_cli, tmp_path):
    """``--dora-norm-launch gemm`` trains a tiny run on the CPU, where the norms form with torch ops:
    the run's ``dora_norms`` column says so and why."""
    import pandas as pd
    from tiny import SAMPLE

    args = ["train", "--device", "cpu", "--weights", "random", "--model-size", "tiny", "--data-file", SAMPLE,
            "--trainable-layers", "lora-kernel", "--lora-variant", "dora", "--num-epochs", "1", "--max-steps", "2",
            "--warmup-steps", "1", "--eval-freq", "0", "--skip-final-eval", "--dora-norm-launch", "gemm"]
    code, out = run_cli(*args, "--results-dir", tmp_path)
    assert code == 0, out
    row = pd.read_csv(tmp_path / "runs.csv").iloc[0]
    assert row["status"] == "done" and row["cfg_dora_norm_launch"] == "gemm"
    assert row["dora_norms"] == "torch: the CPU", row["dora_norms"]


# ----------------------------------------------------------------------------------- GPU
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (out per layer, in, layers side by side): GPT-2 124M's and 1558M's attention and MLP layers
GPU_SHAPES = [(768, 768, 3), (3072, 768, 1), (768, 3072, 1), (1600, 1600, 3), (6400, 1600, 1)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_kernel_at_gpt2_shapes_in_bfloat16(shape):
    """bf16 mode's operands (x, W, A in bfloat16; B, m, the bias float32), 960 rows, r16, against
    float64: the bounds of the interpreter's cases, bfloat16's unit roundoff."""
    from lora_bench.kernels import lora_triton

    out, k, S = shape
    r, rows = 16, 960
    x = fresh(rows, k, device="cuda", dtype=torch.bfloat16)
    w = fresh(S * out, k, device="cuda", dtype=torch.bfloat16, scale=k ** -0.5)
    a = fresh(*((S,) if S > 1 else ()), k, r, device="cuda", dtype=torch.bfloat16, scale=k ** -0.5)
    b = fresh(*((S,) if S > 1 else ()), r, out, device="cuda", dtype=torch.float32, scale=r ** -0.5)
    m = torch.rand(S * out, device="cuda") + 0.5
    bb = fresh(S * out, device="cuda", dtype=torch.float32)
    fwd = lora_triton.dora_fwd_segments if S > 1 else lora_triton.dora_fwd
    got = dict(zip(NAMES, fwd(x, w, a, b, m, w.float().pow(2).sum(1), bb, SCALE, exact=True)))
    want = _float64(x, w, a, b, m, bb, got["z"], S)
    bounds = _bounds(k, r, "fp16w", S)
    bounds.update(y=bounds["y"] - rounded_input_tol(torch.float16, 1) + rounded_input_tol(torch.bfloat16, 1),
                  z=rounded_input_tol(torch.bfloat16, 4), h=rounded_input_tol(torch.bfloat16, 1))
    assert_within({name: rel_err(got[name], want[name].to(got[name].device)) for name in NAMES}, bounds, shape)


def _gpu_model(norm: str, gemm: bool):
    """A random-weights classifier with 124M's widths and 2 blocks of fused DoRA layers on the GPU,
    frozen weights in bf16 as best mode keeps them, query, key and value grouped; adapters and
    magnitudes moved off their start by the same draws; ``gemm``: norms formed in the GEMM. Returns
    (model, its float64 copy)."""
    from lora_bench.classifier.book import build_classifier
    from lora_bench.config import TrainConfig
    from lora_bench.lora.kernel import form_norms_in_gemm, group_qkv

    cfg = TrainConfig(model_size="124M", n_layers=2, weights="random", trainable_layers="lora-kernel",
                      lora_variant="dora", dora_norm=norm, device="cuda")
    torch.manual_seed(5)
    model = build_classifier(cfg, cache_dir=None).cuda()
    gen = torch.Generator(device="cuda").manual_seed(6)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen, device="cuda", dtype=p.dtype))
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and not mod.weight.requires_grad:
            mod.to(torch.bfloat16)
    f64 = copy.deepcopy(model).double()
    assert group_qkv(model) > 0
    if gemm:
        assert form_norms_in_gemm(model) > 0
    return model, f64


def _gpu_step(model, idx, target, autocast: bool = True):
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False, enabled=autocast):
        logits = model(idx)[:, -1, :]
        loss = nn.functional.cross_entropy(logits.float() if autocast else logits, target)
    return {"loss": loss, **{f"g{i}": t for i, t in enumerate(torch.autograd.grad(loss, params))}}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("norm", ["exact", "detached"])
def test_gpu_norms_in_the_gemm_eager_and_replayed_from_cuda_graphs(norm):
    """Under the fused plan and bf16 autocast, eager and replayed from a CUDA graph on 3 fresh batches
    (outputs NaN-filled first): the loss and every gradient as close to the float64 model as the
    inline model's (``same_function_tol`` at bfloat16)."""
    from numerics import rms_rel_err

    from lora_bench.kernels.policy import Plan, PlanPolicy, record_plans, use_policy
    from lora_bench.train.graphs import warm_up

    gemm, f64 = _gpu_model(norm, True)
    inline, _ = _gpu_model(norm, False)
    batch = lambda: (torch.randint(0, 50257, (8, 120), device="cuda"), torch.randint(0, 2, (8,), device="cuda"))

    def check(got, idx, target):
        ref = _gpu_step(f64, idx, target, autocast=False)
        want = _gpu_step(inline, idx, target)
        assert rms_rel_err(got, ref) <= same_function_tol(want, ref, torch.bfloat16), norm

    with use_policy(PlanPolicy(forced=Plan.FUSED)):
        idx, target = batch()
        with record_plans() as log:
            check(_gpu_step(gemm, idx, target), idx, target)
        assert "triton: the norm formed in the LoRA GEMM" in log.dora, log.dora
        static_idx, static_target = idx.clone(), target.clone()
        warm_up(lambda: _gpu_step(gemm, static_idx, static_target), 2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _gpu_step(gemm, static_idx, static_target)
        for _ in range(3):
            idx, target = batch()
            static_idx.copy_(idx)
            static_target.copy_(target)
            for t in outs.values():
                t.fill_(float("nan"))
            graph.replay()
            check({k: t.clone() for k, t in outs.items()}, idx, target)
