"""DoRA's Triton kernels (:mod:`lora_bench.kernels.dora_triton`) and the fused DoRA layer on its GPU paths.

On the CPU, under Triton's interpreter: the forward kernel (n, g, W·A and Bᵀ·AᵀA, and y = g ⊙ z + b)
of odd shapes and row counts, ranks 1 to 64, float32 and float16 operands (bfloat16 is left to the
GPU: the interpreter gets bf16 dots wrong), W and A given transposed as well, with a bias and
without, outputs NaN-poisoned, against float64 evaluated on the same (rounded) values; the exact
backward's kernel (dm, dB, dA and c ⊙ Bᵀ in one launch) alike, ranks 1 to 64; the scale's backward
kernel; the layer with them all against ``LinearWithDoRA`` in float64 (a trained base too); what
one layer launches beyond a fused LoRA layer, forward and backward, held to docs/variants.md's
table. GPU tests (``-m gpu``): the forward kernel and the exact backward's at GPT-2 shapes, both
replayed from a CUDA graph as well; the layer in float32, under bfloat16 autocast and in bfloat16,
eager and replayed from a CUDA graph, against ``LinearWithDoRA`` in float64.

Tolerances (tests/numerics.py): the kernel multiplies its operands exactly and sums in float32, so
each result is ``dot_tol(float32, chain)``: W·A sums k terms, Bᵀ·AᵀA k then r, n k, then r for the
dot with Bᵀ, then the three terms and the root (k + 2r + 4), g one division more, y a product and a
sum more (and its rounding to z's dtype: ``rounded_input_tol`` of a 16-bit z, one rounding); the exact
backward's as ``_bwd_bounds`` counts them (16-bit: its roundings to the parameters' dtype). The layer: float32
``dot_tol`` over ``dora_chain``; 16-bit as tests/lora/test_dora_kernel.py derives it,
``rounded_input_tol(bfloat16, 8)``."""

from __future__ import annotations

import contextlib
import copy
import json
import re

import pytest
import torch
import torch.nn as nn
from numerics import ROOT, assert_within, dora_chain, dot_tol, fresh, interpreted_runs, rel_err, rounded_input_tol

from lora_bench.kernels.policy import record_plans
from lora_bench.lora import LinearWithDoRA, LinearWithDoRAKernel

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp16w": torch.float16,
         "bf16w": torch.bfloat16}
# "fp16w": W and z in float16, A, B and m in float32 (bf16 mode's mix: a 16-bit frozen W beside float32
# adapters under autocast), A read in W's dtype by the forward kernel
ADAPTER_DTYPE = {"fp16w": torch.float32, "bf16w": torch.float32}

# the forward kernel: (out, in, r, operand dtype, W and A stored transposed, rows of z, bias dtype or
# None): odd sizes, K tails, outputs and rows past the last block, a float32 bias beside a 16-bit z
KERNEL_CASES = [
    (53, 37, 1, "fp32", False, 7, "fp32"), (53, 37, 16, "fp32", True, 33, None), (70, 45, 64, "fp32", False, 1, "fp32"),
    (100, 29, 3, "fp32", False, 20, None), (33, 100, 7, "fp16", False, 17, "fp32"), (17, 130, 64, "fp16", True, 5, None),
    (16, 16, 16, "fp32", False, 16, "fp32"), (45, 23, 7, "fp16", False, 40, "fp16"),
    (33, 100, 7, "fp16w", False, 17, "fp32"), (70, 45, 64, "fp16w", True, 9, None),
]
SCALES = (1.5, -0.75)


def _chains(k: int, r: int) -> dict[str, int]:
    return {"n": k + 2 * r + 4, "g": k + 2 * r + 5, "cn": k + 2 * r + 7, "vt": k + r + 2, "y": k + 2 * r + 7}


def _fwd_bounds(k: int, r: int, dt: str) -> dict[str, float]:
    """``_chains`` in float32; y in a 16-bit z's dtype rounds once more; a float32 A read in a 16-bit
    W's dtype rounds each product's A factor (W·A one, AᵀA two)."""
    dtype = DTYPE[dt]
    bounds = {name: dot_tol(torch.float32, chain) for name, chain in _chains(k, r).items()}
    if dtype is not torch.float32:
        bounds["y"] += rounded_input_tol(dtype, 1)
    if dt in ADAPTER_DTYPE:
        bounds = {name: bound + rounded_input_tol(dtype, 2) for name, bound in bounds.items()}
    return bounds


def _operands(out: int, k: int, r: int, dt: str, device, transposed: bool = False):
    """W (out × k) in ``dt``'s dtype; A (k × r), B (r × out) and m (out) in it too, or in
    ``ADAPTER_DTYPE``'s where ``dt`` mixes them."""
    dtype = DTYPE[dt]
    adt = ADAPTER_DTYPE.get(dt, dtype)
    w = fresh(out, k, device=device, dtype=dtype, scale=k ** -0.5)
    a = fresh(k, r, device=device, dtype=adt, scale=k ** -0.5)
    if transposed:  # the same values, stored the other way round
        w, a = w.t().contiguous().t(), a.t().contiguous().t()
    b = fresh(r, out, device=device, dtype=adt, scale=r ** -0.5)
    m = (torch.rand(out, device=device) + 0.5).to(adt)
    return w, a, b, m


def _float64_norm(w, a, b, m, s) -> dict[str, torch.Tensor]:
    W, A, B, M = (t.double() for t in (w, a, b, m))
    n = (W + s * (A @ B).t()).norm(dim=1)
    v = 2 * s * (W @ A) + 2 * s * s * (B.t() @ (A.t() @ A))
    return {"n": n, "g": M / n, "cn": -M / (2 * n ** 3), "vt": v.t()}


def _fwd_operands(rows: int, out: int, bias: str | None, dtype: torch.dtype, device) -> tuple:
    """z (rows × out, ``dtype``) and the bias (out, its dtype) or None."""
    z = fresh(rows, out, device=device, dtype=dtype)
    return z, None if bias is None else fresh(out, device=device, dtype=DTYPE[bias])


def _fwd_kernel(z, w, a, b, m, bias, s) -> dict[str, torch.Tensor]:
    """``dora_forward``'s outputs by name, their dtypes checked: y in z's, the rest float32."""
    from lora_bench.kernels.dora_triton import dora_forward

    got = dict(zip(("y", "n", "g", "cn", "vt"), dora_forward(z, w, a, b, m, bias, s)))
    assert got["y"].dtype is z.dtype and all(got[name].dtype is torch.float32 for name in ("n", "g", "cn", "vt"))
    return got


def _fwd_want(z, w, a, b, m, bias, s) -> dict[str, torch.Tensor]:
    want = _float64_norm(w, a, b, m, s)
    want["y"] = z.double() * want["g"] + (0 if bias is None else bias.double())
    return want


def _kernel_errors(z, w, a, b, m, bias, s) -> dict[str, float]:
    """The forward kernel against float64 on the same values: n, g, cn, vᵀ and y."""
    got = _fwd_kernel(z, w, a, b, m, bias, s)
    want = _fwd_want(z, w, a, b, m, bias, s)
    return {name: rel_err(got[name], want[name]) for name in want}


