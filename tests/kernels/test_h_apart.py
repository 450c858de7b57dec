"""Where the fused GEMMs form H = X·P (x·A forward, g·Bᵀ backward): in their K loop (``adapter_h=gemm``,
the default), or before the launch for launches of 17 adapter columns or more (``adapter_h=apart``,
``policy.h_apart``). The kernels themselves are checked on both paths against float64 by the
interpreter tests (benchmarks/kernel_selfcheck.py, tests/kernels/test_qkv_group.py) and on the GPU."""

from __future__ import annotations

import pytest
import torch

from lora_bench.config import TrainConfig
from lora_bench.errors import UsageError
from lora_bench.kernels.call import H_APART_MIN_R
from lora_bench.kernels.policy import PlanPolicy, current_policy, h_apart, policy_for, use_policy


@pytest.mark.parametrize("columns,apart", [(1, False), (16, False), (17, True), (48, True), (128, True)])
def test_apart_from_17_columns_only_where_the_setting_asks(columns, apart):
    assert H_APART_MIN_R == 17
    assert h_apart(columns, PlanPolicy(adapter_h="apart")) is apart
    assert h_apart(columns, PlanPolicy()) is False  # the default: H in the GEMM
    with use_policy(policy_for("auto", PlanPolicy(), adapter_h="apart")):
        assert current_policy().adapter_h == "apart" and h_apart(columns) is apart


@pytest.mark.parametrize("columns,wide", [(16, False), (17, True), (48, True)])
def test_cublas_forms_h_apart_and_runs_the_wide_calls_on_torch_gemms(columns, wide):
    from lora_bench.kernels.policy import h_by_cublas

    cublas, apart = PlanPolicy(adapter_h="cublas"), PlanPolicy(adapter_h="apart")
    assert h_apart(columns, cublas) is wide and h_by_cublas(columns, cublas) is wide
    assert h_by_cublas(columns, apart) is False and h_by_cublas(columns, PlanPolicy()) is False


def test_the_setting_names_its_choices_and_refuses_others():
    assert TrainConfig().adapter_h == "gemm"
    assert TrainConfig(adapter_h="apart").adapter_h == "apart"
    assert TrainConfig(adapter_h="cublas").adapter_h == "cublas"
    with pytest.raises(UsageError, match="gemm"):
        PlanPolicy(adapter_h="sideways")


lt = pytest.importorskip("lora_bench.kernels.lora_triton")  # the wrappers below need Triton (not its GPU)


@pytest.fixture
def launches(monkeypatch):
    """The ``h_in`` of every GEMM launch the wrappers make (the launch itself is not run)."""
    seen = []
    monkeypatch.setattr(lt, "_mm", lambda *a, **kw: seen.append(kw.get("h_in", False)))
    return seen


@pytest.mark.parametrize("apart", [False, True])
def test_single_layer_wrappers_form_h_and_u_before_the_launch_when_asked(launches, apart):
    g = torch.Generator().manual_seed(3)
    x, gy = torch.randn(5, 8, generator=g), torch.randn(5, 6, generator=g)
    w, a, b = torch.randn(6, 8, generator=g), torch.randn(8, 20, generator=g), torch.randn(20, 6, generator=g)
    _, h = lt.lora_fwd(x, w, a, b, None, 1.0, apart=apart)
    _, u = lt.lora_bwd_x(gy, w, a, b, 1.0, apart=apart)
    assert launches == [apart, apart]
    if apart:  # what the launch reads: H = x·A and u = g·Bᵀ, as torch's GEMM forms them
        assert torch.equal(h, x @ a) and torch.equal(u, gy @ b.t())


@pytest.mark.parametrize("r,S", [(16, 3), (6, 2)])
def test_segment_wrappers_lay_every_layers_columns_side_by_side(launches, r, S):
    g = torch.Generator().manual_seed(r * S)
    k, n, M = 8, 4, 5
    x, gy = torch.randn(M, k, generator=g), torch.randn(M, S * n, generator=g)
    w, a, b = torch.randn(S * n, k, generator=g), torch.randn(S, k, r, generator=g), torch.randn(S, r, n, generator=g)
    _, h = lt.lora_fwd_segments(x, w, a, b, None, 1.0, apart=True)
    _, u = lt.lora_bwd_x_segments(gy, w, a, b, 1.0, apart=True)
    assert launches == [True, True]
    ref_h = torch.cat([x @ a[i] for i in range(S)], 1)
    ref_u = torch.cat([gy[:, i * n:(i + 1) * n] @ b[i].t() for i in range(S)], 1)
    assert torch.allclose(h, ref_h, rtol=1e-6, atol=1e-6) and torch.allclose(u, ref_u, rtol=1e-6, atol=1e-6)


def test_fp32_master_adapters_are_rounded_to_the_input_dtype_before_the_product(launches):
    """Under autocast A may be the fp32 master copy: H is formed from A rounded to x's dtype, as the
    kernel's K loop rounds it."""
    x, w = torch.randn(5, 8).bfloat16(), torch.randn(6, 8).bfloat16()
    a, b = torch.randn(8, 32), torch.randn(32, 6)
    _, h = lt.lora_fwd(x, w, a, b, None, 1.0, apart=True)
    assert h.dtype is torch.bfloat16 and torch.equal(h, x @ a.bfloat16())
