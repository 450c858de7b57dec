"""``--trainable-layers lora-kernel``: the LoRA layer whose forward and backward run the project's
minimal-work op (:mod:`lora_bench.kernels.autograd`), its DoRA layer (that op, then DoRA's per-output
scale in one function: :mod:`lora_bench.kernels.dora`), and the grouping of layers that share an input
(LoRA layers, or DoRA layers: each still scales its own outputs by its own norm, the norms of all
computed by one set of launches)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn as nn

from lora_bench.kernels import dora_ahead
from lora_bench.kernels.autograd import lora_linear
from lora_bench.kernels.deferred import DEFERRED
from lora_bench.kernels.dora import TRITON, DoRASegmentsFunction, dora_output, norm_path, triton_norm
from lora_bench.kernels.plan_names import ADAPTER_GRADS_INLINE
from lora_bench.kernels.policy import current_policy, note_adapter_grads, use_policy
from lora_bench.kernels.segments import fused_segments, lora_linear_segments, parameter_kinds, stacked
from lora_bench.lora.layer import DoRALinearBase, LoRALinearBase


class LinearWithLoRAKernel(LoRALinearBase):
    """``lora`` with the minimal-work op. Each call runs the plan the kernel policy chooses
    (:mod:`lora_bench.kernels.policy`): the C++ op in eager CUDA, the Triton kernels under CUDA-graph
    capture and torch.compile, torch ops on the CPU; ``policy.record_plans`` collects them."""

    variant = "lora-kernel"

    def forward(self, x):
        return lora_linear(x, self.linear.weight, self.linear.bias, self.lora.A, self.lora.B, self.lora.alpha)


DORA_INLINE = f"{ADAPTER_GRADS_INLINE}: DoRA's norm adds its own gradients into A and B in the same backward pass"


class LinearWithDoRAKernel(DoRALinearBase):
    """``dora`` with the minimal-work op: z = x·Wᵀ + s·(x·A)·B from the LoRA op (no bias, its plan
    chosen and noted as ``lora-kernel``'s), then y = g ⊙ z + b with g = m / ‖W + s·(A·B)ᵀ‖ per
    output (:mod:`lora_bench.kernels.dora`: the norm and the scale in one Triton launch on CUDA,
    their backward written out). The adapter gradients run inline: where the policy defers them, the layer runs
    them inline and notes why (``DORA_INLINE``)."""

    variant = "dora-kernel"

    def forward(self, x):
        w, lora = self.linear.weight, self.lora
        norm = dora_ahead.take(self)  # formed ahead: the LoRA GEMM's epilogue scales where it can
        scale = dora_ahead.epilogue(norm, self.linear.bias)
        with _inline_adapter_grads():
            z = lora_linear(x, w, None, lora.A, lora.B, lora.alpha, dora=scale)
        sq = None if w.requires_grad else self.weight_sq  # a trained W (the head) changes every step
        return dora_output(z, w, sq, lora.A, lora.B, self.m, self.linear.bias, scale=lora.alpha,
                           exact=not self.detach_norm, ahead=dora_ahead.with_scaled(norm, scale))


@contextlib.contextmanager
def _inline_adapter_grads():
    """A DoRA layer's LoRA op with its adapter gradients inline: where the policy defers them, run
    inline and note why (``DORA_INLINE``); a compiled call is always inline."""
    policy = None if torch.compiler.is_compiling() else current_policy()
    if policy is not None and policy.adapter_grads == DEFERRED:
        note_adapter_grads(DORA_INLINE)
        with use_policy(dataclasses.replace(policy, adapter_grads=ADAPTER_GRADS_INLINE)):
            yield
    else:
        yield


class SideBySide:
    """Layers that share their input, called as one: returns each layer's output. Not a module
    (the layers stay where they are registered; this only holds references)."""

    def __init__(self, layers: list[LinearWithLoRAKernel]):
        self.layers = layers

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return lora_linear_segments(x, self.layers)

    def __repr__(self) -> str:
        return f"SideBySide({len(self.layers)} lora-kernel layers)"


class DoRASideBySide(SideBySide):
    """DoRA layers that share their input, called as one where the Triton kernels run (the LoRA op
    of all S layers in one fused call, then their norms and scales in one ``DoRASegmentsFunction``),
    else one call each, as ungrouped."""

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layers = self.layers
        first = layers[0]
        w = first.linear.weight
        if not torch.compiler.is_compiling() and norm_path(w, first.lora.A) == TRITON:
            weights = stacked([m.linear.weight for m in layers])
            params = _dora_params(layers)
            if weights is not None and params is not None and triton_norm().segments_fit(w.shape[0], w.device):
                norm = dora_ahead.take(self)
                bias = first.linear.bias
                scale = dora_ahead.epilogue(
                    norm, None if bias is None else stacked([m.linear.bias for m in layers]).reshape(-1))
                with _inline_adapter_grads():
                    z = fused_segments(x, layers, bias=False, defer=False, dora=scale)
                if z is not None:
                    y = DoRASegmentsFunction.apply(z, first.lora.alpha, len(layers), bias is not None,
                                                   not first.detach_norm, dora_ahead.with_scaled(norm, scale),
                                                   weights.reshape(-1, w.shape[1]), *params)
                    return y.split(w.shape[0], dim=-1)
        return tuple(m(x) for m in layers)

    def __repr__(self) -> str:
        return f"DoRASideBySide({len(self.layers)} lora-kernel DoRA layers)"


def _dora_params(layers) -> list[torch.Tensor] | None:
    """The m's, biases (where the layers have them), A's and B's of DoRA layers, each kind back to
    back in one buffer, flat in ``DoRASegmentsFunction``'s order; else None."""
    kinds = [[m.m for m in layers], [m.linear.bias for m in layers], [m.lora.A for m in layers],
             [m.lora.B for m in layers]]
    if kinds[1][0] is None:
        kinds.pop(1)
    if any(stacked(k) is None for k in kinds):
        return None
    return [t for k in kinds for t in k]


def group_layers(layers: list[nn.Module]) -> SideBySide | None:
    """Lay the parameters of lora-kernel ``layers`` (same shapes, dtypes, device and alpha, frozen
    bases; DoRA layers alike, with one kind of norm) side by side: each weight, bias, A and B (and
    DoRA's m) becomes a view of one buffer per kind, holding the same values, so the fused kernels
    read all the layers at once. Returns the caller for the group, or None when the layers cannot
    be grouped (nothing is changed then).

    Call it once the model is on its device and in its final dtypes (``Module.to`` gives each
    parameter its own storage again, which turns the grouped path off, not wrong)."""
    if len(layers) < 2:
        return None
    dora = all(isinstance(m, LinearWithDoRAKernel) for m in layers)
    if not dora and not all(isinstance(m, LinearWithLoRAKernel) for m in layers):
        return None
    kinds = parameter_kinds(layers)
    if dora and kinds is not None:
        if len({m.detach_norm for m in layers}) != 1:
            return None
        kinds.append([m.m for m in layers])
    if kinds is None or any(len({(tuple(t.shape), t.dtype, t.device) for t in group}) != 1 for group in kinds):
        return None
    with torch.no_grad():
        for group in kinds:
            buf = torch.stack([t.detach() for t in group])
            for t, view in zip(group, buf.unbind(0)):
                t.data = view
    return DoRASideBySide(list(layers)) if dora else SideBySide(list(layers))


def install_norms_ahead(model: nn.Module) -> int:
    """Form the norms of ``model``'s fused DoRA layers ahead at each forward
    (:mod:`lora_bench.kernels.dora_ahead`): each group of layers side by side (an attention block's
    ``qkv`` caller, grouped before this call) as one norm, every other layer on its own. Returns how
    many norms form per forward."""
    owners, grouped = [], set()
    for module in model.modules():
        caller = getattr(module, "qkv", None)
        if isinstance(caller, DoRASideBySide):
            owners.append((caller, tuple(caller.layers)))
            grouped.update(id(m) for m in caller.layers)
    for module in model.modules():
        if isinstance(module, LinearWithDoRAKernel) and id(module) not in grouped:
            owners.append((module, (module,)))
    return dora_ahead.install(model, owners)


def group_qkv(model: nn.Module) -> int:
    """Group the query, key and value layers of every attention block of ``model`` (their
    ``qkv`` caller is set); returns how many blocks were grouped."""
    count = 0
    for module in model.modules():
        if hasattr(module, "W_query") and hasattr(module, "qkv"):
            caller = group_layers([module.W_query, module.W_key, module.W_value])
            if caller is not None:
                module.qkv = caller
                count += 1
    return count
