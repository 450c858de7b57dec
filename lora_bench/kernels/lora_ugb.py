"""Triton kernel: the two products of a LoRA backward with the output gradient g, in one launch.

For the layer y = x·Wᵀ + b + s·(x·A)·B (x N×k, W n×k, A k×r, B r×n) the backward needs, besides
the big GEMM g·W, two rank-r products of g (N×n):

    u = g·Bᵀ (N×r, reduced over the n columns)   and   grad_B = s·hᵀ·g (r×n, reduced over the N rows)

``lora_u_gb`` computes ``u_scale·g·Bᵀ`` and ``gb_scale·hᵀ·g`` in one launch with two program roles:

* row programs (the first ``cdiv(N, BLOCK_M_U)``): each owns BLOCK_M_U rows of g and streams them
  across all n columns, so its slice of u is complete and is stored directly in g's dtype: no
  fp32 scratch, atomics or cast launch, and u can feed cuBLAS GEMMs. A row program can also store
  the g tiles it reads into another buffer (``g_copy``): the left part of the [g | s·u] operand of
  a K-concatenated grad_x GEMM, written while g is read anyway.
* column programs: each owns BLOCK_D columns and streams all N rows: its strip of grad_B is
  complete and stored directly (one split: no zero-fill, deterministic).

Each element of g is loaded once per role. Both roles run in the same launch, and at GPT-2 sizes g
is at most 960×6400 bf16 = 12.3 MB against an H200's 60 MB L2 (the backward's g·W GEMM reads the
same g), so DRAM sees g about once; the rank-r products need two separate passes (two cuBLAS
GEMMs) otherwise.

This module imports Triton; import it lazily.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lora_bench.kernels.launch import launch
from lora_bench.kernels.lora_triton import MAX_RANK, block_r

# Tests set this to fill the outputs the wrapper allocates with NaN (an element no program writes
# shows up instead of hiding behind old memory).
POISON_OUTPUTS = False


class UGBConfig(NamedTuple):
    block_m_u: int  # rows per row program
    block_n_u: int  # columns per step of a row program
    block_m_b: int  # rows per step of a column program
    block_d: int  # columns per column program
    num_warps: int
    num_stages: int


@triton.jit
def _lora_ugb_kernel(
    g_ptr, b_ptr, h_ptr, u_ptr, gb_ptr, c_ptr,
    M, N, R, NUM_U,
    stride_gm, stride_gn, stride_br, stride_bn, stride_hm, stride_hr, stride_um, stride_ur,
    stride_gbr, stride_gbn, stride_cm, stride_cn, u_scale, gb_scale,
    COPY_G: tl.constexpr, EVEN_M_U: tl.constexpr, EVEN_N_U: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M_U: tl.constexpr, BLOCK_N_U: tl.constexpr, BLOCK_M_B: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    if pid < NUM_U:
        # u[rows, :] = u_scale · g[rows, :] · Bᵀ   -> (BM_U, BR), complete in this program
        offs_m = pid * BLOCK_M_U + tl.arange(0, BLOCK_M_U)
        offs_n = tl.arange(0, BLOCK_N_U)
        m_mask = offs_m < M
        g_ptrs = g_ptr + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn  # (BM_U, BN_U)
        b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br  # (BN_U, BR): a Bᵀ tile
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        acc = tl.zeros((BLOCK_M_U, BLOCK_R), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N_U):
            if EVEN_M_U and EVEN_N_U:
                gt = tl.load(g_ptrs)
            else:
                n_ok = offs_n < N - n0
                gt = tl.load(g_ptrs, mask=m_mask[:, None] & n_ok[None, :], other=0.0)  # the tail is summed: zeros
            if EVEN_N_U:
                bt = tl.load(b_ptrs, mask=r_mask[None, :], other=0.0)
            else:
                bt = tl.load(b_ptrs, mask=(offs_n < N - n0)[:, None] & r_mask[None, :], other=0.0)
            # B may be an fp32 master copy (autocast): rounded to g's dtype, as a cast would
            acc = tl.dot(gt, bt.to(gt.dtype), acc, input_precision=PRECISION)
            if COPY_G:
                if EVEN_M_U and EVEN_N_U:
                    tl.store(c_ptrs, gt)
                else:
                    tl.store(c_ptrs, gt, mask=m_mask[:, None] & (offs_n < N - n0)[None, :])
            g_ptrs += BLOCK_N_U * stride_gn
            b_ptrs += BLOCK_N_U * stride_bn
            c_ptrs += BLOCK_N_U * stride_cn
        u_ptrs = u_ptr + offs_m[:, None] * stride_um + offs_r[None, :] * stride_ur
        tl.store(u_ptrs, (acc * u_scale).to(u_ptr.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])
    else:
        # grad_B[:, cols] = gb_scale · h[:, :]ᵀ · g[:, cols]   -> (BR, BD), complete in this program
        # (names differ from the other branch: Triton wants a name's type equal in both)
        offs_d = (pid - NUM_U) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = offs_d < N
        offs_mb = tl.arange(0, BLOCK_M_B)
        acc_b = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
        for m0 in range(0, M, BLOCK_M_B):
            rows = m0 + offs_mb
            row_ok = rows < M  # padded rows must be zero: they are summed
            h_t = tl.load(h_ptr + rows[:, None] * stride_hm + offs_r[None, :] * stride_hr,
                          mask=row_ok[:, None] & r_mask[None, :], other=0.0)  # (BM_B, BR)
            g_t = tl.load(g_ptr + rows[:, None] * stride_gm + offs_d[None, :] * stride_gn,
                          mask=row_ok[:, None] & d_mask[None, :], other=0.0)  # (BM_B, BD)
            acc_b = tl.dot(tl.trans(h_t.to(g_t.dtype)), g_t, acc_b, input_precision=PRECISION)
        gb_ptrs = gb_ptr + offs_r[:, None] * stride_gbr + offs_d[None, :] * stride_gbn
        tl.store(gb_ptrs, (acc_b * gb_scale).to(gb_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def _precision(dtype: torch.dtype) -> str:
    """fp32 follows torch's matmul setting: tf32 only where torch itself would allow it."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def pick_config(M: int, N: int, dtype: torch.dtype, device: torch.device) -> UGBConfig:
    """Tiles: 16-row programs for u (the most row programs a 16-row MMA tile allows: ~1k rows give
    60), each streaming 256 columns a step (128 for fp32, or below 2048 columns) with four stages,
    so every row program keeps enough bytes in flight; column strips for grad_B as wide as keeps
    at least ~48 of them. On the CPU (Triton's interpreter) small tiles, so masks and several
    programs of each role are exercised."""
    if device.type != "cuda":
        return UGBConfig(16, 16, 16, 16, 4, 1)
    block_n_u = 256 if N >= 2048 and dtype != torch.float32 else 128
    block_d = 64 if triton.cdiv(N, 64) >= 48 else 32
    return UGBConfig(16, block_n_u, 64, block_d, 4, 4)


