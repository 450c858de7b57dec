"""The packed LoRA layer (lora_bench.lora.packed_layer.PackedLoRALinear) against its float64 evaluation on
fresh random inputs: the output and the gradients of the input and of every adapter's A and B (and
of every head's weight and bias, where each adapter has its own base), with mixed ranks from 1 to
64 in one pack (a rank several adapters share, ranks no other adapter has), odd token counts, in
float32 and under bf16 autocast with the frozen base stored in bfloat16 (as a bf16 run stores it),
eagerly on the CPU and on CUDA, and replayed from a CUDA graph (captured once, then given new
inputs and new adapter values in its static buffers, as a training step's replays are).

Tolerances (tests/numerics.py):

- float32: ``dot_tol`` over the longest chain of summed terms behind each result (``lora_chains``
  of a layer with the pack's largest rank, on one point's rows; the scaling by alpha adds one
  rounding to the output's chain: one term more);
- bf16 autocast: ``rounded_input_tol`` with the roundings on the longest path from an input to the
  output counted: x, A, x·A, its scaling by alpha, B, and (alpha·x·A)·B summed with the base
  product in one rounding: 6 (the base product's path has fewer: x, its product, the sum; every
  gradient's path has fewer: the gradient of A, for one, rounds B, g·Bᵀ, its scaling by alpha, x,
  and its own product: 5).

The layer stores its adapters stacked and padded to the largest rank: each point's gradients are
its slices of the stacked gradients, and the padding's slices must be exactly zero.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from numerics import dot_tol, fresh, lora_chains, rel_err, rounded_input_tol

from lora_bench.lora.layer import LoRALayer
from lora_bench.lora.packed_layer import PackedLoRALinear

K, N_OUT, ROWS = 96, 80, 3  # in and out features, a point's batch rows
# ranks 1 to 64 in one pack: rank 1 twice (a group of some of the points), the others once;
# alphas of every kind (1.5 is no power of two: its scaling rounds)
MIXED = ((1, 2.0), (64, 16.0), (8, 1.5), (1, 8.0), (33, 4.0))
SAME = ((16, 2.0), (16, 32.0), (16, 1.5))  # one group of every point: the pack's single product
AUTOCAST_ROUNDINGS = 6  # the longest rounding path under bf16 autocast (module docstring)


def _packed_layer(points, *, shared: bool, device, bf16_base: bool) -> PackedLoRALinear:
    """A packed layer of fresh values: a frozen shared base (stored in bfloat16 with
    ``bf16_base``), or one trainable head per point; adapters with B nonzero (a fresh adapter's
    zero B would leave A's gradient zero)."""
    adapters = []
    for r, alpha in points:
        a = LoRALayer(K, N_OUT, r, alpha)
        with torch.no_grad():
            a.A.copy_(fresh(K, r, device="cpu", dtype=torch.float32, scale=K ** -0.5))
            a.B.copy_(fresh(r, N_OUT, device="cpu", dtype=torch.float32, scale=r ** -0.5))
        adapters.append(a)
    if shared:
        base = nn.Linear(K, N_OUT).requires_grad_(False)
        layer = PackedLoRALinear(adapters, linear=base)
    else:
        layer = PackedLoRALinear(adapters, heads=[nn.Linear(K, N_OUT) for _ in points])
    layer.to(device)
    if shared and bf16_base:
        layer.linear.to(torch.bfloat16)  # as classifier.book.cast_frozen stores a frozen base
    return layer


def _wrt(layer: PackedLoRALinear, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the gradients are taken of, by name: the input and the layer's stacked A and B (and
    heads' weight and bias)."""
    out = {"x": x, "A": layer.A, "B": layer.B}
    if layer.weight is not None:
        out["W"], out["b"] = layer.weight, layer.bias
    return out


def _per_point(layer: PackedLoRALinear, got: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The output, the input's gradient, and each point's own gradients (``A0``, ``B0``, ``W0``,
    ``b0``, ...): its slices of the stacked ones without the padding, whose slices are exactly zero."""
    out = {"y": got["y"], "x": got["x"]}
    for p, r in enumerate(layer.ranks):
        ga, gb = got["A"][p], got["B"][p]
        assert not ga[:, r:].any() and not gb[r:].any(), f"point {p}: the padding's gradients are not zero"
        out[f"A{p}"], out[f"B{p}"] = ga[:, :r], gb[:r]
        if "W" in got:
            out[f"W{p}"], out[f"b{p}"] = got["W"][p], got["b"][p]
    return out


def _point_tensors(layer: PackedLoRALinear) -> dict[str, torch.Tensor]:
    """Each point's own values by the names ``_per_point`` gives their gradients (views)."""
    out = {}
    for p in range(layer.n):
        out[f"A{p}"], out[f"B{p}"] = layer.point_adapter(p)
        if layer.weight is not None:
            base = layer.point_base(p)
            out[f"W{p}"], out[f"b{p}"] = base["weight"], base["bias"]
    return out


def _float64(layer: PackedLoRALinear, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """The output and every gradient, in float64, point by point from the definition: point p's
    rows get ``base_p(x) + alpha_p · (x·A_p)·B_p`` (a copy of the layer's current values)."""
    n, rows = layer.n, x.shape[0] // layer.n
    x64 = x.detach().double().requires_grad_()
    params = {name: t.detach().double().requires_grad_() for name, t in _point_tensors(layer).items()}
    ys = []
    for p, alpha in enumerate(layer.alpha_values):
        xp = x64[p * rows:(p + 1) * rows]
        if layer.linear is not None:
            w = layer.linear.weight.detach().double()
            b = layer.linear.bias.detach().double()
        else:
            w, b = params[f"W{p}"], params[f"b{p}"]
        ys.append(xp @ w.T + b + alpha * ((xp @ params[f"A{p}"]) @ params[f"B{p}"]))
    y = torch.cat(ys)
    grads = torch.autograd.grad(y, [x64, *params.values()], g.double())
    assert n == len(ys)
    return {"y": y, **dict(zip(["x", *params], grads))}


def _bounds(layer: PackedLoRALinear, *, autocast: bool, rows: int) -> dict[str, float]:
    """Each result's bound by name (module docstring): ``rows``, the rows one adapter sees."""
    if autocast:
        tol = rounded_input_tol(torch.bfloat16, AUTOCAST_ROUNDINGS)
        return {name: tol for name in ("y", "x", "A", "B", "W", "b")}
    r = layer.A.shape[2]  # the largest rank: the stored one
    chains = lora_chains(rows=rows, k=K, n=N_OUT, r=r)
    return {"y": dot_tol(torch.float32, chains["y"] + 1), "x": dot_tol(torch.float32, chains["grad_x"] + 1),
            "A": dot_tol(torch.float32, chains["grad_A"] + 1), "B": dot_tol(torch.float32, chains["grad_B"] + 1),
            "W": dot_tol(torch.float32, chains["grad_W"]), "b": dot_tol(torch.float32, chains["grad_b"])}


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bounds: dict[str, float], what: str):
    assert got.keys() == want.keys()
    for name, t in got.items():
        bound = bounds[name.rstrip("0123456789")]
        err = rel_err(t, want[name])
        assert err <= bound, f"{what}, {name}: error {err:.3g} against float64, bound {bound:.3g}"


def _amp(device: torch.device, autocast: bool):
    if not autocast:
        return contextlib.nullcontext
    # autocast's weight-cast cache off: required inside a CUDA-graph capture (as the runs do)
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)


@contextlib.contextmanager
def _full_float32():
    """float32 products in float32 (no TF32), as a run's fp32 precision sets them."""
    old = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old[0])
        torch.backends.cuda.matmul.allow_tf32 = old[1]


def _eager_case(device: torch.device, precision: str, points, shared: bool, tokens: int) -> None:
    autocast = precision == "bf16"
    layer = _packed_layer(points, shared=shared, device=device, bf16_base=autocast)
    n = layer.n
    x = fresh(n * ROWS, tokens, K, device=device, dtype=torch.float32).requires_grad_()
    with _full_float32(), _amp(device, autocast)():
        y = layer(x)
    assert y.dtype == (torch.bfloat16 if autocast else torch.float32)
    g = fresh(*y.shape, device=device, dtype=y.dtype)
    wrt = _wrt(layer, x)
    with _full_float32():
        grads = torch.autograd.grad(y, list(wrt.values()), g)
    assert all(t.dtype == torch.float32 for t in grads)  # adapters, heads and input keep float32 gradients
    got = _per_point(layer, {"y": y, **dict(zip(wrt, grads))})
    _check(got, _float64(layer, x, g), _bounds(layer, autocast=autocast, rows=ROWS * tokens),
           what=f"{device.type} {precision} eager, ranks {[r for r, _ in points]}, {tokens} tokens")


CASES = [pytest.param(points, shared, id=f"{'mixed' if points is MIXED else 'same'}-{'shared' if shared else 'heads'}")
         for points, shared in ((MIXED, True), (SAME, True), (MIXED, False))]


def every_case(test):
    """``test`` for each precision, set of points and token count."""
    for mark in (pytest.mark.parametrize("precision", ["fp32", "bf16"]),
                 pytest.mark.parametrize("points, shared", CASES),
                 pytest.mark.parametrize("tokens", [7, 121])):
        test = mark(test)
    return test


@every_case
def test_packed_layer_against_float64_on_the_cpu(precision, points, shared, tokens):
    _eager_case(torch.device("cpu"), precision, points, shared, tokens)


@pytest.mark.gpu
@every_case
def test_packed_layer_against_float64_on_cuda(precision, points, shared, tokens):
    _eager_case(torch.device("cuda"), precision, points, shared, tokens)


@pytest.mark.gpu
@every_case
def test_packed_layer_replayed_from_a_cuda_graph_against_float64(precision, points, shared, tokens):
    """The forward and backward captured once (after the warm-up a capture needs, as the training
    step's is: ``train.graphs.warm_up``), then replayed on new inputs and output gradients copied
    into the static buffers, and after the adapters (and heads) change in place as an optimizer
    step changes them: each replay against the float64 evaluation of those new values."""
    from lora_bench.train.graphs import warm_up

    device = torch.device("cuda")
    autocast = precision == "bf16"
    amp = _amp(device, autocast)
    layer = _packed_layer(points, shared=shared, device=device, bf16_base=autocast)
    n = layer.n
    static_x = fresh(n * ROWS, tokens, K, device=device, dtype=torch.float32).requires_grad_()
    out_dtype = torch.bfloat16 if autocast else torch.float32
    static_g = fresh(n * ROWS, tokens, N_OUT, device=device, dtype=out_dtype)
    wrt = _wrt(layer, static_x)

    def step():
        with amp():
            y = layer(static_x)
        return y, torch.autograd.grad(y, list(wrt.values()), static_g)

    with _full_float32():
        warm_up(step, 3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y, static_grads = step()
        bounds = _bounds(layer, autocast=autocast, rows=ROWS * tokens)
        for trial in range(3):
            with torch.no_grad():
                static_x.copy_(fresh(*static_x.shape, device=device, dtype=torch.float32))
                static_g.copy_(fresh(*static_g.shape, device=device, dtype=out_dtype))
                if trial:  # new trainable values, in place (each point's own: the padding stays zero)
                    for t in _point_tensors(layer).values():
                        t.add_(fresh(*t.shape, device=device, dtype=t.dtype, scale=0.1 * float(t.std())))
            graph.replay()
            torch.cuda.synchronize()
            got = _per_point(layer, {"y": static_y, **dict(zip(wrt, static_grads))})
            _check(got, _float64(layer, static_x, static_g), bounds,
                   what=f"cuda {precision} replay {trial}, ranks {[r for r, _ in points]}, {tokens} tokens")
