"""Replace every ``nn.Linear`` in a model by a LoRA variant, recursively, in registration order
(the order fixes which RNG draws initialise which adapter)."""

from __future__ import annotations

import torch.nn as nn

from lora_bench.lora.layer import LoRALinearBase


def inject_lora(model: nn.Module, *, cls: type[LoRALinearBase], rank: int, alpha: float, **options) -> int:
    """Wrap every ``nn.Linear`` below ``model`` with ``cls`` (given ``options``: DoRA's
    ``detach_norm``); returns how many were wrapped.

    Unlike the reference, the chosen variant is applied at every depth (the reference forgot to
    pass its 'merged' flag down the recursion, so only the top-level head got it)."""
    count = 0
    for name, module in model.named_children():
        if isinstance(module, nn.Linear):
            setattr(model, name, cls(module, rank, alpha, **options))
            count += 1
        else:
            count += inject_lora(module, cls=cls, rank=rank, alpha=alpha, **options)
    return count
