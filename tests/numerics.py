"""Helpers shared by the numerical tests: relative error against a reference, the tolerances the
suite allows and their derivation, fresh inputs, a pair of tiny LoRA models with the same weights.

Tolerances (every float comparison of a computed result goes through one of these):

- ``dot_tol(dtype, k)``: a result computed in ``dtype`` whose longest chain of roundings is a sum
  of ``k`` terms (a matrix product with inner dimension k; chained products add their k's),
  against a float64 reference. The rounding errors of a sum of k terms behave as k independent
  errors of at most u (the unit roundoff) times the partial sums; for operands of random sign the
  normwise relative error then stays under λ·u·√k with probability at least 1 − 2·exp(−λ²/2)
  (Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci.
  Comput. 41(5), 2019). λ = 8: odds of a false failure under 3e-14.
- ``rounded_input_tol(dtype, roundings=3)``: a product chain accumulated in float32 whose values
  are rounded to a 16-bit type (or to TF32's 10-bit mantissa inside a float32 product) on the way.
  Each rounding moves what it rounds by at most u relative, so a chain through ``roundings`` of
  them carries at most ``roundings``·u; one more u covers the float32 accumulation
  (2^-24·√k ≪ u). Count the roundings on the longest path from an input to the output: with
  16-bit inputs, the intermediate x·A and the output, rounded once or twice (the adapter product
  added into the rounded base product), are 3 (the default); under autocast the float32 inputs
  x, A, B are rounded too (x, A, x·A, B, y: 5); TF32 rounds both operands of each of the two
  chained products (x, A, x·A, B: 4, output in float32).
- ``kernel_tol(precision, k, autocast=False)``: one of the two above by precision name ('fp32':
  dot_tol over a chain of k; 'tf32', 'bf16', 'fp16': rounded_input_tol with the roundings counted
  above), for the kernel tests; ``lora_chains`` gives the chain lengths of a LoRA layer's results.
- ``same_function_tol(want, ref, dtype)``: two evaluations of one function that differ only in
  the order of their roundings (a grouped product, autograd summing branches in another order,
  another reduction layout, a fused op), where no closed bound fits (whole models, training
  trajectories). Both carry errors of the same distribution against the float64 evaluation
  ``ref``; the other order may be SPREAD = 4 times as far from it as ``want``, plus λ units of
  u for results that happen to round exactly. The bound follows the CPU it runs on: a processor
  whose float32 products round differently moves both errors alike. ``float64_runs`` evaluates a
  whole run (``execute_run``, or ``lora-bench train`` in this process) in float64 for ``ref``.

Bit-exact assertions stay where the two sides run the same operations on the same values.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lora_bench.lora import LinearWithLoRA, inject_lora
from lora_bench.lora.kernel import LinearWithLoRAKernel
from lora_bench.model.gpt2 import build_random_model, gpt_config


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖; an exactly-zero reference must be matched exactly (NaN never passes)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if out.isnan().any():
        return float("inf")
    if ref.norm() == 0:
        return 0.0 if out.norm() == 0 else float("inf")
    return float((out - ref).norm() / ref.norm())


def assert_within(errs: dict[str, float], bounds: dict[str, float] | float, context=None) -> None:
    """Each error of ``errs`` (by name) at most its bound: ``bounds`` by name, or one for all;
    ``context`` shown beside a failure."""
    for name, err in errs.items():
        bound = bounds[name] if isinstance(bounds, dict) else bounds
        assert err <= bound, (context, name, err, bound)


# half an ulp at 1: the relative size of one rounding to nearest
UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
                 torch.bfloat16: 2.0 ** -8}
TF32_UNIT_ROUNDOFF = 2.0 ** -11  # TF32 keeps float16's 10-bit mantissa
LAMBDA = 8.0
SPREAD = 4.0


def dot_tol(dtype: torch.dtype, k: int) -> float:
    """λ·u·√k: the normwise relative error a result computed in ``dtype`` through a sum of ``k``
    terms may carry against float64 (module docstring)."""
    return LAMBDA * UNIT_ROUNDOFF[dtype] * math.sqrt(k)


def rounded_input_tol(dtype: torch.dtype | str, roundings: int = 3) -> float:
    """(roundings + 1)·u of the type the chain's values are rounded to: ``torch.bfloat16``,
    ``torch.float16`` or ``"tf32"`` (module docstring)."""
    u = TF32_UNIT_ROUNDOFF if dtype == "tf32" else UNIT_ROUNDOFF[dtype]
    return (roundings + 1) * u


PRECISION_DTYPE = {"fp32": torch.float32, "tf32": "tf32", "bf16": torch.bfloat16, "fp16": torch.float16}


def kernel_tol(precision: str, k: int, *, autocast: bool = False) -> float:
    """The bound of a kernel's result against float64 under ``precision`` ('fp32', 'tf32', 'bf16' or
    'fp16'; ``autocast``: float32 inputs under a 16-bit autocast): dot_tol(float32, k) for exact
    float32 with a longest chain of ``k`` terms, else rounded_input_tol with the chain's roundings
    counted in the module docstring (3 for 16-bit inputs, 4 for TF32, 5 under autocast)."""
    if precision == "fp32" and not autocast:
        return dot_tol(torch.float32, k)
    return rounded_input_tol(PRECISION_DTYPE[precision], 5 if autocast else 4 if precision == "tf32" else 3)


def lora_chains(*, rows: int, k: int, n: int, r: int, segments: int = 1) -> dict[str, int]:
    """The longest chain of summed terms behind each result of ``segments`` LoRA layers side by side
    (y = x·Wᵀ + s·(x·A)·B + b, each k → n with rank r, on ``rows`` input rows), by name: y sums k
    terms of x·A, then r of (x·A)·B, then adds the base product and the bias (k + r + 2); h = x·A
    sums k; u = g·Bᵀ sums n; grad_x = g·W + s·u·Aᵀ sums the S·n terms of g·W and, after u's n, the
    S·r of u·Aᵀ (S·(n + r) + 1 bounds both); grad_A = s·xᵀ·u sums rows after u's n; grad_B =
    s·hᵀ·g sums rows after h's k; grad_W and grad_b sum rows."""
    s = segments
    return dict(y=k + r + 2, h=k, u=n, grad_x=s * (n + r) + 1, grad_A=rows + n, grad_B=rows + k,
                grad_W=rows, grad_b=rows)


