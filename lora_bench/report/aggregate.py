"""The table of groups of a report, from finished runs (never runs anything): the runs grouped by
the settings that vary (or those asked for), each group's median of every number with its
interval and its ratio to a baseline with the verdict (lora_bench.report.groups, the one engine),
the text columns' values counted; and the options' words: columns, the baseline, the order."""

from __future__ import annotations

import difflib
import math
import re
from collections import Counter
from dataclasses import dataclass, field

import pandas as pd

from lora_bench.config import PATH_SETTINGS, TRAINABLE_LAYERS
from lora_bench.errors import UsageError
from lora_bench.report import stats
from lora_bench.report.empty import is_empty, why_empty
from lora_bench.report.groups import group_runs, metric_sense, same
from lora_bench.report.load import MODE, RUN_DIR, shared_gpu_note, shared_ids_note
from lora_bench.report.labels import MODE_FIELDS, is_blank
from lora_bench.report.samples import pack_count, refused_steps
from lora_bench.results.schema import RETIRED_COLUMNS, SETTING_PREFIX, column_index, run_column_names

FORMATS = ("table", "markdown", "csv", "html", "json")
PHASE_METRICS = ("data_ms_median", "forward_ms_median", "backward_ms_median", "optimizer_ms_median")
DEFAULT_METRICS = ("step_ms_median", *PHASE_METRICS, "training_time_s", "val_acc", "test_acc")
EXTRA_METRICS = ("tokens_per_s",)  # in the CSV and JSON tables besides the metrics shown
NOT_GROUPED = {SETTING_PREFIX + k for k in PATH_SETTINGS}  # paths differ per machine
# a seed that differs across repeats makes them repeats over seeds, not separate configurations
REPEAT_SETTINGS = {SETTING_PREFIX + "seed"}
SIZE_ORDER = ("tiny", "124M", "355M", "774M", "1558M")


def rule(threshold: float = stats.THRESHOLD, metric: str = "step_ms_median") -> str:
    """The verdict rule, as the notes under a table state it, in the words of ``metric``'s verdicts."""
    higher, speed = metric_sense(metric)
    return stats.rule_text(threshold, higher_is_better=bool(higher), speed=speed)


@dataclass
class Report:
    keys: list[str]  # grouping columns
    metrics: list[str]
    # one row per group: keys, n, per metric <m> (median, or text summary) and <m>_lo, <m>_hi, <m>_n,
    # <m>_confidence, <m>_over, <m>_at_least (estimate_columns); the same for ratio, with ratio_paired,
    # verdict, is_baseline
    groups: pd.DataFrame
    done: pd.DataFrame  # the runs aggregated (status done)
    baseline: dict[str, str] = field(default_factory=dict)
    threshold: float = stats.THRESHOLD
    extras: list[str] = field(default_factory=list)  # numbers of the CSV and JSON tables only (p10/p90, tokens/s)
    text_metrics: list[str] = field(default_factory=list)  # metrics of words, summarised by counting
    excluded: dict[str, int] = field(default_factory=dict)  # status -> runs left out
    notes: list[str] = field(default_factory=list)  # why a metric is empty, what was left out

    @property
    def primary(self) -> str:
        return self.metrics[0]


@dataclass
class ReportPlan:
    """What a table of groups is made of, before any grouping: the finished runs, the key columns,
    the metrics shown and the extra ones, the baseline and the notes."""
    done: pd.DataFrame
    keys: list[str]
    metrics: list[str]
    extras: list[str]
    baseline: dict[str, str]
    ratio: str | None  # the metric set against the baseline
    notes: list[str]
    excluded: dict[str, int]
    threshold: float

    @property
    def numeric(self) -> list[str]:
        """The metrics (shown and extra) a group gets an estimate of."""
        return [m for m in [*self.metrics, *self.extras] if not is_text(self.done, m)]


