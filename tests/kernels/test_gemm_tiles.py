"""How the fused GEMMs' tiles are chosen: by the launch shape (``gemm_tiles=picked``, the default), or by
timing a few candidate tiles on each launch shape's first eager launch (``gemm_tiles=timed``,
``lora_tiles.mm_config_for``). The rule and the record are checked here on the CPU with the timing
replaced; the GPU tests time real launches and check the results against float64, eager and replayed
from a CUDA graph."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import kernel_tol, layer_operands, lora_chains, rel_err

from lora_bench.config import TrainConfig
from lora_bench.errors import UsageError
from lora_bench.kernels import lora_tiles, tile_record
from lora_bench.kernels.lora_tiles import MMConfig, fastest, mm_config_for
from lora_bench.kernels.policy import Plan, PlanPolicy, current_policy, policy_for, record_plans, use_policy

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
C1, C2, C3 = MMConfig(64, 128, 64, 4, 4), MMConfig(64, 128, 64, 4, 3), MMConfig(128, 128, 64, 8, 4)


def test_the_setting_defaults_to_picked_names_its_choices_and_refuses_others():
    assert TrainConfig().gemm_tiles == "picked"
    assert TrainConfig(gemm_tiles="timed").gemm_tiles == "timed"
    with pytest.raises(UsageError, match="picked, timed"):
        PlanPolicy(gemm_tiles="guessed")
    with use_policy(policy_for("auto", PlanPolicy(), gemm_tiles="timed")):
        assert current_policy().gemm_tiles == "timed"


def test_fastest_is_the_least_median_and_a_tie_keeps_the_earlier_candidate():
    # medians 10, 9, 9: C2 and C3 tie, C2 comes first; C1's one fast round does not decide
    times = {C1: [1.0, 10.0, 12.0], C2: [9.0, 9.0, 30.0], C3: [8.0, 9.0, 9.5]}
    assert fastest(times) is C2
    assert fastest({C1: [5.0], C3: [4.0]}) is C3
    assert fastest({C1: [2.0, 4.0], C2: [2.0, 5.0]}) is C1  # even count: mean of the middle two, 3 < 3.5


class _Cuda:
    """What ``mm_config_for`` reads of a launch's input, as a CUDA tensor would answer."""

    dtype = torch.bfloat16
    device = torch.device("cuda")


@pytest.fixture
def timing(monkeypatch):
    """``mm_config_for`` on a stand-in CUDA input, its timing replaced: each call of the timer is
    recorded and returns the µs given for each candidate; ``can`` says whether a launch may be timed."""
    state = dict(calls=[], can=True, us={C1: [30.0, 31.0, 29.0], C2: [20.0, 21.0, 22.0], C3: [25.0, 25.0, 25.0]})
    monkeypatch.setattr(tile_record, "TIMED", {})
    monkeypatch.setattr(tile_record, "TIMED_US", {})
    monkeypatch.setattr(lora_tiles, "timed_candidates", lambda dtype: (C1, C2, C3))
    monkeypatch.setattr(lora_tiles, "can_time", lambda: state["can"])
    monkeypatch.setattr(lora_tiles, "_why_not_timed", lambda: "first launched under CUDA-graph capture")

    def time_configs(run, candidates):
        state["calls"].append(run)
        return {c: state["us"][c] for c in candidates}

    monkeypatch.setattr(lora_tiles, "time_configs", time_configs)
    monkeypatch.setattr(lora_tiles, "_mm_config", lambda M, N, K, x: C1)  # the picker's tile here
    return state


def test_picked_never_times(timing):
    with use_policy(PlanPolicy()), record_plans() as log:
        assert mm_config_for("mm", 960, 4800, 1600, 48, False, _Cuda(), "run") is C1
    assert timing["calls"] == [] and log.tiles == {} and log.gemm_tiles() == ""


