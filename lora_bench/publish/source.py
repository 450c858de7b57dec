"""Where the docs tables read from and how they write: the checkout's committed results, each
folder's runs as its ``runs.csv`` holds them (or as one frame a report reads, for the grouping
engine), and the Markdown table every generated block is."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from lora_bench.report.load import RESULTS_DIR, RUN_DIR
from lora_bench.results.store import read_runs

ROOT = Path(__file__).resolve().parents[2]  # the checkout whose README.md and docs/ hold the blocks
RESULTS = ROOT / "results"
LAYERS = ("all", "lora", "lora-kernel")


def runs(folder: str) -> pd.DataFrame:
    return read_runs(RESULTS / folder / "runs.csv")


def as_read(df: pd.DataFrame, folder: str) -> pd.DataFrame:
    """``folder``'s rows as a report reads them: each run's folder and its results folder named, so
    that a group of one run resamples its steps and two groups' same repeats pair
    (lora_bench.report.samples)."""
    return df.assign(**{RESULTS_DIR: folder, RUN_DIR: [str(RESULTS / folder / r) for r in df["run_id"]]})


def fmt_ms(v: float) -> str:
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def md_row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_table(header: list[str], rows: list[list], *, align: str | None = None) -> str:
    align = align or "|".join(["---"] + ["---:"] * (len(header) - 1))
    return "\n".join([md_row(header), f"|{align}|", *(md_row(r) for r in rows)]) + "\n"


KERNEL_NAMES = [  # (pattern in the profiler's kernel name, what it is), first match wins
    ("_lora_mm_kernel", "LoRA GEMM, rank-r work folded in (Triton)"),
    ("_lora_mm_scale_kernel", "LoRA GEMM, scaled by DoRA's g in its epilogue (Triton)"),
    ("_lora_grad_ab_kernel", "adapter gradients (Triton)"),
    ("bfloat16_copy", "cast to bf16"),
    ("direct_copy", "copy"),
    ("flash_bprop", "attention backward (cuDNN)"),
    ("flash_fprop", "attention forward (cuDNN)"),
    ("layer_norm_grad", "LayerNorm backward"),
    ("layer_norm", "LayerNorm"),
    ("GeluBackward", "GELU backward"),
    ("Gelu", "GELU"),
    ("CUDAFunctor_add", "add (residuals, gradients)"),
    ("multi_tensor_apply", "AdamW (multi-tensor)"),
]


def kernel_name(raw: str, names: list[tuple[str, str]] = KERNEL_NAMES, other: str | None = None) -> str:
    """What a profiled kernel does: the first of ``names`` whose pattern its name holds; else
    ``other``, or the start of its own name."""
    fallback = other if other is not None else raw.split("(")[0].split("<")[0][:40]
    return next((name for pattern, name in names if pattern in raw), fallback)


