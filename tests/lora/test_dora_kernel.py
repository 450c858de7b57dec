"""DoRA in the fused layer (``LinearWithDoRAKernel``, ``trainable_layers: lora-kernel`` with
``lora_variant: dora``) on the CPU, against ``LinearWithDoRA`` evaluated in float64: the output and
the gradients of x, A, B, m and, for a trained base (the head), W and b; exact and detached norm;
ranks 1 to 64, odd shapes, B and m moved off their start. ``DoRAFunction``'s written-out
backward (the scale's, then the norm's) by gradcheck in float64; the layer's choices (where its
norm runs, its adapter gradients inline, grouping side by side); a tiny run on the command line, and whole
runs equal to the unmerged layer's (``same_function_tol``); the layer under torch.compile. Its
Triton path, under Triton's CPU interpreter: tests/kernels/test_dora_norm.py.

Tolerances (tests/numerics.py): float32 is ``dot_tol`` over ``dora_chain`` (the longest chain of
summed terms behind a DoRA output or gradient). Under bfloat16 autocast the values are rounded on
their way: the inputs x, W, A, B, the intermediate x·A, z (rounded twice: the
adapter's product added into the rounded base product), g cast for the scale, and y; a gradient runs
through as many (dy, g, dy ⊙ g, B or W, u, x; or dy, z, dy ⊙ z for m): 8 roundings on the longest
path, ``rounded_input_tol(bfloat16, 8)``; the norm itself runs in float32."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
from numerics import dora_chain, dot_tol, fresh, rel_err, rounded_input_tol

from lora_bench.kernels import deferred
from lora_bench.kernels.dora import COMPILED, DoRAFunction
from lora_bench.kernels.policy import Plan, PlanPolicy, record_plans, use_policy
from lora_bench.lora import LinearWithDoRA, LinearWithDoRAKernel, inject_lora, lora_class
from lora_bench.lora.kernel import DORA_INLINE, group_layers, group_qkv
from lora_bench.model.gpt2 import build_random_model, gpt_config

SHAPES = ((37, 53, 7), (96, 80, 15))  # (in, out, rows): odd, more outputs than inputs; even
RANKS = (1, 16, 64)


def _layer(k: int, n: int, r: int, alpha: float, *, trained_base: bool = False, detach: bool = False):
    """A ``LinearWithDoRAKernel`` over a fresh ``nn.Linear`` (frozen unless ``trained_base``), with A,
    B (not zero) and m drawn anew (m moved off W's row norms, so m / n is not 1)."""
    linear = nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.copy_(fresh(n, k, device="cpu", dtype=torch.float32, scale=k ** -0.5))
    linear.requires_grad_(trained_base)
    layer = LinearWithDoRAKernel(linear, r, alpha, detach_norm=detach)
    with torch.no_grad():
        layer.lora.A.copy_(fresh(k, r, device="cpu", dtype=torch.float32, scale=k ** -0.5))
        layer.lora.B.copy_(fresh(r, n, device="cpu", dtype=torch.float32, scale=r ** -0.5))
        layer.m.mul_(1 + 0.1 * torch.rand_like(layer.m))
    return layer


def _reference(layer: LinearWithDoRAKernel) -> LinearWithDoRA:
    """``LinearWithDoRA`` in float64 with the layer's values (its W's row norms taken in float64)."""
    linear = copy.deepcopy(layer.linear).double()
    ref = LinearWithDoRA(linear, layer.lora.A.shape[1], layer.lora.alpha, detach_norm=layer.detach_norm).double()
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    return ref


def _run(layer, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """y and the gradients of x, A, B, m and (a trained base) W and b."""
    x = x.detach().requires_grad_()
    y = layer(x)
    wrt = {"A": layer.lora.A, "B": layer.lora.B, "m": layer.m}
    if layer.linear.weight.requires_grad:
        wrt |= {"W": layer.linear.weight, "b": layer.linear.bias}
    grads = torch.autograd.grad(y, [x, *wrt.values()], g.to(y.dtype))
    return {"y": y, **dict(zip(["x", *wrt], grads))}


def _check(layer, x, g, bound: float, what: str) -> None:
    got = _run(layer, x, g)
    want = _run(_reference(layer), x.double(), g.double())
    assert got.keys() == want.keys()
    for name, t in got.items():
        err = rel_err(t, want[name])
        assert err <= bound, f"{what}, {name}: error {err:.3g} against float64, bound {bound:.3g}"


@pytest.mark.parametrize("k, n, rows", SHAPES)
@pytest.mark.parametrize("r", RANKS)
@pytest.mark.parametrize("detach", [False, True])
def test_dora_kernel_layer_against_float64(detach, k, n, rows, r):
    layer = _layer(k, n, r, 1.5, detach=detach)
    x = fresh(rows, k, device="cpu", dtype=torch.float32)
    g = fresh(rows, n, device="cpu", dtype=torch.float32)
    _check(layer, x, g, dot_tol(torch.float32, dora_chain(k, n, r, rows)), f"detach={detach} r={r} {k}x{n}")


@pytest.mark.parametrize("detach", [False, True])
def test_dora_kernel_layer_with_a_trained_base_against_float64(detach):
    """A trained base (the head): W and b get gradients (the LoRA op's and the norm's, summed), and
    the norm follows W as it changes."""
    k, n, r, rows = 37, 5, 7, 9
    layer = _layer(k, n, r, 2.0, trained_base=True, detach=detach)
    x = fresh(3, 3, k, device="cpu", dtype=torch.float32)
    g = fresh(3, 3, n, device="cpu", dtype=torch.float32)
    bound = dot_tol(torch.float32, dora_chain(k, n, r, rows))
    _check(layer, x, g, bound, "trained base")
    with torch.no_grad():
        layer.linear.weight.mul_(1.5)
    _check(layer, x, g, bound, "trained base, W changed")


@pytest.mark.parametrize("base", ["fp32", "bf16"])
@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("r", [1, 16])
def test_dora_kernel_layer_under_bf16_autocast(detach, r, base):
    """Float32 parameters under CPU bfloat16 autocast, the frozen base in float32 or stored in
    bfloat16 as bf16 mode stores it (``cast_frozen``: W and its bias bfloat16 beside float32 A, B
    and m): the output in bfloat16, the gradients in the parameters' float32, all within the
    bfloat16 bound (module docstring) of float64."""
    from lora_bench.classifier.book import cast_frozen

    k, n, rows = 37, 53, 7
    layer = _layer(k, n, r, 1.5, detach=detach)
    if base == "bf16":
        assert cast_frozen(layer, torch.bfloat16) == 2 and layer.linear.weight.dtype is torch.bfloat16
    x = fresh(rows, k, device="cpu", dtype=torch.float32)
    g = fresh(rows, n, device="cpu", dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(layer, x, g)
    want = _run(_reference(layer), x.double(), g.double())
    assert got["y"].dtype is torch.bfloat16 and all(got[p].dtype is torch.float32 for p in ("A", "B", "m"))
    bound = rounded_input_tol(torch.bfloat16, 8)
    for name, t in got.items():
        assert rel_err(t, want[name]) <= bound, (name, rel_err(t, want[name]), bound)


def _dora_fn(z, w, sq, a, b, m, bias, s, exact):
    return DoRAFunction.apply(z, w, sq, a, b, m, bias, s, exact, "torch")


@pytest.mark.parametrize("bias", [True, False])
def test_dora_function_backward_passes_gradcheck(bias):
    """``DoRAFunction``'s written-out backward (the scale's, then the exact norm's) against finite
    differences in float64, every input differentiable (a trained W and bias), and with a frozen W
    given its row norms; detached: only z, m and the bias."""
    k, n, r = 7, 6, 3
    z = torch.randn(2, 5, n, dtype=torch.float64, requires_grad=True)
    w, a, b = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((n, k), (k, r), (r, n)))
    m = (torch.rand(n, dtype=torch.float64) + 0.5).requires_grad_()
    bb = torch.randn(n, dtype=torch.float64, requires_grad=True) if bias else None
    extra = (bb,) if bias else ()

    def with_bias(t):
        return t[0] if bias else None

    for s in (1.5, -0.75):
        assert torch.autograd.gradcheck(lambda z_, w_, a_, b_, m_, *t: _dora_fn(z_, w_, None, a_, b_, m_, with_bias(t),
                                                                                 s, True), (z, w, a, b, m, *extra))
        sq = w.detach().pow(2).sum(1)
        assert torch.autograd.gradcheck(lambda z_, a_, b_, m_, *t: _dora_fn(z_, w.detach(), sq, a_, b_, m_, with_bias(t),
                                                                             s, True), (z, a, b, m, *extra))
    detached = _dora_fn(z, w, None, a, b, m, bb, 1.5, False)
    grads = torch.autograd.grad(detached.sum(), [w, a, b], allow_unused=True)
    assert grads[0] is None and grads[1] is None and grads[2] is None
    assert torch.autograd.gradcheck(lambda z_, m_, *t: _dora_fn(z_, w.detach(), None, a.detach(), b.detach(), m_,
                                                                 with_bias(t), 1.5, False), (z, m, *extra))


def test_registry_and_state_dict_interchange():
    """``lora-kernel`` with ``dora`` is this layer; its state dict loads into ``LinearWithDoRA`` and back."""
    assert lora_class("lora-kernel", "dora") is LinearWithDoRAKernel
    layer = _layer(20, 12, 4, 2.0)
    other = LinearWithDoRA(nn.Linear(20, 12).requires_grad_(False), 4, 2.0)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.weight_sq, layer.weight_sq)
    assert set(layer.state_dict()) == set(other.state_dict())


def test_dora_kernel_starts_as_its_linear_layer():
    linear = nn.Linear(37, 53).double().requires_grad_(False)
    layer = LinearWithDoRAKernel(linear, 8, 2.0).double()
    x = fresh(4, 37, device="cpu", dtype=torch.float64)
    with use_policy(PlanPolicy(forced=Plan.TORCH)):
        assert rel_err(layer(x), linear(x)) <= dot_tol(torch.float64, 2 * (2 * 37 + 8))


def test_the_layer_notes_where_its_norm_and_its_product_ran():
    layer = _layer(37, 53, 4, 1.5)
    with record_plans() as log:
        layer(fresh(5, 37, device="cpu", dtype=torch.float32)).sum().backward()
    assert set(log) == {Plan.TORCH} and log.dora == {"torch: the CPU"}
    assert log.backend() == "dora-norm-torch+torch"
    with record_plans() as log, torch.no_grad():
        layer(fresh(5, 37, device="cpu", dtype=torch.float32))
    assert not log.dora  # evaluation is not recorded


def test_deferred_adapter_gradients_run_inline_with_the_reason_noted():
    """Where the policy defers the adapter gradients, DoRA's layer runs them inline (its norm
    accumulates into A and B in the same pass) and notes why; the gradients are the inline ones."""
    layer = _layer(37, 53, 4, 1.5)
    x = fresh(5, 37, device="cpu", dtype=torch.float32)
    grads = []
    for mode in ("inline", "deferred"):
        layer.zero_grad(set_to_none=True)
        before = deferred.COUNTS["deferred"]
        with use_policy(PlanPolicy(adapter_grads=mode)), record_plans() as log:
            layer(x).square().sum().backward()
        assert deferred.COUNTS["deferred"] == before
        grads.append([layer.lora.A.grad, layer.lora.B.grad, layer.m.grad])
    assert log.adapter_grads == {DORA_INLINE, "inline"}
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_dora_layers_group_side_by_side_and_run_one_by_one_off_the_triton_path():
    """``group_layers`` lays DoRA layers' parameters (W, b, A, B and m) side by side, values kept;
    off the Triton path (the CPU) the group runs each layer on its own: the same outputs and
    gradients bit for bit as the ungrouped layers. Layers with different norms, or DoRA beside
    LoRA, are not grouped; ``group_qkv`` groups every block of a DoRA model."""
    from lora_bench.kernels.segments import stacked
    from lora_bench.lora import LinearWithLoRAKernel
    from lora_bench.lora.kernel import DoRASideBySide

    layers = [_layer(16, 16, 4, 2.0) for _ in range(3)]
    plain = copy.deepcopy(layers)
    caller = group_layers(layers)
    assert isinstance(caller, DoRASideBySide)
    for kind in ("linear.weight", "linear.bias", "lora.A", "lora.B", "m"):
        ts = [m.get_parameter(kind) for m in layers]
        assert stacked(ts) is not None, kind
        assert all(torch.equal(t, m.get_parameter(kind)) for t, m in zip(ts, plain)), kind
    x = fresh(5, 16, device="cpu", dtype=torch.float32)
    g = fresh(5, 16, device="cpu", dtype=torch.float32)
    got = [_run(_Pick(caller, i), x, g) for i in range(3)]
    want = [_run(m, x, g) for m in plain]
    for a, b in zip(got, want):
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert group_layers([_layer(16, 16, 4, 2.0), _layer(16, 16, 4, 2.0, detach=True)]) is None
    lora = LinearWithLoRAKernel(nn.Linear(16, 16).requires_grad_(False), 4, 2.0)
    assert group_layers([_layer(16, 16, 4, 2.0), lora]) is None
    model = build_random_model(gpt_config("tiny", context_length=16)).requires_grad_(False)  # frozen, as trained
    inject_lora(model, cls=LinearWithDoRAKernel, rank=4, alpha=2.0)
    blocks = [m for m in model.modules() if hasattr(m, "qkv")]
    assert blocks and all(isinstance(m.W_query, LinearWithDoRAKernel) for m in blocks)
    assert group_qkv(model) == len(blocks) and all(isinstance(m.qkv, DoRASideBySide) for m in blocks)


class _Pick(nn.Module):
    """Output i of a group, with layer i's parameters where ``_run`` looks for them."""

    def __init__(self, caller, i: int):
        super().__init__()
        self.caller, self.i = caller, i
        self.lora, self.m, self.linear = caller.layers[i].lora, caller.layers[i].m, caller.layers[i].linear

    def forward(self, x):
        return self.caller(x)[self.i]


def test_dora_kernel_trains_from_the_command_line(run_cli, tmp_path):
    """``--trainable-layers lora-kernel --lora-variant dora`` is accepted and a tiny random-weights run
    trains: its losses change, and it records the settings."""
    import pandas as pd
    from tiny import SAMPLE

    code, out = run_cli("train", "--device", "cpu", "--weights", "random", "--model-size", "tiny",
                        "--data-file", SAMPLE, "--trainable-layers", "lora-kernel", "--lora-variant", "dora",
                        "--dora-norm", "exact", "--num-epochs", "1", "--max-steps", "3", "--warmup-steps", "1",
                        "--eval-freq", "0", "--skip-final-eval", "--learning-rate", "1e-2",
                        "--results-dir", tmp_path)
    assert code == 0, out
    row = pd.read_csv(tmp_path / "runs.csv").iloc[0]
    assert row["status"] == "done" and row["cfg_lora_variant"] == "dora" and row["trainable_layers"] == "lora-kernel"
    assert row["backend"] == "dora-norm-torch+torch"  # the LoRA op's plan and where the norm ran
    steps = pd.read_csv(next(tmp_path.glob("*/steps.csv")))
    assert len(steps) == 3 and steps["loss"].map(math.isfinite).all() and steps["loss"].nunique() > 1


def test_dora_kernel_model_moves_its_magnitudes():
    """One optimizer step of the tiny classifier built with the fused DoRA layers changes every m and
    the loss."""
    from lora_bench.classifier.book import build_classifier
    from lora_bench.config import TrainConfig
    from lora_bench.train.build import build_optimizer

    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora-kernel", lora_variant="dora",
                      device="cpu", learning_rate=1e-2)
    torch.manual_seed(0)
    model = build_classifier(cfg, cache_dir=None)
    layers = [m for m in model.modules() if isinstance(m, LinearWithDoRAKernel)]
    assert layers
    opt = build_optimizer(model, [cfg])
    idx = torch.randint(0, model.cfg.vocab_size, (2, 12))
    target = torch.tensor([0, 1])
    start = [m.m.detach().clone() for m in layers]
    losses = []
    for _ in range(2):
        loss = nn.functional.cross_entropy(model(idx)[:, -1, :], target)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[0] != losses[1]
    assert all(not torch.equal(m.m, s) for m, s in zip(layers, start))