def dora_chain(k: int, n: int, r: int, rows: int) -> int:
    """The longest chain of summed terms behind a DoRA layer's output or gradient (k → n, rank r, on
    ``rows`` input rows): the output sums the two branches (k + r + 2) and the norm (‖W_j‖² or W·A:
    k terms, then B·Gram and its row sums: 2r, the three terms and the root: 4), then divides and
    multiplies (2): 2k + 3r + 8; a gradient adds the backward's sums over the rows and the outputs
    and runs through the norm's chain once more."""
    return rows + n + 2 * (2 * k + 3 * r + 8)


def same_function_tol(want, ref, dtype: torch.dtype = torch.float32) -> float:
    """How far from the float64 evaluation ``ref`` another rounding order of ``want``'s function
    may land: SPREAD × ``want``'s own error plus λ·u (module docstring). ``want`` and ``ref`` are
    tensors, or dicts of tensors with the same keys (then the error is the root mean square of the
    per-tensor relative errors, so that a small tensor counts as much as a large one)."""
    return SPREAD * rms_rel_err(want, ref) + LAMBDA * UNIT_ROUNDOFF[dtype]


def rms_rel_err(out, ref) -> float:
    """``rel_err`` of two tensors, or the root mean square of it over two dicts' common tensors."""
    if isinstance(ref, dict):
        assert out.keys() == ref.keys()
        return math.sqrt(sum(rel_err(out[k], ref[k]) ** 2 for k in ref) / len(ref))
    return rel_err(out, ref)


def without_key_bias(tensors: dict) -> dict:
    """``tensors`` less the attention key biases' (by name): their gradient is zero in exact
    arithmetic (softmax ignores a shift shared by a row's scores), so every evaluation of it, the
    float64 one included, is rounding noise with no relative error to bound."""
    return {name: t for name, t in tensors.items() if not name.endswith("W_key.bias")}


def assert_same_function(got, want, ref, dtype: torch.dtype = torch.float32, what: str = "") -> None:
    """``got`` is as close to the float64 ``ref`` as another rounding order of ``want`` can be."""
    err, bound = rms_rel_err(got, ref), same_function_tol(want, ref, dtype)
    assert err <= bound, f"{what}: error {err:.3g} against float64, bound {bound:.3g} (SPREAD × {rms_rel_err(want, ref):.3g} + λu)"


def fresh(*shape, device, dtype, scale=1.0) -> torch.Tensor:
    """Random normal values drawn anew on every call (no fixed seed), cast to ``dtype``."""
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def float64_operands():
    """x (2, 5, 7), W (6, 7), b (6), A (7, 3), B (3, 6) in float64, all requiring grad (W and b
    too: a trainable head's gradients are checked as well): inputs for gradcheck."""
    shapes = ((2, 5, 7), (6, 7), (6,), (7, 3), (3, 6))
    return tuple(torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes)


