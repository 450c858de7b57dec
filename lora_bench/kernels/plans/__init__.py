"""lora-kernel's plans, one module each (direct, cpp, fused, cublas, torch): what the plan computes
forward and backward, and ``runs(call)``, whether it can run a given call
(:class:`lora_bench.kernels.call.Call`). The C++-op plans (direct, cpp) give ``call``, a whole
autograd op; the others give the three pieces the Python Function and the custom ops run:
``forward`` (y, h), ``grad_x_u`` (grad_x, u) and ``grad_ab`` (grad_A, grad_B). ``FALLBACK`` is the
plan a forced plan gives way to where it cannot run (None: the rules of
:mod:`lora_bench.kernels.plan_rules` decide). What each plan runs: docs/kernel-design.md#the-plans.
"""

from __future__ import annotations

from lora_bench.kernels.call import Plan
from lora_bench.kernels.plans import cpp, cublas, direct, fused, torch_ops

MODULES = {Plan.DIRECT: direct, Plan.CPP: cpp, Plan.FUSED: fused, Plan.CUBLAS: cublas, Plan.TORCH: torch_ops}
# the plans that run through the Python Function (eager) or the custom ops (torch.compile)
PYTHON = {p: MODULES[p] for p in (Plan.FUSED, Plan.CUBLAS, Plan.TORCH)}

__all__ = ["MODULES", "PYTHON"]
