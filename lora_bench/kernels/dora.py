"""DoRA in the fused layer: y = g ⊙ z + b, with z = x·Wᵀ + s·(x·A)·B from the LoRA op and the per-output
scale g = m / n, n_j = ‖W_j + s·(A·B)_j‖ (docs/variants.md#dora-in-the-fused-layer). ``dora_output``
computes it with ``DoRAFunction``, on the path ``norm_path`` chooses for the call (noted:
``PlanLog.dora``): ``triton`` on CUDA (:mod:`lora_bench.kernels.dora_triton` and ``dora_triton_bwd``),
``torch`` ops elsewhere.

The norm needs no merged weight: ‖W_j‖² (fixed while W is frozen, else read anew), ⟨W_j, (A·B)_j⟩
from W·A (out × r) and ‖(A·B)_j‖² from A's r × r Gram matrix. On the Triton path the norm and the
scale are two launches forward. Backward, written out: the scale's dz = dy ⊙ g, dg = Σ_rows dy ⊙ z,
db = Σ_rows dy (one Triton launch, four torch ops), then the norm's (one or two Triton launches, a
trained W's dW aside): dm = dg / n and, with the exact norm, c = dn / (2n), dn = −dg·m / n²,
dBᵀ_j = 2s·c_j·(W·A)_j + 2s²·c_j·(AᵀA·B)_j, dA = 2s·Wᵀ·(c ⊙ Bᵀ) + 2s²·A·(B·diag(c)·Bᵀ) and, for a
trained W, dW = 2·c ⊙ W + 2s·(c ⊙ Bᵀ)·Aᵀ: a frozen W is read once forward (W·A) and once backward
(Wᵀ times an out × r matrix), and no out × in matrix is formed. ``detached``: the norm is a
constant in backward (dm only). The norm runs in float32 (a 16-bit W and A are read as they are
stored, their products accumulated in float32; a float64 W in float64). A is read in W's dtype: in
bf16 mode (a bfloat16 W, a float32 A under autocast) it is rounded to bfloat16 for W·A and its Gram
matrix, as the LoRA op under autocast rounds it for x·A. z (N × out) is kept for dg.
"""

from __future__ import annotations

import torch

from lora_bench.kernels import available
from lora_bench.kernels.autograd import cast, outside_autocast
from lora_bench.kernels.policy import note_dora
from lora_bench.kernels.segments import stacked

TRITON = "triton"
TORCH = "torch"
TRITON_NORM_MAX_RANK = 64  # A's Gram matrix (r × r, float32) lives in registers beside W·A's tile
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_norm():
    """DoRA's Triton kernels (``lora_bench.kernels.dora_triton``), or None where Triton is unavailable
    (``available.triton_kernels``: probed once, forgotten with ``available.forget``)."""
    if available.triton_kernels() is None:
        return None
    from lora_bench.kernels import dora_triton

    return dora_triton


def triton_bwd():
    """DoRA's backward Triton kernels (``lora_bench.kernels.dora_triton_bwd``): asked for only where
    ``triton_norm`` ran the forward."""
    from lora_bench.kernels import dora_triton_bwd

    return dora_triton_bwd


def norm_path(weight: torch.Tensor, a: torch.Tensor) -> str:
    """Where the norm (and the scale) of a layer call with this weight and A runs, noted in the plan
    log: ``triton`` (two launches forward) on CUDA, or under Triton's CPU interpreter, where Triton is
    there and the call fits its kernel, else ``torch`` with the reason."""
    if torch.compiler.is_compiling():
        return _traced_norm_path()
    why = triton_refusal(weight, a)
    path = TRITON if why is None else TORCH
    note_dora(path if why is None else f"{TORCH}: {why}")
    return path


def triton_refusal(weight: torch.Tensor, a: torch.Tensor) -> str | None:
    """Why the norm of a call with this weight and A cannot run on the Triton kernels (None: it can)."""
    if weight.dtype not in TRITON_DTYPES or a.dtype not in TRITON_DTYPES:
        return f"the kernel takes W and A in float32, bfloat16 or float16, not {weight.dtype} and {a.dtype}"
    if a.shape[1] > TRITON_NORM_MAX_RANK:
        return f"rank {a.shape[1]} is above the kernel's {TRITON_NORM_MAX_RANK}"
    if not (weight.is_cuda or available.interpreting()):
        return "the CPU"
    if triton_norm() is None:
        return "Triton is unavailable"
    return None


