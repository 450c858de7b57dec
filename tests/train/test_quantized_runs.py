"""Runs on a quantized frozen base (base_dtype): tiny LoRA runs on int8 and NF4 bases (torchao's and
bitsandbytes') train, store the blocks' frozen weights quantized and record their weight memory and
the library's version; the
combinations that cannot be run are refused as usage errors before any training; fp8 on a CUDA GPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from importlib import metadata

import pytest
import torch
import torch.nn as nn
from rich.console import Console

from lora_bench.config import TrainConfig
from lora_bench.lora.layer import LinearWithLoRA, LoRALinearBase
from lora_bench.lora.quantized import QuantizedLinear
from lora_bench.results.store import read_runs
from lora_bench.train.context import RunContext
from lora_bench.train.run import execute_run
from paths import ROOT, SAMPLE

TINY = ["--model-size", "tiny", "--weights", "random", "--device", "cpu", "--no-progress", "--max-steps", "4",
        "--warmup-steps", "0", "--eval-freq", "0", "--skip-final-eval", "--data-file", str(SAMPLE)]

# Weight memory against float32's 4 bytes a weight: int8 keeps 1 byte, plus a float32 scale and an
# int8 zero point per row (the tiny model's rows are 32 or 128 weights long: 4·32/37 = 3.46 at
# worst); NF4 keeps half a byte, plus an int8 scale per block of 64, a float32 per block of scales
# and the 16-value code table per layer (4·1024/600 = 6.8 at worst for the tiny model's layers).
TINY_BLOCK_WEIGHTS = 2 * (4 * 32 * 32 + 2 * 32 * 128)  # 2 blocks: q, k, v, out (32×32), the MLP's 32×128 twice
RATIO = {"int8": (3.4, 4.0), "nf4": (6.5, 8.0)}
STORED_DTYPE = {"int8": ("qdata", torch.int8), "nf4": ("quantized_data", torch.uint8),
                "nf4-bnb": ("packed", torch.uint8), "nf4-bnb-nodq": ("packed", torch.uint8),
                "fp8": ("qdata", torch.float8_e4m3fn)}


def _cfg(sms_file, **kw) -> TrainConfig:
    """A tiny LoRA run whose periodic evaluation reads the same two training batches each time
    (fixed data), after steps 0, 4 and 8."""
    base = dict(model_size="tiny", weights="random", trainable_layers="lora", device="cpu", data_file=str(sms_file),
                num_epochs=1, max_steps=9, eval_freq=4, eval_iter=2, skip_final_eval=True, warmup_steps=1,
                learning_rate=5e-3, lora_rank=4, lora_alpha=4.0)
    return TrainConfig(**{**base, **kw})


def _run(cfg: TrainConfig, results_dir, run_id: str, cache_dir) -> tuple[dict, dict]:
    row = execute_run(cfg, results_dir=results_dir, run_id=run_id, console=Console(quiet=True), progress=False,
                      cache_dir=cache_dir)
    return row, json.loads((results_dir / run_id / "run.json").read_text())


def _block_linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.trf_blocks.modules() if isinstance(m, QuantizedLinear) or type(m) is nn.Linear]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_a_lora_run_on_a_quantized_base_trains_and_records_it(fmt, sms_file, cache_dir, tmp_path):
    full, _ = _run(_cfg(sms_file), tmp_path, "fp32", cache_dir)
    row, record = _run(_cfg(sms_file, base_dtype=fmt), tmp_path, fmt, cache_dir)
    assert row["status"] == "done", row.get("error")
    losses = record["train_losses"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], f"the loss on the same batches did not fall: {losses}"
    runs = read_runs(tmp_path / "runs.csv").set_index("run_id")
    assert runs.loc[fmt, "cfg_base_dtype"] == fmt and runs.loc["fp32", "cfg_base_dtype"] == "precision"
    assert runs.loc[fmt, "torchao_version"] == metadata.version("torchao")
    assert runs.loc["fp32", "torchao_version"] == ""  # a full-precision base uses no torchao
    ratio = runs.loc["fp32", "base_weight_mib"] / runs.loc[fmt, "base_weight_mib"]
    low, high = RATIO[fmt]
    assert low <= ratio < high, f"{fmt} holds 1/{ratio:.2f} of the float32 base's weight bytes"
    # the full-precision run's figure: the blocks' linear weights at 4 bytes each
    assert runs.loc["fp32", "base_weight_mib"] * 2**20 == 4 * TINY_BLOCK_WEIGHTS


def _bnb_nf4_bytes(numel: int, fmt: str = "nf4-bnb") -> int:
    """bitsandbytes' NF4 bytes for a weight of ``numel``: half a byte a weight, an 8-bit absmax code
    per block of 64, a float32 per block of 256 of those, the 16- and 256-value code tables, the mean;
    without double quantization a float32 absmax per block of 64 and the 16-value table."""
    blocks = numel // 64
    if fmt == "nf4-bnb-nodq":
        return numel // 2 + 4 * blocks + 16 * 4
    return numel // 2 + blocks + 4 * -(-blocks // 256) + 16 * 4 + 256 * 4 + 4


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nf4-bnb", "nf4-bnb-nodq"])
def test_a_lora_run_on_a_bitsandbytes_nf4_base_trains_and_records_it(fmt, sms_file, cache_dir, tmp_path):
    """nf4-bnb (and without double quantization) at width 64 (bitsandbytes' CPU kernels need whole
    64-weight rows): the run trains (its loss on the same batches falls), records bitsandbytes'
    version and not torchao's, and its weight memory is each block layer's NF4 bytes with the quant state."""
    pytest.importorskip("bitsandbytes")
    row, record = _run(_cfg(sms_file, base_dtype=fmt, emb_dim=64), tmp_path, "bnb", cache_dir)
    assert row["status"] == "done", row.get("error")
    losses = record["train_losses"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], f"the loss on the same batches did not fall: {losses}"
    runs = read_runs(tmp_path / "runs.csv").set_index("run_id")
    assert runs.loc["bnb", "bitsandbytes_version"] == metadata.version("bitsandbytes")
    assert runs.loc["bnb", "torchao_version"] == ""
    per_block = 4 * _bnb_nf4_bytes(64 * 64, fmt) + 2 * _bnb_nf4_bytes(64 * 256, fmt)  # q, k, v, out; the MLP's two
    assert runs.loc["bnb", "base_weight_mib"] * 2**20 == pytest.approx(2 * per_block, rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_a_compiled_run_on_a_quantized_base_trains(fmt, sms_file, cache_dir, tmp_path):
    """torch.compile over the stored int8 or NF4 blocks (each block compiled): dynamo compiles graphs
    of the quantized blocks, and the run trains (its loss on the same batches falls)."""
    from torch._dynamo.utils import counters

    counters.clear()
    row, record = _run(_cfg(sms_file, base_dtype=fmt, compile=True, compile_scope="blocks"), tmp_path, "compiled",
                       cache_dir)
    assert row["status"] == "done", row.get("error")
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    losses = record["train_losses"]
    assert len(losses) == 3 and losses[-1] < losses[0], f"the loss on the same batches did not fall: {losses}"


@pytest.mark.parametrize("fmt", ["int8", "nf4", "nf4-bnb", "nf4-bnb-nodq"])
def test_the_frozen_block_weights_are_stored_quantized(fmt, sms_file, cache_dir):
    """Every linear layer of the blocks holds the library's stored weight (torchao's tensor, or
    bitsandbytes' packed codes with their quant state; no float weight parameter left); the
    adapters and the trainable head stay float32; lora-kernel's layers run lora's."""
    bnb = fmt.startswith("nf4-bnb")
    if bnb:
        pytest.importorskip("bitsandbytes")
    extra = {"emb_dim": 64} if bnb else {}
    ctx = RunContext(_cfg(sms_file, base_dtype=fmt, trainable_layers="lora-kernel", **extra), cache_dir=cache_dir,
                     progress=False)
    linears = _block_linears(ctx.model)
    assert len(linears) == 2 * 6
    field, dtype = STORED_DTYPE[fmt]
    for layer in linears:
        assert isinstance(layer, QuantizedLinear)
        assert getattr(layer.weight_stored, field).dtype == dtype
        library = "bitsandbytes" if bnb else "torchao"
        held = layer.weight_stored.state if bnb else layer.weight_stored
        assert type(held).__module__.startswith(library)
    assert all(type(m) is LinearWithLoRA for m in ctx.model.trf_blocks.modules() if isinstance(m, LoRALinearBase))
    names = {n for n, _ in ctx.model.named_parameters()}
    assert not any(n.startswith("trf_blocks") and n.endswith("weight") for n in names)
    for name, p in ctx.model.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32 and (".lora." in name or name.startswith("out_head")), name
    assert ctx.model.out_head.linear.weight.requires_grad  # the head: full precision, trained
    assert ctx.notes and "lora-kernel" in ctx.notes[0] and "full-precision weight" in ctx.notes[0]


def test_lora_kernel_on_a_quantized_base_says_it_runs_lora(tmp_path, run_cli):
    code, out = run_cli("train", *TINY, "--trainable-layers", "lora-kernel", "--base-dtype", "int8",
                        "--results-dir", tmp_path, "--run-id", "k")
    assert code == 0, out
    assert out.count("its fused op reads a full-precision weight") == 1
    assert read_runs(tmp_path / "runs.csv")["status"].tolist() == ["done"]


REFUSED = [
    (["--trainable-layers", "all", "--base-dtype", "int8"],
     ["--base-dtype=int8", "--trainable-layers=all", "lora, lora-kernel, last_layer"]),
    (["--trainable-layers", "last_block", "--base-dtype", "bf16"],
     ["--base-dtype=bf16", "--trainable-layers=last_block", "lora, lora-kernel, last_layer"]),
    (["--trainable-layers", "lora-merged", "--base-dtype", "nf4"],
     ["--base-dtype=nf4", "lora-merged", "changes the frozen base", "lora, lora-kernel, last_layer"]),
    (["--trainable-layers", "lora", "--base-dtype", "fp8"],
     ["--base-dtype=fp8", "--device=cpu", "compute capability 8.9",
      "precision, bf16, int8, nf4, nf4-bnb, nf4-bnb-nodq"]),
    (["--device", "auto", "--trainable-layers", "lora", "--base-dtype", "fp8"],
     ["--base-dtype=fp8", "none is available here", "precision, bf16, int8, nf4, nf4-bnb, nf4-bnb-nodq"]),
    (["--trainable-layers", "lora", "--base-dtype", "int4"],
     ["--base-dtype", "int4", "precision, bf16, fp8, int8, nf4, nf4-bnb, nf4-bnb-nodq"]),
    (["--trainable-layers", "lora", "--base-dtype", "nf4-bnb"],  # the tiny model is 32 wide
     ["--base-dtype=nf4-bnb on the CPU is refused", "not a multiple of 64 (emb_dim=32)", "--emb-dim"]),
    (["--trainable-layers", "all", "--base-dtype", "nf4-bnb", "--emb-dim", "64"],
     ["--base-dtype=nf4-bnb", "--trainable-layers=all", "lora, lora-kernel, last_layer"]),
    (["--implementation", "hf", "--trainable-layers", "lora", "--base-dtype", "nf4-bnb", "--emb-dim", "64"],
     ["--base-dtype=nf4-bnb with --implementation=hf is refused", "bitsandbytes' NF4 already", "precision, nf4"]),
    (["--implementation", "hf", "--trainable-layers", "lora", "--base-dtype", "nf4-bnb-nodq", "--emb-dim", "64"],
     ["--base-dtype=nf4-bnb-nodq with --implementation=hf is refused", "without it", "precision, nf4"]),
    (["--trainable-layers", "lora", "--base-dtype", "nf4-bnb-nodq"],
     ["--base-dtype=nf4-bnb-nodq on the CPU is refused", "not a multiple of 64 (emb_dim=32)", "--emb-dim"]),
]


@pytest.mark.parametrize("args, says", REFUSED, ids=["all-int8", "last_block-bf16", "lora-merged-nf4", "fp8-cpu",
                                                     "fp8-no-gpu", "unknown", "nf4-bnb-width", "all-nf4-bnb",
                                                     "hf-nf4-bnb", "hf-nf4-bnb-nodq", "nf4-bnb-nodq-width"])
def test_impossible_quantized_bases_are_refused_before_any_run(args, says, tmp_path, run_cli):
    code, out = run_cli("train", *TINY, *args, "--results-dir", tmp_path)
    assert code == 2, out
    flat = " ".join(out.split())
    for text in says:
        assert text in flat, f"{text!r} not in {flat!r}"
    assert "Traceback" not in out
    assert not (tmp_path / "runs.csv").exists() and not any(tmp_path.glob("*/run.json"))


def test_a_quantized_base_without_torchao_names_the_extra(tmp_path, run_cli, hide_package):
    hide_package("torchao")
    code, out = run_cli("train", *TINY, "--trainable-layers", "lora", "--base-dtype", "nf4", "--results-dir", tmp_path)
    assert code == 2, out
    flat = " ".join(out.split())
    assert "base_dtype=nf4" in flat and 'pip install "lora-bench[quant]"' in flat and "'torchao'" in flat
    assert "Traceback" not in out
    assert not (tmp_path / "runs.csv").exists()


def test_a_bitsandbytes_base_without_bitsandbytes_names_the_extra(tmp_path, run_cli, hide_package):
    hide_package("bitsandbytes")
    code, out = run_cli("train", *TINY, "--emb-dim", "64", "--trainable-layers", "lora", "--base-dtype", "nf4-bnb",
                        "--results-dir", tmp_path)
    assert code == 2, out
    flat = " ".join(out.split())
    assert "base_dtype=nf4-bnb" in flat and 'pip install "lora-bench[quant]"' in flat and "'bitsandbytes'" in flat
    assert "Traceback" not in out
    assert not (tmp_path / "runs.csv").exists()


def test_the_bf16_base_needs_no_library_and_halves_the_weights(tmp_path, run_cli):
    code, out = run_cli("train", *TINY, "--trainable-layers", "lora", "--base-dtype", "bf16", "--results-dir",
                        tmp_path, "--run-id", "b")
    assert code == 0, out
    row = read_runs(tmp_path / "runs.csv").iloc[0]
    assert row["base_weight_mib"] * 2**20 == 2 * TINY_BLOCK_WEIGHTS
    assert row["torchao_version"] == ""


def test_importing_the_package_and_its_runs_imports_no_quantization_library():
    probe = ("import sys, lora_bench, lora_bench.cli, lora_bench.train.run, lora_bench.sweep.runner, "
             "lora_bench.peers.hf; print('torchao' in sys.modules, 'bitsandbytes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False False"


# -- fp8: a CUDA GPU of compute capability 8.9 or newer ------------------------------------------
def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="fp8 needs a CUDA GPU of compute capability 8.9 or newer")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_tiny_fp8_run_on_cuda(precision, sms_file, cache_dir, tmp_path):
    pytest.importorskip("torchao")  # the optional extra `quant`
    cfg = _cfg(sms_file, device="cuda", precision=precision, timing="sync")
    full, _ = _run(cfg, tmp_path, "full", cache_dir)
    row, record = _run(cfg.replace(base_dtype="fp8"), tmp_path, "fp8", cache_dir)
    assert row["status"] == "done", row.get("error")
    assert all(math.isfinite(v) for v in record["train_losses"])
    assert record["train_losses"][-1] != record["train_losses"][0]
    assert row["torchao_version"] == metadata.version("torchao")
    # float8: 1 byte a weight plus a scale per row, against float32's 4 (bf16's 2 under bf16)
    ratio = full["base_weight_mib"] / row["base_weight_mib"]
    low, high = (3.4, 4.0) if precision == "fp32" else (1.7, 2.0)
    assert low <= ratio < high, ratio
    ctx = RunContext(cfg.replace(base_dtype="fp8"), cache_dir=cache_dir, progress=False)
    for layer in _block_linears(ctx.model):
        assert isinstance(layer, QuantizedLinear) and layer.weight_stored.qdata.dtype == torch.float8_e4m3fn
        assert layer.weight_stored.device.type == "cuda"
