"""DoRA's norm and scale inside the LoRA kernels (``dora_fusion: fused``:
:mod:`lora_bench.kernels.dora_triton_fused`, ``DoRAFusedFunction``).

On the CPU, under Triton's interpreter: the forward kernel (y, z, h, n, g, cn, vᵀ from one launch)
and the backward's two (grad_x and u; grad_A, grad_B and the scale's parts of dg and db, one split of
the rows or two) for one layer and for three side by side, odd shapes and row counts, ranks 1 to 64,
float32 and float16 operands (bfloat16 is left to the GPU: the interpreter gets bf16 dots wrong), B
for the norm in float32 beside a float16 B for the product (bf16 mode's mix), with a bias and
without, outputs NaN-poisoned, against float64 evaluated on the same values; the layer and three
grouped layers against ``LinearWithDoRA`` in float64, exact and detached norm, an input that needs
no gradient too, and what they launch. In-process: when the fused path is taken and why not. GPU
tests (``-m gpu``): the forward kernel at GPT-2 shapes, eager and replayed from a CUDA graph; the
layer and grouped layers in float32, bf16 mode's mix and bfloat16, eager and replayed from a CUDA
graph.

Tolerances (tests/numerics.py): every product is exact and summed in float32. h sums k terms; z
k + r + 1 (h, then h·B added to x·Wᵀ); n, g, cn and vᵀ the split kernel's chains
(tests/kernels/test_dora_norm.py, ``_chains``); y adds a product and a sum to z and g. A 16-bit x
rounds h and z once each, and y once more (``rounded_input_tol``). Backward, on dz = dy ⊙ g rounded
as the kernels round it: u sums out terms, grad_x out + r + 1 (u rounded once more for a 16-bit dz,
and grad_x once); grad_A and grad_B sum the rows, dg's and db's parts too (and the parts' sum P
terms). The layer: as test_dora_norm.py's (``_layer_bound``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from numerics import assert_within, dora_chain, dot_tol, fresh, rel_err, rounded_input_tol, run_interpreted
from test_dora_norm import (
    AUTOCAST_MODES,
    GROUP_NAMES,
    SCALES,
    _assert_float64,
    _capture,
    _chains,
    _dora_torch_ops,
    _dora_group,
    _dora_layer,
    _float64_errors,
    _float64_layer,
    _grads,
    _group_errors,
    _group_grads,
    _layer_bound,
    _mode_cast,
)

from lora_bench.kernels.policy import Plan, PlanPolicy, record_plans, use_policy

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp16w": torch.float16,
         "bf16w": torch.bfloat16}
NORM_B_FP32 = ("fp16w", "bf16w")  # B for the norm as stored, float32, beside B rounded for the product
FUSED_POLICY = PlanPolicy(forced=Plan.FUSED, dora_fusion="fused")
OUTPUTS = ("y", "z", "h", "n", "g", "cn", "vt")

# the kernel: (rows, in, out per layer, r, layers side by side, dtype, bias dtype or None): K tails,
# rows and outputs past the last tile, ranks 1 to 64, layers of 32 and 48 outputs side by side
KERNEL_CASES = [
    (7, 37, 53, 1, 1, "fp32", "fp32"), (33, 40, 70, 16, 1, "fp32", None), (5, 29, 70, 64, 1, "fp32", "fp32"),
    (17, 100, 33, 7, 1, "fp16", "fp32"), (9, 45, 48, 7, 3, "fp32", "fp32"), (40, 64, 32, 16, 3, "fp16w", None),
    (3, 37, 48, 5, 3, "fp16", "fp16"), (20, 130, 53, 3, 1, "fp16w", "fp32"),
]


def _kernel_operands(rows, k, n, r, S, dt, bias, device):
    """x, W (S·n × k), A (k × r, or S × k × r) and B (r × n, or S × r × n) in ``dt``'s dtype, B for the
    norm (float32 where ``dt`` mixes them, else B), m (float32) and the bias or None."""
    dtype = DTYPE[dt]
    x = fresh(rows, k, device=device, dtype=dtype)
    w = fresh(S * n, k, device=device, dtype=dtype, scale=k ** -0.5)
    a = fresh(S, k, r, device=device, dtype=dtype, scale=k ** -0.5)
    b_norm = fresh(S, r, n, device=device, dtype=torch.float32 if dt in NORM_B_FP32 else dtype, scale=r ** -0.5)
    b = b_norm.to(dtype)
    if S == 1:
        a, b, b_norm = a[0], b[0], b_norm[0]
    m = torch.rand(S * n, device=device) + 0.5
    bb = None if bias is None else fresh(S * n, device=device, dtype=DTYPE[bias])
    return x, w, a, b, b_norm, m, bb


def _float64_forward(x, w, a, b, b_norm, m, bias, s) -> dict[str, torch.Tensor]:
    """The kernel's outputs in float64 on the same values: z from B (the product's), the norm from
    ``b_norm``."""
    a3, b3, bn3 = (t if t.dim() == 3 else t.unsqueeze(0) for t in (a, b, b_norm))
    S, n = a3.shape[0], b3.shape[2]
    X, W, M = x.double(), w.double(), m.double()
    out = {key: [] for key in ("z", "h", "n", "vt")}
    for i in range(S):
        A, B, BN, Wi = a3[i].double(), b3[i].double(), bn3[i].double(), W[i * n:(i + 1) * n]
        h = X @ A
        out["h"].append(h)
        out["z"].append(X @ Wi.t() + s * h @ B)
        out["n"].append((Wi + s * (A @ BN).t()).norm(dim=1))
        out["vt"].append((2 * s * (Wi @ A) + 2 * s * s * (BN.t() @ (A.t() @ A))).t())
    want = {key: torch.cat(v, 1 if key != "n" else 0) for key, v in out.items()}
    want["g"] = M / want["n"]
    want["cn"] = -M / (2 * want["n"] ** 3)
    want["y"] = want["z"] * want["g"] + (0 if bias is None else bias.double())
    return want


def _kernel_bounds(k: int, r: int, dt: str) -> dict[str, float]:
    """Module docstring: float32 chains, and a 16-bit x's roundings of h, z and y."""
    chains = _chains(k, r)
    f32 = torch.float32
    bounds = {name: dot_tol(f32, chains[name]) for name in ("n", "g", "cn", "vt")}
    bounds["h"] = dot_tol(f32, k)
    bounds["z"] = dot_tol(f32, k + r + 1)
    bounds["y"] = bounds["z"] + bounds["g"] + dot_tol(f32, 2)
    dtype = DTYPE[dt]
    if dtype is not f32:
        bounds["h"] += rounded_input_tol(dtype, 1)
        bounds["z"] += rounded_input_tol(dtype, 2)  # h, then z
        bounds["y"] += rounded_input_tol(dtype, 3)
    return bounds


