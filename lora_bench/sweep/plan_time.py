"""How long a sweep's runs will take on this machine, said by ``validate`` and ``sweep --dry-run``:
each run's work (``train.estimate.run_work``: its steps and evaluation batches, counted from its
settings and its data file's splits) times the time of one of its model's transformer blocks,
built at the run's width and timed forward and backward at the run's batch shape, once per shape
(the blocks are nearly all of a step's time; the embedding, the head and the adapters are left
out). A run on a CUDA device is not estimated here: timing it would make a CUDA context in this
process. Where each run starts its own process, the time this process took to start (up to this module's
import) is added per run, as the nearest measure of a child's start."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lora_bench.classifier.book import model_config
from lora_bench.data.sms_spam import balance_and_split, packaged_sms_spam, read_raw, resolve_max_length
from lora_bench.data.tokenizer import gpt2_tokenizer
from lora_bench.errors import LoraBenchError
from lora_bench.model.gpt2 import TransformerBlock
from lora_bench.train.estimate import StepTimes, duration, run_work

BLOCK_TRIES = 2  # the first call pays for lazy set-up; the faster of two is kept
WHOLE_BLOCK_TRAINS = ("all", "last_block", "last_two_blocks")  # settings whose blocks' weights train (some or all)


@dataclass(frozen=True)
class Splits:
    """A run's data as its loaders see it: batches per split and the padded length."""

    train_batches: int
    val_batches: int
    test_batches: int
    length: int


def splits_of(cfg, cache: dict) -> Splits:
    """The batches and padded length of ``cfg``'s data, as ``data.sms_spam.build_loaders`` makes
    them (padded to the longest training text unless a length is set), read once per file."""
    path = Path(cfg.data_file) if cfg.data_file else packaged_sms_spam()
    if path not in cache:
        train, val, test = balance_and_split(read_raw(path))
        tok = gpt2_tokenizer()
        longest = max((len(tok.encode(t, disallowed_special=())) for t in train["Text"]), default=1)
        cache[path] = (len(train), len(val), len(test), longest)
    n_train, n_val, n_test, longest = cache[path]
    fixed = resolve_max_length(cfg.context_length, model_context=model_config(cfg).context_length)
    b = cfg.batch_size
    return Splits(n_train // b, math.ceil(n_val / b), math.ceil(n_test / b), fixed or longest)


def block_times(cfg, length: int) -> StepTimes:
    """One transformer block of ``cfg``'s model, forward and backward and forward alone, at its
    batch shape on the CPU; the block's weights train where the setting trains them."""
    block = TransformerBlock(replace(model_config(cfg), drop_rate=0.0))
    trains = cfg.trainable_layers in WHOLE_BLOCK_TRAINS
    for p in block.parameters():
        p.requires_grad_(trains)
    best = StepTimes(math.inf, math.inf)
    with torch.random.fork_rng(devices=[]):
        x = torch.randn(cfg.batch_size, length, model_config(cfg).emb_dim, requires_grad=True)
        for _ in range(BLOCK_TRIES):
            t0 = time.perf_counter()
            out = block(x)
            out.sum().backward()
            t2 = time.perf_counter()
            with torch.no_grad():
                block(x)
            t3 = time.perf_counter()
            best = StepTimes(min(best.step_s, t2 - t0), min(best.forward_s, t3 - t2))
    return best


def process_start_s() -> float | None:
    """Seconds since this process started (Linux), else None."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


# Measured as this module is first imported, when a command has just started and imported torch and
# the sweep's modules, as a sweep's child process does before its run.
START_S = process_start_s()


def plan_estimate(runs: list, *, process_each: bool) -> list[str]:
    """The lines that say how long ``runs`` (``PlannedRun``s) will take here, run one at a time;
    ``process_each``: each run starts its own process."""
    cpu = [r for r in runs if r.cfg.device == "cpu" or (r.cfg.device == "auto" and not torch.cuda.is_available())]
    if not cpu:
        return ["estimate: none here (the runs are for a CUDA device)"] if runs else []
    start = START_S if process_each else None
    data: dict = {}
    blocks: dict = {}
    total = 0.0
    unread = 0
    for run in cpu:
        cfg = run.cfg
        try:
            splits = splits_of(cfg, data)
        except (LoraBenchError, OSError, ValueError):  # the run will fail and say why; the sweep goes on
            unread += 1
            continue
        key = (model_config(cfg), cfg.batch_size, splits.length, cfg.trainable_layers in WHOLE_BLOCK_TRAINS)
        if key not in blocks:
            blocks[key] = block_times(cfg, splits.length)
        per_block = blocks[key]
        layers = model_config(cfg).n_layers
        times = StepTimes(per_block.step_s * layers, per_block.forward_s * layers)
        total += times.seconds(run_work(cfg, train_batches=splits.train_batches, val_batches=splits.val_batches,
                                        test_batches=splits.test_batches))
    starts = f" and {duration(start * len(cpu))} starting their processes" if start else ""
    left = f"; {len(runs) - len(cpu)} runs for a CUDA device not estimated" if len(cpu) < len(runs) else ""
    left += f"; {unread} runs whose data file cannot be read not estimated" if unread else ""
    return [f"estimate: about {duration(total + (start or 0) * len(cpu))} for {len(cpu)} runs on this CPU "
            f"(training and evaluation {duration(total)}{starts}; from a timed block of each model{left})"]
