"""The formats bitsandbytes, the QLoRA reference library, stores: NF4 with double quantization
(``nf4-bnb``: the absmaxes 8-bit) and without (``nf4-bnb-nodq``: the absmaxes in float32), both
multiplied by ``matmul_4bit``, which dequantizes the weight before each product, forward and
backward. bitsandbytes is imported only when one is used."""

from __future__ import annotations

import copy
import functools
from types import ModuleType

import torch

from lora_bench.lora.bases.format import NF4_BLOCK, BaseFormat, Product
from lora_bench.optional import QUANT_EXTRA, require_quietly


def bitsandbytes(purpose: str) -> ModuleType:
    """bitsandbytes imported (its loader's notes about optional CPU kernels it cannot fetch kept
    quiet), or a UsageError naming the extra that installs it."""
    return require_quietly("bitsandbytes", purpose=purpose, extra=QUANT_EXTRA)


def cpu_row_problem(emb_dim: int) -> str | None:
    """Why bitsandbytes' 4-bit weights cannot be used on the CPU at width ``emb_dim``, or None: its
    CPU kernels (0.50) dequantize a weight whose rows (in_features: emb_dim, and 4·emb_dim for the
    MLP's output layer) are not a whole number of 64-weight blocks into wrong values, so its products
    would be wrong; every GPT-2 size's widths are multiples of 64."""
    if emb_dim % NF4_BLOCK:
        return (f"bitsandbytes' CPU kernels compute the 4-bit products wrongly for layers whose input width is not "
                f"a multiple of {NF4_BLOCK} (emb_dim={emb_dim})")
    return None


def quant_state_bytes(state) -> int:
    """Bytes a bitsandbytes 4-bit quant state holds: the absmaxes (8-bit under double quantization),
    the code table, and the nested state's absmaxes, code table and offset."""
    total = 0
    for t in (state.absmax, state.code, state.offset):
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    if getattr(state, "state2", None) is not None:
        total += quant_state_bytes(state.state2)
    return total


class Bnb4bit:
    """A weight bitsandbytes holds as NF4: the packed codes (two a byte, one column of uint8) and
    their quant state (absmaxes per block of 64, stored 8-bit around their mean; the code table; the
    weight's shape and dtype). ``state_for`` gives the state that dequantizes straight to a compute
    dtype, so a bf16 product reads no float32 copy of the weight."""

    def __init__(self, packed: torch.Tensor, state):
        self.packed, self.state = packed, state
        self._states = {state.dtype: state}

    def state_for(self, dtype: torch.dtype):
        if dtype not in self._states:
            other = copy.copy(self.state)
            other.dtype = dtype
            self._states[dtype] = other
        return self._states[dtype]

    def stored_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + quant_state_bytes(self.state)


def _quantize(w: torch.Tensor, *, name: str, double: bool) -> Bnb4bit:
    functional = bitsandbytes(f"base_dtype={name}").functional
    packed, state = functional.quantize_4bit(w.contiguous(), blocksize=NF4_BLOCK, compress_statistics=double,
                                             quant_type="nf4", quant_storage=torch.uint8)
    return Bnb4bit(packed, state)


def _dequantize(stored: Bnb4bit, *, name: str) -> torch.Tensor:
    return bitsandbytes(f"base_dtype={name}").functional.dequantize_4bit(stored.packed, stored.state)


def _make_product(name: str) -> Product:
    """bitsandbytes' 4-bit product (its own autograd function, the input's gradient through the
    dequantized weight), its kernel looked up once: the product runs every step."""
    matmul_4bit = bitsandbytes(f"base_dtype={name}").matmul_4bit

    def product(x: torch.Tensor, stored: Bnb4bit) -> torch.Tensor:
        return matmul_4bit(x, stored.packed.t(), quant_state=stored.state_for(x.dtype))

    return product


def _nf4(name: str, *, double: bool) -> BaseFormat:
    return BaseFormat(name, "bitsandbytes", quantize=functools.partial(_quantize, name=name, double=double),
                      dequantize=functools.partial(_dequantize, name=name),
                      make_product=functools.partial(_make_product, name), stored_bytes=Bnb4bit.stored_bytes)


FORMATS = (_nf4("nf4-bnb", double=True), _nf4("nf4-bnb-nodq", double=False))