def test_timed_times_each_shape_once_and_the_record_names_every_candidate(timing):
    with use_policy(PlanPolicy(gemm_tiles="timed")), record_plans() as log:
        for _ in range(3):
            assert mm_config_for("mm", 960, 4800, 1600, 48, False, _Cuda(), "fwd") is C2
        # the same shape with H formed before the launch, and another rank padding, are other keys
        assert mm_config_for("mm", 960, 4800, 1600, 48, True, _Cuda(), "fwd-h-in") is C2
        assert mm_config_for("mm", 960, 4800, 1600, 16, False, _Cuda(), "fwd-r16") is C2
    assert timing["calls"] == ["fwd", "fwd-h-in", "fwd-r16"]
    text = log.gemm_tiles().split("; ")
    assert len(text) == 3
    assert "mm 960x1600->4800 bfloat16 R64: 64x128x64w4s3 (64x128x64w4s4 30.0, 64x128x64w4s3 21.0, " \
           "128x128x64w8s4 25.0 µs)" in text
    assert any("R64 H-in: 64x128x64w4s3" in t for t in text) and any(" R16: " in t for t in text)


def test_a_launch_that_cannot_be_timed_takes_the_picked_tile_and_says_why(timing):
    timing["can"] = False
    with use_policy(PlanPolicy(gemm_tiles="timed")), record_plans() as log:
        assert mm_config_for("mm", 960, 1600, 4800, 48, False, _Cuda(), "captured") is C1
    assert timing["calls"] == []
    assert log.gemm_tiles() == "mm 960x4800->1600 bfloat16 R64: picked (first launched under CUDA-graph capture)"
    # timed later, eagerly: the record then holds the timed choice, not the reason
    timing["can"] = True
    with use_policy(PlanPolicy(gemm_tiles="timed")), record_plans(log):
        assert mm_config_for("mm", 960, 1600, 4800, 48, False, _Cuda(), "eager") is C2
    assert log.gemm_tiles().startswith("mm 960x4800->1600 bfloat16 R64: 64x128x64w4s3 (")


def test_on_the_cpu_timed_changes_nothing(timing):
    x = torch.zeros(4, 4)
    with use_policy(PlanPolicy(gemm_tiles="timed")):
        assert mm_config_for("mm", 4, 4, 4, 4, False, x, "cpu") is C1
    assert timing["calls"] == []


# ------------------------------------------------------------------------- on the GPU
GPU_CASES = [  # odd sizes; ranks 1..64; bf16 and fp32
    dict(rows=97, k=70, n=131, r=1, dtype=torch.bfloat16),
    dict(rows=300, k=200, n=333, r=48, dtype=torch.bfloat16),
    dict(rows=129, k=96, n=65, r=64, dtype=torch.float32),
    dict(rows=256, k=512, n=384, r=16, dtype=torch.float16),
]


def _layer_and_grads(policy, operands):
    from lora_bench.kernels.autograd import lora_linear

    x, w, b, a, bm = (t.detach().clone().requires_grad_(i in (0, 3, 4)) for i, t in enumerate(operands[:5]))
    g = operands[-1]
    with use_policy(policy), record_plans() as log:
        y = lora_linear(x, w, b, a, bm, 2.0)
        y.backward(g)
    torch.cuda.synchronize()
    return [y.detach(), x.grad, a.grad, bm.grad], log


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"r{c['r']}-{str(c['dtype'])[6:]}")
def test_gpu_timed_tiles_give_the_fused_layer_against_float64(case, monkeypatch):
    monkeypatch.setattr(tile_record, "TIMED", {})
    monkeypatch.setattr(tile_record, "TIMED_US", {})
    k, n, r, dtype = case["k"], case["n"], case["r"], case["dtype"]
    x, w, b, a, bm = layer_operands(batch=(case["rows"],), k=k, n=n, r=r, device="cuda", dtype=dtype)
    g = torch.randn(case["rows"], n, device="cuda").to(dtype)
    ops = (x, w, b, a, bm, g)
    got, log = _layer_and_grads(PlanPolicy(forced=Plan.FUSED, gemm_tiles="timed"), ops)
    ref, _ = _layer_and_grads(PlanPolicy(forced=Plan.TORCH), tuple(t.double() for t in ops))
    prec = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        prec = "tf32"
    chains = lora_chains(rows=case["rows"], k=k, n=n, r=r)
    for name, out, want, chain in zip(("y", "grad_x", "grad_A", "grad_B"), got, ref,
                                      (chains["y"], chains["grad_x"], chains["grad_A"], chains["grad_B"])):
        assert rel_err(out, want) <= kernel_tol(prec, chain), name
    # both GEMM launches (forward, input gradient) were timed, every candidate with a finite time
    assert len(tile_record.TIMED) == 2 and set(log.tiles) == set(tile_record.TIMED)
    assert all(why is None for why in log.tiles.values())
    for us in tile_record.TIMED_US.values():
        assert len(us) == len(lora_tiles.timed_candidates(dtype))
        assert all(math.isfinite(t) and t > 0 for t in us.values())


