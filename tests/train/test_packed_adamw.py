"""PackedAdamW (lora_bench.train.packed_adamw): a pack's stacked parameters, each point with its own
learning rate and weight decay, updated as each point's own ``torch.optim.AdamW`` would update it.

- On the CPU its torch ops are AdamW's single-tensor update on each point's slice: the same
  operations on the same values, so every point's parameters and moments equal a per-point
  ``torch.optim.AdamW(foreach=False)``'s bit for bit, step after step.
- On CUDA (the Triton kernel), eagerly and replayed from a CUDA graph: each point's update
  (parameter change), first and second moments after several steps of fresh random gradients
  against a float64 AdamW from the same start, within another rounding order's distance of the
  fused ``torch.optim.AdamW``'s own error (``numerics.assert_same_function``).
"""

from __future__ import annotations

import pytest
import torch
from numerics import assert_same_function, fresh

from lora_bench.train import packed_adamw
from lora_bench.train.packed_adamw import PackedAdamW, bias_corrections

LRS = [1e-3, 5e-4, 2e-3, 1e-4, 3e-3]
WDS = [0.1, 0.0, 0.5, 0.01, 0.1]
SHAPES = [(5, 33, 17), (5, 1027), (5, 3)]  # odd sizes: partly filled blocks
STEPS = 6


def _start(device):
    return [fresh(*s, device=device, dtype=torch.float32) for s in SHAPES]


def _grads(device):
    return [[fresh(*s, device=device, dtype=torch.float32, scale=0.1) for s in SHAPES] for _ in range(STEPS)]


def _per_point_adamw(start, grads, **options):
    """Each point trained alone by torch.optim.AdamW: its parameters and moments after the steps."""
    out = []
    for p, (lr, wd) in enumerate(zip(LRS, WDS)):
        params = [torch.nn.Parameter(t[p].clone()) for t in start]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, **options)
        for step in grads:
            for t, g in zip(params, step):
                t.grad = g[p].clone()
            opt.step()
        out.append({f"{k}{i}": v for i, t in enumerate(params)
                    for k, v in (("p", t.detach()), ("m", opt.state[t]["exp_avg"]), ("v", opt.state[t]["exp_avg_sq"]))})
    return out


def _by_point(params, opt) -> list[dict]:
    """Each point's parameters and moments, keyed by kind (p: parameter, m and v: the moments) and tensor index."""
    return [{f"{k}{i}": v[p] for i, t in enumerate(params)
             for k, v in (("p", t.detach()), ("m", opt.state[t]["exp_avg"]), ("v", opt.state[t]["exp_avg_sq"]))}
            for p in range(len(LRS))]


def _packed(start, grads, *, graph: bool = False):
    params = [torch.nn.Parameter(t.clone()) for t in start]
    opt = PackedAdamW(params, lrs=LRS, weight_decays=WDS, capturable=graph)
    if not graph:
        for step in grads:
            for t, g in zip(params, step):
                t.grad = g.clone()
            opt.step()
    else:
        from lora_bench.train.graphs import warm_up

        for t in params:
            t.grad = torch.zeros_like(t)
        static = [t.grad for t in params]
        snap = [t.detach().clone() for t in params]
        warm_up(opt.step, 1)  # compiles the kernel, makes the state ...
        with torch.no_grad():  # ... undone: back to the start, no step taken
            for t, v in zip(params, snap):
                t.copy_(v)
            for st in opt.state.values():
                for v in st.values():
                    v.zero_()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            opt.step()
        for step in grads:
            for buf, new in zip(static, step):
                buf.copy_(new)
            g.replay()
        torch.cuda.synchronize()
    return _by_point(params, opt)


