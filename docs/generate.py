"""Regenerate the generated parts of the documentation from the repository's own files.

- ``docs/results-schema.md`` in full, from ``lora_bench/results/schema.py`` and ``TrainConfig``;
- every table between ``<!-- generated:NAME -->`` and ``<!-- /generated -->`` in ``README.md`` and
  ``docs/*.md``, computed from the committed results under ``results/``.

    python docs/generate.py          # rewrite what is out of date
    python docs/generate.py --check  # exit 1 and name the files that are out of date

The tables live in the package (lora_bench.publish); the one kept here reads a benchmark script's
table (benchmarks/), which the package never imports.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: this checkout's lora_bench
    sys.path.insert(0, str(ROOT))

from lora_bench.fileio import atomic_write_text  # noqa: E402
from lora_bench.publish import docs  # noqa: E402
from lora_bench.publish.docs_study import table_answer  # noqa: E402,F401 (the README's first screen)
from lora_bench.publish.source import RESULTS, md_table  # noqa: E402


def table_ddp() -> str:
    """Tokens/s on one GPU (the median of the one-worker sweep's repeats) and under DDP on two, with
    the all-reduce time (eager only: inside a captured step it is not timed apart)."""
    from benchmarks.ddp_table import table, walls

    t = table(RESULTS / "scaling" / "ddp-2gpu")
    rows = []
    for graphs, mode in (("False", "eager fp32"), ("True", "CUDA graphs + bf16 + fused")):
        for size in ("1558M", "124M"):
            for layers in ("all", "lora", "lora-kernel"):
                m = t[(t["size"] == size) & (t["layers"] == layers) & (t["graphs"].astype(str) == graphs)]
                if m.empty and layers == "lora-kernel":  # measured only where the study ran it
                    continue
                r = m.iloc[0]
                comm = (f"{float(r.b16_allreduce_ms):.1f} / {float(r.b16_exposed_ms):.1f}" if graphs == "False"
                        else "in the graph")
                rows.append([f"{size} {layers}, {mode}", f"{float(r.one_gpu_tok_s):,.0f}", f"{r.b16_tok_s:,.0f}",
                             f"**{r.b16_x:.2f}×**", comm, f"{r.b8_tok_s:,.0f}", f"{r.b8_x:.2f}×"])
    w = walls(RESULTS / "scaling" / "ddp-2gpu")
    one, two = w["sweep-1-worker"], w["sweep-2-workers"]
    return (md_table(["tokens/s, one H200 vs two (DDP, NCCL)", "1 GPU, batch 8", "2 GPUs, 8 per GPU", "speed-up",
                    "all-reduce / not hidden, ms per step", "2 GPUs, global batch 8", "speed-up"], rows)
            + f"\nThe 16-run sweep (`configs/dask-2gpu.yaml`): {one:.1f} s on one Dask worker, {two:.1f} s on two "
              f"(one per GPU): {two / one:.3f}× the one-GPU wall time.\n")


TABLES = {**docs.TABLES, "ddp": table_ddp}


def render_blocks(text: str) -> str:
    return docs.render_blocks(text, TABLES)


def expected() -> dict[Path, str]:
    """Every generated file (or file with generated blocks) and the content it should have."""
    return docs.expected(TABLES, root=ROOT)


def outdated() -> list[Path]:
    return docs.outdated(expected())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is out of date")
    args = ap.parse_args()
    files = expected()
    stale = docs.outdated(files)
    if args.check:
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)} (run `python docs/generate.py`)")
        sys.exit(1 if stale else 0)
    for path, text in files.items():
        if path in stale:
            atomic_write_text(path, text)
            print(f"written: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
