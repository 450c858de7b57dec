"""Execution modes side by side: for each model size, trainable set and mode, a short timing run
(random weights, built once per size and reused in-process) into one results folder; prints a table
of median step times and the LoRA/all ratio last.

    python -m benchmarks.modes --results-dir results/modes --sizes 124M 1558M [--data-file TSV]

``--kernel-plans default fused default`` runs the lora-kernel layers once per plan in turn, in one
process: an A-B-A comparison in which a drifting host affects both plans alike.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lora_bench.config import TrainConfig
from lora_bench.kernels.policy import KernelPlanError, parse_plan
from lora_bench.train.run import execute_run

MODES = {
    "eager-fp32": {},
    "graphs-fp32": dict(cuda_graphs=True),
    "eager-bf16-fused": dict(precision="bf16", attention="sdpa", ops="fused"),
    "graphs-bf16-fused": dict(precision="bf16", attention="sdpa", ops="fused", cuda_graphs=True),
    "compile-bf16-fused": dict(precision="bf16", attention="sdpa", ops="fused", compile=True),
    # the fastest settings: + the fused AdamW update; + torch.compile inside the captured graphs
    "graphs-bf16-fused-fopt": dict(precision="bf16", attention="sdpa", ops="fused", cuda_graphs=True,
                                   optimizer="fused"),
    "compile-graphs-bf16-fused-fopt": dict(precision="bf16", attention="sdpa", ops="fused", cuda_graphs=True,
                                           optimizer="fused", compile=True),
    # each transformer block compiled (one graph reused by all blocks): compile time independent of depth
    "bcompile-graphs-bf16-fused-fopt": dict(precision="bf16", attention="sdpa", ops="fused", cuda_graphs=True,
                                            optimizer="fused", compile=True, compile_scope="blocks"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results-dir", required=True, type=Path, help="Folder for runs.csv and the per-run files.")
    ap.add_argument("--data-file", help="Raw SMSSpamCollection TSV (default: lora-bench's own copy or download).")
    ap.add_argument("--sizes", nargs="+", default=["124M", "1558M"])
    ap.add_argument("--layers", nargs="+", default=["all", "lora", "lora-kernel"])
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default="none", help="none or torch (kernel tables per run)")
    ap.add_argument("--skip", nargs="*", default=[], help="MODE:LAYERS pairs not to run (e.g. slow compiles)")
    ap.add_argument("--kernel-plans", nargs="+", default=["auto"],
                    help="lora-kernel plans to run in turn (auto, or a forced plan such as fused: the "
                         "kernel_plan setting); e.g. auto fused auto: an A-B-A comparison in one process")
    args = ap.parse_args()
    for plan in args.kernel_plans:
        try:
            if plan != "auto":
                parse_plan(plan)
        except KernelPlanError as e:
            ap.error(f"--kernel-plans {plan}: {e}")
    console = Console(width=150)
    out = args.results_dir
    table = Table(title="median step ms (device events)")
    for col in ("size", "mode", *args.layers, "lora/all"):
        table.add_column(col)
    for size in args.sizes:
        for mode in args.modes:
            cells = {}
            for layers in args.layers:
                if f"{mode}:{layers}" in args.skip:
                    continue
                plans = args.kernel_plans if layers == "lora-kernel" else ["auto"]
                for i, plan in enumerate(plans):
                    cfg = TrainConfig(model_size=size, weights="random", trainable_layers=layers, lora_rank=16,
                                      lora_alpha=16.0 if size == "124M" else 8.0, data_file=args.data_file,
                                      device=args.device, max_steps=args.steps, eval_freq=0, skip_final_eval=True,
                                      warmup_steps=15, profile=args.profile, kernel_plan=plan, **MODES[mode])
                    rid = f"{size}-{mode}-{layers}" + (f"-{plan}-{i}" if len(plans) > 1 else "")
                    try:
                        row = execute_run(cfg, results_dir=out, run_id=rid, console=Console(quiet=True),
                                          progress=False)
                        cells[layers] = row.get("step_ms_median")  # (with several plans: the last one's)
                        console.print(f"{rid}: step {row.get('step_ms_median'):.2f} ms  " + "  ".join(
                            f"{p} {row.get(f'{p}_ms_median'):.2f}/{row.get(f'host_{p}_ms_median'):.2f}"
                            for p in ("data", "forward", "backward", "optimizer")) + "  (device/host ms)")
                    except Exception as e:  # an exploration goes on past one failing mode; the row records it
                        console.print(f"{rid}: FAILED {type(e).__name__}: {str(e)[:300]}")
                        cells[layers] = None
            ratio = (cells.get("lora") / cells["all"]) if cells.get("lora") and cells.get("all") else None
            table.add_row(size, mode, *[f"{cells[x]:.2f}" if cells.get(x) else "-" for x in args.layers],
                          f"{ratio:.2f}" if ratio else "-")
    console.print(table)


if __name__ == "__main__":
    main()
