"""Where the forward GEMMs form H = X·P: in the kernel's K loop up to 16 adapter columns, before
the launch (torch's GEMM) from 17 (``lora_triton.h_apart``). The kernels themselves are checked on
both paths against float64 by the interpreter tests (benchmarks/kernel_selfcheck.py,
tests/kernels/test_qkv_group.py) and on the GPU (captured in CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

lt = pytest.importorskip("lora_bench.kernels.lora_triton")  # needs Triton (not its GPU)


@pytest.fixture
def launches(monkeypatch):
    """The ``h_in`` of every GEMM launch the wrappers make (the launch itself is not run)."""
    seen = []
    monkeypatch.setattr(lt, "_mm", lambda *a, **kw: seen.append(kw.get("h_in", False)))
    return seen


@pytest.mark.parametrize("R,apart", [(1, False), (16, False), (17, True), (48, True), (64, True)])
def test_single_layer_forms_h_apart_from_17_columns(launches, R, apart):
    g = torch.Generator().manual_seed(R)
    x, gy = torch.randn(5, 8, generator=g), torch.randn(5, 6, generator=g)
    w, a, b = torch.randn(6, 8, generator=g), torch.randn(8, R, generator=g), torch.randn(R, 6, generator=g)
    _, h = lt.lora_fwd(x, w, a, b, None, 1.0)
    _, u = lt.lora_bwd_x(gy, w, a, b, 1.0)
    assert launches == [apart, apart]
    if apart:  # what the launch reads: H = x·A and u = g·Bᵀ, as torch's GEMM forms them
        assert torch.equal(h, x @ a) and torch.equal(u, gy @ b.t())


@pytest.mark.parametrize("r,S,apart", [(5, 3, False), (16, 1, False), (6, 3, True), (16, 3, True)])
def test_segments_count_every_layers_columns(launches, r, S, apart):
    """A block's query, key and value side by side at rank 16 are 48 columns: H formed apart."""
    g = torch.Generator().manual_seed(r * S)
    k, n, M = 8, 4, 5
    x, gy = torch.randn(M, k, generator=g), torch.randn(M, S * n, generator=g)
    w, a, b = torch.randn(S * n, k, generator=g), torch.randn(S, k, r, generator=g), torch.randn(S, r, n, generator=g)
    _, h = lt.lora_fwd_segments(x, w, a, b, None, 1.0)
    _, u = lt.lora_bwd_x_segments(gy, w, a, b, 1.0)
    assert launches == [apart, apart]
    if apart:
        ref_h = torch.cat([x @ a[i] for i in range(S)], 1)
        ref_u = torch.cat([gy[:, i * n:(i + 1) * n] @ b[i].t() for i in range(S)], 1)
        assert torch.allclose(h, ref_h, rtol=1e-6, atol=1e-6) and torch.allclose(u, ref_u, rtol=1e-6, atol=1e-6)


def test_a_forced_choice_wins_over_the_rule(launches):
    x, w, a, b = torch.randn(5, 8), torch.randn(6, 8), torch.randn(8, 48), torch.randn(48, 6)
    lt.lora_fwd(x, w, a, b, None, 1.0, apart=False)
    lt.lora_fwd(x, w, a[:, :4], b[:4], None, 1.0, apart=True)
    assert launches == [False, True]


def test_fp32_master_adapters_are_rounded_to_the_input_dtype_before_the_product(launches):
    """Under autocast A may be the fp32 master copy: H is formed from A rounded to x's dtype, as the
    kernel's K loop rounds it."""
    x, w = torch.randn(5, 8).bfloat16(), torch.randn(6, 8).bfloat16()
    a, b = torch.randn(8, 32), torch.randn(32, 6)
    _, h = lt.lora_fwd(x, w, a, b, None, 1.0)
    assert h.dtype is torch.bfloat16 and torch.equal(h, x @ a.bfloat16())
