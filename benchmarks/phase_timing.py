"""Where the time of a 124M step goes, ``all`` against ``lora`` (reference settings: eager fp32,
random weights): device and host time per phase with the timer on (``events``) and off, in
interleaved repeats; then, unless ``--no-profiles``, the perturbing ``sync`` mode, a torch.profiler
run (kernels per phase) and a line_profiler run. Prints a table of the phase medians last.

    python -m benchmarks.phase_timing --results-dir results/phase-timing [--data-file TSV]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lora_bench.config import TrainConfig
from lora_bench.results.store import read_runs
from lora_bench.timing import PHASES
from lora_bench.train.run import execute_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results-dir", required=True, type=Path, help="Folder for runs.csv and the per-run files.")
    ap.add_argument("--data-file", help="Raw SMSSpamCollection TSV (default: lora-bench's own copy or download).")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-size", default="124M")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-profiles", action="store_true",
                    help="only the interleaved events/off repeats (no sync, torch or line profile runs)")
    args = ap.parse_args()
    out = args.results_dir
    console = Console(width=160)
    base = TrainConfig(model_size=args.model_size, weights="random", data_file=args.data_file, device=args.device,
                       max_steps=args.steps, eval_freq=0, skip_final_eval=True, warmup_steps=20)
    layers = {"all": dict(trainable_layers="all"), "lora": dict(trainable_layers="lora", lora_rank=16, lora_alpha=16.0)}

    def go(run_id: str, **kw) -> dict:
        console.rule(run_id)
        return execute_run(base.replace(**kw), results_dir=out, run_id=run_id, console=console, progress=False)

    loop_ms: dict[str, dict[str, list[float]]] = {}
    for name, kw in layers.items():
        t: dict[str, list[float]] = {"off": [], "events": []}
        for r in range(args.repeats):  # interleaved so that a drifting host hits both modes alike
            for mode in ("off", "events"):
                row = go(f"{name}-{mode}-r{r}", timing=mode, **kw)
                t[mode].append(row["training_time_s"] / row["steps"] * 1e3)
        loop_ms[name] = t
        if not args.no_profiles:
            go(f"{name}-sync", timing="sync", **kw)
            go(f"{name}-torchprof", timing="events", profile="torch", **kw)
            go(f"{name}-lineprof", timing="events", profile="line", **kw)
    console.print(summary_table(read_runs(out / "runs.csv"), loop_ms, repeats=args.repeats))


def summary_table(runs, loop_ms: dict[str, dict[str, list[float]]], *, repeats: int) -> Table:
    """Per trainable set: the median over the ``events`` repeats of each phase's device / host
    median, the step median, and the loop's ms per step with the timer off and on."""
    runs = runs.set_index("run_id")
    table = Table(title="phase medians, ms (device / host), median over repeats", title_justify="left")
    for col in ("layers", *PHASES, "step", "loop off / events"):
        table.add_column(col, justify="left" if col == "layers" else "right")
    for name, t in loop_ms.items():
        rows = [runs.loc[f"{name}-events-r{r}"] for r in range(repeats)]

        def med(col: str) -> float:
            return statistics.median(float(r[col]) for r in rows)

        cells = [f"{med(f'{p}_ms_median'):.2f} / {med(f'host_{p}_ms_median'):.2f}" for p in PHASES]
        table.add_row(name, *cells, f"{med('step_ms_median'):.2f}",
                      f"{statistics.median(t['off']):.2f} / {statistics.median(t['events']):.2f}")
    return table


if __name__ == "__main__":
    main()
