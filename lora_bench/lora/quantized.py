"""A frozen base stored other than full precision (``base_dtype``): the linear weights of the
transformer blocks held in one of the formats of :mod:`lora_bench.lora.bases` (bfloat16, torchao's
int8, NF4 and fp8, bitsandbytes' NF4), the adapters and the head left in full precision.
``store_base`` swaps a model's frozen linear layers for :class:`QuantizedLinear`; the names below
the imports are the formats' facade for the rest of the package. The formats, their products and
why: docs/quantized-base.md."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from lora_bench.lora.bases import BASES, base_format
from lora_bench.lora.bases.bitsandbytes_formats import Bnb4bit, bitsandbytes, cpu_row_problem, quant_state_bytes
from lora_bench.lora.bases.format import NF4_BLOCK, tensor_bytes
from lora_bench.lora.bases.torchao_formats import FP8_CAPABILITY, check_fp8_device, nf4_scaler_block, torchao
from lora_bench.lora.kernel import LinearWithLoRAKernel
from lora_bench.lora.layer import LinearWithLoRA, LoRALinearBase
from lora_bench.lora.merged import LinearWithLoRAMerged

FORMATS = tuple(BASES)
LIBRARY_FORMATS = tuple(n for n, f in BASES.items() if f.library == "torchao")  # what torchao stores
BNB_FORMATS = tuple(n for n, f in BASES.items() if f.library == "bitsandbytes")  # what bitsandbytes stores

KERNEL_FALLBACK = ("lora-kernel with base_dtype={fmt}: its fused op reads a full-precision weight, so its layers "
                   "run lora's layer (the frozen product through torchao's {fmt} linear, the adapter beside it)")


def library_versions(fmt: str) -> dict[str, str | None]:
    """The quantization library's version column for a run whose base is stored in ``fmt``
    (none for ``precision`` and bf16)."""
    return BASES[fmt].versions() if fmt in BASES else {}


def quantize_weight(weight: torch.Tensor, fmt: str):
    """``weight`` (out × in) stored in ``fmt``, on its device."""
    return base_format(fmt).quantize(weight.detach())


def dequantize(stored, fmt: str) -> torch.Tensor:
    """The values a stored weight stands for, in its high-precision dtype."""
    return base_format(fmt).dequantize(stored)


def stored_bytes(t) -> int:
    """Bytes a stored weight holds: bitsandbytes' packed codes with their quant state, a torchao
    tensor's inner tensors (quantized values, scales, code table), a plain tensor's elements."""
    return t.stored_bytes() if isinstance(t, Bnb4bit) else tensor_bytes(t)


class QuantizedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored in ``fmt``; its bias stays as it was (a frozen
    parameter). The stored weight is an attribute, not a parameter or buffer: it is made on the
    run's device, and neither ``Module.to``, the optimizer nor DDP's buffer broadcast touch it."""

    def __init__(self, linear: nn.Linear, fmt: str, device: torch.device | str):
        super().__init__()
        self.format = base_format(fmt)
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        self.weight_stored = self.format.quantize(linear.weight.detach().to(device))
        self._product = self.format.make_product()  # made once: the forward runs every step
        self.bias = (nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
                     if linear.bias is not None else None)

    def dequantized_weight(self) -> torch.Tensor:
        return self.format.dequantize(self.weight_stored)

    def stored_bytes(self) -> int:
        return self.format.stored_bytes(self.weight_stored)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        autocast = torch.is_autocast_enabled(kind)
        out_dtype = torch.get_autocast_dtype(kind) if autocast else x.dtype
        compute = self.format.compute_dtype or out_dtype
        with torch.autocast(kind, enabled=False) if autocast else contextlib.nullcontext():
            y = self._product(x.to(compute), self.weight_stored)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y.to(out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stored={self.fmt}"


def _as_lora(layer: LinearWithLoRAKernel) -> LinearWithLoRA:
    """``lora``'s layer holding the same base and adapter (the same parameters)."""
    out = LinearWithLoRA.__new__(LinearWithLoRA)
    nn.Module.__init__(out)
    out.linear, out.lora = layer.linear, layer.lora
    return out


def _store(parent: nn.Module, fmt: str, device: torch.device, notes: set[str]) -> int:
    count = 0
    for name, module in parent.named_children():
        if isinstance(module, LinearWithLoRAMerged):
            raise ValueError("lora-merged merges its update into the weight; a stored base cannot take it")
        if isinstance(module, LoRALinearBase) and isinstance(module.linear, nn.Linear) \
                and not module.linear.weight.requires_grad:
            if isinstance(module, LinearWithLoRAKernel):
                module = _as_lora(module)
                setattr(parent, name, module)
                notes.add(KERNEL_FALLBACK.format(fmt=fmt))
            module.linear = QuantizedLinear(module.linear, fmt, device)
            count += 1
        elif isinstance(module, nn.Linear):
            if module.weight.requires_grad:
                raise ValueError(f"{name}: a trainable linear layer cannot be stored as {fmt}")
            setattr(parent, name, QuantizedLinear(module, fmt, device))
            count += 1
        else:
            count += _store(module, fmt, device, notes)
    return count


def store_base(model: nn.Module, fmt: str, device: torch.device) -> tuple[int, list[str]]:
    """Store the frozen linear weights of ``model``'s transformer blocks in ``fmt`` on ``device``
    (LoRA layers keep their adapters; lora-kernel's layers become lora's). Returns how many layers,
    and what the run should say about it."""
    notes: set[str] = set()
    count = sum(_store(block, fmt, device, notes) for block in model.trf_blocks)
    return count, sorted(notes)


def base_weight_bytes(model: nn.Module) -> int | None:
    """Bytes the weights of the transformer blocks' linear layers hold as stored (quantized values
    with their scales; biases left out); None for a model without the book's blocks."""
    blocks = getattr(model, "trf_blocks", None)
    if blocks is None:
        return None
    total = 0
    for module in blocks.modules():
        if isinstance(module, QuantizedLinear):
            total += module.stored_bytes()
        elif isinstance(module, nn.Linear):
            total += stored_bytes(module.weight)
    return total


__all__ = ["BNB_FORMATS", "FORMATS", "FP8_CAPABILITY", "KERNEL_FALLBACK", "LIBRARY_FORMATS", "NF4_BLOCK", "Bnb4bit",
           "QuantizedLinear", "base_weight_bytes", "bitsandbytes", "check_fp8_device", "cpu_row_problem", "dequantize",
           "library_versions", "nf4_scaler_block", "quant_state_bytes", "quantize_weight", "store_base", "stored_bytes",
           "torchao"]