# the exact backward's kernel: (out, in, r, operand dtype, W and A stored transposed); 16 × 16 tiles in
# the interpreter: fewer programs than blocks of outputs (each program writes several) and more
BWD_CASES = [
    (53, 37, 1, "fp32", False), (29, 100, 7, "fp32", True), (70, 45, 16, "fp16", False),
    (17, 130, 64, "fp16", True), (100, 33, 64, "fp32", False), (16, 16, 7, "fp32", False),
    (70, 45, 16, "fp16w", False),
]
BWD_NEEDS = ((True, True, True), (False, False, False))  # (dm, dB, c ⊙ Bᵀ): all, or dA alone
BWD_PARTS = 3  # dg (and the bias's gradient) as the scale's parts, added by the kernel where it reads them


def _bwd_operands(out: int, k: int, r: int, dt: str, device, s: float, transposed: bool = False):
    """dg, n, cn, vᵀ (float32: the exact norm's at scale s, of W, A, B), W, A, B (``_operands``); m's dtype."""
    w, a, b, m = _operands(out, k, r, dt, device, transposed)
    norm = _float64_norm(w, a, b, m, s)
    dg = fresh(out, device=device, dtype=torch.float32)
    return dict(dg=dg, n=norm["n"].float(), cn=norm["cn"].float(), vt=norm["vt"].float().contiguous(), weight=w,
                a=a, b=b), m.dtype


def _with_parts(ops: dict, parts: int) -> tuple[dict, torch.Tensor]:
    """``ops`` with dg given as ``parts`` rows of parts (fresh values: dg is their sum), and the bias's
    parts (parts × out) beside them."""
    out, dev = ops["dg"].shape[0], ops["dg"].device
    return {**ops, "dg": fresh(parts, out, device=dev, dtype=torch.float32)}, fresh(parts, out, device=dev,
                                                                                 dtype=torch.float32)


def _float64_exact_bwd(ops: dict, s: float) -> dict[str, torch.Tensor]:
    DG, N, CN, VT, W, A, B = (ops[k].double() for k in ("dg", "n", "cn", "vt", "weight", "a", "b"))
    DG = DG.sum(0) if DG.dim() == 2 else DG  # parts: their sum
    c = DG * CN
    cb = c[:, None] * B.t()
    return {"dm": DG / N, "dB": VT * c, "dA": 2 * s * W.t() @ cb + 2 * s * s * A @ (B @ cb), "cb": cb}


def _bwd_errors(ops: dict, m_dtype: torch.dtype, s: float, needs: tuple[bool, bool, bool],
                bias_parts: torch.Tensor | None = None) -> dict[str, float]:
    """``dora_exact_bwd``'s outputs against float64 on the same values: dm, dB, dA, c ⊙ Bᵀ where asked
    for (None where not), each in its dtype; db where the bias's parts are given."""
    from lora_bench.kernels.dora_triton_bwd import dora_exact_bwd

    need_m, need_b, need_cb = needs
    got = dict(zip(("dm", "dB", "dA", "cb", "db"), dora_exact_bwd(
        *ops.values(), s, m_dtype=m_dtype, need_m=need_m, need_b=need_b, need_cb=need_cb, bias_parts=bias_parts)))
    asked = {"dm": need_m, "dB": need_b, "dA": True, "cb": need_cb, "db": bias_parts is not None}
    assert all((got[name] is None) is not asked[name] for name in got), got
    dtypes = {"dm": m_dtype, "dB": ops["b"].dtype, "dA": ops["a"].dtype, "cb": torch.float32, "db": torch.float32}
    assert all(got[name].dtype is dtypes[name] for name in got if asked[name])
    want = _float64_exact_bwd(ops, s)
    if bias_parts is not None:
        want["db"] = bias_parts.double().sum(0)
    return {name: rel_err(got[name], want[name]) for name in got if asked[name]}


def _bwd_bounds(out: int, r: int, dtype: torch.dtype) -> dict[str, float]:
    """dm: a division (and the store in m's dtype); dB and c ⊙ Bᵀ: c, then a product (and the store in
    B's dtype); dA sums over the outputs (out terms; B·diag(c)·Bᵀ out, then A times it r), after c and
    c ⊙ Bᵀ and before the two scaled terms' sum: ``dot_tol(float32, out + r + 4)``; with a 16-bit W,
    c ⊙ Bᵀ is rounded to W's dtype for the product and dA to A's: two roundings of that dtype more."""
    if dtype is torch.float32:
        return {"dm": dot_tol(dtype, 1), "dB": dot_tol(dtype, 2), "dA": dot_tol(dtype, out + r + 4),
                "cb": dot_tol(dtype, 2)}
    return {"dm": rounded_input_tol(dtype, 1), "dB": rounded_input_tol(dtype, 1),
            "dA": rounded_input_tol(dtype, 2) + dot_tol(torch.float32, out + r + 4),
            "cb": dot_tol(torch.float32, 2)}


# the fused DoRA layer, its norm and scale in the Triton kernels: (in, out, rows, r, detached norm,
# parameter dtype: float16 for the 16-bit paths, the stand-in for bfloat16 here, a trained base)
LAYER_CASES = ([(37, 53, 7, r, detach, "fp32", False) for r in (1, 16, 64) for detach in (False, True)]
               + [(96, 80, 15, 7, False, "fp32", False), (37, 53, 7, 16, False, "fp16", False),
                  (40, 24, 9, 5, True, "fp16", False), (37, 5, 9, 7, False, "fp32", True)])
# three DoRA layers side by side on one input (``group_layers``, as a block's query, key and value),
# under a forced fused plan: (in, out, rows, r, detached norm, dtype, bias); out a multiple of the
# forward kernel's 16-output block (the grouped path), or not (each layer on its own)
GROUP_CASES = [(37, 48, 9, 7, False, "fp32", True), (37, 48, 9, 7, True, "fp32", False),
               (40, 32, 5, 16, False, "fp16", True), (29, 64, 17, 1, False, "fp32", False),
               (37, 53, 9, 7, False, "fp32", True)]
# grouped cases run again with blocks of WIDE_TILE outputs, as on a GPU: layers of 48, 32 and 64
# outputs take blocks of 16, 32 and 64 (``segment_block``)
WIDE_TILE = 64
WIDE_GROUP_CASES = (0, 2, 3)
# the scale's backward kernel: (batch shape, out, bias, z's dtype, dy expanded from a sum)
SCALE_CASES = [((7,), 53, True, "fp32", False), ((3, 11), 37, False, "fp32", False), ((40,), 17, True, "fp16", False),
               ((2, 9), 70, True, "fp32", True), ((5,), 16, True, "fp32", False)]


