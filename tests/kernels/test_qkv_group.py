"""lora-kernel layers side by side (``group_qkv``): a block's query, key and value layers keep their
names and values, their parameters become views of one buffer per kind, and where the fused plan
runs they are computed by one launch forward and two backward (the segment kernels), matching
float64 references on fresh random inputs and the ungrouped layers.

CPU tests cover the grouping and the one-by-one fallback; under Triton's CPU interpreter the
segment kernels and a grouped model run for real. GPU tests (``-m gpu``) check the kernels in
every dtype, under autocast, captured in a CUDA graph, with outputs pre-filled with NaN."""

from __future__ import annotations

import json

import pytest
import torch
from numerics import (
    assert_same_function,
    fresh,
    interpreted_runs,
    kernel_tol,
    lora_chains,
    model_pair,
    rounded_input_tol,
    rel_err,
    rms_rel_err,
    run_model,
    same_function_tol,
)

from lora_bench.kernels import available
from lora_bench.kernels.segments import segment_params, stacked
from lora_bench.kernels.policy import Plan, PlanPolicy, graph_plan, record_plans, use_policy
from lora_bench.lora import LinearWithLoRA
from lora_bench.lora.kernel import LinearWithLoRAKernel, SideBySide, group_layers, group_qkv
from lora_bench.train.graphs import warm_up

DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
KER = (LinearWithLoRAKernel, LinearWithLoRAKernel)


def _attention_blocks(model):
    return [m for m in model.modules() if hasattr(m, "W_query")]


def _kinds(att):
    layers = (att.W_query, att.W_key, att.W_value)
    return ([m.linear.weight for m in layers], [m.linear.bias for m in layers],
            [m.lora.A for m in layers], [m.lora.B for m in layers])


# ----------------------------------------------------------------------------------- CPU


def test_grouping_keeps_names_and_values_and_lays_parameters_side_by_side():
    plain, grouped = model_pair("cpu", torch.float32, KER)
    before = {k: v.clone() for k, v in grouped.state_dict().items()}
    assert group_qkv(grouped) == len(_attention_blocks(grouped)) == 2
    after = grouped.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    for att in _attention_blocks(grouped):
        assert isinstance(att.qkv, SideBySide)
        for kind in _kinds(att):
            if kind[0] is not None:
                view = stacked(kind)
                assert view is not None and torch.equal(view, torch.stack([t.detach() for t in kind]))
    assert all(att.qkv is None for att in _attention_blocks(plain))


def _train_grouped_and_plain(*, perturb: float = 0.0):
    """Two SGD steps of an ungrouped float32 model, the grouped one and an ungrouped float64
    reference, from the same weights (``perturb``: a relative error put into one grouped weight, as
    a broken grouping would); yields (what, grouped, ungrouped, float64) at every comparison."""
    plain, grouped = model_pair("cpu", torch.float32, KER)
    ref, = model_pair("cpu", torch.float64, KER[:1])
    group_qkv(grouped)
    if perturb:
        with torch.no_grad():
            _attention_blocks(grouped)[0].W_value.lora.B.mul_(1 + perturb)
    models = (grouped, plain, ref)
    idx = torch.randint(0, 50257, (3, 11))
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in models]
    for step in range(2):
        (l1, g1), (l0, g0), (lr_, gr) = (run_model(m, idx) for m in models)
        assert g0.keys() == g1.keys() == gr.keys()
        yield f"logits, step {step}", l1, l0, lr_
        yield f"gradients, step {step}", g1, g0, gr
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    yield "parameters after two steps", *({n: p for n, p in m.named_parameters() if p.requires_grad} for m in models)