def norm_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the norm and its backward compute in: float32, or float64 for a float64 weight."""
    return torch.promote_types(weight.dtype, torch.float32)


def norm_torch(weight: torch.Tensor, weight_sq: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
               m: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """The norm's forward with torch ops (four products and a few elementwise ones), in ``norm_dtype``:
    n (out), g = m / n (out), cn = −m / (2n³) (out: dg·cn is the c of the module docstring) and vᵀ
    (r × out) with v = 2s·(W·A) + 2s²·(Bᵀ·AᵀA), so that the exact backward's dB = vᵀ ⊙ c."""
    acc = norm_dtype(weight)
    bt = b.t().to(acc)  # (out, r)
    a = cast(a, weight.dtype)  # read in W's dtype, as the Triton kernel reads it (bf16 mode: a 16-bit W, fp32 A)
    wa = (weight @ a).to(acc)  # (out, r): the one pass over W
    btg = bt @ (a.t() @ a).to(acc)  # (out, r): Bᵀ times A's Gram matrix
    wsq = weight.to(acc).pow(2).sum(1) if weight_sq is None else weight_sq.to(acc)
    sq = wsq + (2 * scale) * (wa * bt).sum(1) + (scale * scale) * (btg * bt).sum(1)
    n = sq.clamp_min(0).sqrt()
    g = m.to(acc) / n
    return n, g, -0.5 * g / n.square(), ((2 * scale) * wa + (2 * scale * scale) * btg).t().contiguous()


COMPILED = f"{TORCH}: torch.compile traces torch ops (inductor fuses the elementwise ones)"