def _kernel_errors(ops, s, given_sq: bool = False) -> dict[str, float]:
    """The kernel's outputs, their dtypes checked, against float64 on the same values; ``given_sq``:
    ‖W_j‖² given (summed once in float32, as a frozen W's), else summed in the kernel's loop."""
    from lora_bench.kernels.dora_triton_fused import lora_dora_forward

    sq = ops[1].float().pow(2).sum(1) if given_sq else None
    got = dict(zip(OUTPUTS, lora_dora_forward(*ops, s, sq)))
    x = ops[0]
    assert all(got[name].dtype is x.dtype for name in ("y", "z", "h")), {k: v.dtype for k, v in got.items()}
    assert all(got[name].dtype is torch.float32 for name in ("n", "g", "cn", "vt"))
    want = _float64_forward(*ops, s)
    return {name: rel_err(got[name], want[name]) for name in OUTPUTS}


# the layer (in, out, rows, r, detached norm, dtype) and three grouped ones (in, out, rows, r, detached
# norm, dtype, bias): out a multiple of 16 (one launch for the three) or not (one each)
LAYER_CASES = [(37, 53, 7, 1, False, "fp32"), (37, 53, 7, 16, True, "fp32"), (96, 80, 15, 64, False, "fp32"),
               (40, 24, 9, 5, False, "fp16"), (40, 24, 9, 5, True, "fp16")]
GROUP_CASES = [(37, 48, 9, 7, False, "fp32", True), (37, 48, 9, 7, True, "fp32", False),
               (40, 32, 5, 16, False, "fp16", True), (37, 53, 9, 7, False, "fp32", True)]
# the backward's launches: the LoRA kernels' two (grad_x with u; grad_A and grad_B with the scale's
# parts), then dm and db from the parts (detached norm) or the exact norm's two
BWD_TAGS = {False: ["dora_bwd_x", "dora_ab", "dora_norm_exact_bwd", "dora_norm_exact_bwd_finish"],
            True: ["dora_bwd_x", "dora_ab", "dora_scale_bwd_finish"]}
# a layer whose input needs no gradient (a first block's): (in, out, rows, r, detached norm)
NO_X_CASES = [(37, 53, 7, 7, False), (37, 53, 7, 7, True)]
# bf16 mode's layer with float16 in bfloat16's place (the interpreter gets bf16 dots wrong): the frozen W
# and bias stored in float16, A, B and m float32, called under the CPU's float16 autocast: (in, out,
# rows, r, detached norm)
AUTOCAST_CASES = [(37, 53, 9, 7, False), (40, 48, 9, 16, True)]


def _autocast_run(k, n, rows, r, detach) -> dict:
    """The fused layer in bf16 mode's dtypes under autocast (``AUTOCAST_CASES``): its path, its output's
    and gradients' dtypes, and their errors against ``LinearWithDoRA`` in float64."""
    from lora_bench.classifier.book import cast_frozen

    layer = _dora_layer(k, n, r, dtype=torch.float32, detach=detach, device="cpu")
    assert cast_frozen(layer, torch.float16) > 0
    x = fresh(rows, k, device="cpu", dtype=torch.float32).requires_grad_()
    g = fresh(rows, n, device="cpu", dtype=torch.float32)
    with use_policy(FUSED_POLICY), record_plans() as log, torch.autocast("cpu", dtype=torch.float16):
        if not (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.float16):
            return dict(skip="this torch's CPU autocast does not take float16")
        outs = _grads(layer, x, g)
    return dict(backend=log.backend(), dtypes=[str(o.dtype) for o in outs], errs=_float64_errors(layer, x, g, outs))


