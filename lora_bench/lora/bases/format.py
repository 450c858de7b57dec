"""One format a frozen base's weights can be stored in: what a backend module declares for it
(:mod:`lora_bench.lora.bases` lists them in order)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from lora_bench.optional import installed_version

NF4_BLOCK = 64  # weights per absmax scale (QLoRA's, torchao's and bitsandbytes' default)

Product = Callable[[torch.Tensor, Any], torch.Tensor]  # (activations in the compute dtype, stored weight) -> x·Wᵀ


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a torchao tensor's inner tensors (quantized values, scales, code
    table), a plain tensor's elements."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(inner) for inner in (getattr(t, n) for n in names) if inner is not None)
    return t.numel() * t.element_size()


@dataclasses.dataclass(frozen=True)
class BaseFormat:
    """A ``base_dtype`` value's storage. ``quantize``: a weight (out × in, on its device) as
    stored, or a UsageError where the format refuses it (the weight's shape, the device);
    ``dequantize``: the values a stored weight stands for; ``make_product``: the forward product
    (its backward the input's gradient through the dequantized weight), made once per layer;
    ``compute_dtype``: the activations' dtype for the product (None: the activations' own);
    ``stored_bytes``: bytes a stored weight holds; ``library``: the package that stores it, whose
    version each run records (None: torch itself)."""

    name: str
    library: str | None
    quantize: Callable[[torch.Tensor], Any]
    dequantize: Callable[[Any], torch.Tensor]
    make_product: Callable[[], Product]
    compute_dtype: torch.dtype | None = None
    stored_bytes: Callable[[Any], int] = tensor_bytes

    def versions(self) -> dict[str, str | None]:
        """The run's column for the library's version (none for torch's own formats)."""
        return {f"{self.library}_version": installed_version(self.library)} if self.library else {}