def plan_report(df: pd.DataFrame, *, group_by: list[str] | None = None, baseline: str | None = None,
                metrics: list[str] | None = None, threshold: float = stats.THRESHOLD) -> ReportPlan:
    """The table's runs, keys, metrics and baseline, checked (a usage error names what is wrong)."""
    done = df[df["status"] == "done"].copy()
    excluded = {str(k): int(v) for k, v in df.loc[df["status"] != "done", "status"].value_counts().items()}
    if done.empty:
        what = ", ".join(f"{v} {k}" for k, v in excluded.items()) or "none"
        raise UsageError(f"nothing to report: {len(df)} run(s) found, none finished ({what}); "
                         "their errors are in the error column of runs.csv")
    # a key or metric named twice (or by two of its names: label, sweep_label) counts once
    keys = list(dict.fromkeys(resolve_column(done, k) for k in group_by)) if group_by else default_keys(done)
    notes = [n for n in (shared_ids_note(df), shared_gpu_note(df)) if n] + diverged_notes(df)
    if metrics:
        metrics = list(dict.fromkeys(resolve_column(done, m, metric=True) for m in metrics))
        for m in metrics:
            if is_empty(done, m):
                notes.append(why_empty(done, m))
            if m not in done:
                done[m] = pd.NA
    else:
        metrics = [m for m in DEFAULT_METRICS if not is_empty(done, m)]
        notes += [why_empty(done, m) for m in DEFAULT_METRICS if is_empty(done, m)]
        if not metrics:
            raise UsageError("nothing to report: the finished runs hold none of the default metrics "
                             f"({', '.join(DEFAULT_METRICS)}); pick some with --metrics")
    if pack_count(done):
        notes.append(PACKS_NOTE)
    spec = parse_baseline(baseline, done) if baseline else {}
    if spec and is_text(done, metrics[0]):
        notes.append(f"{metrics[0]} is text: no ratio to the baseline (put a numeric metric first)")
    ratio = metrics[0] if spec and not is_text(done, metrics[0]) else None
    return ReportPlan(done=done, keys=keys, metrics=metrics, extras=extra_metrics(done, metrics), baseline=spec,
                      ratio=ratio, notes=notes, excluded=excluded, threshold=threshold)


def build_report(df: pd.DataFrame, *, group_by: list[str] | None = None, baseline: str | None = None,
                 metrics: list[str] | None = None, threshold: float = stats.THRESHOLD) -> Report:
    """The table of groups of ``df``: planned, then grouped once by the engine."""
    plan = plan_report(df, group_by=group_by, baseline=baseline, metrics=metrics, threshold=threshold)
    groups = group_runs(plan.done, plan.keys, metrics=plan.numeric, baseline=plan.baseline, ratio_metric=plan.ratio,
                        threshold=threshold)
    return report_of(plan, groups)


def report_of(plan: ReportPlan, groups: list, *, keys: list[str] | None = None) -> Report:
    """The table of ``groups`` (RunGroups holding an estimate of each of ``plan.numeric``), keyed
    by ``keys`` (default: the plan's): a row per group, in the keys' natural order."""
    keys = keys or plan.keys
    done, metrics, extras = plan.done, plan.metrics, plan.extras
    records = []
    for group in groups:
        g = group.runs
        rec = {k: group.values.get(k, g[k].iloc[0] if k in g else pd.NA) for k in keys}
        rec["n"] = len(g)
        rec["packs"] = pack_count(g)
        for m in [*metrics, *extras]:
            if is_text(done, m):
                rec[m] = text_summary(g[m])
                rec.update({f"{m}_lo": math.nan, f"{m}_hi": math.nan, f"{m}_n": len(g), f"{m}_confidence": math.nan,
                            f"{m}_over": "", f"{m}_at_least": False})
            else:
                rec.update(estimate_columns(m, group.estimates[m]))
        if plan.ratio:
            r = group.ratio
            rec.update({**estimate_columns("ratio", r), "ratio_paired": r.paired, "verdict": group.verdict,
                        "is_baseline": group.is_baseline})
        records.append(rec)
    records.sort(key=lambda r: tuple(order_key(r[k], col=k) for k in keys))
    return Report(keys=keys, metrics=metrics, groups=pd.DataFrame(records), done=done, baseline=plan.baseline,
                  threshold=plan.threshold, extras=extras, text_metrics=[m for m in metrics if is_text(done, m)],
                  excluded=plan.excluded, notes=plan.notes)


