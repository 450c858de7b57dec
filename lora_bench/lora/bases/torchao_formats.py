"""The formats torchao stores: ``int8`` (weight-only, one absmax scale per output channel), ``nf4``
(QLoRA's NormalFloat, blocks of 64 with double-quantized scales) and ``fp8`` (float8 e4m3
rowwise, CUDA compute capability 8.9 or newer). torchao is imported only when one is used."""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lora_bench.errors import UsageError
from lora_bench.lora.bases.format import NF4_BLOCK, BaseFormat
from lora_bench.optional import QUANT_EXTRA, require_quietly

NF4_SCALER_BLOCK = 256  # scales per int8 block of scales (torchao's default), or fewer where a layer has fewer
FP8_CAPABILITY = (8, 9)  # torch._scaled_mm's float8 products: Ada, Hopper and newer


def torchao(purpose: str) -> ModuleType:
    """torchao imported (its loader's notes about CUDA extensions a CPU build cannot load kept
    quiet), or a UsageError naming the extra that installs it."""
    return require_quietly("torchao", purpose=purpose, extra=QUANT_EXTRA)


def check_fp8_device(device: torch.device) -> None:
    """UsageError unless ``device`` runs torch._scaled_mm's float8 rowwise products."""
    if device.type != "cuda":
        raise UsageError(f"base_dtype=fp8 needs a CUDA GPU of compute capability {FP8_CAPABILITY[0]}."
                         f"{FP8_CAPABILITY[1]} or newer (torch._scaled_mm); the run's device is {device}: choose "
                         "base_dtype precision, bf16, int8 or nf4")
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_CAPABILITY:
        raise UsageError(f"base_dtype=fp8 needs a CUDA GPU of compute capability {FP8_CAPABILITY[0]}."
                         f"{FP8_CAPABILITY[1]} or newer (torch._scaled_mm's float8 products); {device} has "
                         f"{cap[0]}.{cap[1]}: choose base_dtype bf16, int8 or nf4")


def nf4_scaler_block(n_blocks: int) -> int:
    """The scales per int8 block of scales for a weight of ``n_blocks`` NF4 blocks: torchao's 256,
    or the largest divisor of ``n_blocks`` below it (torchao needs an exact division)."""
    return max(d for d in range(1, min(NF4_SCALER_BLOCK, n_blocks) + 1) if n_blocks % d == 0)


def _one_layer(weight: torch.Tensor) -> nn.Module:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return nn.Sequential(layer)


def _quantize_nf4(w: torch.Tensor) -> torch.Tensor:
    q = torchao("base_dtype=nf4").quantization
    if w.numel() % NF4_BLOCK:
        raise UsageError(f"base_dtype=nf4 stores blocks of {NF4_BLOCK} weights; a {tuple(w.shape)} weight does "
                         "not divide into them")
    per = nf4_scaler_block(w.numel() // NF4_BLOCK)
    return q.to_nf4(w.contiguous(), block_size=NF4_BLOCK, scaler_block_size=per)


def _quantize_int8(w: torch.Tensor) -> torch.Tensor:
    q = torchao("base_dtype=int8").quantization
    holder = _one_layer(w.clone())
    q.quantize_(holder, q.Int8WeightOnlyConfig())
    return holder[0].weight.detach()


def _quantize_fp8(w: torch.Tensor) -> torch.Tensor:
    q = torchao("base_dtype=fp8").quantization
    check_fp8_device(w.device)
    holder = _one_layer(w.to(torch.bfloat16))
    q.quantize_(holder, q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow()))
    return holder[0].weight.detach()


class _ThroughDequantized(torch.autograd.Function):
    """torchao's product forward; the input's gradient through the dequantized weight backward."""

    @staticmethod
    def forward(ctx, x, stored):
        ctx.stored = stored
        return F.linear(x, stored)

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.stored.dequantize().to(grad.dtype), None


_PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _recompute_all_but_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _PRODUCTS else CheckpointPolicy.MUST_RECOMPUTE


def _int8_dequantized_product(x: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    return F.linear(x, stored.dequantize().to(x.dtype))


def _checkpointed(product, x: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """An int8 or NF4 product as torch.compile traces it
    (docs/quantized-base.md#fusing-the-quantization-each-block-compiled).

    NF4 is torchao's NF4 linear; int8 multiplies by the dequantized weight instead of running
    torchao's int8 product, ``mm(x, int8 weight cast) * scales``: that is the pattern inductor's
    post-grad pass rewrites into ``aten._weight_int8pack_mm``, a kernel made for a few rows of
    activations (decoding): at 1558M and a batch of 960 rows its compiled forward took 2.27 s
    against the bf16 base's 11.7 ms.

    Traced whole, forward's dequantization is the one backward needs too, and the compiled graph
    would keep that full-precision copy of the weight from forward to backward (every block's, for
    the whole step); checkpointed with every op but the matrix products recomputed, backward
    dequantizes the stored weight again, as eager does."""
    return checkpoint(product, x, stored, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _recompute_all_but_products))


def _nf4_product(x: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """torchao's NF4 linear: its own autograd function, the input's gradient through the
    dequantized weight."""
    if torch.compiler.is_compiling():
        return _checkpointed(F.linear, x, stored)
    return F.linear(x, stored)


def _int8_product(x: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _checkpointed(_int8_dequantized_product, x, stored)
    return _ThroughDequantized.apply(x, stored)


def _fp8_product(x: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    return _ThroughDequantized.apply(x, stored)


FORMATS = (
    BaseFormat("int8", "torchao", quantize=_quantize_int8, dequantize=lambda stored: stored.dequantize(),
               make_product=lambda: _int8_product),
    BaseFormat("nf4", "torchao", quantize=_quantize_nf4, dequantize=lambda stored: stored.get_original_weight(),
               make_product=lambda: _nf4_product),
    # fp8's rowwise products take bf16 activations
    BaseFormat("fp8", "torchao", quantize=_quantize_fp8, dequantize=lambda stored: stored.dequantize(),
               make_product=lambda: _fp8_product, compute_dtype=torch.bfloat16),
)
