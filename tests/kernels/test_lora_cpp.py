"""lora-kernel's C++ autograd op (plan "cpp"): forward and every gradient against float64 on fresh
random inputs, autocast, the frozen base, routing through LinearWithLoRAKernel, errors.

CPU tests force the op through the plan policy (``use_policy(PlanPolicy(forced=Plan.CPP))``) or
call it directly; the whole module is skipped when it cannot be built here (no C++ compiler or
ninja). GPU tests (``-m gpu``) check CUDA numbers and that eager CUDA layers run it by default,
but not under CUDA graph capture.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from numerics import (
    assert_same_function,
    float64_layer,
    float64_operands,
    fresh,
    kernel_tol,
    layer_operands,
    lora_chains,
    model_pair,
    rel_err,
    run_model,
)

from lora_bench.kernels import available, lora_cpp
from lora_bench.kernels.plans import direct as direct_mod
from lora_bench.kernels.autograd import call_plan, lora_linear
from lora_bench.kernels.policy import Plan, PlanPolicy, graph_plan, parse_plan, record_plans, use_policy
from lora_bench.lora import LinearWithLoRA
from lora_bench.lora.kernel import LinearWithLoRAKernel

PY_GRAD_FN = "LoRAKernelFunctionBackward"
PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@pytest.fixture(scope="module", autouse=True)
def cpp_op():
    """Build (or load from the extension cache) once for the module; skip it if that fails."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mod = lora_cpp.module()
    if mod is None:
        pytest.skip(f"the C++ op cannot be built here: {lora_cpp.build_error()}", allow_module_level=True)
    return mod


@pytest.fixture
def force_cpp():
    with use_policy(PlanPolicy(forced=Plan.CPP)):
        yield


@pytest.fixture
def default_mode():
    with use_policy(PlanPolicy()):
        yield


def check_cpp(*, device="cpu", dtype=torch.float32, batch=(37,), k=70, n=53, r=16, alpha=2.0, bias=True,
              noncontig=False, head=False, x_grad=True, autocast=None, direct=False) -> None:
    """One forward+backward of the C++ op against float64. ``autocast``: a dtype to run the op
    under autocast with (inputs and parameters in ``dtype``, normally fp32). ``direct``: through
    the layer's dispatch with the "direct" plan forced (the C++ op launching the Triton kernels;
    CUDA), on an allocator pool poisoned with NaN, and assert that the plan was registered."""
    x, w, b, a, bm = layer_operands(batch=batch, k=k, n=n, r=r, device=device, dtype=dtype, bias=bias,
                                    noncontig=noncontig)
    w_before = w.clone()
    leaves = ([x] if x_grad else []) + [a, bm] + ([w] + ([b] if bias else []) if head else [])
    for t in leaves:
        t.requires_grad_(True)
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        if direct:
            poison_cuda_pool()
            with use_policy(PlanPolicy(forced=Plan.DIRECT)), record_plans() as log:
                y = lora_linear(x, w, b, a, bm, alpha)
            key = direct_mod.plan_key(x, w, b, a, bm)
            pid = direct_mod.registered(key) if key is not None else None
            assert pid is not None and pid >= 0, "the direct plan did not register"
            assert list(log) == [Plan.DIRECT], "the call did not run it"
        else:
            y = lora_cpp.lora_linear_cpp(x, w, b, a, bm, alpha)
    out_dtype = autocast or dtype
    assert y.grad_fn.name() == lora_cpp.GRAD_FN_NAME
    assert y.dtype == out_dtype and y.shape == (*batch, n) and not y._is_view()
    g = fresh(*batch, n, device=device, dtype=out_dtype)
    if direct:
        poison_cuda_pool()  # the backward's outputs come from the pool too
    grads = torch.autograd.grad(y, leaves, g)

    ref = {id(t): t.detach().double().cpu().requires_grad_(t.requires_grad) for t in (x, w, a, bm)}
    xr, wr, ar, bmr = (ref[id(t)] for t in (x, w, a, bm))
    br = (b.detach().double().cpu().requires_grad_(head)) if bias else None
    yr = xr @ wr.t() + alpha * (xr @ ar) @ bmr + (br if bias else 0)
    ref_leaves = [ref[id(t)] if t is not b else br for t in leaves]
    ref_grads = torch.autograd.grad(yr, ref_leaves, g.double().cpu())

    chains = lora_chains(rows=math.prod(batch), k=k, n=n, r=r)

    def tol(name: str) -> float:  # numerics.kernel_tol over the result's longest chain
        return kernel_tol(PRECISION[out_dtype], chains[name], autocast=autocast is not None)

    assert rel_err(y, yr) <= tol("y"), ("y", rel_err(y, yr))
    names = ["grad_x"] * x_grad + ["grad_A", "grad_B"] + (["grad_W"] + ["grad_b"] * bias if head else [])
    for name, got, want, leaf in zip(names, grads, ref_grads, leaves, strict=True):
        assert got.shape == leaf.shape and got.dtype == leaf.dtype, name  # grads in the params' own dtype
        assert rel_err(got, want) <= tol(name), (name, rel_err(got, want))
    assert torch.equal(w, w_before), "frozen base was modified"


