"""DoRA's forward inside the LoRA op's Triton kernel (``dora_forward: epilogue``;
:mod:`lora_bench.kernels.dora`): one launch gives z = x·Wᵀ + s·(x·A)·B, h = x·A, the norm
n_j = ‖W_j + s·(A·B)_j‖, g = m / n and y = g ⊙ z + b, where the split forward launches the LoRA op,
then the norm's two kernels (:mod:`lora_bench.kernels.dora_triton`).

Each program of the LoRA kernel (a tile of rows × a block of outputs) already reads, over all of K,
the tiles of W its outputs need. Its main loop adds, beside x·Wᵀ and x·A, its outputs' part of W·A
(r × block, from the same W tiles), of ‖W_j‖² and of A's Gram matrix AᵀA (from the A tiles); its
epilogue forms the norm from them (the expansion of docs/variants.md#the-norm-without-the-merged-weight,
in float32, as the split kernels form it) and scales its tile. Every tile of rows forms the norm of
its outputs anew (the redundant work: r + r²/out multiply-adds per element of W per tile of rows, on
the tensor cores, and a square per element of W); the first stores n, g, −m/(2n³) and vᵀ for the
backward, which is the split forward's (``DoRAFunction``'s). No cross-program sum: no workspace,
no second launch, no atomics. This module imports Triton; import it lazily (``dora.triton_epilogue``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_bench.kernels.lora_triton import MMConfig, _alloc, _mm_config, _precision, block_r
from lora_bench.kernels.triton_launch import launch


@triton.jit
def _lora_dora_mm_kernel(
    x_ptr, w_ptr, p_ptr, q_ptr, bq_ptr, m_ptr, bias_ptr, y_ptr, z_ptr, h_ptr, n_ptr, g_ptr, cn_ptr, vt_ptr,
    M, N, K, R, RS, N_SEG,
    stride_xm, stride_xk, stride_wn, stride_wk, P_SS, stride_pk, stride_pr,
    Q_SS, stride_qr, stride_qn, BQ_SS, stride_bqr, stride_bqn, stride_ym, stride_zm, stride_hm, stride_vr,
    scale,
    HAS_BIAS: tl.constexpr, SEGMENTED: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_RS: tl.constexpr, GROUP_M: tl.constexpr,
):
    # S layers with one input side by side (SEGMENTED): R = S·RS adapter columns, layer j // RS's;
    # N = S·N_SEG outputs, a block of outputs inside one layer's (the host makes N_SEG a multiple of
    # BLOCK_N). One layer: RS = R, N_SEG = N.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % group_size)
    pid_n = (pid % per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, BLOCK_RS)
    r_mask = offs_r < R
    s_mask = offs_s < RS
    seg = (pid_n * BLOCK_N) // N_SEG  # this block's layer
    if SEGMENTED:
        seg_r = offs_r // RS
        p_cols = seg_r * P_SS + (offs_r % RS) * stride_pr
        q_rows = seg_r * Q_SS + (offs_r % RS) * stride_qr
    else:
        p_cols = offs_r * stride_pr
        q_rows = offs_r * stride_qr
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
        # the norm's sums: W·A and AᵀA with A read in W's dtype, ‖W_j‖² in float32. Every tile of rows
        # sums them unconditionally (a dot under a branch in a pipelined loop summed wrong on a GPU)
        at = at.to(wt.dtype)
        wa = tl.dot(tl.trans(at), wt, wa, input_precision=PRECISION)
        gram = tl.dot(tl.trans(at), at, gram, input_precision=PRECISION)
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


BLOCK_N_CHOICES = (128, 64, 32, 16)  # the widths a block of outputs may take, widest first


def epilogue_config(M: int, N: int, K: int, x: torch.Tensor, seg_out: int, segments: int) -> MMConfig | None:
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


def _segments(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A and B as (S, in, r) and (S, r, n) (one layer's: S = 1), and S."""
    if a.dim() == 2:
        return a.unsqueeze(0), b.unsqueeze(0), 1
    return a, b, a.shape[0]


def lora_dora_forward(x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      b_norm: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None, scale: float,
                      config: MMConfig | None = None) -> tuple[torch.Tensor, ...]:
    """(y, z, h, n, g, cn, vᵀ) in one launch for x (M × in), W (out × in), A (in × r), B (r × out) in
    x's dtype (the LoRA op's operands), ``b_norm`` (B as stored: the norm reads it, in float32), m (out)
    and the bias (out) or None: z = x·Wᵀ + s·(x·A)·B and y = g ⊙ z + b in x's dtype, h = x·A, and n,
    g = m / n, cn = −m / (2n³) and vᵀ = (2s·(W·A) + 2s²·(Bᵀ·AᵀA))ᵀ (r × out) in float32, as
    ``dora_triton.dora_forward`` gives them from z.

    S layers side by side: A (S × in × r), B and ``b_norm`` (S × r × n), W (S·n × in), m and the bias
    (S·n); layer i's columns of y, z, n, g, cn and vᵀ are [i·n, (i+1)·n), h's [i·r, (i+1)·r).
    ``config``: the tile (``epilogue_config``; chosen here when None, asserted to fit)."""
    M, k = x.shape
    out = weight.shape[0]
    a, b, S = _segments(a, b)
    b_norm = b_norm if b_norm.dim() == 3 else b_norm.unsqueeze(0)
    r, seg_out = a.shape[2], b.shape[2]
    assert weight.shape == (S * seg_out, k) and a.shape[1] == k and b.shape == (S, r, seg_out) \
        and b_norm.shape == b.shape and m.shape == (out,), (x.shape, weight.shape, a.shape, b.shape, m.shape)
    assert weight.dtype is x.dtype and a.dtype is x.dtype and b.dtype is x.dtype, (x.dtype, weight.dtype, a.dtype)
    c = config or epilogue_config(M, out, k, x, seg_out, S)
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
        (x, weight, a, b, b_norm, m, bias if bias is not None else m, y, z, h, n, g, cn, vt),
        (M, out, k, S * r, r, seg_out, *x.stride(), *ws, as_[0], as_[1], as_[2], q_ss, bs[1], bs[2],
         bq_ss, bns[1], bns[2], y.stride(0), z.stride(0), h.stride(0), vt.stride(0)),
        (float(scale),),
        (bias is not None, S > 1, k % c.block_k == 0, _precision(x.dtype), c.block_m, c.block_n, c.block_k,
         block_r(S * r), block_r(r), 8),
        tag="dora_epilogue", num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return y, z, h, n, g, cn, vt


__all__ = ["BLOCK_N_CHOICES", "epilogue_config", "lora_dora_forward"]
