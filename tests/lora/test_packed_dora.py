"""DoRA's packed layer (lora_bench.lora.packed_layer.PackedDoRALinear) against each point's solo
DoRA layer (lora_bench.lora.layer.LinearWithDoRA) evaluated in float64, on fresh random inputs and
values (B nonzero, so each norm differs from W's row norms): the output and the gradients of the
input and of every point's A, B and magnitude m (and of its own head's weight and bias, where each
point has its own base), with the exact and the detached norm, mixed ranks from 1 to 64 in one pack
and odd row counts.

Tolerance: ``dot_tol`` in float32 over a DoRA layer's longest chain of summed terms
(``numerics.dora_chain``, at the pack's largest rank); the padding's slices of the stacked
gradients must be exactly zero.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from numerics import dora_chain, dot_tol, fresh, rel_err

from lora_bench.lora.layer import LinearWithDoRA, LoRALayer
from lora_bench.lora.packed_layer import PackedDoRALinear

K, N_OUT = 96, 80
MIXED = ((1, 2.0), (64, 16.0), (8, 1.5), (33, 4.0))


def _solo_layers(points, *, shared: bool, detach: bool) -> list[LinearWithDoRA]:
    """One float64 solo DoRA layer per point, of fresh values: a shared frozen base, or a trainable
    one per point; A and B random, m random around W's row norms."""
    base = nn.Linear(K, N_OUT).double().requires_grad_(False)
    with torch.no_grad():
        base.weight.copy_(fresh(N_OUT, K, device="cpu", dtype=torch.float64, scale=K ** -0.5))
        base.bias.copy_(fresh(N_OUT, device="cpu", dtype=torch.float64))
    layers = []
    for r, alpha in points:
        linear = base if shared else nn.Linear(K, N_OUT).double()
        layer = LinearWithDoRA(linear, r, alpha, detach_norm=detach).double()
        with torch.no_grad():
            layer.lora.A.copy_(fresh(K, r, device="cpu", dtype=torch.float64, scale=K ** -0.5))
            layer.lora.B.copy_(fresh(r, N_OUT, device="cpu", dtype=torch.float64, scale=r ** -0.5))
            layer.m.copy_(layer.m * (1 + 0.1 * fresh(N_OUT, device="cpu", dtype=torch.float64)))
        layers.append(layer)
    return layers


def _packed(solo: list[LinearWithDoRA], *, shared: bool, detach: bool) -> PackedDoRALinear:
    """The float32 pack of the solo layers' values."""
    adapters = []
    for layer in solo:
        a = LoRALayer(K, N_OUT, layer.lora.A.shape[1], layer.lora.alpha)
        with torch.no_grad():
            a.A.copy_(layer.lora.A)
            a.B.copy_(layer.lora.B)
        adapters.append(a)
    mags = [layer.m.detach().float() for layer in solo]
    if shared:
        linear = nn.Linear(K, N_OUT).requires_grad_(False)
        linear.load_state_dict({k: v.float() for k, v in solo[0].linear.state_dict().items()})
        return PackedDoRALinear(adapters, mags, detach_norm=detach, linear=linear)
    heads = []
    for layer in solo:
        head = nn.Linear(K, N_OUT)
        head.load_state_dict({k: v.float() for k, v in layer.linear.state_dict().items()})
        heads.append(head)
    return PackedDoRALinear(adapters, mags, detach_norm=detach, heads=heads)


@pytest.mark.parametrize("detach", [False, True], ids=["exact", "detached"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-base", "own-heads"])
@pytest.mark.parametrize("rows", [3, 7])
def test_packed_dora_layer_is_each_points_solo_layer(detach, shared, rows):
    solo = _solo_layers(MIXED, shared=shared, detach=detach)
    packed = _packed(solo, shared=shared, detach=detach)
    n = len(MIXED)
    x = fresh(n * rows, K, device="cpu", dtype=torch.float32)
    g = fresh(n * rows, N_OUT, device="cpu", dtype=torch.float32)
    x32 = x.clone().requires_grad_()
    y = packed(x32)
    wrt = [x32, packed.A, packed.B, packed.m] + ([packed.weight, packed.bias] if not shared else [])
    grads = dict(zip(["x", "A", "B", "m", "W", "b"], torch.autograd.grad(y, wrt, g)))

    bound = dot_tol(torch.float32, dora_chain(K, N_OUT, max(r for r, _ in MIXED), rows))
    x64 = x.double().requires_grad_()
    for p, (layer, (r, _)) in enumerate(zip(solo, MIXED)):
        rows_p = slice(p * rows, (p + 1) * rows)
        want = layer(x64[rows_p])
        params = [layer.lora.A, layer.lora.B, layer.m]
        params += [] if shared else [layer.linear.weight, layer.linear.bias]
        ref = torch.autograd.grad(want, [x64, *params], g[rows_p].double())
        assert not grads["A"][p][:, r:].any() and not grads["B"][p][r:].any(), f"point {p}: padding's gradients"
        got = {"y": y[rows_p], "x": grads["x"][rows_p], "A": grads["A"][p][:, :r], "B": grads["B"][p][:r],
               "m": grads["m"][p]}
        exp = {"y": want, "x": ref[0][rows_p], "A": ref[1], "B": ref[2], "m": ref[3]}
        if not shared:
            got.update(W=grads["W"][p], b=grads["b"][p])
            exp.update(W=ref[4], b=ref[5])
        for name in got:
            err = rel_err(got[name], exp[name])
            assert err <= bound, (f"point {p}", name, err, bound)


def test_the_detached_norm_sends_no_gradient_through_the_norm():
    """Detached, m's gradient is Σ dy ⊙ z / n and A's and B's come from the products alone: they
    differ from the exact norm's (a check that the setting reaches the packed layer)."""
    solo = _solo_layers(MIXED[:2], shared=True, detach=False)
    x = fresh(2 * 3, K, device="cpu", dtype=torch.float32)
    out = {}
    for detach in (False, True):
        packed = _packed(solo, shared=True, detach=detach)
        out[detach] = torch.autograd.grad(packed(x).square().sum(), [packed.A])[0]
    assert rel_err(out[True], out[False]) > 1e-3