def test_grouped_model_trains_as_the_ungrouped_one_on_the_cpu():
    """On the CPU the layers run one by one (the torch plan): the same logits bit for bit on the
    same weights (the same operations on the same values), and gradients, later logits and the
    updated parameters as close to a float64 evaluation as the ungrouped model's (autograd sums
    the three layers' input gradients in another order; numerics.same_function_tol). SGD, since
    AdamW would magnify last-bit differences of near-zero gradients; after AdamW steps too the
    parameters still lie side by side, updated in place."""
    for what, got, want, ref in _train_grouped_and_plain():
        if what == "logits, step 0":
            assert torch.equal(got, want)
        assert_same_function(got, want, ref, what=what)
    plain, grouped = model_pair("cpu", torch.float32, KER)
    group_qkv(grouped)
    idx = torch.randint(0, 50257, (3, 11))
    adamw = torch.optim.AdamW([p for p in grouped.parameters() if p.requires_grad], lr=1e-2)
    before = {k: v.clone() for k, v in grouped.state_dict().items() if "lora" in k}
    run_model(grouped, idx)
    adamw.step()
    assert all(not torch.equal(grouped.state_dict()[k], v) for k, v in before.items() if k.endswith(".A"))
    for att in _attention_blocks(grouped):
        assert all(stacked(kind) is not None for kind in _kinds(att) if kind[0] is not None)


@pytest.mark.parametrize("perturb", [1e-4, 1e-5])
def test_the_grouping_bound_catches_a_grouped_weight_off_by_a_little(perturb):
    """The bound of the test above fails on a grouping that really changes the numbers: one
    adapter weight of the grouped model off by a relative 1e-4 or 1e-5 (some 100 units of float32's
    rounding) is caught in the first gradients already."""
    checks = _train_grouped_and_plain(perturb=perturb)
    next(checks)  # the logits: they move less than the gradients (a relative 1e-5 hides in their spread)
    what, got, want, ref = next(checks)
    assert what == "gradients, step 0"
    with pytest.raises(AssertionError, match="bound"):
        assert_same_function(got, want, ref, what=what)


def _three(cls=LinearWithLoRAKernel, *, alpha=(2.0, 2.0, 2.0), bias=(True, True, True), k=12, n=10, r=3):
    layers = []
    for a, b in zip(alpha, bias):
        m = cls(torch.nn.Linear(k, n, bias=b), r, a)
        m.linear.requires_grad_(False)
        layers.append(m)
    return layers


@pytest.mark.parametrize("case", ["alpha", "bias", "class", "trainable base", "shape", "one layer"])
def test_group_layers_refuses_layers_that_cannot_share_a_launch(case):
    layers = {
        "alpha": lambda: _three(alpha=(2.0, 2.0, 1.0)),
        "bias": lambda: _three(bias=(True, False, True)),
        "class": lambda: _three()[:2] + _three(LinearWithLoRA)[:1],
        "trainable base": lambda: _three(),
        "shape": lambda: _three()[:2] + _three(n=11)[:1],
        "one layer": lambda: _three()[:1],
    }[case]()
    if case == "trainable base":
        layers[1].linear.weight.requires_grad_(True)
    ptrs = [p.data_ptr() for m in layers for p in m.parameters()]
    assert group_layers(layers) is None
    assert [p.data_ptr() for m in layers for p in m.parameters()] == ptrs  # nothing was moved


def test_a_model_moved_after_grouping_runs_its_layers_one_by_one():
    """``Module.to`` gives each parameter its own storage: the layers no longer lie side by side,
    so the fused call is not taken (a forced fused plan included) and results stay right."""
    plain, grouped = model_pair("cpu", torch.float32, KER)
    group_qkv(grouped)
    plain, grouped = plain.double(), grouped.double()
    att = _attention_blocks(grouped)[0]
    assert segment_params([att.W_query, att.W_key, att.W_value]) is None
    idx = torch.randint(0, 50257, (2, 7))
    with use_policy(PlanPolicy(forced=Plan.FUSED)):
        (l0, g0), (l1, g1) = run_model(plain, idx), run_model(grouped, idx)
    assert rel_err(l1, l0) == 0.0 and all(rel_err(g1[k], g0[k]) <= 1e-12 for k in g0)


