"""``--trainable-layers lora-kernel``: the LoRA layer whose forward and backward run the project's
minimal-work op (:mod:`lora_bench.kernels.autograd`)."""

from __future__ import annotations

from lora_bench.kernels.autograd import lora_linear
from lora_bench.lora.layer import LoRALinearBase


class LinearWithLoRAKernel(LoRALinearBase):
    """``lora`` with the minimal-work op. Each call runs the plan the kernel policy chooses
    (:mod:`lora_bench.kernels.policy`): the C++ op in eager CUDA, the Triton kernels under CUDA-graph
    capture and torch.compile, torch ops on the CPU; ``policy.record_plans`` collects them."""

    variant = "lora-kernel"

    def forward(self, x):
        return lora_linear(x, self.linear.weight, self.linear.bias, self.lora.A, self.lora.B, self.lora.alpha)
