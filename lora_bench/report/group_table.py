"""The table of every group of a report (one row per configuration: each metric's median with its
interval and n, the ratio to the baseline with its verdict) as plain text cells, and the one CSV
writer of reports and comparisons (formulas defused, floats to 6 significant digits)."""

from __future__ import annotations

import pandas as pd

from lora_bench.escaping import report_csv_cell as stored_cell
from lora_bench.report.aggregate import ESTIMATE_SUFFIXES, Report, estimate_of, rule
from lora_bench.report.labels import column_label, is_blank
from lora_bench.report.stats import RESAMPLING, STATISTIC, span_text
from lora_bench.report.tables import CI, Table, est, interval_notes
from lora_bench.results.schema import column_index


def _digits(values: pd.Series, col: str) -> int:
    """One precision per column (by its largest value) so the column's decimals line up."""
    if getattr(column_index().get(col), "unit", "") == "%":
        return 2
    top = pd.to_numeric(values, errors="coerce").abs().max()
    return 1 if top >= 100 else 2 if top >= 1 else 3


def _cell(v, digits: int) -> str:
    if isinstance(v, str):
        return v or "-"
    return "-" if v is None or pd.isna(v) else f"{float(v):.{digits}f}"


def runs_cell(rec: dict) -> str:
    """A group's run count, with the packs they trained in where they did."""
    packs = int(rec.get("packs") or 0)
    return str(rec["n"]) + (f" ({packs} pack{'s' if packs != 1 else ''})" if packs else "")


def groups_table(rep: Report, *, title: str = "") -> Table:
    """Every group with the median of each metric and its interval, the ratio to the baseline."""
    head = [column_label(k) for k in rep.keys] + ["n"]
    head += [f"{column_label(m)} {CI}" if m not in rep.text_metrics else column_label(m) for m in rep.metrics]
    if rep.baseline:
        head.append("vs " + ",".join(f"{column_label(k)}={v}" for k, v in rep.baseline.items()) + f" {CI}")
    rows, shown = [], []
    digits = {m: _digits(rep.groups[m], m) for m in rep.metrics}
    for rec in rep.groups.to_dict("records"):
        row = [str(rec[k]) if not is_blank(rec[k]) else "-" for k in rep.keys] + [runs_cell(rec)]
        for m in rep.metrics:
            if m in rep.text_metrics:
                row.append(_cell(rec[m], digits[m]))
                continue
            e = estimate_of(rec, m)
            shown.append(e)
            row.append(est(e, digits[m]))
        if rep.baseline:
            row.append(_groups_ratio(rec))
            shown.append(estimate_of(rec, "ratio"))
        rows.append(row)
    notes = [f"median over repeats of each configuration (each run's own value: for times its median over its "
             f"measured steps), with its {STATISTIC}"]
    if rep.baseline and "ratio" in rep.groups:
        notes.append(f"ratio to the baseline's {column_label(rep.primary)}, its interval ({RESAMPLING}) and "
                     f"verdict; {rule(rep.threshold, rep.primary)}")
    notes += interval_notes(*shown)
    for col, what in (("gpu_name", "GPUs"), ("hostname", "hosts")):
        seen = sorted({str(v) for v in rep.done.get(col, pd.Series(dtype=str)).dropna() if str(v)})
        if len(seen) > 1:
            notes.append(f"runs come from {len(seen)} {what} ({', '.join(seen)}): compare within one")
    if rep.excluded:
        notes.append("not included: " + ", ".join(f"{v} {k}" for k, v in sorted(rep.excluded.items())) + " run(s)")
    notes += rep.notes
    return Table(title=title, head=head, rows=rows, notes=notes, n_keys=len(rep.keys))


def _groups_ratio(rec: dict) -> str:
    r = rec.get("ratio")
    if r is None or pd.isna(r):
        return "-"
    if rec.get("is_baseline"):
        return f"{r:.2f}× (baseline)"
    word = f" {rec['verdict']}" if rec.get("verdict") else ""
    return f"{r:.2f}× {span_text(estimate_of(rec, 'ratio'))}{word}"


def to_csv(rep: Report) -> str:
    """The groups as CSV: keys, n, per metric its median, interval (lo, hi), the n it stands on, the
    confidence the interval reaches and what it is over, the p10/p90 and tokens/s beside them, the
    ratio with the same and whether it is paired (unpaired: the confidence is a lower bound), the verdict."""
    cols = [*rep.keys, "n"]
    for m in [*rep.metrics, *rep.extras, "ratio"]:
        cols += [c for c in (m, *(m + x for x in ESTIMATE_SUFFIXES)) if c in rep.groups]
    cols += [c for c in ("ratio_paired", "verdict", "is_baseline") if c in rep.groups]
    return csv_text(rep.groups[cols].rename(columns={k: column_label(k) for k in rep.keys}))


def csv_cell(v):
    """A text cell of a CSV report (``escaping.report_csv_cell``: no formula runs, no control
    character is sent), a lone '-' (a blank cell of the tables) left as it is."""
    return v if v in ("-", "+") else stored_cell(v)


def csv_text(df: pd.DataFrame) -> str:
    """The one CSV writer of reports and comparisons: formulas defused, floats to 6 significant digits."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object or pd.api.types.is_string_dtype(out[col]):
            out[col] = out[col].map(csv_cell)
    out.columns = [csv_cell(c) for c in out.columns]
    return out.to_csv(index=False, float_format="%.6g")
