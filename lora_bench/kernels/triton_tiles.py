"""Pieces of the LoRA kernels (:mod:`lora_bench.kernels.lora_triton`) that more than one kernel or
branch uses: the grouped tile order of a GEMM's grid, where each adapter column lies (one layer, or
layers side by side), the split of a reduction's rows over grid axis 1, grad_A's tile and a
gradient's store. Each is a ``@triton.jit`` function, inlined
where it is called. This module imports Triton; import it lazily (the kernel modules do)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of program ``pid`` in grouped order: neighbouring programs share X rows
    and Wᵀ columns in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    return first_m + ((pid % per_group) % group_size), (pid % per_group) // group_size


@triton.jit
def adapter_offsets(offs_r, RS: tl.constexpr, SS_1, stride_1, SS_2, stride_2):
    """Offsets of adapter column j in two operands: layer j // RS's stretch at (j // RS)·SS, then
    (j % RS)·stride (segments: RS > 0), or j·stride (one layer)."""
    if RS > 0:
        seg_r = offs_r // RS
        off_1 = seg_r * SS_1 + (offs_r % RS) * stride_1
        off_2 = seg_r * SS_2 + (offs_r % RS) * stride_2
    else:
        off_1 = offs_r * stride_1
        off_2 = offs_r * stride_2
    return off_1, off_2


@triton.jit
def split_rows(M, BLOCK_M: tl.constexpr):
    """(split index, first row, end) of this program's rows along grid axis 1: whole blocks, shared out
    as evenly as they go (counts differ by at most one, none empty), so only the last block of all
    needs the row mask."""
    blocks = tl.cdiv(M, BLOCK_M)
    sid, splits = tl.program_id(1), tl.num_programs(1)
    return sid, (sid * blocks // splits) * BLOCK_M, min(((sid + 1) * blocks // splits) * BLOCK_M, M)


@triton.jit
def store_grad(ptrs, acc, mask, ATOMIC: tl.constexpr):
    """A gradient's tile: added (a split's partial sum, float32; relaxed: only the final sum is read) or
    stored in the pointers' dtype."""
    if ATOMIC:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def grad_a_tile(x_ptr, u_ptr, ga_ptrs, d_tile, m_lo, m_hi, M, K, stride_xm, stride_xk, stride_um, stride_ur,
                stride_gak, ga_cols, offs_r, r_mask, scale, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, ATOMIC: tl.constexpr):
    """grad_A[d, :] = s · Σ_m x[m, d] · u[m, :] for block ``d_tile`` of x's columns over rows [m_lo, m_hi)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = d_tile * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < K
    acc_a = tl.zeros((BLOCK_D, BLOCK_R), dtype=tl.float32)
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rows = m0 + offs_m
        row_ok = rows < M  # padded rows must be zero: they are summed
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_d[None, :] * stride_xk,
                     mask=row_ok[:, None] & d_mask[None, :], other=0.0)  # (BM, BD)
        ut = tl.load(u_ptr + rows[:, None] * stride_um + offs_r[None, :] * stride_ur,
                     mask=row_ok[:, None] & r_mask[None, :], other=0.0)  # (BM, BR)
        acc_a = tl.dot(tl.trans(xt), ut, acc_a, input_precision=PRECISION)
    store_grad(ga_ptrs + offs_d[:, None] * stride_gak + ga_cols[None, :], acc_a * scale,
               d_mask[:, None] & r_mask[None, :], ATOMIC)


__all__ = ["adapter_offsets", "grad_a_tile", "split_rows", "store_grad", "tile_of"]
