"""Deferred adapter gradients (``adapter_grads="deferred"``, lora_bench.kernels.deferred): the
gradients of A and B equal the inline ones (same kernels, so bit-equal on the CPU) and float64's
within the kernels' bound, over single layers and a tiny GPT-2 trained several steps with gradient
accumulation; one join per backward pass; inline where deferring would be wrong (a process group,
gradient hooks, torch.autograd.grad, backward(inputs=...), create_graph), with the reason noted.

CPU tests run the torch plan, and the fused plan (segments included) under Triton's interpreter;
GPU tests (``-m gpu``) compare eager and graph-replayed steps.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import torch.nn as nn
from numerics import fresh, interpreted_runs, kernel_tol, layer_operands, lora_chains, model_pair, rel_err

from lora_bench.kernels import deferred
from lora_bench.kernels.autograd import lora_linear
from lora_bench.kernels.policy import (KernelPlanError, Plan, PlanPolicy, default_policy, policy_for, record_plans,
                                       use_policy)
from lora_bench.lora.kernel import LinearWithLoRAKernel, group_qkv

KER = (LinearWithLoRAKernel, LinearWithLoRAKernel)
INLINE, DEFERRED = PlanPolicy(), PlanPolicy(adapter_grads="deferred")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _counts() -> dict[str, int]:
    return dict(deferred.COUNTS)


def _since(before: dict[str, int]) -> dict[str, int]:
    return {k: deferred.COUNTS[k] - before[k] for k in before}


def _layer_steps(policy, operands, gs, *, alpha, need_x=True):
    """Backward of the layer for each output gradient in ``gs`` (accumulating), under ``policy``;
    returns the leaves' gradients and the plan log."""
    x, w, b, a, bm = (t.detach().clone() if t is not None else None for t in operands)
    leaves = [a, bm] + ([x] if need_x else [])
    for t in leaves:
        t.requires_grad_(True)
    with use_policy(policy), record_plans() as log:
        for g in gs:
            lora_linear(x, w, b, a, bm, alpha).backward(g)
    return [t.grad for t in leaves], log


LAYER_CASES = [  # odd sizes, ranks 1..64, 2-D/3-D, no bias, the first layer (input without gradient)
    dict(batch=(37,), k=70, n=53, r=1, alpha=0.5),
    dict(batch=(3, 41), k=96, n=130, r=16, alpha=2.0, bias=False),
    dict(batch=(2, 5, 7), k=45, n=33, r=33, alpha=2.0, need_x=False),
    dict(batch=(150,), k=128, n=192, r=64, alpha=8.0),
]


@pytest.mark.parametrize("case", LAYER_CASES)
@pytest.mark.parametrize("steps", [1, 3])
def test_deferred_layer_gradients_equal_inline_and_float64(case, steps):
    case = dict(case)
    batch, k, n, r, alpha = case.pop("batch"), case.pop("k"), case.pop("n"), case.pop("r"), case.pop("alpha")
    need_x = case.pop("need_x", True)
    ops = layer_operands(batch=batch, k=k, n=n, r=r, device="cpu", dtype=torch.float32, **case)
    gs = [fresh(*batch, n, device="cpu", dtype=torch.float32) for _ in range(steps)]
    before = _counts()
    inline, log_i = _layer_steps(INLINE, ops, gs, alpha=alpha, need_x=need_x)
    assert _since(before) == {"deferred": 0, "joins": 0}
    got, log_d = _layer_steps(DEFERRED, ops, gs, alpha=alpha, need_x=need_x)
    assert _since(before) == {"deferred": steps, "joins": steps}
    assert log_i.adapter_grads == {"inline"} and log_d.adapter_grads == {"deferred"}
    for name, t, want in zip(("grad_A", "grad_B", "grad_x"), got, inline):
        assert t is not None and t.dtype is torch.float32 and torch.equal(t, want), name

    # float64: the summed gradients of all steps
    x, w, b, a, bm = (t.double().requires_grad_(True) if t is not None else None for t in ops)
    for g in gs:
        y = x @ w.t() + alpha * (x @ a) @ bm + (b if b is not None else 0)
        y.backward(g.double())
    chains = lora_chains(rows=math.prod(batch) * steps, k=k, n=n, r=r)
    for name, t, ref in zip(("grad_A", "grad_B", "grad_x"), got, (a.grad, bm.grad, x.grad)):
        assert rel_err(t, ref) <= kernel_tol("fp32", chains[name]), (name, rel_err(t, ref))


