"""Which plan a lora-kernel layer call runs: the policy in force, and the one function that chooses.

``choose`` is a pure function of a ``PlanPolicy`` and the facts of one call: a forced plan runs
where it can (else the plan its module names as its fallback, else the rules), otherwise the
first rule of :data:`lora_bench.kernels.plan_rules.RULES` whose plan can run the call. The plans
themselves are :mod:`lora_bench.kernels.plans`.

The policy in force is held in a context variable: ``use_policy`` sets it for a block,
``graph_plan`` switches it to capture mode (graph warm-ups run the plan their capture will use).
``policy_for(name)`` is the policy of a run's ``kernel_plan`` setting. ``record_plans`` collects
the plans that layer calls with gradients enabled ran (what a run reports in its ``backend``
column) and where their adapter gradients ran (``adapter_grads``: inline, deferred, or why not), and where
DoRA layers' norms ran (``dora``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator

import torch

from lora_bench.errors import UsageError
from lora_bench.kernels import tile_record
from lora_bench.kernels.call import CPP_GRAPH_MIN_WEIGHT, DTYPES_16, H_APART_MIN_R, TRITON_MAX_RANK, Call, Plan
from lora_bench.kernels.plan_names import (ADAPTER_GRADS, ADAPTER_GRADS_INLINE, ADAPTER_H, ADAPTER_H_CUBLAS,
                                           ADAPTER_H_GEMM, AUTO, GEMM_TILES, GEMM_TILES_PICKED)
from lora_bench.kernels.plans import MODULES
from lora_bench.kernels.plan_rules import RULES


class KernelPlanError(UsageError, ValueError):
    """A plan name that is not one of ``Plan`` (a forced plan, e.g. the ``kernel_plan`` setting), or
    a name for where the adapter gradients run that is not one of ``ADAPTER_GRADS``."""


@dataclasses.dataclass(frozen=True)
class PlanPolicy:
    """How plans are chosen. ``forced``: run this plan wherever it can run (see ``choose``).
    ``cpp_graph_min_weight``: the weight size from which captured and compiled layers run cuBLAS
    GEMMs. ``capture``: choose as under CUDA-graph capture (graph warm-ups, ``graph_plan``).
    ``adapter_grads``: where the Python plans' backward runs the adapter gradients: ``inline`` in
    the layer's backward, ``deferred`` on a side stream joined once per backward pass
    (:mod:`lora_bench.kernels.deferred`; the C++ op's plans always run them inline). ``adapter_h``: where
    the fused plan's GEMMs form x·A and g·Bᵀ: ``gemm``, in their K loop; ``apart``, before the launch for
    launches of ``H_APART_MIN_R`` adapter columns or more (``h_apart``); ``cublas``, those calls on torch's
    GEMMs altogether (``h_by_cublas``). ``gemm_tiles``: how the fused
    GEMMs' tiles are chosen: ``picked`` by the launch shape, ``timed`` on each shape's first eager launch
    (:func:`lora_bench.kernels.lora_tiles.mm_config_for`)."""

    forced: Plan | None = None
    cpp_graph_min_weight: int = CPP_GRAPH_MIN_WEIGHT
    capture: bool = False
    adapter_grads: str = ADAPTER_GRADS_INLINE
    adapter_h: str = ADAPTER_H_GEMM
    gemm_tiles: str = GEMM_TILES_PICKED

    def __post_init__(self) -> None:
        if self.forced is not None and not isinstance(self.forced, Plan):  # a plan's name
            object.__setattr__(self, "forced", parse_plan(str(self.forced)))
        object.__setattr__(self, "adapter_grads", parse_adapter_grads(self.adapter_grads))
        if self.adapter_h not in ADAPTER_H:
            raise KernelPlanError(f"lora-kernel adapter_h {self.adapter_h!r}: expected one of {', '.join(ADAPTER_H)}")
        if self.gemm_tiles not in GEMM_TILES:
            raise KernelPlanError(f"lora-kernel gemm_tiles {self.gemm_tiles!r}: expected one of "
                                  f"{', '.join(GEMM_TILES)}")


def choose(policy: PlanPolicy, *, device: str, dtype: torch.dtype, capturing: bool, compiling: bool,
           weight_numel: int, rank: int, exact_fp32: bool, have_triton, have_cpp) -> Plan:
    """The plan of one layer call (the facts: :class:`lora_bench.kernels.call.Call`).

    A forced plan runs where its module's ``runs`` says it can; otherwise its ``FALLBACK`` (direct
    gives way to cpp, fused and cublas to torch); a forced plan without one that cannot run (cpp
    under torch.compile, or without the built op) leaves the choice to the rules, with the size
    rule of compiled layers off. Without a forced plan: the first rule whose plan can run.

    Eager layers ask on every call, so answers are kept: by the facts, with each availability probe
    by its answer where it is known (unknown: the answer did not depend on it)."""
    capturing = capturing or policy.capture
    key = (policy, device, dtype, capturing, compiling, weight_numel, rank, exact_fp32, _known(have_triton),
           _known(have_cpp))
    plan = _CHOICES.get(key)
    if plan is None:
        plan = _choose(policy, Call(device, dtype, capturing, compiling, weight_numel, rank, exact_fp32,
                                    have_triton, have_cpp))
        if len(_CHOICES) >= _MAX_CHOICES:
            _CHOICES.clear()
        _CHOICES[key[:-2] + (_known(have_triton), _known(have_cpp))] = plan  # the probes it asked are known now
    return plan


_CHOICES: dict[tuple, Plan] = {}
_MAX_CHOICES = 4096


def _known(probe) -> bool | None:
    """A probe's answer if it is known without asking (a bool, or a probe that has run), else None."""
    if probe is True or probe is False:
        return probe
    return getattr(probe, "answer", None)


