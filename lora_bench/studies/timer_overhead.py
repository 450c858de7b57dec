"""How much does phase timing cost? One model and optimizer, blocks of steps run alternately with
the timer ``off`` and ``events`` (ABAB…, so drift hits both alike); per block the wall time of the
loop with a device synchronisation at both ends.

    python -m lora_bench.studies.timer_overhead --data-file PATH [--trainable-layers lora]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from ..config import TrainConfig
from ..run import RunContext, default_cache_dir
from ..timing import PhaseTimer
from ..train import train_classifier


def measure(ctx: RunContext, *, mode: str, steps: int) -> float:
    """ms per step of one block (the block's epoch-end accuracy on 10 batches included)."""
    timer = PhaseTimer(mode, ctx.device, warmup_steps=0)
    settings = dataclasses.replace(ctx.loop_settings(), num_epochs=1, eval_freq=0, max_steps=steps, eval_iter=1)
    torch.cuda.synchronize() if ctx.device.type == "cuda" else None
    t0 = time.perf_counter()
    train_classifier(ctx.forward_model, ctx.loaders.train, ctx.loaders.val, ctx.optimizer, ctx.device,
                     settings=settings, timer=timer, amp=ctx.amp, say=lambda m: None)
    return (time.perf_counter() - t0) * 1e3 / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-file", required=True)
    ap.add_argument("--model-size", default="124M")
    ap.add_argument("--trainable-layers", default="all")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--blocks", type=int, default=8)
    args = ap.parse_args()
    cfg = TrainConfig(model_size=args.model_size, weights="random", trainable_layers=args.trainable_layers,
                      lora_rank=16, lora_alpha=16.0, data_file=args.data_file, device=args.device)
    ctx = RunContext(cfg, cache_dir=default_cache_dir(), progress=False)
    measure(ctx, mode="off", steps=10)  # warm-up
    res: dict[str, list[float]] = {"off": [], "events": []}
    for _ in range(args.blocks):
        for mode in ("off", "events"):
            res[mode].append(measure(ctx, mode=mode, steps=args.steps))
    off, ev = statistics.median(res["off"]), statistics.median(res["events"])
    print(f"timer overhead {args.model_size} {args.trainable_layers}: ms/step off {off:.3f} events {ev:.3f} "
          f"-> {100 * (ev / off - 1):+.2f}%  (blocks of {args.steps} steps, {args.blocks} each)")
    print("  off   ", [round(x, 2) for x in res["off"]])
    print("  events", [round(x, 2) for x in res["events"]])


if __name__ == "__main__":
    main()
