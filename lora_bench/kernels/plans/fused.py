"""The ``fused`` plan: the project's Triton kernels (:mod:`lora_bench.kernels.lora_triton`). The big
GEMM carries the rank-r path in its K loop and epilogue: one launch forward (y and h), two backward
(grad_x with u, then grad_A with grad_B). On the CPU it runs only under Triton's interpreter."""

from __future__ import annotations

from lora_bench.kernels import available
from lora_bench.kernels.call import TRITON_MAX_RANK, Call, Plan

FALLBACK = Plan.TORCH


def runs(call: Call) -> bool:
    return call.rank <= TRITON_MAX_RANK and bool(call.have_triton)


def forward(x, w, b, a, bm, s):
    return available.triton_kernels().lora_fwd(x, w, a, bm, b, s)


def grad_x_u(g, w, a, bm, s):
    return available.triton_kernels().lora_bwd_x(g, w, a, bm, s)


def grad_ab(x, u, h, g, s, *, do_a, do_b, dtype):
    return available.triton_kernels().lora_grad_ab(x, u, h, g, scale=s, grad_dtype=dtype, do_a=do_a, do_b=do_b)