@torch.compiler.assume_constant_result
def _traced_norm_path() -> str:
    """The norm's path in a layer call torch.compile traces (run once, at trace time, and noted then)."""
    note_dora(COMPILED)
    return TORCH


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., n) as rows (N × n) whose elements lie one after the other (a copy only where not)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class DoRAFunction(torch.autograd.Function):
    """y = g ⊙ z + b with g = m / ‖W + s·(A·B)ᵀ‖ per output, its backward written out (module
    docstring). Inputs: z (..., out) from the LoRA op, weight (out × in), weight_sq (‖W_j‖², float32)
    or None (taken from W: a trained W), A (in × r), B (r × out), m (out), bias (out) or None, scale,
    exact (differentiate through the norm), path (``norm_path``), and on the Triton path the norm's
    (n, g, cn, vᵀ) formed before the call or None (``dora_ahead``: then the forward launches the
    scale alone), or those and y, scaled in the LoRA GEMM's epilogue (``dora_ahead.EpilogueScale``:
    then it launches nothing). y in z's dtype.

    Triton path: forward ``dora_forward``'s two launches (the norm's parts, then the norm and
    g ⊙ z + b, g and b read as they are); backward the scale's one (dz, dg, db; with the detached norm dm too), then
    with the exact norm dm, dB and dA in ``dora_exact_bwd``'s two (it gives c ⊙ Bᵀ too where a
    trained W needs dW, which torch ops take from it). Torch ops: the norm four products and a few
    elementwise ops, the scale one ``addcmul`` (and casts of g and b to z's dtype where they
    differ); backward the scale's four ops, then dm one; c,
    dB and c ⊙ Bᵀ three more; dA three (two r-wide products and one ``addmm`` over Wᵀ); dW for a
    trained W. Sums in float32 (or float64)."""

    @staticmethod
    def forward(ctx, z, weight, weight_sq, A, B, m, bias, scale, exact, path, ahead=None):
        s = float(scale)
        dev = weight.device.type
        if path == TRITON:
            z2 = _rows(z)
            if ahead is None:
                y, n, g, cn, vt = triton_norm().dora_forward(z2, weight, A, B, m, bias, s)
            else:  # the norm formed before the call (lora_bench.kernels.dora_ahead): the scale alone
                y, n, g, cn, vt = _formed(ahead, z2, bias)
            y, zs, gs = y.view(z.shape), z2, g
        else:
            with torch.autocast(dev, enabled=False):
                n, g, cn, vt = norm_torch(weight, weight_sq, A, B, m, s)
            zs, gs = z, cast(g, z.dtype)
            y = z * gs if bias is None else torch.addcmul(cast(bias, z.dtype), z, gs)
        if exact:
            ctx.save_for_backward(zs, gs, weight, A, B, n, cn, vt)
        else:
            ctx.save_for_backward(zs, gs, n)
        ctx.scale, ctx.exact, ctx.dev, ctx.path = s, bool(exact), dev, path
        ctx.dtypes = (weight.dtype, A.dtype, B.dtype, m.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        return outside_autocast(DoRAFunction._backward, ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        need_z, need_w, _, need_a, need_b, need_m, need_bias = ctx.needs_input_grad[:7]
        b_dt = ctx.dtypes[4]
        need_bias = need_bias and b_dt is not None
        z, gz, *norm = ctx.saved_tensors
        if not ctx.exact:
            need_w = need_a = need_b = False
        need_g = need_m or need_w or need_a or need_b
        grad_w = grad_a = grad_b = grad_m = None
        if ctx.path == TRITON and not ctx.exact and need_m:  # dm = dg / n in the scale's own launch
            dz, _, db, grad_m = triton_bwd().scale_bias_bwd(_rows(cast(dy, z.dtype)), z, gz, need_dz=need_z,
                                                             need_db=need_bias, n=norm[0], m_dtype=ctx.dtypes[3])
            dz = None if dz is None else dz.view(dy.shape)
            return dz, None, None, None, None, grad_m, cast(db, b_dt), None, None, None, None
        if ctx.path == TRITON and ctx.exact and need_a and not need_w:
            dz, grad_m, grad_b, grad_a, db = _exact_backward(dy, z, gz, norm, ctx.scale, m_dtype=ctx.dtypes[3],
                                                             need_dz=need_z, need_bias=need_bias, need_m=need_m,
                                                             need_b=need_b)
            return dz, None, None, grad_a, grad_b, grad_m, cast(db, b_dt), None, None, None, None
        dz, dg, db = _scale_backward(ctx.path, dy, z, gz, need_z=need_z, need_g=need_g, need_bias=need_bias)
        if need_g:
            grad_w, grad_a, grad_b, grad_m = _norm_backward(ctx, norm, dg, need_w=need_w, need_a=need_a,
                                                            need_b=need_b, need_m=need_m)
        return dz, grad_w, None, grad_a, grad_b, grad_m, cast(db, b_dt), None, None, None, None


def _exact_backward(dy, z, g, norm, scale: float, *, m_dtype: torch.dtype, need_dz: bool, need_bias: bool,
                    need_m: bool, need_b: bool) -> tuple[torch.Tensor | None, ...]:
    """The Triton path's whole backward with the exact norm (no trained W): the scale's first launch
    (dz and the blocks of rows' parts of dg and db), then the norm's, which adds those parts where it
    reads them. ``norm``: the saved (W, A, B, n, cn, vᵀ). Returns (dz in dy's shape, dm, dB, dA, db),
    each in its parameter's dtype, None where not asked for (db: float32)."""
    weight, a, b, n, cn, vt = norm
    dz, pg, pb, _ = triton_bwd().scale_bias_bwd(_rows(cast(dy, z.dtype)), z, g, need_dz=need_dz, need_db=need_bias,
                                                sums=False)
    grad_m, grad_b, grad_a, _, db = triton_bwd().dora_exact_bwd(
        pg, n, cn, vt, weight, a, b, scale, m_dtype=m_dtype, need_m=need_m, need_b=need_b, need_cb=False,
        bias_parts=pb)
    return None if dz is None else dz.view(dy.shape), grad_m, grad_b, grad_a, db


def _scale_backward(path: str, dy: torch.Tensor, z: torch.Tensor, gz: torch.Tensor, *, need_z: bool, need_g: bool,
                    need_bias: bool) -> tuple[torch.Tensor | None, ...]:
    """y = g ⊙ z + b's backward: (dz = dy ⊙ g in z's dtype, dg = Σ_rows dy ⊙ z, db = Σ_rows dy, summed in
    float32 or float64), None where not asked for; ``triton``: one launch (z as rows, g as stored;
    it gives dg always), else four torch ops (``gz``: g in z's dtype)."""
    if path == TRITON:
        dz, dg, db, _ = triton_bwd().scale_bias_bwd(_rows(cast(dy, z.dtype)), z, gz, need_dz=need_z,
                                                     need_db=need_bias)
        return None if dz is None else dz.view(dy.shape), dg, db
    dy = cast(dy, z.dtype)
    rows = dy.reshape(-1, dy.shape[-1])
    acc = torch.promote_types(z.dtype, torch.float32)
    dz = dy * gz if need_z else None
    dg = (rows * z.reshape(rows.shape)).sum(0, dtype=acc) if need_g else None
    db = rows.sum(0, dtype=acc) if need_bias else None
    return dz, dg, db


def _norm_backward(ctx, saved: list[torch.Tensor], grad_g: torch.Tensor, *, need_w: bool, need_a: bool,
                   need_b: bool, need_m: bool) -> tuple[torch.Tensor | None, ...]:
    """g = m / n's backward from dg: (dW, dA, dB, dm), None where not asked for (module docstring);
    ``saved``: (W, A, B, n, cn, vᵀ) with the exact norm, (n,) with the detached one."""
    w_dt, a_dt, b_dt, m_dt, _ = ctx.dtypes
    s = ctx.scale
    if ctx.exact:
        weight, A, B, n, cn, vt = saved
    else:  # the norm is a constant: dm alone
        (n,) = saved
        cn = vt = B = n  # (unread)
    acc = n.dtype
    dg = grad_g if grad_g.dtype is acc else grad_g.to(acc)
    grad_w = grad_a = grad_b = grad_m = cb = None
    if ctx.path == TRITON:
        dg = dg.contiguous()  # the kernels read dg's elements one after the other
        if need_a:  # dm, dB, dA (and c ⊙ Bᵀ for dW) in two launches
            grad_m, grad_b, grad_a, cb, _ = triton_bwd().dora_exact_bwd(
                dg, n, cn, vt, weight, A, B, s, m_dtype=m_dt, need_m=need_m, need_b=need_b, need_cb=need_w)
        else:  # dm, dB and c ⊙ Bᵀ in one launch
            grad_m, grad_b, cb = triton_bwd().dora_norm_bwd(dg, n, cn, vt, B, m_dtype=m_dt, need_m=need_m,
                                                             need_b=need_b, need_cb=need_w)
    else:
        if need_m:
            grad_m = cast(dg / n, m_dt)
        if need_b or need_a or need_w:
            c = dg * cn  # dn / (2n), dn = −dg·m / n²
            if need_b:
                grad_b = cast(vt * c, b_dt)  # 2s·c ⊙ (W·A)ᵀ + 2s²·c ⊙ (Bᵀ·AᵀA)ᵀ
            if need_a or need_w:
                cb = c[:, None] * cast(B, acc).t()  # (out, r): c ⊙ Bᵀ
        if need_a:  # 2s·Wᵀ·(c ⊙ Bᵀ) + 2s²·A·(B·diag(c)·Bᵀ): the backward's one pass over W
            gram = cast(A, acc) @ (cast(B, acc) @ cb)
            if w_dt is acc:
                grad_a = torch.addmm(gram, weight.t(), cb, beta=2 * s * s, alpha=2 * s)
            else:  # a 16-bit W: read as it is stored
                grad_a = gram.mul_(2 * s * s).add_(weight.t() @ cast(cb, w_dt), alpha=2 * s)
            grad_a = cast(grad_a, a_dt)
    if need_w:  # a trained W (the head): 2·c ⊙ W + 2s·(c ⊙ Bᵀ)·Aᵀ, out × in anyway
        w_c = cast(weight, acc) * (dg * cn)[:, None]
        grad_w = cast(torch.addmm(w_c, cb, cast(A, acc).t(), beta=2, alpha=2 * s), w_dt)
    return grad_w, grad_a, grad_b, grad_m


class DoRASegmentsFunction(torch.autograd.Function):
    """S DoRA layers side by side (one input, so one z): y (..., S·n) = g ⊙ z + b over all S·n outputs,
    layer i's in columns [i·n, (i+1)·n), each layer's g from its own W rows, A, B and m. The Triton
    path only (``DoRAFunction``'s kernels over S segments: the launches of one layer, forward and
    backward). Inputs after z: the scale, S, whether the layers
    have biases, exact, the S norms formed before the call or None (``DoRAFunction``'s), W (S·n × in,
    the layers' frozen weights side by side), then the S m's, the S
    biases (``has_bias``), the S A's and the S B's one by one, so that autograd hands each its own
    gradient; the kernels read them through their stacked views (``segments.stacked``: the caller
    checked that they lie back to back)."""

    @staticmethod
    def forward(ctx, z, scale, segments, has_bias, exact, ahead, weight, *params):
        S = segments
        ms, bs = params[:S], (params[S:2 * S] if has_bias else None)
        As, Bs = params[S + S * has_bias:2 * S + S * has_bias], params[2 * S + S * has_bias:]
        m3 = stacked(list(ms)).reshape(-1)
        bias3 = stacked(list(bs)).reshape(-1) if has_bias else None
        a3, b3 = stacked(list(As)), stacked(list(Bs))
        s = float(scale)
        z2 = _rows(z)
        if ahead is None:
            y, n, g, cn, vt = triton_norm().dora_forward(z2, weight, a3, b3, m3, bias3, s)
        else:  # the S norms formed before the call (lora_bench.kernels.dora_ahead): the scale alone
            y, n, g, cn, vt = _formed(ahead, z2, bias3)
        if exact:
            ctx.save_for_backward(z2, g, weight, a3, b3, n, cn, vt)
        else:
            ctx.save_for_backward(z2, g, n)
        ctx.scale, ctx.exact, ctx.segments, ctx.has_bias = s, bool(exact), S, has_bias
        ctx.dev = weight.device.type
        ctx.dtypes = (ms[0].dtype, bs[0].dtype if has_bias else None, As[0].dtype, Bs[0].dtype)
        return y.view(z.shape)

    @staticmethod
    def backward(ctx, dy):
        return outside_autocast(DoRASegmentsFunction._backward, ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        S, s = ctx.segments, ctx.scale
        m_dt, bias_dt, a_dt, b_dt = ctx.dtypes
        z, g, *norm = ctx.saved_tensors
        need = ctx.needs_input_grad
        first = 7  # z, scale, segments, has_bias, exact, ahead, weight
        need_m = any(need[first:first + S])
        need_ab = ctx.exact and any(need[first + S * (1 + ctx.has_bias):])
        need_bias = ctx.has_bias and any(need[first + S:first + 2 * S])
        alone = need_m and not need_ab  # dm alone (the detached norm): in the scale's own launch
        n = norm[3] if ctx.exact else norm[0]
        if need_ab:
            dz, grad_m, grad_b, grad_a, db = _exact_backward(dy, z, g, norm, s, m_dtype=m_dt, need_dz=need[0],
                                                             need_bias=need_bias, need_m=need_m, need_b=True)
        else:
            dz, _, db, grad_m = triton_bwd().scale_bias_bwd(_rows(cast(dy, z.dtype)), z, g, need_dz=need[0],
                                                             need_db=need_bias, n=n if alone else None,
                                                             m_dtype=m_dt)
            dz = None if dz is None else dz.view(dy.shape)
            grad_a = grad_b = None
        per_m = (None,) * S if grad_m is None else grad_m.view(S, -1).unbind(0)
        per_b = (None,) * S if db is None else cast(db, bias_dt).view(S, -1).unbind(0)
        per_a = (None,) * S if grad_a is None else cast(grad_a, a_dt).unbind(0)
        per_bb = (None,) * S if grad_b is None else cast(grad_b, b_dt).unbind(0)
        return (dz, None, None, None, None, None, None, *per_m, *(per_b if ctx.has_bias else ()), *per_a, *per_bb)


def _formed(ahead: tuple, z2: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """(y, n, g, cn, vᵀ) from a norm formed ahead: (n, g, cn, vᵀ), y then scaled here (one launch), or
    (n, g, cn, vᵀ, y), y from the LoRA GEMM's epilogue."""
    if len(ahead) == 5:
        n, g, cn, vt, y = ahead
        return y, n, g, cn, vt
    n, g, cn, vt = ahead
    return triton_norm().dora_scale(z2, g, bias), n, g, cn, vt


def dora_output(z: torch.Tensor, weight: torch.Tensor, weight_sq: torch.Tensor | None, A: torch.Tensor,
                B: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None, *, scale: float,
                exact: bool, ahead: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """y = g ⊙ z + b with g = m / ‖W + s·(A·B)ᵀ‖ (``DoRAFunction``) on the path ``norm_path`` chooses
    (noted). ``weight_sq``: ‖W_j‖² of a frozen W (None: read from W). ``ahead``: the norm's (n, g, cn,
    vᵀ) formed before the call (:mod:`lora_bench.kernels.dora_ahead`), used on the Triton path."""
    path = norm_path(weight, A)
    return DoRAFunction.apply(z, weight, weight_sq, A, B, m, bias, scale, exact, path,
                              ahead if path == TRITON else None)


__all__ = ["COMPILED", "DoRAFunction", "DoRASegmentsFunction", "TRITON_NORM_MAX_RANK", "dora_output", "norm_dtype",
           "norm_path", "norm_torch", "triton_bwd", "triton_norm", "triton_refusal"]
