"""What a training run pays once, before and around its first step, with cold and with warm caches.

Each trainable set runs ``lora-bench train`` twice in fresh processes that share one empty cache
folder (Triton's kernel cache, the C++ op's build folder, TorchInductor's cache, Python's bytecode
cache): the first run
finds every cache cold, the second warm, as a user's first and second run on a new machine. Each
row's ``training_time_s``, ``graph_capture_s`` (warm-up iterations, capture and instantiation of
the step's graphs) and ``eval_s`` come from the harness itself; the difference between the cold and
the warm row is what compiling and building cost, the warm row what every run pays.

    python -m benchmarks.first_use --results-dir results/first-use --data-file TSV \\
        [--layers lora-kernel all] [--train-args "--model-size 124M --cuda-graphs ..."]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_TRAIN = ("--model-size 124M --lora-rank 16 --lora-alpha 16 --weights random --cuda-graphs --precision bf16 "
                 "--attention sdpa --ops fused --optimizer fused --num-epochs 5 --no-progress")


def cache_env(folder: Path) -> dict[str, str]:
    """Environment that points every on-disk cache a run uses into ``folder``."""
    env = dict(os.environ)
    env["TRITON_CACHE_DIR"] = str(folder / "triton")
    env["LORA_BENCH_EXT_DIR"] = str(folder / "ext")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    env["PYTHONPYCACHEPREFIX"] = str(folder / "pycache")  # torch's lazily imported modules too
    return env


def run(cmd: list[str], env: dict[str, str]) -> None:
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results-dir", type=Path, required=True)
    ap.add_argument("--data-file", type=Path, default=None)
    ap.add_argument("--layers", nargs="+", default=["lora-kernel", "all"])
    ap.add_argument("--train-args", default=DEFAULT_TRAIN, help="arguments for every lora-bench train call")
    ap.add_argument("--cache-root", type=Path, default=None, help="where the empty cache folders are made")
    args = ap.parse_args(argv)

    args.results_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="first-use-", dir=args.cache_root))
    base = [sys.executable, "-m", "lora_bench", "train", *shlex.split(args.train_args)]
    if args.data_file:
        base += ["--data-file", str(args.data_file)]
    for layers in args.layers:
        env = cache_env(root / layers)
        for state in ("cold", "warm"):
            run([*base, "--trainable-layers", layers, "--results-dir", str(args.results_dir),
                 "--run-id", f"{layers}-{state}-cache"], env)
    print(f"\nrows: {args.results_dir / 'runs.csv'} (run ids LAYERS-cold-cache, LAYERS-warm-cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