def _layer_run(k, n, rows, r, detach, dt, need_x: bool = True) -> dict:
    from lora_bench.kernels import dora_fused, dora_triton_bwd, dora_triton_fused, triton_launch

    layer = _dora_layer(k, n, r, dtype=DTYPE[dt], detach=detach, device="cpu")
    x = fresh(rows, k, device="cpu", dtype=DTYPE[dt]).requires_grad_(need_x)
    g = fresh(rows, n, device="cpu", dtype=torch.float32)
    ops = dict(function=dora_fused.DoRAFusedFunction, kernel_modules=(dora_triton_fused, dora_triton_bwd))
    with use_policy(FUSED_POLICY), record_plans() as log:
        with triton_launch.recording() as fwd, _dora_torch_ops(**ops) as fwd_ops:
            y = layer(x)
        wrt = [x, layer.lora.A, layer.lora.B, layer.m][0 if need_x else 1:]
        with triton_launch.recording() as bwd, _dora_torch_ops(**ops) as bwd_ops:
            grads = torch.autograd.grad((y.float() * g).sum(), wrt)
    if need_x:
        errs = _float64_errors(layer, x, g, (y, *grads))
    else:  # x's gradient is not asked for: the reference's in its place
        ref = _float64_layer(layer)
        x64 = x.double().requires_grad_()
        want = _grads(ref, x64, g.double())
        errs = {name: rel_err(got, w) for name, got, w in zip(("y", "A", "B", "m"), (y, *grads),
                                                                 (want[0], *want[2:5]))}
    return dict(backend=log.backend(), forward=[rec[0] for rec in fwd], backward=[rec[0] for rec in bwd],
                torch_ops=dict(forward=fwd_ops, backward=bwd_ops), errs=errs)


# the backward's kernels: (rows, in, out per layer, r, layers side by side, dtype, bias, splits of the
# rows for grad_A and grad_B: 2 takes the atomic float32 path, each split writing its row of parts)
BWD_KERNEL_CASES = [
    (7, 37, 53, 1, 1, "fp32", True, 1), (33, 40, 70, 16, 1, "fp32", False, 2), (40, 45, 48, 7, 3, "fp32", True, 2),
    (17, 100, 33, 64, 1, "fp16", True, 1), (40, 64, 32, 16, 3, "fp16", False, 1), (5, 29, 70, 3, 1, "fp32", True, 1),
]


def _bwd_kernel_errors(rows, k, n, r, S, dt, bias, splits, device="cpu") -> dict[str, float]:
    """``lora_dora_bwd_x`` and ``lora_dora_grad_ab`` against float64 on the same values: grad_x, u,
    grad_A, grad_B, and the sums of dg's and db's parts. ``splits`` None: the launch's own choice
    (float32 gradients, as bf16 mode's adapters have), else forced (the interpreter's small tiles)."""
    from lora_bench.kernels.dora_triton_fused import lora_dora_bwd_x, lora_dora_grad_ab
    from lora_bench.kernels.lora_triton import ABConfig

    dtype = DTYPE[dt]
    out = S * n
    dy, z = fresh(rows, out, device=device, dtype=dtype), fresh(rows, out, device=device, dtype=dtype)
    g = torch.rand(out, device=device) + 0.5
    x, h = fresh(rows, k, device=device, dtype=dtype), fresh(rows, S * r, device=device, dtype=dtype)
    w = fresh(out, k, device=device, dtype=dtype, scale=k ** -0.5)
    a = fresh(S, k, r, device=device, dtype=dtype, scale=k ** -0.5)
    b = fresh(S, r, n, device=device, dtype=dtype, scale=r ** -0.5)
    if S == 1:
        a, b = a[0], b[0]
    s = SCALES[1]
    gx, u = lora_dora_bwd_x(dy, g, w, a, b, s)
    grad_dt = torch.float32 if splits is None or splits > 1 else dtype  # atomics add float32
    ga, gb, pg, pb = lora_dora_grad_ab(x, u, h, dy, z, g, scale=s, segments=S, grad_dtype=grad_dt, need_db=bias,
                                       config=None if splits is None else ABConfig(32, 16, 4, 1, splits))
    assert (splits is None or pg.shape == (splits, out)) and pg.shape[1] == out
    assert (pb is None) is not bias and u.dtype is dtype and gx.dtype is dtype
    a3, b3 = (a, b) if S > 1 else (a.unsqueeze(0), b.unsqueeze(0))
    DZ = (dy.float() * g).to(dtype).double()  # dz as the kernels round it
    U = torch.cat([DZ[:, i * n:(i + 1) * n] @ b3[i].double().t() for i in range(S)], 1)
    GX = DZ @ w.double() + s * sum(U[:, i * r:(i + 1) * r] @ a3[i].double().t() for i in range(S))
    X, H, U_got = x.double(), h.double(), u.double()
    GA = torch.stack([s * X.t() @ U_got[:, i * r:(i + 1) * r] for i in range(S)])
    GB = torch.stack([s * H[:, i * r:(i + 1) * r].t() @ DZ[:, i * n:(i + 1) * n] for i in range(S)])
    if S == 1:
        GA, GB = GA[0], GB[0]
    errs = {"gx": rel_err(gx, GX), "u": rel_err(u, U), "ga": rel_err(ga, GA), "gb": rel_err(gb, GB),
            "dg": rel_err(pg.double().sum(0), (dy.double() * z.double()).sum(0)), "parts": pg.shape[0]}
    if bias:
        errs["db"] = rel_err(pb.double().sum(0), dy.double().sum(0))
    return errs


