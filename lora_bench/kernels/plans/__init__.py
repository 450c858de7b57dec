"""lora-kernel's plans, one module each: what the plan computes forward and backward, and
``runs(call)``, whether it can run a given call (:class:`lora_bench.kernels.call.Call`).

  direct  the C++ autograd op launching the project's Triton kernels itself through the CUDA
          driver: one launch forward, two backward
  cpp     the C++ autograd op with ATen GEMMs (cuBLAS on CUDA): no Python in backward
  fused   the Python Function / custom ops with the Triton kernels: the big GEMM with the rank-r
          path folded in, one launch forward, two backward
  cublas  the Python Function / custom ops with torch GEMMs (cuBLAS) and one Triton launch for
          grad_A and grad_B together
  torch   the Python Function / custom ops with torch ops only: the CPU, and the fallback

The C++-op plans (direct, cpp) are whole autograd ops: their modules give ``call``. The others
give the three pieces the Python Function and the custom ops run: ``forward`` (y, h),
``grad_x_u`` (grad_x, u) and ``grad_ab`` (grad_A, grad_B). ``FALLBACK`` is the plan a forced plan
gives way to where it cannot run (None: the rules of :mod:`lora_bench.kernels.rules` decide).
"""

from __future__ import annotations

from lora_bench.kernels.call import Plan
from lora_bench.kernels.plans import cpp, cublas, direct, fused, torch_ops

MODULES = {Plan.DIRECT: direct, Plan.CPP: cpp, Plan.FUSED: fused, Plan.CUBLAS: cublas, Plan.TORCH: torch_ops}
# the plans that run through the Python Function (eager) or the custom ops (torch.compile)
PYTHON = {p: MODULES[p] for p in (Plan.FUSED, Plan.CUBLAS, Plan.TORCH)}

__all__ = ["MODULES", "PYTHON"]
