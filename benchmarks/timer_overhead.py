"""How much does phase timing cost? One model and optimizer, blocks of steps run alternately with
the timer ``off`` and ``events`` in ABBA order (off-events, events-off, …: a linear drift of the
host cancels within each pair of pairs); per block the wall time of the loop with a device
synchronisation at both ends. The overhead is the median over pairs of events/off − 1, with a
bootstrap 95 % interval over the pairs, so a claim such as "at most 2 %" can be read off the upper
bound rather than off one noisy ratio of medians. Also measured directly: the timer's own host
cost per step. Prints a table last; ``--results-dir`` also keeps every block in ``timer_overhead.csv``.

    python -m benchmarks.timer_overhead [--trainable-layers lora] [--results-dir DIR] [--data-file TSV]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from lora_bench.config import TrainConfig
from lora_bench.results.manifest import record_invocation
from lora_bench.results.store import write_csv
from lora_bench.timing import PHASES, PhaseTimer
from lora_bench.train.loop import train_classifier
from lora_bench.model.checkpoints import default_cache_dir
from lora_bench.train.context import RunContext


def measure(ctx: RunContext, *, mode: str, steps: int) -> float:
    """ms per step of one block of ``steps`` training steps (as many epochs as that takes; each
    epoch's end-of-epoch accuracy on one train and one validation batch included). The loop ends
    with a device synchronisation, and one comes before it."""
    timer = PhaseTimer(mode, ctx.device, warmup_steps=0)
    epochs = -(-steps // len(ctx.loaders.train))
    settings = dataclasses.replace(ctx.loop_settings(), num_epochs=epochs, eval_freq=0, max_steps=steps, eval_iter=1)
    torch.cuda.synchronize() if ctx.device.type == "cuda" else None
    t0 = time.perf_counter()
    res = train_classifier(ctx.forward_model, ctx.loaders.train, ctx.loaders.val, ctx.optimizer, ctx.device,
                           settings=settings, timer=timer, amp=ctx.amp)
    return (time.perf_counter() - t0) * 1e3 / res.steps


def block_order(blocks: int) -> list[tuple[str, str]]:
    """ABBA: pair i runs (off, events) when i is even, (events, off) when odd."""
    return [("off", "events") if i % 2 == 0 else ("events", "off") for i in range(blocks)]


def paired_overhead(off: list[float], events: list[float], *, n_boot: int = 4000,
                    seed: int = 0) -> tuple[float, float, float]:
    """(median, lo, hi) in percent of events/off − 1 over ABBA quads (two consecutive pairs, in
    which a linear drift cancels: (e1 + e2) / (o1 + o2)); lo/hi: bootstrap 95 % interval of that
    median (resampling quads; seeded, so a report is reproducible)."""
    if len(off) != len(events) or not off or len(off) % 2:
        raise ValueError("need the same, even, non-zero number of off and events blocks (whole ABBA quads)")
    ratios = [100 * (sum(events[i:i + 2]) / sum(off[i:i + 2]) - 1) for i in range(0, len(off), 2)]
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n_boot))
    return statistics.median(ratios), boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]


def timer_cost_us(device: torch.device, *, steps: int = 2000) -> float:
    """Host µs per step that the timer itself adds, measured directly: ``steps`` timed steps with no
    work between the boundaries (begin, one mark per phase, end with a device loss, the in-loop
    resolution), the pending ones resolved at the end. In a host-bound loop this is what the timer
    adds to a step; in a device-bound one it is hidden behind the device. Unlike the ABBA blocks,
    it does not depend on how much the host drifts between blocks."""
    timer = PhaseTimer("events", device, warmup_steps=0)
    loss = torch.zeros((), device=device)
    for _ in range(50):  # warm-up (event pool, first query)
        _timed_step(timer, 0, loss)
    timer.sync_point()
    timer.records.clear()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        _timed_step(timer, i, loss)
    host = time.perf_counter() - t0
    timer.sync_point()
    assert len(timer.records) == steps, (len(timer.records), steps)
    return host * 1e6 / steps


def _timed_step(timer: PhaseTimer, step: int, loss: torch.Tensor) -> None:
    timer.begin(step=step, epoch=0)
    for phase in PHASES:
        timer.mark(phase)
    timer.end(loss, tokens=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-file", help="Raw SMSSpamCollection TSV (default: lora-bench's own copy or download).")
    ap.add_argument("--results-dir", type=Path, help="Also write every block to DIR/timer_overhead.csv.")
    ap.add_argument("--model-size", default="124M")
    ap.add_argument("--trainable-layers", default="all")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--cost-only", action="store_true", help="only the direct per-step cost of the timer")
    args = ap.parse_args()
    if args.blocks < 2 or args.blocks % 2:
        ap.error(f"--blocks {args.blocks}: need an even number (ABBA quads), at least 2")
    console = Console(width=160)
    cost = timer_cost_us(torch.device(args.device))
    table = Table(title=f"timer overhead, {args.model_size} {args.trainable_layers} on {args.device}",
                  title_justify="left")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("timer's host cost per step (direct)", f"{cost:.1f} µs")
    if args.cost_only:
        console.print(table)
        return
    cfg = TrainConfig(model_size=args.model_size, weights="random", trainable_layers=args.trainable_layers,
                      lora_rank=16, lora_alpha=16.0, data_file=args.data_file, device=args.device)
    ctx = RunContext(cfg, cache_dir=default_cache_dir(), progress=False)
    measure(ctx, mode="off", steps=10)  # warm-up
    res: dict[str, list[float]] = {"off": [], "events": []}
    blocks = []
    for pair in block_order(args.blocks):
        for mode in pair:
            res[mode].append(measure(ctx, mode=mode, steps=args.steps))
            blocks.append({"block": len(blocks), "mode": mode, "steps": args.steps, "ms_per_step": res[mode][-1]})
    if args.results_dir:
        write_csv(args.results_dir / "timer_overhead.csv", blocks, ["block", "mode", "steps", "ms_per_step"])
        record_invocation(args.results_dir, outputs=["timer_overhead.csv"])
    med, lo, hi = paired_overhead(res["off"], res["events"])
    off = statistics.median(res["off"])
    console.print("off   ", [round(x, 2) for x in res["off"]])
    console.print("events", [round(x, 2) for x in res["events"]])
    table.add_row("ms per step, timer off (median of blocks)", f"{off:.3f}")
    table.add_row("ms per step, timer on (median of blocks)", f"{statistics.median(res['events']):.3f}")
    table.add_row(f"paired overhead, {args.blocks} ABBA blocks of {args.steps} steps", f"{med:+.2f} %")
    table.add_row("95 % interval", f"{lo:+.2f} % to {hi:+.2f} %")
    table.add_row("direct cost in % of the off step", f"{100 * cost / 1e3 / off:.3f} %")
    console.print(table)


if __name__ == "__main__":
    main()
