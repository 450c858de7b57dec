"""What a run's row says of it beyond its settings: the versions of the libraries it used, the
environment it ran in, the summary columns of its steps (step-time medians and spreads, tokens/s,
FLOP rate, memory) and the step from which it diverged (lora_bench.train.recording saves them)."""

from __future__ import annotations

import math

import torch

from lora_bench.config import TrainConfig
from lora_bench.lora.quantized import library_versions
from lora_bench.peers.hf import package_versions, qlora_versions
from lora_bench.results.environment import environment, host_speed
from lora_bench.results.metrics import flops_per_step, peak_tflops, summarise_steps
from lora_bench.timing import PhaseTimer, host_op_us
from lora_bench.train.context import RunContext


def peer_versions(cfg: TrainConfig) -> dict:
    """The versions of transformers, PEFT, safetensors and huggingface_hub, for a run that uses them,
    and of the quantization library, for a run whose frozen base it stores (torchao for the book
    model, bitsandbytes for the transformers peer)."""
    out = qlora_versions(cfg.base_dtype) if cfg.implementation == "hf" else library_versions(cfg.base_dtype)
    if cfg.implementation == "book" and cfg.weights_source == "openai":
        return out
    return {**out, **{f"{name}_version": version for name, version in package_versions().items()}}


def run_environment(device: torch.device) -> dict:
    """The environment columns of a run on ``device`` with the host's speed measured there."""
    return {**environment(device), **host_speed(), "host_op_us": host_op_us(device)}


def summary(context: RunContext, timer: PhaseTimer, cfg: TrainConfig, steps: list[dict]) -> dict:
    """The row's measured columns from the per-step rows: medians and spreads per phase, tokens/s,
    FLOP per step and the rate achieved, peak memory."""
    out: dict = {"timing_clock": timer.clock, "eval_s": timer.eval_ms / 1e3 if timer.enabled else None}
    if context.device.type == "cuda":
        out["peak_mem_allocated_mib"] = torch.cuda.max_memory_allocated(context.device) / 2**20
        out["peak_mem_reserved_mib"] = torch.cuda.max_memory_reserved(context.device) / 2**20
    if not timer.enabled:
        return out
    s = summarise_steps(steps)
    out.update(s)
    if "step_ms_median" in s:
        tokens = s["tokens_per_step"]
        step_s = s["step_ms_median"] / 1e3
        flops = flops_per_step(context.mcfg, trainable_layers=cfg.trainable_layers, tokens=tokens, rank=cfg.lora_rank,
                               implementation=cfg.implementation, lora_variant=cfg.lora_variant,
                               dora_norm=cfg.dora_norm)
        out.update(tokens_per_s=tokens / step_s, flops_per_step=flops, achieved_tflops=flops / step_s / 1e12)
        if context.device.type == "cuda":
            peak = peak_tflops(torch.cuda.get_device_name(context.device), cfg.precision)
            gpus = context.dp.env.world_size if context.dp is not None else 1  # the global step ran on every rank's GPU
            if peak:
                out.update(peak_tflops=peak, mfu=out["achieved_tflops"] / (peak * gpus))
    return out


def divergence(steps: list[dict] | None, curves: dict, *, eval_freq: int) -> int | None:
    """The first step whose training loss (from the phase timer's per-step record, read where the
    loop synchronises anyway) or whose periodic evaluation (after the step's update) is not
    finite; None when every loss seen is finite."""
    bad = [int(s["step"]) for s in steps or () if isinstance(s.get("loss"), float) and not math.isfinite(s["loss"])]
    if eval_freq:
        for name in ("train_losses", "val_losses"):
            bad += [i * eval_freq for i, v in enumerate(curves.get(name) or ()) if not math.isfinite(v)]
    return min(bad, default=None)