def test_a_layer_called_twice_in_one_pass_gets_both_gradients():
    """The same A and B deferred twice in one backward: the second adds to the first, at the join."""
    ops = layer_operands(batch=(9,), k=20, n=12, r=4, device="cpu", dtype=torch.float32)
    x2 = fresh(9, 20, device="cpu", dtype=torch.float32)
    results = []
    for policy in (INLINE, DEFERRED):
        x, w, b, a, bm = (t.detach().clone() for t in ops)
        a.requires_grad_(True)
        bm.requires_grad_(True)
        a.grad = torch.ones_like(a)  # an earlier micro-step's gradient: added to
        with use_policy(policy):
            (lora_linear(x, w, b, a, bm, 1.5).square().sum() + lora_linear(x2, w, b, a, bm, 1.5).sum()).backward()
        results.append((a.grad, bm.grad))
    for want, got in zip(*results):
        assert torch.equal(got, want)


def _train(model, policy, batches, *, accumulation: int, lr: float = 1e-2):
    """A few optimizer steps over ``batches`` (``accumulation`` micro-batches each) under ``policy``;
    returns the adapters' gradients after every backward and the parameters at the end."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    seen = []
    with use_policy(policy), record_plans() as log:
        for i, idx in enumerate(batches):
            loss = model(idx)[:, -1, :].float().logsumexp(-1).mean() / accumulation
            loss.backward()
            seen.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
            if (i + 1) % accumulation == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return seen, {n: p.detach().clone() for n, p in model.named_parameters()}, log


def test_tiny_gpt2_trains_the_same_with_deferred_adapter_gradients():
    inline_model, deferred_model = model_pair("cpu", torch.float32, KER)
    layers = sum(isinstance(m, LinearWithLoRAKernel) for m in inline_model.modules())
    batches = [torch.randint(0, 50257, (2, 9)) for _ in range(6)]
    before = _counts()
    grads_i, params_i, _ = _train(inline_model, INLINE, batches, accumulation=3)
    assert _since(before) == {"deferred": 0, "joins": 0}
    grads_d, params_d, log = _train(deferred_model, DEFERRED, batches, accumulation=3)
    assert _since(before) == {"deferred": layers * len(batches), "joins": len(batches)}  # one join per backward
    assert log.adapter_grads == {"deferred"} and log.backend() == "torch"
    lora = [n for n in grads_i[0] if ".lora." in n]
    assert len(lora) == 2 * layers
    for step, (gi, gd) in enumerate(zip(grads_i, grads_d)):
        assert gi.keys() == gd.keys()
        for n in gi:
            assert torch.equal(gi[n], gd[n]), (step, n)
    for n in params_i:
        assert torch.equal(params_i[n], params_d[n]), n


def _a_layer():
    torch.manual_seed(3)
    m = LinearWithLoRAKernel(nn.Linear(10, 6), 3, 2.0)
    m.linear.requires_grad_(False)
    with torch.no_grad():
        m.lora.B.normal_()
    return m


def test_a_parameter_with_a_gradient_hook_runs_inline_and_the_hook_fires():
    m, x = _a_layer(), torch.randn(4, 10)
    fired = []
    m.lora.A.register_hook(lambda g: fired.append(g.clone()))
    before = _counts()
    with use_policy(DEFERRED), record_plans() as log:
        m(x).sum().backward()
    assert _since(before)["deferred"] == 0 and len(fired) == 1 and torch.equal(fired[0], m.lora.A.grad)
    assert log.adapter_grads == {"inline: a parameter has gradient hooks"}


def test_a_process_group_makes_every_layer_run_inline(tmp_path):
    import torch.distributed as dist

    m, x = _a_layer(), torch.randn(4, 10)
    ref = _a_layer()
    ref(x).sum().backward()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        before = _counts()
        with use_policy(DEFERRED), record_plans() as log:
            m(x).sum().backward()
    finally:
        dist.destroy_process_group()
    assert _since(before)["deferred"] == 0
    assert [w.split(" (")[0] for w in log.adapter_grads] == ["inline: a process group is initialized"]
    assert torch.equal(m.lora.A.grad, ref.lora.A.grad) and torch.equal(m.lora.B.grad, ref.lora.B.grad)


def _other_backwards(policy, x):
    """autograd.grad of A and B, backward(inputs=[x]), a create_graph gradient of A and the
    backward of that gradient, under ``policy``; returns what each gave and the deferrals of each."""
    m = _a_layer()
    out, counts = [], []
    with use_policy(policy):
        before = _counts()
        out += torch.autograd.grad(m(x).square().sum(), [m.lora.A, m.lora.B])
        counts.append(_since(before)["deferred"])
        xi = x.detach().clone().requires_grad_(True)
        before = _counts()
        m(xi).square().sum().backward(inputs=[xi])  # A and B not asked for: left alone
        counts.append(_since(before)["deferred"])
        out += [xi.grad, m.lora.A.grad, m.lora.B.grad]
        before = _counts()
        gA, = torch.autograd.grad(m(x).square().sum(), [m.lora.A], create_graph=True)
        counts.append(_since(before)["deferred"])
        out.append(gA.detach())
        gA.sum().backward()  # differentiable: reaches A and B through the layer's forward
        out += [m.lora.A.grad, m.lora.B.grad]
    return out, counts


def test_autograd_grad_inputs_and_create_graph_run_inline():
    x = torch.randn(4, 10)
    want, counts_i = _other_backwards(INLINE, x)
    got, counts_d = _other_backwards(DEFERRED, x)
    assert counts_i == counts_d == [0, 0, 0]
    assert got[3] is None and got[4] is None and got[-1].abs().sum() > 0
    for i, (t, w) in enumerate(zip(got, want)):
        assert (t is None and w is None) or torch.equal(t, w), i


def test_cpp_op_layers_run_inline_and_say_so():
    import warnings

    from lora_bench.kernels import lora_cpp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if lora_cpp.module() is None:
            pytest.skip(f"the C++ op cannot be built here: {lora_cpp.build_error()}")
    m, x = _a_layer(), torch.randn(4, 10)
    before = _counts()
    with use_policy(PlanPolicy(forced=Plan.CPP, adapter_grads="deferred")), record_plans() as log:
        m(x).sum().backward()
    assert log.backend() == "cpp" and log.adapter_grads == {deferred.CPP_OP}
    assert _since(before)["deferred"] == 0 and m.lora.A.grad is not None and m.lora.B.grad is not None


def test_policy_names_and_the_default():
    assert PlanPolicy().adapter_grads == "inline" and PlanPolicy(adapter_grads=" Deferred ").adapter_grads == "deferred"
    with pytest.raises(KernelPlanError, match="expected one of inline, deferred"):
        PlanPolicy(adapter_grads="sideways")
    assert policy_for("auto", INLINE, adapter_grads="deferred") == DEFERRED
    assert (policy_for("fused", INLINE, adapter_grads="deferred")
            == PlanPolicy(forced=Plan.FUSED, adapter_grads="deferred"))
    assert policy_for("auto", DEFERRED) == DEFERRED
    assert default_policy().adapter_grads == "inline" and policy_for("auto").adapter_grads == "inline"


# ---------------------------------------------------------- CPU, under Triton's interpreter
# the fused plan's grad_ab (one layer) and the segment kernels' (a grouped tiny model), deferred and
# inline; fp32 (the interpreter gets bf16 dots wrong; bf16 is checked on the GPU)
FUSED_CASES = [(37, 40, 24, 3), (20, 33, 17, 16), (45, 64, 50, 40)]  # rows, k, n, r


def _interp_main() -> None:
    """Run with TRITON_INTERPRET=1: one JSON line per FUSED_CASES case, then one for the model."""
    policy = {m: PlanPolicy(forced=Plan.FUSED, adapter_grads=m) for m in ("inline", "deferred")}
    for i, (rows, k, n, r) in enumerate(FUSED_CASES):
        ops = layer_operands(batch=(rows,), k=k, n=n, r=r, device="cpu", dtype=torch.float32)
        gs = [fresh(rows, n, device="cpu", dtype=torch.float32) for _ in range(2)]
        before = _counts()
        (gi, log_i), (gd, log_d) = (_layer_steps(policy[m], ops, gs, alpha=1.5) for m in ("inline", "deferred"))
        x, w, b, a, bm = (t.double().requires_grad_(True) for t in ops)
        for g in gs:
            (x @ w.t() + 1.5 * (x @ a) @ bm + b).backward(g.double())
        print(json.dumps(dict(case=i, equal=[torch.equal(p, q) for p, q in zip(gi, gd)],
                              errs=[rel_err(t, ref) for t, ref in zip(gd, (a.grad, bm.grad, x.grad))],
                              plans=[log_i.backend(), log_d.backend()], counts=_since(before))), flush=True)

    inline_model, deferred_model = model_pair("cpu", torch.float32, KER)
    grouped = [group_qkv(inline_model), group_qkv(deferred_model)]
    batches = [torch.randint(0, 50257, (2, 9)) for _ in range(4)]
    before = _counts()
    grads_i, params_i, _ = _train(inline_model, policy["inline"], batches, accumulation=2)
    grads_d, params_d, log = _train(deferred_model, policy["deferred"], batches, accumulation=2)
    equal = all(torch.equal(gi[n], gd[n]) for gi, gd in zip(grads_i, grads_d) for n in gi)
    equal = equal and all(torch.equal(params_i[n], params_d[n]) for n in params_i)
    print(json.dumps(dict(model=True, grouped=grouped, equal=equal, plans=log.backend(),
                          adapter_grads=sorted(log.adapter_grads), counts=_since(before))), flush=True)


@pytest.fixture(scope="module")
def interp_runs():
    return interpreted_runs(__file__)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(FUSED_CASES)))
def test_fused_layer_deferred_under_triton_interpreter(interp_runs, i):
    rows, k, n, r = FUSED_CASES[i]
    run, = (x for x in interp_runs if x.get("case") == i)
    assert run["plans"] == ["fused", "fused"] and run["counts"] == {"deferred": 2, "joins": 2}
    assert run["equal"] == [True, True, True]
    chains = lora_chains(rows=2 * rows, k=k, n=n, r=r)
    for name, err in zip(("grad_A", "grad_B", "grad_x"), run["errs"]):
        assert err <= kernel_tol("fp32", chains[name]), (name, err)


@pytest.mark.slow
def test_grouped_model_deferred_under_triton_interpreter(interp_runs):
    run, = (x for x in interp_runs if x.get("model"))
    assert run["grouped"] == [2, 2] and run["plans"] == "fused" and run["adapter_grads"] == ["deferred"]
    assert run["equal"]
    # per backward: one deferral per attention block's three layers, one per other layer, one join
    blocks, per_block = 2, 1 + 3
    assert run["counts"] == {"deferred": 4 * blocks * per_block + 4 * 1, "joins": 4}


# ----------------------------------------------------------------------------------- GPU


def _gpu_model():
    from lora_bench.lora import inject_lora
    from lora_bench.model.gpt2 import build_random_model, gpt_config

    torch.manual_seed(11)
    m = build_random_model(gpt_config("tiny", context_length=64))
    m.requires_grad_(False)
    m.out_head = nn.Linear(m.cfg.emb_dim, 2)
    inject_lora(m, cls=LinearWithLoRAKernel, rank=16, alpha=2.0)
    for name, p in m.named_parameters():
        if name.endswith("lora.B"):
            p.data.normal_(0, 0.1)
    m = m.cuda()
    group_qkv(m)
    return m


def _gpu_step(model, idx):
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        loss = model(idx)[:, -1, :].float().logsumexp(-1).mean()
    return loss


def _gpu_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _close(got: dict, want: dict, rows: int) -> None:
    """The same kernels on the same inputs, but not bit-equal: grad_ab adds its row splits' fp32
    partial sums atomically, in no fixed order, and so may other backward kernels upstream (whose
    bf16 outputs then round differently). Each of two evaluations lies within the bf16-autocast
    kernel bound of the exact value, so they lie within twice it of each other; a lost, doubled or
    unjoined gradient is off by O(1)."""
    assert got.keys() == want.keys()
    for n in want:
        assert rel_err(got[n], want[n]) <= 2 * kernel_tol("bf16", rows, autocast=True), n


@pytest.mark.gpu
@gpu
def test_gpu_deferred_equals_inline_eager_and_replayed_from_a_graph():
    from lora_bench.train.graphs import warm_up

    idx, idx2 = (torch.randint(0, 50257, (8, 64), device="cuda") for _ in range(2))  # the tiny model's context
    results = {}
    for mode in ("inline", "deferred"):
        model = _gpu_model()
        policy = PlanPolicy(forced=Plan.FUSED, adapter_grads=mode)
        with use_policy(policy):
            _gpu_step(model, idx).backward()  # eager, two micro-steps accumulated
            _gpu_step(model, idx.flip(0)).backward()
            torch.cuda.synchronize()
            eager = _gpu_grads(model)

            def step():
                model.zero_grad(set_to_none=True)
                _gpu_step(model, static).backward()

            static = idx.clone()
            warm_up(step, 3)
            before = _counts()
            graph = torch.cuda.CUDAGraph()
            model.zero_grad(set_to_none=True)
            with torch.cuda.graph(graph):
                _gpu_step(model, static).backward()
            captured = _since(before)
            static.copy_(idx2)
            graph.replay()
            torch.cuda.synchronize()
            replayed = _gpu_grads(model)
            # eager again, after the replay, on the same input: what the graph must have computed
            for p in model.parameters():
                p.grad = None
            _gpu_step(model, static).backward()
            torch.cuda.synchronize()
            results[mode] = (eager, replayed, _gpu_grads(model), captured)
    e_i, r_i, a_i, c_i = results["inline"]
    e_d, r_d, a_d, c_d = results["deferred"]
    assert c_i == {"deferred": 0, "joins": 0}
    assert c_d["joins"] == 1 and c_d["deferred"] > 0  # one join in the captured backward
    rows = 2 * 8 * 64
    _close(e_d, e_i, rows)
    _close(a_i, r_i, rows)  # replayed = eager on the replay's input ...
    _close(a_d, r_d, rows)  # ... deferred too: the replayed graph joined its side stream
    _close(r_d, r_i, rows)
    assert any(".lora." in n for n in r_d)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.slow
def test_a_run_with_the_deferred_setting_defers_and_trains_as_inline(tiny_cfg, tmp_path):
    """The run setting reaches the layers: every lora-kernel backward of a tiny CPU run defers, one
    join per backward, and the run's step losses are the inline run's (the same adapter gradients)."""
    import csv

    from rich.console import Console

    from lora_bench.train.run import execute_run

    cfg = tiny_cfg.replace(trainable_layers="lora-kernel", lora_rank=4, eval_freq=0)
    losses = {}
    for where in ("inline", "deferred"):
        before = _counts()
        execute_run(cfg.replace(adapter_grads=where), results_dir=tmp_path, run_id=where, console=Console(quiet=True),
                    progress=False, cache_dir=tmp_path / "cache")
        got = _since(before)
        if where == "deferred":
            assert got["joins"] == cfg.max_steps and got["deferred"] > 0  # one join per backward pass
        else:
            assert got == {"deferred": 0, "joins": 0}
        with open(tmp_path / where / "steps.csv", newline="") as f:
            losses[where] = [row["loss"] for row in csv.DictReader(f)]
    assert len(losses["inline"]) == cfg.max_steps and losses["inline"] == losses["deferred"]


def test_adapter_grads_other_than_inline_needs_lora_kernel():
    from lora_bench.config import TrainConfig

    problems = TrainConfig(trainable_layers="lora", adapter_grads="deferred").problems()
    assert any("adapter_grads" in p and "lora-kernel" in p for p in map(str, problems)), problems
