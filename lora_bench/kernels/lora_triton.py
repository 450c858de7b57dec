"""Triton kernels for the LoRA layer y = x·Wᵀ + b + s·(x·A)·B (W frozen; x N×k, W n×k, A k×r,
B r×n): ``lora_mm`` computes out = X·Wt + bias + s·(X·P)·Q and H = X·P in one launch (forward
(x, Wᵀ, A, B) gives y and h; backward (g, W, Bᵀ, Aᵀ) gives grad_x and u); ``lora_grad_ab``
computes grad_A = s·xᵀ·u and grad_B = s·hᵀ·g in one launch. Their tiling and why:
docs/kernel-design.md#the-implementations. This module imports Triton; import it lazily
(``lora_bench.kernels.available`` does). Tile shapes and grid splits: :mod:`lora_bench.kernels.lora_tiles`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_bench.kernels.triton_launch import launch
from lora_bench.kernels.call import TRITON_MAX_RANK as MAX_RANK  # H lives in registers beside the tile
from lora_bench.kernels.lora_tiles import (  # noqa: F401 (the tiles' names, as callers of this module read them)
    AB_PICKED, TUNED, ABConfig, MMConfig, _precision, _sm_count, ab_split, block_r, mm_config_for,
    pick_ab_config, pick_mm_config)

# Tests set this to fill every output the wrappers allocate with NaN, so an element a kernel
# forgets to write shows up instead of hiding behind whatever memory held before.
POISON_OUTPUTS = False


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # grouped tile order: neighbouring programs share X rows and Wt columns in L2
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    return first_m + ((pid % per_group) % group_size), (pid % per_group) // group_size


@triton.jit
def _adapter_offsets(offs_r, stride, RS: tl.constexpr, SS: tl.constexpr):
    # (segment, offset) of adapter columns (of P) or rows (of Q) offs_r: with segments (RS > 0) column
    # j lies at (j // RS)·SS + (j % RS)·stride, else at j·stride (segment 0)
    if RS > 0:
        return offs_r // RS, (offs_r // RS) * SS + (offs_r % RS) * stride
    return offs_r * 0, offs_r * stride


@triton.jit
def _main_loop(
    x_ptr, w_ptr, p_ptr, pid_m, pid_n, M, N, K, R,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_pk, stride_pr,
    EVEN_K: tl.constexpr, EVEN_R: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, RS: tl.constexpr, P_SS: tl.constexpr,
    P_SEG: tl.constexpr, DO_H: tl.constexpr = True,
):
    # The K loop of both forward GEMM kernels: acc (BM × BN) = X·Wt and, with DO_H, hacc (BM × BR) = X·P over
    # all of K (without it hacc stays zero: H was formed before the launch).
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    seg_r, p_cols = _adapter_offsets(offs_r, stride_pr, RS, P_SS)
    # Wrap rows/columns past the edge onto valid ones instead of masking every load: those
    # lanes compute garbage that is never stored, and the K loop stays mask-free.
    rm = offs_m % M
    rn = offs_n % N
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :] * stride_xk  # (BM, BK)
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn  # (BK, BN)
    p_ptrs = p_ptr + offs_k[:, None] * stride_pk + p_cols[None, :]  # (BK, BR)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    hacc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs)
            wt = tl.load(w_ptrs)
        else:
            # the K tail must read zeros: it is summed
            k_mask = offs_k < K - k0
            xt = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if DO_H:
            if EVEN_K:
                if P_SEG > 0:
                    pt = tl.load(p_ptrs, mask=r_mask[None, :] & ((k0 + offs_k)[:, None] // P_SEG == seg_r[None, :]),
                                 other=0.0)
                elif EVEN_R:
                    pt = tl.load(p_ptrs)
                else:
                    pt = tl.load(p_ptrs, mask=r_mask[None, :], other=0.0)
            else:
                p_mask = (offs_k < K - k0)[:, None] & r_mask[None, :]
                if P_SEG > 0:
                    p_mask = p_mask & ((k0 + offs_k)[:, None] // P_SEG == seg_r[None, :])
                pt = tl.load(p_ptrs, mask=p_mask, other=0.0)
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        if DO_H:
            # p may be the fp32 master copy of A (or Bᵀ) under autocast: rounded here, as a cast would
            hacc = tl.dot(xt, pt.to(xt.dtype), hacc, input_precision=PRECISION)
            p_ptrs += BLOCK_K * stride_pk
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc, hacc


@triton.jit
def _q_tile(q_ptr, rn, R, stride_qr, stride_qn, BLOCK_R: tl.constexpr, RS: tl.constexpr, Q_SS: tl.constexpr,
            Q_SEG: tl.constexpr):
    # Q's (BR × BN) tile for the columns rn, as stored (a segment's rows only where Q is block-diagonal)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    seg_r, q_rows = _adapter_offsets(offs_r, stride_qr, RS, Q_SS)
    q_ptrs = q_ptr + q_rows[:, None] + rn[None, :] * stride_qn  # (BR, BN)
    if Q_SEG > 0:
        return tl.load(q_ptrs, mask=r_mask[:, None] & (rn[None, :] // Q_SEG == seg_r[:, None]), other=0.0)
    return tl.load(q_ptrs, mask=r_mask[:, None], other=0.0)


@triton.jit
def _lora_tile(
    x_ptr, w_ptr, p_ptr, q_ptr, h_ptr, M, N, K, R,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_pk, stride_pr, stride_qr, stride_qn, stride_hm, stride_hr, scale,
    WRITE_H: tl.constexpr, EVEN_K: tl.constexpr, EVEN_R: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, RS: tl.constexpr, P_SS: tl.constexpr, Q_SS: tl.constexpr, P_SEG: tl.constexpr,
    Q_SEG: tl.constexpr, H_IN: tl.constexpr,
):
    # One program's output tile of both forward GEMM kernels, before their epilogues: acc = X·Wt + s·H·Q
    # with H = X·P from the K loop (stored by the first column of programs where WRITE_H) or, with H_IN,
    # read from h_ptr. Returns acc with the tile's rows, columns, wrapped columns and row mask.
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, hacc = _main_loop(x_ptr, w_ptr, p_ptr, pid_m, pid_n, M, N, K, R, stride_xm, stride_xk, stride_wk,
                           stride_wn, stride_pk, stride_pr, EVEN_K, EVEN_R, PRECISION, BLOCK_M, BLOCK_N,
                           BLOCK_K, BLOCK_R, RS, P_SS, P_SEG, not H_IN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    rn = offs_n % N
    m_mask = offs_m < M
    if H_IN:
        h = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_r[None, :] * stride_hr,
                    mask=m_mask[:, None] & (offs_r < R)[None, :], other=0.0)
    else:
        # H is rounded to the input dtype, as torch's x @ A would be, before the second product
        h = hacc.to(x_ptr.dtype.element_ty)
    if WRITE_H and not H_IN:
        if pid_n == 0:
            h_ptrs = h_ptr + offs_m[:, None] * stride_hm + offs_r[None, :] * stride_hr
            tl.store(h_ptrs, h, mask=m_mask[:, None] & (offs_r < R)[None, :])
    qt = _q_tile(q_ptr, rn, R, stride_qr, stride_qn, BLOCK_R, RS, Q_SS, Q_SEG).to(h.dtype)
    acc += scale * tl.dot(h, qt, input_precision=PRECISION)
    return acc, offs_m, offs_n, rn, m_mask


@triton.jit
def _lora_mm_kernel(
    x_ptr, w_ptr, p_ptr, q_ptr, bias_ptr, out_ptr, h_ptr,
    M, N, K, R,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_pk, stride_pr,
    stride_qr, stride_qn, stride_om, stride_on, stride_hm, stride_hr, scale,
    HAS_BIAS: tl.constexpr, WRITE_H: tl.constexpr, EVEN_K: tl.constexpr, EVEN_R: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
    RS: tl.constexpr = 0, P_SS: tl.constexpr = 0, Q_SS: tl.constexpr = 0, P_SEG: tl.constexpr = 0,
    Q_SEG: tl.constexpr = 0, H_IN: tl.constexpr = False,
):
    # H_IN: H = X·P was formed before the launch and is read from h_ptr (M × R, columns in adapter order)
    # for the epilogue; the K loop then runs the frozen product alone (``apart``).
    # Segments (RS > 0): S layers side by side with one input (a block's query, key and value),
    # adapter j of the R = S·RS columns belonging to layer j // RS. P and Q column/row j then lie
    # at (j // RS)·P_SS + (j % RS)·stride (Q alike): the layers' adapters as stored, one after the
    # other. Where a segment's P or Q covers only its own stretch of K or N (block-diagonal), P_SEG
    # or Q_SEG is that stretch's width and the rest reads as zero.
    acc, offs_m, offs_n, rn, m_mask = _lora_tile(
        x_ptr, w_ptr, p_ptr, q_ptr, h_ptr, M, N, K, R, stride_xm, stride_xk, stride_wk, stride_wn, stride_pk,
        stride_pr, stride_qr, stride_qn, stride_hm, stride_hr, scale, WRITE_H, EVEN_K, EVEN_R, PRECISION, BLOCK_M,
        BLOCK_N, BLOCK_K, BLOCK_R, GROUP_M, RS, P_SS, Q_SS, P_SEG, Q_SEG, H_IN)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n < N)[None, :])


@triton.jit
def _lora_grad_ab_kernel(
    x_ptr, u_ptr, h_ptr, g_ptr, ga_ptr, gb_ptr,
    M, K, N, R, NUM_A,
    stride_xm, stride_xk, stride_um, stride_ur, stride_hm, stride_hr, stride_gm, stride_gn,
    stride_gak, stride_gar, stride_gbr, stride_gbn, scale,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    ATOMIC: tl.constexpr, RS: tl.constexpr = 0, GA_SS: tl.constexpr = 0, GB_SS: tl.constexpr = 0,
    GB_SEG: tl.constexpr = 0,
):
    # Segments (RS > 0), as in _lora_mm_kernel: grad_A's column j and grad_B's row j lie at
    # (j // RS)·GA_SS (GB_SS) + (j % RS)·stride, and grad_B keeps only the block of its own layer
    # (columns d with d // GB_SEG == j // RS): S layers' gradients in one launch.
    pid = tl.program_id(0)
    # this program's rows [m_lo, m_hi): whole blocks, shared out as evenly as they go (counts
    # differ by at most one, none empty), so only the last block of all needs the row mask
    blocks = tl.cdiv(M, BLOCK_M)
    sid, splits = tl.program_id(1), tl.num_programs(1)
    m_lo = (sid * blocks // splits) * BLOCK_M
    m_hi = min(((sid + 1) * blocks // splits) * BLOCK_M, M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    if RS > 0:
        seg_r = offs_r // RS
        ga_cols = seg_r * GA_SS + (offs_r % RS) * stride_gar
        gb_rows = seg_r * GB_SS + (offs_r % RS) * stride_gbr
    else:
        ga_cols = offs_r * stride_gar
        gb_rows = offs_r * stride_gbr
    if pid < NUM_A:
        # grad_A[d, :] = s · Σ_m x[m, d] · u[m, :]   -> (BD, BR)
        offs_d = pid * BLOCK_D + tl.arange(0, BLOCK_D)
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
        ga_ptrs = ga_ptr + offs_d[:, None] * stride_gak + ga_cols[None, :]
        ga_mask = d_mask[:, None] & r_mask[None, :]
        if ATOMIC:  # partial sum over this split's rows; relaxed: only the final sum is read
            tl.atomic_add(ga_ptrs, acc_a * scale, mask=ga_mask, sem="relaxed")
        else:
            tl.store(ga_ptrs, (acc_a * scale).to(ga_ptr.dtype.element_ty), mask=ga_mask)
    else:
        # grad_B[:, d] = s · Σ_m h[m, :]ᵀ · g[m, d]   -> (BR, BD)
        offs_d = (pid - NUM_A) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = offs_d < N
        acc_b = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
        for m0 in range(m_lo, m_hi, BLOCK_M):
            rows = m0 + offs_m
            row_ok = rows < M
            ht = tl.load(h_ptr + rows[:, None] * stride_hm + offs_r[None, :] * stride_hr,
                         mask=row_ok[:, None] & r_mask[None, :], other=0.0)  # (BM, BR)
            gt = tl.load(g_ptr + rows[:, None] * stride_gm + offs_d[None, :] * stride_gn,
                         mask=row_ok[:, None] & d_mask[None, :], other=0.0)  # (BM, BD)
            acc_b = tl.dot(tl.trans(ht), gt, acc_b, input_precision=PRECISION)
        gb_ptrs = gb_ptr + gb_rows[:, None] + offs_d[None, :] * stride_gbn
        gb_mask = r_mask[:, None] & d_mask[None, :]
        if GB_SEG > 0:
            gb_mask = gb_mask & (offs_d[None, :] // GB_SEG == seg_r[:, None])
        if ATOMIC:
            tl.atomic_add(gb_ptrs, acc_b * scale, mask=gb_mask, sem="relaxed")
        else:
            tl.store(gb_ptrs, (acc_b * scale).to(gb_ptr.dtype.element_ty), mask=gb_mask)


# ---------------------------------------------------------------------------------- host side

# the two kernels by the name the direct plan's launch records use (their ABI: plans.direct)
KERNELS = {"mm": _lora_mm_kernel, "ab": _lora_grad_ab_kernel}


def _alloc(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype or like.dtype, device=like.device)
    return like.new_empty(shape, dtype=dtype)


_NO_SEGMENTS = (0, 0, 0, 0, 0)


def _mm(x, xs, wt, ws, p, ps, q, qs, bias, out, h, M, N, K, R, scale, config, seg=_NO_SEGMENTS, h_in=False):
    """Launch ``_lora_mm_kernel``; operands come with explicit (row, col) strides so callers pass
    W, A, B as stored instead of building transposed views (each view costs host time). ``seg``:
    the kernel's segment constants (RS, P_SS, Q_SS, P_SEG, Q_SEG), always passed (the fast launch
    hands every constexpr to Triton's launcher). ``h_in``: ``h`` already holds H = X·P (``apart``)."""
    br = block_r(R)
    write_h = h is not None
    h_arg = h if write_h else out  # an unused pointer still needs a tensor
    hs = h_arg.stride()
    os_ = out.stride()

    def run(c: MMConfig) -> None:
        launch(
            _lora_mm_kernel, (triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n), 1, 1),
            (x, wt, p, q, bias if bias is not None else out, out, h_arg),
            (M, N, K, R, xs[0], xs[1], ws[0], ws[1], ps[0], ps[1], qs[0], qs[1], os_[0], os_[1], hs[0], hs[1]),
            (float(scale),),
            (bias is not None, write_h, K % c.block_k == 0, R == br, _precision(x.dtype), c.block_m, c.block_n,
             c.block_k, br, 8, *seg, bool(h_in)),
            tag="mm", num_warps=c.num_warps, num_stages=c.num_stages,
        )

    run(config or mm_config_for("mm", M, N, K, R, h_in, x, run))


