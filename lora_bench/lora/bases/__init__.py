"""The formats a frozen base can be stored in (``base_dtype`` other than ``precision``), one
declared :class:`~lora_bench.lora.bases.format.BaseFormat` each, by the backend that stores it:

  bf16          torch: the weight in bfloat16                                  bases/bf16.py
  int8 nf4 fp8  torchao: int8 weight-only, NF4, float8 rowwise                 bases/torchao_formats.py
  nf4-bnb       bitsandbytes: NF4 with and without double quantization         bases/bitsandbytes_formats.py
  nf4-bnb-nodq

``base_format(name)`` is the entry of a name. The formats, their products and their measured
costs: docs/quantized-base.md."""

from __future__ import annotations

from lora_bench.lora.bases import bf16, bitsandbytes_formats, torchao_formats
from lora_bench.lora.bases.format import BaseFormat

BASES: dict[str, BaseFormat] = {f.name: f for module in (bf16, torchao_formats, bitsandbytes_formats)
                                for f in module.FORMATS}


def base_format(name: str) -> BaseFormat:
    """The declared format of a ``base_dtype`` name; ValueError for a name that is none."""
    try:
        return BASES[name]
    except KeyError:
        raise ValueError(f"base format {name!r}: expected one of {', '.join(BASES)}") from None


__all__ = ["BASES", "BaseFormat", "base_format"]