def _scale_errors(batch, out: int, bias: bool, dt: str, summed: bool) -> dict[str, float]:
    """dz, dg and db of y = g ⊙ z + b from the scale's backward on the Triton path against float64
    (g float32, z and dy in ``dt``; ``summed``: dy is the expanded one of ``y.sum()``)."""
    from lora_bench.kernels.dora import TRITON, _scale_backward

    z = fresh(*batch, out, device="cpu", dtype=DTYPE[dt])
    g = torch.rand(out) + 0.5
    dy = torch.ones((), dtype=z.dtype).expand(*batch, out) if summed else fresh(*batch, out, device="cpu", dtype=z.dtype)
    rows = z.reshape(-1, out)
    got = _scale_backward(TRITON, dy, rows, g, need_z=True, need_g=True, need_bias=bias)
    assert (got[2] is None) is not bias and got[0].dtype is z.dtype and got[1].dtype is torch.float32
    DY, Z = dy.double(), z.double()
    want = [DY * g.double(), (DY * Z).reshape(-1, out).sum(0), DY.reshape(-1, out).sum(0)]
    return {name: rel_err(a, w) for name, a, w in zip(("dz", "dg", "db"), got, want) if a is not None}


def _interp_main() -> None:
    """Run with TRITON_INTERPRET=1: every KERNEL_CASES case at both scales, every BWD_CASES case with
    each of BWD_NEEDS, every SCALE_CASES and LAYER_CASES case, outputs NaN-poisoned: one JSON line
    each with the errors against float64; and one line each for what a layer launches (``_launches``)
    with the exact and the detached norm."""
    from lora_bench.kernels import lora_triton

    lora_triton.POISON_OUTPUTS = True
    for i, (out, k, r, dt, transposed, rows, bias) in enumerate(KERNEL_CASES):
        for s in SCALES:
            w, a, b, m = _operands(out, k, r, dt, "cpu", transposed)
            z, bb = _fwd_operands(rows, out, bias, DTYPE[dt], "cpu")
            print(json.dumps(dict(case=i, scale=s, errs=_kernel_errors(z, w, a, b, m, bb, s))), flush=True)
    for i, (out, k, r, dt, transposed) in enumerate(BWD_CASES):
        for needs in BWD_NEEDS:
            ops, m_dtype = _bwd_operands(out, k, r, dt, "cpu", SCALES[1], transposed)
            print(json.dumps(dict(bwd_case=i, needs=needs, errs=_bwd_errors(ops, m_dtype, SCALES[1], needs))),
                  flush=True)
        ops, bias_parts = _with_parts(_bwd_operands(out, k, r, dt, "cpu", SCALES[1], transposed)[0], BWD_PARTS)
        print(json.dumps(dict(bwd_parts_case=i, errs=_bwd_errors(ops, m_dtype, SCALES[1], BWD_NEEDS[0], bias_parts))),
              flush=True)
    for i, case in enumerate(SCALE_CASES):
        print(json.dumps(dict(scale_case=i, errs=_scale_errors(*case))), flush=True)
    for detach in (False, True):
        print(json.dumps(dict(launches="detached" if detach else "exact", **_launches(detach))), flush=True)
    for i, (k, n, rows, r, detach, dt, trained) in enumerate(LAYER_CASES):
        layer = _dora_layer(k, n, r, dtype=DTYPE[dt], detach=detach, device="cpu", trained_base=trained)
        x = fresh(rows, k, device="cpu", dtype=DTYPE[dt]).requires_grad_()
        g = fresh(rows, n, device="cpu", dtype=torch.float32)
        with record_plans() as log:
            outs = _grads(layer, x, g)
        print(json.dumps(dict(layer_case=i, dora=sorted(log.dora), backend=log.backend(),
                              errs=_float64_errors(layer, x, g, outs))), flush=True)
    for i, case in enumerate(GROUP_CASES):
        print(json.dumps(dict(group_case=i, **_group_run(*case))), flush=True)
    from lora_bench.kernels import dora_triton

    narrow = dora_triton.fwd_config, dora_triton.scale_config
    dora_triton.fwd_config = lambda dtype, device: (WIDE_TILE, 16, 4, 1)  # a GPU's width of outputs
    dora_triton.scale_config = lambda device: (32, 16, WIDE_TILE)
    try:
        for i in WIDE_GROUP_CASES:
            print(json.dumps(dict(wide_group_case=i, **_group_run(*GROUP_CASES[i]))), flush=True)
    finally:
        dora_triton.fwd_config, dora_triton.scale_config = narrow


def _dora_group(k: int, n: int, r: int, *, dtype: torch.dtype, detach: bool, bias: bool, device: str,
                mode: str | None = None):
    """Three DoRA layers (``_dora_layer``), with fresh biases or none, in ``mode``'s dtypes where given
    (``_mode_cast``), grouped by ``group_layers`` (a block's query, key and value, grouped after the
    cast as the trainer groups them); returns (the group's caller, the layers)."""
    from lora_bench.lora.kernel import DoRASideBySide, group_layers

    layers = [_dora_layer(k, n, r, dtype=dtype, detach=detach, device=device) for _ in range(3)]
    for m in layers:
        if bias:
            with torch.no_grad():
                m.linear.bias.copy_(fresh(n, device=device, dtype=dtype))
        else:
            m.linear.bias = None
        if mode is not None:
            _mode_cast(m, mode)
    caller = group_layers(layers)
    assert isinstance(caller, DoRASideBySide), caller
    return caller, layers


def _group_grads(caller, layers, x, gs):
    """The group's outputs and the gradients of x and each layer's A, B and m, for output gradients gs."""
    ys = caller(x)
    loss = sum((y.float() * g.float()).sum() for y, g in zip(ys, gs))
    return (*ys, *torch.autograd.grad(loss, [x, *[t for m in layers for t in (m.lora.A, m.lora.B, m.m)]]))


GROUP_NAMES = ("y0", "y1", "y2", "x", "A0", "B0", "m0", "A1", "B1", "m1", "A2", "B2", "m2")


def _group_errors(layers, x, gs, outs) -> dict[str, float]:
    """``_group_grads``' results against the three layers as ``LinearWithDoRA`` in float64."""
    refs = [_float64_layer(m) for m in layers]
    x64 = x.detach().double().requires_grad_()
    ys64 = [m(x64) for m in refs]
    loss64 = sum((y * g.double()).sum() for y, g in zip(ys64, gs))
    want = (*ys64, *torch.autograd.grad(loss64, [x64, *[t for m in refs for t in (m.lora.A, m.lora.B, m.m)]]))
    return {name: rel_err(got, w) for name, got, w in zip(GROUP_NAMES, outs, want)}


def _group_run(k: int, n: int, rows: int, r: int, detach: bool, dt: str, bias: bool) -> dict:
    """Three DoRA layers grouped, under a forced fused plan: the Triton launches of their forward and
    backward (tags) and, against the three as ``LinearWithDoRA`` in float64, the errors of their
    outputs, x's gradient (summed over the three) and each layer's A, B and m."""
    from lora_bench.kernels import triton_launch
    from lora_bench.kernels.policy import Plan, PlanPolicy, use_policy

    caller, layers = _dora_group(k, n, r, dtype=DTYPE[dt], detach=detach, bias=bias, device="cpu")
    x = fresh(rows, k, device="cpu", dtype=DTYPE[dt]).requires_grad_()
    gs = [fresh(rows, n, device="cpu", dtype=torch.float32) for _ in layers]
    with use_policy(PlanPolicy(forced=Plan.FUSED)), record_plans() as log:
        with triton_launch.recording() as fwd:
            ys = caller(x)
        loss = sum((y.float() * g).sum() for y, g in zip(ys, gs))
        with triton_launch.recording() as bwd:
            grads = torch.autograd.grad(loss, [x, *[t for m in layers for t in (m.lora.A, m.lora.B, m.m)]])
    return dict(forward=[rec[0] for rec in fwd], backward=[rec[0] for rec in bwd], dora=sorted(log.dora),
                fwd_grids={rec[0]: list(rec[1]) for rec in fwd if rec[0].startswith("dora")},
                errs=_group_errors(layers, x, gs, (*ys, *grads)))


