"""The vocabulary every lora-kernel plan shares: the plans' names, the facts of one layer call
that decide which plan runs, and the limits the kernels have.

A *plan* is one implementation of the same math (y = x·Wᵀ + b + s·(x·A)·B with the minimal
backward, :mod:`lora_bench.kernels.autograd`); each lives in its own module under
:mod:`lora_bench.kernels.plans`, and :mod:`lora_bench.kernels.plan_rules` says when each one is chosen.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import torch

# At least this many weight elements (GPT-2 1558M's MLP projections, 1600×6400): captured layers
# run the C++ op's cuBLAS GEMMs and compiled layers the cublas plan instead of the Triton GEMM,
# which reaches ~60 % of cuBLAS there (lora_bench.kernels.plan_rules).
CPP_GRAPH_MIN_WEIGHT = 1600 * 6400
# The Triton kernels keep the rank-r accumulator in registers beside the output tile; above this
# rank the plans that use them give way to torch ops.
TRITON_MAX_RANK = 128
# With the adapter_h setting at apart, forward GEMMs of this many adapter columns or more (R = S·r for S
# layers side by side) take H = X·P formed before the launch: docs/kernel-design.md#h-formed-apart.
H_APART_MIN_R = 17
DTYPES_16 = (torch.bfloat16, torch.float16)  # the compute dtypes of the direct plan


class Plan(str, enum.Enum):
    """One implementation of the lora-kernel layer; its value is its one name everywhere: the
    ``kernel_plan`` setting (whose choices are ``names.PLAN_NAMES``, the same names in the same
    order), ``kernel-bench --impls lora-kernel:NAME``, the ``backend`` column."""

    DIRECT = "direct"
    CPP = "cpp"
    FUSED = "fused"
    CUBLAS = "cublas"
    TORCH = "torch"

    @property
    def cpp_op(self) -> bool:
        """Whether the plan runs the C++ autograd op (else the Python Function or custom ops)."""
        return self is Plan.DIRECT or self is Plan.CPP


class Call(NamedTuple):
    """The facts of one layer call that the choice of plan depends on.

    ``device``: the input's device type; ``dtype``: the compute dtype (autocast's when it is on);
    ``capturing``: the current CUDA stream is capturing a graph (or the policy chooses as if it
    were: graph warm-ups); ``compiling``: torch.compile is tracing the call; ``exact_fp32``: fp32
    compute with tf32 off. ``have_triton``: the Triton kernels can run on this device (on the CPU:
    Triton's interpreter); ``have_cpp``: the C++ op is built. Those two may be objects whose truth
    value runs a probe on first use (``lora_bench.kernels.available``): a plan reads them only
    where the answer depends on them, after the cheaper facts."""

    device: str
    dtype: torch.dtype
    capturing: bool
    compiling: bool
    weight_numel: int
    rank: int
    exact_fp32: bool
    have_triton: Any
    have_cpp: Any

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def eager(self) -> bool:
        """Neither captured in a CUDA graph nor traced by torch.compile."""
        return not (self.capturing or self.compiling)


__all__ = ["CPP_GRAPH_MIN_WEIGHT", "Call", "DTYPES_16", "H_APART_MIN_R", "Plan", "TRITON_MAX_RANK"]
