"""What an interval rests on for a group of runs (lora_bench.report.stats): the repeats' values of
a metric when the group has two runs or more; when it has one, that run's measured steps from its
``steps.csv`` (warm-up steps left out, as in the run's own medians):

- a ``<column>_median`` metric whose column the steps table holds (``step_ms_median`` ->
  ``step_ms``, ``host_forward_ms_median`` -> ``host_forward_ms``): that column;
- a throughput (``tokens_per_s``, ``achieved_tflops``, ``mfu``): the run's value scaled by its
  median step over each step's time, since a throughput is the step's work over its time;
- anything else (accuracies, training time): one value, no interval.

Runs trained in one pack (``pack_id``) share the pack's measurements (its step times, memory,
training time): where a metric is the same in every run of a pack, the pack counts once, as one
repeat, not as many as it has points; a metric of each point's own (its accuracy, its losses)
counts per run.

Each repeat is keyed by its folder, sweep and repeat number, so that a ratio of two groups that ran
the same repeats of one sweep is taken in pairs (lora_bench.report.stats)."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pandas as pd

from lora_bench.errors import ResultsError
from lora_bench.report.load import RESULTS_DIR, RUN_DIR
from lora_bench.report.labels import is_blank
from lora_bench.report.stats import REPEATS, STEPS, Sample
from lora_bench.results.records import STEPS_CSV
from lora_bench.results.schema import STEP_COLUMNS
from lora_bench.results.store import read_steps

STEP_VALUES = {c.name for c in STEP_COLUMNS if c.dtype == "float64"}
THROUGHPUTS = ("tokens_per_s", "achieved_tflops", "mfu")  # inversely proportional to the step time


def steps_column(metric: str) -> str | None:
    """The steps-table column a run's ``metric`` summarises, or None."""
    base = metric.removesuffix("_median")
    return base if metric.endswith("_median") and base in STEP_VALUES else None


def per_step(metric: str) -> bool:
    """Whether a one-run group's interval for ``metric`` can come from its steps."""
    return steps_column(metric) is not None or metric in THROUGHPUTS


def sample(runs: pd.DataFrame, metric: str) -> Sample:
    """The repeats of ``metric`` in ``runs``; for a single run, its steps (see the module)."""
    runs = once_per_pack(runs, metric)
    values = pd.to_numeric(runs[metric], errors="coerce") if metric in runs else pd.Series(dtype=float)
    values = values.dropna().astype(float)
    if len(values) != 1 or len(runs) != 1:
        return Sample.of(values.to_numpy(), over=REPEATS, keys=repeat_keys(runs.loc[values.index]))
    value = float(values.iloc[0])
    steps = _measured_steps(runs.iloc[0])
    if steps is None:
        return Sample.of([value], over=REPEATS)
    col = steps_column(metric)
    if col is not None and col in steps:
        return Sample.of(steps[col].to_numpy(dtype=float), over=STEPS, value=value)
    if metric in THROUGHPUTS and "step_ms" in steps and "step_ms_median" in runs:
        med = float(pd.to_numeric(runs["step_ms_median"], errors="coerce").iloc[0])
        ms = steps["step_ms"].to_numpy(dtype=float)
        if not math.isnan(med) and (ms > 0).all():
            return Sample.of(value * med / ms, over=STEPS, value=value)
    return Sample.of([value], over=REPEATS)


PACK_ID = "pack_id"


def _packs(runs: pd.DataFrame) -> list[str | None]:
    """Each run's pack id, None for a run that trained alone."""
    if PACK_ID not in runs:
        return [None] * len(runs)
    return [None if is_blank(v) else str(v) for v in runs[PACK_ID]]


def once_per_pack(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """``runs`` with each pack's runs after its first left out, where ``metric`` is the same in all
    of them (the pack's own measurement); runs outside a pack stay."""
    if PACK_ID not in runs or metric not in runs or len(runs) < 2:
        return runs
    values = pd.to_numeric(runs[metric], errors="coerce").to_numpy(dtype=float)
    at: dict[str, list[int]] = {}
    for i, pack in enumerate(_packs(runs)):
        if pack is not None:
            at.setdefault(pack, []).append(i)
    keep = np.ones(len(runs), dtype=bool)
    for where in at.values():
        v = values[where]
        if len(where) > 1 and (np.isnan(v).all() or (not np.isnan(v).any() and (v == v[0]).all())):
            keep[where[1:]] = False
    return runs if keep.all() else runs[keep]


def pack_count(runs: pd.DataFrame) -> int:
    """How many packs the runs trained in (0: none trained packed)."""
    return len({p for p in _packs(runs) if p is not None})


PAIRING = (RESULTS_DIR, "sweep_name", "repeat")  # what a repeat shares with the other groups' same repeat


def repeat_keys(runs: pd.DataFrame) -> tuple | None:
    """(folder, sweep, repeat) per run, or None where a run lacks one of them (run outside a sweep)."""
    if not all(c in runs for c in PAIRING):
        return None
    keys = []
    for row in runs[list(PAIRING)].itertuples(index=False):
        if any(is_blank(v) for v in row):
            return None
        keys.append(tuple(str(v) for v in row))
    return tuple(keys)


def _measured_steps(run: pd.Series) -> pd.DataFrame | None:
    folder = run.get(RUN_DIR)
    if not isinstance(folder, str) or not folder:
        return None
    path = Path(folder) / STEPS_CSV
    try:
        stat = path.stat()
    except OSError:
        return None
    return _read(str(path.parent), stat.st_mtime_ns, stat.st_size)


REFUSED: dict[str, str] = {}  # run folder -> why its steps table was refused (what the report says)


def refused_steps(folders) -> list[str]:
    """One line for each of ``folders`` whose steps table was refused when read, naming the file
    and what is wrong."""
    return [f"{REFUSED[f]} (left out: that run's steps give no interval)" for f in dict.fromkeys(map(str, folders))
            if f in REFUSED]


@functools.lru_cache(maxsize=64)
def _read(folder: str, mtime_ns: int, size: int) -> pd.DataFrame | None:
    """The measured steps of one run (cached by the file's time and size, so a rewritten file is
    read again); None when the table is unreadable: the group then has no interval, and the
    reason is kept for the report to say (refused_steps)."""
    try:
        df = read_steps(Path(folder))
    except ResultsError as err:
        REFUSED[folder] = str(err)
        return None
    if df is None or df.empty:
        return None
    if "warmup" in df:
        df = df[~df["warmup"].fillna(False).astype(bool)]
    return df.reset_index(drop=True) if len(df) else None