@pytest.fixture(scope="module")
def interp_runs():
    runs = interpreted_runs(__file__)
    expected = (len(KERNEL_CASES) * len(SCALES) + len(BWD_CASES) * (len(BWD_NEEDS) + 1) + len(SCALE_CASES) + 2
                + len(LAYER_CASES) + len(GROUP_CASES) + len(WIDE_GROUP_CASES))
    assert len(runs) == expected, runs[-3:]
    return runs


@pytest.mark.parametrize("i", range(len(KERNEL_CASES)))
def test_forward_kernel_under_the_triton_interpreter(interp_runs, i):
    """n, g, cn, vᵀ and y = g ⊙ z + b from one launch against float64 (``_fwd_bounds``), outputs
    NaN-poisoned: every one written."""
    out, k, r, dt, transposed, rows, bias = KERNEL_CASES[i]
    runs = [run for run in interp_runs if run.get("case") == i]
    assert len(runs) == len(SCALES)
    bounds = _fwd_bounds(k, r, dt)
    for run in runs:
        assert set(run["errs"]) == set(bounds), run
        assert_within(run["errs"], bounds, run)


@pytest.mark.parametrize("i", range(len(BWD_CASES)))
def test_exact_backward_kernel_under_the_triton_interpreter(interp_runs, i):
    """dm, dB, dA and c ⊙ Bᵀ from the exact backward's launches against float64 (``_bwd_bounds``),
    outputs NaN-poisoned: every one written, each exactly once whatever the count of programs; dA
    alone as well; and with dg given as the scale's parts, and the bias's parts beside it, added where
    they are read (their fp32 sum: ``BWD_PARTS`` terms more in every chain, and db itself)."""
    out, k, r, dt, transposed = BWD_CASES[i]
    runs = [run for run in interp_runs if run.get("bwd_case") == i]
    assert sorted(tuple(run["needs"]) for run in runs) == sorted(BWD_NEEDS)
    bounds = _bwd_bounds(out, r, DTYPE[dt])
    for run in runs:
        assert set(run["errs"]) == ({"dm", "dB", "dA", "cb"} if run["needs"][0] else {"dA"}), run
        assert_within(run["errs"], bounds, run)
    (run,) = [run for run in interp_runs if run.get("bwd_parts_case") == i]
    assert set(run["errs"]) == {"dm", "dB", "dA", "cb", "db"}, run
    summed = {**{name: b + dot_tol(torch.float32, BWD_PARTS) for name, b in bounds.items()},
              "db": dot_tol(torch.float32, BWD_PARTS)}
    for name, err in run["errs"].items():
        assert err <= summed[name], (run, name, summed[name])


@pytest.mark.parametrize("i", range(len(SCALE_CASES)))
def test_scale_backward_kernel_under_the_triton_interpreter(interp_runs, i):
    """dz = dy ⊙ g rounds once to z's dtype; dg and db sum the rows in float32 (a 16-bit z and dy are
    exact in float32): ``rounded_input_tol`` of z's dtype with one rounding for dz,
    ``dot_tol(float32, rows + 1)`` for dg and db."""
    batch, out, bias, dt, summed = SCALE_CASES[i]
    (run,) = [run for run in interp_runs if run.get("scale_case") == i]
    rows = 1
    for d in batch:
        rows *= d
    bounds = {"dz": rounded_input_tol(DTYPE[dt], 1), "dg": dot_tol(torch.float32, rows + 1),
              "db": dot_tol(torch.float32, rows)}
    assert set(run["errs"]) == ({"dz", "dg", "db"} if bias else {"dz", "dg"}), run
    assert_within(run["errs"], bounds, run)


@pytest.mark.parametrize("i", range(len(LAYER_CASES)))
def test_dora_kernel_layer_under_the_triton_interpreter(interp_runs, i):
    """The layer with its norm and scale in the Triton kernels against ``LinearWithDoRA`` in float64,
    within the float32 bound of its torch path (the kernels sum in float32 as torch does); the run
    notes the Triton path. Float16 parameters: ``rounded_input_tol(float16, 8)``, as for bfloat16."""
    k, n, rows, r, detach, dt, trained = LAYER_CASES[i]
    (run,) = [run for run in interp_runs if run.get("layer_case") == i]
    assert run["dora"] == ["triton"] and run["backend"] == "dora-norm-triton+torch", run
    bound = dot_tol(torch.float32, dora_chain(k, n, r, rows)) if dt == "fp32" else rounded_input_tol(DTYPE[dt], 8)
    assert set(run["errs"]) == {"y", "x", "A", "B", "m"} | ({"W", "b"} if trained else set()), run
    assert_within(run["errs"], bound, run)


# a DoRA function's launches: forward the norm's parts of K, then their sum, g and the scale;
# backward the scale's one (dz and the blocks of rows' parts of dg, summed by each block of
# outputs' last program), and with the exact norm its two
FWD_TAGS = ["dora_fwd", "dora_fwd_scale"]
SCALE_BWD_TAGS = ["dora_scale_bwd"]
EXACT_BWD_TAGS = ["dora_norm_exact_bwd", "dora_norm_exact_bwd_finish"]  # the exact norm's: the parts of the outputs, dA


@pytest.mark.parametrize("i", range(len(GROUP_CASES)))
def test_grouped_dora_layers_under_the_triton_interpreter(interp_runs, i):
    """Three DoRA layers side by side: where their outputs fit the forward kernel's blocks, one
    LoRA launch and one DoRA function's launches forward for all three, and one scale's and (the
    exact norm) one norm launch backward (beside the LoRA op's own), not three of each; elsewhere
    each layer on its own. Outputs
    and gradients against ``LinearWithDoRA`` in float64: the layer's bound, its chain taken over
    the three layers' outputs (x's gradient sums them)."""
    k, n, rows, r, detach, dt, bias = GROUP_CASES[i]
    (run,) = [run for run in interp_runs if run.get("group_case") == i]
    fits = n % 16 == 0
    dora_fwd = [t for t in run["forward"] if t.startswith("dora")]
    dora_bwd = [t for t in run["backward"] if t.startswith("dora")]
    lora_fwd = [t for t in run["forward"] if not t.startswith("dora")]
    if fits:
        assert dora_fwd == FWD_TAGS and len(lora_fwd) == 1, run
        # detached: dm in the scale's second launch; exact: the norm's first adds the scale's parts
        want_bwd = SCALE_BWD_TAGS if detach else ["dora_scale_bwd", *EXACT_BWD_TAGS]
        assert sorted(dora_bwd) == sorted(want_bwd), run
    else:
        assert dora_fwd == FWD_TAGS * 3, run
    assert run["dora"] == ["triton"], run
    bound = (dot_tol(torch.float32, dora_chain(k, 3 * n, r, rows)) if dt == "fp32"
             else rounded_input_tol(DTYPE[dt], 8))
    assert_within(run["errs"], bound, run)


