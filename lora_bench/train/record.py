"""What a run leaves behind: its row's summary columns (step-time medians and spreads, tokens/s,
FLOP rate, memory) and its files (``<run_id>/steps.csv``, ``<run_id>/run.json``, the row in
``runs.csv``), written whatever state the run ended in."""

from __future__ import annotations

import math
import resource
from pathlib import Path

import torch
from rich.console import Console

from lora_bench.config import TrainConfig
from lora_bench.escaping import markup
from lora_bench.lora.quantized import library_versions
from lora_bench.peers.hf import package_versions, qlora_versions
from lora_bench.results.environment import environment, host_speed
from lora_bench.results.metrics import flops_per_step, peak_tflops, summarise_steps
from lora_bench.results.save import save_record
from lora_bench.signals import signal_name, signals_deferred
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


def summary(ctx: RunContext, timer: PhaseTimer, cfg: TrainConfig, steps: list[dict]) -> dict:
    """The row's measured columns from the per-step rows: medians and spreads per phase, tokens/s,
    FLOP per step and the rate achieved, peak memory."""
    out: dict = {"timing_clock": timer.clock, "eval_s": timer.eval_ms / 1e3 if timer.enabled else None}
    if ctx.device.type == "cuda":
        out["peak_mem_allocated_mib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
        out["peak_mem_reserved_mib"] = torch.cuda.max_memory_reserved(ctx.device) / 2**20
    if not timer.enabled:
        return out
    s = summarise_steps(steps, clock=timer.clock)
    out.update(s)
    if "step_ms_median" in s:
        tokens = s["tokens_per_step"]
        step_s = s["step_ms_median"] / 1e3
        flops = flops_per_step(ctx.mcfg, trainable_layers=cfg.trainable_layers, tokens=tokens, rank=cfg.lora_rank,
                               implementation=cfg.implementation)
        out.update(tokens_per_s=tokens / step_s, flops_per_step=flops, achieved_tflops=flops / step_s / 1e12)
        if ctx.device.type == "cuda":
            peak = peak_tflops(torch.cuda.get_device_name(ctx.device), cfg.precision)
            gpus = ctx.dp.env.world_size if ctx.dp is not None else 1  # the global step ran on every rank's GPU
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


def record_run(row: dict, *, ctx: RunContext | None, timer: PhaseTimer | None, steps: list[dict] | None,
               cfg: TrainConfig, run_id: str, run_dir: Path, results_dir: Path, log: list[str], curves: dict,
               console: Console) -> None:
    """Save the run's steps.csv, run.json and runs.csv row as one (lora_bench.results.save),
    whatever state the run ended in. A terminating signal that comes meanwhile waits until the
    record is saved; it then ends the process, after saying so when the run was done."""
    with signals_deferred() as pending:
        if timer is not None and timer.enabled:
            try:
                if steps is None:  # the run stopped before its summary
                    steps = timer.step_rows(run_id)
                    if row["status"] == "interrupted" and ctx is not None:
                        row.setdefault("steps", len(steps))
                        row.update(summary(ctx, timer, cfg, steps))  # what was measured so far
            except RuntimeError as err:  # a dead CUDA context cannot resolve events; keep the row
                steps = None
                row["error"] = (row.get("error") or "") + f" (steps not saved: {err})"
        row["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        save_record(results_dir, row, steps=steps if timer is not None and timer.enabled else None, log=log,
                    curves=curves)
        if row["status"] == "interrupted":
            console.print(f"{markup(row['error'])} after {row.get('steps') or 0} step(s): recorded as interrupted "
                          f"(run_id {run_id}); results: {results_dir / 'runs.csv'}, files: {run_dir}",
                          highlight=False)
        elif pending and row["status"] == "done":
            console.print(f"{signal_name(pending[0])} came while the finished run was being saved: it is recorded "
                          f"as done (run_id {run_id}, results: {results_dir / 'runs.csv'}); stopping now",
                          highlight=False)