@pytest.mark.gpu
@gpu
def test_gpu_a_shape_first_seen_under_capture_takes_the_picked_tile_and_replays_as_eager(monkeypatch):
    from lora_bench.kernels.autograd import lora_linear

    monkeypatch.setattr(tile_record, "TIMED", {})
    monkeypatch.setattr(tile_record, "TIMED_US", {})
    x, w, b, a, bm = layer_operands(batch=(333,), k=160, n=200, r=16, device="cuda", dtype=torch.bfloat16)
    # the picked tiles compiled eagerly first, as a graph's warm-up would (under the default policy)
    with use_policy(PlanPolicy(forced=Plan.FUSED)):
        lora_linear(x, w, b, a, bm, 2.0)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with use_policy(PlanPolicy(forced=Plan.FUSED, gemm_tiles="timed")), record_plans() as log:
        with torch.cuda.graph(graph):
            y = lora_linear(static, w, b, a, bm, 2.0)
    assert tile_record.TIMED == {}
    assert list(log.tiles.values()) == ["first launched under CUDA-graph capture"]
    x2 = torch.randn_like(x)
    static.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    with use_policy(PlanPolicy(forced=Plan.FUSED)):
        want = lora_linear(x2, w, b, a, bm, 2.0)
    assert torch.equal(y, want)  # the same tile, the same rounding


def test_the_backward_runs_under_the_forwards_policy_and_log_on_any_thread(monkeypatch):
    """On a GPU autograd runs the backward on its own thread, where the caller's policy and plan log
    (context variables) are not set: the layer's backward takes the forward's with it, so its launches
    are chosen under the same settings (gemm_tiles timed among them) and noted in the same record."""
    import threading

    from lora_bench.kernels import policy as pol
    from lora_bench.kernels.autograd import LoRAKernelFunction, lora_linear

    seen = []
    original = LoRAKernelFunction._backward

    def spy(ctx, grad_out):
        seen.append((current_policy(), pol._LOG.get()))
        return original(ctx, grad_out)

    monkeypatch.setattr(LoRAKernelFunction, "_backward", staticmethod(spy))
    policy = PlanPolicy(forced=Plan.TORCH, gemm_tiles="timed", adapter_h="apart")
    x, w, b, a, bm = layer_operands(batch=(5,), k=7, n=6, r=3, device="cpu", dtype=torch.float64)
    a.requires_grad_(True)
    with use_policy(policy), record_plans() as log:
        y = lora_linear(x, w, b, a, bm, 2.0)
    worker = threading.Thread(target=lambda: y.sum().backward())  # neither set on this thread
    worker.start()
    worker.join()
    assert len(seen) == 1 and seen[0][0] == policy and seen[0][1] is log and a.grad is not None
    assert current_policy() != policy and pol._LOG.get() is None  # and none left behind here