@pytest.mark.parametrize("i", WIDE_GROUP_CASES)
def test_grouped_layers_take_the_widest_block_that_fits_under_the_triton_interpreter(interp_runs, i):
    """With a GPU's 64-output tiles, three grouped layers of 48, 32 or 64 outputs each run the
    forward's two launches over blocks of 16, 32 or 64 outputs (the grid's first side: 3n / block),
    none straddling two layers, and match ``LinearWithDoRA`` in float64 within the grouped bound."""
    from lora_bench.kernels.dora_triton import segment_block

    k, n, rows, r, detach, dt, bias = GROUP_CASES[i]
    (run,) = [run for run in interp_runs if run.get("wide_group_case") == i]
    block = segment_block(WIDE_TILE, n, 3)
    assert block == {48: 16, 32: 32, 64: 64}[n]
    assert [t for t in run["forward"] if t.startswith("dora")] == FWD_TAGS, run
    assert {tag: grid[0] for tag, grid in run["fwd_grids"].items()} == {tag: 3 * n // block for tag in FWD_TAGS}
    bound = (dot_tol(torch.float32, dora_chain(k, 3 * n, r, rows)) if dt == "fp32"
             else rounded_input_tol(DTYPE[dt], 8))
    assert_within(run["errs"], bound, run)


# ------------------------------------------------------------------ the layer (interpreter and GPU)


def _dora_layer(k: int, n: int, r: int, *, dtype: torch.dtype, detach: bool, device: str = "cuda",
                trained_base: bool = False) -> LinearWithDoRAKernel:
    """A fused DoRA layer on ``device`` in ``dtype``, B and m moved off their start; its base frozen
    unless ``trained_base`` (the head)."""
    linear = nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.copy_(fresh(n, k, device="cpu", dtype=torch.float32, scale=k ** -0.5))
    layer = LinearWithDoRAKernel(linear.requires_grad_(trained_base), r, 1.5, detach_norm=detach)
    with torch.no_grad():
        layer.lora.B.copy_(fresh(r, n, device="cpu", dtype=torch.float32, scale=r ** -0.5))
        layer.m.mul_(1 + 0.1 * torch.rand_like(layer.m))
    return layer.to(device, dtype)


def _float64_layer(layer: LinearWithDoRAKernel) -> LinearWithDoRA:
    """``LinearWithDoRA`` in float64 with the layer's values, on the layer's device. Built on the CPU
    (where a new adapter's A and B are made) and moved after, as the trainer moves a model."""
    linear = copy.deepcopy(layer.linear).cpu().double()
    ref = LinearWithDoRA(linear, layer.lora.A.shape[1], layer.lora.alpha, detach_norm=layer.detach_norm).double()
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    return ref.to(layer.m.device)


def _grads(layer, x, g):
    """y and the gradients of x, A, B, m and, for a trained base, W and b (``GRADS``' order)."""
    wrt = [x, layer.lora.A, layer.lora.B, layer.m]
    if layer.linear.weight.requires_grad:
        wrt += [layer.linear.weight, layer.linear.bias]
    y = layer(x)
    return (y, *torch.autograd.grad(y, wrt, g.to(y.dtype)))


GRADS = ("y", "x", "A", "B", "m", "W", "b")


# the layer's modes on the GPU: float32; bfloat16 autocast over float32 parameters; "bf16-base", what
# the harness's bf16 mode holds (``cast_frozen``: the frozen W and bias stored in bfloat16, A, B and m
# float32) under autocast; bfloat16 parameters (bf16-true)
AUTOCAST_MODES = ("bf16", "bf16-base")


def _mode_cast(layer: nn.Module, mode: str) -> nn.Module:
    """``layer`` (float32) in ``mode``'s dtypes (``AUTOCAST_MODES``)."""
    from lora_bench.classifier.book import cast_frozen

    if mode == "bf16-true":
        return layer.to(torch.bfloat16)
    if mode == "bf16-base":
        assert cast_frozen(layer, torch.bfloat16) > 0
    return layer


def _layer_bound(mode: str, k: int, n: int, r: int, rows: int) -> float:
    return dot_tol(torch.float32, dora_chain(k, n, r, rows)) if mode == "fp32" else rounded_input_tol(torch.bfloat16, 8)


def _float64_errors(layer, x, g, outs) -> dict[str, float]:
    """Each of ``_grads``' results against ``LinearWithDoRA`` in float64 with the layer's values."""
    want = _grads(_float64_layer(layer), x.detach().double().requires_grad_(), g.double())
    assert len(outs) == len(want)
    return {name: rel_err(got, w) for name, got, w in zip(GRADS, outs, want)}


def _assert_float64(layer, x, g, outs, bound: float, what: str) -> None:
    for name, err in _float64_errors(layer, x, g, outs).items():
        assert err <= bound, (what, name, err, bound)


# ------------------------------------------------------------------ what one layer launches

LAUNCH_TABLE = "| | forward | backward, exact norm | backward, detached norm |"
# a kernel's tag starts with its row's key
LAUNCH_ROWS = {"dora_fwd": "the norm and the scale", "dora_scale": "the scale", "dora_norm": "the norm"}


def _gradient_counter(y: torch.Tensor) -> tuple[dict, list]:
    """Hooks on every node of y's graph counting the gradients (not None) each input of a node (a
    leaf's accumulator too) receives in backward: autograd sums all but one of them. Returns the
    counts (filled by the backward) and the hooks' handles."""
    counts: dict = {}
    handles, seen, todo = [], set(), [y.grad_fn]

    def count(fn):
        def hook(grad_inputs, grad_outputs):
            for edge, grad in zip(fn.next_functions, grad_inputs):
                if edge[0] is not None and grad is not None:
                    counts[edge] = counts.get(edge, 0) + 1
        return hook

    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        handles.append(fn.register_hook(count(fn)))
        todo.extend(edge[0] for edge in fn.next_functions)
    return counts, handles


@contextlib.contextmanager
def _dora_torch_ops():
    """The aten ops that compute (no views, no allocations) DoRA's own function (``DoRAFunction``,
    forward and backward) runs in the block outside its Triton launches, by name: the list yielded."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lora_bench.kernels import dora, dora_triton, dora_triton_bwd

    aten = torch.ops.aten
    free = {aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.full, aten.new_full}
    ops, state = [], {"inside": 0, "launching": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if state["inside"] and not state["launching"] and not func.is_view and func.overloadpacket not in free:
                ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def within(key, fn):
        def run(*args, **kwargs):
            state[key] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                state[key] -= 1
        return run

    wrapped = [(dora_triton, "launch", None), (dora_triton_bwd, "launch", None)] + [
        (dora.DoRAFunction, name, staticmethod) for name in ("forward", "_backward")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in wrapped]
    try:
        for owner, name, wrap in wrapped:
            fn = within("launching" if wrap is None else "inside", getattr(owner, name))
            setattr(owner, name, fn if wrap is None else wrap(fn))
        with Count():
            yield ops
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _launches(detach: bool) -> dict:
    """The Triton launches (tags) of one fused DoRA layer's forward and backward, the torch ops its
    own functions run besides, and autograd's sums in its backward, beside a fused LoRA layer's over
    the same linear layer."""
    from lora_bench.kernels import lora_triton, triton_launch
    from lora_bench.lora import LinearWithLoRAKernel

    lora_triton.POISON_OUTPUTS = False  # (allocations only: the count is the same either way)
    dora = _dora_layer(37, 53, 7, dtype=torch.float32, detach=detach, device="cpu")
    lora = LinearWithLoRAKernel(copy.deepcopy(dora.linear), 7, 1.5)
    x = fresh(9, 37, device="cpu", dtype=torch.float32).requires_grad_()
    g = fresh(9, 53, device="cpu", dtype=torch.float32)
    counts = {}
    for name, layer in (("dora", dora), ("lora", lora)):
        with triton_launch.recording() as fwd, _dora_torch_ops() as fwd_ops:
            y = layer(x)
        grads, hooks = _gradient_counter(y)
        with triton_launch.recording() as bwd, _dora_torch_ops() as bwd_ops:
            y.backward(g)
        for hook in hooks:
            hook.remove()
        counts[name] = dict(forward=[rec[0] for rec in fwd], backward=[rec[0] for rec in bwd],
                            torch_ops=dict(forward=fwd_ops, backward=bwd_ops), sums=sum(n - 1 for n in grads.values()))
    lora_triton.POISON_OUTPUTS = True
    return counts


def _docs_launch_table() -> dict[str, list[int]]:
    """docs/variants.md's table of what a fused DoRA layer launches beyond LoRA: each row's leading
    numbers (an empty cell: 0) in its columns forward, backward exact, backward detached."""
    text = (ROOT / "docs" / "variants.md").read_text(encoding="utf-8")
    rows = {}
    for line in text[text.index(LAUNCH_TABLE):].splitlines()[2:]:
        if not line.startswith("|"):
            break
        name, *cells = (cell.strip().strip("*") for cell in line.strip().strip("|").split("|"))
        rows[name] = [int(re.match(r"\d*", cell).group() or 0) for cell in cells]
    return rows


def _beyond_lora(run: dict, phase: str) -> dict[str, int]:
    """One phase's launches of the DoRA layer beyond the LoRA layer's, per row of the docs' table."""
    dora, lora = run["dora"], run["lora"]
    assert dora["torch_ops"][phase] == [], run  # DoRA's function launches nothing but its Triton kernels
    tags = [tag for tag in dora[phase] if tag.startswith("dora_")]
    assert [tag for tag in dora[phase] if tag not in tags] == lora[phase], run  # the LoRA op's own
    rows = {row: sum(tag.startswith(key) for tag in tags) for key, row in LAUNCH_ROWS.items()}
    assert sum(rows.values()) == len(tags), tags
    rows["autograd's sums"] = dora["sums"] - lora["sums"] if phase == "backward" else 0
    rows["more than LoRA"] = sum(rows.values())
    return rows


def test_one_layer_launches_what_the_docs_state(interp_runs):
    """The Triton launches of one fused DoRA layer (its forward, scale and norm kernels, tagged; its
    function runs no torch op that computes) and autograd's sums of A's and B's gradients, forward and backward
    with the exact and the detached norm, beyond a fused LoRA layer's: docs/variants.md's table, row
    by row."""
    runs = {run["launches"]: run for run in interp_runs if "launches" in run}
    assert _beyond_lora(runs["exact"], "forward") == _beyond_lora(runs["detached"], "forward")
    columns = [_beyond_lora(runs["exact"], "forward"), _beyond_lora(runs["exact"], "backward"),
               _beyond_lora(runs["detached"], "backward")]
    measured = {row: [column[row] for column in columns] for row in columns[0]}
    assert _docs_launch_table() == measured


def test_a_block_of_outputs_lies_in_one_layer_of_a_group():
    """Layers side by side take the widest block of outputs (at most the tile asked for, at least
    ``SEGMENT_ALIGN``) that divides each layer's outputs, so no program's outputs straddle two
    layers; one layer takes the tile asked for, its tail masked."""
    dora_triton = pytest.importorskip("lora_bench.kernels.dora_triton")
    block = dora_triton.segment_block
    assert block(64, 1600, 1) == 64 and block(64, 770, 1) == 64
    assert block(64, 1600, 3) == 64 and block(64, 768, 3) == 64  # GPT-2's widths
    assert block(64, 720, 3) == 16 and block(64, 96, 2) == 32 and block(128, 1600, 3) == 64
    for seg in range(16, 1000, 16):
        bn = block(64, seg, 3)
        assert seg % bn == 0 and dora_triton.SEGMENT_ALIGN <= bn <= 64
        assert dora_triton.segments_fit(seg, torch.device("cpu"))
    assert not dora_triton.segments_fit(100, torch.device("cpu"))


# ----------------------------------------------------------------------------------- GPU


def _capture(call):
    """``call`` warmed up on a side stream (as a run's graphs are made) and captured in a CUDA graph:
    (the graph, the outputs it writes)."""
    from lora_bench.train.graphs import warm_up

    warm_up(call, 2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = call()
    return graph, outs


# the forward kernel at GPT-2's shapes, a batch of 8 × 120 rows: (out, in, r, rows, bias dtype or None)
GPT2_FWD_SHAPES = [(2304, 768, 16, 960, "fp32"), (768, 768, 16, 960, "fp32"), (3072, 768, 16, 960, None),
                   (768, 3072, 16, 960, "fp32"), (6400, 1600, 16, 960, "fp32"), (1600, 6400, 64, 333, None),
                   (770, 768, 1, 129, "fp32"), (384, 640, 64, 1, "fp32")]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["fp32", "bf16", "bf16w"])
@pytest.mark.parametrize("out, k, r, rows, bias", GPT2_FWD_SHAPES)
def test_gpu_forward_kernel_matches_float64(dt, out, k, r, rows, bias, monkeypatch):
    """n, g, cn, vᵀ and y of ``dora_forward`` at GPT-2's shapes, outputs NaN-poisoned."""
    from lora_bench.kernels import lora_triton

    monkeypatch.setattr(lora_triton, "POISON_OUTPUTS", True)
    w, a, b, m = _operands(out, k, r, dt, "cuda")
    z, bb = _fwd_operands(rows, out, bias, DTYPE[dt], "cuda")
    bounds = _fwd_bounds(k, r, dt)
    for s in SCALES:
        errs = _kernel_errors(z, w, a, b, m, bb, s)
        for name, err in errs.items():
            assert err <= bounds[name], (name, errs, s)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
@pytest.mark.parametrize("out, k, r, rows, bias", GPT2_FWD_SHAPES[:3] + GPT2_FWD_SHAPES[4:6])
def test_gpu_forward_kernel_replayed_from_a_cuda_graph(dt, out, k, r, rows, bias):
    """``dora_forward`` captured in a CUDA graph (warm-up on a side stream): replays on fresh z, W, A,
    B, m and bias copied into the captured buffers, outputs NaN-filled before each, match float64
    every time."""
    s = SCALES[1]
    w, a, b, m = _operands(out, k, r, dt, "cuda")
    z, bb = _fwd_operands(rows, out, bias, DTYPE[dt], "cuda")

    def call():
        return _fwd_kernel(z, w, a, b, m, bb, s)

    graph, outs = _capture(call)
    bounds = _fwd_bounds(k, r, dt)
    for i in range(3):
        (z2, bb2), (w2, a2, b2, m2) = _fwd_operands(rows, out, bias, DTYPE[dt], "cuda"), _operands(out, k, r, dt, "cuda")
        with torch.no_grad():
            for t, new in zip((z, w, a, b, m, bb), (z2, w2, a2, b2, m2, bb2)):
                if t is not None:
                    t.copy_(new)
            for t in outs.values():
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = _fwd_want(z, w, a, b, m, bb, s)
        for name, got in outs.items():
            assert rel_err(got, want[name]) <= bounds[name], (name, rel_err(got, want[name]), f"replay {i}")


def _scale_sum_want(dy, z, n):
    DY, Z = dy.double(), z.double()
    dg = (DY * Z).sum(0)
    return {"dg": dg, "db": DY.sum(0), "dm": dg / n.double()}


def _scale_sum_check(rows: int, out: int, dt: str, outs: dict, dy, z, n) -> None:
    """dg, db and dm of the one-launch scale backward against float64: float32 sums of ``rows``
    exact products (``dot_tol(float32, rows + 1)``), dm one more rounding, to m's float32."""
    want = _scale_sum_want(dy, z, n)
    bound = dot_tol(torch.float32, rows + 2)
    for name in ("dg", "db", "dm"):
        assert rel_err(outs[name], want[name]) <= bound, (name, rel_err(outs[name], want[name]), rows, out, dt)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_gpu_scale_backward_sums_in_its_one_launch(dt):
    """The scale's backward in one launch, each block of outputs' last program to finish summing its
    parts: on fresh inputs launch after launch (shapes of 1 to 63 blocks of rows, outputs not a
    multiple of the tile), dg, db and dm match float64; the same inputs give the same bits (the parts
    are summed in order whichever program comes last); every counter is back at 0 after each
    launch, so the next one counts from 0."""
    from lora_bench.kernels import dora_triton_bwd as bwd

    dtype = DTYPE[dt]
    for rows, out in [(960, 2304), (4000, 770), (1, 64), (333, 6400), (960, 768), (64, 1600)]:
        dy = fresh(rows, out, device="cuda", dtype=dtype)
        z = fresh(rows, out, device="cuda", dtype=dtype)
        g = torch.rand(out, device="cuda") + 0.5
        n = torch.rand(out, device="cuda") + 0.5
        first = None
        for _ in range(3):
            dz, dg, db, dm = bwd.scale_bias_bwd(dy, z, g, need_dz=True, need_db=True, n=n, m_dtype=torch.float32)
            torch.cuda.synchronize()
            counters = bwd._counters(z.device, 1)
            assert int(counters.abs().sum()) == 0, (rows, out)
            _scale_sum_check(rows, out, dt, {"dg": dg, "db": db, "dm": dm}, dy, z, n)
            assert rel_err(dz, dy.double() * g.double()) <= rounded_input_tol(dtype, 1)
            if first is None:
                first = (dg.clone(), db.clone(), dm.clone())
            else:
                assert all(torch.equal(a, b) for a, b in zip(first, (dg, db, dm))), (rows, out)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
@pytest.mark.parametrize("rows, out", [(960, 2304), (960, 6400), (333, 770)])
def test_gpu_scale_backward_one_launch_replayed_from_a_cuda_graph(dt, rows, out):
    """The one-launch scale backward captured in a CUDA graph: replays on fresh dy, z, g and n copied
    into the captured buffers, outputs NaN-filled before each, match float64 every time (the counters
    the graph baked in are back at 0 after each replay)."""
    from lora_bench.kernels import dora_triton_bwd as bwd

    dtype = DTYPE[dt]
    dy, z = fresh(rows, out, device="cuda", dtype=dtype), fresh(rows, out, device="cuda", dtype=dtype)
    g, n = torch.rand(out, device="cuda") + 0.5, torch.rand(out, device="cuda") + 0.5

    def call():
        dz, dg, db, dm = bwd.scale_bias_bwd(dy, z, g, need_dz=True, need_db=True, n=n, m_dtype=torch.float32)
        return {"dz": dz, "dg": dg, "db": db, "dm": dm}

    graph, outs = _capture(call)
    for i in range(4):
        with torch.no_grad():
            dy.copy_(fresh(rows, out, device="cuda", dtype=dtype))
            z.copy_(fresh(rows, out, device="cuda", dtype=dtype))
            g.copy_(torch.rand(out, device="cuda") + 0.5)
            n.copy_(torch.rand(out, device="cuda") + 0.5)
            for t in outs.values():
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _scale_sum_check(rows, out, dt, outs, dy, z, n)
        assert rel_err(outs["dz"], dy.double() * g.double()) <= rounded_input_tol(dtype, 1), f"replay {i}"


# GPT-2's adapted layers (out, in): 124M's attention, its projection and MLP; 1558M's MLP both ways
GPT2_BWD_SHAPES = [(2304, 768, 16), (768, 768, 16), (3072, 768, 16), (768, 3072, 16), (6400, 1600, 16),
                   (1600, 6400, 64), (770, 768, 1)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["fp32", "bf16", "bf16w"])
@pytest.mark.parametrize("out, k, r", GPT2_BWD_SHAPES)
def test_gpu_exact_backward_kernel_matches_float64(dt, out, k, r, monkeypatch):
    """dm, dB, dA and c ⊙ Bᵀ of ``dora_exact_bwd`` at GPT-2's shapes, outputs NaN-poisoned; dA alone too."""
    from lora_bench.kernels import lora_triton

    monkeypatch.setattr(lora_triton, "POISON_OUTPUTS", True)
    bounds = _bwd_bounds(out, r, DTYPE[dt])
    for s in SCALES:
        ops, m_dtype = _bwd_operands(out, k, r, dt, "cuda", s)
        for needs in BWD_NEEDS:
            for name, err in _bwd_errors(ops, m_dtype, s, needs).items():
                assert err <= bounds[name], (name, err, bounds[name], s, needs)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
@pytest.mark.parametrize("out, k, r", [(2304, 768, 16), (6400, 1600, 16), (1600, 6400, 64)])
def test_gpu_exact_backward_kernel_replayed_from_a_cuda_graph(dt, out, k, r):
    """``dora_exact_bwd`` captured in a CUDA graph (warm-up on a side stream): replays on fresh operands
    copied into the captured buffers, outputs NaN-filled before each, match float64 every time."""
    from lora_bench.kernels.dora_triton_bwd import dora_exact_bwd

    s = SCALES[1]
    ops, m_dtype = _bwd_operands(out, k, r, dt, "cuda", s)

    def call():
        return dora_exact_bwd(*ops.values(), s, m_dtype=m_dtype, need_m=True, need_b=True, need_cb=True)[:4]

    graph, outs = _capture(call)
    bounds = _bwd_bounds(out, r, DTYPE[dt])
    for i in range(3):
        fresh_ops, _ = _bwd_operands(out, k, r, dt, "cuda", s)
        with torch.no_grad():
            for name, t in ops.items():
                t.copy_(fresh_ops[name])
            for t in outs:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = _float64_exact_bwd(ops, s)
        for name, got in zip(("dm", "dB", "dA", "cb"), outs):
            assert rel_err(got, want[name]) <= bounds[name], (name, rel_err(got, want[name]), f"replay {i}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-base", "bf16-true"])
