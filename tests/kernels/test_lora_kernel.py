"""lora-kernel: forward and all gradients against float64 on fresh random inputs; frozen base
untouched; trainable head gets its gradient; same outputs and grads as LinearWithLoRA in a model.

CPU tests exercise the torch path (and, where Triton is installed, the kernels under Triton's
interpreter). GPU tests (``-m gpu``) run the default plan (the C++ op, tests/kernels/test_lora_cpp.py)
and the Triton plans, forced through the plan policy, Triton outputs pre-filled with NaN.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from numerics import (
    assert_same_function,
    float64_layer,
    float64_operands,
    fresh,
    interpreted_runs,
    kernel_tol,
    layer_operands,
    lora_chains,
    model_pair,
    rel_err,
    run_model,
)

from lora_bench.kernels import available
from lora_bench.kernels.autograd import call_plan, lora_linear
from lora_bench.kernels.policy import Plan, PlanPolicy, choose, record_plans, use_policy
from lora_bench.lora import LinearWithLoRA, inject_lora, lora_class
from lora_bench.lora.kernel import LinearWithLoRAKernel
from lora_bench.model.gpt2 import build_random_model, gpt_config
from lora_bench.train.graphs import warm_up

DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def check_case(*, device, dt: str, batch: tuple[int, ...], k: int, n: int, r: int, alpha: float,
               bias: bool = True, noncontig: bool = False, head: bool = False) -> None:
    """One forward+backward of lora_linear against a float64 reference of the same math."""
    dtype = DTYPE[dt]
    x, w, b, a, bm = layer_operands(batch=batch, k=k, n=n, r=r, device=device, dtype=dtype, bias=bias,
                                    noncontig=noncontig)
    g = fresh(*batch, n, device=device, dtype=dtype)
    w_before, b_before = w.clone(), (b.clone() if bias else None)
    leaves = [x, a, bm] + ([w] + ([b] if bias else []) if head else [])
    for t in leaves:
        t.requires_grad_(True)
    y = lora_linear(x, w, b, a, bm, alpha)
    grads = torch.autograd.grad(y, leaves, g)

    ref_leaves = [t.detach().double().cpu().requires_grad_(True) for t in leaves]
    xr, ar, bmr = ref_leaves[:3]
    wr = ref_leaves[3] if head else w.double().cpu()
    br = (ref_leaves[4] if head else b.double().cpu()) if bias else None
    yr = xr @ wr.t() + alpha * (xr @ ar) @ bmr + (br if bias else 0)
    ref_grads = torch.autograd.grad(yr, ref_leaves, g.double().cpu())

    chains = lora_chains(rows=math.prod(batch), k=k, n=n, r=r)
    assert y.dtype == dtype and y.shape == (*batch, n)
    assert rel_err(y, yr) <= kernel_tol(dt, chains["y"]), ("y", rel_err(y, yr))
    names = ["grad_x", "grad_A", "grad_B", "grad_W", "grad_b"]
    for name, got, ref, leaf in zip(names, grads, ref_grads, leaves):
        assert got.shape == leaf.shape and got.dtype == leaf.dtype, name
        assert rel_err(got, ref) <= kernel_tol(dt, chains[name]), (name, rel_err(got, ref))
    assert torch.equal(w, w_before) and (not bias or torch.equal(b, b_before)), "frozen base was modified"


CASES = [  # odd sizes (not tile multiples), ranks 1..64, alpha 0, 2-D/3-D, no bias, views
    dict(batch=(37,), k=70, n=53, r=1, alpha=0.5),
    dict(batch=(3, 41), k=96, n=130, r=16, alpha=0.0, noncontig=True),
    dict(batch=(2, 5, 7), k=45, n=33, r=33, alpha=2.0, bias=False),
    dict(batch=(150,), k=128, n=192, r=64, alpha=8.0, head=True),
]


# ----------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_cpu_matches_float64(case, dt):
    check_case(device="cpu", dt=dt, **case)


def test_cpu_backend_is_torch():
    assert call_plan(torch.empty(2, 4), torch.empty(3, 4), 16) is Plan.TORCH
    ker, _ = _layer_pair(4, 3, 2, 1.0)
    with record_plans() as log:
        y = ker(torch.randn(2, 4))
    assert list(log) == [Plan.TORCH] and log.backend() == "torch" and y.grad_fn.name() == "LoRAKernelFunctionBackward"


def test_gradcheck_float64():
    x, w, b, a, bm = float64_operands()
    assert torch.autograd.gradcheck(lambda *t: lora_linear(*t, 1.7), (x, w, b, a, bm))


def _layer_pair(k: int, n: int, r: int, alpha: float, *, trainable_base: bool = False):
    lin = nn.Linear(k, n)
    lin.requires_grad_(trainable_base)
    ker = LinearWithLoRAKernel(lin, r, alpha)
    nn.init.normal_(ker.lora.B)  # a zero B would hide grad_A
    ref = LinearWithLoRA(nn.Linear(k, n), r, alpha)
    ref.load_state_dict(ker.state_dict())  # same parameter names in every variant
    ref.linear.requires_grad_(trainable_base)
    return ker, ref


def test_frozen_base_gets_no_gradient_and_is_not_modified():
    ker, _ = _layer_pair(24, 18, 4, 2.0)
    before = {k: v.clone() for k, v in ker.state_dict().items()}
    ker(torch.randn(5, 24, requires_grad=True)).square().sum().backward()
    assert ker.linear.weight.grad is None and ker.linear.bias.grad is None
    assert ker.lora.A.grad is not None and ker.lora.B.grad is not None
    for k, v in ker.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_trainable_head_gets_weight_and_bias_gradients():
    """As close to the float64 evaluation as LinearWithLoRA's (numerics.same_function_tol)."""
    ker, ref = _layer_pair(24, 2, 16, 16.0, trainable_base=True)
    ref64 = copy.deepcopy(ref).double()
    x = torch.randn(4, 9, 24)
    for m in (ker, ref, ref64):
        m(x.to(m.linear.weight.dtype))[:, -1].square().sum().backward()
    for (name, p), q, q64 in zip(ker.named_parameters(), ref.parameters(), ref64.parameters()):
        assert_same_function(p.grad, q.grad, q64.grad, what=name)


