"""Reports from results only (never runs anything): merge result folders by run id, aggregate the
repeats of each configuration (median and IQR), group by chosen settings, compare against a
baseline, and render a rich table, Markdown or CSV.

Within-spread rule: a group's difference from the baseline is marked '≈' when
|median(group) − median(baseline)| ≤ max(IQR(group), IQR(baseline)), the IQRs taken over repeats
of the primary metric. Such a difference is inside the run-to-run spread and should not be read as
a speed-up or slow-down. With fewer than 2 repeats on either side the spread is unknown: '?'."""

from __future__ import annotations

import difflib
import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from lora_bench.config import TRAINABLE_LAYERS
from lora_bench.errors import UsageError
from lora_bench.results.schema import SETTING_PREFIX, column_index
from lora_bench.results.store import read_runs, result_rows

FORMATS = ("table", "markdown", "csv")
PHASE_METRICS = ("data_ms_median", "forward_ms_median", "backward_ms_median", "optimizer_ms_median")
DEFAULT_METRICS = ("step_ms_median", *PHASE_METRICS, "training_time_s", "val_acc", "test_acc")
NOT_GROUPED = {SETTING_PREFIX + "data_file", SETTING_PREFIX + "weights_dir"}  # paths differ per machine
SIZE_ORDER = ("tiny", "124M", "355M", "774M", "1558M")
LABELS = {"step_ms_median": "step ms", "training_time_s": "train s", "val_acc": "val acc %",
          "test_acc": "test acc %", "train_acc": "train acc %", "tokens_per_s": "tokens/s",
          "sweep_label": "label"}
RULE = ("≈: |Δ median| ≤ max(IQR of the group, IQR of the baseline), i.e. within run-to-run spread; "
        "?: fewer than 2 repeats on a side, spread unknown")


# -- reading ---------------------------------------------------------------------------------------
def _result_dirs(path: Path) -> list[Path]:
    if path.is_file():
        return [path.parent]
    if not path.is_dir():
        raise UsageError(f"no such results folder: {path}")

    def holds(d: Path) -> bool:
        return (d / "runs.csv").is_file() or any(d.glob("*/run.json"))

    if holds(path):
        return [path]
    return sorted(d for d in path.iterdir() if d.is_dir() and holds(d))


def load_results(paths: list[Path]) -> pd.DataFrame:
    """Every run under ``paths`` (folders, runs.csv files, or a folder of result folders), merged
    by run id (a done row beats a failed one; otherwise the later start wins), schema dtypes."""
    merged: dict[str, dict] = {}
    for path in paths:
        for d in _result_dirs(Path(path)):
            for row in result_rows(d):
                old = merged.get(row["run_id"])
                if old is None or _rank(row) >= _rank(old):
                    merged[row["run_id"]] = row
    if not merged:
        shown = " ".join(str(p) for p in paths)
        raise UsageError(f"nothing to report: no results under {shown} "
                         "(run `lora-bench sweep FILE` or `lora-bench train` first)")
    buf = io.StringIO()
    pd.DataFrame(list(merged.values())).to_csv(buf, index=False)
    buf.seek(0)
    return read_runs(buf)


def _rank(row: dict) -> tuple:
    return (row.get("status") == "done", row.get("started_at") or "")


# -- aggregation ---------------------------------------------------------------------------------
@dataclass
class Report:
    keys: list[str]  # grouping columns
    metrics: list[str]
    groups: pd.DataFrame  # one row per group: keys, n, <metric> (median) and <metric>_iqr, ratio, within, is_baseline
    done: pd.DataFrame  # the runs aggregated (status done)
    baseline: dict[str, str] = field(default_factory=dict)
    excluded: dict[str, int] = field(default_factory=dict)  # status -> runs left out

    @property
    def primary(self) -> str:
        return self.metrics[0]