@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("rows, k, n, r", [(960, 1600, 6400, 16), (960, 768, 2304, 16), (333, 768, 770, 1),
                                         (129, 640, 384, 64)])
def test_gpu_dora_kernel_layer_matches_float64(mode, detach, rows, k, n, r):
    """Eager: float32 (exact products), bfloat16 autocast over float32 parameters, bf16 mode's layer
    (a bfloat16 frozen W beside float32 adapters, under autocast), bfloat16 parameters; the norm ran
    in the Triton kernel."""
    layer = _mode_cast(_dora_layer(k, n, r, dtype=torch.float32, detach=detach), mode)
    pdt = layer.m.dtype
    x = fresh(rows, k, device="cuda", dtype=pdt).requires_grad_()
    g = fresh(rows, n, device="cuda", dtype=pdt)
    with record_plans() as log, torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode in AUTOCAST_MODES):
        outs = _grads(layer, x, g)
    assert log.dora == {"triton"}, log.dora
    _assert_float64(layer, x, g, outs, _layer_bound(mode, k, n, r, rows), f"{mode} detach={detach}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-base"])
@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("rows, k, n, r", [(960, 1600, 6400, 16), (960, 768, 2304, 16), (333, 768, 770, 1)])
def test_gpu_dora_kernel_layer_replayed_from_a_cuda_graph(mode, detach, rows, k, n, r):
    """Forward and backward captured in a CUDA graph (warm-up on a side stream, as a run's graphs
    are made): replays on fresh x, A, B, m and output gradient copied into the captured buffers match
    float64 every time."""
    from lora_bench.train.graphs import warm_up

    layer = _mode_cast(_dora_layer(k, n, r, dtype=torch.float32, detach=detach), mode)
    x = fresh(rows, k, device="cuda", dtype=torch.float32).requires_grad_()
    g = fresh(rows, n, device="cuda", dtype=torch.float32)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode in AUTOCAST_MODES, cache_enabled=False):
            return _grads(layer, x, g)

    with record_plans() as log:
        warm_up(step, 2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
    assert log.dora == {"triton"}, log.dora
    bound = _layer_bound(mode, k, n, r, rows)
    for i in range(3):
        with torch.no_grad():
            for t in (x, layer.lora.A, layer.lora.B, g):
                t.copy_(fresh(*t.shape, device="cuda", dtype=t.dtype, scale=float(t.std())))
            layer.m.copy_(layer.m * (1 + 0.1 * torch.rand_like(layer.m)))
            for t in outs:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_float64(layer, x, g, outs, bound, f"{mode} detach={detach} replay {i}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-base", "bf16-true"])
