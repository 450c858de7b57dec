"""The table of ``benchmarks/ddp_scaling.sh``: for each model size, trainable set and mode, tokens/s
on one GPU (the median of the one-worker sweep's repeats, else of the two-worker one's) and on two GPUs at a global
batch of 16 (per-GPU batch 8) and of 8, with the speed-up, the all-reduce time per step and the
part of it backward did not hide; then the sweep's wall time on one worker and on two.

    python -m benchmarks.ddp_table RESULTS_DIR
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd

from lora_bench.results.store import read_runs

KEYS = ["cfg_model_size", "cfg_trainable_layers", "cfg_precision", "cfg_cuda_graphs"]


def _done(path: Path) -> pd.DataFrame:
    if not path.is_file():
        return pd.DataFrame(columns=[*KEYS, "cfg_batch_size", "tokens_per_s"])
    df = read_runs(path)
    return df[df["status"] == "done"]


def table(results: Path) -> pd.DataFrame:
    # the one-GPU tokens/s: the median over the one-worker sweep's repeats (each run had the host to
    # itself), else the lone runs in one/, else the two-worker sweep's
    one = pd.concat([_done(results / "w1" / "runs.csv").assign(_src=0),
                     _done(results / "one" / "runs.csv").assign(_src=1),  # lora-kernel, alone on the host
                     _done(results / "w2" / "runs.csv").assign(_src=2)])
    one["tokens_per_s"] = pd.to_numeric(one["tokens_per_s"], errors="coerce")
    one = one[one["_src"] == one.groupby(KEYS)["_src"].transform("min")]
    one = one.groupby(KEYS, sort=False)[["tokens_per_s"]].median()
    ddp = _done(results / "ddp" / "runs.csv")
    batch_size = pd.to_numeric(ddp["cfg_batch_size"], errors="coerce")  # runs.csv settings are text
    rows = []
    for key, base in one.iterrows():
        row = dict(zip(["size", "layers", "precision", "graphs"], key), one_gpu_tok_s=base["tokens_per_s"])
        for batch in (16, 8):
            m = ddp[(ddp[KEYS] == list(key)).all(axis=1) & (batch_size == batch)]
            if m.empty:
                continue
            r = m.iloc[-1]
            tok_s = float(r["tokens_per_s"])
            row.update({f"b{batch}_tok_s": tok_s, f"b{batch}_x": tok_s / float(base["tokens_per_s"]),
                        f"b{batch}_allreduce_ms": r["allreduce_ms_median"],
                        f"b{batch}_exposed_ms": r["allreduce_exposed_ms_median"],
                        f"b{batch}_spread_pct": r["rank_step_spread_pct"]})
        rows.append(row)
    return pd.DataFrame(rows)


def walls(results: Path) -> dict[str, float]:
    log = results / "wall.log"
    found = re.findall(r"^(\S+) wall_s ([0-9.]+)", log.read_text(), re.M) if log.is_file() else []
    return {name: float(s) for name, s in found}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    args = ap.parse_args()
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.2f}".format):
        print(table(args.results).to_string(index=False))
    w = walls(args.results)
    if "sweep-1-worker" in w and "sweep-2-workers" in w:
        print(f"sweep wall time: 1 worker {w['sweep-1-worker']:.1f} s, 2 workers {w['sweep-2-workers']:.1f} s, "
              f"ratio {w['sweep-2-workers'] / w['sweep-1-worker']:.3f}")


if __name__ == "__main__":
    main()
