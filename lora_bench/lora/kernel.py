"""``--trainable-layers lora-kernel``: the LoRA layer whose forward and backward run the project's
minimal-work op (:mod:`lora_bench.kernels.autograd`), its DoRA layer (that op, then DoRA's per-output
scale in one function: :mod:`lora_bench.kernels.dora`), and the grouping of LoRA layers that share an input (DoRA
layers are not grouped: each scales its own outputs by its own norm)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from lora_bench.kernels.autograd import lora_linear
from lora_bench.kernels.deferred import DEFERRED
from lora_bench.kernels.dora import dora_output
from lora_bench.kernels.plan_names import ADAPTER_GRADS_INLINE
from lora_bench.kernels.policy import current_policy, note_adapter_grads, use_policy
from lora_bench.kernels.segments import lora_linear_segments, parameter_kinds
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
        policy = None if torch.compiler.is_compiling() else current_policy()  # compiled: always inline
        if policy is not None and policy.adapter_grads == DEFERRED:
            note_adapter_grads(DORA_INLINE)
            with use_policy(dataclasses.replace(policy, adapter_grads=ADAPTER_GRADS_INLINE)):
                z = lora_linear(x, w, None, lora.A, lora.B, lora.alpha)
        else:
            z = lora_linear(x, w, None, lora.A, lora.B, lora.alpha)
        sq = None if w.requires_grad else self.weight_sq  # a trained W (the head) changes every step
        return dora_output(z, w, sq, lora.A, lora.B, self.m, self.linear.bias, scale=lora.alpha,
                           exact=not self.detach_norm)


class SideBySide:
    """Layers that share their input, called as one: returns each layer's output. Not a module
    (the layers stay where they are registered; this only holds references)."""

    def __init__(self, layers: list[LinearWithLoRAKernel]):
        self.layers = layers

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return lora_linear_segments(x, self.layers)

    def __repr__(self) -> str:
        return f"SideBySide({len(self.layers)} lora-kernel layers)"


def group_layers(layers: list[nn.Module]) -> SideBySide | None:
    """Lay the parameters of lora-kernel ``layers`` (same shapes, dtypes, device and alpha, frozen
    bases) side by side: each weight, bias, A and B becomes a view of one buffer per kind, holding
    the same values, so the fused kernels read all the layers at once. Returns the caller for the
    group, or None when the layers cannot be grouped (nothing is changed then).

    Call it once the model is on its device and in its final dtypes (``Module.to`` gives each
    parameter its own storage again, which turns the grouped path off, not wrong)."""
    if len(layers) < 2 or not all(isinstance(m, LinearWithLoRAKernel) for m in layers):
        return None
    kinds = parameter_kinds(layers)
    if kinds is None or any(len({(tuple(t.shape), t.dtype, t.device) for t in group}) != 1 for group in kinds):
        return None
    with torch.no_grad():
        for group in kinds:
            buf = torch.stack([t.detach() for t in group])
            for t, view in zip(group, buf.unbind(0)):
                t.data = view
    return SideBySide(list(layers))


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
