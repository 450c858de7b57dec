"""``bf16``: the weight in bfloat16, cast to the activations' dtype for each product."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lora_bench.lora.bases.format import BaseFormat


def _product(x: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    return F.linear(x, stored.to(x.dtype))


FORMATS = (BaseFormat("bf16", None, quantize=lambda w: w.to(torch.bfloat16), dequantize=lambda stored: stored,
                      make_product=lambda: _product),)
