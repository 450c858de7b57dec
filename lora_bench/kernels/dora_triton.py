"""The Triton kernels of DoRA's forward in the fused layer (:mod:`lora_bench.kernels.dora`; its
backward's are :mod:`lora_bench.kernels.dora_triton_bwd`). ``dora_forward``: for z (M × out) from
the LoRA op, W (out × in), A (in × r), B (r × out), m (out), the bias and the scale s,
y = g ⊙ z + b with g = m / n, n_j = ‖W_j + s·(A·B)_j‖, and what the backward reads (n, g,
−m / (2n³), and 2s·(W·A)ᵀ + 2s²·(Bᵀ·AᵀA)ᵀ: r × out, all float32).

Every long loop is split across the grid, so that each launch runs as one or two waves of short
programs: a loop of dependent steps in too few programs leaves an SM's loads waiting (the first
build, one program per 16 outputs over all of K and all rows, took 24 to 100 µs a launch). A split
sum goes to a workspace, one slot per part, and the next launch adds the parts in a fixed order:
no atomics, so a run repeats bit for bit (``norm_parts`` chooses how many parts, here and in the
backward).

Two launches: programs of (64 outputs, a part of K) accumulate their part of W·A and of ‖W_j‖² from
the same W tiles (a frozen W needs no stored row norms here) and of A's Gram matrix AᵀA from the
same A tiles, which the first block of each segment writes; then programs of (64 outputs, a block of
rows) add the parts, form Bᵀ·AᵀA, the dots with Bᵀ, the root and g (each block of rows alike, the
first storing them), and write y = g ⊙ z + b for their rows. W is read once, z once. ``dora_norm``
and ``dora_scale`` run the second launch's two halves apart, the same kernel with one half switched
off: the norm formed before the layer's input exists (``dora_ahead``), then the scale alone. This
module imports Triton; import it lazily (``dora.triton_norm``)."""

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
    first = pid * BLOCK_N == seg * N_SEG
    k_lo = part * K_PER
    for k0 in range(k_lo, k_lo + K_PER, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K  # the K tail, rows past N and A's columns past R read zeros: they are summed
        wt = tl.load(w_ptr + offs_n[:, None] * stride_wn + ks[None, :] * stride_wk,
                     mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # (BN, BK)
        at = tl.load(a_ptr + ks[:, None] * stride_ak + offs_r[None, :] * stride_ar,
                     mask=k_mask[:, None] & r_mask[None, :], other=0.0).to(w_ptr.dtype.element_ty)  # (BK, BR)
        wa = tl.dot(wt, at, wa, input_precision=PRECISION)
        # every block sums AᵀA (a quarter of W·A's multiply-adds at 64 outputs), the first writes it: a
        # dot under a branch in this pipelined loop computed wrong sums on a GPU (float32, rank 64)
        gram = tl.dot(tl.trans(at), at, gram, input_precision=PRECISION)
        wf = wt.to(tl.float32)
        wsq += tl.sum(wf * wf, axis=1)
    tl.store(wa_ptr + part * N * BLOCK_R + offs_n[:, None] * BLOCK_R + offs_r[None, :], wa, mask=n_mask[:, None])
    tl.store(sq_ptr + part * N + offs_n, wsq, mask=n_mask)
    if first:
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
    SUB_M: tl.constexpr, NORM: tl.constexpr = True, SCALE: tl.constexpr = True,
):
    # program (block of outputs, block of rows): the parts of K summed in order, then Bᵀ·AᵀA, the dots
    # with Bᵀ, n and g (every block of rows forms them alike: a few loads and an r-wide product; the
    # first stores them and what the backward reads); then y = g ⊙ z + b for its rows, SUB_M at a time.
    # NORM off: g is read from g_ptr (a norm formed before); SCALE off: the norm alone (one block of rows)
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if NORM:
        seg = (pid * BLOCK_N) // N_SEG
        b_ptr += seg * stride_bs
        local_n = offs_n - seg * N_SEG
        offs_r = tl.arange(0, BLOCK_R)
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
    else:
        g = tl.load(g_ptr + offs_n, mask=n_mask, other=0.0)
    if SCALE:
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


def fwd_config(dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the norm's first launch in ``dora_forward`` on a
    GPU: tiles of W of 64 outputs × 128-byte rows per K step. On an H100 the two launches took 28
    µs at 1600→6400 and 21 at 6400→1600 this way, against 66 and 53 with 16 outputs a program;
    wider or deeper tiles were no faster (docs/variants.md). The interpreter takes 16 × 16 tiles,
    so its tests cross every mask."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    return 64, 32 if dtype == torch.float32 else 64, 4, 3


SEGMENT_ALIGN = 16  # layers side by side must each have a multiple of this many outputs (``segments_fit``)


def segment_block(want: int, seg_out: int, segments: int) -> int:
    """A block of outputs of at most ``want`` that lies in one layer's: ``want`` for one layer, else
    the largest of ``want``, ``want``/2, ... down to ``SEGMENT_ALIGN`` that divides ``seg_out``."""
    bn = want
    while segments > 1 and bn > SEGMENT_ALIGN and seg_out % bn:
        bn //= 2
    return bn


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


def scale_config(device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, SUB_M, BLOCK_N) of the norm's second launch, which scales z: 128 rows a program, 64
    at a time, of 64 outputs (128-byte rows of a 16-bit z) on a GPU (960 rows and 768 outputs give
    12 × 8 programs); 32, 16 and 16 in the interpreter, so its tests cross blocks of rows and the
    steps inside one."""
    return (128, 64, 64) if device.type == "cuda" else (32, 16, 16)


def _segments(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A and B as (S, in, r) and (S, r, n) (a layer's own: S = 1), and S."""
    if a.dim() == 2:
        return a.unsqueeze(0), b.unsqueeze(0), 1
    assert a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0], (a.shape, b.shape)
    return a, b, a.shape[0]


def segments_fit(out: int, device: torch.device) -> bool:
    """Whether layers of ``out`` outputs each can run side by side in the forward kernels: each
    block of outputs must lie in one layer's (``segment_block``)."""
    return out % SEGMENT_ALIGN == 0


def _norm_parts(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple:
    """The norm's first launch (module docstring) for W (out × in), A and B (one layer's, or S layers'
    stacked): returns what the second reads, (A and B as (S, ...), S, r, the outputs per layer, the parts
    of W·A, ‖W_j‖² and AᵀA, how many parts)."""
    out, k = weight.shape
    a, b, S = _segments(a, b)
    r, seg_out = a.shape[2], b.shape[2]
    assert a.shape[1] == k and b.shape == (S, r, seg_out) and S * seg_out == out, (weight.shape, a.shape, b.shape)
    f32 = torch.float32
    bn, bk, warps, stages = fwd_config(weight.dtype, weight.device)
    bn = segment_block(bn, seg_out, S)
    assert S == 1 or seg_out % bn == 0, (seg_out, bn)
    blocks, br = triton.cdiv(out, bn), block_r(r)
    steps = triton.cdiv(k, bk)
    k_per = triton.cdiv(steps, norm_parts(blocks, k, bk, weight.device)) * bk
    parts = triton.cdiv(k, k_per)  # no part without a step of K
    wa = _alloc((parts, out, br), weight, f32)  # the parts' sums, added in order by the second launch
    sq = _alloc((parts, out), weight, f32)
    gram = _alloc((S, parts, br, br), weight, f32)
    ws, as_ = weight.stride(), a.stride()
    launch(_dora_norm_part_kernel, (blocks, parts, 1), (weight, a, wa, sq, gram),
           (out, k, r, seg_out, k_per, ws[0], ws[1], *as_), (),
           (_precision(weight.dtype), bn, bk, br), tag="dora_fwd", num_warps=warps, num_stages=stages)
    return a, b, S, r, seg_out, wa, sq, gram, parts


def norm_outputs(weight: torch.Tensor, r: int) -> tuple[torch.Tensor, ...]:
    """Room for what the norm gives for W (out × in) and rank r: n, g, cn (out) and vᵀ (r × out), float32."""
    out = weight.shape[0]
    return (*(_alloc((out,), weight, torch.float32) for _ in range(3)), _alloc((r, out), weight, torch.float32))


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
    out = weight.shape[0]
    rows = z.shape[0]
    assert m.shape == (out,) and z.shape == (rows, out), (weight.shape, m.shape, z.shape)
    assert z.stride(1) == 1 or rows <= 1, z.stride()
    y = _alloc((rows, out), z)
    a, b, S, r, seg_out, wa, sq, gram, parts = _norm_parts(weight, a, b)
    n, g, cn, vt = norm_outputs(weight, r)
    _finish(wa, sq, gram, b, m, n, g, cn, vt, parts, seg_out, S, scale, z=z, bias=bias, y=y)
    return y, n, g, cn, vt


def dora_norm(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, m: torch.Tensor, scale: float,
              outputs: tuple[torch.Tensor, ...]) -> None:
    """``dora_forward``'s norm alone, into ``outputs`` (n, g, cn, vᵀ from ``norm_outputs``), in two
    launches: the norm of a layer (or of S side by side) formed before its input is known, for
    ``dora_scale`` to apply."""
    a, b, S, r, seg_out, wa, sq, gram, parts = _norm_parts(weight, a, b)
    assert m.shape == (weight.shape[0],), (weight.shape, m.shape)
    _finish(wa, sq, gram, b, m, *outputs, parts, seg_out, S, scale)


def dora_scale(z: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = g ⊙ z + b for z (M × out, rows contiguous) and g (out, float32, from ``dora_norm``) in one
    launch: ``dora_forward``'s second launch with g read, not formed. y in z's dtype."""
    rows, out = z.shape
    assert g.shape == (out,) and g.dtype == torch.float32 and (z.stride(1) == 1 or rows <= 1), (z.shape, g.shape)
    y = _alloc((rows, out), z)
    bm, sub, sbn = scale_config(z.device)
    launch(_dora_norm_scale_kernel, (triton.cdiv(out, sbn), max(1, triton.cdiv(rows, bm)), 1),
           (g, g, g, g, g, z, bias if bias is not None else g, y, g, g, g, g),
           (out, 1, rows, out, 1, 0, 0, 0, 0, 0, z.stride(0), y.stride(0)), (1.0,),
           (bias is not None, sbn, 16, bm, sub, False, True), tag="dora_scale", num_warps=4, num_stages=2)
    return y


def _finish(wa, sq, gram, b, m, n, g, cn, vt, parts: int, seg_out: int, S: int, scale: float, *,
            z: torch.Tensor | None = None, bias: torch.Tensor | None = None, y: torch.Tensor | None = None) -> None:
    """The norm's second launch: the parts added, n, g, cn and vᵀ stored, and, where z is given,
    y = g ⊙ z + b for its rows."""
    out = n.shape[0]
    r, br = vt.shape[0], wa.shape[2]
    bm, sub, sbn = scale_config(n.device)
    sbn = segment_block(sbn, seg_out, S)
    rows = 0 if z is None else z.shape[0]
    bs, vs = b.stride(), vt.stride()
    zs = (z, y, bias if bias is not None else m) if z is not None else (m, m, m)
    launch(_dora_norm_scale_kernel, (triton.cdiv(out, sbn), max(1, triton.cdiv(rows, bm)), 1),
           (wa, sq, gram, b, m, zs[0], zs[2], zs[1], n, g, cn, vt),
           (out, r, rows, seg_out, parts, *bs, vs[0], vs[1], z.stride(0) if z is not None else 0,
            y.stride(0) if y is not None else 0), (float(scale),),
           (bias is not None, sbn, br, bm, sub, True, z is not None),
           tag="dora_fwd_scale" if z is not None else "dora_norm_end", num_warps=4, num_stages=2)


__all__ = ["MAX_PARTS", "PROGRAMS_PER_SM", "SEGMENT_ALIGN", "dora_forward", "dora_norm", "dora_scale", "fwd_config",
           "norm_outputs", "norm_parts",
           "scale_config", "segment_block", "segments_fit"]