@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("rows, k, r", [(960, 768, 16), (960, 1600, 16), (333, 640, 32), (333, 640, 64),
                                         (333, 720, 16)])
def test_gpu_grouped_dora_layers_match_float64(mode, detach, rows, k, r):
    """A block's query, key and value as grouped DoRA layers (k → k each; 720 outputs take blocks of
    16, not the GPU's 64), eager: float32, bfloat16 autocast, bf16 mode's layers, bfloat16
    parameters; the grouped path ran (one DoRA forward launch
    for the three) where the three ranks fit the fused LoRA kernel, else each layer on its own."""
    from lora_bench.kernels import triton_launch
    from lora_bench.kernels.policy import TRITON_MAX_RANK, Plan, PlanPolicy, use_policy

    caller, layers = _dora_group(k, k, r, dtype=torch.float32, detach=detach, bias=True, device="cuda", mode=mode)
    pdt = layers[0].m.dtype
    x = fresh(rows, k, device="cuda", dtype=pdt).requires_grad_()
    gs = [fresh(rows, k, device="cuda", dtype=pdt) for _ in layers]
    # the fused plan, as under CUDA-graph capture (eager CUDA takes the C++ op, one layer at a time)
    with use_policy(PlanPolicy(forced=Plan.FUSED)), record_plans() as log, triton_launch.recording() as rec, \
            torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode in AUTOCAST_MODES):
        outs = _group_grads(caller, layers, x, gs)
    launches = 1 if 3 * r <= TRITON_MAX_RANK else 3
    assert log.dora == {"triton"} and [t for t, *_ in rec].count("dora_fwd") == launches, (log.dora, rec)
    bound = _layer_bound(mode, k, 3 * k, r, rows)
    for name, err in _group_errors(layers, x, gs, outs).items():
        assert err <= bound, (mode, detach, name, err, bound)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-base"])