def poison_cuda_pool(mib: int = 64) -> None:
    """Fill free blocks of the CUDA caching allocator with NaN: outputs the C++ op allocates with
    at::empty then hold NaN wherever a kernel fails to write."""
    blocks = [torch.full((mib << 18,), float("nan"), device="cuda")]  # mib MiB of fp32
    blocks += [torch.full((1 << s,), float("nan"), device="cuda") for s in range(8, 20)]
    del blocks


CASES = [  # 2-D/3-D/4-D, non-contiguous x, with/without bias, ranks 1/16/64, alpha 0, trainable head,
    dict(batch=(37,), k=70, n=53, r=1, alpha=0.5),  # input without gradient (the first layer)
    dict(batch=(3, 41), k=96, n=130, r=16, alpha=0.0, noncontig=True),
    dict(batch=(2, 5, 7), k=45, n=33, r=16, alpha=2.0, bias=False),
    dict(batch=(150,), k=128, n=192, r=64, alpha=8.0, head=True),
    dict(batch=(4, 9), k=24, n=2, r=16, alpha=16.0, head=True, bias=False),
    dict(batch=(3, 11), k=40, n=24, r=4, alpha=1.5, x_grad=False),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_matches_float64(case, dtype):
    check_cpp(dtype=dtype, **case)


@pytest.mark.parametrize("case", [CASES[1], CASES[3]])
def test_cpu_autocast_bf16(case):
    """x and parameters fp32, autocast bf16: y is bf16 and close to the fp32 math, grads are fp32."""
    check_cpp(dtype=torch.float32, autocast=torch.bfloat16, **case)


def test_cpu_autocast_backward_with_autocast_still_on():
    """CPU backward runs on the caller's thread: autocast left on must not change its dtypes."""
    x = torch.randn(6, 16, requires_grad=True)
    w, a, bm = torch.randn(12, 16), torch.randn(16, 4, requires_grad=True), torch.randn(4, 12, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lora_cpp.lora_linear_cpp(x, w, None, a, bm, 2.0)
        gx, ga, gb = torch.autograd.grad(y.float().sum(), [x, a, bm])
    assert gx.dtype == ga.dtype == gb.dtype == torch.float32
    ref = [t.detach().double().requires_grad_(True) for t in (x, a, bm)]
    yr = ref[0] @ w.double().t() + 2.0 * (ref[0] @ ref[1]) @ ref[2]
    chains = lora_chains(rows=6, k=16, n=12, r=4)
    for name, got, want in zip(("grad_x", "grad_A", "grad_B"), (gx, ga, gb), torch.autograd.grad(yr.sum(), ref)):
        assert rel_err(got, want) <= kernel_tol("bf16", chains[name], autocast=True), name


def test_gradcheck_float64():
    x, w, b, a, bm = float64_operands()
    assert torch.autograd.gradcheck(lambda *t: lora_cpp.lora_linear_cpp(*t, 1.7), (x, w, b, a, bm))
    assert torch.autograd.gradcheck(lambda x, w, a, bm: lora_cpp.lora_linear_cpp(x, w, None, a, bm, 0.3),
                                    (x, w, a, bm))


def test_no_grad_forward_builds_no_graph():
    x, w, a, bm = torch.randn(3, 8), torch.randn(5, 8), torch.randn(8, 2, requires_grad=True), torch.randn(2, 5)
    with torch.no_grad():
        y = lora_cpp.lora_linear_cpp(x, w, None, a, bm, 1.0)
    assert y.grad_fn is None and not y.requires_grad
    x, w, a, bm = (t.detach().double() for t in (x, w, a, bm))
    assert rel_err(y, x @ w.t() + (x @ a) @ bm) <= kernel_tol("fp32", lora_chains(rows=3, k=8, n=5, r=2)["y"])


def test_dtype_mismatch_raises_type_error():
    x = torch.randn(2, 8, dtype=torch.float64)
    w, a, bm = torch.randn(8, 8), torch.randn(8, 2), torch.randn(2, 8)
    with pytest.raises(TypeError, match="input is Double but a parameter is Float"):
        lora_cpp.lora_linear_cpp(x, w, None, a, bm, 1.0)
    with pytest.raises(TypeError, match="bias"):
        lora_cpp.lora_linear_cpp(x.float(), w, torch.zeros(8, dtype=torch.float64), a, bm, 1.0)
    with pytest.raises(ValueError, match="shapes do not fit"):
        lora_cpp.lora_linear_cpp(x.float(), w, None, a[:3], bm, 1.0)


def _layer(k=24, n=18, r=4, alpha=2.0, device="cpu"):
    ker = LinearWithLoRAKernel(nn.Linear(k, n), r, alpha).to(device)
    ker.linear.requires_grad_(False)
    nn.init.normal_(ker.lora.B)  # a zero B would hide grad_A
    return ker


def test_override_routes_the_layer_through_the_cpp_op(force_cpp):
    ker = _layer()
    x = torch.randn(2, 5, 24, requires_grad=True)
    y = ker(x)
    assert y.grad_fn.name() == lora_cpp.GRAD_FN_NAME  # not the Python Function's node
    with record_plans() as log:
        assert lora_linear(x, ker.linear.weight, None, ker.lora.A, ker.lora.B, 1.0).grad_fn.name() == lora_cpp.GRAD_FN_NAME
    assert list(log) == [Plan.CPP] and log.backend() == "cpp"
    assert call_plan(x, ker.linear.weight, 4) is Plan.CPP
    ref = LinearWithLoRA(nn.Linear(24, 18), 4, 2.0)
    ref.load_state_dict(ker.state_dict())
    ref.linear.requires_grad_(False)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, ker.lora.A, ker.lora.B], g)
    _, *want = float64_layer(ref, x, g)
    chains = lora_chains(rows=10, k=24, n=18, r=4)
    for name, a, b in zip(("grad_x", "grad_A", "grad_B"), got, want):
        assert rel_err(a, b) <= kernel_tol("fp32", chains[name]), name


