"""Which plan a lora-kernel layer call runs: the plans, the policy, and the one function that chooses.

A *plan* is one implementation of the same math (y = x·Wᵀ + b + s·(x·A)·B with the minimal
backward, :mod:`lora_bench.kernels.autograd`):

  direct  the C++ autograd op launching the project's Triton kernels itself through the CUDA
          driver: one launch forward, two backward (:mod:`lora_bench.kernels.direct`)
  cpp     the C++ autograd op with ATen GEMMs (cuBLAS on CUDA): no Python in backward
  fused   the Python Function / custom ops with the Triton kernels: the big GEMM with the rank-r
          path folded in, one launch forward, two backward
  cublas  the Python Function / custom ops with torch GEMMs (cuBLAS) and one Triton launch for
          grad_A and grad_B together
  streams the Python Function / custom ops with torch GEMMs (cuBLAS) for the big products and the
          rank-r work (x·A, g·Bᵀ, grad_A and grad_B in one Triton launch) on a second CUDA stream,
          running beside them; only its two rank-r updates (y += s·h·B, grad_x += s·u·Aᵀ) follow
          the big GEMMs on the caller's stream
  torch   the Python Function / custom ops with torch ops only: the CPU, and the fallback

``choose`` is a pure function of a ``PlanPolicy`` and the facts of one call. The default rules:
an eager CUDA layer is host-bound, so it runs the C++ op (``direct`` for bf16/fp16, ``cpp``
otherwise); under CUDA-graph capture only device time counts, so captured layers run ``fused``
(``cublas`` for exact fp32), except weights of ``cpp_graph_min_weight`` elements or more, where
cuBLAS beats the Triton GEMM (``cpp``); torch.compile cannot trace the C++ op, so compiled layers
run ``fused`` / ``cublas`` with the same size rule; the CPU runs ``torch``. The measurements
behind each rule are in docs/kernel-design.md.

The policy in force is held in a context variable: ``use_policy`` sets it for a block,
``graph_plan`` switches it to capture mode (graph warm-ups run the plan their capture will use).
``policy_from_env`` reads ``LORA_BENCH_KERNEL_MODE`` (a forced plan, for measurements); the entry
points that start a run call it once. ``record_plans`` collects the plans that layer calls with
gradients enabled ran: what a run reports in its ``backend`` column.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import os
from collections.abc import Iterator, Mapping

import torch

from lora_bench.errors import UsageError

ENV_VAR = "LORA_BENCH_KERNEL_MODE"
# At least this many weight elements (GPT-2 1558M's MLP projections, 1600×6400): captured and
# compiled layers run cuBLAS GEMMs instead of the Triton GEMM, which reaches ~60 % of cuBLAS there.
CPP_GRAPH_MIN_WEIGHT = 1600 * 6400
# The Triton kernels keep the rank-r accumulator in registers beside the output tile; above this
# rank the Python Function runs torch ops.
TRITON_MAX_RANK = 128
DTYPES_16 = (torch.bfloat16, torch.float16)  # the compute dtypes of the direct plan


class Plan(str, enum.Enum):
    """One implementation of the lora-kernel layer (module docstring)."""

    FUSED = "fused"
    CUBLAS = "cublas"
    TORCH = "torch"
    STREAMS = "streams"
    CPP = "cpp"
    DIRECT = "direct"

    @property
    def cpp_op(self) -> bool:
        """Whether the plan runs the C++ autograd op (else the Python Function or custom ops)."""
        return self is Plan.DIRECT or self is Plan.CPP

    @property
    def backend(self) -> str:
        """The name results use for it (the ``backend`` column)."""
        return _BACKEND[self]


_BACKEND = {Plan.DIRECT: "cpp-direct", Plan.CPP: "cpp", Plan.FUSED: "triton", Plan.CUBLAS: "cublas",
            Plan.TORCH: "torch", Plan.STREAMS: "cublas-streams"}


class KernelModeError(UsageError, ValueError):
    """A plan name that is not one of ``Plan`` (a forced plan, e.g. from LORA_BENCH_KERNEL_MODE)."""


@dataclasses.dataclass(frozen=True)
class PlanPolicy:
    """How plans are chosen. ``forced``: run this plan wherever it can run (a C++-op plan that
    cannot — under torch.compile, or without the built op — leaves the choice to the rules, and
    turns the size rule of compiled layers off). ``cpp_graph_min_weight``: the weight size from
    which captured and compiled layers run cuBLAS GEMMs. ``capture``: choose as under CUDA-graph
    capture (graph warm-ups, ``graph_plan``)."""

    forced: Plan | None = None
    cpp_graph_min_weight: int = CPP_GRAPH_MIN_WEIGHT
    capture: bool = False

    def __post_init__(self) -> None:
        if self.forced is not None and not isinstance(self.forced, Plan):  # a plan's name
            object.__setattr__(self, "forced", parse_plan(str(self.forced)))


def choose(policy: PlanPolicy, *, device: str, dtype: torch.dtype, capturing: bool, compiling: bool,
           weight_numel: int, rank: int, exact_fp32: bool, have_triton, have_cpp) -> Plan:
    """The plan of one layer call.

    ``device``: the input's device type; ``dtype``: the compute dtype (autocast's when it is on);
    ``capturing``: the current CUDA stream is capturing a graph; ``compiling``: torch.compile is
    tracing the call; ``exact_fp32``: fp32 compute with tf32 off. ``have_triton``: the Triton
    kernels can run on this device (on the CPU: Triton's interpreter); ``have_cpp``: the C++ op is
    built. Those two are read only where the answer depends on them, so they may be objects whose
    truth value runs a probe on first use (``lora_bench.kernels.available``)."""
    forced = policy.forced
    cuda = device == "cuda"
    # (identity tests only: this runs on every eager layer call, and host time counts there)
    if not compiling:  # the C++ op: opaque to torch.compile
        if forced is None:
            if cuda:
                if not (capturing or policy.capture):
                    if have_cpp:
                        direct = (dtype is torch.bfloat16 or dtype is torch.float16) and rank <= TRITON_MAX_RANK
                        return Plan.DIRECT if direct and have_triton else Plan.CPP
                elif weight_numel >= policy.cpp_graph_min_weight and have_cpp:
                    return Plan.CPP
        elif forced is Plan.CPP or forced is Plan.DIRECT:
            if have_cpp:
                direct = (forced is Plan.DIRECT and cuda and (dtype is torch.bfloat16 or dtype is torch.float16)
                          and rank <= TRITON_MAX_RANK)
                return Plan.DIRECT if direct and have_triton else Plan.CPP
    # the Python Function (eager) or the custom ops (torch.compile)
    python_forced = None if forced is None or forced is Plan.CPP or forced is Plan.DIRECT else forced
    if not cuda and (python_forced is None or python_forced is Plan.STREAMS):
        return Plan.TORCH  # (streams are CUDA's)
    if python_forced is Plan.STREAMS:
        return Plan.STREAMS  # (its adapter gradients fall back to torch GEMMs without Triton)
    if rank > TRITON_MAX_RANK or not have_triton:
        return Plan.TORCH
    if python_forced is not None:
        return python_forced
    if exact_fp32:
        return Plan.CUBLAS  # cuBLAS's fp32 GEMMs; the Triton kernels' exact fp32 dots are far slower
    if compiling and forced is None and weight_numel >= policy.cpp_graph_min_weight:
        return Plan.CUBLAS
    return Plan.FUSED


def parse_plan(text: str) -> Plan:
    """A plan from its name (KernelModeError naming the allowed ones otherwise)."""
    try:
        return Plan(text.strip().lower())
    except ValueError:
        raise KernelModeError(f"lora-kernel plan {text!r}: expected one of "
                              f"{', '.join(p.value for p in Plan)}") from None


def policy_from_env(base: PlanPolicy | None = None, environ: Mapping[str, str] | None = None) -> PlanPolicy:
    """``base`` (default: the policy in force) with the plan that ``LORA_BENCH_KERNEL_MODE`` forces,
    if it is set. A bad value raises KernelModeError (a usage error) naming the variable."""
    base = current_policy() if base is None else base
    text = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not text.strip():
        return base
    try:
        return dataclasses.replace(base, forced=parse_plan(text))
    except KernelModeError as exc:
        raise KernelModeError(f"{ENV_VAR}: {exc}") from None


# ------------------------------------------------------------------------- the policy in force
_POLICY: contextvars.ContextVar[PlanPolicy] = contextvars.ContextVar("lora_bench_plan_policy",
                                                                     default=PlanPolicy())


def current_policy() -> PlanPolicy:
    """The policy in force here (the default one unless ``use_policy`` set another)."""
    return _POLICY.get()


@contextlib.contextmanager
def use_policy(policy: PlanPolicy) -> Iterator[PlanPolicy]:
    """Run the block with ``policy`` in force (in this thread / task)."""
    token = _POLICY.set(policy)
    try:
        yield policy
    finally:
        _POLICY.reset(token)


def graph_plan() -> contextlib.AbstractContextManager[PlanPolicy]:
    """The policy in force, in capture mode: calls inside choose the plan a CUDA-graph capture
    gives them. Graph warm-ups run in it, so the kernels a graph captures were compiled and
    launched once before the capture."""
    return use_policy(dataclasses.replace(current_policy(), capture=True))


# ------------------------------------------------------------------------- what the calls ran
class PlanLog:
    """The plans lora-kernel layer calls with gradients enabled (training, not evaluation) ran
    while this log was being recorded into (``record_plans``). Calls under torch.compile note
    their plan when they are traced, calls captured in a CUDA graph when they are captured."""

    def __init__(self) -> None:
        self.plans: set[Plan] = set()

    def __iter__(self) -> Iterator[Plan]:
        return iter(sorted(self.plans, key=lambda p: p.value))

    def __len__(self) -> int:
        return len(self.plans)

    def backend(self) -> str:
        """'+'-joined backend names of the plans noted, e.g. 'cpp+triton'; '' if none."""
        return "+".join(sorted({p.backend for p in self.plans}))


_LOG: contextvars.ContextVar[PlanLog | None] = contextvars.ContextVar("lora_bench_plan_log", default=None)


@contextlib.contextmanager
def record_plans(log: PlanLog | None = None) -> Iterator[PlanLog]:
    """Note into ``log`` (a new one by default) the plan of every layer call in the block."""
    log = PlanLog() if log is None else log
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


def note(plan: Plan) -> None:
    """Record that a layer call ran ``plan`` (calls with gradients enabled, while recording)."""
    log = _LOG.get()
    if log is not None and torch.is_grad_enabled():
        log.plans.add(plan)


__all__ = ["CPP_GRAPH_MIN_WEIGHT", "DTYPES_16", "ENV_VAR", "KernelModeError", "Plan", "PlanLog", "PlanPolicy",
           "TRITON_MAX_RANK", "choose", "current_policy", "graph_plan", "note", "parse_plan", "policy_from_env",
           "record_plans", "use_policy"]
