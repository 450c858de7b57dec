"""When each lora-kernel plan runs: the default choice as a table, first match wins, each rule
with the measurement behind it. :func:`lora_bench.kernels.policy.choose` walks the table, taking
a rule's plan only where that plan can run the call (``runs`` of its module); the last rule always
matches. ``tests/kernels/test_rules.py`` checks each rule against the committed measurement it cites, and
docs/kernel-design.md tabulates those measurements.

Host time decides eager training at GPT-2 sizes (a layer costs its Python, dispatcher and launch
time, not its kernels): eager layers run the C++ op. Replayed from a CUDA graph, or compiled,
only device time counts: the fastest kernels win.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lora_bench.kernels.call import Call, Plan

KERNEL_BENCH = "results/kernel/kernel-bench/plans/kernel_bench.csv"  # every plan of one layer, eager and replayed


@dataclass(frozen=True)
class Rule:
    """``when`` (the call's facts, the policy's size threshold, whether a plan was forced) → ``plan``."""

    name: str  # what the rule covers, in words
    when: Callable[[Call, int, bool], bool]
    plan: Plan
    evidence: str  # what was measured
    source: str = ""  # where it is recorded (a committed results file or folder)


RULES: tuple[Rule, ...] = (
    Rule("on the CPU", lambda c, big, forced: not c.cuda, Plan.TORCH,
         "Triton runs on the CPU only in its interpreter (for tests); nothing to fuse for"),
    Rule("eager CUDA calls, 16-bit compute", lambda c, big, forced: c.eager, Plan.DIRECT,
         "eager bf16 forward+backward: about the frozen layer's host cost, half of cpp's, at every 124M and "
         "1558M shape", KERNEL_BENCH),
    Rule("eager CUDA calls", lambda c, big, forced: c.eager, Plan.CPP,
         "eager fp32 forward+backward: the fewest host calls; the Python plans cost more host time and fused's "
         "FMA GEMM more device time", KERNEL_BENCH),
    Rule("captured calls with a weight of the size threshold or more",
         lambda c, big, forced: not c.compiling and c.weight_numel >= big, Plan.CPP,
         "bf16 graph replay at 1558M's MLP shapes (1600x6400 weights): cuBLAS beats the Triton GEMM", KERNEL_BENCH),
    Rule("exact fp32, captured or compiled", lambda c, big, forced: c.exact_fp32, Plan.CUBLAS,
         "exact fp32 graph replay: cuBLAS GEMMs with one launch for both adapter gradients beat cpp's separate "
         "GEMMs and fused's FMA GEMM", KERNEL_BENCH),
    Rule("compiled calls with a weight of the size threshold or more (no plan forced)",
         lambda c, big, forced: c.compiling and not forced and c.weight_numel >= big, Plan.CUBLAS,
         "1558M block-compiled, graph-replayed bf16 step: faster with cublas at the MLP shapes than with fused "
         "everywhere (A-B-A)", "results/kernel/plans-compiled-1558m"),
    Rule("captured and compiled calls", lambda c, big, forced: True, Plan.FUSED,
         "bf16 graph replay at the 124M shapes and the square 1558M one: the fused kernels beat cuBLAS-based "
         "plans", KERNEL_BENCH),
    Rule("otherwise (no Triton, or a rank above the kernels' limit)", lambda c, big, forced: True, Plan.TORCH,
         "the plan that needs nothing but torch"),
)

__all__ = ["KERNEL_BENCH", "RULES", "Rule"]