def extra_metrics(done: pd.DataFrame, metrics: list[str]) -> list[str]:
    """The p10 and p90 beside each ``*_median`` metric, and tokens/s, where the runs hold them."""
    out = []
    for m in metrics:
        if m.endswith("_median"):
            out += [m.removesuffix("_median") + q for q in ("_p10", "_p90")]
    out += EXTRA_METRICS
    return [c for c in dict.fromkeys(out) if c not in metrics and not is_empty(done, c)]


ESTIMATE_SUFFIXES = ("_lo", "_hi", "_n", "_confidence", "_over")  # a metric's columns beside its median


def estimate_columns(metric: str, e: stats.Estimate) -> dict:
    """A metric's median, its interval, the n it stands on, the confidence the interval reaches
    (a lower bound where ``<metric>_at_least``) and what the interval is over."""
    return {metric: e.value, f"{metric}_lo": e.lo, f"{metric}_hi": e.hi, f"{metric}_n": e.n,
            f"{metric}_confidence": e.confidence, f"{metric}_over": e.over, f"{metric}_at_least": e.at_least}


def estimate_of(rec: dict, metric: str) -> stats.Estimate:
    """A group's estimate back from its columns."""
    over = rec.get(f"{metric}_over") or ""
    n = rec.get(f"{metric}_n", rec.get("n"))
    return stats.Estimate(_float(rec.get(metric)), _float(rec.get(f"{metric}_lo")), _float(rec.get(f"{metric}_hi")),
                          n=int(n) if not is_blank(n) else 0, over=over if isinstance(over, str) else "",
                          paired=bool(rec.get(f"{metric}_paired")), confidence=_float(rec.get(f"{metric}_confidence")),
                          at_least=bool(rec.get(f"{metric}_at_least")))


def _float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


PACKS_NOTE = ("n: runs (in how many packs, where they trained packed); the runs of one pack share its "
              "measurements (step times, memory, training time), which count once per pack, as one repeat; "
              "each run's own accuracies and losses count per run")


def diverged_notes(df: pd.DataFrame) -> list[str]:
    """One note naming the runs whose loss was not finite (status diverged, left out): their
    numbers are measured, but they are not results."""
    bad = df[df["status"] == "diverged"]
    if bad.empty:
        return []
    at = bad["diverged_at_step"] if "diverged_at_step" in bad else pd.Series(pd.NA, index=bad.index)
    named = [f"{r} (from step {s})" if not pd.isna(s) else str(r) for r, s in zip(bad["run_id"], at)]
    more = f" and {len(named) - 5} more" if len(named) > 5 else ""
    return [f"diverged, not included (the loss is not finite, NaN or inf): {', '.join(named[:5])}{more}"]


def varying_settings(done: pd.DataFrame) -> list[str]:
    """Settings columns with more than one value among ``done`` (paths and seeds left out)."""
    return [c for c in done.columns if c.startswith(SETTING_PREFIX) and c not in NOT_GROUPED | REPEAT_SETTINGS
            and done[c].fillna("").astype(str).nunique() > 1]


def collapse_modes(keys: list[str]) -> list[str]:
    """The execution-mode settings among ``keys`` replaced by the one ``mode`` column (its human
    name), where the first of them stood."""
    out = []
    for k in keys:
        k = MODE if k in MODE_FIELDS else k
        if k not in out:
            out.append(k)
    return out


def default_keys(done: pd.DataFrame) -> list[str]:
    """The settings that vary across the runs (execution modes by their human name), led by the
    run label where labels split runs that share their settings."""
    keys = collapse_modes(varying_settings(done))
    if "sweep_label" in done and done["sweep_label"].fillna("").ne("").all() and done["sweep_label"].nunique() > 1:
        by_settings = done.groupby(keys, dropna=False).ngroups if keys else 1
        if done.groupby(["sweep_label", *keys], dropna=False).ngroups > by_settings:
            keys = ["sweep_label", *keys]
    return keys or [c for c in (SETTING_PREFIX + "model_size", SETTING_PREFIX + "trainable_layers") if c in done]


