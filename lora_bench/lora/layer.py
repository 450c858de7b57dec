"""The LoRA adapter and the reference's unmerged variant: ``linear(x) + alpha * (x @ A @ B)``."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


class LoRALayer(nn.Module):
    """A (in×r) kaiming-uniform from the global RNG, B (r×out) zeros. Alpha is *not* divided by r."""

    def __init__(self, in_dim: int, out_dim: int, rank: int, alpha: float):
        super().__init__()
        self.A = nn.Parameter(torch.empty(in_dim, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.B = nn.Parameter(torch.zeros(rank, out_dim))
        self.alpha = alpha

    def forward(self, x):
        return self.alpha * (x @ self.A @ self.B)


class LoRALinearBase(nn.Module):
    """Wraps a frozen-or-not ``nn.Linear``; subclasses differ only in how forward is computed.
    Parameter names (``linear.weight``, ``lora.A``, ``lora.B``) are shared by every variant, so a
    state dict moves between them."""

    variant = "base"

    def __init__(self, linear: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.linear = linear
        self.lora = LoRALayer(linear.in_features, linear.out_features, rank, alpha)

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def extra_repr(self) -> str:
        return f"rank={self.lora.A.shape[1]}, alpha={self.lora.alpha}, variant={self.variant}"


class LinearWithLoRA(LoRALinearBase):
    """The reference's ``LinearWithLoRA``: two branches, added."""

    variant = "lora"

    def forward(self, x):
        return self.linear(x) + self.lora(x)
