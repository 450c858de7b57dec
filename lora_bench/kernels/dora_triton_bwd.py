"""The Triton kernels of DoRA's backward in the fused layer (:mod:`lora_bench.kernels.dora`; the
forward's are :mod:`lora_bench.kernels.dora_triton`, whose grid rules these follow: every long loop
split across the grid, every split sum added in a fixed order; no atomic adds: an atomic count
only says which program adds the parts). ``dora_exact_bwd``:
the exact norm's backward (dm, dB and dA, and c ⊙ Bᵀ for a trained W's dW); ``dora_norm_bwd``: its
elementwise part alone (dm; dB and c ⊙ Bᵀ where dA is not asked for) in one launch;
``scale_bias_bwd``: the scale's backward, dz = dy ⊙ g, dg = Σ_rows dy ⊙ z, db = Σ_rows dy.

The exact backward turns the forward round, two launches: programs of (a block of A's rows, a part
of the outputs) sum Wᵀ·(c ⊙ Bᵀ) for their rows from W's tiles as stored and B·diag(c)·Bᵀ (r × r)
from the same B tiles, writing dm, dB and c ⊙ Bᵀ on the way (each block of outputs by one program
of its part); then one program per block of rows adds the parts and forms dA. The scale's
backward, one launch: tiles of rows × outputs write dz and their rows' parts of dg and db; the
last of a block of outputs' programs to finish (an atomic count per block, which it sets back to
0) adds that block's parts in order (and dm = dg / n for the detached norm), so no second launch
waits on the first; with the exact norm the parts alone are written and the norm's first launch
adds them where it reads dg. This module imports Triton;
import it lazily (``dora.triton_bwd``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_bench.kernels.dora_triton import _segments, norm_parts
from lora_bench.kernels.lora_triton import _alloc, _precision, block_r
from lora_bench.kernels.triton_launch import launch


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
def _scale_bwd_kernel(dy_ptr, z_ptr, g_ptr, dz_ptr, pg_ptr, pb_ptr, dg_ptr, db_ptr, n_ptr, gm_ptr, cnt_ptr,
                      M, N, PARTS, stride_dym, stride_zm, stride_dzm, WRITE_DZ: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SUMS: tl.constexpr, NEED_M: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    # a tile of rows × outputs: dz = dy ⊙ g, and this block of rows' parts of dg = Σ dy ⊙ z and db = Σ dy;
    # with SUMS the last of a block of outputs' programs to finish (counted in cnt, which it sets back
    # to 0) then sums that block's parts in order: dg, db and dm = dg / n
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
    if SUMS:
        tl.debug_barrier()  # every thread's parts stored before the count (released with it, device-wide)
        count = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if count == PARTS - 1:
            acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
            acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for part in range(0, PARTS):  # read from L2, past this SM's cache: the others' parts
                acc_g += tl.load(pg_ptr + part * N + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    acc_b += tl.load(pb_ptr + part * N + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg")
            tl.store(dg_ptr + offs_n, acc_g, mask=n_mask)
            if HAS_BIAS:
                tl.store(db_ptr + offs_n, acc_b, mask=n_mask)
            if NEED_M:
                nrm = tl.load(n_ptr + offs_n, mask=n_mask, other=1.0)
                tl.store(gm_ptr + offs_n, (acc_g / nrm).to(gm_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


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

BIG_SIDE = 4096  # a side of W from which the exact backward's programs take 128 rows of A (``exact_bwd_config``)


def exact_bwd_config(device: torch.device, k: int, out: int) -> tuple[int, int, int, int]:
    """(BLOCK_K, BLOCK_N, num_warps, num_stages) of ``dora_exact_bwd``'s first launch for W's ``k``
    inputs and ``out`` outputs (all segments') on a GPU. Every block of A's rows re-reads dg's parts,
    c and Bᵀ for every output, so fewer, taller blocks pay off on a large side: 128 rows × 64
    outputs a step where either side is at least ``BIG_SIDE`` (GPT-2 1558M's MLP and its grouped
    query, key and value), else 64 rows × 128 outputs. On an H100 these took the exact backward
    (with the scale's first launch) from 152 to 67 µs at 1600→6400, 122 to 37 at 6400→1600 and 42
    to 22 at 1600→1600, against 32 rows × 64 outputs (docs/variants.md). The interpreter takes
    16 × 16 tiles, so its tests cross every mask."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    return (128, 64, 4, 3) if max(k, out) >= BIG_SIDE else (64, 128, 4, 3)


def dora_exact_bwd(dg: torch.Tensor, n: torch.Tensor, cn: torch.Tensor, vt: torch.Tensor, weight: torch.Tensor,
                   a: torch.Tensor, b: torch.Tensor, scale: float, *, m_dtype: torch.dtype, need_m: bool,
                   need_b: bool, need_cb: bool,
                   bias_parts: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
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
    bk, bn, warps, stages = exact_bwd_config(weight.device, k, out)
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
    rows contiguous), g (N); one launch: dz and each block of rows' parts of dg and db, the last
    program of each block of outputs then summing that block's parts in order (with n: the detached
    norm's backward in the same launch). ``sums=False``: the parts alone (P × N, float32) returned
    in dg's and db's places, for ``dora_exact_bwd`` to add where it reads them."""
    M, N = z.shape
    dz = _alloc((M, N), z) if need_dz else None
    bm, bn = _scale_bwd_config(z.device)
    parts = max(1, triton.cdiv(M, bm))
    pg = _alloc((parts, N), z, torch.float32)
    pb = _alloc((parts, N), z, torch.float32) if need_db else pg
    if not M:  # no rows: the sums are zero
        pg.zero_()
        pb.zero_()
        if not sums:
            return dz, pg, pb if need_db else None, None
        gm = torch.zeros((N,), dtype=m_dtype, device=z.device) if n is not None else None
        return dz, pg[0], pb[0] if need_db else None, gm
    dg = _alloc((N,), z, torch.float32) if sums else pg
    db = _alloc((N,), z, torch.float32) if sums and need_db else None
    gm = _alloc((N,), z, m_dtype) if sums and n is not None else None
    grid_n = triton.cdiv(N, bn)
    launch(_scale_bwd_kernel, (grid_n, parts, 1),
           (dy, z, g, dz if need_dz else dy, pg, pb, dg, db if db is not None else dg, n if n is not None else dg,
            gm if gm is not None else dg, _counters(z.device, grid_n) if sums else pg),
           (M, N, parts, dy.stride(0), z.stride(0), dz.stride(0) if need_dz else 0), (),
           (need_dz, need_db, sums, gm is not None, bm, bn), tag="dora_scale_bwd", num_warps=4, num_stages=1)
    if not sums:
        return dz, pg, pb if need_db else None, None
    return dz, dg, db, gm


_COUNTERS: dict[tuple, torch.Tensor] = {}  # (device, stream) -> int32 counts, all 0 between launches


def _counters(device: torch.device, count: int) -> torch.Tensor:
    """``count`` int32 counters at 0 for ``_scale_bwd_kernel``'s sums on the current stream of
    ``device``: one buffer per stream, made once (grown where a launch needs more), each launch
    leaving its counters at 0 again. Launches on one stream run one after the other, so they share
    it; each stream has its own, so launches on two streams never count in one."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < count:
        buf = _COUNTERS[key] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    return buf


__all__ = ["BIG_SIDE", "dora_exact_bwd", "dora_norm_bwd", "exact_bwd_config", "scale_bias_bwd"]
