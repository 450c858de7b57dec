"""LoRA variants and their registry (``--trainable-layers`` name -> layer class), the packed layer,
and the formats a frozen base is stored in (``bases``, used through ``quantized``)."""

from __future__ import annotations

from lora_bench.lora.inject import inject_lora
from lora_bench.lora.kernel import LinearWithLoRAKernel
from lora_bench.lora.layer import LinearWithLoRA, LoRALayer, LoRALinearBase
from lora_bench.lora.merged import LinearWithLoRAMerged


def lora_class(name: str) -> type[LoRALinearBase]:
    """The layer class for a trainable-layers name."""
    if name == "lora":
        return LinearWithLoRA
    if name == "lora-merged":
        return LinearWithLoRAMerged
    if name == "lora-kernel":
        return LinearWithLoRAKernel
    raise ValueError(f"{name!r} is not a LoRA variant; choose lora, lora-merged or lora-kernel")


__all__ = ["LoRALayer", "LoRALinearBase", "LinearWithLoRA", "LinearWithLoRAMerged", "LinearWithLoRAKernel", "inject_lora", "lora_class"]