def _bwd_kernel_bounds(rows: int, n: int, r: int, S: int, dt: str, splits: int) -> dict[str, float]:
    """Module docstring: float32 sums, a 16-bit dz's roundings of u and grad_x, 16-bit gradients' own."""
    f32, dtype = torch.float32, DTYPE[dt]
    bounds = {"u": dot_tol(f32, S * n), "gx": dot_tol(f32, S * n + r + 1), "ga": dot_tol(f32, rows),
              "gb": dot_tol(f32, rows), "dg": dot_tol(f32, rows + splits), "db": dot_tol(f32, rows + splits)}
    if dtype is not f32:
        bounds["u"] += rounded_input_tol(dtype, 1)
        bounds["gx"] += rounded_input_tol(dtype, 2)
        if splits == 1:  # the gradients stored in the 16-bit dtype
            bounds["ga"] += rounded_input_tol(dtype, 1)
            bounds["gb"] += rounded_input_tol(dtype, 1)
    return bounds


def _group_run(k, n, rows, r, detach, dt, bias) -> dict:
    from lora_bench.kernels import triton_launch

    caller, layers = _dora_group(k, n, r, dtype=DTYPE[dt], detach=detach, bias=bias, device="cpu")
    x = fresh(rows, k, device="cpu", dtype=DTYPE[dt]).requires_grad_()
    gs = [fresh(rows, n, device="cpu", dtype=torch.float32) for _ in layers]
    with use_policy(FUSED_POLICY), record_plans() as log:
        with triton_launch.recording() as fwd:
            ys = caller(x)
        loss = sum((y.float() * g).sum() for y, g in zip(ys, gs))
        with triton_launch.recording() as bwd:
            grads = torch.autograd.grad(loss, [x, *[t for m in layers for t in (m.lora.A, m.lora.B, m.m)]])
    return dict(backend=log.backend(), forward=[rec[0] for rec in fwd], backward=[rec[0] for rec in bwd],
                errs=_group_errors(layers, x, gs, (*ys, *grads)))


def _interp_main() -> None:
    """Run with TRITON_INTERPRET=1: every KERNEL_CASES case at both scales, every LAYER_CASES and
    GROUP_CASES case, outputs NaN-poisoned: one JSON line each."""
    from lora_bench.kernels import lora_triton

    lora_triton.POISON_OUTPUTS = True
    for i, case in enumerate(KERNEL_CASES):
        for s in SCALES:  # ‖W_j‖² summed in the kernel at one scale, given at the other
            ops = _kernel_operands(*case, device="cpu")
            print(json.dumps(dict(case=i, scale=s, errs=_kernel_errors(ops, s, given_sq=s == SCALES[1]))), flush=True)
    for i, case in enumerate(BWD_KERNEL_CASES):
        print(json.dumps(dict(bwd_case=i, errs=_bwd_kernel_errors(*case))), flush=True)
    for i, case in enumerate(LAYER_CASES):
        print(json.dumps(dict(layer_case=i, **_layer_run(*case))), flush=True)
    for i, (k, n, rows, r, detach) in enumerate(NO_X_CASES):
        print(json.dumps(dict(no_x_case=i, **_layer_run(k, n, rows, r, detach, "fp32", need_x=False))), flush=True)
    for i, case in enumerate(AUTOCAST_CASES):
        print(json.dumps(dict(autocast_case=i, **_autocast_run(*case))), flush=True)
    for i, case in enumerate(GROUP_CASES):
        print(json.dumps(dict(group_case=i, **_group_run(*case))), flush=True)


@pytest.fixture(scope="module")
def interp_runs():
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path[:0] = [{str(here.parent)!r}, {str(here)!r}]; "
            "import test_dora_fused as t; t._interp_main()")
    proc = run_interpreted(["-c", code])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(runs) == (len(KERNEL_CASES) * len(SCALES) + len(BWD_KERNEL_CASES) + len(LAYER_CASES) + len(NO_X_CASES)
                         + len(AUTOCAST_CASES) + len(GROUP_CASES)), proc.stdout[-3000:]
    return runs


