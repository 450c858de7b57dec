"""The reference's ``LinearWithLoRAMerged``: materialise ``W + alpha·(A·B)ᵀ`` every call; and DoRA's
merged form in the same style, ``m ⊙ (W + alpha·(A·B)ᵀ) / ‖W + alpha·(A·B)ᵀ‖`` row by row."""

from __future__ import annotations

import torch.nn.functional as F

from lora_bench.lora.layer import DoRALinearBase, LoRALinearBase


class LinearWithLoRAMerged(LoRALinearBase):
    variant = "lora-merged"

    def forward(self, x):
        lora = self.lora.A @ self.lora.B  # (in, out)
        combined_weight = self.linear.weight + self.lora.alpha * lora.T  # (out, in)
        return F.linear(x, combined_weight, self.linear.bias)


class LinearWithDoRAMerged(DoRALinearBase):
    """DoRA merged: the merged weight formed, its row norms taken from it (no ``dora_norm``)."""

    variant = "dora-merged"

    def forward(self, x):
        lora = self.lora.A @ self.lora.B  # (in, out)
        numerator = self.linear.weight + self.lora.alpha * lora.T  # (out, in)
        denominator = numerator.norm(p=2, dim=1, keepdim=True)  # each output's row
        if self.detach_norm:
            denominator = denominator.detach()
        directional_component = numerator / denominator
        new_weight = self.m.unsqueeze(1) * directional_component
        return F.linear(x, new_weight, self.linear.bias)
