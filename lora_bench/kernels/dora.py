"""DoRA in the fused layer: y = g ⊙ z + b, with z = x·Wᵀ + s·(x·A)·B from the LoRA op and the per-output
scale g = m / n, n_j = ‖W_j + s·(A·B)_j‖ (docs/variants.md#dora-in-the-fused-layer).

``dora_scale`` gives g. Its forward takes the norm without the merged weight: ‖W_j‖² (fixed while W
is frozen, else read anew), ⟨W_j, (A·B)_j⟩ from W·A (out × r) and ‖(A·B)_j‖² from A's r × r Gram
matrix; in one Triton launch on CUDA (:mod:`lora_bench.kernels.dora_triton`), with torch ops elsewhere.
Its backward is written out: dm = dg / n and, with the exact norm, c = dn / (2n), dn = −dg·m / n²,
dBᵀ_j = 2s·c_j·(W·A)_j + 2s²·c_j·(AᵀA·B)_j, dA = 2s·Wᵀ·(c ⊙ Bᵀ) + 2s²·A·(B·diag(c)·Bᵀ) and, for a
trained W, dW = 2·c ⊙ W + 2s·(c ⊙ Bᵀ)·Aᵀ: a frozen W is read once forward (W·A) and once backward
(Wᵀ times an out × r matrix), and no out × in matrix is formed. ``detached``: the norm is a
constant in backward (dm only). The norm runs in float32 (a 16-bit W and A are read as they are
stored, their products accumulated in float32; a float64 W in float64); g and n come in that dtype.

``scale_bias`` gives y = g ⊙ z + b in one launch; its backward dz = dy ⊙ g, dg = Σ_rows dy ⊙ z,
db = Σ_rows dy. It keeps z (N × out) for dg.

``norm_path`` says where the norm runs for a call, and notes it (``PlanLog.dora``).
"""

from __future__ import annotations

import functools

import torch

from lora_bench.kernels import available
from lora_bench.kernels.autograd import outside_autocast
from lora_bench.kernels.policy import note_dora

TRITON = "triton"
TORCH = "torch"
TRITON_NORM_MAX_RANK = 64  # A's Gram matrix (r × r, float32) lives in registers beside W·A's tile
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def triton_norm():
    """The Triton norm module (``lora_bench.kernels.dora_triton``), or None without Triton."""
    if available.triton_kernels() is None:
        return None
    from lora_bench.kernels import dora_triton

    return dora_triton


def norm_path(weight: torch.Tensor, a: torch.Tensor) -> str:
    """Where the norm of a layer call with this weight and A runs, noted in the plan log: ``triton``
    (one launch) on CUDA, or under Triton's CPU interpreter, where Triton is there and the call
    fits its kernel, else ``torch`` with the reason."""
    if torch.compiler.is_compiling():
        return _traced_norm_path()
    why = None
    if weight.dtype not in TRITON_DTYPES or a.dtype is not weight.dtype:
        why = f"the kernel takes W and A in one of float32, bfloat16, float16, not {weight.dtype} and {a.dtype}"
    elif a.shape[1] > TRITON_NORM_MAX_RANK:
        why = f"rank {a.shape[1]} is above the kernel's {TRITON_NORM_MAX_RANK}"
    elif not (weight.is_cuda or available.interpreting()):
        why = "the CPU"
    elif triton_norm() is None:
        why = "Triton is unavailable"
    path = TRITON if why is None else TORCH
    note_dora(path if why is None else f"{TORCH}: {why}")
    return path


def norm_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the norm and its backward compute in: float32, or float64 for a float64 weight."""
    return torch.promote_types(weight.dtype, torch.float32)


def norm_torch(weight: torch.Tensor, weight_sq: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
               m: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """(n, g, W·A, Bᵀ·AᵀA) in ``norm_dtype`` with torch ops: four products and a few elementwise ones."""
    acc = norm_dtype(weight)
    bt = b.t().to(acc)  # (out, r)
    wa = (weight @ a).to(acc)  # (out, r): the one pass over W
    btg = bt @ (a.t() @ a).to(acc)  # (out, r): Bᵀ times A's Gram matrix
    wsq = weight.to(acc).pow(2).sum(1) if weight_sq is None else weight_sq.to(acc)
    sq = wsq + (2 * scale) * (wa * bt).sum(1) + (scale * scale) * (btg * bt).sum(1)
    n = sq.clamp_min(0).sqrt()
    return n, m.to(acc) / n, wa, btg


COMPILED = f"{TORCH}: torch.compile traces torch ops (inductor fuses the elementwise ones)"


@torch.compiler.assume_constant_result
def _traced_norm_path() -> str:
    """The norm's path in a layer call torch.compile traces (run once, at trace time, and noted then)."""
    note_dora(COMPILED)
    return TORCH