def build_report(df: pd.DataFrame, *, group_by: list[str] | None = None, baseline: str | None = None,
                 metrics: list[str] | None = None) -> Report:
    done = df[df["status"] == "done"].copy()
    excluded = {str(k): int(v) for k, v in df.loc[df["status"] != "done", "status"].value_counts().items()}
    if done.empty:
        what = ", ".join(f"{v} {k}" for k, v in excluded.items()) or "none"
        raise UsageError(f"nothing to report: {len(df)} run(s) found, none finished ({what}); "
                         "their errors are in the error column of runs.csv")
    keys = [resolve_column(done, k) for k in group_by] if group_by else default_keys(done)
    if metrics:
        metrics = [resolve_column(done, m, metric=True) for m in metrics]
    else:
        metrics = [m for m in DEFAULT_METRICS if m in done and done[m].notna().any()]
        if not metrics:
            raise UsageError("nothing to report: the finished runs hold none of the default metrics "
                             f"({', '.join(DEFAULT_METRICS)}); pick some with --metrics")
    spec = parse_baseline(baseline, done) if baseline else {}
    records = []
    for values, g in done.groupby(keys, sort=False, dropna=False):
        rec = dict(zip(keys, values if isinstance(values, tuple) else (values,)))
        rec["n"] = len(g)
        for m in metrics:
            rec[m], rec[f"{m}_iqr"] = _median_iqr(g[m])
        if spec:
            rec.update(_against_baseline(rec, g, done, keys=keys, spec=spec, metric=metrics[0]))
        records.append(rec)
    records.sort(key=lambda r: tuple(order_key(r[k]) for k in keys))
    return Report(keys=keys, metrics=metrics, groups=pd.DataFrame(records), done=done, baseline=spec,
                  excluded=excluded)


def default_keys(done: pd.DataFrame) -> list[str]:
    """The run labels when every run has one, else the settings that vary across the runs."""
    if "sweep_label" in done and done["sweep_label"].fillna("").ne("").all() and done["sweep_label"].nunique() > 1:
        return ["sweep_label"]
    keys = [c for c in done.columns if c.startswith(SETTING_PREFIX) and c not in NOT_GROUPED
            and done[c].fillna("").astype(str).nunique() > 1]
    return keys or [c for c in (SETTING_PREFIX + "model_size", SETTING_PREFIX + "trainable_layers") if c in done]


def resolve_column(df: pd.DataFrame, name: str, *, metric: bool = False) -> str:
    """A setting name (``trainable_layers``), ``label``, or any results column."""
    name = name.strip()
    for cand in (SETTING_PREFIX + name, name, "sweep_" + name):
        if cand in df.columns and not (metric and cand.startswith(SETTING_PREFIX)):
            return cand
    pool = sorted({c.removeprefix(SETTING_PREFIX) for c in df.columns})
    close = difflib.get_close_matches(name, pool, n=3)
    if close:
        hint = f"; did you mean {', '.join(map(repr, close))}?"
    elif metric:
        numeric = [c for c in df.columns if not c.startswith(SETTING_PREFIX) and pd.api.types.is_numeric_dtype(df[c])]
        hint = f"; numeric result columns include {', '.join(numeric[:12])}, …"
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
        if not any(_same(v, value) for v in present):
            raise UsageError(f"--baseline {part!r} matches no finished run; {key} takes: {', '.join(present)}")
        spec[col] = value
    return spec


def matches(df: pd.DataFrame, spec: dict[str, str]) -> pd.Series:
    mask = pd.Series(True, index=df.index)
    for col, value in spec.items():
        mask &= df[col].map(lambda v: _same(v, value))
    return mask


def _against_baseline(rec: dict, g: pd.DataFrame, done: pd.DataFrame, *, keys: list[str], spec: dict,
                      metric: str) -> dict:
    """Ratio of this group's median to its baseline's: the baseline runs that share this group's
    other settings (e.g. the same model size), or the only baseline group if there is one."""
    base = done[matches(done, spec)]
    other = [k for k in keys if k not in spec]
    same = base[matches(base, {k: rec[k] for k in other})] if other else base
    if same.empty and base.groupby(keys, dropna=False).ngroups == 1:
        same = base
    is_base = bool(matches(g, spec).all())
    med = rec[metric]
    if same.empty or pd.isna(med):
        return {"ratio": math.nan, "within": None, "is_baseline": is_base}
    b_med, b_iqr = _median_iqr(same[metric])
    within = None
    if not (pd.isna(rec[f"{metric}_iqr"]) or pd.isna(b_iqr)):
        within = bool(abs(med - b_med) <= max(rec[f"{metric}_iqr"], b_iqr))
    return {"ratio": med / b_med if b_med else math.nan, "within": within, "is_baseline": is_base}


def _median_iqr(s: pd.Series) -> tuple[float, float]:
    v = pd.to_numeric(s, errors="coerce").dropna().astype(float)
    if v.empty:
        return math.nan, math.nan
    iqr = float(v.quantile(0.75) - v.quantile(0.25)) if len(v) >= 2 else math.nan
    return float(v.median()), iqr


