"""Triton kernels for AdamW's update, each one launch:

- ``packed_adamw_`` for ``train.packed_adamw.PackedAdamW``: one stacked parameter (its N points
  along the first axis), each point with its own learning rate and weight decay;
- ``adamw_tensors_`` for ``train.one_launch_adamw.OneLaunchAdamW``: every tensor of a list, found
  through a table of their addresses, so a model's hundreds of small adapter tensors take one
  launch with every block busy instead of a few dozen tensors per launch.

The update is ``torch.optim.AdamW``'s (the fused CUDA kernel's order of operations), in float32:
decay ``p -= lr·wd·p``; moments ``m = β1·m + (1-β1)·g``, ``v = β2·v + (1-β2)·g²`` (``1-β`` from the
host, in double precision); step
``p -= lr/(1-β1ᵗ) · m / (√v/√(1-β2ᵗ) + ε)``. The step count ``t`` is read from the device (a
capturable optimizer's), so a CUDA graph that replays the launch takes every step's own count.
The bias corrections ``1 - β^t`` come from ``t·ln β`` (``ln β`` from the host in double precision)
without cancellation (``_one_minus_pow``).

This module imports Triton; import it lazily (``lora_bench.kernels.available`` does for the
LoRA kernels; the optimizers do on their first CUDA step).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lora_bench.kernels.triton_launch import launch

BLOCK = 1024
NUM_WARPS = 4
# the columns of adamw_tensors_'s table, one row per tensor: the addresses of the parameter, its
# gradient, its two moments and the bfloat16 parameter to write, then its number of elements
TABLE_COLUMNS = 6


@triton.jit
def _one_minus_pow(ln_beta, step):
    """``1 - β^t`` in float32 without the cancellation of ``1 - exp(t·ln β)`` near t·ln β = 0 (where
    it loses all but a few bits: 1 - 0.999 in float32 is 1.3e-5 off): ``-expm1(x)`` by its series
    for |x| < 0.5 (nine terms, below float32's rounding there), ``1 - exp(x)`` beyond."""
    x = step * ln_beta
    series = x / 9.0 + 1.0
    series = x / 8.0 * series + 1.0
    series = x / 7.0 * series + 1.0
    series = x / 6.0 * series + 1.0
    series = x / 5.0 * series + 1.0
    series = x / 4.0 * series + 1.0
    series = x / 3.0 * series + 1.0
    series = x / 2.0 * series + 1.0
    return tl.where(x > -0.5, -(x * series), 1.0 - tl.exp(x))


@triton.jit
def _adamw(p, g, m, v, lr, wd, step, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, ln_beta1, ln_beta2):
    bias_correction1 = _one_minus_pow(ln_beta1, step)
    bias_correction2_sqrt = tl.sqrt(_one_minus_pow(ln_beta2, step))
    p = p - lr * wd * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - (lr / bias_correction1) * m / denom
    return p, m, v


@triton.jit
def _packed_adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, lr_ptr, wd_ptr, step_ptr, per_point,
                         beta1, beta2, one_minus_beta1, one_minus_beta2, eps, ln_beta1, ln_beta2,
                         BLOCK: tl.constexpr):
    point = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < per_point
    at = point.to(tl.int64) * per_point + offs
    p, m, v = _adamw(tl.load(p_ptr + at, mask=mask), tl.load(g_ptr + at, mask=mask), tl.load(m_ptr + at, mask=mask),
                     tl.load(v_ptr + at, mask=mask), tl.load(lr_ptr + point), tl.load(wd_ptr + point),
                     tl.load(step_ptr), beta1, beta2, one_minus_beta1, one_minus_beta2, eps, ln_beta1, ln_beta2)
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
           _floats(beta1, beta2, eps), (BLOCK,),
           tag="packed_adamw", num_warps=NUM_WARPS, num_stages=1)


@triton.jit
def _adamw_tensors_kernel(table_ptr, tiles_ptr, hyper_ptr, step_ptr, beta1, beta2, one_minus_beta1, one_minus_beta2,
                          eps, ln_beta1, ln_beta2,
                          GRAD_BF16: tl.constexpr, WRITE_BF16: tl.constexpr, COLUMNS: tl.constexpr,
                          BLOCK: tl.constexpr):
    tile = tl.program_id(0)
    t = tl.load(tiles_ptr + 2 * tile)  # the tensor this program updates, and where its block starts
    offs = tl.load(tiles_ptr + 2 * tile + 1) + tl.arange(0, BLOCK)
    row = table_ptr + t * COLUMNS
    mask = offs < tl.load(row + 5)
    p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    if GRAD_BF16:
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.bfloat16))
    else:
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    p, m, v = _adamw(tl.load(p_ptr + offs, mask=mask), g, tl.load(m_ptr + offs, mask=mask),
                     tl.load(v_ptr + offs, mask=mask), tl.load(hyper_ptr + 2 * t), tl.load(hyper_ptr + 2 * t + 1),
                     tl.load(step_ptr), beta1, beta2, one_minus_beta1, one_minus_beta2, eps, ln_beta1, ln_beta2)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if WRITE_BF16:  # the bfloat16 parameter a float32 master stands for: the master rounded to nearest
        out_ptr = tl.load(row + 4).to(tl.pointer_type(tl.bfloat16))
        tl.store(out_ptr + offs, p.to(tl.bfloat16), mask=mask)


def _floats(beta1: float, beta2: float, eps: float) -> tuple[float, ...]:
    """The kernels' float arguments. ``1 - β`` is formed on the host in double precision: in float32
    ``1 - 0.999`` is 1.3e-5 off, and every second moment with it."""
    return (float(beta1), float(beta2), 1.0 - beta1, 1.0 - beta2, float(eps), ln_beta(beta1), ln_beta(beta2))


def ln_beta(beta: float) -> float:
    """``ln β`` for ``1 - βᵗ = -expm1(t·ln β)``; -inf for β = 0 (AdamW allows it: ``1 - 0ᵗ`` is 1)."""
    return math.log(beta) if beta > 0 else -math.inf


def tiles_of(numels: list[int]) -> list[int]:
    """The programs of ``adamw_tensors_`` for tensors of these sizes, flattened: (tensor index,
    first element) per block of BLOCK elements."""
    out: list[int] = []
    for t, n in enumerate(numels):
        for start in range(0, n, BLOCK):
            out += (t, start)
    return out


def adamw_tensors_(table: torch.Tensor, tiles: torch.Tensor, hyper: torch.Tensor, step: torch.Tensor, *,
                   grad_bf16: bool, write_bf16: bool, beta1: float, beta2: float, eps: float) -> None:
    """Update every tensor that ``table`` lists, in place, in one launch. ``table``: int64 (T, 6), per
    tensor the addresses of its float32 parameter (or master), its gradient (bfloat16 where
    ``grad_bf16``, else float32), its float32 moments, the bfloat16 parameter to write the result to
    (where ``write_bf16``, else unused), and its number of elements; every tensor contiguous, on
    the device of ``table``. ``tiles``: int64, ``tiles_of`` their sizes. ``hyper``: float32 (T, 2),
    each tensor's learning rate and weight decay. ``step``: the 0-d float32 step count, already
    counting this step."""
    launch(_adamw_tensors_kernel, (tiles.numel() // 2, 1, 1), (table, tiles, hyper, step), (),
           _floats(beta1, beta2, eps),
           (bool(grad_bf16), bool(write_bf16), TABLE_COLUMNS, BLOCK),
           tag="adamw_tensors", num_warps=NUM_WARPS, num_stages=1)