@pytest.mark.parametrize("trained_base", [False, True])
@pytest.mark.parametrize("detach", [False, True])
def test_compiled_layer_against_float64(trained_base, detach):
    """Under torch.compile (one graph, AOTAutograd's aot_eager): the norm runs torch ops (noted, with
    the reason), and the output and every gradient stay within the float32 bound of float64."""
    import torch._dynamo

    k, n, r, rows = 37, 53, 7, 6
    layer = _layer(k, n, r, 1.5, trained_base=trained_base, detach=detach)
    x = fresh(2, 3, k, device="cpu", dtype=torch.float32)
    g = fresh(2, 3, n, device="cpu", dtype=torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with record_plans() as log:
        got = _run(compiled, x, g)
    assert log.dora == {COMPILED}
    want = _run(_reference(layer), x.double(), g.double())
    bound = dot_tol(torch.float32, dora_chain(k, n, r, rows))
    for name, t in got.items():
        assert rel_err(t, want[name]) <= bound, (name, rel_err(t, want[name]), bound)
    torch._dynamo.reset()


@pytest.mark.parametrize("norm", ["exact", "detached"])
def test_fused_and_unmerged_dora_runs_are_one_function(norm, tmp_path):
    """Whole tiny runs: the fused DoRA layer trains to the unmerged layer's losses, as close to the
    float64 run as another rounding order of the unmerged run can be."""
    import json

    import pandas as pd
    from numerics import assert_same_function, float64_runs
    from rich.console import Console
    from tiny import SAMPLE

    from lora_bench.config import TrainConfig
    from lora_bench.train.run import execute_run

    def losses(cfg, run_id):
        execute_run(cfg, results_dir=tmp_path, run_id=run_id, console=Console(quiet=True), progress=False,
                    cache_dir=tmp_path / "cache")
        record = json.loads((tmp_path / run_id / "run.json").read_text())
        steps = pd.read_csv(tmp_path / run_id / "steps.csv")
        return torch.tensor(list(steps["loss"]) + record["train_losses"] + record["val_losses"], dtype=torch.float64)

    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora", lora_variant="dora",
                      dora_norm=norm, device="cpu", data_file=str(SAMPLE), num_epochs=1, max_steps=4, warmup_steps=1,
                      eval_freq=2, eval_iter=1, skip_final_eval=True, learning_rate=1e-3)
    want = losses(cfg, "unmerged")
    got = losses(cfg.replace(trainable_layers="lora-kernel"), "fused")
    with float64_runs() as built:
        ref = losses(cfg, "float64")
    assert built and all(p.dtype == torch.float64 for p in built[0].parameters())
    assert_same_function(got, want, ref, what=f"fused DoRA vs unmerged, norm {norm}")
