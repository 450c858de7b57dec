"""The Triton kernel of DoRA's norm forward (:mod:`lora_bench.kernels.dora`): for W (out × in), A
(in × r), B (r × out), m (out) and the scale s, one launch gives n_j = ‖W_j + s·(A·B)_j‖, g = m / n,
W·A and Bᵀ·AᵀA (out × r, which the exact backward reads), all float32.

Each program owns a block of output rows and runs over K once: W·A accumulated for its rows, ‖W_j‖²
from the same W tiles (so a frozen W needs no stored row norms here), and A's Gram matrix AᵀA
recomputed from the same A tiles (in × r² multiply-adds per program: far less than its W·A's
rows × in × r); then Bᵀ·AᵀA, the dot products with Bᵀ and the root. W is read once, A once per
program (it stays in L2). This module imports Triton; import it lazily (``dora.triton_norm``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_bench.kernels.lora_triton import _alloc, _precision, block_r
from lora_bench.kernels.triton_launch import launch


@triton.jit
def _dora_norm_kernel(
    w_ptr, a_ptr, b_ptr, m_ptr, n_ptr, g_ptr, wa_ptr, btg_ptr,
    N, K, R,
    stride_wn, stride_wk, stride_ak, stride_ar, stride_br, stride_bn, stride_on, stride_or, scale,
    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < N
    r_mask = offs_r < R
    wa = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    gram = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)
    wsq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K  # the K tail, rows past N and A's columns past R read zeros: they are summed
        wt = tl.load(w_ptr + offs_n[:, None] * stride_wn + ks[None, :] * stride_wk,
                     mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # (BN, BK)
        at = tl.load(a_ptr + ks[:, None] * stride_ak + offs_r[None, :] * stride_ar,
                     mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # (BK, BR)
        wa = tl.dot(wt, at, wa, input_precision=PRECISION)
        gram = tl.dot(tl.trans(at), at, gram, input_precision=PRECISION)
        wf = wt.to(tl.float32)
        wsq += tl.sum(wf * wf, axis=1)
    bt = tl.load(b_ptr + offs_r[None, :] * stride_br + offs_n[:, None] * stride_bn,
                 mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)  # (BN, BR): Bᵀ's rows
    btg = tl.dot(bt, gram, input_precision="ieee")
    sq = wsq + (2.0 * scale) * tl.sum(wa * bt, axis=1) + (scale * scale) * tl.sum(btg * bt, axis=1)
    nrm = tl.where(n_mask, tl.sqrt(tl.maximum(sq, 0.0)), 1.0)  # rows past N: 1, never stored
    m = tl.load(m_ptr + offs_n, mask=n_mask, other=1.0).to(tl.float32)
    tl.store(n_ptr + offs_n, nrm, mask=n_mask)
    tl.store(g_ptr + offs_n, m / nrm, mask=n_mask)
    o_mask = n_mask[:, None] & r_mask[None, :]
    o = offs_n[:, None] * stride_on + offs_r[None, :] * stride_or
    tl.store(wa_ptr + o, wa, mask=o_mask)
    tl.store(btg_ptr + o, btg, mask=o_mask)


def norm_config(dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): 32 output rows per program (1600 outputs give 50
    programs), 128-byte rows of W per K step; the interpreter takes 16 × 16 tiles, so its tests
    cross every mask."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    return 32, 32 if dtype == torch.float32 else 64, 4, 3


def dora_norm(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, m: torch.Tensor,
              scale: float) -> tuple[torch.Tensor, ...]:
    """(n, g, W·A, Bᵀ·AᵀA) in float32 for W (out × in), A (in × r), B (r × out), m (out), in one
    launch. W and A in one dtype (float32, bfloat16 or float16; fp32 products follow torch's
    matmul precision, as the LoRA kernels do), any strides; B and m in any float dtype."""
    out, k = weight.shape
    r = a.shape[1]
    assert a.shape[0] == k and b.shape == (r, out) and m.shape == (out,), (weight.shape, a.shape, b.shape, m.shape)
    f32 = torch.float32
    n, g = _alloc((out,), weight, f32), _alloc((out,), weight, f32)
    wa, btg = _alloc((out, r), weight, f32), _alloc((out, r), weight, f32)
    bn, bk, warps, stages = norm_config(weight.dtype, weight.device)
    ws, as_, bs, os_ = weight.stride(), a.stride(), b.stride(), wa.stride()
    launch(
        _dora_norm_kernel, (triton.cdiv(out, bn), 1, 1), (weight, a, b, m, n, g, wa, btg),
        (out, k, r, ws[0], ws[1], as_[0], as_[1], bs[0], bs[1], os_[0], os_[1]),
        (float(scale),),
        (_precision(weight.dtype), bn, bk, block_r(r)),
        tag="dora_norm", num_warps=warps, num_stages=stages,
    )
    return n, g, wa, btg


__all__ = ["dora_norm", "norm_config"]