# ---------------------------------------------------------- CPU, under Triton's interpreter
# (M, k, n, r, S, dtype, bias, row splits of grad_ab): odd sizes (segments not tile multiples), ranks
# 1 to 40 (S·r up to 120, under the kernels' 128), fp16 standing in for 16-bit inputs (the
# interpreter gets bf16 dots wrong; bf16 is checked on the GPU)
SEGMENT_CASES = [
    (37, 40, 64, 3, 3, "fp32", True, 1),
    (50, 33, 96, 16, 3, "fp16", False, 2),
    (29, 64, 32, 40, 2, "fp32", True, 1),
    (37, 40, 24, 3, 3, "fp32", True, 1),
    (70, 33, 50, 16, 3, "fp32", False, 2),
    (20, 48, 32, 5, 2, "fp16", True, 1),
    (45, 21, 17, 1, 3, "fp32", True, 3),
    (33, 50, 19, 40, 3, "fp32", False, 1),
]


def _reference(x, W, A, B, b, g, s):
    """float64 y, h, grad_x, u, grad_A (S×k×r), grad_B (S×r×n) of S layers side by side."""
    S, _, r = A.shape
    n = B.shape[2]
    X, Wd, Ad, Bd, G = (t.double() for t in (x, W, A, B, g))
    Y = torch.cat([X @ Wd[i * n:(i + 1) * n].t() + s * (X @ Ad[i]) @ Bd[i] for i in range(S)], 1)
    if b is not None:
        Y = Y + b.double()
    H = torch.cat([X @ Ad[i] for i in range(S)], 1)
    U = torch.cat([G[:, i * n:(i + 1) * n] @ Bd[i].t() for i in range(S)], 1)
    GX = G @ Wd + s * sum(U[:, i * r:(i + 1) * r] @ Ad[i].t() for i in range(S))
    GA = torch.stack([s * X.t() @ U[:, i * r:(i + 1) * r] for i in range(S)])
    GB = torch.stack([s * H[:, i * r:(i + 1) * r].t() @ G[:, i * n:(i + 1) * n] for i in range(S)])
    return Y, H, GX, U, GA, GB