def test_cpu_default_stays_on_the_python_function(default_mode):
    ker = _layer()
    with record_plans() as log:
        assert ker(torch.randn(3, 24)).grad_fn.name() == PY_GRAD_FN
    assert list(log) == [Plan.TORCH]


def test_mode_parsing():
    """The C++ op is one op forward and backward: its plans cannot be mixed with another (no plan can)."""
    assert parse_plan("cpp") is Plan.CPP and Plan.CPP.cpp_op and Plan.DIRECT.cpp_op
    for bad in ("cpp:fused", "torch:cpp", "cpp:cpp"):
        with pytest.raises(ValueError, match="expected one of"):
            parse_plan(bad)


def test_frozen_weight_gets_no_grad_and_is_unchanged_after_a_step(force_cpp):
    ker = _layer()
    before = {k: v.clone() for k, v in ker.state_dict().items()}
    opt = torch.optim.AdamW(ker.parameters(), lr=0.1)  # every parameter, frozen ones included
    ker(torch.randn(4, 6, 24, requires_grad=True)).square().sum().backward()
    assert ker.linear.weight.grad is None and ker.linear.bias.grad is None
    assert ker.lora.A.grad is not None and ker.lora.B.grad is not None
    opt.step()
    after = ker.state_dict()
    assert torch.equal(after["linear.weight"], before["linear.weight"])
    assert torch.equal(after["linear.bias"], before["linear.bias"])
    assert not torch.equal(after["lora.A"], before["lora.A"]) and not torch.equal(after["lora.B"], before["lora.B"])


