"""lora-kernel's plan policy: ``choose`` (a pure function: every branch, no GPU), plan names, the
``kernel_plan`` setting's policy, the policy context, and the log of plans that calls ran. The
rules' agreement with the committed measurements is tests/kernels/test_rules.py."""

from __future__ import annotations

import dataclasses
import pytest
import torch

from lora_bench.errors import UsageError
from lora_bench.config.declaration import KERNEL_PLANS
from lora_bench.kernels.plan_names import AUTO, PLAN_NAMES
from lora_bench.kernels.policy import (
    CPP_GRAPH_MIN_WEIGHT,
    TRITON_MAX_RANK,
    KernelPlanError,
    Plan,
    PlanLog,
    PlanPolicy,
    choose,
    current_policy,
    graph_plan,
    note,
    parse_plan,
    policy_for,
    record_plans,
    use_policy,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
SMALL, LARGE = 768 * 768, 1600 * 6400  # GPT-2 124M attention / 1558M MLP weights


def pick(policy=None, **facts) -> Plan:
    """``choose`` on an eager CUDA bf16 call of a small r16 layer with everything available, unless
    ``facts`` say otherwise."""
    args = dict(device="cuda", dtype=BF16, capturing=False, compiling=False, weight_numel=SMALL, rank=16,
                exact_fp32=False, have_triton=True, have_cpp=True)
    args.update(facts)
    return choose(policy or PlanPolicy(), **args)


class Unasked:
    """A probe that must not be consulted: its truth value fails the test."""

    def __bool__(self):
        raise AssertionError("probe consulted where the answer does not depend on it")


# ------------------------------------------------------------------------- default, eager


def test_eager_cuda_runs_the_cpp_op_direct_for_16_bit_cpp_otherwise():
    assert pick() is pick(dtype=FP16) is Plan.DIRECT
    assert pick(dtype=FP32, exact_fp32=True) is pick(dtype=FP32) is Plan.CPP
    assert pick(have_triton=False) is Plan.CPP  # no Triton kernels to launch: the op's ATen GEMMs
    assert pick(rank=TRITON_MAX_RANK) is Plan.DIRECT
    assert pick(rank=TRITON_MAX_RANK + 1) is Plan.CPP
    assert pick(dtype=FP32, have_triton=Unasked()) is Plan.CPP  # fp32 never asks for Triton


def test_eager_cuda_without_the_cpp_op_runs_the_python_function():
    assert pick(have_cpp=False) is Plan.FUSED
    assert pick(have_cpp=False, dtype=FP32, exact_fp32=True) is Plan.CUBLAS
    assert pick(have_cpp=False, dtype=FP32, exact_fp32=False) is Plan.FUSED  # tf32 allowed
    assert pick(have_cpp=False, have_triton=False) is Plan.TORCH
    assert pick(have_cpp=False, rank=TRITON_MAX_RANK + 1) is Plan.TORCH
    assert pick(have_cpp=False, weight_numel=LARGE) is Plan.FUSED  # the size rule is for capture/compile


# ------------------------------------------------------------------------- default, captured


@pytest.mark.parametrize("how", ["stream", "policy"])
def test_captured_layers_run_triton_below_the_threshold_and_the_cpp_op_above(how):
    def cap(**facts):
        if how == "stream":
            return pick(capturing=True, **facts)
        return pick(PlanPolicy(capture=True), **facts)

    assert cap() is Plan.FUSED
    assert cap(dtype=FP32, exact_fp32=True) is Plan.CUBLAS
    assert cap(weight_numel=LARGE) is cap(weight_numel=LARGE, dtype=FP32, exact_fp32=True) is Plan.CPP
    assert cap(weight_numel=CPP_GRAPH_MIN_WEIGHT - 1) is Plan.FUSED
    assert cap(weight_numel=LARGE, have_cpp=False) is Plan.FUSED
    assert cap(have_cpp=Unasked()) is Plan.FUSED  # small captured layers never build the op
    assert cap(have_triton=False) is Plan.TORCH


def test_the_threshold_is_part_of_the_policy():
    low = PlanPolicy(capture=True, cpp_graph_min_weight=SMALL)
    assert pick(low) is Plan.CPP and pick(low, weight_numel=SMALL - 1) is Plan.FUSED
    assert pick(PlanPolicy(cpp_graph_min_weight=SMALL), compiling=True) is Plan.CUBLAS


# ------------------------------------------------------------------------- default, compiled


def test_compiled_layers_run_the_python_plans_with_the_size_rule():
    assert pick(compiling=True, have_cpp=Unasked()) is Plan.FUSED  # the C++ op is never traced
    assert pick(compiling=True, weight_numel=LARGE) is Plan.CUBLAS  # cuBLAS beats the Triton GEMM there
    assert pick(compiling=True, dtype=FP32, exact_fp32=True) is Plan.CUBLAS
    assert pick(compiling=True, capturing=True, weight_numel=LARGE) is Plan.CUBLAS
    assert pick(compiling=True, have_triton=False) is Plan.TORCH
    assert pick(compiling=True, device="cpu", weight_numel=LARGE) is Plan.TORCH


# ------------------------------------------------------------------------- default, CPU


def test_cpu_runs_torch_and_probes_nothing():
    assert pick(device="cpu", have_triton=Unasked(), have_cpp=Unasked()) is Plan.TORCH
    assert pick(device="cpu", dtype=FP32, exact_fp32=True, have_triton=Unasked(), have_cpp=Unasked()) is Plan.TORCH
    assert pick(device="cpu", compiling=True, have_triton=Unasked(), have_cpp=Unasked()) is Plan.TORCH


# ------------------------------------------------------------------------- forced plans


def forced(plan: Plan) -> PlanPolicy:
    return PlanPolicy(forced=plan)


def test_forced_cpp_runs_the_cpp_op_everywhere_it_exists():
    for facts in ({}, dict(device="cpu"), dict(capturing=True), dict(dtype=FP32), dict(weight_numel=LARGE)):
        assert pick(forced(Plan.CPP), have_triton=Unasked(), **facts) is Plan.CPP, facts


def test_forced_direct_launches_where_it_can_else_the_cpp_op():
    assert pick(forced(Plan.DIRECT)) is Plan.DIRECT
    assert pick(forced(Plan.DIRECT), capturing=True, weight_numel=LARGE) is Plan.DIRECT  # forced: no size rule
    assert pick(forced(Plan.DIRECT), device="cpu") is Plan.CPP
    assert pick(forced(Plan.DIRECT), dtype=FP32) is Plan.CPP
    assert pick(forced(Plan.DIRECT), have_triton=False) is Plan.CPP
    assert pick(forced(Plan.DIRECT), rank=TRITON_MAX_RANK + 1) is Plan.CPP


def test_a_forced_cpp_op_plan_that_cannot_run_leaves_the_choice_to_the_rules():
    for plan in (Plan.CPP, Plan.DIRECT):
        assert pick(forced(plan), have_cpp=False) is Plan.FUSED
        assert pick(forced(plan), have_cpp=False, dtype=FP32, exact_fp32=True) is Plan.CUBLAS
        assert pick(forced(plan), have_cpp=False, device="cpu") is Plan.TORCH
        assert pick(forced(plan), have_cpp=False, capturing=True, weight_numel=LARGE) is Plan.FUSED
        # compiled: the Python plans, with the size rule off (a plan was forced)
        assert pick(forced(plan), compiling=True, weight_numel=LARGE) is Plan.FUSED


@pytest.mark.parametrize("plan", [Plan.FUSED, Plan.CUBLAS, Plan.TORCH])
def test_forced_python_plans(plan):
    assert pick(forced(plan), have_cpp=Unasked()) is plan
    assert pick(forced(plan), dtype=FP32, exact_fp32=True) is plan
    assert pick(forced(plan), capturing=True, weight_numel=LARGE) is plan
    assert pick(forced(plan), compiling=True, weight_numel=LARGE) is plan  # the size rule is off
    assert pick(forced(plan), have_triton=False) is Plan.TORCH
    assert pick(forced(plan), rank=TRITON_MAX_RANK + 1) is Plan.TORCH
    # on the CPU only under Triton's interpreter (have_triton there), else torch ops
    assert pick(forced(plan), device="cpu", have_triton=True) is plan
    assert pick(forced(plan), device="cpu", have_triton=False) is Plan.TORCH


# ------------------------------------------------------------------------- names, setting, context


def test_plan_names_are_one_list_everywhere():
    """The setting's choices, the plans and the modules that implement them use one list of names."""
    from lora_bench.kernels.plans import MODULES

    assert tuple(p.value for p in Plan) == PLAN_NAMES == ("direct", "cpp", "fused", "cublas", "torch")
    assert KERNEL_PLANS == (AUTO, *PLAN_NAMES) and set(MODULES) == set(Plan)
    assert [p for p in Plan if p.cpp_op] == [Plan.DIRECT, Plan.CPP]
    assert parse_plan("cpp") is parse_plan(" CPP ") is Plan.CPP
    for bad in ("", "foo", "fused:torch", "cpp:cpp", "cpp:fused", "streams", "triton"):  # no mixes, no other names
        with pytest.raises(KernelPlanError, match="expected one of direct, cpp, fused, cublas, torch"):
            parse_plan(bad)


def test_a_policy_takes_a_plan_or_its_name():
    assert PlanPolicy(forced="cpp") == PlanPolicy(forced=Plan.CPP) and PlanPolicy(forced="cpp").forced is Plan.CPP
    assert pick(PlanPolicy(forced="fused")) is Plan.FUSED
    with pytest.raises(KernelPlanError, match="'cpp:fused'"):
        PlanPolicy(forced="cpp:fused")


def test_the_kernel_plan_setting_forces_its_plan_on_the_policy_in_force():
    base = PlanPolicy(cpp_graph_min_weight=5)
    assert policy_for(AUTO, base) is base
    assert policy_for("direct", base) == PlanPolicy(forced=Plan.DIRECT, cpp_graph_min_weight=5)
    with pytest.raises(KernelPlanError, match="lora-kernel plan 'fused:cpp'") as err:
        policy_for("fused:cpp", base)
    assert isinstance(err.value, UsageError) and err.value.exit_code == 2 and isinstance(err.value, ValueError)
    with use_policy(base):
        assert policy_for("torch") == dataclasses.replace(base, forced=Plan.TORCH)
        assert policy_for(AUTO) is base


def test_use_policy_and_graph_plan_nest_and_restore():
    default = current_policy()
    assert default == PlanPolicy()
    with use_policy(PlanPolicy(forced=Plan.FUSED, cpp_graph_min_weight=7)) as p:
        assert current_policy() is p
        with graph_plan() as g:
            assert g == PlanPolicy(forced=Plan.FUSED, cpp_graph_min_weight=7, capture=True)
            assert current_policy() is g
        assert current_policy() is p
        with pytest.raises(RuntimeError):
            with use_policy(PlanPolicy(forced=Plan.CPP)):
                raise RuntimeError
        assert current_policy() is p
    assert current_policy() is default


def test_record_plans_notes_calls_with_gradients_only():
    note(Plan.CPP)  # nothing records outside record_plans: no error, nothing kept
    with record_plans() as log:
        note(Plan.CPP)
        note(Plan.FUSED)
        note(Plan.CPP)
        with torch.no_grad():  # evaluation: not the training step's plan
            note(Plan.TORCH)
        inner = PlanLog()
        with record_plans(inner):
            note(Plan.CUBLAS)
    assert list(log) == [Plan.CPP, Plan.FUSED] and len(log) == 2
    assert log.backend() == "cpp+fused" and inner.backend() == "cublas"
    assert PlanLog().backend() == ""
