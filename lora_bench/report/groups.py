"""The one grouping engine of the report's tables, the study view, ``lora-bench compare`` and the
docs tables: ``group_runs`` groups runs by key columns and gives each group its estimates (a
median with its interval per metric) and its ratio to the baseline runs that share its other
keys, with that ratio's interval and its verdict. Every interval, ratio, difference and verdict a
report states is computed here, on the statistics of lora_bench.report.stats and the samples of
lora_bench.report.samples.

Where the views read a rule differently, the rule is a parameter: ``lone_baseline`` (a group with
no baseline of its own keys is set against the only baseline group there is) and ``unknown`` (the
verdict of a ratio that cannot be computed: '' in the report, 'unclear' in a comparison)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pandas as pd

from lora_bench.report import stats
from lora_bench.report.samples import sample
from lora_bench.report.stats import NONE, Estimate, Sample
from lora_bench.results.runs_csv import same_number
from lora_bench.results.schema import column_index

SPEED_UNITS = ("ms", "s", "min", "tokens/s", "TFLOP/s")


@dataclass
class RunGroup:
    values: dict  # key column -> the group's value
    runs: pd.DataFrame
    estimates: dict[str, Estimate]  # metric -> median with its interval
    is_baseline: bool = False
    ratio: Estimate = NONE  # the ratio metric's median / its baseline's, with its interval
    verdict: str = ""  # stats.verdict of that ratio ('' for a baseline group)
    has_baseline: bool = False  # baseline runs were found to divide by
    baseline_runs: pd.DataFrame | None = None  # those runs (None without a baseline)


def metric_sense(col: str) -> tuple[bool | None, bool]:
    """(higher is better, or None where the schema names no direction; whether it is a speed:
    a time or a throughput)."""
    c = column_index().get(col)
    better = {"higher": True, "lower": False}.get(getattr(c, "better", ""))
    speed = c is not None and (c.unit in SPEED_UNITS or col == "mfu") and better is not None
    return better, speed


def same(a, b) -> bool:
    """Two cells name the same value: equal as text (any case) or as numbers."""
    a, b = str(a), str(b)
    return a.casefold() == b.casefold() or same_number(a, b)


def matches(df: pd.DataFrame, spec: dict, *, equal: Callable = same) -> pd.Series:
    mask = pd.Series(True, index=df.index)
    for col, value in spec.items():
        mask &= df[col].map(lambda v, value=value: equal(v, value))
    return mask


def exact(a, b) -> bool:
    return a == b


# -- one group, one pair -------------------------------------------------------------------------
def estimate(runs: pd.DataFrame, metric: str) -> Estimate:
    """The median of ``metric`` over ``runs`` with its interval."""
    return summary(sample(runs, metric))


def summary(s: Sample) -> Estimate:
    """A sample's median (or its one run's recorded value) with its interval."""
    return stats.median_interval(s)


def verdict(r: Estimate, *, metric: str = "step_ms_median", threshold: float = stats.THRESHOLD) -> str:
    """The verdict of a ratio of ``metric``, in the words of its sense (stats.verdict)."""
    higher, speed = metric_sense(metric)
    return stats.verdict(r, threshold=threshold, higher_is_better=bool(higher), speed=speed)


def ratio(candidate: Sample, baseline: Sample, *, metric: str = "step_ms_median",
          threshold: float = stats.THRESHOLD) -> tuple[Estimate, str]:
    """median(candidate) / median(baseline) with its interval, and its verdict."""
    r = stats.ratio_interval(candidate, baseline)
    return r, verdict(r, metric=metric, threshold=threshold)


def difference(candidate: Sample, baseline: Sample) -> tuple[Estimate, bool | None]:
    """median(candidate) − median(baseline) with its interval, and whether that interval leaves
    out 0 (None without an interval)."""
    d = stats.difference_interval(candidate, baseline)
    return d, stats.excludes_zero(d)


def fails_gate(r: Estimate, *, metric: str, fail_above: float | None) -> bool:
    """Worse by more than ``fail_above`` with the ratio's whole interval (never without a gate)."""
    if fail_above is None:
        return False
    higher, speed = metric_sense(metric)
    return verdict(r, metric=metric, threshold=fail_above) == stats.worse(higher_is_better=bool(higher), speed=speed)


# -- the engine ----------------------------------------------------------------------------------
def group_runs(frame: pd.DataFrame, keys: list[str], *, metrics: tuple[str, ...] | list[str] = (),
               baseline: dict | None = None, ratio_metric: str | None = None, threshold: float = stats.THRESHOLD,
               lone_baseline: bool = True, unknown: str = "", equal: Callable = same,
               sort: bool = False, unmatched: tuple[str, ...] | list[str] = ()) -> list[RunGroup]:
    """The runs of ``frame`` grouped by ``keys`` (in first-seen order, or sorted), each with the
    estimate of every metric of ``metrics``; with a ``baseline`` (column -> value) and a
    ``ratio_metric``, each group's ratio to the baseline runs sharing its other keys (see the module)
    but those of ``unmatched`` (keys that split the groups but that the baseline does not depend on)."""
    spec = dict(baseline or {})
    out = []
    parts = frame.groupby(keys, sort=sort, dropna=False) if keys else [((), frame)]
    base = frame[matches(frame, spec, equal=equal)] if spec and ratio_metric else None
    for values, g in parts:
        values = dict(zip(keys, values if isinstance(values, tuple) else (values,)))
        group = RunGroup(values=values, runs=g, estimates={m: estimate(g, m) for m in metrics},
                         is_baseline=bool(spec) and bool(matches(g, spec, equal=equal).all()))
        if base is not None:
            _against(group, base, keys=[k for k in keys if k not in unmatched], spec=spec, metric=ratio_metric, threshold=threshold,
                     lone_baseline=lone_baseline, unknown=unknown, equal=equal)
        out.append(group)
    return out


def _against(group: RunGroup, base: pd.DataFrame, *, keys: list[str], spec: dict, metric: str,
             threshold: float, lone_baseline: bool, unknown: str, equal: Callable) -> None:
    """``group``'s ratio to the ``base`` runs sharing its keys outside the baseline's, and its verdict."""
    other = [k for k in keys if k not in spec]
    rows = base[matches(base, {k: group.values[k] for k in other}, equal=equal)] if other else base
    if rows.empty and lone_baseline and keys and base.groupby(keys, dropna=False).ngroups == 1:
        rows = base
    group.has_baseline = not rows.empty
    group.baseline_runs = rows if not rows.empty else None
    own = group.estimates.get(metric) or estimate(group.runs, metric)
    r, word = NONE, unknown
    if not rows.empty and own.known:
        r, word = ratio(sample(group.runs, metric), sample(rows, metric), metric=metric, threshold=threshold)
    group.ratio = r
    if not group.is_baseline:
        group.verdict = word if r.known else unknown