def layer_operands(*, batch: tuple[int, ...], k: int, n: int, r: int, device, dtype, bias: bool = True,
                   noncontig: bool = False):
    """Fresh x (..., k), W (n, k), b (n) or None, A (k, r), B (r, n) for a LoRA layer, scaled so
    outputs stay O(1); ``noncontig``: the same kind of x with transposed storage."""
    if noncontig:
        x = fresh(k, *batch, device=device, dtype=dtype).movedim(0, -1)
        assert not x.is_contiguous()
    else:
        x = fresh(*batch, k, device=device, dtype=dtype)
    w = fresh(n, k, device=device, dtype=dtype, scale=k ** -0.5)
    b = fresh(n, device=device, dtype=dtype) if bias else None
    a = fresh(k, r, device=device, dtype=dtype, scale=k ** -0.5)
    bm = fresh(r, n, device=device, dtype=dtype)
    return x, w, b, a, bm


def model_pair(device: str, dtype: torch.dtype, classes=(LinearWithLoRA, LinearWithLoRAKernel)):
    """Tiny GPT with a trainable 2-class head, LoRA everywhere, one model per class, same weights."""
    models = []
    for cls in classes:
        torch.manual_seed(7)
        m = build_random_model(gpt_config("tiny", context_length=64))
        m.requires_grad_(False)
        m.out_head = nn.Linear(m.cfg.emb_dim, 2)
        torch.manual_seed(8)
        inject_lora(m, cls=cls, rank=4, alpha=2.0)
        models.append(m)
    gen = torch.Generator().manual_seed(9)
    for name, p in models[0].named_parameters():
        if name.endswith("lora.B"):  # moderate, so the model is not chaotic in bf16
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return [m.to(device, dtype) for m in models]


def float64_layer(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """y, then the gradients of x (where it asks for one), A and B, of a LoRA ``layer`` evaluated
    in float64 (a copy; the layer itself is left as it is) at ``x`` with output gradient ``g``; a
    lora-kernel layer runs the torch plan (ATen's float64 products), not the kernels under test."""
    from lora_bench.kernels.policy import Plan, PlanPolicy, use_policy

    layer = copy.deepcopy(layer).double()
    x = x.detach().double().requires_grad_(x.requires_grad)
    with use_policy(PlanPolicy(forced=Plan.TORCH)):
        y = layer(x)
        return [y, *torch.autograd.grad(y, [x] * x.requires_grad + [layer.lora.A, layer.lora.B], g.double())]


def run_model(m, idx):
    logits = m(idx)[:, -1, :]
    logits.float().logsumexp(-1).sum().backward()
    return logits, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def float64_runs():
    """Inside, a run (``execute_run``, or ``lora-bench train`` in this process) builds its classifier
    as always (the same values from the same RNG draws, book's rounded GELU constant included),
    then casts it to float64, and lora-kernel layers run the torch plan (ATen's float64 products):
    the float64 evaluation of that run. Yields the models built, for the caller to check that they
    really ran in float64."""
    from unittest import mock

    from lora_bench.kernels.policy import Plan, PlanPolicy, use_policy
    from lora_bench.train import build as run  # where a run builds its model

    built = []
    real = run.build_classifier

    def build(cfg, **kw):
        built.append(real(cfg, **kw).double())
        return built[-1]

    with mock.patch.object(run, "build_classifier", build), use_policy(PlanPolicy(forced=Plan.TORCH)):
        yield built


ROOT = Path(__file__).resolve().parents[1]
INTERP_SKIP = "this Triton's interpreter does not work with this NumPy (needs Triton >= 3.7 or NumPy < 2.4)"


def run_interpreted(args: list[str]) -> subprocess.CompletedProcess:
    """``python ARGS`` from the checkout's root under Triton's CPU interpreter (TRITON_INTERPRET=1,
    this checkout's lora_bench first on the path); skips the test where that interpreter cannot run."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if "only 0-dimensional arrays can be converted" in proc.stderr:
        pytest.skip(INTERP_SKIP)
    return proc


def interpreted_runs(test_file: str, main: str = "_interp_main") -> list[dict]:
    """Run ``main()`` of the test module ``test_file`` (a path) under Triton's CPU interpreter
    (``run_interpreted``; skipped where Triton is missing or its interpreter cannot run) and return
    the JSON objects it printed, one per line; the run must exit 0."""
    pytest.importorskip("triton")
    here = Path(test_file).resolve()
    code = (f"import sys; sys.path[:0] = [{str(ROOT / 'tests')!r}, {str(here.parent)!r}]; "
            f"import {here.stem} as t; t.{main}()")
    proc = run_interpreted(["-c", code])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