def _choose(policy: PlanPolicy, call: Call) -> Plan:
    plan = policy.forced
    while plan is not None:
        module = MODULES[plan]
        if module.runs(call):
            return plan
        plan = module.FALLBACK
    forced = policy.forced is not None
    big = policy.cpp_graph_min_weight
    for rule in RULES:
        if rule.when(call, big, forced) and MODULES[rule.plan].runs(call):
            return rule.plan
    raise AssertionError("the last rule always matches")  # pragma: no cover


def parse_plan(text: str) -> Plan:
    """A plan from its name (KernelPlanError naming the allowed ones otherwise)."""
    try:
        return Plan(text.strip().lower())
    except ValueError:
        raise KernelPlanError(f"lora-kernel plan {text!r}: expected one of "
                              f"{', '.join(p.value for p in Plan)}") from None


def parse_adapter_grads(text: str) -> str:
    """One of ``ADAPTER_GRADS`` from its name (KernelPlanError naming the allowed ones otherwise)."""
    name = str(text).strip().lower()
    if name not in ADAPTER_GRADS:
        raise KernelPlanError(f"lora-kernel adapter gradients {text!r}: expected one of {', '.join(ADAPTER_GRADS)}")
    return name


def policy_for(kernel_plan: str, base: PlanPolicy | None = None, *, adapter_grads: str | None = None,
               adapter_h: str | None = None, gemm_tiles: str | None = None) -> PlanPolicy:
    """``base`` (default: the policy in force) with the plan a run's ``kernel_plan`` setting forces
    (``auto``: none) and, where given, where the adapter gradients run, where the fused GEMMs form H and
    how their tiles are chosen."""
    base = current_policy() if base is None else base
    if gemm_tiles is not None:
        base = dataclasses.replace(base, gemm_tiles=gemm_tiles)
    if adapter_h is not None:
        base = dataclasses.replace(base, adapter_h=adapter_h)
    if adapter_grads is not None:
        base = dataclasses.replace(base, adapter_grads=adapter_grads)
    if kernel_plan == AUTO:
        return base
    return dataclasses.replace(base, forced=parse_plan(kernel_plan))


def h_apart(columns: int, policy: PlanPolicy | None = None) -> bool:
    """Whether a fused GEMM launch of ``columns`` adapter columns (r, or S·r for S layers side by side)
    takes H formed before it, under ``policy`` (default: the one in force). Asked in a layer's forward,
    on the caller's thread, and kept for its backward (which may run on autograd's own thread)."""
    policy = current_policy() if policy is None else policy
    return policy.adapter_h != ADAPTER_H_GEMM and columns >= H_APART_MIN_R


def h_by_cublas(columns: int, policy: PlanPolicy | None = None) -> bool:
    """Whether a call of ``columns`` adapter columns runs on torch's GEMMs (cuBLAS) instead of the fused
    GEMM: the ``adapter_h`` setting's cublas, from ``H_APART_MIN_R`` columns (asked where ``h_apart`` is)."""
    policy = current_policy() if policy is None else policy
    return policy.adapter_h == ADAPTER_H_CUBLAS and columns >= H_APART_MIN_R


# ------------------------------------------------------------------------- the policy in force
_POLICY: contextvars.ContextVar[PlanPolicy | None] = contextvars.ContextVar("lora_bench_plan_policy",
                                                                            default=None)


@functools.cache
def default_policy() -> PlanPolicy:
    """The policy in force where ``use_policy`` set none: the rules choose, and the adapter
    gradients run inline (a run's ``adapter_grads`` setting says otherwise)."""
    return PlanPolicy()