def _interp_main() -> None:
    """Run with TRITON_INTERPRET=1: every SEGMENT_CASES case through the three segment wrappers
    (outputs allocated NaN-filled), then a grouped tiny model against the ungrouped one under a
    forced fused plan; one JSON line each."""
    from lora_bench.kernels import lora_triton as lt

    lt.POISON_OUTPUTS = True
    for i, (M, k, n, r, S, dt, bias, split) in enumerate(SEGMENT_CASES):
        dtype, s = DTYPE[dt], 0.7
        x, g = fresh(M, k, device="cpu", dtype=dtype), fresh(M, S * n, device="cpu", dtype=dtype)
        W = fresh(S * n, k, device="cpu", dtype=dtype, scale=k ** -0.5)
        A, B = fresh(S, k, r, device="cpu", dtype=dtype, scale=k ** -0.5), fresh(S, r, n, device="cpu", dtype=dtype)
        b = fresh(S * n, device="cpu", dtype=dtype) if bias else None
        ref = _reference(x, W, A, B, b, g, s)
        for apart in (False, True):  # H and u formed in the GEMM's K loop, and before its launch
            y, h = lt.lora_fwd_segments(x, W, A, B, b, s, apart=apart)
            gx, u = lt.lora_bwd_x_segments(g, W, A, B, s, apart=apart)
            ga, gb = lt.lora_grad_ab(x, u, h, g, scale=s, grad_dtype=torch.float32, segments=S,
                                     config=lt.ABConfig(32, 16, 4, 1, split))
            errs = [rel_err(t, rt) for t, rt in zip((y, h, gx, u, ga, gb), ref)]
            shapes = [list(ga.shape), list(gb.shape)]
            print(json.dumps(dict(case=i, apart=apart, errs=errs, shapes=shapes)), flush=True)

    calls = []
    real = lt.lora_fwd_segments
    lt.lora_fwd_segments = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
    plain, grouped = model_pair("cpu", torch.float32, KER)
    ref, = model_pair("cpu", torch.float64, KER[:1])
    group_qkv(grouped)
    idx = torch.randint(0, 50257, (2, 9))
    l64, g64 = run_model(ref, idx)  # (the torch plan: the default on the CPU)
    with use_policy(PlanPolicy(forced=Plan.FUSED)), record_plans() as log:
        (l0, g0), (l1, g1) = run_model(plain, idx), run_model(grouped, idx)
    same_keys = g0.keys() == g1.keys() == g64.keys()
    print(json.dumps(dict(model=True, calls=len(calls), plans=sorted(p.value for p in set(log)),
                          logits=[rms_rel_err(l1, l64), same_function_tol(l0, l64)],
                          grads=[rms_rel_err(g1, g64), same_function_tol(g0, g64)] if same_keys else None,
                          same_keys=same_keys)), flush=True)

    # adapter_h=apart, its column threshold lowered to 1 so the tiny model's rank-4 layers (12 columns
    # side by side) take it: every GEMM launch reads H formed before it, forward and backward
    from lora_bench.kernels import policy as pol

    pol.H_APART_MIN_R = 1
    h_in = []
    real_mm = lt._mm
    lt._mm = lambda *a, **kw: (h_in.append(kw.get("h_in", False)), real_mm(*a, **kw))[1]
    with use_policy(PlanPolicy(forced=Plan.FUSED, adapter_h="apart")):
        (l2, g2), (l3, g3) = run_model(plain, idx), run_model(grouped, idx)
    print(json.dumps(dict(apart_model=True, launches=len(h_in), all_apart=all(h_in),
                          logits=[max(rms_rel_err(l2, l64), rms_rel_err(l3, l64)), same_function_tol(l0, l64)],
                          grads=[max(rms_rel_err(g2, g64), rms_rel_err(g3, g64)), same_function_tol(g0, g64)])),
          flush=True)

    # adapter_h=cublas, the same threshold: no fused GEMM launch at all, every layer and group on
    # torch's GEMMs (the cublas plan), the adapter gradients still from the Triton kernel
    h_in.clear()
    with use_policy(PlanPolicy(forced=Plan.FUSED, adapter_h="cublas")), record_plans() as log:
        (l4, g4), (l5, g5) = run_model(plain, idx), run_model(grouped, idx)
    print(json.dumps(dict(cublas_model=True, launches=len(h_in), plans=sorted(p.value for p in set(log)),
                          logits=[max(rms_rel_err(l4, l64), rms_rel_err(l5, l64)), same_function_tol(l0, l64)],
                          grads=[max(rms_rel_err(g4, g64), rms_rel_err(g5, g64)), same_function_tol(g0, g64)])),
          flush=True)


@pytest.fixture(scope="module")
def interp_runs():
    return interpreted_runs(__file__)


@pytest.mark.parametrize("apart", [False, True], ids=["h-in-gemm", "h-apart"])
@pytest.mark.parametrize("i", range(len(SEGMENT_CASES)))
def test_segment_kernels_under_triton_interpreter(interp_runs, i, apart):
    M, k, n, r, S, dt, bias, split = SEGMENT_CASES[i]
    run, = (x for x in interp_runs if x.get("case") == i and x["apart"] == apart)
    assert run["shapes"] == [[S, k, r], [S, r, n]]
    chains = lora_chains(rows=M, k=k, n=n, r=r, segments=S)
    for name, err in zip(("y", "h", "grad_x", "u", "grad_A", "grad_B"), run["errs"]):
        assert err <= kernel_tol(dt, chains[name]), (name, err, kernel_tol(dt, chains[name]))


def test_adapter_h_apart_runs_every_launch_with_h_formed_before_it_and_matches_float64(interp_runs):
    """The tiny model one by one and grouped under the fused plan with adapter_h=apart (threshold
    lowered): H and u formed before every GEMM launch, through the Functions' forward and backward,
    and the loss and gradients as close to float64 as the model with H in the GEMM."""
    run, = (x for x in interp_runs if x.get("apart_model"))
    assert run["launches"] >= 8 and run["all_apart"], run
    for what in ("logits", "grads"):
        err, bound = run[what]
        assert err <= bound, (what, err, bound)


