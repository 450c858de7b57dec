"""PiSSA's initialisation (docs/variants.md): the adapter of each frozen layer takes the top-r
singular part of the layer's weight, ``W ≈ U_r·S_r·V_rᵀ = s·(A·B)ᵀ`` with
``A = V_r·√(S_r/|s|)`` (in × r) and ``B = sign(s)·√(S_r/|s|)·U_rᵀ`` (r × out), and the weight keeps
the residual ``W − s·(A·B)ᵀ``: the layer starts computing what it computed before, its adapter
training the weight's principal directions. A trained base (the new head) is left as it is."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from lora_bench.lora.layer import LoRALinearBase


def pissa_init(model: nn.Module, *, device: torch.device | str | None = None) -> int:
    """Initialise every LoRA layer of ``model`` over a frozen ``nn.Linear`` as PiSSA does, the SVDs
    run on ``device`` (default: where each weight is); returns how many layers."""
    count = 0
    for module in model.modules():
        if isinstance(module, LoRALinearBase) and isinstance(module.linear, nn.Linear) \
                and not module.linear.weight.requires_grad:
            pissa_layer(module, device=device)
            count += 1
    return count


@torch.no_grad()
def pissa_layer(layer: LoRALinearBase, *, device: torch.device | str | None = None) -> None:
    """One layer's PiSSA initialisation (module docstring), in float64 for a float64 weight and
    float32 otherwise; the residual is taken with the adapter as stored, so that ``W_res + s·(A·B)ᵀ``
    is W up to the rounding of the residual itself."""
    w, a, b, s = layer.linear.weight, layer.lora.A, layer.lora.B, float(layer.lora.alpha)
    rank = a.shape[1]
    if rank > min(w.shape):
        raise ValueError(f"PiSSA at rank {rank} needs a weight of at least {rank} rows and columns, got "
                         f"{tuple(w.shape)}")
    if s == 0:
        raise ValueError("PiSSA needs a nonzero scale: the update s·A·B holds the weight's top singular part")
    compute = torch.float64 if w.dtype == torch.float64 else torch.float32
    where = device if device is not None else w.device
    wd = w.to(device=where, dtype=compute)
    u, sv, vh = torch.linalg.svd(wd, full_matrices=False)
    root = (sv[:rank] / abs(s)).sqrt()
    a.copy_(vh[:rank].t() * root)
    b.copy_(math.copysign(1.0, s) * root.unsqueeze(1) * u[:, :rank].t())
    stored = (a.to(where, compute) @ b.to(where, compute)).t()
    w.copy_(wd - s * stored)
    layer.weight_changed()