def current_policy() -> PlanPolicy:
    """The policy in force here (``default_policy`` unless ``use_policy`` set another)."""
    policy = _POLICY.get()
    return default_policy() if policy is None else policy


@contextlib.contextmanager
def use_policy(policy: PlanPolicy) -> Iterator[PlanPolicy]:
    """Run the block with ``policy`` in force (in this thread / task)."""
    token, mode = _POLICY.set(policy), tile_record.MODE.set(policy.gemm_tiles)
    try:
        yield policy
    finally:
        tile_record.MODE.reset(mode)
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
        self.adapter_grads: set[str] = set()  # "inline", "deferred", or "inline: why it could not defer"
        self.dora: set[str] = set()  # where DoRA's norm ran (lora_bench.kernels.dora): "triton", or "torch: why"
        # gemm_tiles timed: each launch shape's key (lora_tiles.mm_config_for) -> None (timed) or why not
        self.tiles: dict[tuple, str | None] = {}

    def __iter__(self) -> Iterator[Plan]:
        return iter(sorted(self.plans, key=lambda p: p.value))

    def __len__(self) -> int:
        return len(self.plans)

    def backend(self) -> str:
        """'+'-joined names of the plans noted, e.g. 'cpp+fused', with where DoRA layers' norms ran
        (``dora-norm-triton``, ``dora-norm-torch``); '' if none."""
        norms = {DORA_NORM_PREFIX + where.split(":")[0] for where in self.dora}
        return "+".join(sorted({p.value for p in self.plans} | norms))

    def dora_norms(self) -> str:
        """Where DoRA layers' norms formed, each note once, '; '-joined ('' if none)."""
        return "; ".join(sorted(self.dora))

    def gemm_tiles(self) -> str:
        """Under gemm_tiles timed: each fused GEMM launch shape's tile and every candidate's µs per
        launch, or the picker's tile and why it was not timed; '; '-joined ('' if none)."""
        return "; ".join(sorted(tile_record.describe(k, why) for k, why in self.tiles.items()))


DORA_NORM_PREFIX = "dora-norm-"  # a DoRA norm's path as the backend names it
_LOG: contextvars.ContextVar[PlanLog | None] = contextvars.ContextVar("lora_bench_plan_log", default=None)


@contextlib.contextmanager
def record_plans(log: PlanLog | None = None) -> Iterator[PlanLog]:
    """Note into ``log`` (a new one by default) the plan of every layer call in the block."""
    log = PlanLog() if log is None else log
    token, notes = _LOG.set(log), tile_record.NOTES.set(log.tiles)
    try:
        yield log
    finally:
        tile_record.NOTES.reset(notes)
        _LOG.reset(token)


def in_force() -> tuple[PlanPolicy, PlanLog | None]:
    """The policy in force and the log being recorded into: what a layer's forward hands its backward,
    which on a GPU autograd runs on a thread of its own, where neither is set (``carried``)."""
    return current_policy(), _LOG.get()


@contextlib.contextmanager
def carried(state: tuple[PlanPolicy, PlanLog | None]) -> Iterator[None]:
    """Run the block under the policy and into the log ``in_force`` gave, on whichever thread."""
    policy, log = state
    with use_policy(policy):
        lg, notes = _LOG.set(log), tile_record.NOTES.set(log.tiles if log is not None else None)
        try:
            yield
        finally:
            tile_record.NOTES.reset(notes)
            _LOG.reset(lg)


def note(plan: Plan) -> None:
    """Record that a layer call ran ``plan`` (calls with gradients enabled, while recording)."""
    log = _LOG.get()
    if log is not None and torch.is_grad_enabled():
        log.plans.add(plan)


def note_adapter_grads(where: str) -> None:
    """Record where a layer call's adapter gradients run (calls with gradients enabled, while recording)."""
    log = _LOG.get()
    if log is not None and torch.is_grad_enabled():
        log.adapter_grads.add(where)


def note_dora(where: str) -> None:
    """Record where a DoRA layer call's norm runs (calls with gradients enabled, while recording)."""
    log = _LOG.get()
    if log is not None and torch.is_grad_enabled():
        log.dora.add(where)


__all__ = ["AUTO", "CPP_GRAPH_MIN_WEIGHT", "DTYPES_16", "KernelPlanError", "Plan", "PlanLog", "PlanPolicy",
           "TRITON_MAX_RANK", "carried", "choose", "current_policy", "default_policy", "graph_plan", "note", "note_adapter_grads",
           "h_apart", "h_by_cublas", "in_force", "note_dora", "parse_adapter_grads", "parse_plan", "policy_for", "record_plans", "use_policy"]