def is_text(df: pd.DataFrame, col: str) -> bool:
    """A column of words (backend, …), aggregated by counting values rather than a median."""
    schema = column_index().get(col)
    if schema is not None:
        return schema.dtype == "string"
    return col in df and not pd.api.types.is_numeric_dtype(df[col]) and \
        pd.to_numeric(df[col].dropna(), errors="coerce").isna().any()


def resolve_column(df: pd.DataFrame, name: str, *, metric: bool = False) -> str:
    """A setting name (``trainable_layers``), ``label``, ``mode``, or any results column; as a
    metric, also a schema column these results lack (reported as empty, with the reason)."""
    name = name.strip()
    if name in RETIRED_COLUMNS:  # older rows hold it; it is not shown as a result
        raise UsageError(f"{name} is no longer written and not reported: {RETIRED_COLUMNS[name]}")
    for cand in (SETTING_PREFIX + name, name, "sweep_" + name):
        if cand in df.columns and not (metric and cand.startswith(SETTING_PREFIX)):
            return cand
    if metric and name in run_column_names() and not name.startswith(SETTING_PREFIX):
        return name
    pool = sorted({c.removeprefix(SETTING_PREFIX) for c in df.columns})
    close = difflib.get_close_matches(name, pool, n=3)
    if close:
        hint = f"; did you mean {', '.join(map(repr, close))}?"
    elif metric:
        cols = [c for c in df.columns if not c.startswith(SETTING_PREFIX) and c in column_index()]
        hint = f"; result columns include {', '.join(cols[:12])}, …"
    else:
        hint = ("; settings: " + ", ".join(sorted(c.removeprefix(SETTING_PREFIX) for c in df.columns
                                                  if c.startswith(SETTING_PREFIX))))
    what = "metric" if metric else "setting or column"
    raise UsageError(f"unknown {what} {name!r}{hint}")


def parse_baseline(text: str, done: pd.DataFrame) -> dict[str, str]:
    """``key=value[,key=value]``; each key a setting, each value one that some finished run has."""
    spec = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise UsageError(f"--baseline {text!r}: write key=value, e.g. trainable_layers=all")
        key, value = (s.strip() for s in part.split("=", 1))
        col = resolve_column(done, key)
        present = sorted({str(v) for v in done[col].dropna()})
        if not any(same(v, value) for v in present):
            raise UsageError(f"--baseline {part!r} matches no finished run; {key} takes: {', '.join(present)}")
        spec[col] = value
    return spec


def numbers(s: pd.Series) -> pd.Series:
    return pd.to_numeric(s, errors="coerce").dropna().astype(float)


def text_summary(s: pd.Series) -> str:
    """'host' when the repeats agree, 'host 2 · device 1' when they do not, '' when blank."""
    counts = Counter(str(v) for v in s if not is_blank(v))
    if len(counts) <= 1:
        return next(iter(counts), "")
    return " · ".join(f"{v} {n}" for v, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def order_key(value, *, col: str = "") -> tuple:
    """Sizes and trainable-layer choices in their natural order, numbers by value, execution modes
    from the plainest (eager) up, labels naturally (row 2 before row 10)."""
    v = "" if is_blank(value) else str(value)
    if col == MODE:
        return (3, v.count(" + ") + (0 if v.startswith("eager") else 1), _natural(v))
    for known in (SIZE_ORDER, TRAINABLE_LAYERS):
        if v in known:
            return (0, known.index(v), ())
    try:
        return (1, float(v), ())
    except ValueError:
        return (2, 0, _natural(v))


def _natural(v: str) -> tuple:
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.findall(r"\d+|\D+", v))


def refused_notes(df: pd.DataFrame) -> list[str]:
    """A line for each run of ``df`` whose steps table a report refused to read (samples.refused_steps)."""
    return refused_steps(df[RUN_DIR]) if RUN_DIR in df else []