def _alloc(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


def lora_u_gb(
    g: torch.Tensor, b: torch.Tensor, h: torch.Tensor, *, u_scale: float, gb_scale: float,
    u_out: torch.Tensor | None = None, gb_out: torch.Tensor | None = None, g_copy: torch.Tensor | None = None,
    grad_dtype: torch.dtype | None = None, config: UGBConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(u_scale·g·Bᵀ, gb_scale·hᵀ·g) for g (M×N), B (R×N), h (M×R); any strides (views such as
    the right part of a [g | s·u] buffer work as ``u_out``, its left part as ``g_copy``, which then
    receives a copy of g). u is in g's dtype, grad_B in ``grad_dtype`` (default: g's)."""
    M, N = g.shape
    R = b.shape[0]
    if b.shape != (R, N) or h.shape != (M, R):
        raise ValueError(f"lora_u_gb: g {tuple(g.shape)}, B {tuple(b.shape)}, h {tuple(h.shape)} do not fit")
    if R > MAX_RANK:
        raise ValueError(f"lora_u_gb: rank {R} is above {MAX_RANK}")
    u = _alloc((M, R), g, g.dtype) if u_out is None else u_out
    gb = _alloc((R, N), g, grad_dtype or g.dtype) if gb_out is None else gb_out
    c = config or pick_config(M, N, g.dtype, g.device)
    num_u = triton.cdiv(M, c.block_m_u)
    grid = (num_u + triton.cdiv(N, c.block_d), 1, 1)
    cp = g_copy if g_copy is not None else g  # an unused pointer still needs a tensor
    gs, bs, hs, us, gbs, cs = g.stride(), b.stride(), h.stride(), u.stride(), gb.stride(), cp.stride()
    launch(
        _lora_ugb_kernel, grid, (g, b, h, u, gb, cp),
        (M, N, R, num_u, gs[0], gs[1], bs[0], bs[1], hs[0], hs[1], us[0], us[1], gbs[0], gbs[1], cs[0], cs[1]),
        (float(u_scale), float(gb_scale)),
        (g_copy is not None, M % c.block_m_u == 0, N % c.block_n_u == 0, _precision(g.dtype), c.block_m_u,
         c.block_n_u, c.block_m_b, c.block_d, block_r(R)),
        tag="ugb", num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return u, gb


__all__ = ["UGBConfig", "lora_u_gb", "pick_config"]