@pytest.mark.parametrize("i", range(len(KERNEL_CASES)))
def test_fused_forward_kernel_under_the_triton_interpreter(interp_runs, i):
    """y, z, h, n, g, cn and vᵀ from one launch against float64 (``_kernel_bounds``), outputs
    NaN-poisoned: every one written, for one layer and for three side by side, ‖W_j‖² summed in the
    kernel or given."""
    rows, k, n, r, S, dt, bias = KERNEL_CASES[i]
    runs = [run for run in interp_runs if run.get("case") == i]
    assert len(runs) == len(SCALES)
    bounds = _kernel_bounds(k, r, dt)
    for run in runs:
        assert set(run["errs"]) == set(OUTPUTS), run
        assert_within(run["errs"], bounds, run)


@pytest.mark.parametrize("i", range(len(BWD_KERNEL_CASES)))
def test_fused_backward_kernels_under_the_triton_interpreter(interp_runs, i):
    """grad_x and u, grad_A and grad_B and the parts of dg and db from the backward's two launches
    against float64 (``_bwd_kernel_bounds``), with one split of the rows and with two."""
    rows, k, n, r, S, dt, bias, splits = BWD_KERNEL_CASES[i]
    (run,) = [run for run in interp_runs if run.get("bwd_case") == i]
    bounds = _bwd_kernel_bounds(rows, n, r, S, dt, splits)
    assert run["errs"].pop("parts") == splits
    assert set(run["errs"]) == {"gx", "u", "ga", "gb", "dg"} | ({"db"} if bias else set()), run
    assert_within(run["errs"], bounds, run)


@pytest.mark.parametrize("i", range(len(LAYER_CASES)))
def test_fused_layer_under_the_triton_interpreter(interp_runs, i):
    """The fused DoRA layer with ``dora_fusion: fused`` against ``LinearWithDoRA`` in float64 (the
    bound of test_dora_norm.py's layer); its forward is one launch, its backward the LoRA kernels' two
    and one (detached norm) or two (exact) more; the run notes it (``dora-norm-fused``)."""
    k, n, rows, r, detach, dt = LAYER_CASES[i]
    (run,) = [run for run in interp_runs if run.get("layer_case") == i]
    assert run["backend"] == "dora-norm-fused+fused", run
    assert run["forward"] == ["dora_fused_fwd"] and run["backward"] == BWD_TAGS[detach], run
    assert run["torch_ops"] == {"forward": [], "backward": []}, run  # no sums or casts beside the kernels
    bound = dot_tol(torch.float32, dora_chain(k, n, r, rows)) if dt == "fp32" else rounded_input_tol(DTYPE[dt], 8)
    assert set(run["errs"]) == {"y", "x", "A", "B", "m"}, run
    assert_within(run["errs"], bound, run)


@pytest.mark.parametrize("i", range(len(NO_X_CASES)))
def test_fused_layer_whose_input_needs_no_gradient_under_the_triton_interpreter(interp_runs, i):
    """A first block's layer (its input needs no gradient): no grad_x launch, u from dz formed in torch
    ops; y, A's, B's and m's gradients against float64."""
    k, n, rows, r, detach = NO_X_CASES[i]
    (run,) = [run for run in interp_runs if run.get("no_x_case") == i]
    assert run["forward"] == ["dora_fused_fwd"] and run["backward"] == BWD_TAGS[detach][1:], run
    bound = dot_tol(torch.float32, dora_chain(k, n, r, rows))
    assert set(run["errs"]) == {"y", "A", "B", "m"}, run
    assert_within(run["errs"], bound, run)


@pytest.mark.parametrize("i", range(len(AUTOCAST_CASES)))
def test_fused_layer_in_bf16_modes_dtypes_under_autocast_under_the_triton_interpreter(interp_runs, i):
    """A 16-bit frozen W beside float32 adapters under autocast (bf16 mode's layer, float16 standing in
    for bfloat16) takes the fused path: x, A and B cast for the products, the norm from A in W's dtype
    and B as stored; y in the 16-bit dtype, the gradients in their parameters' (float32); against
    float64 within ``rounded_input_tol(float16, 8)``, the bound of the 16-bit layers."""
    (run,) = [run for run in interp_runs if run.get("autocast_case") == i]
    if "skip" in run:
        pytest.skip(run["skip"])
    assert run["backend"] == "dora-norm-fused+fused", run
    assert run["dtypes"] == ["torch.float16"] + ["torch.float32"] * 4, run
    bound = rounded_input_tol(torch.float16, 8)
    assert set(run["errs"]) == {"y", "x", "A", "B", "m"}, run
    assert_within(run["errs"], bound, run)


