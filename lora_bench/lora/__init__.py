"""LoRA variants and their registry: ``--trainable-layers`` name -> layer class."""

from __future__ import annotations

from .inject import inject_lora
from .layer import LinearWithLoRA, LoRALayer, LoRALinearBase
from .merged import LinearWithLoRAMerged


def lora_class(name: str) -> type[LoRALinearBase]:
    """The layer class for a trainable-layers name; the kernel variant is imported only when used."""
    if name == "lora":
        return LinearWithLoRA
    if name == "lora-merged":
        return LinearWithLoRAMerged
    if name == "lora-kernel":
        from .kernel import LinearWithLoRAKernel

        return LinearWithLoRAKernel
    raise ValueError(f"{name!r} is not a LoRA variant; choose lora, lora-merged or lora-kernel")


__all__ = ["LoRALayer", "LoRALinearBase", "LinearWithLoRA", "LinearWithLoRAMerged", "inject_lora", "lora_class"]
