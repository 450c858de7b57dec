"""A frozen base stored other than full precision (``base_dtype``): the linear weights of the
transformer blocks held in bfloat16 or quantized by torchao, the adapters and the head left in full
precision (docs/quantized-base.md).

- ``bf16``: the weight in bfloat16, cast to the activations' dtype for each product.
- ``int8``: torchao's int8 weight-only format (``Int8WeightOnlyConfig``): int8 values with one
  absmax scale per output channel; torchao's linear runs the forward product.
- ``nf4``: torchao's NF4 (QLoRA's 4-bit NormalFloat, ``to_nf4``): 16 code values, one absmax scale
  per block of 64 weights, the scales themselves quantized to int8 per block of scales
  ("double quantization"); torchao's NF4 linear (``F.linear`` on its tensor) runs forward and backward.
- ``nf4-bnb``: the same NF4 format stored and multiplied by bitsandbytes, the QLoRA reference
  library (``quantize_4bit`` with double quantization, ``matmul_4bit``): its CUDA kernel dequantizes
  the weight before each bf16 or float32 product, forward and backward.
- ``nf4-bnb-nodq``: bitsandbytes' NF4 without double quantization (QLoRA's
  ``bnb_4bit_use_double_quant=False``): the scales kept in float32, 4 bytes a block of 64 instead of
  about 1, so a product needs no kernels to rebuild them before the weight's dequantization.
- ``fp8``: torchao's float8 rowwise format (``Float8DynamicActivationFloat8WeightConfig`` with
  ``PerRow``): float8 e4m3 weights with one scale per output channel; each product quantizes its
  activations rowwise too and runs ``torch._scaled_mm`` (CUDA, compute capability 8.9 or newer).

The backward of int8 and fp8 (and of torchao's nf4) is the input's gradient through the
dequantized weight: ``grad_out @ dequantize(W)``, the product the frozen weight needs (it takes no
gradient); so is bitsandbytes' ``matmul_4bit``'s. Under torch.compile the int8 and NF4 products'
dequantization is recomputed backward (selective checkpointing), so that the compiled step keeps
only the stored weight between forward and backward, as eager does; compiled int8 multiplies by
the dequantized weight (``_product_compiled`` says why). torchao and bitsandbytes are
imported only here (and by the transformers peer), and only when a run asks for one of their formats."""

from __future__ import annotations

import contextlib
import copy
import functools
from types import ModuleType

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lora_bench.errors import UsageError
from lora_bench.lora.kernel import LinearWithLoRAKernel
from lora_bench.lora.layer import LinearWithLoRA, LoRALinearBase
from lora_bench.lora.merged import LinearWithLoRAMerged
from lora_bench.optional import QUANT_EXTRA, installed_version, require_quietly

FORMATS = ("bf16", "int8", "nf4", "fp8", "nf4-bnb", "nf4-bnb-nodq")
LIBRARY_FORMATS = ("int8", "nf4", "fp8")  # what torchao stores
BNB_FORMATS = ("nf4-bnb", "nf4-bnb-nodq")  # what bitsandbytes stores (with and without double quantization)
NF4_BLOCK = 64  # weights per absmax scale (QLoRA's, torchao's and bitsandbytes' default)
NF4_SCALER_BLOCK = 256  # scales per int8 block of scales (torchao's default), or fewer where a layer has fewer
FP8_CAPABILITY = (8, 9)  # torch._scaled_mm's float8 products: Ada, Hopper and newer

KERNEL_FALLBACK = ("lora-kernel with base_dtype={fmt}: its fused op reads a full-precision weight, so its layers "
                   "run lora's layer (the frozen product through torchao's {fmt} linear, the adapter beside it)")


def torchao(purpose: str) -> ModuleType:
    """torchao imported (its loader's notes about CUDA extensions a CPU build cannot load kept
    quiet), or a UsageError naming the extra that installs it."""
    return require_quietly("torchao", purpose=purpose, extra=QUANT_EXTRA)


def bitsandbytes(purpose: str) -> ModuleType:
    """bitsandbytes imported (its loader's notes about optional CPU kernels it cannot fetch kept
    quiet), or a UsageError naming the extra that installs it."""
    return require_quietly("bitsandbytes", purpose=purpose, extra=QUANT_EXTRA)


def library_versions(fmt: str) -> dict[str, str | None]:
    """The quantization library's version column for a run whose base is stored in ``fmt``."""
    if fmt in BNB_FORMATS:
        return {"bitsandbytes_version": installed_version("bitsandbytes")}
    return {"torchao_version": installed_version("torchao")} if fmt in LIBRARY_FORMATS else {}


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


def _one_layer(weight: torch.Tensor) -> nn.Module:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return nn.Sequential(layer)


def nf4_scaler_block(n_blocks: int) -> int:
    """The scales per int8 block of scales for a weight of ``n_blocks`` NF4 blocks: torchao's 256,
    or the largest divisor of ``n_blocks`` below it (torchao needs an exact division)."""
    return max(d for d in range(1, min(NF4_SCALER_BLOCK, n_blocks) + 1) if n_blocks % d == 0)


