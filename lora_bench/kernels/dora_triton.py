"""The Triton kernels of DoRA in the fused layer (:mod:`lora_bench.kernels.dora`). ``dora_forward``:
for z (M × out) from the LoRA op, W (out × in), A (in × r), B (r × out), m (out), the bias and the
scale s, y = g ⊙ z + b with g = m / n, n_j = ‖W_j + s·(A·B)_j‖, and what the backward reads (n, g,
−m / (2n³), and 2s·(W·A)ᵀ + 2s²·(Bᵀ·AᵀA)ᵀ: r × out, all float32); ``dora_exact_bwd`` the exact
norm's backward (dm, dB and dA, and c ⊙ Bᵀ for a trained W's dW); ``dora_norm_bwd`` its elementwise
part alone (dm; dB and c ⊙ Bᵀ where dA is not asked for) in one launch; ``scale_bias_bwd`` the
scale's backward, dz = dy ⊙ g, dg = Σ_rows dy ⊙ z, db = Σ_rows dy.

Every long loop is split across the grid, so that each launch runs as one or two waves of short
programs: a loop of dependent steps in too few programs leaves an SM's loads waiting (the first
build, one program per 16 outputs over all of K and all rows, took 24 to 100 µs a launch). A split
sum goes to a workspace, one slot per part, and the next launch adds the parts in a fixed order:
no atomics, so a run repeats bit for bit.

The forward, two launches: programs of (16 outputs, a part of K) accumulate their part of W·A,
of ‖W_j‖² from the same W tiles (a frozen W needs no stored row norms here) and of A's Gram matrix
AᵀA from the same A tiles (in × r² multiply-adds per program beside its W·A's rows × in × r),
which the first block of each segment writes; then programs of (16 outputs, a block of rows) add
the parts, form Bᵀ·AᵀA, the dots with Bᵀ, the root and g (each block of rows alike, the first
storing them), and write y = g ⊙ z + b for their rows. W is read once, z once. The exact backward turns it round, two launches: programs of (a block of
A's rows, a part of the outputs) sum Wᵀ·(c ⊙ Bᵀ) for their rows from W's tiles as stored and
B·diag(c)·Bᵀ (r × r) from the same B tiles, writing dm, dB and c ⊙ Bᵀ on the way (each block of
outputs by one program of its part); then one program per block of rows adds the parts and forms
dA. The scale's backward, two launches: tiles of rows × outputs write dz and their rows' parts of
dg and db; then the parts are added (and dm = dg / n for the detached norm); with the exact norm
the second is left out and the norm's first launch adds the parts where it reads dg. This module imports
Triton; import it lazily (``dora.triton_norm``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lora_bench.kernels.lora_triton import _alloc, _precision, block_r
from lora_bench.kernels.triton_launch import launch


@triton.jit
def _dora_norm_part_kernel(
    w_ptr, a_ptr, wa_ptr, sq_ptr, gram_ptr,
    N, K, R, N_SEG, K_PER,
    stride_wn, stride_wk, stride_as, stride_ak, stride_ar,
    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # program (block of outputs, part of K): its part of W·A (BN × r) and of ‖W_j‖²; the first block of
    # each segment also writes its part of A's Gram matrix AᵀA (every block sums it: r² per row of A)
    pid = tl.program_id(0)
    part = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    # segments of N_SEG outputs, each with its own A and B (one segment: N_SEG = N); a block lies in
    # one segment (the host makes N_SEG a multiple of BLOCK_N where there are several)
    seg = (pid * BLOCK_N) // N_SEG
    a_ptr += seg * stride_as
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < N
    r_mask = offs_r < R
    wa = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    gram = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)
    wsq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_lo = part * K_PER
    for k0 in range(k_lo, k_lo + K_PER, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K  # the K tail, rows past N and A's columns past R read zeros: they are summed
        wt = tl.load(w_ptr + offs_n[:, None] * stride_wn + ks[None, :] * stride_wk,
                     mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # (BN, BK)
        at = tl.load(a_ptr + ks[:, None] * stride_ak + offs_r[None, :] * stride_ar,
                     mask=k_mask[:, None] & r_mask[None, :], other=0.0).to(w_ptr.dtype.element_ty)  # (BK, BR)
        wa = tl.dot(wt, at, wa, input_precision=PRECISION)
        gram = tl.dot(tl.trans(at), at, gram, input_precision=PRECISION)
        wf = wt.to(tl.float32)
        wsq += tl.sum(wf * wf, axis=1)
    tl.store(wa_ptr + part * N * BLOCK_R + offs_n[:, None] * BLOCK_R + offs_r[None, :], wa, mask=n_mask[:, None])
    tl.store(sq_ptr + part * N + offs_n, wsq, mask=n_mask)
    if pid * BLOCK_N == seg * N_SEG:
        nparts = tl.num_programs(1)
        tl.store(gram_ptr + (seg * nparts + part) * BLOCK_R * BLOCK_R + offs_r[:, None] * BLOCK_R + offs_r[None, :],
                 gram)


@triton.jit
def _dora_norm_scale_kernel(
    wa_ptr, sq_ptr, gram_ptr, b_ptr, m_ptr, z_ptr, bias_ptr, y_ptr, n_ptr, g_ptr, cn_ptr, vt_ptr,
    N, R, M, N_SEG, PARTS,
    stride_bs, stride_br, stride_bn, stride_vr, stride_vn, stride_zm, stride_ym,
    scale,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
    SUB_M: tl.constexpr,
):
    # program (block of outputs, block of rows): the parts of K summed in order, then Bᵀ·AᵀA, the dots
    # with Bᵀ, n and g (every block of rows forms them alike: a few loads and an r-wide product; the
    # first stores them and what the backward reads); then y = g ⊙ z + b for its rows, SUB_M at a time
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    seg = (pid * BLOCK_N) // N_SEG
    b_ptr += seg * stride_bs
    local_n = offs_n - seg * N_SEG
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < N
    r_mask = offs_r < R
    wa = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    gram = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)
    wsq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for part in range(0, PARTS):
        wa += tl.load(wa_ptr + part * N * BLOCK_R + offs_n[:, None] * BLOCK_R + offs_r[None, :],
                      mask=n_mask[:, None], other=0.0)
        wsq += tl.load(sq_ptr + part * N + offs_n, mask=n_mask, other=0.0)
        gram += tl.load(gram_ptr + (seg * PARTS + part) * BLOCK_R * BLOCK_R + offs_r[:, None] * BLOCK_R
                        + offs_r[None, :])
    bt = tl.load(b_ptr + offs_r[None, :] * stride_br + local_n[:, None] * stride_bn,
                 mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)  # (BN, BR): Bᵀ's rows
    btg = tl.dot(bt, gram, input_precision="ieee")
    sq = wsq + (2.0 * scale) * tl.sum(wa * bt, axis=1) + (scale * scale) * tl.sum(btg * bt, axis=1)
    nrm = tl.where(n_mask, tl.sqrt(tl.maximum(sq, 0.0)), 1.0)  # rows past N: 1, never stored
    m = tl.load(m_ptr + offs_n, mask=n_mask, other=1.0).to(tl.float32)
    g = m / nrm
    if pid_m == 0:
        tl.store(n_ptr + offs_n, nrm, mask=n_mask)
        tl.store(g_ptr + offs_n, g, mask=n_mask)
        tl.store(cn_ptr + offs_n, -0.5 * g / (nrm * nrm), mask=n_mask)
        v = (2.0 * scale) * wa + (2.0 * scale * scale) * btg  # (BN, BR), stored as vᵀ (r × out)
        tl.store(vt_ptr + offs_r[None, :] * stride_vr + offs_n[:, None] * stride_vn, v,
                 mask=n_mask[:, None] & r_mask[None, :])
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    for m0 in range(pid_m * BLOCK_M, pid_m * BLOCK_M + BLOCK_M, SUB_M):
        offs_m = m0 + tl.arange(0, SUB_M)
        mask = (offs_m < M)[:, None] & n_mask[None, :]
        z = tl.load(z_ptr + offs_m[:, None] * stride_zm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        y = z * g[None, :]
        if HAS_BIAS:
            y += bias[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dora_norm_bwd_kernel(dg_ptr, n_ptr, cn_ptr, vt_ptr, b_ptr, gm_ptr, gb_ptr, cb_ptr, N, R,
                          stride_vr, stride_vn, stride_br, stride_bn, stride_gr, stride_gn, stride_cn, stride_cr,
                          NEED_M: tl.constexpr, NEED_B: tl.constexpr, NEED_CB: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    # dm = dg / n; with c = dg · (−m / (2n³)): dB = vᵀ ⊙ c and c ⊙ Bᵀ (out × r, for dW)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < N
    mask = (offs_r < R)[:, None] & n_mask[None, :]  # (BR, BN)
    dg = tl.load(dg_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if NEED_M:
        nrm = tl.load(n_ptr + offs_n, mask=n_mask, other=1.0)
        tl.store(gm_ptr + offs_n, (dg / nrm).to(gm_ptr.dtype.element_ty), mask=n_mask)
    if NEED_B or NEED_CB:
        c = dg * tl.load(cn_ptr + offs_n, mask=n_mask, other=0.0)
        if NEED_B:
            vt = tl.load(vt_ptr + offs_r[:, None] * stride_vr + offs_n[None, :] * stride_vn, mask=mask, other=0.0)
            tl.store(gb_ptr + offs_r[:, None] * stride_gr + offs_n[None, :] * stride_gn,
                     (vt * c[None, :]).to(gb_ptr.dtype.element_ty), mask=mask)
        if NEED_CB:
            b = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn, mask=mask,
                        other=0.0).to(tl.float32)
            tl.store(cb_ptr + offs_n[None, :] * stride_cn + offs_r[:, None] * stride_cr, b * c[None, :], mask=mask)


@triton.jit
def _dora_exact_bwd_kernel(
    dg_ptr, n_ptr, cn_ptr, vt_ptr, w_ptr, b_ptr, gm_ptr, gb_ptr, cb_ptr, pa_ptr, pbcb_ptr, pdb_ptr, db_ptr,
    N, K, R, N_PER, DG_PARTS, stride_dgp,
    stride_vr, stride_vn, stride_wn, stride_wk, stride_bs, stride_br, stride_bn,
    stride_gs, stride_gr, stride_gn, stride_cn, stride_cr,
    PRECISION: tl.constexpr, PRECISION_F32: tl.constexpr, NEED_M: tl.constexpr, NEED_B: tl.constexpr,
    NEED_CB: tl.constexpr, NEED_DB: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # For a block of A's rows and a part of the outputs: that part's Wᵀ·(c ⊙ Bᵀ) for the rows and its
    # B·diag(c)·Bᵀ (r × r, summed alike by every block of rows, written by the first), c ⊙ Bᵀ rebuilt per
    # block of outputs; each block of outputs also gets dm, dB (and c ⊙ Bᵀ) from one program of its
    # part, the pid ≡ block one. program_id(1) is segment × parts + part: segment seg has N outputs
    # (its own A, B, dA and dB) and its per-output vectors, vᵀ's columns, W's rows and c ⊙ Bᵀ's rows
    # start at column seg·N. dg comes as DG_PARTS rows (the scale's blocks of rows' parts, added here in
    # order; one row: dg itself), with the bias's parts beside it where NEED_DB (db written by the owners).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    parts = tl.cdiv(N, N_PER)
    seg = tl.program_id(1) // parts
    part = tl.program_id(1) % parts
    base = seg * N
    dg_ptr += base
    pdb_ptr += base
    db_ptr += base
    n_ptr += base
    cn_ptr += base
    gm_ptr += base
    vt_ptr += base * stride_vn
    w_ptr += base * stride_wn
    cb_ptr += base * stride_cn
    b_ptr += seg * stride_bs
    gb_ptr += seg * stride_gs
    offs_k = pid * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    k_mask = offs_k < K
    r_mask = offs_r < R
    acc = tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.float32)  # Wᵀ·(c ⊙ Bᵀ) for this program's rows
    bcb = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)  # B·diag(c)·Bᵀ over this part's outputs
    n_lo = part * N_PER
    for n0 in range(n_lo, n_lo + N_PER, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        nr_mask = n_mask[:, None] & r_mask[None, :]
        dg = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for p in range(0, DG_PARTS):
            dg += tl.load(dg_ptr + p * stride_dgp + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        c = dg * tl.load(cn_ptr + offs_n, mask=n_mask, other=0.0)  # outputs past N: c = 0, summed
        bt = tl.load(b_ptr + offs_r[None, :] * stride_br + offs_n[:, None] * stride_bn, mask=nr_mask,
                     other=0.0).to(tl.float32)  # (BN, BR): Bᵀ's rows
        cb = bt * c[:, None]  # (BN, BR): c ⊙ Bᵀ
        wt = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                     mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # (BK, BN): Wᵀ's tile, as stored
        acc = tl.dot(wt, cb.to(wt.dtype), acc, input_precision=PRECISION)
        bcb = tl.dot(tl.trans(bt), cb, bcb, input_precision=PRECISION_F32)
        own = n_mask & ((offs_n // BLOCK_N) % nprog == pid)  # one writer for each output: this block's
        own_r = own[:, None] & r_mask[None, :]
        if NEED_M:
            nrm = tl.load(n_ptr + offs_n, mask=own, other=1.0)
            tl.store(gm_ptr + offs_n, (dg / nrm).to(gm_ptr.dtype.element_ty), mask=own)
        if NEED_B:
            v = tl.load(vt_ptr + offs_r[None, :] * stride_vr + offs_n[:, None] * stride_vn, mask=own_r, other=0.0)
            tl.store(gb_ptr + offs_r[None, :] * stride_gr + offs_n[:, None] * stride_gn,
                     (v * c[:, None]).to(gb_ptr.dtype.element_ty), mask=own_r)
        if NEED_CB:
            tl.store(cb_ptr + offs_n[:, None] * stride_cn + offs_r[None, :] * stride_cr, cb, mask=own_r)
        if NEED_DB:
            db = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for p in range(0, DG_PARTS):
                db += tl.load(pdb_ptr + p * stride_dgp + offs_n, mask=own, other=0.0)
            tl.store(db_ptr + offs_n, db, mask=own)
    slot = tl.program_id(1)  # (segment, part): the parts' sums, added in order by the second launch
    tl.store(pa_ptr + (slot * K + offs_k[:, None]) * BLOCK_R + offs_r[None, :], acc, mask=k_mask[:, None])
    if pid == 0:
        tl.store(pbcb_ptr + slot * BLOCK_R * BLOCK_R + offs_r[:, None] * BLOCK_R + offs_r[None, :], bcb)


@triton.jit
def _dora_exact_bwd_finish_kernel(pa_ptr, pbcb_ptr, a_ptr, ga_ptr, K, R, PARTS, stride_as, stride_ak, stride_ar,
                                  stride_gas, stride_gak, stride_gar, scale, PRECISION_F32: tl.constexpr,
                                  BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    # dA = 2s·Wᵀ·(c ⊙ Bᵀ) + 2s²·A·(B·diag(c)·Bᵀ) for a block of A's rows of segment program_id(1), the
    # parts of the outputs summed in order
    pid = tl.program_id(0)
    seg = tl.program_id(1)
    offs_k = pid * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    k_mask = offs_k < K
    kr_mask = k_mask[:, None] & (offs_r < R)[None, :]
    acc = tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.float32)
    bcb = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)
    for part in range(0, PARTS):
        slot = seg * PARTS + part
        acc += tl.load(pa_ptr + (slot * K + offs_k[:, None]) * BLOCK_R + offs_r[None, :], mask=k_mask[:, None],
                       other=0.0)
        bcb += tl.load(pbcb_ptr + slot * BLOCK_R * BLOCK_R + offs_r[:, None] * BLOCK_R + offs_r[None, :])
    a = tl.load(a_ptr + seg * stride_as + offs_k[:, None] * stride_ak + offs_r[None, :] * stride_ar, mask=kr_mask,
                other=0.0).to(tl.float32)
    ga = (2.0 * scale) * acc + (2.0 * scale * scale) * tl.dot(a, bcb, input_precision=PRECISION_F32)
    tl.store(ga_ptr + seg * stride_gas + offs_k[:, None] * stride_gak + offs_r[None, :] * stride_gar,
             ga.to(ga_ptr.dtype.element_ty), mask=kr_mask)


@triton.jit
def _scale_bwd_part_kernel(dy_ptr, z_ptr, g_ptr, dz_ptr, pg_ptr, pb_ptr, M, N, stride_dym, stride_zm, stride_dzm,
                           WRITE_DZ: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    # a tile of rows × outputs: dz = dy ⊙ g, and this block of rows' parts of dg = Σ dy ⊙ z and db = Σ dy
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    mask = (offs_m < M)[:, None] & n_mask[None, :]  # padded rows read zeros: they are summed
    dy = tl.load(dy_ptr + offs_m[:, None] * stride_dym + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs_m[:, None] * stride_zm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if WRITE_DZ:
        g = tl.load(g_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(dz_ptr + offs_m[:, None] * stride_dzm + offs_n[None, :],
                 (dy * g[None, :]).to(dz_ptr.dtype.element_ty), mask=mask)
    tl.store(pg_ptr + pid_m * N + offs_n, tl.sum(dy * z, axis=0), mask=n_mask)
    if HAS_BIAS:
        tl.store(pb_ptr + pid_m * N + offs_n, tl.sum(dy, axis=0), mask=n_mask)


@triton.jit
def _scale_bwd_finish_kernel(pg_ptr, pb_ptr, dg_ptr, db_ptr, n_ptr, gm_ptr, N, PARTS, HAS_BIAS: tl.constexpr,
                             NEED_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # dg and db: the blocks of rows' parts summed in order; dm = dg / n, the detached norm's whole backward
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for part in range(0, PARTS):
        acc_g += tl.load(pg_ptr + part * N + offs_n, mask=n_mask, other=0.0)
        if HAS_BIAS:
            acc_b += tl.load(pb_ptr + part * N + offs_n, mask=n_mask, other=0.0)
    tl.store(dg_ptr + offs_n, acc_g, mask=n_mask)
    if HAS_BIAS:
        tl.store(db_ptr + offs_n, acc_b, mask=n_mask)
    if NEED_M:
        nrm = tl.load(n_ptr + offs_n, mask=n_mask, other=1.0)
        tl.store(gm_ptr + offs_n, (acc_g / nrm).to(gm_ptr.dtype.element_ty), mask=n_mask)


def fwd_config(dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the norm's two launches in ``dora_forward``: 16
    outputs per program, the smallest side ``tl.dot`` takes, 128-byte rows of W per K step; the
    interpreter takes 16 × 16 tiles, so its tests cross every mask."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    return 16, 32 if dtype == torch.float32 else 64, 4, 3


PROGRAMS_PER_SM = 4  # what the norm's first launch aims at: enough programs on every SM to keep loads in flight
MAX_PARTS = 16  # parts of K at most (the second launch sums them one after the other)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def norm_parts(blocks: int, k: int, bk: int, device: torch.device) -> int:
    """How many parts of K the norm's first launch splits W·A, ‖W_j‖² and AᵀA into, for ``blocks``
    blocks of outputs: on a GPU enough for ``PROGRAMS_PER_SM`` programs on each SM (GPT-2 124M's 768
    outputs over K = 768 give 11 parts of 1 or 2 steps on an H200's 132 SMs instead of one program
    running 12 steps; 1558M's 6400 outputs give 2), at most one per step of K and ``MAX_PARTS``; the
    interpreter takes 3 (at most one per step), so its tests sum parts."""
    want = 3 if device.type != "cuda" else triton.cdiv(PROGRAMS_PER_SM * _sm_count(device.index or 0), blocks)
    return max(1, min(want, triton.cdiv(k, bk), MAX_PARTS))


def scale_config(device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, SUB_M) of the norm's second launch, which scales z: 128 rows a program, 64 at a time,
    on a GPU (960 rows and 768 outputs give 48 × 8 programs); 32 and 16 in the interpreter, so its
    tests cross blocks of rows and the steps inside one."""
    return (128, 64) if device.type == "cuda" else (32, 16)


def _segments(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A and B as (S, in, r) and (S, r, n) (a layer's own: S = 1), and S."""
    if a.dim() == 2:
        return a.unsqueeze(0), b.unsqueeze(0), 1
    assert a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0], (a.shape, b.shape)
    return a, b, a.shape[0]


def segments_fit(out: int, device: torch.device) -> bool:
    """Whether layers of ``out`` outputs each can run side by side in the forward kernel: each block
    of outputs must lie in one layer's (``fwd_config``'s BLOCK_N divides ``out``)."""
    return out % fwd_config(torch.float32, device)[0] == 0


def dora_forward(z: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, m: torch.Tensor,
                 bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, ...]:
    """(y, n, g, cn, vᵀ) in two launches, for z (M × out, rows contiguous), W (out × in), A (in × r),
    B (r × out), m (out) and the bias (out) or None: y = g ⊙ z + b in z's dtype (computed in float32
    from g and b as they are), and n, g, cn = −m / (2n³) and vᵀ = (2s·(W·A) + 2s²·(Bᵀ·AᵀA))ᵀ (r × out)
    in float32. W in float32, bfloat16 or float16 (fp32 products follow torch's matmul precision, as
    the LoRA kernels do) and A in any of them, read in W's dtype (a float32 A beside a bfloat16 W,
    as in bf16 mode, is rounded as the LoRA op under autocast rounds it), any strides; B, m and the
    bias in any float dtype.

    S layers side by side (one input, their outputs side by side in z's columns): A (S × in × r) and
    B (S × r × n) stacked, W (S·n × in), m and the bias (S·n), out = S·n; layer i's columns are
    [i·n, (i+1)·n) of y, n, g, cn and vᵀ (``segments_fit`` n)."""
    out, k = weight.shape
    a, b, S = _segments(a, b)
    r, seg_out = a.shape[2], b.shape[2]
    rows = z.shape[0]
    assert a.shape[1] == k and b.shape == (S, r, seg_out) and S * seg_out == out and m.shape == (out,) \
        and z.shape == (rows, out), (weight.shape, a.shape, b.shape, m.shape, z.shape)
    assert z.stride(1) == 1 or rows <= 1, z.stride()
    f32 = torch.float32
    n, g, cn = (_alloc((out,), weight, f32) for _ in range(3))
    vt = _alloc((r, out), weight, f32)
    y = _alloc((rows, out), z)
    bn, bk, warps, stages = fwd_config(weight.dtype, weight.device)
    assert S == 1 or seg_out % bn == 0, (seg_out, bn)
    blocks, br = triton.cdiv(out, bn), block_r(r)
    steps = triton.cdiv(k, bk)
    k_per = triton.cdiv(steps, norm_parts(blocks, k, bk, weight.device)) * bk
    parts = triton.cdiv(k, k_per)  # no part without a step of K
    wa = _alloc((parts, out, br), weight, f32)  # the parts' sums, added in order by the second launch
    sq = _alloc((parts, out), weight, f32)
    gram = _alloc((S, parts, br, br), weight, f32)
    ws, as_, bs, vs = weight.stride(), a.stride(), b.stride(), vt.stride()
    launch(_dora_norm_part_kernel, (blocks, parts, 1), (weight, a, wa, sq, gram),
           (out, k, r, seg_out, k_per, ws[0], ws[1], *as_), (),
           (_precision(weight.dtype), bn, bk, br), tag="dora_fwd", num_warps=warps, num_stages=stages)
    bm, sub = scale_config(z.device)
    launch(_dora_norm_scale_kernel, (blocks, max(1, triton.cdiv(rows, bm)), 1),
           (wa, sq, gram, b, m, z, bias if bias is not None else m, y, n, g, cn, vt),
           (out, r, rows, seg_out, parts, *bs, vs[0], vs[1], z.stride(0), y.stride(0)), (float(scale),),
           (bias is not None, bn, br, bm, sub), tag="dora_fwd_scale", num_warps=warps, num_stages=2)
    return y, n, g, cn, vt


def dora_norm_bwd(dg: torch.Tensor, n: torch.Tensor, cn: torch.Tensor, vt: torch.Tensor, b: torch.Tensor, *,
                  m_dtype: torch.dtype, need_m: bool, need_b: bool, need_cb: bool) -> tuple[torch.Tensor | None, ...]:
    """The elementwise part of the norm's backward in one launch, from ``dora_norm``'s outputs and
    dg (out, float32): (dm = dg / n in ``m_dtype``, dB = vᵀ ⊙ c in B's dtype, c ⊙ Bᵀ (out × r,
    float32)) with c = dg · cn, each None where not asked for (cn, vᵀ and B are read only for dB or
    c ⊙ Bᵀ)."""
    exact = need_b or need_cb
    out, r = dg.shape[0], vt.shape[0] if exact else 1
    gm = _alloc((out,), dg, m_dtype) if need_m else None
    gb = _alloc((r, out), dg, b.dtype) if need_b else None
    cb = _alloc((out, r), dg, torch.float32) if need_cb else None
    bn = 64 if dg.is_cuda else 16
    vs, bs = (vt.stride(), b.stride()) if exact else ((0, 0), (0, 0))
    gs = gb.stride() if need_b else (0, 0)
    cs = cb.stride() if need_cb else (0, 0)
    launch(_dora_norm_bwd_kernel, (triton.cdiv(out, bn), 1, 1),
           (dg, n, cn, vt, b, gm if need_m else dg, gb if need_b else dg, cb if need_cb else dg),
           (out, r, vs[0], vs[1], bs[0], bs[1], gs[0], gs[1], cs[0], cs[1]), (),
           (need_m, need_b, need_cb, bn, block_r(r)), tag="dora_norm_bwd", num_warps=4, num_stages=1)
    return gm, gb, cb

def exact_bwd_config(device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_K, BLOCK_N, num_warps, num_stages) of ``dora_exact_bwd``'s first launch: 32 rows of A per
    program (768 inputs give 24 blocks of rows, 1600 give 50), 64 outputs per step over its part of
    them; the interpreter takes 16 × 16 tiles, so its tests cross every mask."""
    return (32, 64, 4, 3) if device.type == "cuda" else (16, 16, 4, 1)


def dora_exact_bwd(dg: torch.Tensor, n: torch.Tensor, cn: torch.Tensor, vt: torch.Tensor, weight: torch.Tensor,
                   a: torch.Tensor, b: torch.Tensor, scale: float, *, m_dtype: torch.dtype, need_m: bool,
                   need_b: bool, need_cb: bool, bias_parts: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """The exact norm's backward in two launches (S layers side by side as ``dora_forward`` takes
    them: dB (S × r × n) and dA (S × in × r) then), from ``dora_norm``'s outputs and dg (out, float32),
    with W (out × in, as stored), A (in × r) and B (r × out): (dm = dg / n in ``m_dtype``, dB = vᵀ ⊙ c
    in B's dtype, dA = 2s·Wᵀ·(c ⊙ Bᵀ) + 2s²·A·(B·diag(c)·Bᵀ) in A's dtype, c ⊙ Bᵀ (out × r, float32,
    for a trained W's dW)) with c = dg · cn, dm, dB and c ⊙ Bᵀ None where not asked for. A 16-bit W
    is multiplied by c ⊙ Bᵀ rounded to W's dtype (as torch's ``W.t() @ cb`` does); fp32 products
    follow torch's matmul precision; all sums in float32. The first launch runs over blocks of A's
    rows × parts of the outputs (``norm_parts``' rule: enough programs for every SM), writing dm, dB
    and c ⊙ Bᵀ and each part's sums; the second adds the parts in order and forms dA.

    dg may come as the scale's parts (P × out, ``scale_bias_bwd(..., sums=False)``), added in order
    where it is read, with the bias's parts (``bias_parts``, P × out) beside it: their sum db (out,
    float32) is then written on the way and returned fifth (else None), so the scale's backward
    needs no launch to add its parts."""
    out, k = weight.shape
    flat = a.dim() == 2
    a, b, S = _segments(a, b)
    r, seg_out = a.shape[2], b.shape[2]
    assert a.shape[1] == k and b.shape == (S, r, seg_out) and S * seg_out == out and vt.shape == (r, out), (
        weight.shape, a.shape, b.shape)
    dg_parts = dg if dg.dim() == 2 else dg.unsqueeze(0)
    assert dg_parts.shape[1] == out and dg_parts.stride(1) == 1 and (bias_parts is None or (
        bias_parts.shape == dg_parts.shape and bias_parts.stride() == dg_parts.stride())), (dg.shape, out)
    gm = _alloc((out,), dg, m_dtype) if need_m else None
    gb = _alloc((S, r, seg_out), dg, b.dtype) if need_b else None
    cb = _alloc((out, r), dg, torch.float32) if need_cb else None
    db = _alloc((out,), dg, torch.float32) if bias_parts is not None else None
    ga = _alloc((S, k, r), a)
    bk, bn, warps, stages = exact_bwd_config(weight.device)
    blocks, br = triton.cdiv(k, bk), block_r(r)
    steps = triton.cdiv(seg_out, bn)
    n_per = triton.cdiv(steps, norm_parts(blocks * S, seg_out, bn, weight.device)) * bn
    parts = triton.cdiv(seg_out, n_per)
    pa = _alloc((S * parts, k, br), dg, torch.float32)  # each (segment, part)'s Wᵀ·(c ⊙ Bᵀ) for every row of A
    pbcb = _alloc((S * parts, br, br), dg, torch.float32)  # and its B·diag(c)·Bᵀ
    gs = gb.stride() if need_b else (0, 0, 0)
    cs = cb.stride() if need_cb else (0, 0)
    launch(_dora_exact_bwd_kernel, (blocks, S * parts, 1),
           (dg_parts, n, cn, vt, weight, b, gm if need_m else dg, gb if need_b else dg, cb if need_cb else dg, pa,
            pbcb, bias_parts if db is not None else dg, db if db is not None else dg),
           (seg_out, k, r, n_per, dg_parts.shape[0], dg_parts.stride(0), *vt.stride(), *weight.stride(),
            *b.stride(), *gs, *cs), (),
           (_precision(weight.dtype), _precision(torch.float32), need_m, need_b, need_cb, db is not None, bk, bn, br),
           tag="dora_norm_exact_bwd", num_warps=warps, num_stages=stages)
    launch(_dora_exact_bwd_finish_kernel, (blocks, S, 1), (pa, pbcb, a, ga),
           (k, r, parts, *a.stride(), *ga.stride()), (float(scale),), (_precision(torch.float32), bk, br),
           tag="dora_norm_exact_bwd_finish", num_warps=4, num_stages=1)
    if flat:  # one layer: its own (in × r) and (r × out)
        return gm, None if gb is None else gb[0], ga[0], cb, db
    return gm, gb, ga, cb, db


def _scale_bwd_config(device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the scale's backward: 64 rows × 64 outputs a program on a GPU, a grid
    over rows and outputs (960 rows and 768 outputs give 180 programs); 16 × 16 in the interpreter,
    so its tests cross the masks and sum several blocks of rows."""
    return (64, 64) if device.type == "cuda" else (16, 16)


def scale_bias_bwd(dy: torch.Tensor, z: torch.Tensor, g: torch.Tensor, *, need_dz: bool, need_db: bool,
                   n: torch.Tensor | None = None, m_dtype: torch.dtype | None = None,
                   sums: bool = True) -> tuple[torch.Tensor | None, ...]:
    """(dz = dy ⊙ g in z's dtype or None, dg = Σ_rows dy ⊙ z and db = Σ_rows dy in float32 or None,
    dm = dg / n in ``m_dtype`` where the norm n (N, float32) is given, else None) for dy, z (M × N,
    rows contiguous), g (N); two launches: dz and each block of rows' parts of dg and db, then the
    parts summed in order (with n: the detached norm's backward in the same launch). ``sums=False``:
    the first launch alone, dg's and db's parts (P × N, float32) returned in their places, for
    ``dora_exact_bwd`` to add where it reads them."""
    M, N = z.shape
    dz = _alloc((M, N), z) if need_dz else None
    dg = _alloc((N,), z, torch.float32)
    db = _alloc((N,), z, torch.float32) if need_db else None
    gm = _alloc((N,), z, m_dtype) if n is not None else None
    bm, bn = _scale_bwd_config(z.device)
    parts = max(1, triton.cdiv(M, bm))
    pg = _alloc((parts, N), z, torch.float32)
    pb = _alloc((parts, N), z, torch.float32) if need_db else pg
    if M:
        launch(_scale_bwd_part_kernel, (triton.cdiv(N, bn), parts, 1),
               (dy, z, g, dz if need_dz else dy, pg, pb), (M, N, dy.stride(0), z.stride(0),
                                                          dz.stride(0) if need_dz else 0), (),
               (need_dz, need_db, bm, bn), tag="dora_scale_bwd", num_warps=4, num_stages=1)
    else:  # no rows: the sums are zero
        pg.zero_()
        pb.zero_()
    if not sums:
        return dz, pg, pb if need_db else None, None
    fn = 64 if z.is_cuda else 16
    launch(_scale_bwd_finish_kernel, (triton.cdiv(N, fn), 1, 1),
           (pg, pb, dg, db if need_db else dg, n if n is not None else dg, gm if gm is not None else dg),
           (N, parts), (), (need_db, gm is not None, fn), tag="dora_scale_bwd_finish", num_warps=4, num_stages=1)
    return dz, dg, db, gm


__all__ = ["dora_exact_bwd", "dora_forward", "dora_norm_bwd", "exact_bwd_config", "fwd_config", "norm_parts",
           "scale_bias_bwd", "scale_config",
           "segments_fit"]
