"""The ``fused`` plan: the project's Triton kernels (:mod:`lora_bench.kernels.lora_triton`). The big
GEMM carries the rank-r path in its K loop and epilogue: one launch forward (y and h), two backward
(grad_x with u, then grad_A with grad_B). On the CPU it runs only under Triton's interpreter."""

from __future__ import annotations

from lora_bench.kernels import available
from lora_bench.kernels.call import TRITON_MAX_RANK, Call, Plan

FALLBACK = Plan.TORCH


def runs(call: Call) -> bool:
    return call.rank <= TRITON_MAX_RANK and bool(call.have_triton)


def forward(x, w, b, a, bm, s, apart=False):
    """(y, h); ``apart``: h formed before the GEMM's launch (the ``adapter_h`` setting, ``policy.h_apart``)."""
    return available.triton_kernels().lora_fwd(x, w, a, bm, b, s, apart=apart)


def forward_scaled(x, w, a, bm, s, request, apart=False):
    """``forward`` of a DoRA layer whose scale g was formed ahead (``dora_ahead.EpilogueScale``): (z, h),
    and y = g ⊙ z + b from the GEMM's epilogue left in ``request``."""
    from lora_bench.kernels.lora_triton_scaled import lora_fwd_scaled

    y, z, h = lora_fwd_scaled(x, w, a, bm, request.g, request.bias, s, apart=apart)
    request.y = y
    return z, h


def forward_scaled_segments(x, w, a, bm, s, request, apart=False):
    """``forward_scaled`` for S layers side by side (``lora_triton_scaled.lora_fwd_scaled_segments``)."""
    from lora_bench.kernels.lora_triton_scaled import lora_fwd_scaled_segments

    y, z, h = lora_fwd_scaled_segments(x, w, a, bm, request.g, request.bias, s, apart=apart)
    request.y = y
    return z, h


def grad_x_u(g, w, a, bm, s, apart=False):
    return available.triton_kernels().lora_bwd_x(g, w, a, bm, s, apart=apart)


def grad_ab(x, u, h, g, s, *, do_a, do_b, dtype):
    return available.triton_kernels().lora_grad_ab(x, u, h, g, scale=s, grad_dtype=dtype, do_a=do_a, do_b=do_b)
