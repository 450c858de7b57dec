"""What a training run pays once, before and around its first step, with cold and with warm caches.

Each trainable set runs ``lora-bench train`` twice in fresh processes that share one empty cache
folder (Triton's kernel cache, the C++ op's build folder, TorchInductor's cache): the first run
finds every cache cold, the second warm, as a user's first and second run on a new machine. Each
row's ``training_time_s`` and ``graph_capture_s`` come from the harness itself.

With ``--profile`` each of those runs is repeated under cProfile (in its own cache folder, again
cold then warm), and the cumulative host time of named stages is read from the profile: the
C++ op's build or load, Triton's compile (or cache load) of each kernel, loading compiled kernels
onto the GPU, the graph warm-up iterations, the training-step capture, the evaluation captures.
cProfile slows Python-heavy stages, so the stage figures show where the time goes, and the
unprofiled rows say how much there is.

    python -m benchmarks.first_use --results-dir results/first-use --data-file TSV \\
        [--layers lora-kernel all] [--train-args "--model-size 124M --cuda-graphs ..."] [--profile]
"""

from __future__ import annotations

import argparse
import csv
import os
import pstats
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

# (stage, file-name suffix, function): cumulative seconds are read for each from a profile
STAGES = (
    ("import lora_bench (torch, triton, ...)", "lora_bench/cli/__init__.py", "<module>"),
    ("run context: data, model, optimizer", "lora_bench/train/run.py", "__init__"),
    ("C++ op: build or load", "lora_bench/kernels/lora_cpp.py", "compile_op"),
    ("Triton: compile or load from cache", "triton/compiler/compiler.py", "compile"),
    ("Triton: load kernel onto the GPU", "triton/compiler/compiler.py", "_init_handles"),
    ("graph warm-up iterations (training step)", "lora_bench/train/graphs.py", "warm_up"),
    ("training-step capture (warm-up included)", "lora_bench/train/graphs.py", "capture"),
    ("graph instantiate", "lora_bench/train/graph_nodes.py", "instantiate"),
    ("evaluation captures (warm-up included)", "lora_bench/train/graphs.py", "_capture"),
    ("training loop (all steps and evaluations)", "lora_bench/train/loop.py", "train_classifier"),
)

DEFAULT_TRAIN = ("--model-size 124M --lora-rank 16 --lora-alpha 16 --weights random --cuda-graphs --precision bf16 "
                 "--attention sdpa --ops fused --optimizer fused --num-epochs 5 --no-progress")


def cache_env(folder: Path) -> dict[str, str]:
    """Environment that points every on-disk cache a run uses into ``folder``."""
    env = dict(os.environ)
    env["TRITON_CACHE_DIR"] = str(folder / "triton")
    env["LORA_BENCH_EXT_DIR"] = str(folder / "ext")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    return env


def stage_seconds(profile: Path) -> list[tuple[str, float, int]]:
    """(stage, cumulative s, calls) for each of ``STAGES`` found in a cProfile output."""
    stats = pstats.Stats(str(profile)).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    out = []
    for label, suffix, func in STAGES:
        ct, calls = 0.0, 0
        for (file, _line, name), (_cc, nc, _tt, cum, _callers) in stats.items():
            if name == func and file.replace(os.sep, "/").endswith(suffix):
                ct, calls = ct + cum, calls + nc
        out.append((label, ct, calls))
    return out


def run(cmd: list[str], env: dict[str, str]) -> None:
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results-dir", type=Path, required=True)
    ap.add_argument("--data-file", type=Path, default=None)
    ap.add_argument("--layers", nargs="+", default=["lora-kernel", "all"])
    ap.add_argument("--train-args", default=DEFAULT_TRAIN, help="arguments for every lora-bench train call")
    ap.add_argument("--profile", action="store_true", help="also run each under cProfile and report stages")
    ap.add_argument("--profile-args", default="--max-steps 20 --skip-final-eval",
                    help="extra arguments for the profiled runs (shorter: the stages are paid once)")
    ap.add_argument("--cache-root", type=Path, default=None, help="where the empty cache folders are made")
    args = ap.parse_args(argv)

    args.results_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="first-use-", dir=args.cache_root))
    base = [sys.executable, "-m", "lora_bench", "train", *shlex.split(args.train_args)]
    if args.data_file:
        base += ["--data-file", str(args.data_file)]
    rows = []
    for layers in args.layers:
        env = cache_env(root / layers)
        for state in ("cold", "warm"):
            run([*base, "--trainable-layers", layers, "--results-dir", str(args.results_dir),
                 "--run-id", f"{layers}-{state}-cache"], env)
        if not args.profile:
            continue
        env = cache_env(root / f"{layers}-profiled")
        for state in ("cold", "warm"):
            prof = root / f"{layers}-{state}-cache.prof"
            run([sys.executable, "-m", "cProfile", "-o", str(prof), *base[1:], "--trainable-layers", layers,
                 *shlex.split(args.profile_args), "--results-dir", str(root / "profiled-runs"),
                 "--run-id", f"{layers}-{state}"], env)
            for label, seconds, calls in stage_seconds(prof):
                rows.append({"layers": layers, "cache": state, "stage": label, "seconds": round(seconds, 3),
                             "calls": calls})
            top = args.results_dir / f"{layers}-{state}-cache-top.txt"
            with open(top, "w") as fh:
                st = pstats.Stats(str(prof), stream=fh)
                st.sort_stats("cumulative").print_stats(60)
    if rows:
        with open(args.results_dir / "stages.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        width = max(len(r["stage"]) for r in rows)
        for layers in args.layers:
            print(f"\n{layers}: cumulative host seconds under cProfile (cold cache / warm cache)")
            cold = [r for r in rows if r["layers"] == layers and r["cache"] == "cold"]
            warm = [r for r in rows if r["layers"] == layers and r["cache"] == "warm"]
            for c, w_ in zip(cold, warm):
                print(f"  {c['stage']:<{width}}  {c['seconds']:8.2f} ({c['calls']:>4}) / {w_['seconds']:8.2f} "
                      f"({w_['calls']:>4})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