@pytest.mark.parametrize("i", range(len(GROUP_CASES)))
def test_grouped_fused_layers_under_the_triton_interpreter(interp_runs, i):
    """Three grouped DoRA layers fused: one launch forward for the three where their
    outputs are a multiple of 16, else one each; each layer's output and gradients, and x's summed
    over the three, against the three as ``LinearWithDoRA`` in float64."""
    k, n, rows, r, detach, dt, bias = GROUP_CASES[i]
    (run,) = [run for run in interp_runs if run.get("group_case") == i]
    assert run["backend"] == "dora-norm-fused+fused", run
    grouped = n % 16 == 0
    assert run["forward"] == ["dora_fused_fwd"] * (1 if grouped else 3), run
    assert run["backward"] == BWD_TAGS[detach] * (1 if grouped else 3), run
    bound = dot_tol(torch.float32, dora_chain(k, 3 * n, r, rows)) if dt == "fp32" else rounded_input_tol(DTYPE[dt], 8)
    assert set(run["errs"]) == set(GROUP_NAMES), run
    assert_within(run["errs"], bound, run)


# ------------------------------------------------------------------------ when it is taken


def _why(layer, x, policy=FUSED_POLICY):
    from lora_bench.kernels.dora_fused import fused_why

    with use_policy(policy):
        bias = layer.linear.bias
        return fused_why(x, layer.linear.weight, [layer.m, *(() if bias is None else (bias,)), layer.lora.A,
                                                     layer.lora.B], 1)


def test_the_cpu_runs_the_split_forward_with_its_reason():
    """Off the interpreter the CPU takes torch's path, split, whatever the policy asks for: the
    fused path's reason names the CPU, the run notes the torch path and nothing of the fused one."""
    layer = _dora_layer(37, 53, 7, dtype=torch.float32, detach=False, device="cpu")
    x = fresh(5, 37, device="cpu", dtype=torch.float32)
    assert _why(layer, x) == "the CPU"
    with use_policy(FUSED_POLICY), record_plans() as log:
        layer(x.requires_grad_()).sum().backward()
    assert log.backend() == "dora-norm-torch+torch", log.backend()


def test_the_fused_path_is_off_by_default_and_a_setting_turns_it_on():
    """``dora_fusion`` defaults to split (the policy and the setting); a run's setting reaches its
    policy; an unknown value is refused with the allowed ones."""
    from lora_bench.config import TrainConfig
    from lora_bench.kernels.policy import KernelPlanError, policy_for

    assert PlanPolicy().dora_fusion == "split" and TrainConfig().dora_fusion == "split"
    assert policy_for("auto", PlanPolicy(), dora_fusion="fused").dora_fusion == "fused"
    with pytest.raises(KernelPlanError, match="split, fused"):
        PlanPolicy(dora_fusion="epilogue")


def test_a_trained_weight_and_a_non_fused_plan_keep_the_split_forward(monkeypatch):
    """Where Triton's path is open (as on a GPU), the fused path still needs a frozen W (the head's is
    trained) and the fused plan (an eager 16-bit call takes the C++ op's); each refusal is named."""
    from lora_bench.kernels import dora_fused

    monkeypatch.setattr(dora_fused, "_triton_why", lambda weight, a: None)
    layer = _dora_layer(37, 53, 7, dtype=torch.float32, detach=False, device="cpu")
    x = fresh(5, 37, device="cpu", dtype=torch.float32)
    assert _why(layer, x, PlanPolicy(forced=Plan.TORCH, dora_fusion="fused")) == "a LoRA plan other than fused"
    layer.linear.weight.requires_grad_(True)
    assert "trained W" in _why(layer, x)
    layer.linear.weight.requires_grad_(False)
    half = _dora_layer(37, 53, 7, dtype=torch.float16, detach=False, device="cpu")
    assert "dtype the call computes in" in _why(half, x.half().float())


def test_a_captured_call_takes_the_fused_kernels_where_a_lora_layer_takes_cublas(monkeypatch):
    """The size rule gives a captured LoRA layer of 1558M's MLP size the C++ op's cuBLAS GEMMs; a DoRA
    layer with ``dora_fusion: fused`` takes the fused kernels there (under capture only: an eager
    call the C++ op gets stays split)."""
    from lora_bench.kernels import dora_fused

    monkeypatch.setattr(dora_fused, "_triton_why", lambda weight, a: None)
    monkeypatch.setattr(dora_fused, "plan_for_size", lambda x, numel, rank: Plan.CPP)
    layer = _dora_layer(37, 53, 7, dtype=torch.float32, detach=False, device="cpu")
    x = fresh(5, 37, device="cpu", dtype=torch.float32)
    assert _why(layer, x, PlanPolicy(capture=True, dora_fusion="fused")) is None
    assert _why(layer, x, PlanPolicy(dora_fusion="fused")) == "a LoRA plan other than fused"


def test_layers_side_by_side_need_outputs_in_blocks_of_sixteen(monkeypatch):
    """Side by side, every block of outputs must lie in one layer's: 53 outputs are refused, 48 taken."""
    from lora_bench.kernels import dora_fused

    monkeypatch.setattr(dora_fused, "_triton_why", lambda weight, a: None)
    monkeypatch.setattr(dora_fused, "plan_for_size", lambda x, numel, rank: Plan.FUSED)  # as captured on a GPU
    for n, want in ((53, "outputs side by side"), (48, None)):
        layers = [_dora_layer(37, n, 7, dtype=torch.float32, detach=False, device="cpu") for _ in range(3)]
        params = [*(m.m for m in layers), *(m.linear.bias for m in layers), *(m.lora.A for m in layers),
                  *(m.lora.B for m in layers)]
        weight = torch.cat([m.linear.weight for m in layers])
        with use_policy(FUSED_POLICY):
            why = dora_fused.fused_why(fresh(5, 37, device="cpu", dtype=torch.float32), weight, params, 3)
        assert (why is None) if want is None else (want in why), why