def test_adapter_h_cublas_runs_every_layer_on_torch_gemms_and_matches_float64(interp_runs):
    """The tiny model one by one and grouped with adapter_h=cublas (threshold lowered): no fused GEMM
    launch, every call noted as the cublas plan, loss and gradients as close to float64 as the model
    with H in the GEMM."""
    run, = (x for x in interp_runs if x.get("cublas_model"))
    assert run["launches"] == 0 and run["plans"] == ["cublas"], run
    for what in ("logits", "grads"):
        err, bound = run[what]
        assert err <= bound, (what, err, bound)


TORCH_CASES = SEGMENT_CASES + [(41, 70, 53, 16, 3, "bf16", True, 1), (29, 45, 33, 64, 2, "bf16", False, 1)]


@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: f"{c[5]}-r{c[3]}-S{c[4]}")
def test_torch_segments_match_float64(case):
    """adapter_h=cublas's segment functions (torch's GEMMs) against float64 at odd sizes, ranks 1-64:
    y is rounded once more than in the fused launch (after the frozen product), so its bound counts
    one more rounding."""
    from lora_bench.kernels.segments import torch_bwd_x_segments, torch_fwd_segments

    M, k, n, r, S, dt, bias, _ = case
    dtype, s = DTYPE[dt], 0.7
    x, g = fresh(M, k, device="cpu", dtype=dtype), fresh(M, S * n, device="cpu", dtype=dtype)
    W = fresh(S * n, k, device="cpu", dtype=dtype, scale=k ** -0.5)
    A, B = fresh(S, k, r, device="cpu", dtype=dtype, scale=k ** -0.5), fresh(S, r, n, device="cpu", dtype=dtype)
    b = fresh(S * n, device="cpu", dtype=dtype) if bias else None
    Y, H, GX, U, _, _ = _reference(x, W, A, B, b, g, s)
    y, h = torch_fwd_segments(x, W, A, B, b, s)
    gx, u = torch_bwd_x_segments(g, W, A, B, s)
    chains = lora_chains(rows=M, k=k, n=n, r=r, segments=S)
    y_tol = kernel_tol(dt, chains["y"]) if dt == "fp32" else rounded_input_tol(DTYPE[dt], 4)
    assert rel_err(y, Y) <= y_tol
    for name, got, want in (("h", h, H), ("grad_x", gx, GX), ("u", u, U)):
        assert got.dtype == dtype and rel_err(got, want) <= kernel_tol(dt, chains[name]), name


def test_grouped_model_under_triton_interpreter_takes_one_launch_per_block(interp_runs):
    run, = (x for x in interp_runs if x.get("model"))
    assert run["calls"] == 2  # one fused forward per attention block of the tiny model
    assert run["plans"] == ["fused"] and run["same_keys"]
    for what in ("logits", "grads"):  # [error, bound]: as close to float64 as the ungrouped model
        err, bound = run[what]
        assert err <= bound, (what, err, bound)


# ----------------------------------------------------------------------------------- GPU


def _gpu_group(k, n, r, S, dtype, bias, alpha):
    layers = []
    for _ in range(S):
        m = LinearWithLoRAKernel(torch.nn.Linear(k, n, bias=bias), r, alpha).cuda()
        m.linear.requires_grad_(False)
        with torch.no_grad():
            m.linear.weight.copy_(fresh(n, k, device="cuda", dtype=torch.float32, scale=k ** -0.5))
            m.lora.B.copy_(fresh(r, n, device="cuda", dtype=torch.float32))
        layers.append(m)
    for m in layers:
        m.linear.to(dtype)
    return layers


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dt", ["fp32", "tf32", "bf16", "fp16", "autocast-bf16"])
@pytest.mark.parametrize("M,k,n,r,S,bias", [(960, 768, 768, 16, 3, True), (333, 100, 70, 1, 3, False),
                                            (129, 1600, 1600, 40, 3, True), (77, 64, 48, 5, 2, True)])
