"""The reference's ``LinearWithLoRAMerged``: materialise ``W + alpha·(A·B)ᵀ`` every call."""

from __future__ import annotations

import torch.nn.functional as F

from lora_bench.lora.layer import LoRALinearBase


class LinearWithLoRAMerged(LoRALinearBase):
    variant = "lora-merged"

    def forward(self, x):
        lora = self.lora.A @ self.lora.B  # (in, out)
        combined_weight = self.linear.weight + self.lora.alpha * lora.T  # (out, in)
        return F.linear(x, combined_weight, self.linear.bias)