def test_cpu_autocast_bf16_matches_lora_under_autocast():
    """Both layers against float64, within the bound of a bf16 autocast chain (numerics.kernel_tol)."""
    ker, ref = _layer_pair(64, 48, 8, 2.0)
    x = torch.randn(3, 10, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yk, yr = ker(x), ref(x)
    assert yk.dtype == yr.dtype == torch.bfloat16
    g = torch.randn_like(yk)
    want = float64_layer(ref, x, g)
    chains = lora_chains(rows=30, k=64, n=48, r=8)
    for y, layer in ((yk, ker), (yr, ref)):
        got = [y, *torch.autograd.grad(y, [layer.lora.A, layer.lora.B], g)]
        assert [t.dtype for t in got[1:]] == [torch.float32] * 2
        for name, a, b in zip(("y", "grad_A", "grad_B"), got, want):
            assert rel_err(a, b) <= kernel_tol("bf16", chains[name], autocast=True), (type(layer).__name__, name)


def test_dtype_mismatch_without_autocast_raises():
    ker, _ = _layer_pair(8, 8, 2, 1.0)
    with pytest.raises(TypeError):
        ker(torch.randn(2, 8, dtype=torch.float64))


class _GraphRecorder:
    """A torch.compile backend that keeps the FX graphs it is given and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def count(self, name: str) -> int:
        return sum(name in str(n.target) for g in self.graphs for n in g.graph.nodes if n.op == "call_function")


def test_compiled_model_traces_lora_kernel_as_custom_ops_in_one_graph():
    """torch.compile sees each lora-kernel layer as the lora_bench custom op: one graph for the whole
    model (fullgraph: no break), same outputs as eager."""
    torch.manual_seed(3)
    m = build_random_model(gpt_config("tiny", context_length=32))
    m.requires_grad_(False)
    n_layers = inject_lora(m, cls=LinearWithLoRAKernel, rank=4, alpha=2.0)
    rec = _GraphRecorder()
    x = torch.randint(0, 50257, (2, 12))
    with record_plans() as log:
        out = torch.compile(m, fullgraph=True, backend=rec)(x)
    assert len(rec.graphs) == 1 and rec.count("lora_linear_fwd") == n_layers > 0
    assert torch.equal(out, m(x))
    # the plan is chosen when the call is traced, noted then, and held by the graph as a constant
    assert list(log) == [Plan.TORCH]
    plans = {n.args[-1] for g in rec.graphs for n in g.graph.nodes if "lora_linear_fwd" in str(n.target)}
    assert plans == {"torch"}


def test_compiled_layers_note_their_plan_once_per_trace_and_keep_it(monkeypatch):
    """The plan of a compiled call is fixed when it is traced: chosen under the policy then in
    force (here forced, under Triton's interpreter stand-in) and run by forward and backward,
    whatever the policy when the compiled code runs later."""
    torch.manual_seed(6)
    ker, ref = _layer_pair(20, 12, 3, 1.5)
    x = torch.randn(4, 20, requires_grad=True)
    compiled = torch.compile(ker, fullgraph=True, backend="aot_eager")
    seen = []
    real = available.triton_kernels
    monkeypatch.setattr(available, "HAVE_TRITON_INTERPRETER", True)  # the CPU may take a forced Triton plan

    class Torchish:  # stands in for the Triton kernels, running the same math with torch ops
        def lora_grad_ab(self, x, u, h, g, *, scale, grad_dtype, do_a, do_b):
            seen.append("grad_ab")
            return ((x.t() @ u).mul_(scale).to(grad_dtype) if do_a else None,
                    (h.t() @ g).mul_(scale).to(grad_dtype) if do_b else None)

    monkeypatch.setattr(available, "triton_kernels", lambda: Torchish())
    with use_policy(PlanPolicy(forced=Plan.CUBLAS)), record_plans() as log:
        y = compiled(x)
        got = torch.autograd.grad(y, [x, ker.lora.A, ker.lora.B], torch.ones_like(y))
    assert list(log) == [Plan.CUBLAS] and seen == ["grad_ab"]  # the backward ran the traced plan too
    with record_plans() as later:  # the default policy now; the compiled code keeps its plan
        y2 = compiled(x)
        torch.autograd.grad(y2, [x, ker.lora.A, ker.lora.B], torch.ones_like(y2))
    assert len(later) == 0 and seen == ["grad_ab", "grad_ab"]
    monkeypatch.setattr(available, "triton_kernels", real)
    _, *want = float64_layer(ref, x, torch.ones_like(y))
    chains = lora_chains(rows=4, k=20, n=12, r=3)
    for name, a, b in zip(("grad_x", "grad_A", "grad_B"), got, want):
        assert rel_err(a, b) <= kernel_tol("fp32", chains[name]), name
    torch._dynamo.reset()


@pytest.mark.parametrize("trainable_base", [False, True])
def test_compiled_layer_gradients_match_eager(trainable_base):
    """Through AOTAutograd (backend aot_eager): the custom ops' autograd formula gives the eager
    Function's gradients, for the input, A, B and — for a trainable head — W and b."""
    torch.manual_seed(4)
    ker, _ = _layer_pair(40, 28, 5, 1.5, trainable_base=trainable_base)
    x = torch.randn(3, 7, 40, requires_grad=True)
    g = torch.randn(3, 7, 28)
    wrt = [x, ker.lora.A, ker.lora.B] + ([ker.linear.weight, ker.linear.bias] if trainable_base else [])
    y = torch.compile(ker, fullgraph=True, backend="aot_eager")(x)
    got = torch.autograd.grad(y, wrt, g)
    want_y = ker(x)
    want = torch.autograd.grad(want_y, wrt, g)
    ker64 = copy.deepcopy(ker).double()
    x64 = x.detach().double().requires_grad_(True)
    wrt64 = [x64, ker64.lora.A, ker64.lora.B] + ([ker64.linear.weight, ker64.linear.bias] if trainable_base else [])
    ref_y = ker64(x64)
    ref = torch.autograd.grad(ref_y, wrt64, g.double())
    assert_same_function(y, want_y, ref_y, what="y")  # (numerics.same_function_tol)
    for a, b, c in zip(got, want, ref):
        assert a.shape == b.shape
        assert_same_function(a, b, c, what="gradient")


def test_compiled_layer_under_cpu_autocast_keeps_fp32_gradients():
    torch.manual_seed(5)
    ker, ref = _layer_pair(32, 24, 4, 2.0)
    x = torch.randn(2, 6, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.compile(ker, fullgraph=True, backend="aot_eager")(x)
    assert y.dtype == torch.bfloat16
    g = torch.randn_like(y)
    got = [y, *torch.autograd.grad(y, [ker.lora.A, ker.lora.B], g)]
    chains = lora_chains(rows=12, k=32, n=24, r=4)
    for name, a, b in zip(("y", "grad_A", "grad_B"), got, float64_layer(ref, x, g)):
        assert rel_err(a, b) <= kernel_tol("bf16", chains[name], autocast=True), name
    assert got[1].dtype == got[2].dtype == torch.float32


def test_custom_ops_pass_torch_library_opcheck():
    """Schema, fake (shape) implementation and autograd registration agree with the real op."""
    x, w, b = torch.randn(9, 16), torch.randn(12, 16), torch.randn(12)
    a, bm = torch.randn(16, 3, requires_grad=True), torch.randn(3, 12, requires_grad=True)
    torch.library.opcheck(torch.ops.lora_bench.lora_linear_fwd.default, (x, w, b, a, bm, 0.5, "torch"))
    torch.library.opcheck(torch.ops.lora_bench.lora_linear_fwd.default, (x, w, None, a, bm, 0.5, "torch"))
    g, h = torch.randn(9, 12), torch.randn(9, 3)
    for need_x in (True, False):
        torch.library.opcheck(torch.ops.lora_bench.lora_linear_bwd.default,
                              (g, x, h, w, a.detach(), bm.detach(), 0.5, need_x, "torch"))


def test_registry_and_state_dict_interchange():
    assert lora_class("lora-kernel") is LinearWithLoRAKernel
    ker, ref = _layer_pair(12, 10, 3, 1.0)
    assert set(ker.state_dict()) == set(ref.state_dict()) == {"linear.weight", "linear.bias", "lora.A", "lora.B"}


def _compare_models(device: str, dtype: torch.dtype):
    """lora-kernel and lora in ``dtype``, logits and every gradient, both against a float64 lora
    model: lora-kernel as close to it as lora is (numerics.same_function_tol, with ``dtype``'s
    unit roundoff: two computations that round in different places need not agree bit for bit)."""
    idx = torch.randint(0, 50257, (3, 20), device=device)
    ref, ker = model_pair(device, dtype)
    (lr, gr), (lk, gk) = run_model(ref, idx), run_model(ker, idx)
    assert gr.keys() == gk.keys() and any("out_head.linear.weight" in n for n in gk)
    (l64, g64), = [run_model(m, idx) for m in model_pair(device, torch.float64, (LinearWithLoRA,))]
    assert_same_function(lk, lr, l64, dtype, what="logits")
    assert_same_function(gk, gr, g64, dtype, what="gradients")
    for name, p in ker.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, name


def test_model_equivalence_with_lora_cpu():
    _compare_models("cpu", torch.float32)


def test_model_equivalence_with_lora_cpu_bf16():
    _compare_models("cpu", torch.bfloat16)


@pytest.fixture
def fresh_probes():
    """The availability probes start over, and start over again afterwards (nothing simulated here
    outlives the test)."""
    available.forget()
    yield
    available.forget()


def test_missing_triton_warns_once(monkeypatch, fresh_probes):
    monkeypatch.setitem(sys.modules, "lora_bench.kernels.lora_triton", None)  # import now fails
    import lora_bench.kernels

    monkeypatch.delattr(lora_bench.kernels, "lora_triton", raising=False)  # (set once an earlier test imported it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert available.triton_kernels() is None and available.triton_kernels() is None
        assert not available.HAVE_TRITON and not available.HAVE_TRITON
        # CUDA without the C++ op and without Triton: torch ops
        assert choose(PlanPolicy(), device="cuda", dtype=torch.bfloat16, capturing=False, compiling=False,
                      weight_numel=64, rank=4, exact_fp32=False, have_triton=available.HAVE_TRITON,
                      have_cpp=False) is Plan.TORCH
    assert sum("Triton is unavailable" in str(w.message) for w in caught) == 1


def test_kernels_under_triton_interpreter():
    """The Triton kernels themselves, on CPU, outputs pre-filled with NaN (fp32 and fp16)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("Triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernel_selfcheck", "--interpret"],
                          capture_output=True, text=True, env=env, timeout=600)
    if "only 0-dimensional arrays can be converted" in proc.stderr:
        pytest.skip("this Triton's interpreter does not work with this NumPy (needs Triton >= 3.7 or NumPy < 2.4)")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "interpreter check: all ok" in proc.stdout


# lora_grad_ab with a forced row split, under the interpreter (CPU tiles: BLOCK_M 32, BLOCK_D 16):
# (M, K, N, R, split_m, do_a, do_b, input dtype, grad dtype, split launched). Odd sizes everywhere;
# M=100 is 4 row blocks, so 3 splits get 1+1+2 and the last block is 4 rows; 9 splits of 45 rows
# clamp to its 2 blocks; fp16 grads cannot take atomics and keep one split. bf16 is left to the GPU
# test below (the interpreter gets bf16 dots wrong), fp16 stands in for 16-bit inputs.
AB_SPLIT_CASES = [
    (100, 70, 53, 16, 1, True, True, "fp32", "fp32", 1),
    (100, 70, 53, 16, 2, True, True, "fp32", "fp32", 2),
    (100, 70, 53, 16, 3, True, True, "fp16", "fp32", 3),
    (150, 45, 33, 1, 3, True, True, "fp32", "fp32", 3),
    (130, 33, 70, 64, 4, True, True, "fp16", "fp32", 4),
    (77, 50, 29, 64, 3, True, True, "fp32", "fp32", 3),
    (97, 40, 36, 16, 2, True, False, "fp32", "fp32", 2),
    (97, 40, 36, 1, 3, False, True, "fp16", "fp32", 3),
    (45, 70, 53, 16, 9, True, True, "fp32", "fp32", 2),
    (100, 70, 53, 16, 3, True, True, "fp16", "fp16", 1),
]


def _ab_interp_main() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: every AB_SPLIT_CASES case twice, outputs
    allocated by the wrapper (POISON_OUTPUTS on) and passed in NaN-filled; one JSON line per run
    with the launched split and both errors against float64."""
    from lora_bench.kernels import lora_triton as lt

    lt.POISON_OUTPUTS = True
    grids = []
    real_launch = lt.launch
    lt.launch = lambda fn, grid, *a, **kw: (grids.append(grid), real_launch(fn, grid, *a, **kw))
    for i, (M, k, n, r, split, do_a, do_b, dt, gdt, _) in enumerate(AB_SPLIT_CASES):
        dtype, gdtype, s = DTYPE[dt], DTYPE[gdt], 0.7
        x, u, h, g = (fresh(M, d, device="cpu", dtype=dtype) for d in (k, r, r, n))
        X, U, H, G = (t.double() for t in (x, u, h, g))
        for given in (False, True):
            outs = {}
            if given:
                outs = dict(ga_out=torch.full((k, r), float("nan"), dtype=gdtype),
                            gb_out=torch.full((r, n), float("nan"), dtype=gdtype))
            grids.clear()
            ga, gb = lt.lora_grad_ab(x, u, h, g, scale=s, grad_dtype=gdtype, do_a=do_a, do_b=do_b,
                                     config=lt.ABConfig(32, 16, 4, 1, split), **outs)
            # a gradient not asked for: None, or the given buffer untouched (still NaN)
            skipped = [t is None or bool(t.isnan().all()) for t, on in ((ga, do_a), (gb, do_b)) if not on]
            print(json.dumps(dict(
                case=i, given=given, split=grids[0][1], skipped_ok=all(skipped),
                dtypes=[str(t.dtype) for t, on in ((ga, do_a), (gb, do_b)) if on],
                err_a=rel_err(ga, s * X.t() @ U) if do_a else None,
                err_b=rel_err(gb, s * H.t() @ G) if do_b else None)), flush=True)


@pytest.fixture(scope="module")
def ab_interp_runs():
    runs = interpreted_runs(__file__, "_ab_interp_main")
    assert len(runs) == 2 * len(AB_SPLIT_CASES), runs[-3:]
    return runs


@pytest.mark.parametrize("i", range(len(AB_SPLIT_CASES)))
def test_grad_ab_row_split_under_triton_interpreter(ab_interp_runs, i):
    """Forced splits (atomics into zeroed fp32) and their fallbacks match float64; outputs given
    NaN-filled are zeroed first; a gradient not asked for is not written."""
    M, k, n, r, split, do_a, do_b, dt, gdt, launched = AB_SPLIT_CASES[i]
    for run in (x for x in ab_interp_runs if x["case"] == i):
        assert run["split"] == launched, run
        assert run["dtypes"] == [str(DTYPE[gdt])] * (do_a + do_b), run
        assert run["skipped_ok"], run
        tol = kernel_tol(dt, M)  # grad_A = s·xᵀ·u and grad_B = s·hᵀ·g sum M rows of given u, h
        for err in (run["err_a"], run["err_b"]):
            assert err is None or err <= tol, (run, tol)


def test_grad_ab_split_heuristic(monkeypatch):
    """2-4 programs per SM at the GPT-2 1558M shapes (M=960) on a 132-SM GPU; never more splits
    than row blocks; no GPU needed (the SM count is patched in)."""
    triton = pytest.importorskip("triton")
    from lora_bench.kernels import lora_tiles
    from lora_bench.kernels import lora_triton as lt

    monkeypatch.setattr(lora_tiles, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    for k, n in ((1600, 1600), (1600, 6400), (6400, 1600)):
        for do_a, do_b in ((True, True), (True, False), (False, True)):
            c = lt.pick_ab_config(960, k, n, cuda, do_a=do_a, do_b=do_b)
            strips = do_a * triton.cdiv(k, c.block_d) + do_b * triton.cdiv(n, c.block_d)
            assert 1 <= c.split_m <= triton.cdiv(960, c.block_m), (k, n, c)
            assert 2 * 132 <= strips * c.split_m <= 4 * 132, (k, n, do_a, do_b, c)
    assert lt.pick_ab_config(960, 1600, 1600, cuda) == lt.ABConfig(64, 32, 4, 3, 4)
    assert lt.ab_split(100, 64, 1, 132) == 2  # capped at the row blocks
    assert lt.ab_split(0, 64, 10, 132) == 1 and lt.ab_split(960, 64, 1000, 132) == 1
    assert lt.pick_ab_config(960, 1600, 1600, torch.device("cpu")).split_m == 1  # the interpreter: forced only


# ----------------------------------------------------------------------------------- GPU


@pytest.fixture
def poisoned(monkeypatch):
    """Every output the Triton wrappers allocate starts as NaN; unwritten elements fail."""
    from lora_bench.kernels import lora_triton

    monkeypatch.setattr(lora_triton, "POISON_OUTPUTS", True)
    yield


@pytest.fixture
def tf32():
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(prev)


def _recorded(layer: nn.Module, x: torch.Tensor) -> set[Plan]:
    """The plans a forward+backward of ``layer`` on ``x`` ran."""
    with record_plans() as log:
        layer(x).float().square().sum().backward()
    return set(log)


@pytest.mark.gpu
@gpu
def test_gpu_backend_is_cpp_or_forced_triton():
    ker = _layer_pair(64, 48, 8, 2.0)[0].cuda()
    x = torch.randn(5, 64, device="cuda", requires_grad=True)  # exact fp32
    assert _recorded(ker, x) == ({Plan.CPP} if available.HAVE_CPP else {Plan.CUBLAS})
    with use_policy(PlanPolicy(forced=Plan.FUSED)):
        assert _recorded(ker, x) == {Plan.FUSED}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", [None, "fused", "cublas"])  # None: the C++ op in eager CUDA
@pytest.mark.parametrize("dt", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES)
def test_gpu_matches_float64(case, dt, mode, poisoned, request):
    if dt == "tf32":
        request.getfixturevalue("tf32")
    with use_policy(PlanPolicy(forced=mode and Plan(mode))):
        check_case(device="cuda", dt=dt, **case)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["bf16", "fp16", "tf32"])
def test_gpu_kernels_direct_with_poisoned_buffers(dt, request):
    from lora_bench.kernels import lora_triton as lt

    if dt == "tf32":
        request.getfixturevalue("tf32")
    dtype, dev, nan = DTYPE[dt], "cuda", float("nan")
    cases = ((1000, 1600, 1700, 16, 2.0), (77, 300, 200, 5, 0.0), (129, 64, 65, 64, 1.0))
    for M, k, n, r, s in cases + cases:  # the repeat launches through the cached fast path
        x, g = fresh(M, k, device=dev, dtype=dtype), fresh(M, n, device=dev, dtype=dtype)
        w, bias = fresh(n, k, device=dev, dtype=dtype, scale=k ** -0.5), fresh(n, device=dev, dtype=dtype)
        a, b = fresh(k, r, device=dev, dtype=dtype, scale=k ** -0.5), fresh(r, n, device=dev, dtype=dtype)
        y, h = torch.full((M, n), nan, device=dev, dtype=dtype), torch.full((M, r), nan, device=dev, dtype=dtype)
        lt.lora_mm(x, w.t(), a, b, bias, scale=s, out=y, h_out=h)
        gx, u = torch.full((M, k), nan, device=dev, dtype=dtype), torch.full((M, r), nan, device=dev, dtype=dtype)
        lt.lora_mm(g, w, b.t(), a.t(), None, scale=s, out=gx, h_out=u)
        ga, gb = torch.full((k, r), nan, device=dev), torch.full((r, n), nan, device=dev)
        lt.lora_grad_ab(x, u, h, g, scale=s, ga_out=ga, gb_out=gb)
        X, G, W, A, B = (t.double() for t in (x, g, w, a, b))
        tol = {name: kernel_tol(dt, c) for name, c in lora_chains(rows=M, k=k, n=n, r=r).items()}
        assert rel_err(h, X @ A) <= tol["h"] and rel_err(u, G @ B.t()) <= tol["u"]
        assert rel_err(y, X @ W.t() + bias.double() + s * (X @ A) @ B) <= tol["y"]
        assert rel_err(gx, G @ W + s * (G @ B.t()) @ A.t()) <= tol["grad_x"]
        tol_ab = kernel_tol(dt, M)  # against the kernels' own u and h: M terms each
        assert rel_err(ga, s * X.t() @ u.double()) <= tol_ab and rel_err(gb, s * h.double().t() @ G) <= tol_ab
    from lora_bench.kernels import triton_launch as launch

    assert not launch.FAST or len(launch._COMPILED) >= 2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["bf16", "fp32"])
@pytest.mark.parametrize("n", [1600, 6400])
def test_gpu_grad_ab_auto_split_at_1558m(dt, n):
    """The default (auto-split, atomic) path at the GPT-2 1558M shapes: fp32 grads against
    float64, twice (the second through the cached config and fast launch)."""
    from lora_bench.kernels import lora_triton as lt

    M, k, r, s, dev = 960, 1600, 16, 2.0, "cuda"
    dtype = DTYPE[dt]
    x, u, h, g = (fresh(M, d, device=dev, dtype=dtype) for d in (k, r, r, n))
    X, U, H, G = (t.double() for t in (x, u, h, g))
    for _ in range(2):
        ga, gb = lt.lora_grad_ab(x, u, h, g, scale=s, grad_dtype=torch.float32)
        assert ga.dtype == gb.dtype == torch.float32
        tol = kernel_tol(dt, M)  # M terms each, from the given u and h
        assert rel_err(ga, s * X.t() @ U) <= tol and rel_err(gb, s * H.t() @ G) <= tol
    assert lt.AB_PICKED[(M, k, n, True, True)].split_m > 1


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", [None, "fused", "cublas"])
def test_gpu_autocast_bf16(poisoned, mode):
    with use_policy(PlanPolicy(forced=mode and Plan(mode))):
        _gpu_autocast_bf16()


def _gpu_autocast_bf16():
    ker, ref = (m.cuda() for m in _layer_pair(256, 192, 16, 2.0))
    for x_grad in (True, False):  # False: a first layer (the input needs no gradient; A and B do)
        x = torch.randn(4, 33, 256, device="cuda", requires_grad=x_grad)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            yk, yr = ker(x), ref(x)
        assert yk.dtype == yr.dtype == torch.bfloat16
        g = torch.randn_like(yk)
        wrt = ([x] if x_grad else [])
        want = float64_layer(ref, x, g)
        chains = lora_chains(rows=4 * 33, k=256, n=192, r=16)
        names = ["y", *(["grad_x"] if x_grad else []), "grad_A", "grad_B"]
        for y, layer in ((yk, ker), (yr, ref)):  # both against float64 (numerics.kernel_tol)
            got = [y, *torch.autograd.grad(y, [*wrt, layer.lora.A, layer.lora.B], g)]
            assert all(t.dtype == torch.float32 for t in got[1:])
            for name, a, b in zip(names, got, want):
                assert rel_err(a, b) <= kernel_tol("bf16", chains[name], autocast=True), (type(layer).__name__, name)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", [None, "fused", "cublas"])
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_gpu_model_equivalence_with_lora(dt, mode, poisoned):
    with use_policy(PlanPolicy(forced=mode and Plan(mode))):
        _compare_models("cuda", DTYPE[dt])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("M,k,n,r", [(960, 1600, 6400, 16), (333, 768, 770, 1), (129, 640, 384, 64)])
@pytest.mark.parametrize("mode", [None, "fused", "cublas", "cpp"])  # None: the capture-mode rules
def test_gpu_plans_captured_in_a_cuda_graph(dt, M, k, n, r, mode, poisoned):
    """Each plan captured in a CUDA graph (forward and backward): replays on fresh random inputs
    copied into the captured buffers match float64 every time, with the adapter gradients complete
    when the replay ends."""
    dtype, dev, s = DTYPE[dt], "cuda", 2.0
    w, b = fresh(n, k, device=dev, dtype=dtype, scale=k ** -0.5), fresh(n, device=dev, dtype=dtype)
    a = fresh(k, r, device=dev, dtype=dtype, scale=k ** -0.5).requires_grad_(True)
    bm = fresh(r, n, device=dev, dtype=dtype).requires_grad_(True)
    x = fresh(M, k, device=dev, dtype=dtype).requires_grad_(True)
    g = fresh(M, n, device=dev, dtype=dtype)

    def step():
        y = lora_linear(x, w, b, a, bm, s)
        return (y, *torch.autograd.grad(y, [x, a, bm], g))

    with use_policy(PlanPolicy(forced=mode and Plan(mode))), record_plans() as log:
        warm_up(step, 2)  # (a forced plan stays forced under the capture-mode policy)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
    assert len(log) == 1 and (mode is None or set(log) == {Plan(mode)}), set(log)
    for _ in range(3):
        with torch.no_grad():
            for t in (x, a, bm, g):
                t.copy_(fresh(*t.shape, device=dev, dtype=dtype, scale=float(t.std())))
            for t in outs:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        X, W, A, B, G = (t.detach().double() for t in (x, w, a, bm, g))
        H, U = X @ A, G @ B.t()
        refs = (X @ W.t() + b.double() + s * H @ B, G @ W + s * U @ A.t(), s * X.t() @ U, s * H.t() @ G)
        chains = lora_chains(rows=M, k=k, n=n, r=r)
        for name, got, ref in zip(("y", "grad_x", "grad_A", "grad_B"), outs, refs):
            assert rel_err(got, ref) <= kernel_tol(dt, chains[name]), (name, rel_err(got, ref))
