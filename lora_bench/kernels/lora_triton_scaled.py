"""The LoRA GEMM of a DoRA layer whose per-output scale g was formed before the call (``dora_ahead``):
``_lora_mm_kernel``'s forward with y = g ⊙ z + bias in its epilogue, one launch where ``lora_fwd`` then
``dora_triton.dora_scale`` take two. It shares the fused kernel's K loop and tiles
(:mod:`lora_bench.kernels.lora_triton`); this module imports Triton, import it lazily."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_bench.kernels.call import TRITON_MAX_RANK as MAX_RANK
from lora_bench.kernels.lora_triton import MMConfig, _alloc, _lora_tile, _precision, block_r, mm_config_for
from lora_bench.kernels.triton_launch import launch


@triton.jit
def _lora_mm_scale_kernel(
    x_ptr, w_ptr, p_ptr, q_ptr, bias_ptr, out_ptr, h_ptr, z_ptr, g_ptr,
    M, N, K, R,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_pk, stride_pr,
    stride_qr, stride_qn, stride_om, stride_on, stride_hm, stride_hr, scale,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_R: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
    RS: tl.constexpr = 0, P_SS: tl.constexpr = 0, Q_SS: tl.constexpr = 0, Q_SEG: tl.constexpr = 0,
    H_IN: tl.constexpr = False,
):
    # H_IN: h holds H = X·P formed before the launch, as in _lora_mm_kernel.
    # A DoRA layer's forward whose per-output scale g (float32) was formed before the call: z = X·Wt +
    # s·(X·P)·Q (no bias) and h = X·P as _lora_mm_kernel computes them, z stored (the backward reads
    # it) and out = g ⊙ z + bias, from z as stored, as a scale launched apart computes it.
    acc, offs_m, offs_n, rn, m_mask = _lora_tile(
        x_ptr, w_ptr, p_ptr, q_ptr, h_ptr, M, N, K, R, stride_xm, stride_xk, stride_wk, stride_wn, stride_pk,
        stride_pr, stride_qr, stride_qn, stride_hm, stride_hr, scale, True, EVEN_K, EVEN_R, PRECISION, BLOCK_M,
        BLOCK_N, BLOCK_K, BLOCK_R, GROUP_M, RS, P_SS, Q_SS, 0, Q_SEG, H_IN)
    z = acc.to(z_ptr.dtype.element_ty)
    mask = m_mask[:, None] & (offs_n < N)[None, :]
    tl.store(z_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, z, mask=mask)
    y = z.to(tl.float32) * tl.load(g_ptr + rn)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, y.to(out_ptr.dtype.element_ty),
             mask=mask)


def _mm_scale(x, w, p, ps, q, qs, g, bias, M, N, K, R, scale, seg, h_apart_of=None):
    """Launch ``_lora_mm_scale_kernel`` (``lora_fwd_scaled``: one layer; ``lora_fwd_scaled_segments``:
    S side by side, seg the kernel's segment constants RS, P_SS, Q_SS, Q_SEG). ``h_apart_of``: None, or
    a function that writes H = X·P into the tensor it is given before the launch. Returns (y, z, h)."""
    br = block_r(R)
    y, z, h = _alloc((M, N), x), _alloc((M, N), x), _alloc((M, R), x)
    if h_apart_of is not None:
        h_apart_of(h)
    ws, xs = w.stride(), x.stride()

    def run(c: MMConfig) -> None:
        launch(
            _lora_mm_scale_kernel, (triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n), 1, 1),
            (x, w, p, q, bias if bias is not None else g, y, h, z, g),
            (M, N, K, R, xs[0], xs[1], ws[1], ws[0], ps[0], ps[1], qs[0], qs[1], y.stride(0), y.stride(1),
             h.stride(0), h.stride(1)),
            (float(scale),),
            (bias is not None, K % c.block_k == 0, R == br, _precision(x.dtype), c.block_m, c.block_n, c.block_k,
             br, 8, *seg, h_apart_of is not None),
            tag="mm_scale", num_warps=c.num_warps, num_stages=c.num_stages,
        )

    run(mm_config_for("mm_scale", M, N, K, R, h_apart_of is not None, x, run))
    return y, z, h


def lora_fwd_scaled(x, w, a, b, g, bias, scale: float, *, apart: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lora_fwd`` without a bias, scaled by a DoRA layer's g in its epilogue, in one launch: z = x·Wᵀ +
    s·(x·A)·B and h = x·A as ``lora_fwd`` gives them, and y = g ⊙ z + bias (computed in float32 from z
    as stored, g float32, the bias read as stored). Returns (y, z, h), y and z in x's dtype. ``apart``:
    as in ``lora_fwd``."""
    M, K = x.shape
    N, R = w.shape[0], a.shape[1]
    assert R <= MAX_RANK and b.shape == (R, N) and g.shape == (N,) and g.dtype == torch.float32, (w.shape, g.shape)
    form = (lambda h: torch.mm(x, a.to(x.dtype), out=h)) if apart else None
    return _mm_scale(x, w, a, a.stride(), b, b.stride(), g, bias, M, N, K, R, scale, (0, 0, 0, 0), form)


def lora_fwd_scaled_segments(x, w, a, b, g, bias, scale: float, *, apart: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lora_fwd_scaled`` for S layers that share their input, side by side as in ``lora_fwd_segments``:
    W (S·n × k), A (S×k×r), B (S×r×n), g and the bias (S·n); y and z (M × S·n), h (M × S·r)."""
    S, k, r = a.shape
    n = b.shape[2]
    seg = (r, a.stride(0), b.stride(0) - n * b.stride(2), n)  # B block-diagonal: Q_SEG = n
    form = (lambda h: torch.mm(x, a.to(x.dtype).transpose(0, 1).reshape(k, S * r), out=h)) if apart else None
    return _mm_scale(x, w, a, (a.stride(1), a.stride(2)), b, (b.stride(1), b.stride(2)), g, bias, x.shape[0], S * n,
                     k, S * r, scale, seg, form)
