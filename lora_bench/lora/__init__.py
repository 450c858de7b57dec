"""LoRA variants and their registry (``--trainable-layers`` and ``--lora-variant`` -> layer class),
the update's scale, PiSSA's initialisation, the packed layer, and the formats a frozen base is stored
in (``bases``, used through ``quantized``)."""

from __future__ import annotations

from lora_bench.lora.inject import inject_lora
from lora_bench.lora.kernel import LinearWithDoRAKernel, LinearWithLoRAKernel
from lora_bench.lora.layer import (DoRALinearBase, LinearWithDoRA, LinearWithLoRA, LoRALayer, LoRALinearBase,
                                   lora_scale)
from lora_bench.lora.merged import LinearWithDoRAMerged, LinearWithLoRAMerged
from lora_bench.lora.pissa import pissa_init

LAYER_CLASSES: dict[tuple[str, str], type[LoRALinearBase]] = {
    ("lora", "lora"): LinearWithLoRA,
    ("lora-merged", "lora"): LinearWithLoRAMerged,
    ("lora-kernel", "lora"): LinearWithLoRAKernel,
    ("lora", "dora"): LinearWithDoRA,
    ("lora-merged", "dora"): LinearWithDoRAMerged,
    ("lora-kernel", "dora"): LinearWithDoRAKernel,
}


def lora_class(name: str, variant: str = "lora") -> type[LoRALinearBase]:
    """The layer class for a trainable-layers name and a LoRA variant (lora or dora)."""
    if (name, variant) in LAYER_CLASSES:
        return LAYER_CLASSES[(name, variant)]
    raise ValueError(f"{name!r} with variant {variant!r} is not a LoRA layer; choose lora, lora-merged or "
                     "lora-kernel, and variant lora or dora")


__all__ = ["LoRALayer", "LoRALinearBase", "DoRALinearBase", "LinearWithLoRA", "LinearWithLoRAMerged",
           "LinearWithLoRAKernel", "LinearWithDoRA", "LinearWithDoRAKernel", "LinearWithDoRAMerged", "inject_lora",
           "lora_class", "lora_scale", "pissa_init"]
