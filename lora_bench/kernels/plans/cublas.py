"""The ``cublas`` plan: torch GEMMs (cuBLAS) for the products with W and the rank-r updates, one
Triton launch for grad_A and grad_B together (``lora_triton.lora_grad_ab``): cuBLAS where the
Triton GEMM is slower on the device (exact fp32, 1558M's MLP shapes under torch.compile)."""

from __future__ import annotations

from lora_bench.kernels.call import Plan
from lora_bench.kernels.plans import fused, torch_ops

FALLBACK = Plan.TORCH
runs = fused.runs  # it needs the Triton kernel for the adapter gradients
forward = torch_ops.forward
grad_x_u = torch_ops.grad_x_u
grad_ab = fused.grad_ab
