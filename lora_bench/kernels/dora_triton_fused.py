"""DoRA's norm and scale inside the LoRA op's Triton kernels (``dora_fusion: fused``;
:mod:`lora_bench.kernels.dora_fused`), where the split path launches kernels of their own beside the LoRA
op's (:mod:`lora_bench.kernels.dora_triton`, ``dora_triton_bwd``).

Forward, ``lora_dora_forward``: one launch gives z = x·Wᵀ + s·(x·A)·B, h = x·A, the norm
n_j = ‖W_j + s·(A·B)_j‖, g = m / n and y = g ⊙ z + b. Each program of the LoRA kernel (a tile of
rows × a block of outputs) already reads, over all of K, the tiles of W its outputs need. Its main
loop adds, beside x·Wᵀ and x·A, its outputs' part of W·A (r × block, from the same W tiles) and of
A's Gram matrix AᵀA (from the A tiles), and ‖W_j‖² where the layer does not hold it (a frozen W's is
summed once, in float32); its epilogue forms the norm from them (the expansion of
docs/variants.md#the-norm-without-the-merged-weight, in float32, as the split kernels form it) and
scales its tile. Every tile of rows forms the norm of its outputs anew (the redundant work: r + r²/out
multiply-adds per element of W per tile of rows, on the tensor cores); the first stores n, g,
−m/(2n³) and vᵀ for the backward. No sum crosses programs: no workspace, no second launch.

Backward: the LoRA kernel's two launches with dz = dy ⊙ g formed as each tile of dy is loaded, so dz
is never written: ``lora_dora_bwd_x`` (grad_x and u = dz·Bᵀ) and ``lora_dora_grad_ab`` (grad_A,
grad_B, and beside grad_B the scale's parts of dg = Σ dy ⊙ z and db = Σ dy, one row of parts per
split of the rows, which the norm's backward adds in order). This module imports Triton; import it
lazily (``dora_fused.triton_fused``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_bench.kernels.lora_triton import (AB_PICKED, MMConfig, _alloc, _mm_config, _precision, _sm_count, ab_split,
                                            block_r, pick_ab_config)
from lora_bench.kernels.triton_launch import launch
from lora_bench.kernels.triton_tiles import adapter_offsets, grad_a_tile, split_rows, store_grad, tile_of


@triton.jit
def _lora_dora_mm_kernel(
    x_ptr, w_ptr, p_ptr, q_ptr, bq_ptr, m_ptr, bias_ptr, wsq_ptr, y_ptr, z_ptr, h_ptr, n_ptr, g_ptr, cn_ptr, vt_ptr,
    M, N, K, R, N_SEG,
    stride_xm, stride_xk, stride_wn, stride_wk, P_SS, stride_pk, stride_pr,
    Q_SS, stride_qr, stride_qn, BQ_SS, stride_bqr, stride_bqn, stride_ym, stride_zm, stride_hm, stride_vr,
    scale,
    RS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WSQ: tl.constexpr, SEGMENTED: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_RS: tl.constexpr, GROUP_M: tl.constexpr,
):
    # S layers with one input side by side (SEGMENTED): R = S·RS adapter columns, layer j // RS's;
    # N = S·N_SEG outputs, a block of outputs inside one layer's (the host makes N_SEG a multiple of
    # BLOCK_N). One layer: RS = R, N_SEG = N.
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, BLOCK_RS)
    r_mask = offs_r < R
    s_mask = offs_s < RS
    seg = (pid_n * BLOCK_N) // N_SEG  # this block's layer
    p_cols, q_rows = adapter_offsets(offs_r, RS * SEGMENTED, P_SS, stride_pr, Q_SS, stride_qr)
    if SEGMENTED:
        seg_r = offs_r // RS  # each adapter column's layer
    # rows and outputs past the edge wrap onto valid ones (computed, never stored): no masks in the loop
    rm = offs_m % M
    rn = offs_n % N
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :] * stride_xk  # (BM, BK)
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn  # (BK, BN): Wᵀ's tile
    p_ptrs = p_ptr + offs_k[:, None] * stride_pk + p_cols[None, :]  # (BK, BR): every layer's A
    a_ptrs = p_ptr + seg * P_SS + offs_k[:, None] * stride_pk + offs_s[None, :] * stride_pr  # (BK, BRS): its own

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    hacc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    wa = tl.zeros((BLOCK_RS, BLOCK_N), dtype=tl.float32)  # (W·A)ᵀ of this block's outputs
    gram = tl.zeros((BLOCK_RS, BLOCK_RS), dtype=tl.float32)
    wsq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs)
            wt = tl.load(w_ptrs)
            pt = tl.load(p_ptrs, mask=r_mask[None, :], other=0.0)
            if SEGMENTED:
                at = tl.load(a_ptrs, mask=s_mask[None, :], other=0.0)
        else:  # the K tail reads zeros: it is summed
            k_mask = offs_k < K - k0
            xt = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
            pt = tl.load(p_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            if SEGMENTED:
                at = tl.load(a_ptrs, mask=k_mask[:, None] & s_mask[None, :], other=0.0)
        if not SEGMENTED:
            at = pt
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        hacc = tl.dot(xt, pt.to(xt.dtype), hacc, input_precision=PRECISION)
        # the norm's sums: W·A and AᵀA with A read in W's dtype, and ‖W_j‖² in float32 where it is not
        # given. Every tile of rows sums them unconditionally (a dot under a branch in a pipelined loop
        # summed wrong on a GPU)
        at = at.to(wt.dtype)
        wa = tl.dot(tl.trans(at), wt, wa, input_precision=PRECISION)
        gram = tl.dot(tl.trans(at), at, gram, input_precision=PRECISION)
        if not HAS_WSQ:
            wf = wt.to(tl.float32)
            wsq += tl.sum(wf * wf, axis=0)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
        p_ptrs += BLOCK_K * stride_pk
        a_ptrs += BLOCK_K * stride_pk

    # z as the LoRA kernel forms it: H rounded to the input dtype before the second product
    h = hacc.to(x_ptr.dtype.element_ty)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if pid_n == 0:
        tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_r[None, :], h, mask=m_mask[:, None] & r_mask[None, :])
    q_ptrs = q_ptr + q_rows[:, None] + rn[None, :] * stride_qn  # (BR, BN)
    if SEGMENTED:  # each output takes its own layer's rows of B (block-diagonal)
        qt = tl.load(q_ptrs, mask=r_mask[:, None] & (rn[None, :] // N_SEG == seg_r[:, None]), other=0.0)
    else:
        qt = tl.load(q_ptrs, mask=r_mask[:, None], other=0.0)
    acc += scale * tl.dot(h, qt.to(h.dtype), input_precision=PRECISION)
    z = acc.to(z_ptr.dtype.element_ty)

    # the norm, as the split kernels form it: ‖W_j‖² + 2s·⟨(W·A)_j, B_j⟩ + s²·B_jᵀ·AᵀA·B_j, with B
    # as stored
    if HAS_WSQ:  # a frozen W's, summed once in float32
        wsq = tl.load(wsq_ptr + rn)
    bq = tl.load(bq_ptr + seg * BQ_SS + offs_s[:, None] * stride_bqr + rn[None, :] * stride_bqn,
                 mask=s_mask[:, None], other=0.0).to(tl.float32)  # (BRS, BN): B's columns
    gb = tl.dot(gram, bq, input_precision="ieee")  # (BRS, BN): (Bᵀ·AᵀA)ᵀ
    sq = wsq + (2.0 * scale) * tl.sum(wa * bq, axis=0) + (scale * scale) * tl.sum(gb * bq, axis=0)
    nrm = tl.where(n_mask, tl.sqrt(tl.maximum(sq, 0.0)), 1.0)  # outputs past N: 1, never stored
    g = tl.load(m_ptr + rn).to(tl.float32) / nrm
    if pid_m == 0:
        tl.store(n_ptr + offs_n, nrm, mask=n_mask)
        tl.store(g_ptr + offs_n, g, mask=n_mask)
        tl.store(cn_ptr + offs_n, -0.5 * g / (nrm * nrm), mask=n_mask)
        v = (2.0 * scale) * wa + (2.0 * scale * scale) * gb  # vᵀ's columns (r × out)
        tl.store(vt_ptr + offs_s[:, None] * stride_vr + offs_n[None, :], v,
                 mask=s_mask[:, None] & n_mask[None, :])
    out_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(z_ptr + offs_m[:, None] * stride_zm + offs_n[None, :], z, mask=out_mask)
    y = z.to(tl.float32) * g[None, :]  # from z as stored: the z the backward reads
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _lora_dora_bwd_x_kernel(
    dy_ptr, gs_ptr, w_ptr, p_ptr, q_ptr, out_ptr, u_ptr,
    M, N, K, R, K_SEG,
    stride_dym, stride_wk, stride_wn, P_SS, stride_pk, stride_pr, Q_SS, stride_qr, stride_qn,
    stride_om, stride_um,
    scale,
    RS: tl.constexpr, SEGMENTED: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
):
    # The LoRA kernel's backward (grad_x = dz·W + s·u·Aᵀ, u = dz·Bᵀ; K = the layers' outputs, N = in)
    # with dz = dy ⊙ g formed as each tile of dy is loaded (rounded to dy's dtype, as the scale's
    # backward stores it): dz is never written. P is Bᵀ (K × R; side by side, layer j // RS's rows of
    # K only: K_SEG each), Q is Aᵀ (R × N).
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    p_cols, q_rows = adapter_offsets(offs_r, RS * SEGMENTED, P_SS, stride_pr, Q_SS, stride_qr)
    if SEGMENTED:
        seg_r = offs_r // RS  # each adapter column's layer
    rm = offs_m % M
    rn = offs_n % N
    dy_ptrs = dy_ptr + rm[:, None] * stride_dym + offs_k[None, :]  # (BM, BK): dy's rows are contiguous
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn  # (BK, BN)
    p_ptrs = p_ptr + offs_k[:, None] * stride_pk + p_cols[None, :]  # (BK, BR)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    uacc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        if EVEN_K:
            dyt = tl.load(dy_ptrs)
            gk = tl.load(gs_ptr + ks)
            wt = tl.load(w_ptrs)
            p_mask = r_mask[None, :]
        else:  # the K tail reads zeros: it is summed
            k_mask = offs_k < K - k0
            dyt = tl.load(dy_ptrs, mask=k_mask[None, :], other=0.0)
            gk = tl.load(gs_ptr + ks, mask=k_mask, other=0.0)
            wt = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
            p_mask = k_mask[:, None] & r_mask[None, :]
        if SEGMENTED:  # Bᵀ block-diagonal along K: each output row of Bᵀ belongs to one layer
            p_mask = p_mask & (ks[:, None] // K_SEG == seg_r[None, :])
        pt = tl.load(p_ptrs, mask=p_mask, other=0.0)
        dzt = (dyt.to(tl.float32) * gk.to(tl.float32)[None, :]).to(dy_ptr.dtype.element_ty)
        acc = tl.dot(dzt, wt, acc, input_precision=PRECISION)
        uacc = tl.dot(dzt, pt.to(dzt.dtype), uacc, input_precision=PRECISION)
        dy_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
        p_ptrs += BLOCK_K * stride_pk

    u = uacc.to(dy_ptr.dtype.element_ty)  # rounded as torch's dz @ Bᵀ would be, before the second product
    m_mask = offs_m < M
    if pid_n == 0:
        tl.store(u_ptr + offs_m[:, None] * stride_um + offs_r[None, :], u, mask=m_mask[:, None] & r_mask[None, :])
    qt = tl.load(q_ptr + q_rows[:, None] + rn[None, :] * stride_qn, mask=r_mask[:, None], other=0.0)
    acc += scale * tl.dot(u, qt.to(u.dtype), input_precision=PRECISION)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & (offs_n < N)[None, :])


@triton.jit
def _lora_dora_grad_ab_kernel(
    x_ptr, u_ptr, h_ptr, dy_ptr, z_ptr, gs_ptr, ga_ptr, gb_ptr, pg_ptr, pb_ptr,
    M, K, N, R, NUM_A,
    stride_xm, stride_xk, stride_um, stride_hm, stride_dym, stride_zm, stride_gak, stride_gar, stride_gbr, stride_gbn,
    scale,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    ATOMIC: tl.constexpr, HAS_BIAS: tl.constexpr, RS: tl.constexpr, GA_SS: tl.constexpr, GB_SS: tl.constexpr,
    GB_SEG: tl.constexpr,
):
    # The LoRA kernel's adapter gradients (grad_A = s·xᵀ·u, grad_B = s·hᵀ·dz), dz = dy ⊙ g formed as
    # each tile of dy is loaded; the programs of grad_B's columns also sum, over their rows, the scale's
    # parts of dg = Σ dy ⊙ z and db = Σ dy (one row of parts per split of the rows). Segments as in
    # lora_triton's kernel (RS > 0).
    pid = tl.program_id(0)
    sid, m_lo, m_hi = split_rows(M, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    ga_cols, gb_rows = adapter_offsets(offs_r, RS, GA_SS, stride_gar, GB_SS, stride_gbr)
    if pid < NUM_A:
        grad_a_tile(x_ptr, u_ptr, ga_ptr, pid, m_lo, m_hi, M, K, stride_xm, stride_xk, stride_um, 1, stride_gak,
                    ga_cols, offs_r, r_mask, scale, PRECISION, BLOCK_M, BLOCK_D, BLOCK_R, ATOMIC)
    else:
        offs_d = (pid - NUM_A) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = offs_d < N
        gd = tl.load(gs_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        acc_b = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_D,), dtype=tl.float32)
        acc_bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for m0 in range(m_lo, m_hi, BLOCK_M):
            rows = m0 + offs_m
            row_ok = rows < M
            tile = row_ok[:, None] & d_mask[None, :]
            ht = tl.load(h_ptr + rows[:, None] * stride_hm + offs_r[None, :], mask=row_ok[:, None] & r_mask[None, :],
                         other=0.0)  # (BM, BR)
            dyt = tl.load(dy_ptr + rows[:, None] * stride_dym + offs_d[None, :], mask=tile, other=0.0).to(tl.float32)
            zt = tl.load(z_ptr + rows[:, None] * stride_zm + offs_d[None, :], mask=tile, other=0.0).to(tl.float32)
            acc_g += tl.sum(dyt * zt, axis=0)
            if HAS_BIAS:
                acc_bias += tl.sum(dyt, axis=0)
            dzt = (dyt * gd[None, :]).to(dy_ptr.dtype.element_ty)
            acc_b = tl.dot(tl.trans(ht), dzt, acc_b, input_precision=PRECISION)
        tl.store(pg_ptr + sid * N + offs_d, acc_g, mask=d_mask)
        if HAS_BIAS:
            tl.store(pb_ptr + sid * N + offs_d, acc_bias, mask=d_mask)
        gb_ptrs = gb_ptr + gb_rows[:, None] + offs_d[None, :] * stride_gbn
        gb_mask = r_mask[:, None] & d_mask[None, :]
        if GB_SEG > 0:  # (segments: RS > 0)
            gb_mask = gb_mask & (offs_d[None, :] // GB_SEG == (offs_r // RS)[:, None])
        store_grad(gb_ptrs, acc_b * scale, gb_mask, ATOMIC)


BLOCK_N_CHOICES = (128, 64, 32, 16)  # the widths a block of outputs may take, widest first


def fused_config(M: int, N: int, K: int, x: torch.Tensor, seg_out: int, segments: int) -> MMConfig | None:
    """The LoRA kernel's tile (``lora_triton``'s choice for the shape) for the fused forward of S layers
    of ``seg_out`` outputs: side by side, its block of outputs narrowed until it divides ``seg_out``
    (each block inside one layer's); None where none of ``BLOCK_N_CHOICES`` does."""
    c = _mm_config(M, N, K, x)
    if segments == 1 or seg_out % c.block_n == 0:
        return c
    for bn in BLOCK_N_CHOICES:
        if bn < c.block_n and seg_out % bn == 0:
            return c._replace(block_n=bn)
    return None


def lora_dora_bwd_x(dy: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    scale: float, config: MMConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, u) in one launch for dy (M × out, rows contiguous) and g (out, float32) of the layers
    ``lora_dora_forward`` ran, W (out × in), A (in × r, or S × in × r) and B (r × out, or S × r × n) in
    dy's dtype: with dz = dy ⊙ g (rounded to dy's dtype), grad_x = dz·W + s·u·Aᵀ and u = dz·Bᵀ, layer
    i's u in columns [i·r, (i+1)·r) (side by side: grad_x sums the layers')."""
    M, out = dy.shape
    a, b, S = _segments(a, b)
    r, seg_out, k = a.shape[2], b.shape[2], weight.shape[1]
    assert dy.stride(1) == 1 or M <= 1, dy.stride()
    assert weight.shape == (S * seg_out, k) and g.shape == (out,) and out == S * seg_out, (dy.shape, weight.shape)
    gx, u = _alloc((M, k), dy), _alloc((M, S * r), dy)
    c = config or _mm_config(M, k, out, dy)
    ws, as_, bs = weight.stride(), a.stride(), b.stride()
    # P = Bᵀ: (output o, column j) of layer j // r at its start + (j % r)·stride(1) + (o − its first)·stride(2);
    # Q = Aᵀ: (column j, input i) at its start + (j % r)·stride(2) + i·stride(1)
    launch(
        _lora_dora_bwd_x_kernel, (triton.cdiv(M, c.block_m) * triton.cdiv(k, c.block_n), 1, 1),
        (dy, g, weight, b, a, gx, u),
        (M, k, out, S * r, seg_out, dy.stride(0), ws[0], ws[1], bs[0] - seg_out * bs[2], bs[2], bs[1],
         as_[0], as_[2], as_[1], gx.stride(0), u.stride(0)),
        (float(scale),),
        (r, S > 1, out % c.block_k == 0, _precision(dy.dtype), c.block_m, c.block_n, c.block_k, block_r(S * r), 8),
        tag="dora_bwd_x", num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return gx, u


def lora_dora_grad_ab(x: torch.Tensor, u: torch.Tensor, h: torch.Tensor, dy: torch.Tensor, z: torch.Tensor,
                      g: torch.Tensor, *, scale: float, segments: int, grad_dtype: torch.dtype, need_db: bool,
                      config=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(grad_A, grad_B, dg's parts, db's parts) in one launch: grad_A = s·xᵀ·u and grad_B = s·hᵀ·dz with
    dz = dy ⊙ g, as ``lora_triton.lora_grad_ab`` gives them (the same tiles, splits of the rows and
    stores: S layers side by side give S × in × r and S × r × n), and the scale's parts of
    dg = Σ_rows dy ⊙ z and db = Σ_rows dy (db's where ``need_db``, else None): one row of parts (P × out,
    float32) per split of the rows, for ``dora_triton_bwd.sum_parts`` or ``dora_exact_bwd`` to add."""
    M, K = x.shape
    N, R = dy.shape[1], u.shape[1]
    S = segments
    assert dy.stride(1) == 1 and z.stride(1) == 1 and u.stride(1) == 1 and h.stride(1) == 1, (dy.stride(), z.stride())
    ga_shape, gb_shape = ((K, R), (R, N)) if S == 1 else ((S, K, R // S), (S, R // S, N // S))
    key = (M, K, N, True, True)
    c = config or AB_PICKED.get(key) or AB_PICKED.setdefault(key, pick_ab_config(M, K, N, x.device))
    num_a, num_b = triton.cdiv(K, c.block_d), triton.cdiv(N, c.block_d)
    split = c.split_m or (ab_split(M, c.block_m, num_a + num_b, _sm_count(x.device)) if x.is_cuda else 1)
    split = max(1, min(split, triton.cdiv(M, c.block_m)))
    # as lora_grad_ab: atomics need float32 gradients, and torch's deterministic mode keeps one split
    if split > 1 and (grad_dtype != torch.float32 or torch.are_deterministic_algorithms_enabled()):
        split = 1
    if split > 1:
        ga = torch.zeros(ga_shape, dtype=torch.float32, device=x.device)
        gb = torch.zeros(gb_shape, dtype=torch.float32, device=x.device)
    else:
        ga, gb = _alloc(ga_shape, x, grad_dtype), _alloc(gb_shape, x, grad_dtype)
    f32 = torch.float32
    pg = _alloc((split, N), x, f32)
    pb = _alloc((split, N), x, f32) if need_db else None
    if M == 0:  # no rows: every sum is zero
        for t in (ga, gb, pg, pb):
            if t is not None:
                t.zero_()
        return ga, gb, pg, pb
    if S == 1:
        gas, gbs, seg = ga.stride(), gb.stride(), (0, 0, 0, 0)
    else:
        gas, gbs = ga.stride()[-2:], gb.stride()[-2:]
        n = N // S
        seg = (R // S, ga.stride(0), gb.stride(0) - n * gb.stride(2), n)
    launch(
        _lora_dora_grad_ab_kernel, (num_a + num_b, split, 1), (x, u, h, dy, z, g, ga, gb, pg, pg if pb is None else pb),
        (M, K, N, R, num_a, x.stride(0), x.stride(1), u.stride(0), h.stride(0), dy.stride(0), z.stride(0),
         gas[0], gas[1], gbs[0], gbs[1]),
        (float(scale),),
        (_precision(x.dtype), c.block_m, c.block_d, block_r(R), split > 1, need_db, *seg),
        tag="dora_ab", num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return ga, gb, pg, pb


def _segments(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A and B as (S, in, r) and (S, r, n) (one layer's: S = 1), and S."""
    if a.dim() == 2:
        return a.unsqueeze(0), b.unsqueeze(0), 1
    return a, b, a.shape[0]


def lora_dora_forward(x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      b_norm: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None, scale: float,
                      weight_sq: torch.Tensor | None = None,
                      config: MMConfig | None = None) -> tuple[torch.Tensor, ...]:
    """(y, z, h, n, g, cn, vᵀ) in one launch for x (M × in), W (out × in), A (in × r), B (r × out) in
    x's dtype (the LoRA op's operands), ``b_norm`` (B as stored: the norm reads it, in float32), m (out)
    and the bias (out) or None: z = x·Wᵀ + s·(x·A)·B and y = g ⊙ z + b in x's dtype, h = x·A, and n,
    g = m / n, cn = −m / (2n³) and vᵀ = (2s·(W·A) + 2s²·(Bᵀ·AᵀA))ᵀ (r × out) in float32, as
    ``dora_triton.dora_fusion`` gives them from z.

    S layers side by side: A (S × in × r), B and ``b_norm`` (S × r × n), W (S·n × in), m and the bias
    (S·n); layer i's columns of y, z, n, g, cn and vᵀ are [i·n, (i+1)·n), h's [i·r, (i+1)·r).
    ``weight_sq``: ‖W_j‖² (out, float32) of a frozen W, read instead of summed in the main loop (None:
    summed there). ``config``: the tile (``fused_config``; chosen here when None, asserted to fit)."""
    M, k = x.shape
    out = weight.shape[0]
    a, b, S = _segments(a, b)
    b_norm = b_norm if b_norm.dim() == 3 else b_norm.unsqueeze(0)
    r, seg_out = a.shape[2], b.shape[2]
    assert weight.shape == (S * seg_out, k) and a.shape[1] == k and b.shape == (S, r, seg_out) \
        and b_norm.shape == b.shape and m.shape == (out,), (x.shape, weight.shape, a.shape, b.shape, m.shape)
    assert weight.dtype is x.dtype and a.dtype is x.dtype and b.dtype is x.dtype, (x.dtype, weight.dtype, a.dtype)
    assert weight_sq is None or (weight_sq.shape == (out,) and weight_sq.dtype is torch.float32
                                 and weight_sq.stride(0) == 1), None if weight_sq is None else weight_sq.shape
    c = config or fused_config(M, out, k, x, seg_out, S)
    assert c is not None and (S == 1 or seg_out % c.block_n == 0), (seg_out, c)
    f32 = torch.float32
    y, z, h = _alloc((M, out), x), _alloc((M, out), x), _alloc((M, S * r), x)
    n, g, cn = (_alloc((out,), weight, f32) for _ in range(3))
    vt = _alloc((r, out), weight, f32)
    ws, as_, bs, bns = weight.stride(), a.stride(), b.stride(), b_norm.stride()
    # B's column j of layer j // n at j·stride(2) past its layer's start: the layer's offset less n columns
    q_ss, bq_ss = bs[0] - seg_out * bs[2], bns[0] - seg_out * bns[2]
    launch(
        _lora_dora_mm_kernel, (triton.cdiv(M, c.block_m) * triton.cdiv(out, c.block_n), 1, 1),
        (x, weight, a, b, b_norm, m, bias if bias is not None else m, weight_sq if weight_sq is not None else m,
         y, z, h, n, g, cn, vt),
        (M, out, k, S * r, seg_out, *x.stride(), *ws, as_[0], as_[1], as_[2], q_ss, bs[1], bs[2],
         bq_ss, bns[1], bns[2], y.stride(0), z.stride(0), h.stride(0), vt.stride(0)),
        (float(scale),),
        (r, bias is not None, weight_sq is not None, S > 1, k % c.block_k == 0, _precision(x.dtype), c.block_m,
         c.block_n, c.block_k, block_r(S * r), block_r(r), 8),
        tag="dora_fused_fwd", num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return y, z, h, n, g, cn, vt


__all__ = ["BLOCK_N_CHOICES", "fused_config", "lora_dora_bwd_x", "lora_dora_forward", "lora_dora_grad_ab"]
