"""A Triton kernel for ``train.packed_adamw.PackedAdamW``: the AdamW update of one stacked
parameter (its N points along the first axis), each point with its own learning rate and weight
decay, in one launch over all N points.

The update is ``torch.optim.AdamW``'s (the fused CUDA kernel's order of operations), in float32:
decay ``p -= lr·wd·p``; moments ``m = β1·m + (1-β1)·g``, ``v = β2·v + (1-β2)·g²``; step
``p -= lr/(1-β1ᵗ) · m / (√v/√(1-β2ᵗ) + ε)``. The step count ``t`` is read from the device (a
capturable optimizer's), so a CUDA graph that replays the launch takes every step's own count.
``β^t`` is computed as ``exp2(t·log2 β)`` with ``log2 β`` from the host in double precision.

This module imports Triton; import it lazily (``lora_bench.kernels.available`` does for the
LoRA kernels; ``PackedAdamW`` does on its first CUDA step).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lora_bench.kernels.triton_launch import launch

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _packed_adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, lr_ptr, wd_ptr, step_ptr, per_point,
                         beta1, beta2, eps, log2_beta1, log2_beta2, BLOCK: tl.constexpr):
    point = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < per_point
    at = point.to(tl.int64) * per_point + offs
    lr = tl.load(lr_ptr + point)
    wd = tl.load(wd_ptr + point)
    step = tl.load(step_ptr)
    bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    p = tl.load(p_ptr + at, mask=mask)
    g = tl.load(g_ptr + at, mask=mask)
    m = tl.load(m_ptr + at, mask=mask)
    v = tl.load(v_ptr + at, mask=mask)
    p = p - lr * wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - (lr / bias_correction1) * m / denom
    tl.store(p_ptr + at, p, mask=mask)
    tl.store(m_ptr + at, m, mask=mask)
    tl.store(v_ptr + at, v, mask=mask)


def packed_adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lrs: torch.Tensor,
                  wds: torch.Tensor, step: torch.Tensor, *, beta1: float, beta2: float, eps: float) -> None:
    """Update ``p``, ``m``, ``v`` in place (all float32, contiguous, on one CUDA device, of one
    shape (N, ...)); ``lrs``, ``wds``: (N,) float32; ``step``: the 0-d float32 step count, already
    counting this step."""
    n = p.shape[0]
    per_point = p.numel() // n
    launch(_packed_adamw_kernel, (n, triton.cdiv(per_point, BLOCK), 1), (p, g, m, v, lrs, wds, step), (per_point,),
           (float(beta1), float(beta2), float(eps), math.log2(beta1), math.log2(beta2)), (BLOCK,),
           tag="packed_adamw", num_warps=NUM_WARPS, num_stages=1)
