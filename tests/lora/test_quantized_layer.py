"""The quantized frozen base (lora_bench.lora.quantized): a LoRA layer whose base weight torchao
(or, for nf4-bnb and nf4-bnb-nodq, bitsandbytes) stores, against a float64 evaluation that uses the DEQUANTIZED
weight (so the bound is the products' rounding alone, not the quantization error), and the
quantization error itself against each format's bound, on fresh random weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from lora_bench.lora.layer import LinearWithLoRA
from lora_bench.lora.quantized import NF4_BLOCK, QuantizedLinear, nf4_scaler_block, stored_bytes
from tests.numerics import dot_tol, fresh, lora_chains, rel_err, rounded_input_tol

pytest.importorskip("torchao")

# QLoRA's NF4 code values (Dettmers et al. 2023, appendix E), as torchao and bitsandbytes hold them
NF4_CODES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0)
NF4_HALF_GAP = max(b - a for a, b in zip(NF4_CODES, NF4_CODES[1:])) / 2
U32 = 2.0 ** -24

K, N, R, ROWS = 96, 64, 4, 2 * 5  # weights a multiple of 64 (NF4 blocks), batch (2, 5)
KB = 128  # bitsandbytes' CPU kernels need rows of whole 64-weight blocks (quantized.cpu_row_problem)


def _layer(fmt: str, dtype: torch.dtype, k: int = K) -> tuple[LinearWithLoRA, torch.Tensor]:
    """A LoRA layer (alpha 2: exact in every dtype) on a fresh random base stored in ``fmt``, its
    adapter fresh too (B nonzero, so its gradients are not trivially zero), and its input."""
    linear = nn.Linear(k, N)
    with torch.no_grad():
        linear.weight.copy_(fresh(N, k, device="cpu", dtype=torch.float32, scale=k ** -0.5))
        linear.bias.copy_(fresh(N, device="cpu", dtype=torch.float32))
    linear.requires_grad_(False)
    layer = LinearWithLoRA(linear, R, 2.0)
    with torch.no_grad():
        layer.lora.A.copy_(fresh(k, R, device="cpu", dtype=torch.float32, scale=k ** -0.5))
        layer.lora.B.copy_(fresh(R, N, device="cpu", dtype=torch.float32))
    layer.linear = QuantizedLinear(linear, fmt, "cpu")
    layer.lora.to(dtype)
    return layer, fresh(2, 5, k, device="cpu", dtype=dtype).requires_grad_(True)


def _float64(layer: LinearWithLoRA, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """y, grad x, grad A, grad B in float64 with the dequantized weight in place of the stored one."""
    w = layer.linear.dequantized_weight().double()
    b = layer.linear.bias.double()
    a = layer.lora.A.detach().double().requires_grad_(True)
    bm = layer.lora.B.detach().double().requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    y = x64 @ w.T + b + layer.lora.alpha * (x64 @ a @ bm)
    return [y, *torch.autograd.grad(y, [x64, a, bm], g.double())]


@pytest.mark.parametrize("fmt", ["int8", "nf4", "bf16", "nf4-bnb", "nf4-bnb-nodq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_base_layer_matches_float64_of_the_dequantized_weight(fmt, dtype):
    """Output and gradients of x, A and B, each within the bound of its longest chain: float32
    activations, λ·u·√k (dot_tol); bfloat16 activations, the 16-bit chain's 3 roundings
    (rounded_input_tol) plus one for the dequantized weight rounded to bfloat16 for the product."""
    if fmt.startswith("nf4-bnb"):
        pytest.importorskip("bitsandbytes")
    k = KB if fmt.startswith("nf4-bnb") else K
    layer, x = _layer(fmt, dtype, k)
    g = fresh(2, 5, N, device="cpu", dtype=dtype)
    y = layer(x)
    assert y.dtype == dtype
    got = [y, *torch.autograd.grad(y, [x, layer.lora.A, layer.lora.B], g)]
    want = _float64(layer, x, g)
    chains = lora_chains(rows=ROWS, k=k, n=N, r=R)
    for name, o, w in zip(("y", "grad_x", "grad_A", "grad_B"), got, want):
        tol = dot_tol(torch.float32, chains[name]) if dtype == torch.float32 else rounded_input_tol(torch.bfloat16, 4)
        assert rel_err(o, w) <= tol, f"{fmt} {dtype} {name}: {rel_err(o, w):.3g} > {tol:.3g}"


def test_int8_error_is_at_most_half_a_step_of_its_channel():
    """int8 weight-only, per output channel: each row's scale is its absmax over 127 at most (the
    symmetric range), and every weight lies within half a scale step of its dequantized value, up
    to float32's rounding of the quotient w / scale and of the product code · scale (values of at
    most 128 steps: 128·u steps each)."""
    w = fresh(N, K, device="cpu", dtype=torch.float32, scale=K ** -0.5)
    q = QuantizedLinear(_linear(w), "int8", "cpu")
    stored = q.weight_stored
    assert stored.qdata.dtype == torch.int8 and stored.qdata.shape == (N, K)
    scale = stored.scale.reshape(N, 1).double()
    assert scale.numel() == N  # one scale per output channel
    assert (scale <= w.abs().amax(dim=1, keepdim=True).double() / 127 * (1 + U32)).all()
    err = (w.double() - q.dequantized_weight().double()).abs()
    assert (err <= scale * (0.5 + 2 * 128 * U32)).all(), float((err / scale).max())
    assert (err > scale / 4).any()  # the bound is about this format: rounding uses most of it


def test_nf4_error_is_within_its_block_scale_times_half_the_largest_code_gap():
    """NF4, blocks of 64: each weight rounds to the nearest code of its block's absmax-normalised
    values (at most half the largest gap between codes, times the absmax), and the absmax itself
    is stored as int8 around its mean per block of scales ("double quantization": off by at most
    that block's absmax deviation / 128, which the weight's code, at most 1 in size, carries)."""
    w = fresh(N, K, device="cpu", dtype=torch.float32, scale=K ** -0.5)
    q = QuantizedLinear(_linear(w), "nf4", "cpu")
    assert torch.allclose(q.weight_stored.nf4.double(), torch.tensor(NF4_CODES, dtype=torch.float64), atol=1e-4)
    assert q.weight_stored.quantized_data.dtype == torch.uint8
    assert q.weight_stored.quantized_data.numel() == w.numel() // 2  # two 4-bit codes a byte
    blocks = w.double().reshape(-1, NF4_BLOCK)
    absmax = blocks.abs().amax(dim=1)
    per = nf4_scaler_block(absmax.numel())
    dev = (absmax - absmax.mean()).reshape(-1, per)
    scale_err = (dev.abs().amax(dim=1, keepdim=True) / 128).expand(-1, per).reshape(-1)
    bound = (absmax * NF4_HALF_GAP + scale_err) * (1 + 8 * U32)
    err = (blocks - q.dequantized_weight().double().reshape(-1, NF4_BLOCK)).abs()
    assert (err <= bound.unsqueeze(1)).all(), float((err / bound.unsqueeze(1)).max())


def test_bitsandbytes_nf4_error_is_within_its_block_scale_times_half_the_largest_code_gap():
    """nf4-bnb, blocks of 64: each weight rounds to the nearest code of its block's values divided
    by their absmax (at most half the largest gap between codes, times the absmax), and is
    dequantized with the absmax as stored (8-bit codes around their mean per block of 256, "double
    quantization"): off by at most that stored absmax's error, which the code, at most 1 in size,
    carries. The stored absmaxes are read back from the quant state itself."""
    functional = pytest.importorskip("bitsandbytes.functional")
    w = fresh(N, KB, device="cpu", dtype=torch.float32, scale=KB ** -0.5)
    q = QuantizedLinear(_linear(w), "nf4-bnb", "cpu")
    packed, state = q.weight_stored.packed, q.weight_stored.state
    assert packed.dtype == torch.uint8 and packed.numel() == w.numel() // 2  # two 4-bit codes a byte
    assert state.quant_type == "nf4" and state.blocksize == NF4_BLOCK and state.nested
    assert state.absmax.dtype == torch.uint8 and state.absmax.numel() == w.numel() // NF4_BLOCK
    assert torch.allclose(state.code.double(), torch.tensor(NF4_CODES, dtype=torch.float64), atol=1e-6)
    stored_absmax = functional.dequantize_blockwise(state.absmax, state.state2).double() + float(state.offset)
    blocks = w.double().reshape(-1, NF4_BLOCK)
    absmax = blocks.abs().amax(dim=1)
    bound = (absmax * NF4_HALF_GAP + (absmax - stored_absmax).abs()) * (1 + 8 * U32)
    err = (blocks - q.dequantized_weight().double().reshape(-1, NF4_BLOCK)).abs()
    assert (err <= bound.unsqueeze(1)).all(), float((err / bound.unsqueeze(1)).max())
    assert (err > bound.unsqueeze(1) / 2).any()  # the bound is about this format: rounding uses most of it


def test_bitsandbytes_nf4_without_double_quantization_keeps_each_block_absmax_exactly():
    """nf4-bnb-nodq: the same codes as nf4-bnb, each block's absmax kept in float32 (no nested
    state), equal to the block's own absmax; so each weight is off by at most half the largest gap
    between codes times that absmax."""
    pytest.importorskip("bitsandbytes")
    w = fresh(N, KB, device="cpu", dtype=torch.float32, scale=KB ** -0.5)
    q = QuantizedLinear(_linear(w), "nf4-bnb-nodq", "cpu")
    state = q.weight_stored.state
    assert state.quant_type == "nf4" and state.blocksize == NF4_BLOCK and not state.nested
    assert state.absmax.dtype == torch.float32 and state.absmax.numel() == w.numel() // NF4_BLOCK
    blocks = w.double().reshape(-1, NF4_BLOCK)
    absmax = blocks.abs().amax(dim=1)
    assert torch.equal(state.absmax.double(), absmax)
    double = QuantizedLinear(_linear(w), "nf4-bnb", "cpu").weight_stored.packed
    assert torch.equal(q.weight_stored.packed, double)  # the same 4-bit codes: only the scales' storage differs
    bound = absmax * NF4_HALF_GAP * (1 + 8 * U32)
    err = (blocks - q.dequantized_weight().double().reshape(-1, NF4_BLOCK)).abs()
    assert (err <= bound.unsqueeze(1)).all(), float((err / bound.unsqueeze(1)).max())
    assert (err > bound.unsqueeze(1) / 2).any()


def test_bitsandbytes_nf4_dequantizes_straight_to_the_compute_dtype():
    """Under bf16 autocast the bf16 product reads the weight dequantized to bf16 (the quant state's
    output dtype), no float32 copy; the stored codes and absmaxes are the float32 state's, shared."""
    pytest.importorskip("bitsandbytes")
    layer, x = _layer("nf4-bnb", torch.float32, KB)
    stored = layer.linear.weight_stored
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer.linear(x)
    assert y.dtype == torch.bfloat16
    bf16 = stored.state_for(torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and stored.state.dtype == torch.float32
    assert bf16.absmax is stored.state.absmax and bf16.state2 is stored.state.state2


def test_nf4_code_values_are_the_qlora_reference_ones():
    """torchao's NF4 codes are bitsandbytes' (the QLoRA reference implementation's)."""
    functional = pytest.importorskip("bitsandbytes.functional")
    codes = functional.get_4bit_type("nf4", device="cpu").double()
    assert torch.allclose(codes, torch.tensor(NF4_CODES, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("fmt, per_weight", [("int8", 1), ("nf4", 0.5), ("bf16", 2), ("nf4-bnb", 0.5),
                                             ("nf4-bnb-nodq", 0.5)])
def test_stored_bytes_count_the_format(fmt, per_weight):
    """Bytes held: the values at their width, plus the scales (int8: one float32 scale and one int8
    zero point, 0 for the symmetric format torchao keeps anyway, per row; NF4: one
    int8 per block of 64 and a float32 per block of scales, the 16-value code table, the mean;
    bitsandbytes' NF4: one 8-bit code per block of 64 and a float32 per block of 256 of those, the
    16-value NF4 table, the 256-value table of the absmaxes' codes, their mean; without double
    quantization: a float32 absmax per block of 64 and the 16-value NF4 table)."""
    if fmt.startswith("nf4-bnb"):
        pytest.importorskip("bitsandbytes")
    w = fresh(N, KB if fmt.startswith("nf4-bnb") else K, device="cpu", dtype=torch.float32)
    q = QuantizedLinear(_linear(w), fmt, "cpu")
    blocks = w.numel() // NF4_BLOCK
    extra = {"int8": 5 * N, "nf4": blocks + 4 * (blocks // nf4_scaler_block(blocks)) + 16 * 4 + 4, "bf16": 0,
             "nf4-bnb": blocks + 4 * -(-blocks // 256) + 16 * 4 + 256 * 4 + 4, "nf4-bnb-nodq": 4 * blocks + 16 * 4}[fmt]
    assert q.stored_bytes() == per_weight * w.numel() + extra
    assert stored_bytes(w) == 4 * w.numel()


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_compiled_layer_keeps_only_the_stored_weight_for_backward(fmt):
    """Under torch.compile a LoRA layer on a stored base matches float64 of the dequantized weight
    (float32 bounds), and what its compiled step keeps from forward to backward holds no
    full-precision copy of the weight: every saved floating tensor is smaller than the weight."""
    torch._dynamo.reset()
    layer, x = _layer(fmt, torch.float32)
    g = fresh(2, 5, N, device="cpu", dtype=torch.float32)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = torch.compile(layer)(x)
    got = [y, *torch.autograd.grad(y, [x, layer.lora.A, layer.lora.B], g)]
    chains = lora_chains(rows=ROWS, k=K, n=N, r=R)
    for name, o, w in zip(("y", "grad_x", "grad_A", "grad_B"), got, _float64(layer, x, g)):
        tol = dot_tol(torch.float32, chains[name])
        assert rel_err(o, w) <= tol, f"compiled {fmt} {name}: {rel_err(o, w):.3g} > {tol:.3g}"
    assert saved, "the compiled layer saved nothing for backward"
    weight_sized = [(tuple(t.shape), t.dtype) for t in saved if t.is_floating_point() and t.numel() >= N * K]
    assert not weight_sized, f"compiled {fmt} keeps weight-sized floating tensors for backward: {weight_sized}"


@pytest.mark.slow
def test_compiled_int8_in_bfloat16_is_not_rewritten_into_the_decoding_kernel():
    """In bfloat16, torchao's int8 product traced as it is (``mm(x, int8 weight cast) * scales``) is
    what inductor's post-grad pass rewrites into ``_weight_int8pack_mm`` (its ``woq_matcher_count``),
    a kernel for a few rows of activations; the layer's compiled int8 product is not rewritten and
    matches float64 of the dequantized weight (bfloat16 bounds, as eager)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer, x = _layer("int8", torch.bfloat16)
    g = fresh(2, 5, N, device="cpu", dtype=torch.bfloat16)
    y = torch.compile(layer)(x)
    got = [y, *torch.autograd.grad(y, [x, layer.lora.A, layer.lora.B], g)]
    assert counters["inductor"]["woq_matcher_count"] == 0, "the compiled int8 product became _weight_int8pack_mm"
    for name, o, w in zip(("y", "grad_x", "grad_A", "grad_B"), got, _float64(layer, x, g)):
        tol = rounded_input_tol(torch.bfloat16, 4)
        assert rel_err(o, w) <= tol, f"compiled int8 bfloat16 {name}: {rel_err(o, w):.3g} > {tol:.3g}"


def test_every_declared_base_dtype_is_one_registered_format_whose_library_version_is_a_column():
    """The settings declare the base_dtype names; the registry holds one format for each but
    ``precision`` (no stored base), and each format's library version goes to a declared column."""
    from lora_bench.config import BASE_DTYPE_DEFAULT, BASE_DTYPES
    from lora_bench.lora.bases import BASES
    from lora_bench.results.schema import ENV_COLUMNS

    assert sorted(BASES) == sorted(set(BASE_DTYPES) - {BASE_DTYPE_DEFAULT})
    assert all(name == fmt.name for name, fmt in BASES.items())
    columns = {c.name for c in ENV_COLUMNS}
    assert {"torchao_version", "bitsandbytes_version"} == {k for f in BASES.values() for k in f.versions()} <= columns


def test_the_stored_weight_is_not_a_parameter_and_takes_no_gradient():
    layer, x = _layer("int8", torch.float32)
    names = [n for n, _ in layer.named_parameters()]
    assert names == ["linear.bias", "lora.A", "lora.B"]
    assert not layer.linear.bias.requires_grad
    layer(x).sum().backward()
    assert layer.lora.A.grad is not None and layer.linear.bias.grad is None


def test_autocast_computes_in_its_dtype():
    layer, x = _layer("nf4", torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer.linear(x)
    assert y.dtype == torch.bfloat16


def _linear(w: torch.Tensor) -> nn.Linear:
    out = nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        out.weight.copy_(w)
    return out.requires_grad_(False)


# -- fp8: a CUDA GPU of compute capability 8.9 or newer ------------------------------------------
def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


U_E4M3 = 2.0 ** -4  # float8 e4m3: 3 mantissa bits


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="fp8 needs a CUDA GPU of compute capability 8.9 or newer")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_layer_matches_float64_of_the_dequantized_weight(dtype):
    """fp8 rowwise: the product quantizes its activations rowwise to e4m3 as well, so the output's
    bound adds e4m3's unit roundoff for the activations (each in its row's range: relative
    rounding, at most u) to the bfloat16 chain's (x to bf16, the product's output, the adapter's
    two products, the sum: 5 roundings). The gradients run in bfloat16 through the dequantized
    weight: the 16-bit chain plus the weight's rounding to bfloat16 (4)."""
    layer, x = _layer_on_cuda(dtype)
    g = fresh(2, 5, N, device="cuda", dtype=dtype)
    y = layer(x)
    assert y.dtype == dtype
    got = [y, *torch.autograd.grad(y, [x, layer.lora.A, layer.lora.B], g)]
    want = _float64(layer, x, g)
    for name, o, w in zip(("y", "grad_x", "grad_A", "grad_B"), got, want):
        tol = U_E4M3 + rounded_input_tol(torch.bfloat16, 5) if name == "y" else rounded_input_tol(torch.bfloat16, 4)
        assert rel_err(o, w) <= tol, f"fp8 {dtype} {name}: {rel_err(o, w):.3g} > {tol:.3g}"
    assert layer.linear.weight_stored.qdata.dtype == torch.float8_e4m3fn


def _layer_on_cuda(dtype: torch.dtype, fmt: str = "fp8", k: int = K) -> tuple[LinearWithLoRA, torch.Tensor]:
    linear = _linear(fresh(N, k, device="cpu", dtype=torch.float32, scale=k ** -0.5))
    with torch.no_grad():
        linear.bias.copy_(fresh(N, device="cpu", dtype=torch.float32))
    layer = LinearWithLoRA(copy.deepcopy(linear), R, 2.0)
    with torch.no_grad():
        layer.lora.B.copy_(fresh(R, N, device="cpu", dtype=torch.float32))
    layer.lora.to("cuda", dtype)
    layer.linear = QuantizedLinear(linear, fmt, torch.device("cuda"))
    layer.linear.bias.data = layer.linear.bias.data.cuda()
    return layer, fresh(2, 5, k, device="cuda", dtype=dtype).requires_grad_(True)


# -- nf4-bnb on CUDA: bitsandbytes' CUDA kernels --------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes' CUDA kernels need a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["nf4-bnb", "nf4-bnb-nodq"])
def test_bitsandbytes_nf4_layer_on_cuda_matches_float64_of_the_dequantized_weight(fmt, dtype):
    """nf4-bnb on CUDA, eager and replayed as a CUDA graph on new inputs: output and gradients of
    x, A and B within the bounds of the CPU test (float32: λ·u·√k; bfloat16: the 16-bit chain's
    roundings plus the weight's)."""
    pytest.importorskip("bitsandbytes")
    from lora_bench.train.graphs import warm_up

    layer, x = _layer_on_cuda(dtype, fmt, KB)
    chains = lora_chains(rows=ROWS, k=KB, n=N, r=R)

    def check(got, x, g, how):
        want = _float64(layer, x, g)
        for name, o, w in zip(("y", "grad_x", "grad_A", "grad_B"), got, want):
            fp32 = dtype == torch.float32
            tol = dot_tol(torch.float32, chains[name]) if fp32 else rounded_input_tol(torch.bfloat16, 4)
            assert rel_err(o, w) <= tol, f"{fmt} {dtype} {how} {name}: {rel_err(o, w):.3g} > {tol:.3g}"

    def step(x, g):
        y = layer(x)
        return [y, *torch.autograd.grad(y, [x, layer.lora.A, layer.lora.B], g)]

    g = fresh(2, 5, N, device="cuda", dtype=dtype)
    check(step(x, g), x, g, "eager")
    static_x, static_g = x.detach().clone().requires_grad_(True), g.clone()
    warm_up(lambda: step(static_x, static_g), 3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static_x, static_g)
    new_x, new_g = fresh(2, 5, KB, device="cuda", dtype=dtype), fresh(2, 5, N, device="cuda", dtype=dtype)
    with torch.no_grad():
        static_x.copy_(new_x)
        static_g.copy_(new_g)
    graph.replay()
    torch.cuda.synchronize()
    check([t.clone() for t in out], new_x.requires_grad_(True), new_g, "graph")