def test_gpu_segments_match_float64_and_replay_from_a_graph(dt, M, k, n, r, S, bias, monkeypatch):
    """Grouped layers under the fused plan (forced, so that exact fp32 takes it too; the capture-mode
    policy picks it for the 16-bit and tf32 rows anyway): eager once, then captured in a CUDA graph
    and replayed on fresh inputs; every output and gradient (x, each A, each B) against float64 of
    the same math, outputs NaN-filled before each replay."""
    from lora_bench.kernels import lora_triton as lt

    monkeypatch.setattr(lt, "POISON_OUTPUTS", True)
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dt == "tf32" else "highest")
    try:
        amp = dt == "autocast-bf16"
        base = torch.bfloat16 if amp else DTYPE[dt]
        layers = _gpu_group(k, n, r, S, base, bias, 2.0)
        if not amp:
            for m in layers:
                m.lora.to(base)
        caller = group_layers(layers)
        assert caller is not None
        adapters = [p for m in layers for p in (m.lora.A, m.lora.B)]
        x = fresh(M, k, device="cuda", dtype=torch.float32 if amp else base).requires_grad_(True)
        g = fresh(M, n, device="cuda", dtype=base)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                outs = caller(x)
            loss = sum((o.float() * g.float()).sum() for o in outs)
            return (*outs, *torch.autograd.grad(loss, [x, *adapters]))

        def check(got):
            got = [t.detach() for t in got]  # (the outputs are views that the replays refill in place)
            ws = torch.cat([m.linear.weight for m in layers])
            A = torch.stack([m.lora.A.detach() for m in layers])
            B = torch.stack([m.lora.B.detach() for m in layers])
            b = torch.cat([m.linear.bias for m in layers]) if bias else None
            gg = g.repeat(1, S)
            Y, _, GX, _, GA, GB = _reference(x.detach(), ws, A, B, b, gg, 2.0)
            chains = lora_chains(rows=M, k=k, n=n, r=r, segments=S)
            tol = {name: kernel_tol("bf16" if amp else dt, c, autocast=amp) for name, c in chains.items()}
            y = torch.cat(got[:S], 1)
            assert rel_err(y, Y) <= tol["y"] and rel_err(got[S], GX) <= tol["grad_x"]
            for i in range(S):
                assert got[S + 1 + 2 * i].dtype == layers[i].lora.A.dtype
                assert rel_err(got[S + 1 + 2 * i], GA[i]) <= tol["grad_A"]
                assert rel_err(got[S + 2 + 2 * i], GB[i]) <= tol["grad_B"]

        with use_policy(PlanPolicy(forced=Plan.FUSED)), graph_plan(), record_plans() as log:
            check(step())
            warm_up(step, 1)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = step()
        assert set(log) == {Plan.FUSED}
        for _ in range(2):
            with torch.no_grad():
                for t in (x, g, *adapters):
                    t.copy_(fresh(*t.shape, device="cuda", dtype=t.dtype, scale=float(t.float().std()) or 1.0))
                for t in outs:
                    t.detach().fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check(outs)
    finally:
        torch.set_float32_matmul_precision(prev)


@pytest.mark.gpu
@gpu
def test_gpu_grouped_model_matches_ungrouped_under_the_capture_plan():
    """A tiny model, grouped and not, under bf16 autocast and the capture-mode policy: the grouped
    one takes one fused call per block and lands as close to a float64 reference as the ungrouped
    (numerics.same_function_tol at bf16's unit roundoff)."""
    assert available.HAVE_TRITON
    plain, grouped = model_pair("cuda", torch.float32, KER)
    ref, = model_pair("cuda", torch.float64, (LinearWithLoRA,))
    group_qkv(grouped)
    idx = torch.randint(0, 50257, (3, 20), device="cuda")
    (lr, gr) = run_model(ref, idx)
    with graph_plan(), torch.autocast("cuda", dtype=torch.bfloat16):
        (l0, g0), (l1, g1) = run_model(plain, idx), run_model(grouped, idx)
    assert g0.keys() == g1.keys() == gr.keys()
    assert_same_function(l1, l0, lr, torch.bfloat16, what="logits")
    assert_same_function(g1, g0, gr, torch.bfloat16, what="gradients")