def test_model_equivalence_with_lora(force_cpp):
    """Tiny GPT, LoRA everywhere, trainable 2-class head: logits and every gradient as ``lora``."""
    idx = torch.randint(0, 50257, (3, 20))
    (lr, gr), (lk, gk) = (run_model(m, idx) for m in model_pair("cpu", torch.float32))
    assert lk.grad_fn is not None and any("out_head.linear.weight" in n for n in gk)
    (l64, g64), = [run_model(m, idx) for m in model_pair("cpu", torch.float64, (LinearWithLoRA,))]
    assert gr.keys() == gk.keys()  # both as close to float64 as lora is (numerics.same_function_tol)
    assert_same_function(lk, lr, l64, what="logits")
    assert_same_function(gk, gr, g64, what="gradients")


@pytest.fixture
def fresh_probes():
    """The availability probes start over, and start over again afterwards: a simulated failure
    does not outlive the test (the next probe loads the real build from the extension cache)."""
    available.forget()
    yield
    available.forget()


def test_failed_build_warns_once_and_falls_back(monkeypatch, force_cpp, fresh_probes):
    def broken():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(lora_cpp, "compile_op", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lora_cpp.module() is None and not lora_cpp.cpp_available() and not available.HAVE_CPP
        ker = _layer()
        with record_plans() as log:
            y = ker(torch.randn(3, 24))  # cpp forced but unavailable: the Python Function
        assert y.grad_fn.name() == PY_GRAD_FN
        assert list(log) == [Plan.TORCH]
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "C++ op could not be built" in msgs[0] and "no compiler here" in msgs[0]
    assert "no compiler here" in lora_cpp.build_error()
    with pytest.raises(RuntimeError, match="unavailable"):
        lora_cpp.lora_linear_cpp(torch.randn(2, 3), torch.randn(3, 3), None, torch.randn(3, 1), torch.randn(1, 3), 1.0)


def test_the_source_ships_as_a_cpp_file():
    """The op's source is a real C++ file inside the package (package data), named by ``SOURCE``."""
    assert lora_cpp.SOURCE.suffix == ".cpp" and lora_cpp.SOURCE.parent == Path(lora_cpp.__file__).parent
    text = lora_cpp.SOURCE.read_text()
    assert "struct LoRALinearCpp" in text and "PYBIND11_MODULE(TORCH_EXTENSION_NAME" in text
    assert lora_cpp.GRAD_FN_NAME.endswith("<lora_bench::LoRALinearCpp>") and "namespace lora_bench" in text


# ----------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_matches_float64(case, dtype):
    check_cpp(device="cuda", dtype=dtype, **case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[1], CASES[3]])
def test_gpu_autocast_bf16(case):
    check_cpp(device="cuda", dtype=torch.float32, autocast=torch.bfloat16, **case)


