"""Kernel classes by name, and a profiled run's device time per phase and class.

A profiled run (``profile: torch`` or ``kernels``, lora_bench.train.profiling) writes per phase its
kernel launches and device time per step (``kernels_by_phase.csv``) and its longest kernels
(``top_kernels.csv``: at most the profiler's top rows over all phases, each name cut at 200
characters). ``class_times`` sorts the named kernels into CLASSES by the first pattern their name
matches; what a phase's totals hold beyond its named kernels is the class UNNAMED. A class says
what a kernel's name says, not what it computes: a kernel whose name fits no pattern is OTHER."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from lora_bench.escaping import csv_value
from lora_bench.report.load import kernel_counts
from lora_bench.results.guarded_read import read_results_file

TOP_FILE = "top_kernels.csv"
TOP_MAX_BYTES = 1 << 20  # a few dozen rows of at most 200-character names

# (class, patterns searched in the kernel's name, case-insensitive); the first match wins, so a
# pattern sits below the more specific ones it would also match (a cuBLAS reduction is a GEMM's,
# a copy kernel is elementwise, the fused AdamW's kernels are functors)
CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("memcpy, memset", (r"^memcpy", r"^memset")),
    ("LoRA Triton kernels", (r"^_lora_\w*kernel",)),
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("attention (SDPA)", ("sdpa", "flash", "fmha", "attention", "cudnn::fusion")),
    ("GEMMs (cuBLAS, CUTLASS)", ("gemm", "nvjet", "cutlass", "cublas", "xmma")),
    ("Triton kernels of torch.compile", ("^triton_",)),
    ("casts, copies", ("copy_kernel", "_to_copy", r"\bcast")),
    ("norms, softmax, reductions, loss", ("norm", "softmax", "reduce", "nll_loss", "cross_entropy", "welford")),
    ("other elementwise", ("elementwise", "functor", "gelu", "gather", "scatter", "index", "arange", "fill")),
)
OTHER = "other named kernels"
UNNAMED = "kernels not named in top_kernels.csv"
ORDER = (*(name for name, _ in CLASSES), OTHER, UNNAMED)
_COMPILED = tuple((name, re.compile("|".join(patterns), re.I)) for name, patterns in CLASSES)
_CUT = 1e-9  # ms/step or launches/step below which a phase's rest is rounding, not a kernel


def kernel_class(name: str) -> str:
    """The class of a kernel named ``name``: the first of CLASSES whose pattern it matches, else OTHER."""
    return next((cls for cls, pattern in _COMPILED if pattern.search(name)), OTHER)


def classes_text() -> str:
    """How kernels are sorted, for a reader: each class with its patterns, in matching order."""
    listed = "; ".join(f"{cls}: " + ", ".join(f"`{p}`" for p in patterns) for cls, patterns in CLASSES)
    return (f"kernel classes by name alone (lora_bench/report/kernel_classes.py): a kernel belongs to the first "
            f"class one of whose patterns its name contains (regular expressions, any case): {listed}; any other "
            f"name: {OTHER}; {UNNAMED}: a phase's kernel time and launches beyond the kernels top_kernels.csv names "
            "(it keeps the profile's longest kernels only)")


@dataclass(frozen=True)
class ClassTime:
    launches: float = 0.0  # per step
    ms: float = 0.0  # device ms per step
    longest: str = ""  # the longest kernel of the class in the phase, by name
    longest_ms: float = 0.0


@dataclass
class KernelProfile:
    """One profiled run's kernels: per phase its totals and its classes."""
    run_id: str
    totals: dict[str, tuple[float, float]]  # phase -> (launches, kernel ms) per step
    classes: dict[str, dict[str, ClassTime]] = field(default_factory=dict)  # phase -> class -> time


def top_kernels(run_dir: str | Path) -> pd.DataFrame | None:
    """A profiled run's ``top_kernels.csv`` (phase, kernel, calls_per_step, ms_per_step), or None
    where the run wrote none or it lacks those columns."""
    data = read_results_file(Path(run_dir) / TOP_FILE, limit=TOP_MAX_BYTES, root=Path(run_dir).parent)
    if data is None:
        return None
    df = pd.read_csv(io.BytesIO(data), dtype={"phase": str, "kernel": str}, keep_default_na=False)
    if not {"phase", "kernel", "calls_per_step", "ms_per_step"} <= set(df.columns):
        return None
    df["kernel"] = df["kernel"].map(csv_value)
    df["phase"] = df["phase"].map(csv_value)
    return df


def class_times(run_id: str, run_dir: str | Path) -> KernelProfile | None:
    """The run's kernel time per phase and class, or None where it wrote no kernel summaries."""
    totals = kernel_counts(run_dir)
    top = top_kernels(run_dir)
    if not totals or top is None:
        return None
    out = KernelProfile(run_id=run_id, totals=totals)
    for phase in totals:
        acc: dict[str, ClassTime] = {}
        for r in top[top["phase"] == phase].itertuples():
            cls, calls, ms = kernel_class(str(r.kernel)), float(r.calls_per_step), float(r.ms_per_step)
            old = acc.get(cls, ClassTime())
            longer = ms > old.longest_ms
            acc[cls] = ClassTime(launches=old.launches + calls, ms=old.ms + ms,
                                 longest=str(r.kernel) if longer else old.longest,
                                 longest_ms=ms if longer else old.longest_ms)
        launches = totals[phase][0] - sum(c.launches for c in acc.values())
        ms = totals[phase][1] - sum(c.ms for c in acc.values())
        if launches > _CUT or ms > _CUT:
            acc[UNNAMED] = ClassTime(launches=max(launches, 0.0), ms=max(ms, 0.0))
        out.classes[phase] = {cls: acc[cls] for cls in ORDER if cls in acc}
    return out