# ----------------------------------------------------------------------------------- GPU

# (rows, in, out per layer, r, layers side by side, bias): GPT-2 124M's and 1558M's shapes, a block's
# query, key and value side by side, and odd ones
GPU_KERNEL_SHAPES = [(960, 768, 768, 16, 3, "fp32"), (960, 768, 3072, 16, 1, None), (960, 3072, 768, 16, 1, "fp32"),
                     (960, 1600, 1600, 16, 3, "fp32"), (960, 1600, 6400, 16, 1, None),
                     (333, 640, 770, 64, 1, "fp32"), (129, 720, 720, 1, 3, None)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["fp32", "bf16", "bf16w"])
@pytest.mark.parametrize("rows, k, n, r, S, bias", GPU_KERNEL_SHAPES)
def test_gpu_fused_forward_kernel_matches_float64(dt, rows, k, n, r, S, bias, monkeypatch):
    """y, z, h, n, g, cn and vᵀ of the one launch at GPT-2's shapes, outputs NaN-poisoned."""
    from lora_bench.kernels import lora_triton

    monkeypatch.setattr(lora_triton, "POISON_OUTPUTS", True)
    bounds = _kernel_bounds(k, r, dt)
    for s in SCALES:
        errs = _kernel_errors(_kernel_operands(rows, k, n, r, S, dt, bias, "cuda"), s, given_sq=s == SCALES[1])
        for name, err in errs.items():
            assert err <= bounds[name], (name, errs, s)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
@pytest.mark.parametrize("rows, k, n, r, S, bias", GPU_KERNEL_SHAPES[:2] + GPU_KERNEL_SHAPES[3:5])
def test_gpu_fused_forward_kernel_replayed_from_a_cuda_graph(dt, rows, k, n, r, S, bias):
    """The launch captured in a CUDA graph: replays on fresh operands copied into the captured
    buffers, outputs NaN-filled before each, match float64 every time."""
    from lora_bench.kernels.dora_triton_fused import lora_dora_forward

    s = SCALES[1]
    ops = _kernel_operands(rows, k, n, r, S, dt, bias, "cuda")
    graph, outs = _capture(lambda: lora_dora_forward(*ops, s))
    bounds = _kernel_bounds(k, r, dt)
    for i in range(3):
        with torch.no_grad():
            for t, new in zip(ops, _kernel_operands(rows, k, n, r, S, dt, bias, "cuda")):
                if t is not None:
                    t.copy_(new)
            for t in outs:
                t.fill_(float("nan"))
        graph.replay()
        want = _float64_forward(*ops, s)
        for name, got in zip(OUTPUTS, outs):
            assert rel_err(got, want[name]) <= bounds[name], (name, rel_err(got, want[name]), f"replay {i}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
@pytest.mark.parametrize("rows, k, n, r, S, bias", GPU_KERNEL_SHAPES)
def test_gpu_fused_backward_kernels_match_float64(dt, rows, k, n, r, S, bias, monkeypatch):
    """grad_x, u, grad_A, grad_B and the parts of dg and db from the backward's two launches at
    GPT-2's shapes, with the splits of the rows the launch chooses (float32 gradients), outputs
    NaN-poisoned."""
    from lora_bench.kernels import lora_triton

    monkeypatch.setattr(lora_triton, "POISON_OUTPUTS", True)
    errs = _bwd_kernel_errors(rows, k, n, r, S, dt, bias is not None, None, device="cuda")
    parts = errs.pop("parts")
    bounds = _bwd_kernel_bounds(rows, n, r, S, dt, parts)
    for name, err in errs.items():
        assert err <= bounds[name], (name, errs, parts)


# bf16 autocast over float32 parameters is left out: a float32 W is not the dtype the call computes in
GPU_MODES = ("fp32", "bf16-base", "bf16-true")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", GPU_MODES)
@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("rows, k, n, r", [(960, 1600, 6400, 16), (960, 768, 768, 16), (333, 768, 770, 1),
                                         (129, 640, 384, 64)])
def test_gpu_fused_layer_matches_float64(mode, detach, rows, k, n, r):
    """The fused layer under the fused plan (as captured), eager: float32, bf16 mode's
    layer (a bfloat16 frozen W beside float32 adapters, under autocast), bfloat16 parameters."""
    layer = _mode_cast(_dora_layer(k, n, r, dtype=torch.float32, detach=detach), mode)
    pdt = layer.m.dtype
    x = fresh(rows, k, device="cuda", dtype=pdt).requires_grad_()
    g = fresh(rows, n, device="cuda", dtype=pdt)
    with use_policy(FUSED_POLICY), record_plans() as log, \
            torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode in AUTOCAST_MODES):
        outs = _grads(layer, x, g)
    assert log.dora == {"fused"}, log.dora
    _assert_float64(layer, x, g, outs, _layer_bound(mode, k, n, r, rows), f"{mode} detach={detach}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", GPU_MODES)
