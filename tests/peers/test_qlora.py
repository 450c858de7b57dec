"""The QLoRA peer (implementation=hf with base_dtype=nf4): transformers loads the GPT-2 body 4-bit
with bitsandbytes, PEFT trains LoRA on it. Its frozen block weights are bitsandbytes' 4-bit codes
(no Conv1D left), the codes are the NF4 codes torchao gives the same weights, the LoRA layer's
output and gradients match a float64 evaluation on the dequantized weight, a tiny run trains and
records bitsandbytes' version and the weight bytes, and the combinations without a faithful
bitsandbytes analogue are refused. bitsandbytes' CPU backend runs the 4-bit products forward and
backward, so all of it runs on the CPU; the CUDA run is a GPU test."""

from __future__ import annotations

import importlib
import json
import math
from importlib import metadata

import pytest
import torch
import torch.nn as nn
from rich.console import Console

from lora_bench.classifier.book import model_config
from lora_bench.config import TrainConfig
from lora_bench.lora.quantized import NF4_BLOCK, dequantize, quantize_weight
from lora_bench.peers.hf import base_state, build_hf_classifier, hf_base_weight_bytes, linear4bit_modules
from lora_bench.results.store import read_runs
from lora_bench.train.context import RunContext
from lora_bench.train.run import execute_run
from paths import SAMPLE
from tests.numerics import UNIT_ROUNDOFF, dot_tol, fresh, lora_chains, rel_err, rounded_input_tol

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
pytest.importorskip("torchao")
functional = importlib.import_module("bitsandbytes.functional")

U32 = UNIT_ROUNDOFF[torch.float32]
TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # the four Conv1D of a GPT-2 block


def _cfg(**kw) -> TrainConfig:
    """A tiny LoRA run of the peer, 64 wide (bitsandbytes' CPU kernels need rows of whole 64-weight
    blocks, as every GPT-2 size has), whose periodic evaluation reads the same two training batches
    each time (fixed data)."""
    base = dict(model_size="tiny", emb_dim=64, weights="random", trainable_layers="lora", implementation="hf", device="cpu",
                data_file=str(SAMPLE), num_epochs=1, max_steps=9, eval_freq=4, eval_iter=2, skip_final_eval=True,
                warmup_steps=1, learning_rate=5e-3, lora_rank=4, lora_alpha=4.0, base_dtype="nf4")
    return TrainConfig(**{**base, **kw})


def _blocks(model) -> list[nn.Module]:
    return list(model.trf_blocks)


def _base_layer(block: nn.Module, target: str) -> nn.Module:
    module = block.get_submodule(target)
    return getattr(module, "base_layer", module)  # PEFT's LoRA wrapper holds the frozen layer


def _nf4_sizes(n: int) -> int:
    """Bytes bitsandbytes holds for an n-weight NF4 layer with double quantization: two codes a
    byte, one 8-bit absmax per block of 64, a float32 absmax per block of 256 absmaxes, the 16-value
    NF4 table, the 256-value table of the absmaxes' 8-bit code and their float32 offset (the mean)."""
    blocks = math.ceil(n / NF4_BLOCK)
    return n // 2 + blocks + 4 * math.ceil(blocks / 256) + 4 * 16 + 4 * 256 + 4


# -- the 4-bit body -----------------------------------------------------------------------------------

