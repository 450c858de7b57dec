"""LoRA's variants, layer by layer, on fresh random inputs: rsLoRA's scale, DoRA's unmerged
(``LinearWithDoRA``) and merged (``LinearWithDoRAMerged``) layers with the exact and the detached
norm, DoRA's cheap norm, and PiSSA's initialisation; ranks 1 to 64, odd shapes.

Each layer in float32 against the variant's definition evaluated in float64 (written out here, the
merged weight formed whole): the output and the gradients of the input, A, B, DoRA's magnitude m
and, where it trains (the head), W and b. Tolerances (tests/numerics.py): ``dot_tol`` over the
longest chain of summed terms behind a result. LoRA's are ``lora_chains``' (the scale's rounding one
term more). DoRA's output sums the two branches (k + r + 2) and the norm (‖W_j‖² or W·A: k terms,
then B·Gram and its row sums: 2r, the three terms and the root: 4), then divides and multiplies
(2): 2k + 3r + 8. A gradient adds the backward's sums over the rows and the outputs and runs
through the norm's chain once more: ``DORA_CHAIN`` (tests/numerics.py, ``dora_chain``) bounds every
path. Float64 against float64 (the two DoRA layers, the cheap norm) is bounded the same way in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from numerics import dora_chain as DORA_CHAIN
from numerics import dot_tol, fresh, lora_chains, rel_err

from lora_bench.lora import LinearWithDoRA, LinearWithDoRAMerged, LinearWithLoRA, LinearWithLoRAMerged, lora_scale
from lora_bench.lora.kernel import LinearWithLoRAKernel
from lora_bench.lora.layer import dora_norm, merged_norm
from lora_bench.lora.pissa import pissa_init

SHAPES = ((96, 80), (37, 53))  # (in, out): even, and odd with more outputs than inputs
RANKS = (1, 7, 64)
ROWS = (3, 5)  # batch 3 of 5 tokens: 15 rows


def _layer(cls, k: int, n: int, r: int, alpha: float, *, trained_base: bool = False, **options):
    """``cls`` over a fresh ``nn.Linear`` (frozen unless ``trained_base``), its B nonzero (a zero B
    leaves A's gradient zero), DoRA's magnitude moved off its start (so m / norm is not 1)."""
    linear = nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.copy_(fresh(n, k, device="cpu", dtype=torch.float32, scale=k ** -0.5))
    linear.requires_grad_(trained_base)
    layer = cls(linear, r, alpha, **options)
    with torch.no_grad():
        layer.lora.A.copy_(fresh(k, r, device="cpu", dtype=torch.float32, scale=k ** -0.5))
        layer.lora.B.copy_(fresh(r, n, device="cpu", dtype=torch.float32, scale=r ** -0.5))
        if hasattr(layer, "m"):
            layer.m.mul_(1 + 0.1 * torch.rand_like(layer.m))
    return layer


def _wrt(layer) -> dict[str, torch.Tensor]:
    """The layer's trained tensors by name (A, B, DoRA's m, a trained base's W and b)."""
    out = {"A": layer.lora.A, "B": layer.lora.B}
    if hasattr(layer, "m"):
        out["m"] = layer.m
    if layer.linear.weight.requires_grad:
        out["W"], out["b"] = layer.linear.weight, layer.linear.bias
    return out


def _run(layer, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """The layer's output and the gradients of x and its trained tensors, as it computes them."""
    x = x.detach().requires_grad_()
    y = layer(x)
    wrt = _wrt(layer)
    grads = torch.autograd.grad(y, [x, *wrt.values()], g)
    return {"y": y, **dict(zip(["x", *wrt], grads))}


def _reference(layer, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """The variant's definition in float64 on the layer's current values: LoRA's
    ``x·Wᵀ + b + s·(x·A)·B``; DoRA's ``x·(m ⊙ (W + s·(A·B)ᵀ) / ‖W + s·(A·B)ᵀ‖_rows)ᵀ + b``, the norm
    detached where the layer detaches it."""
    x64 = x.detach().double().requires_grad_()
    t = {name: p.detach().double().requires_grad_() for name, p in _wrt(layer).items()}
    w = t.get("W", layer.linear.weight.detach().double())
    b = t.get("b", layer.linear.bias.detach().double())
    s = float(layer.lora.alpha)
    if "m" in t:
        merged = w + s * (t["A"] @ t["B"]).T
        norm = merged.norm(dim=1, keepdim=True)
        if layer.detach_norm:
            norm = norm.detach()
        y = x64 @ (t["m"].unsqueeze(1) * merged / norm).T + b
    else:
        y = x64 @ w.T + b + s * ((x64 @ t["A"]) @ t["B"])
    grads = torch.autograd.grad(y, [x64, *t.values()], g.double())
    return {"y": y, **dict(zip(["x", *t], grads))}


def _check(got: dict, want: dict, bound: dict | float, what: str) -> None:
    assert got.keys() == want.keys()
    for name, t in got.items():
        tol = bound[name] if isinstance(bound, dict) else bound
        err = rel_err(t, want[name])
        assert err <= tol, f"{what}, {name}: error {err:.3g} against float64, bound {tol:.3g}"


def _lora_bounds(k: int, n: int, r: int, rows: int) -> dict[str, float]:
    c = lora_chains(rows=rows, k=k, n=n, r=r)
    return {"y": dot_tol(torch.float32, c["y"] + 1), "x": dot_tol(torch.float32, c["grad_x"] + 1),
            "A": dot_tol(torch.float32, c["grad_A"] + 1), "B": dot_tol(torch.float32, c["grad_B"] + 1),
            "W": dot_tol(torch.float32, c["grad_W"]), "b": dot_tol(torch.float32, c["grad_b"])}


def test_lora_scale_is_alpha_or_alpha_over_root_rank():
    assert lora_scale(8.0, 16) == 8.0 and lora_scale(8.0, 16, "alpha") == 8.0
    assert lora_scale(8.0, 16, "rslora") == 2.0
    assert lora_scale(3.0, 7, "rslora") == 3.0 / math.sqrt(7)
    with pytest.raises(ValueError, match="rslora"):
        lora_scale(8.0, 16, "other")


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("r", RANKS)
@pytest.mark.parametrize("cls", [LinearWithLoRA, LinearWithLoRAMerged, LinearWithLoRAKernel])
def test_rslora_layers_against_float64(cls, k, n, r):
    """Every LoRA layer at rsLoRA's scale (1.5·4/√r: no power of two) against its float64 definition."""
    layer = _layer(cls, k, n, r, lora_scale(6.0, r, "rslora"))
    x = fresh(*ROWS, k, device="cpu", dtype=torch.float32)
    g = fresh(*ROWS, n, device="cpu", dtype=torch.float32)
    rows = math.prod(ROWS)
    bound = _lora_bounds(k, n, r, rows)
    if cls is LinearWithLoRAMerged:  # the update merged first: A·B (r terms) then into W·x (k terms)
        bound = {name: dot_tol(torch.float32, lora_chains(rows=rows, k=k, n=n, r=r)["grad_x"] + k + r + 2)
                 for name in bound}
    _check(_run(layer, x, g), _reference(layer, x, g), bound, f"{cls.__name__} r={r} {k}x{n}")


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("r", RANKS)
@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("cls", [LinearWithDoRA, LinearWithDoRAMerged])
def test_dora_layers_against_float64(cls, detach, k, n, r):
    layer = _layer(cls, k, n, r, 1.5, detach_norm=detach)
    x = fresh(*ROWS, k, device="cpu", dtype=torch.float32)
    g = fresh(*ROWS, n, device="cpu", dtype=torch.float32)
    bound = dot_tol(torch.float32, DORA_CHAIN(k, n, r, math.prod(ROWS)))
    _check(_run(layer, x, g), _reference(layer, x, g), bound, f"{cls.__name__} detach={detach} r={r} {k}x{n}")


@pytest.mark.parametrize("cls", [LinearWithDoRA, LinearWithDoRAMerged])
def test_dora_with_a_trained_base_against_float64(cls):
    """A trained base (the new head's): W and b get gradients, and the norm follows W as it trains."""
    k, n, r = 37, 5, 7
    layer = _layer(cls, k, n, r, 2.0, trained_base=True)
    x = fresh(*ROWS, k, device="cpu", dtype=torch.float32)
    g = fresh(*ROWS, n, device="cpu", dtype=torch.float32)
    bound = dot_tol(torch.float32, DORA_CHAIN(k, n, r, math.prod(ROWS)))
    _check(_run(layer, x, g), _reference(layer, x, g), bound, cls.__name__)
    with torch.no_grad():
        layer.linear.weight.mul_(1.5)
    _check(_run(layer, x, g), _reference(layer, x, g), bound, f"{cls.__name__}, W changed")


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("r", RANKS)
def test_cheap_norm_equals_the_merged_matrix_norm(k, n, r):
    """``dora_norm`` (W's row norms, W·A, A's Gram) against the merged weight's row norms, both in
    float64 (a chain of k + 2r + 4 terms each; the merged one sums r, then adds, then k squares)."""
    w = fresh(n, k, device="cpu", dtype=torch.float64, scale=k ** -0.5)
    a = fresh(k, r, device="cpu", dtype=torch.float64, scale=k ** -0.5)
    b = fresh(r, n, device="cpu", dtype=torch.float64, scale=r ** -0.5)
    for s in (1.5, -0.75):
        want = merged_norm(w, a, b, s)
        bound = 2 * dot_tol(torch.float64, k + 2 * r + 4)
        assert rel_err(dora_norm(w, a, b, s), want) <= bound
        assert rel_err(dora_norm(w, a, b, s, w.pow(2).sum(1)), want) <= bound


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("r", RANKS)
@pytest.mark.parametrize("detach", [False, True])
def test_dora_unmerged_equals_merged_in_float64(detach, k, n, r):
    """The book-style pair computes one function: outputs and every gradient agree in float64."""
    torch.manual_seed(r)
    unmerged = _layer(LinearWithDoRA, k, n, r, 1.5, detach_norm=detach).double()
    merged = LinearWithDoRAMerged(nn.Linear(k, n).requires_grad_(False), r, 1.5, detach_norm=detach).double()
    merged.load_state_dict(unmerged.state_dict())
    x = fresh(*ROWS, k, device="cpu", dtype=torch.float64)
    g = fresh(*ROWS, n, device="cpu", dtype=torch.float64)
    bound = dot_tol(torch.float64, DORA_CHAIN(k, n, r, math.prod(ROWS)))
    _check(_run(unmerged, x, g), _run(merged, x, g), bound, f"detach={detach} r={r} {k}x{n}")


def test_dora_starts_as_its_linear_layer():
    """m starts as W's row norms and B as zeros: the layer's weight is W itself."""
    linear = nn.Linear(37, 53).double().requires_grad_(False)
    x = fresh(4, 37, device="cpu", dtype=torch.float64)
    for cls in (LinearWithDoRA, LinearWithDoRAMerged):
        layer = cls(linear, 8, 2.0).double()
        assert torch.equal(layer.m, linear.weight.norm(dim=1))
        assert rel_err(layer(x), linear(x)) <= dot_tol(torch.float64, 2 * (2 * 37 + 8))


def test_detached_norm_gives_other_gradients_and_the_same_output():
    """The norm does not depend on m: m's gradient is the same; A's and B's lose the norm's part."""
    exact = _layer(LinearWithDoRA, 37, 53, 7, 1.5)
    detached = LinearWithDoRA(nn.Linear(37, 53).requires_grad_(False), 7, 1.5, detach_norm=True)
    detached.load_state_dict(exact.state_dict())
    x = fresh(*ROWS, 37, device="cpu", dtype=torch.float32)
    g = fresh(*ROWS, 53, device="cpu", dtype=torch.float32)
    a, b = _run(exact, x, g), _run(detached, x, g)
    assert torch.equal(a["y"], b["y"])
    assert torch.equal(a["m"], b["m"])
    assert rel_err(a["A"], b["A"]) > 1e-3 and rel_err(a["B"], b["B"]) > 1e-3


@pytest.mark.parametrize("k, n, r", [(96, 80, 1), (96, 80, 64), (37, 53, 7), (37, 53, 37)])
@pytest.mark.parametrize("cls", [LinearWithLoRA, LinearWithLoRAMerged, LinearWithLoRAKernel, LinearWithDoRA,
                                 LinearWithDoRAMerged])
@pytest.mark.parametrize("scale", [2.0, -0.5])
def test_pissa_layer_starts_as_the_base_layer(cls, k, n, r, scale):
    """PiSSA moves W's top-r singular part into s·(A·B)ᵀ and keeps the residual: in float64 the
    layer's output is the base layer's, A·B has rank r along W's top singular vectors, and the
    residual has W's other singular values."""
    linear = nn.Linear(k, n).double().requires_grad_(False)
    w0 = linear.weight.detach().clone()
    x = fresh(*ROWS, k, device="cpu", dtype=torch.float64)
    want = linear(x)
    layer = cls(linear, r, scale).double()
    assert pissa_init(layer) == 1
    bound = dot_tol(torch.float64, 2 * (2 * k + 3 * r + 8))
    assert rel_err(layer(x), want) <= bound
    sv = torch.linalg.svdvals(w0)
    update = scale * (layer.lora.A @ layer.lora.B).T
    assert rel_err(torch.linalg.svdvals(update)[:r], sv[:r]) <= dot_tol(torch.float64, k + n)
    assert rel_err(torch.linalg.svdvals(layer.linear.weight)[:min(k, n) - r], sv[r:]) <= dot_tol(torch.float64, k + n)
    assert rel_err(layer.linear.weight + update, w0) <= dot_tol(torch.float64, r + 2)


def test_pissa_leaves_a_trained_base_and_refuses_a_rank_beyond_the_weight():
    head = LinearWithLoRA(nn.Linear(8, 2), 4, 1.0)  # the new head: its base trains
    before = {k: v.clone() for k, v in head.state_dict().items()}
    assert pissa_init(head) == 0
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items())
    with pytest.raises(ValueError, match="rank 9 needs a weight of at least 9 rows and columns"):
        pissa_init(LinearWithLoRA(nn.Linear(8, 20).requires_grad_(False), 9, 1.0))


@pytest.mark.parametrize("cls", [LinearWithLoRA, LinearWithDoRA, LinearWithDoRAMerged, LinearWithLoRAKernel])
def test_a_layer_wrapping_a_linear_on_another_device_keeps_its_parameters_there(cls):
    """Wrapping a layer that lives elsewhere (a GPU's; here the meta device stands in) puts A, B and
    m beside its weight, and draws A from the CPU's generator exactly as wrapping a CPU layer does."""
    on_cpu, elsewhere = nn.Linear(12, 10), nn.Linear(12, 10, device="meta")
    torch.manual_seed(0)
    cls(on_cpu, 4, 2.0)
    after_cpu = torch.get_rng_state()
    torch.manual_seed(0)
    layer = cls(elsewhere, 4, 2.0)
    assert {p.device.type for p in layer.parameters()} == {"meta"}
    assert {b.device.type for b in layer.buffers()} <= {"meta"}
    assert torch.equal(torch.get_rng_state(), after_cpu)
