"""Issue study: where the time goes for 124M ``all`` vs ``lora`` (reference settings, fp32, random
weights) — phase times (device and host), timer overhead (events vs off, interleaved repeats),
the perturbing sync mode, kernel counts per phase (torch.profiler) and the line_profiler report.

    python -m benchmarks.phase_timing --data-file PATH --out results/phase-timing-h200
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from rich.console import Console

from lora_bench.config import TrainConfig
from lora_bench.results.store import read_runs
from lora_bench.train.run import execute_run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-file", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-size", default="124M")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-profiles", action="store_true",
                    help="only the interleaved events/off repeats (no sync, torch or line profile runs)")
    args = ap.parse_args()
    out = Path(args.out)
    console = Console(width=160)
    base = TrainConfig(model_size=args.model_size, weights="random", data_file=args.data_file, device=args.device,
                       max_steps=args.steps, eval_freq=0, skip_final_eval=True, warmup_steps=20)
    lora = dict(trainable_layers="lora", lora_rank=16, lora_alpha=16.0)
    layers = {"all": dict(trainable_layers="all"), "lora": lora}

    def go(run_id: str, **kw) -> dict:
        console.rule(run_id)
        return execute_run(base.replace(**kw), results_dir=out, run_id=run_id, console=console, progress=False)

    overhead = {}
    for name, kw in layers.items():
        t = {"off": [], "events": []}
        for r in range(args.repeats):  # interleaved so drift hits both modes alike
            for mode in ("off", "events"):
                row = go(f"{name}-{mode}-r{r}", timing=mode, **kw)
                t[mode].append(row["training_time_s"] / row["steps"] * 1e3)
        overhead[name] = t
        if not args.no_profiles:
            go(f"{name}-sync", timing="sync", **kw)
            go(f"{name}-torchprof", timing="events", profile="torch", **kw)
            go(f"{name}-lineprof", timing="events", profile="line", **kw)

    runs = read_runs(out / "runs.csv").set_index("run_id")
    console.rule("summary")
    for name, t in overhead.items():
        off, ev = statistics.median(t["off"]), statistics.median(t["events"])
        console.print(f"{name}: loop ms/step off {off:.2f} {t['off']}  events {ev:.2f} {t['events']}  "
                      f"overhead {100 * (ev / off - 1):+.2f}%")
        phases = ["data", "forward", "backward", "optimizer"]
        for rep in range(args.repeats):
            r = runs.loc[f"{name}-events-r{rep}"]
            console.print(f"  r{rep}: step median {r['step_ms_median']:.2f} ms (p10 {r['step_ms_p10']:.2f}, p90 "
                          f"{r['step_ms_p90']:.2f}); sum of phase medians {r['phase_sum_pct']:+.2f}% of it; "
                          + "; ".join(
                              f"{p} dev {r[f'{p}_ms_median']:.2f} host {r[f'host_{p}_ms_median']:.2f} "
                              f"{r[f'bound_{p}']}" for p in phases))
        if f"{name}-sync" in runs.index:
            rs = runs.loc[f"{name}-sync"]
            console.print(f"  sync mode step median {rs['step_ms_median']:.2f} ms (perturbing)")
        kp = out / f"{name}-torchprof" / "kernels_by_phase.csv"
        if kp.exists():
            console.print("  kernels: " + kp.read_text().replace("\n", " | "))


if __name__ == "__main__":
    main()