@pytest.mark.parametrize("precision, compute", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_every_frozen_block_weight_is_a_4bit_nf4_layer(precision, compute, tmp_path):
    """transformers turns each of a block's four Conv1D into bitsandbytes' Linear4bit (out × in),
    NF4 codes packed two a byte, blocks of 64, double quantization, products in the run's compute
    dtype; the adapters and the head stay float32 and are all that trains; the bytes recorded are
    the packed codes and their quant state (a float32 Conv1D body's are 4 a weight)."""
    ctx = RunContext(_cfg(precision=precision), cache_dir=tmp_path, progress=False)
    mcfg = ctx.mcfg
    four_bit = linear4bit_modules(ctx.model)
    assert len(four_bit) == 4 * mcfg.n_layers
    conv1d = importlib.import_module("transformers.pytorch_utils").Conv1D
    assert not any(isinstance(m, conv1d) for m in ctx.model.trf_blocks.modules())
    expected = 0
    for block in _blocks(ctx.model):
        for target in TARGETS:
            layer = _base_layer(block, target)
            assert isinstance(layer, bnb.nn.Linear4bit), target
            w = layer.weight
            state = w.quant_state
            n = layer.in_features * layer.out_features
            assert type(w).__name__ == "Params4bit" and w.dtype == torch.uint8 and w.numel() == n // 2
            assert not w.requires_grad and not layer.bias.requires_grad
            assert tuple(state.shape) == (layer.out_features, layer.in_features)
            assert (state.quant_type, state.blocksize, state.nested) == ("nf4", NF4_BLOCK, True)
            assert state.absmax.dtype == torch.uint8 and state.state2.blocksize == 256
            assert layer.compute_dtype == compute
            expected += _nf4_sizes(n)
    assert hf_base_weight_bytes(ctx.model) == expected == ctx.base_weight_mib * 2**20
    trainable = [(n, p) for n, p in ctx.model.named_parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for _, p in trainable)
    assert all(".lora_A." in n or ".lora_B." in n or ".score." in n for n, _ in trainable)
    full = RunContext(_cfg(precision=precision, base_dtype="precision"), cache_dir=tmp_path, progress=False)
    assert ctx.trainable_params == full.trainable_params and ctx.total_params == full.total_params
    width = 2 if precision == "bf16" else 4  # precision=bf16 casts the frozen Conv1D weights once
    n_block_weights = sum(_base_layer(b, t).in_features * _base_layer(b, t).out_features
                          for b in _blocks(ctx.model) for t in TARGETS)
    assert full.base_weight_mib * 2**20 == width * n_block_weights


def test_the_nf4_codes_are_torchaos_for_the_same_weights():
    """Each block weight (the Conv1D's, transposed to out × in) quantized by bitsandbytes and by
    torchao's to_nf4 (the book model's nf4 base): the same blocks of 64 (row-major), the same
    absmax, the same code index for every weight except where the weight's absmax-normalised value
    lies within the two tables' largest difference (torchao rounds QLoRA's codes to 4 decimals) of
    a decision midpoint, there the neighbouring code; and dequantized, the two differ by at most
    the tables' difference times the absmax plus each format's error in the stored absmax:
    bitsandbytes' half the largest gap of its 8-bit absmax code times the block's absmax of the
    centred absmaxes, torchao's that block's absmax / 128."""
    cfg = _cfg()
    mcfg = model_config(cfg)
    state = base_state(cfg, mcfg, cache_dir=None, progress=False)
    model = build_hf_classifier(cfg, cache_dir=None)
    for i, block in enumerate(_blocks(model)):
        for target in TARGETS:
            layer = _base_layer(block, target)
            w = state[f"h.{i}.{target}.weight"].t().contiguous()  # Conv1D keeps in × out
            qs = layer.weight.quant_state
            ao = quantize_weight(w, "nf4")
            bnb_table = qs.code.double()
            table_diff = float((ao.nf4.double() - bnb_table).abs().max())
            assert table_diff <= 1e-4
            codes_b = _unpack(layer.weight.data.reshape(-1))
            codes_a = _unpack(ao.quantized_data.reshape(-1))
            blocks = w.double().reshape(-1, NF4_BLOCK)
            absmax = blocks.abs().amax(dim=1, keepdim=True)
            x = (blocks / absmax).reshape(-1)
            mids = (bnb_table[1:] + bnb_table[:-1]) / 2
            near = (x.unsqueeze(1) - mids).abs().min(dim=1).values <= table_diff + 4 * U32
            differ = codes_b != codes_a
            assert not (differ & ~near).any(), f"{target}: codes differ away from a midpoint"
            assert ((codes_b - codes_a).abs() <= 1).all()
            # the stored absmaxes against the true ones, each within its format's bound
            s_b = functional.dequantize_blockwise(qs.absmax, qs.state2).double() + float(qs.offset)
            code2 = torch.sort(qs.state2.code.double()).values
            half_gap2 = float((code2[1:] - code2[:-1]).max()) / 2
            nested = qs.state2.absmax.double().repeat_interleave(256)[:absmax.numel()]
            err_b = nested * half_gap2 * (1 + 8 * U32) + 8 * U32 * absmax.reshape(-1)
            assert ((s_b - absmax.reshape(-1)).abs() <= err_b).all(), target
            dev = absmax.reshape(-1) - absmax.mean()
            per = ao.scaler_block_size
            err_a = (dev.reshape(-1, per).abs().amax(dim=1, keepdim=True) / 128).expand(-1, per).reshape(-1)
            dq_b = functional.dequantize_4bit(layer.weight.data, qs).double()
            assert (dq_b - _decoded(layer)).abs().max() <= 8 * U32 * float(absmax.max())  # bitsandbytes' kernel
            dq_b = dq_b.reshape(-1, NF4_BLOCK)
            dq_a = dequantize(ao, "nf4").double().reshape(-1, NF4_BLOCK)
            same = ~differ.reshape(-1, NF4_BLOCK)
            bound = (table_diff * absmax + (err_b + err_a).unsqueeze(1)) * (1 + 8 * U32) + 8 * U32 * absmax
            gap = (dq_b - dq_a).abs()
            assert (gap[same] <= bound.expand_as(gap)[same]).all(), float((gap / bound)[same].max())


def _decoded(layer: nn.Module) -> torch.Tensor:
    """A Linear4bit's weight (out × in, float64) decoded here from what it stores, not by
    bitsandbytes' dequantization kernel: each code's NF4 value times its block's absmax (the 8-bit
    absmax decoded with its own code table and block scale, plus the offset)."""
    state = layer.weight.quant_state
    nested = state.state2
    absmax = (nested.code.double()[state.absmax.long()].reshape(-1)
              * nested.absmax.double().repeat_interleave(nested.blocksize)[:state.absmax.numel()]) + float(state.offset)
    codes = _unpack(layer.weight.data.reshape(-1))
    values = state.code.double()[codes].reshape(-1, state.blocksize) * absmax.unsqueeze(1)
    return values.reshape(tuple(state.shape))


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """4-bit codes, the high nibble first (both libraries' layout)."""
    p = packed.to(torch.int64)
    return torch.stack([p >> 4, p & 0xF], dim=1).reshape(-1)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("target", ["mlp.c_fc", "mlp.c_proj"])
def test_the_lora_layer_on_the_4bit_weight_matches_float64_of_the_dequantized_weight(precision, target):
    """PEFT's LoRA layer around a Linear4bit of the peer, after an evaluation-mode pass without
    gradients (as a run's periodic evaluation makes), against a float64 evaluation with the
    dequantized weight: y = x·dq(W)ᵀ + b + s·(x·Aᵀ)·Bᵀ and the gradients of x, A and B. float32:
    each within λ·u·√k of its longest chain; bf16 (the run's autocast, bitsandbytes computing in
    bfloat16): x, the weight, the product and the adapter's operands are rounded to bfloat16 on the
    way, 5 roundings on the longest path."""
    cfg = _cfg(precision=precision)
    model = build_hf_classifier(cfg, cache_dir=None)
    layer = _blocks(model)[0].get_submodule(target)
    base = layer.base_layer
    k, n = base.in_features, base.out_features
    lora_a, lora_b = layer.lora_A["default"], layer.lora_B["default"]
    with torch.no_grad():
        lora_b.weight.copy_(fresh(n, cfg.lora_rank, device="cpu", dtype=torch.float32))  # B = 0 at the start
    x = fresh(2, 5, k, device="cpu", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        layer(x)
    model.train()
    # the evaluation left the training layout (bitsandbytes' CPU inference repacking reshapes it)
    assert tuple(base.weight.shape) == (k * n // 2, 1)
    assert not getattr(base.weight.quant_state, "packing_format_for_cpu", False)
    x.requires_grad_(True)
    g = fresh(2, 5, n, device="cpu", dtype=torch.float32)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast:
        y = layer(x)
    got = [y, *torch.autograd.grad(y, [x, lora_a.weight, lora_b.weight], g.to(y.dtype))]
    w = _decoded(base)
    a64 = lora_a.weight.detach().double().requires_grad_(True)
    b64 = lora_b.weight.detach().double().requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    scale = layer.scaling["default"]
    y64 = x64 @ w.T + base.bias.double() + scale * (x64 @ a64.T) @ b64.T
    want = [y64, *torch.autograd.grad(y64, [x64, a64, b64], g.double())]
    chains = lora_chains(rows=10, k=k, n=n, r=cfg.lora_rank)
    for name, o, ref in zip(("y", "grad_x", "grad_A", "grad_B"), got, want):
        tol = dot_tol(torch.float32, chains[name]) if precision == "fp32" else rounded_input_tol(torch.bfloat16, 5)
        assert rel_err(o, ref) <= tol, f"{precision} {target} {name}: {rel_err(o, ref):.3g} > {tol:.3g}"


# -- whole runs ---------------------------------------------------------------------------------------

def _run(cfg: TrainConfig, results_dir, run_id: str) -> tuple[dict, dict]:
    row = execute_run(cfg, results_dir=results_dir, run_id=run_id, console=Console(quiet=True), progress=False,
                      cache_dir=results_dir / "cache")
    return row, json.loads((results_dir / run_id / "run.json").read_text())


@pytest.mark.slow
def test_a_tiny_qlora_run_trains_and_records_bitsandbytes(tmp_path):
    """The loss on the same two batches falls; the row names bitsandbytes' version (not torchao's),
    and the 4-bit body's bytes against the float32 peer's (4 bytes a weight)."""
    full, _ = _run(_cfg(base_dtype="precision"), tmp_path, "fp32")
    row, record = _run(_cfg(), tmp_path, "nf4")
    assert row["status"] == "done", row.get("error")
    losses = record["train_losses"]
    assert len(losses) >= 2 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], f"the loss on the same batches did not fall: {losses}"
    runs = read_runs(tmp_path / "runs.csv").set_index("run_id")
    assert runs.loc["nf4", "cfg_base_dtype"] == "nf4" and runs.loc["nf4", "cfg_implementation"] == "hf"
    assert runs.loc["nf4", "bitsandbytes_version"] == metadata.version("bitsandbytes")
    assert runs.loc["nf4", "torchao_version"] == "" and runs.loc["fp32", "bitsandbytes_version"] == ""
    mcfg = model_config(_cfg())
    e, h = mcfg.emb_dim, 4 * mcfg.emb_dim
    sizes = [e * 3 * e, e * e, e * h, h * e] * mcfg.n_layers
    assert runs.loc["fp32", "base_weight_mib"] * 2**20 == 4 * sum(sizes)
    assert runs.loc["nf4", "base_weight_mib"] * 2**20 == sum(map(_nf4_sizes, sizes))
    assert runs.loc["nf4", "total_params"] == runs.loc["fp32", "total_params"]


# -- what is refused ----------------------------------------------------------------------------------

TINY = ["--model-size", "tiny", "--weights", "random", "--device", "cpu", "--no-progress", "--max-steps", "3",
        "--warmup-steps", "0", "--eval-freq", "0", "--skip-final-eval", "--data-file", str(SAMPLE),
        "--implementation", "hf", "--trainable-layers", "lora"]
HF_REFUSED = [
    ("int8", ["LLM.int8", "activations to int8", "int8 weight-only"]),
    ("bf16", ["--precision=bf16", "--base-dtype=precision"]),
    ("fp8", ["no float8 weights"]),
]


@pytest.mark.parametrize("fmt, says", HF_REFUSED, ids=[f for f, _ in HF_REFUSED])
def test_other_stored_bases_with_the_peer_are_refused_with_the_reason(fmt, says, tmp_path, run_cli):
    code, out = run_cli("train", *TINY, "--base-dtype", fmt, "--results-dir", tmp_path)
    assert code == 2, out
    flat = " ".join(out.split())
    assert f"--base-dtype={fmt} with --implementation=hf is refused" in flat, flat
    for text in says + ["choose --base-dtype one of: precision, nf4"]:
        assert text in flat, f"{text!r} not in {flat!r}"
    assert "Traceback" not in out
    assert not (tmp_path / "runs.csv").exists()


def test_a_4bit_body_whose_rows_bitsandbytes_cpu_kernels_get_wrong_is_refused_on_the_cpu(tmp_path, run_cli):
    """The tiny model's 32-wide rows are half a block: bitsandbytes' CPU kernels give wrong products
    there, so the run is refused before it starts, naming the width and what to use instead."""
    code, out = run_cli("train", *TINY, "--base-dtype", "nf4", "--results-dir", tmp_path)
    assert code == 2, out
    flat = " ".join(out.split())
    assert "--base-dtype=nf4 with --implementation=hf on the CPU is refused" in flat, flat
    assert "emb_dim=32" in flat and "multiple of 64" in flat and "CUDA device" in flat
    assert "Traceback" not in out and not (tmp_path / "runs.csv").exists()
    code, out = run_cli("train", *TINY, "--emb-dim", "64", "--base-dtype", "nf4", "--results-dir", tmp_path,
                        "--run-id", "w64")
    assert code == 0, out
    assert read_runs(tmp_path / "runs.csv")["status"].tolist() == ["done"]


def test_qlora_without_bitsandbytes_names_the_extra(tmp_path, run_cli, hide_package):
    hide_package("bitsandbytes")
    code, out = run_cli("train", *TINY, "--emb-dim", "64", "--base-dtype", "nf4", "--results-dir", tmp_path)
    assert code == 2, out
    flat = " ".join(out.split())
    assert "base_dtype=nf4 with implementation=hf" in flat and 'pip install "lora-bench[quant]"' in flat
    assert "'bitsandbytes'" in flat and "Traceback" not in out
    assert not (tmp_path / "runs.csv").exists()


# -- CUDA -----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["fp32", "bf16", "best"])
def test_a_tiny_qlora_run_on_cuda(mode, tmp_path):
    """On the GPU: the body quantized there (bitsandbytes' CUDA kernels), the loss falls, in fp32,
    bf16 and the peer's best mode (bf16, SDPA, fused ops and AdamW, each block compiled)."""
    kw = dict(device="cuda", timing="sync")
    if mode != "fp32":
        kw.update(precision="bf16", attention="sdpa", ops="fused")
    if mode == "best":
        kw.update(optimizer="fused", compile=True, compile_scope="blocks", max_steps=13)
    row, record = _run(_cfg(**kw), tmp_path, mode)
    assert row["status"] == "done", row.get("error")
    losses = record["train_losses"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert row["bitsandbytes_version"] == metadata.version("bitsandbytes")
    ctx = RunContext(_cfg(**kw), cache_dir=tmp_path, progress=False)
    four_bit = linear4bit_modules(ctx.model)
    assert len(four_bit) == 4 * ctx.mcfg.n_layers
    assert all(m.weight.device.type == "cuda" and m.weight.dtype == torch.uint8 for m in four_bit)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_lora_layer_on_cuda_matches_float64_of_the_dequantized_weight():
    """bitsandbytes' CUDA 4-bit product (bfloat16 compute under the run's autocast) against float64
    on the dequantized weight: 5 roundings to bfloat16 on the longest path."""
    cfg = _cfg(device="cuda", precision="bf16")
    model = build_hf_classifier(cfg, cache_dir=None, device=torch.device("cuda")).to("cuda")
    layer = _blocks(model)[0].get_submodule("mlp.c_fc")
    base = layer.base_layer
    k, n = base.in_features, base.out_features
    with torch.no_grad():
        layer.lora_B["default"].weight.copy_(fresh(n, cfg.lora_rank, device="cuda", dtype=torch.float32))
    x = fresh(2, 5, k, device="cuda", dtype=torch.float32).requires_grad_(True)
    g = fresh(2, 5, n, device="cuda", dtype=torch.float32)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    got = [y, *torch.autograd.grad(y, [x, a, b], g.to(y.dtype))]
    w = _decoded(base).to(x.device)
    a64, b64, x64 = (t.detach().double().requires_grad_(True) for t in (a, b, x))
    y64 = x64 @ w.T + base.bias.double() + layer.scaling["default"] * (x64 @ a64.T) @ b64.T
    want = [y64, *torch.autograd.grad(y64, [x64, a64, b64], g.double())]
    for name, o, ref in zip(("y", "grad_x", "grad_A", "grad_B"), got, want):
        assert rel_err(o, ref) <= rounded_input_tol(torch.bfloat16, 5), f"{name}: {rel_err(o, ref):.3g}"