class DoRAScaleFunction(torch.autograd.Function):
    """g = m / ‖W + s·(A·B)ᵀ‖ per output, its backward written out (module docstring). Inputs: weight
    (out × in), weight_sq (‖W_j‖², float32) or None (taken from W: a trained W), A (in × r), B
    (r × out), m (out), scale, exact (differentiate through the norm), path (``norm_path``)."""

    @staticmethod
    def forward(ctx, weight, weight_sq, A, B, m, scale, exact, path):
        s = float(scale)
        dev = weight.device.type
        with torch.autocast(dev, enabled=False):
            if path == TRITON:
                n, g, wa, btg = triton_norm().dora_norm(weight, A, B, m, s)
            else:
                n, g, wa, btg = norm_torch(weight, weight_sq, A, B, m, s)
        ctx.save_for_backward(weight, A, B, m, n, wa, btg)
        ctx.scale, ctx.exact, ctx.dev = s, bool(exact), dev
        return g

    @staticmethod
    def backward(ctx, grad_g):
        return outside_autocast(DoRAScaleFunction._backward, ctx, grad_g)

    @staticmethod
    def _backward(ctx, grad_g):
        weight, A, B, m, n, wa, btg = ctx.saved_tensors
        need_w, _, need_a, need_b, need_m = ctx.needs_input_grad[:5]
        s = ctx.scale
        acc = n.dtype
        dg = grad_g.to(acc)
        grad_w = grad_a = grad_b = grad_m = None
        if need_m:
            grad_m = (dg / n).to(m.dtype)
        if ctx.exact and (need_w or need_a or need_b):
            c = -dg * m.to(acc) / (2 * n.pow(3))  # dn / (2n), dn = −dg·m / n²
            cb = c[:, None] * B.t().to(acc)  # (out, r): c ⊙ Bᵀ
            if need_b:
                grad_b = ((2 * s) * c[:, None] * wa + (2 * s * s) * c[:, None] * btg).t().contiguous().to(B.dtype)
            if need_a:
                gram_c = B.to(acc) @ cb  # B·diag(c)·Bᵀ (r × r)
                ga = weight.t() @ cb.to(weight.dtype)  # the backward's one pass over W
                grad_a = ((2 * s) * ga.to(acc) + (2 * s * s) * (A.to(acc) @ gram_c)).to(A.dtype)
            if need_w:  # a trained W (the head): its gradient is out × in anyway
                grad_w = (2 * c[:, None] * weight.to(acc) + (2 * s) * (cb @ A.to(acc).t())).to(weight.dtype)
        return grad_w, None, grad_a, grad_b, grad_m, None, None, None


def dora_scale(weight, weight_sq, A, B, m, scale: float, *, exact: bool) -> torch.Tensor:
    """g = m / ‖W + s·(A·B)ᵀ‖ per output (float32), through ``DoRAScaleFunction`` on the path
    ``norm_path`` chooses. ``weight_sq``: ‖W_j‖² of a frozen W (None: read from W)."""
    path = norm_path(weight, A)
    return DoRAScaleFunction.apply(weight, weight_sq, A, B, m, scale, exact, path)


class ScaleBiasFunction(torch.autograd.Function):
    """y = g ⊙ z + b (z (..., out), g (out), b (out) or None), in z's dtype: one launch forward;
    backward dz = dy ⊙ g, dg = Σ_rows dy ⊙ z and db = Σ_rows dy, summed in float32 (or float64)."""

    @staticmethod
    def forward(ctx, z, g, bias):
        gz = g.to(z.dtype)
        y = z * gz if bias is None else torch.addcmul(bias.to(z.dtype), z, gz)
        ctx.save_for_backward(z, gz)
        ctx.dtypes = (g.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        z, gz = ctx.saved_tensors
        g_dt, b_dt = ctx.dtypes
        need_z, need_g, need_b = ctx.needs_input_grad
        dy = dy.to(z.dtype)
        rows = dy.reshape(-1, dy.shape[-1])
        acc = torch.promote_types(z.dtype, torch.float32)
        grad_z = dy * gz if need_z else None
        grad_g = (rows * z.reshape(rows.shape)).sum(0, dtype=acc).to(g_dt) if need_g else None
        grad_b = rows.sum(0, dtype=acc).to(b_dt) if need_b and b_dt is not None else None
        return grad_z, grad_g, grad_b


def scale_bias(z: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = g ⊙ z + b through ``ScaleBiasFunction``."""
    return ScaleBiasFunction.apply(z, g, bias)


__all__ = ["DoRAScaleFunction", "ScaleBiasFunction", "TRITON_NORM_MAX_RANK", "dora_scale", "norm_dtype", "norm_path",
           "norm_torch", "scale_bias", "triton_norm"]
