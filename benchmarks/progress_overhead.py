"""What the training progress bar costs per step, against the phase timer's own cost per step on
the same machine (``timer_overhead.timer_cost_us``). Both run inside the measured training loop;
the bar must cost less than the timer.

- update: µs per ``TrainProgress.update`` call over a tight loop of steps, refreshes throttled to
  REFRESH_PER_S (the few refreshes included);
- refresh: µs of one refresh (read the resolved loss, format, redraw to a terminal console);
- per step at T ms: update + refresh × min(1, REFRESH_PER_S × T / 1000), the bar's cost in a
  loop of T-ms steps (at most one refresh per step: update runs once a step);
- every step: µs per step when every step refreshes (no throttle).

    python -m benchmarks.progress_overhead [--device cpu|cuda] [--step-ms 4]
"""

from __future__ import annotations

import argparse
import io
import time

import torch
from rich.console import Console

from benchmarks.timer_overhead import timer_cost_us
from lora_bench.progress import REFRESH_PER_S, TrainProgress


def _bar(total: int) -> TrainProgress:
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    return TrainProgress(console, total=total, enabled=True)


def update_cost_us(steps: int = 200_000) -> float:
    """µs per update() call, throttled, over ``steps`` calls (after a warm-up)."""
    with _bar(steps) as bar:
        for i in range(1000):
            bar.update(i, 1, None)
        t0 = time.perf_counter()
        for i in range(steps):
            bar.update(i, 1, None)
        return (time.perf_counter() - t0) * 1e6 / steps


def refresh_cost_us(n: int = 200) -> float:
    """µs of one refresh: loss read, formatting and a redraw."""
    with _bar(n) as bar:
        bar.update(0, 1, None)
        t0 = time.perf_counter()
        for i in range(n):
            bar._step = i
            bar.refresh()
        return (time.perf_counter() - t0) * 1e6 / n


def every_step_cost_us(steps: int = 20_000) -> float:
    """µs per step when every step refreshes (no throttle)."""
    with _bar(steps) as bar:
        t0 = time.perf_counter()
        for i in range(steps):
            bar._step = i
            bar.refresh()
        return (time.perf_counter() - t0) * 1e6 / steps


def measure(device: torch.device, *, step_ms: float) -> dict[str, float]:
    timer = timer_cost_us(device)
    update, refresh = update_cost_us(), refresh_cost_us()
    per_step = update + refresh * min(1.0, REFRESH_PER_S * step_ms / 1e3)
    return {"timer_us": timer, "update_us": update, "refresh_us": refresh, "per_step_us": per_step,
            "every_step_us": every_step_cost_us(), "step_ms": step_ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--step-ms", type=float, default=4.0, help="step time for the amortised cost (default: "
                                                               "4 ms, the fastest 124M step measured)")
    args = ap.parse_args()
    r = measure(torch.device(args.device), step_ms=args.step_ms)
    print(f"phase timer (events, {args.device}): {r['timer_us']:.2f} us per step")
    print(f"progress update, throttled to {REFRESH_PER_S:g}/s: {r['update_us']:.3f} us per step "
          f"({100 * r['update_us'] / r['timer_us']:.1f} % of the timer)")
    print(f"progress refresh (loss read, format, redraw): {r['refresh_us']:.1f} us each")
    print(f"per step at {r['step_ms']:g} ms steps: {r['per_step_us']:.3f} us "
          f"({100 * r['per_step_us'] / r['timer_us']:.1f} % of the timer)")
    print(f"refreshing every step instead: {r['every_step_us']:.2f} us per step")


if __name__ == "__main__":
    main()
