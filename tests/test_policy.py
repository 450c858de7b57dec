"""lora-kernel's plan policy: ``choose`` (a pure function: every branch, no GPU), plan names, the
LORA_BENCH_KERNEL_MODE variable, the policy context, and the log of plans that calls ran."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from lora_bench.errors import UsageError
from lora_bench.kernels.policy import (
    CPP_GRAPH_MIN_WEIGHT,
    ENV_VAR,
    TRITON_MAX_RANK,
    KernelModeError,
    Plan,
    PlanLog,
    PlanPolicy,
    choose,
    current_policy,
    graph_plan,
    note,
    parse_plan,
    policy_from_env,
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


def test_forced_streams_runs_wherever_there_is_cuda():
    """The streams plan needs CUDA streams only (without Triton its adapter gradients are torch
    GEMMs); the CPU runs torch ops."""
    streams = forced(Plan.STREAMS)
    assert pick(streams, have_cpp=Unasked(), have_triton=Unasked()) is Plan.STREAMS
    assert pick(streams, capturing=True, weight_numel=LARGE) is Plan.STREAMS
    assert pick(streams, compiling=True, weight_numel=LARGE, dtype=FP32, exact_fp32=True) is Plan.STREAMS
    assert pick(streams, rank=TRITON_MAX_RANK + 1) is Plan.STREAMS
    assert pick(streams, device="cpu", have_triton=True) is Plan.TORCH
    assert pick(streams, device="cpu", have_triton=False) is Plan.TORCH


# ------------------------------------------------------------------------- names, variable, context


def test_plan_names_and_backends():
    assert [p.value for p in Plan] == ["fused", "cublas", "torch", "streams", "cpp", "direct"]
    assert {p.backend for p in Plan} == {"triton", "cublas", "torch", "cublas-streams", "cpp", "cpp-direct"}
    assert [p for p in Plan if p.cpp_op] == [Plan.CPP, Plan.DIRECT]
    assert parse_plan("cpp") is parse_plan(" CPP ") is Plan.CPP
    for bad in ("", "foo", "fused:torch", "cpp:cpp", "cpp:fused"):  # no forward/backward mixes
        with pytest.raises(KernelModeError, match="expected one of fused, cublas, torch, streams, cpp, direct"):
            parse_plan(bad)


def test_a_policy_takes_a_plan_or_its_name():
    assert PlanPolicy(forced="cpp") == PlanPolicy(forced=Plan.CPP) and PlanPolicy(forced="cpp").forced is Plan.CPP
    assert pick(PlanPolicy(forced="fused")) is Plan.FUSED
    with pytest.raises(KernelModeError, match="'cpp:fused'"):
        PlanPolicy(forced="cpp:fused")


def test_policy_from_env():
    base = PlanPolicy(cpp_graph_min_weight=5)
    assert policy_from_env(base, {}) is base
    assert policy_from_env(base, {ENV_VAR: "  "}) is base
    assert policy_from_env(base, {ENV_VAR: "direct"}) == PlanPolicy(forced=Plan.DIRECT, cpp_graph_min_weight=5)
    with pytest.raises(KernelModeError, match=f"{ENV_VAR}: lora-kernel plan 'fused:cpp'") as err:
        policy_from_env(base, {ENV_VAR: "fused:cpp"})
    assert isinstance(err.value, UsageError) and err.value.exit_code == 2 and isinstance(err.value, ValueError)
    with use_policy(base):
        assert policy_from_env(environ={ENV_VAR: "torch"}) == dataclasses.replace(base, forced=Plan.TORCH)


def test_a_bad_variable_does_not_break_importing_the_package():
    code = "import lora_bench.kernels.autograd, lora_bench.lora, lora_bench.train.run; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **{ENV_VAR: "nonsense"}))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


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
    assert log.backend() == "cpp+triton" and inner.backend() == "cublas"
    assert PlanLog().backend() == ""