def lora_mm(
    x: torch.Tensor, wt: torch.Tensor, p: torch.Tensor, q: torch.Tensor, bias: torch.Tensor | None = None,
    *, scale: float, out: torch.Tensor | None = None, h_out: torch.Tensor | None = None,
    write_h: bool = True, config: MMConfig | None = None, apart: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out (M×N) = x·wt + bias + scale·(x·p)·q, and h_out (M×R) = x·p when ``write_h``.

    x: M×K, wt: K×N, p: K×R, q: R×N, bias: N; any strides (views such as Wᵀ work). One dtype;
    fp32 accumulation. ``apart``: H formed before the launch by torch's GEMM, the K loop running the frozen
    product alone (the ``adapter_h`` setting's apart: docs/kernel-design.md#h-formed-apart). The
    layer itself uses ``lora_fwd``/``lora_bwd_x``, which skip the views."""
    M, K = x.shape
    N, R = wt.shape[1], p.shape[1]
    assert wt.shape[0] == K and p.shape[0] == K and q.shape == (R, N), (x.shape, wt.shape, p.shape, q.shape)
    assert R <= MAX_RANK, R
    out = _alloc((M, N), x) if out is None else out
    if (write_h or apart) and h_out is None:
        h_out = _alloc((M, R), x)
    if apart:
        torch.mm(x, p.to(x.dtype), out=h_out)
    _mm(x, x.stride(), wt, wt.stride(), p, p.stride(), q, q.stride(), bias, out,
        h_out if write_h or apart else None, M, N, K, R, scale, config, h_in=apart)
    return out, (h_out if write_h else None)


def lora_fwd(x, w, a, b, bias, scale: float, *, apart: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x·Wᵀ + bias + s·(x·A)·B and h = x·A for x (M×k), W (n×k), A (k×r), B (r×n); ``apart``: H
    formed by torch's GEMM before the launch (as in ``lora_mm``)."""
    M, K = x.shape
    N, R = w.shape[0], a.shape[1]
    y, h = _alloc((M, N), x), _alloc((M, R), x)
    if apart:
        torch.mm(x, a.to(x.dtype), out=h)
    ws = w.stride()
    _mm(x, x.stride(), w, (ws[1], ws[0]), a, a.stride(), b, b.stride(), bias, y, h, M, N, K, R, scale, None,
        h_in=apart)
    return y, h


def lora_bwd_x(g, w, a, b, scale: float, *, apart: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_x = g·W + s·u·Aᵀ and u = g·Bᵀ for g (M×n): the forward kernel on (g, W, Bᵀ, Aᵀ)."""
    M, K = g.shape  # K here is n, the reduction
    N, R = w.shape[1], a.shape[1]
    gx, u = _alloc((M, N), g), _alloc((M, R), g)
    if apart:
        torch.mm(g, b.t().to(g.dtype), out=u)
    bs, as_ = b.stride(), a.stride()
    _mm(g, g.stride(), w, w.stride(), b, (bs[1], bs[0]), a, (as_[1], as_[0]), None, gx, u, M, N, K, R, scale, None,
        h_in=apart)
    return gx, u


def lora_fwd_segments(x, w, a, b, bias, scale: float, *, apart: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """S layers that share their input, side by side, in one launch: y = x·Wᵀ + bias + s·(x·A_i)·B_i
    for each layer i's columns, and h = [x·A_1 | … | x·A_S].

    x (M×k); w (S·n × k): layer i's rows at i·n; a (S×k×r), b (S×r×n): each layer's adapter at its
    index (any strides); bias (S·n) or None. Returns y (M × S·n), h (M × S·r). ``apart``: h formed
    before the launch, by torch's GEMM on the adapters laid side by side."""
    S, k, r = a.shape
    n = b.shape[2]
    M = x.shape[0]
    y, h = _alloc((M, S * n), x), _alloc((M, S * r), x)
    if apart:
        torch.mm(x, a.to(x.dtype).transpose(0, 1).reshape(k, S * r), out=h)
    ws = w.stride()
    seg = (r, a.stride(0), b.stride(0) - n * b.stride(2), 0, n)  # B block-diagonal: Q_SEG = n
    _mm(x, x.stride(), w, (ws[1], ws[0]), a, (a.stride(1), a.stride(2)), b, (b.stride(1), b.stride(2)), bias,
        y, h, M, S * n, k, S * r, scale, None, seg, h_in=apart)
    return y, h


def lora_bwd_x_segments(g, w, a, b, scale: float, *, apart: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_x = g·W + s·Σ_i u_i·A_iᵀ and u = [g_1·B_1ᵀ | … | g_S·B_Sᵀ] for ``lora_fwd_segments``'
    operands: g (M × S·n), g_i its layer-i columns. Returns grad_x (M×k), u (M × S·r). ``apart``: u
    formed before the launch, by one batched GEMM over the layers."""
    S, k, r = a.shape
    n = b.shape[2]
    M = g.shape[0]
    gx, u = _alloc((M, k), g), _alloc((M, S * r), g)
    if apart:
        u.view(M, S, r).copy_(torch.bmm(g.unflatten(1, (S, n)).transpose(0, 1), b.to(g.dtype).transpose(1, 2))
                              .transpose(0, 1))
    seg = (r, b.stride(0) - n * b.stride(2), a.stride(0), n, 0)  # Bᵀ block-diagonal along K: P_SEG = n
    _mm(g, g.stride(), w, w.stride(), b, (b.stride(2), b.stride(1)), a, (a.stride(2), a.stride(1)), None,
        gx, u, M, k, S * n, S * r, scale, None, seg, h_in=apart)
    return gx, u


def lora_grad_ab(
    x: torch.Tensor, u: torch.Tensor, h: torch.Tensor, g: torch.Tensor, *, scale: float,
    ga_out: torch.Tensor | None = None, gb_out: torch.Tensor | None = None,
    grad_dtype: torch.dtype | None = None, do_a: bool = True, do_b: bool = True,
    config: ABConfig | None = None, segments: int = 1,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """grad_A (K×R) = scale·xᵀ·u and grad_B (R×N) = scale·hᵀ·g in one launch.

    x: M×K, u: M×R, h: M×R, g: M×N. Gradients are stored in ``grad_dtype`` (the parameters'
    dtype: fp32 master weights under autocast get fp32 gradients without a cast pass).

    ``segments`` S > 1: the S layers of ``lora_fwd_segments`` (R = S·r, N = S·n). grad_A comes as
    S×K×r (layer i's xᵀ·u_i at index i) and grad_B as S×r×n (h_iᵀ·g_i: each layer's own block).

    fp32 gradients split the rows (``ABConfig.split_m``, auto when 0) and sum the partials with
    atomics, so the last bits vary from run to run; other dtypes, and torch's deterministic mode,
    keep one split: the direct store, bit-for-bit repeatable."""
    M, K = x.shape
    N, R = g.shape[1], u.shape[1]
    S = segments
    ga_shape, gb_shape = ((K, R), (R, N)) if S == 1 else ((S, K, R // S), (S, R // S, N // S))
    if config is None:
        key = (M, K, N, do_a, do_b)
        c = AB_PICKED.get(key) or AB_PICKED.setdefault(key, pick_ab_config(M, K, N, x.device, do_a=do_a,
                                                                               do_b=do_b))
    else:
        c = config
    num_a = triton.cdiv(K, c.block_d) if do_a else 0
    num_b = triton.cdiv(N, c.block_d) if do_b else 0
    split = c.split_m or (ab_split(M, c.block_m, num_a + num_b, _sm_count(x.device)) if x.is_cuda else 1)
    split = max(1, min(split, triton.cdiv(M, c.block_m)))
    # Atomics need an fp32 output. Other grad dtypes (bf16 parameters) keep one split rather than
    # summing into an fp32 buffer and casting: that is two more launches (zero-fill and cast) on a
    # layer that is host-bound in eager mode, for a kernel of a few microseconds.
    dt = grad_dtype or x.dtype
    out_dts = [t.dtype if t is not None else dt for t, on in ((ga_out, do_a), (gb_out, do_b)) if on]
    if split > 1 and (any(d != torch.float32 for d in out_dts) or torch.are_deterministic_algorithms_enabled()):
        split = 1
    if split > 1:
        # Every split adds into the output, so it starts at zero: these outputs cannot be
        # NaN-poisoned (POISON_OUTPUTS), and an element no program adds to reads as 0, not NaN.
        if do_a:
            ga_out = torch.zeros(ga_shape, dtype=torch.float32, device=x.device) if ga_out is None else ga_out.zero_()
        if do_b:
            gb_out = torch.zeros(gb_shape, dtype=torch.float32, device=x.device) if gb_out is None else gb_out.zero_()
    else:
        if do_a and ga_out is None:
            ga_out = _alloc(ga_shape, x, grad_dtype)
        if do_b and gb_out is None:
            gb_out = _alloc(gb_shape, x, grad_dtype)
    if num_a + num_b == 0:
        return ga_out, gb_out
    ga = ga_out if do_a else gb_out  # placeholders for the branch that never runs
    gb = gb_out if do_b else ga_out
    xs, us, hs, gs = x.stride(), u.stride(), h.stride(), g.stride()
    if S == 1:
        gas, gbs, seg = ga.stride(), gb.stride(), (0, 0, 0, 0)
    else:  # (the placeholder of a branch that never runs gets the other's strides: never used)
        gas, gbs = ga.stride()[-2:], gb.stride()[-2:]
        n = N // S
        seg = (R // S, ga.stride(0) if do_a else 0, gb.stride(0) - n * gb.stride(2) if do_b else 0, n)
    launch(
        _lora_grad_ab_kernel, (num_a + num_b, split, 1), (x, u, h, g, ga, gb),
        (M, K, N, R, num_a, xs[0], xs[1], us[0], us[1], hs[0], hs[1], gs[0], gs[1], gas[0], gas[1],
         gbs[0], gbs[1]),
        (float(scale),),
        (_precision(x.dtype), c.block_m, c.block_d, block_r(R), split > 1, *seg),
        tag="ab", num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return ga_out, gb_out