@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("rows, k, r", [(960, 768, 16), (960, 1600, 16)])
def test_gpu_grouped_dora_layers_replayed_from_a_cuda_graph(mode, detach, rows, k, r):
    """The grouped layers' forward and backward captured in a CUDA graph (warm-up on a side stream),
    where the fused plan runs them as one (one DoRA forward launch for the three): replays on fresh
    x, A's, B's, m's and output gradients copied into the captured buffers match float64 every time.
    Under autocast the policy's own capture plan is the fused one; float32 with exact products is
    captured with cuBLAS's GEMMs, one layer at a time, so there the fused plan is forced."""
    from lora_bench.kernels import triton_launch
    from lora_bench.kernels.policy import Plan, PlanPolicy, use_policy
    from lora_bench.train.graphs import warm_up

    caller, layers = _dora_group(k, k, r, dtype=torch.float32, detach=detach, bias=True, device="cuda", mode=mode)
    x = fresh(rows, k, device="cuda", dtype=torch.float32).requires_grad_()
    gs = [fresh(rows, k, device="cuda", dtype=torch.float32) for _ in layers]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode in AUTOCAST_MODES, cache_enabled=False):
            return _group_grads(caller, layers, x, gs)

    forced = use_policy(PlanPolicy(forced=Plan.FUSED)) if mode == "fp32" else contextlib.nullcontext()
    with forced, record_plans() as log:
        warm_up(step, 2)
        graph = torch.cuda.CUDAGraph()
        with triton_launch.recording() as rec, torch.cuda.graph(graph):
            outs = step()
    assert log.dora == {"triton"} and [t for t, *_ in rec].count("dora_fwd") == 1, (log.dora, rec)
    bound = _layer_bound(mode, k, 3 * k, r, rows)
    for i in range(3):
        with torch.no_grad():
            for t in (x, *gs, *[p for m in layers for p in (m.lora.A, m.lora.B)]):
                t.copy_(fresh(*t.shape, device="cuda", dtype=t.dtype, scale=float(t.std())))
            for m in layers:
                m.m.copy_(m.m * (1 + 0.1 * torch.rand_like(m.m)))
            for t in outs:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for name, err in _group_errors(layers, x, gs, outs).items():
            assert err <= bound, (mode, detach, name, err, bound, f"replay {i}")