def quantize_weight(weight: torch.Tensor, fmt: str) -> torch.Tensor | Bnb4bit:
    """``weight`` (out × in) stored in ``fmt``, on its device."""
    w = weight.detach()
    if fmt == "bf16":
        return w.to(torch.bfloat16)
    if fmt in BNB_FORMATS:
        functional = bitsandbytes(f"base_dtype={fmt}").functional
        packed, state = functional.quantize_4bit(w.contiguous(), blocksize=NF4_BLOCK,
                                                 compress_statistics=fmt == "nf4-bnb", quant_type="nf4",
                                                 quant_storage=torch.uint8)
        return Bnb4bit(packed, state)
    ao = torchao(f"base_dtype={fmt}")
    q = ao.quantization
    if fmt == "nf4":
        if w.numel() % NF4_BLOCK:
            raise UsageError(f"base_dtype=nf4 stores blocks of {NF4_BLOCK} weights; a {tuple(w.shape)} weight does "
                             "not divide into them")
        per = nf4_scaler_block(w.numel() // NF4_BLOCK)
        return q.to_nf4(w.contiguous(), block_size=NF4_BLOCK, scaler_block_size=per)
    if fmt == "int8":
        holder = _one_layer(w.clone())
        q.quantize_(holder, q.Int8WeightOnlyConfig())
    elif fmt == "fp8":
        check_fp8_device(w.device)
        holder = _one_layer(w.to(torch.bfloat16))
        q.quantize_(holder, q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow()))
    else:
        raise ValueError(f"base format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return holder[0].weight.detach()


def dequantize(stored, fmt: str) -> torch.Tensor:
    """The values a stored weight stands for, in its high-precision dtype."""
    if fmt == "bf16":
        return stored
    if fmt in BNB_FORMATS:
        return bitsandbytes(f"base_dtype={fmt}").functional.dequantize_4bit(stored.packed, stored.state)
    if fmt == "nf4":
        return stored.get_original_weight()
    return stored.dequantize()


def stored_bytes(t) -> int:
    """Bytes a stored weight holds: bitsandbytes' packed codes with their quant state, a torchao
    tensor's inner tensors (quantized values, scales, code table), a plain tensor's elements."""
    if isinstance(t, Bnb4bit):
        return t.stored_bytes()
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(stored_bytes(inner) for inner in (getattr(t, n) for n in names) if inner is not None)
    return t.numel() * t.element_size()


class _ThroughDequantized(torch.autograd.Function):
    """torchao's product forward; the input's gradient through the dequantized weight backward."""

    @staticmethod
    def forward(ctx, x, stored, fmt):
        ctx.stored, ctx.fmt = stored, fmt
        return F.linear(x, stored)

    @staticmethod
    def backward(ctx, grad):
        return grad @ dequantize(ctx.stored, ctx.fmt).to(grad.dtype), None, None


_PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _recompute_all_but_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _PRODUCTS else CheckpointPolicy.MUST_RECOMPUTE


def _int8_product(x: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize(stored, "int8").to(x.dtype))


def _product_compiled(x: torch.Tensor, stored: torch.Tensor, fmt: str) -> torch.Tensor:
    """An int8 or NF4 product as torch.compile traces it.

    NF4 is torchao's NF4 linear; int8 multiplies by the dequantized weight instead of running
    torchao's int8 product, ``mm(x, int8 weight cast) * scales``: that is the pattern inductor's
    post-grad pass rewrites into ``aten._weight_int8pack_mm``, a kernel made for a few rows of
    activations (decoding): at 1558M and a batch of 960 rows its compiled forward took 2.27 s
    against the bf16 base's 11.7 ms (docs/quantized-base.md).

    Traced whole, forward's dequantization is the one backward needs too, and the compiled graph
    would keep that full-precision copy of the weight from forward to backward (every block's, for
    the whole step); checkpointed with every op but the matrix products recomputed, backward
    dequantizes the stored weight again, as eager does."""
    product = _int8_product if fmt == "int8" else F.linear
    return checkpoint(product, x, stored, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _recompute_all_but_products))


class QuantizedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored in ``fmt``; its bias stays as it was (a frozen
    parameter). The stored weight is an attribute, not a parameter or buffer: it is made on the
    run's device, and neither ``Module.to``, the optimizer nor DDP's buffer broadcast touch it."""

    def __init__(self, linear: nn.Linear, fmt: str, device: torch.device | str):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"base format {fmt!r}: expected one of {', '.join(FORMATS)}")
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        self.weight_stored = quantize_weight(linear.weight.detach().to(device), fmt)
        if fmt in BNB_FORMATS:  # looked up once: the forward runs every step
            self._matmul_4bit = bitsandbytes(f"base_dtype={fmt}").matmul_4bit
        self.bias = (nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
                     if linear.bias is not None else None)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize(self.weight_stored, self.fmt)

    def stored_bytes(self) -> int:
        return stored_bytes(self.weight_stored)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        autocast = torch.is_autocast_enabled(kind)
        out_dtype = torch.get_autocast_dtype(kind) if autocast else x.dtype
        # fp8's rowwise products take bf16 activations; the others compute in the activations' dtype
        compute = torch.bfloat16 if self.fmt == "fp8" else out_dtype
        with torch.autocast(kind, enabled=False) if autocast else contextlib.nullcontext():
            xc = x.to(compute)
            if self.fmt == "bf16":
                y = F.linear(xc, self.weight_stored.to(compute))
            elif self.fmt in ("nf4", "int8") and torch.compiler.is_compiling():
                y = _product_compiled(xc, self.weight_stored, self.fmt)
            elif self.fmt == "nf4":  # torchao's NF4 linear: its own autograd function, the same backward
                y = F.linear(xc, self.weight_stored)
            elif self.fmt in BNB_FORMATS:  # bitsandbytes' 4-bit product: its own autograd function, the same backward
                stored = self.weight_stored
                y = self._matmul_4bit(xc, stored.packed.t(), quant_state=stored.state_for(compute))
            else:
                y = _ThroughDequantized.apply(xc, self.weight_stored, self.fmt)
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