@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("rows, k, r", [(960, 768, 16), (960, 1600, 16), (333, 720, 16)])
def test_gpu_grouped_fused_layers_replayed_from_a_cuda_graph(mode, detach, rows, k, r):
    """A block's query, key and value grouped and fused, forward and backward captured in a
    CUDA graph under the run's own capture policy (the fused plan forced for float32, which captures
    cuBLAS's GEMMs otherwise): one forward launch for the three; replays on fresh x, A's, B's, m's
    and output gradients match float64 every time."""
    from lora_bench.kernels import triton_launch
    from lora_bench.train.graphs import warm_up

    caller, layers = _dora_group(k, k, r, dtype=torch.float32, detach=detach, bias=True, device="cuda", mode=mode)
    pdt = layers[0].m.dtype
    x = fresh(rows, k, device="cuda", dtype=pdt).requires_grad_()
    gs = [fresh(rows, k, device="cuda", dtype=pdt) for _ in layers]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode in AUTOCAST_MODES, cache_enabled=False):
            return _group_grads(caller, layers, x, gs)

    policy = FUSED_POLICY if mode == "fp32" else PlanPolicy(dora_fusion="fused")
    with use_policy(policy), record_plans() as log:
        warm_up(step, 2)
        graph = torch.cuda.CUDAGraph()
        with triton_launch.recording() as rec, torch.cuda.graph(graph):
            outs = step()
    assert log.dora == {"fused"} and [t for t, *_ in rec].count("dora_fused_fwd") == 1, (log.dora, rec)
    bound = _layer_bound(mode, k, 3 * k, r, rows)
    for i in range(3):
        with torch.no_grad():
            for t in (x, *gs, *[p for m in layers for p in (m.lora.A, m.lora.B)]):
                t.copy_(fresh(*t.shape, device="cuda", dtype=t.dtype, scale=float(t.float().std())))
            for m in layers:
                m.m.copy_(m.m * (1 + 0.1 * torch.rand_like(m.m)))
            for t in outs:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for name, err in _group_errors(layers, x, gs, outs).items():
            assert err <= bound, (mode, detach, name, err, bound, f"replay {i}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("k, n", [(1600, 6400), (6400, 1600)])
def test_gpu_fused_layer_of_cublas_size_replayed_from_a_cuda_graph(detach, k, n):
    """A bf16-mode layer of 1558M's MLP size captured under the run's own policy: the fused kernels
    run (not the C++ op's cuBLAS GEMMs a LoRA layer of this size takes), and replays on fresh x, A, B,
    m and output gradient match float64 every time."""
    from lora_bench.kernels.policy import Plan
    from lora_bench.train.graphs import warm_up

    layer = _mode_cast(_dora_layer(k, n, 16, dtype=torch.float32, detach=detach), "bf16-base")
    x = fresh(960, k, device="cuda", dtype=torch.float32).requires_grad_()
    g = fresh(960, n, device="cuda", dtype=torch.float32)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            return _grads(layer, x, g)

    with use_policy(PlanPolicy(dora_fusion="fused")), record_plans() as log:
        warm_up(step, 2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
    assert log.dora == {"fused"} and Plan.CPP not in log.plans, (log.dora, log.plans)
    bound = _layer_bound("bf16-base", k, n, 16, 960)
    for i in range(2):
        with torch.no_grad():
            for t in (x, layer.lora.A, layer.lora.B, g):
                t.copy_(fresh(*t.shape, device="cuda", dtype=t.dtype, scale=float(t.float().std())))
            layer.m.copy_(layer.m * (1 + 0.1 * torch.rand_like(layer.m)))
            for t in outs:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_float64(layer, x, g, outs, bound, f"detach={detach} replay {i}")


@pytest.mark.gpu
@gpu
def test_gpu_fused_and_split_paths_agree_on_one_layer():
    """The same bf16-mode layer, split and fused, under the fused plan: outputs and every
    gradient within the two paths' float64 bounds of each other."""
    layer = _mode_cast(_dora_layer(768, 2304, 16, dtype=torch.float32, detach=False), "bf16-base")
    x = fresh(960, 768, device="cuda", dtype=torch.float32).requires_grad_()
    g = fresh(960, 2304, device="cuda", dtype=torch.float32)
    runs = {}
    for forward in ("split", "fused"):
        with use_policy(PlanPolicy(forced=Plan.FUSED, dora_fusion=forward)), record_plans() as log, \
                torch.autocast("cuda", dtype=torch.bfloat16):
            runs[forward] = _grads(layer, x, g)
        assert log.dora == ({"triton"} if forward == "split" else {"fused"}), log.dora
    bound = 2 * _layer_bound("bf16-base", 768, 2304, 16, 960)
    for a, b in zip(runs["split"], runs["fused"]):
        assert rel_err(b, a.double()) <= bound