def _float64_adamw(start, grads):
    """AdamW from its definition in float64, point by point (betas 0.9, 0.999, eps 1e-8)."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    out = []
    for p, (lr, wd) in enumerate(zip(LRS, WDS)):
        res = {}
        for i, t in enumerate(start):
            x = t[p].double().clone()
            m, v = torch.zeros_like(x), torch.zeros_like(x)
            for k, step in enumerate(grads, start=1):
                g = step[i][p].double()
                x = x - lr * wd * x
                m = b1 * m + (1 - b1) * g
                v = b2 * v + (1 - b2) * g * g
                x = x - lr / (1 - b1 ** k) * m / (v.sqrt() / (1 - b2 ** k) ** 0.5 + eps)
            res.update({f"p{i}": x, f"m{i}": m, f"v{i}": v})
        out.append(res)
    return out


def _updates(results, start):
    """Parameters as their change from the start (what the learning rate scales), moments as they are."""
    out = []
    for p, res in enumerate(results):
        out.append({k: (v.double() - start[int(k[1:])][p].double() if k[0] == "p" else v.double())
                    for k, v in res.items()})
    return out


def test_packed_adamw_is_each_points_adamw_bit_for_bit_on_the_cpu():
    start, grads = _start("cpu"), _grads("cpu")
    got, want = _packed(start, grads), _per_point_adamw(start, grads, foreach=False)
    for p, (mine, theirs) in enumerate(zip(got, want)):
        for name in theirs:
            assert torch.equal(mine[name], theirs[name]), f"point {p}, {name}"


def test_a_group_with_its_own_rates_is_each_points_adamw_at_those_rates_bit_for_bit_on_the_cpu():
    """LoRA+'s group (every B at each point's rate times its ratio) beside the group at the points'
    rates: each point's tensors as torch.optim.AdamW with those two groups updates them alone."""
    start, grads = _start("cpu"), _grads("cpu")
    ratios = [16.0, 1.0, 4.0, 2.0, 8.0]
    b_lrs = [lr * q for lr, q in zip(LRS, ratios)]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    opt = PackedAdamW([{"params": params[:1]}, {"params": params[1:], "lrs": b_lrs}], lrs=LRS, weight_decays=WDS)
    for step in grads:
        for t, g in zip(params, step):
            t.grad = g.clone()
        opt.step()
    got = _by_point(params, opt)
    for p, (lr, b_lr, wd) in enumerate(zip(LRS, b_lrs, WDS)):
        mine = [torch.nn.Parameter(t[p].clone()) for t in start]
        ref = torch.optim.AdamW([{"params": mine[:1], "lr": lr}, {"params": mine[1:], "lr": b_lr}], lr=lr,
                                weight_decay=wd, foreach=False)
        for step in grads:
            for t, g in zip(mine, step):
                t.grad = g[p].clone()
            ref.step()
        for i, t in enumerate(mine):
            assert torch.equal(got[p][f"p{i}"], t.detach()), f"point {p}, tensor {i}"
    with pytest.raises(ValueError, match="a group's 2 learning rates for 5 points"):
        PackedAdamW([{"params": params[:1], "lrs": [1e-3, 1e-3]}], lrs=LRS, weight_decays=WDS)


def test_packed_adamw_refuses_a_tensor_without_its_points_on_the_first_axis():
    with pytest.raises(ValueError, match=r"holds its 5 points along its first axis, got shape \(4, 3\)"):
        PackedAdamW([torch.nn.Parameter(torch.zeros(4, 3))], lrs=LRS, weight_decays=WDS)
    with pytest.raises(ValueError, match="2 weight decays for 5 learning rates"):
        PackedAdamW([torch.nn.Parameter(torch.zeros(5, 3))], lrs=LRS, weight_decays=WDS[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_packed_adamw_kernel_against_float64_on_cuda(graph):
    assert packed_adamw._kernel() is not None, "the Triton update does not load on this CUDA machine"
    start, grads = _start("cuda"), _grads("cuda")
    got = _updates(_packed(start, grads, graph=graph), start)
    want = _updates(_per_point_adamw(start, grads, fused=True), start)
    ref = _updates(_float64_adamw(start, grads), start)
    for p in range(len(LRS)):
        assert_same_function(got[p], want[p], ref[p], what=f"point {p} ({'graph' if graph else 'eager'})")


def test_the_torch_update_with_the_step_count_as_a_tensor_is_the_one_with_a_number():
    """The fallback a CUDA device without Triton takes (bias corrections as tensors of the device's
    step count, no host synchronisation), run here on the CPU against the Python-number path it
    replaces: the same update but for the rounding of the bias corrections in float32, within
    another rounding order's distance of float64 AdamW."""
    start, grads = _start("cpu"), _grads("cpu")
    results = {}
    for host in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = PackedAdamW(params, lrs=LRS, weight_decays=WDS)
        step = torch.zeros(())
        for gs in grads:
            step += 1
            for t, g in zip(params, gs):
                state = opt.state[t]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(t), torch.zeros_like(t)
                with torch.no_grad():
                    opt._torch_update(t, g, state["exp_avg"], state["exp_avg_sq"], LRS,
                                      bias_corrections(step, 0.9, 0.999, host_step=host), 0.9, 0.999, 1e-8)
        results[host] = _by_point(params, opt)
    got, want = _updates(results[False], start), _updates(results[True], start)
    ref = _updates(_float64_adamw(start, grads), start)
    for p in range(len(LRS)):
        assert_same_function(got[p], want[p], ref[p], what=f"point {p}")