def _same(a, b) -> bool:
    a, b = str(a), str(b)
    if a.casefold() == b.casefold():
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def order_key(value) -> tuple:
    """Sizes and trainable-layer choices in their natural order, numbers by value, labels naturally."""
    v = "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)
    for known in (SIZE_ORDER, TRAINABLE_LAYERS):
        if v in known:
            return (0, known.index(v), ())
    try:
        return (1, float(v), ())
    except ValueError:
        return (2, 0, tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.findall(r"\d+|\D+", v)))


# -- rendering -----------------------------------------------------------------------------------
def label(col: str) -> str:
    if col in LABELS:
        return LABELS[col]
    if col.startswith(SETTING_PREFIX):
        return col.removeprefix(SETTING_PREFIX)
    unit = getattr(column_index().get(col), "unit", "")
    name = col.removesuffix("_median").removesuffix(f"_{unit}").replace("_", " ")
    return f"{name} {unit}".strip()


def _digits(values: pd.Series, col: str) -> int:
    """One precision per column (by its largest value) so the column's decimals line up."""
    if getattr(column_index().get(col), "unit", "") == "%":
        return 2
    top = pd.to_numeric(values, errors="coerce").abs().max()
    return 1 if top >= 100 else 2 if top >= 1 else 3


def _num(v, digits: int) -> str:
    return "-" if v is None or pd.isna(v) else f"{float(v):.{digits}f}"


def cells(rep: Report) -> tuple[list[str], list[list[str]], list[str]]:
    """Header, rows and notes shared by the rich and Markdown renderings."""
    head = [label(k) for k in rep.keys] + ["n"]
    for i, m in enumerate(rep.metrics):
        head += [label(m)] + (["IQR"] if i == 0 else [])
    if rep.baseline:
        head.append("vs " + ",".join(f"{label(k)}={v}" for k, v in rep.baseline.items()))
    rows = []
    digits = {m: _digits(rep.groups[m], m) for m in rep.metrics}
    for rec in rep.groups.to_dict("records"):
        row = [str(rec[k]) if not pd.isna(rec[k]) else "-" for k in rep.keys] + [str(rec["n"])]
        for i, m in enumerate(rep.metrics):
            row.append(_num(rec[m], digits[m]))
            if i == 0:
                row.append(_num(rec[f"{m}_iqr"], _digits(rep.groups[f"{m}_iqr"], m)))
        if rep.baseline:
            row.append(_ratio_cell(rec))
        rows.append(row)
    notes = [f"median over repeats of each configuration; IQR of {label(rep.primary)} over repeats"]
    if rep.baseline:
        notes.append(f"ratio = median {label(rep.primary)} / the baseline's; {RULE}")
    for col, what in (("gpu_name", "GPUs"), ("hostname", "hosts")):
        seen = sorted({str(v) for v in rep.done.get(col, pd.Series(dtype=str)).dropna() if str(v)})
        if len(seen) > 1:
            notes.append(f"runs come from {len(seen)} {what} ({', '.join(seen)}): compare within one")
    if rep.excluded:
        notes.append("not included: " + ", ".join(f"{v} {k}" for k, v in sorted(rep.excluded.items())) + " run(s)")
    return head, rows, notes


def _ratio_cell(rec: dict) -> str:
    r = rec.get("ratio")
    if r is None or pd.isna(r):
        return "-"
    if rec.get("is_baseline"):
        return f"{r:.2f}× (baseline)"
    mark = {True: " ≈", False: "", None: " ?"}[rec.get("within")]
    return f"{r:.2f}×{mark}"


def to_markdown(rep: Report) -> str:
    head, rows, notes = cells(rep)
    n_keys = len(rep.keys)
    align = ["---"] * n_keys + ["---:"] * (len(head) - n_keys)
    lines = ["| " + " | ".join(r) + " |" for r in (head, align, *rows)]
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


def to_csv(rep: Report) -> str:
    out = rep.groups.rename(columns={k: label(k) for k in rep.keys})
    return out.to_csv(index=False, float_format="%.6g")


def to_rich(rep: Report, *, title: str = ""):
    from rich.table import Table

    head, rows, notes = cells(rep)
    table = Table(title=title or None, title_justify="left", caption="\n".join(notes), caption_justify="left")
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i < len(rep.keys) else "right", no_wrap=True)
    for r in rows:
        table.add_row(*r)
    return table