def _capture_fwd_bwd(ker, static_x, g):
    """Warm up as graph users do (side stream, eager), then capture forward+backward; returns
    (graph, the plan the captured call ran, static y, static grads)."""
    params = [static_x, ker.lora.A, ker.lora.B]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            torch.autograd.grad(ker(static_x), params, g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), record_plans() as log:
        static_y = ker(static_x)
        static_grads = torch.autograd.grad(static_y, params, g)
    assert len(log) == 1, list(log)
    return graph, next(iter(log)), static_y, static_grads


def _replay_matches_eager(ker, graph, static_x, static_y, static_grads, g, precision: str):
    """After a replay on fresh inputs, the replayed and the eager results both lie within
    ``precision``'s bound of a float64 evaluation (numerics.kernel_tol)."""
    with torch.no_grad():
        static_x.copy_(torch.randn_like(static_x))
    graph.replay()
    torch.cuda.synchronize()
    y = ker(static_x)
    eager = [y, *torch.autograd.grad(y, [static_x, ker.lora.A, ker.lora.B], g)]
    want = float64_layer(ker, static_x, g)
    n, k = ker.linear.weight.shape
    chains = lora_chains(rows=static_x.numel() // k, k=k, n=n, r=ker.lora.A.shape[1])
    for got in ([static_y, *static_grads], eager):
        for name, a, b in zip(("y", "grad_x", "grad_A", "grad_B"), got, want):
            assert rel_err(a, b) <= kernel_tol(precision, chains[name]), name


@pytest.mark.gpu
def test_gpu_default_is_cpp_eagerly_but_not_under_graph_capture(default_mode):
    """bf16, so the capture holds the fused Triton kernels, first launched inside the capture
    (the eager warm-up ran the C++ op): what graphs.py and the kernel bench do."""
    ker = _layer(256, 192, 16, device="cuda").to(torch.bfloat16)
    x = torch.randn(4, 33, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4, 33, 192, device="cuda", dtype=torch.bfloat16)
    w = ker.linear.weight
    assert call_plan(x.float(), w.float(), 16) is Plan.CPP  # fp32: the C++ op's ATen GEMMs
    assert call_plan(x, w, 16) is Plan.DIRECT  # bf16: the C++ op launches the Triton kernels
    with record_plans() as log:
        assert ker(x).grad_fn.name() == lora_cpp.GRAD_FN_NAME
    assert list(log) == [Plan.DIRECT]
    with graph_plan(), record_plans() as log:  # graph warm-ups run the plan the capture will use
        assert call_plan(x, w, 16) is Plan.FUSED and ker(x).grad_fn.name() == PY_GRAD_FN
    assert list(log) == [Plan.FUSED]
    assert call_plan(x, w, 16) is Plan.DIRECT
    big = torch.empty(6400, 1600, device="cuda", dtype=torch.bfloat16)  # a 1558M MLP weight: cuBLAS wins
    with graph_plan():
        assert call_plan(x, big, 16) is Plan.CPP and call_plan(x, w, 16) is not Plan.CPP
    graph, plan, static_y, static_grads = _capture_fwd_bwd(ker, x, g)
    assert plan is Plan.FUSED and static_y.grad_fn.name() == PY_GRAD_FN
    _replay_matches_eager(ker, graph, x, static_y, static_grads, g, "bf16")  # two bf16 paths
    with record_plans() as log:  # torch.compile traces the custom ops (Python plans), never the C++ op
        y = torch.compile(ker, fullgraph=True, backend="aot_eager")(x)
        torch.autograd.grad(y, [x, ker.lora.A, ker.lora.B], g)
    assert list(log) == [Plan.FUSED]
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_forced_cpp_is_capturable(force_cpp):
    ker = _layer(128, 96, 8, device="cuda")
    x = torch.randn(64, 128, device="cuda", requires_grad=True)
    g = torch.randn(64, 96, device="cuda")
    graph, plan, static_y, static_grads = _capture_fwd_bwd(ker, x, g)
    assert plan is Plan.CPP and static_y.grad_fn.name() == lora_cpp.GRAD_FN_NAME
    _replay_matches_eager(ker, graph, x, static_y, static_grads, g, "fp32")


# ------------------------------------------------- the "direct" plan: Triton kernels launched by the C++ op

DIRECT_CASES = [  # odd sizes (no tile multiples), 2-D/3-D, no bias, ranks 1/16/64, alpha 0, first layer
    dict(batch=(37,), k=70, n=53, r=1, alpha=0.5),
    dict(batch=(3, 41), k=96, n=130, r=16, alpha=0.0, noncontig=True),
    dict(batch=(2, 5, 7), k=45, n=33, r=16, alpha=2.0, bias=False),
    dict(batch=(150,), k=128, n=192, r=64, alpha=8.0),
    dict(batch=(3, 11), k=40, n=24, r=4, alpha=1.5, x_grad=False),
    # a GPT-2 1558M MLP layer at 960 tokens (alpha 2: with 16, fp16's grad_A overflows, in every plan)
    dict(batch=(8, 120), k=1600, n=6400, r=16, alpha=2.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DIRECT_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_direct_matches_float64(case, dtype):
    check_cpp(device="cuda", dtype=dtype, direct=True, **case)
    check_cpp(device="cuda", dtype=dtype, direct=True, **case)  # again: the registered plan, fresh inputs


@pytest.mark.gpu
@pytest.mark.parametrize("case", [DIRECT_CASES[1], DIRECT_CASES[3]])
def test_gpu_direct_autocast_reads_fp32_adapters(case):
    """fp32 x and parameters under bf16 autocast: the kernels read fp32 A and B as they are; grads fp32."""
    check_cpp(device="cuda", dtype=torch.float32, autocast=torch.bfloat16, direct=True, **case)


@pytest.mark.gpu
def test_gpu_direct_on_a_side_stream_and_in_the_default_route(default_mode):
    """The default eager route of a bf16 layer is the direct plan (fp32: the ATen plan); launched on
    a side stream it matches the ATen plan's numbers, and the backward runs on that stream too."""
    ker = _layer(256, 192, 16, device="cuda").to(torch.bfloat16)
    x = torch.randn(4, 33, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(4, 33, 192, device="cuda", dtype=torch.bfloat16)
    w = ker.linear.weight
    assert call_plan(x, w, 16) is Plan.DIRECT
    assert call_plan(x.float(), w.float(), 16) is Plan.CPP
    params = [x, ker.lora.A, ker.lora.B]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), record_plans() as log:
        torch.cuda._sleep(2_000_000)  # keep the side stream busy: a launch on the wrong stream would race
        y = ker(x)
        got = torch.autograd.grad(y, params, g)
    torch.cuda.current_stream().wait_stream(side)
    assert list(log) == [Plan.DIRECT]
    with use_policy(PlanPolicy(forced=Plan.CPP)), record_plans() as log:
        want_y = ker(x)
        want = torch.autograd.grad(want_y, params, g)
    assert list(log) == [Plan.CPP]
    ref = float64_layer(ker, x, g)
    chains = lora_chains(rows=4 * 33, k=256, n=192, r=16)
    for results in ([y, *got], [want_y, *want]):  # both plans against float64 (numerics.kernel_tol)
        for name, a, b in zip(("y", "grad_x", "grad_A", "grad_B"), results, ref):
            assert rel_err(a, b) <= kernel_tol("bf16", chains[name]), name
    big = torch.empty(6400, 1600, device="cuda", dtype=torch.bfloat16)
    with graph_plan():  # captured large layers: the C++ op's cuBLAS GEMMs, not the direct plan
        assert call_plan(x, big, 16) is Plan.CPP
