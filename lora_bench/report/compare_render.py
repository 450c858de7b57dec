"""A comparison (lora_bench.report.comparison) as a report document (for the terminal, Markdown and HTML
renderers), as CSV (one row per setting, those on one side only included) and as JSON. Each takes
the rows to show (Comparison.shown: all or only the changed ones, in an order)."""

from __future__ import annotations

import pandas as pd

from lora_bench.report import stats
from lora_bench.report.comparison import SIDES, Comparison, Row, gate_text
from lora_bench.report.document import Document, Section
from lora_bench.report.group_table import csv_text
from lora_bench.report.labels import column_label
from lora_bench.report.render_json import dumps, statistic
from lora_bench.report.stats import span_text
from lora_bench.report.tables import CI, Table, est, interval_notes

FORMATS = ("table", "markdown", "html", "csv", "json")


def _digits(c: Comparison) -> int:
    top = max([abs(e.value) for r in c.rows for e in (r.baseline, r.candidate) if e.known] or [0.0])
    return 1 if top >= 100 else 2 if top >= 1 else 3


def comparison_table(c: Comparison, rows: list[Row] | None = None) -> Table:
    label, d = column_label(c.metric), _digits(c)
    shown = c.rows if rows is None else rows
    head = [*c.keys, "n", f"baseline {label} {CI}", f"candidate {label} {CI}", f"candidate ÷ baseline {CI}",
            "verdict"]
    if c.fail_above is not None:
        head.append(f"gate {stats.threshold_text(c.fail_above)}")
    cells = []
    for r in shown:
        row = [*(r.settings[k] for k in c.keys), f"{r.baseline.n} / {r.candidate.n}", est(r.baseline, d),
               est(r.candidate, d), f"{r.ratio.value:.3f}× {span_text(r.ratio, digits=3)}" if r.ratio.known else "-",
               r.verdict]
        if c.fail_above is not None:
            row.append(_gate_cell(r))
        cells.append(row)
    notes = [f"{label}: median over repeats (n: baseline / candidate runs) with its {stats.STATISTIC}; ratio "
             f"candidate ÷ baseline with its interval ({stats.RESAMPLING}); runs matched by their settings (paths "
             "left out, and the seed where it varies across repeats)",
             stats.rule_text(c.threshold),
             *interval_notes(*(e for r in c.rows for e in (r.baseline, r.candidate, r.ratio)))]
    if c.environment:
        notes.append("environment differs, so the comparison mixes machines or software: " + "; ".join(c.environment))
    for side in SIDES:
        if c.only[side]:
            listed = "; ".join(" · ".join(f"{k}={v}" for k, v in s.items()) for s in c.only[side])
            notes.append(f"only in the {side} ({len(c.only[side])}): {listed}")
    notes += c.notes
    if len(shown) < len(c.rows):
        notes.append(f"{len(shown)} of {len(c.rows)} setting(s) shown (--only-changed: those with a verdict of a "
                     "difference)")
    notes += [f"incomplete: {p}" for p in c.problems if c.fail_above is None]
    if c.fail_above is not None:
        notes.append(gate_text(c))
    title = f"{c.candidate_dir} against {c.baseline_dir}: {label}"
    return Table(title=title, head=head, rows=cells, notes=notes, n_keys=len(c.keys))


def _gate_cell(r: Row) -> str:
    return "fail" if r.fails else "not judged" if r.verdict == stats.TOO_FEW else "pass"


def comparison_document(c: Comparison, rows: list[Row] | None = None) -> Document:
    return Document(title="", question="", setting="", sections=[Section("", tables=[comparison_table(c, rows)],
                                                                         first_screen=True)])


def comparison_csv(c: Comparison, rows: list[Row] | None = None) -> str:
    """One row per setting: its settings, each side's n, median and interval, the ratio with its
    interval and what it resamples, the verdict and the gate; settings on one side only included
    (verdict 'only in baseline' / 'only in candidate')."""
    records = []
    for r in c.rows if rows is None else rows:
        rec = dict(r.settings)
        for side, e in zip(SIDES, (r.baseline, r.candidate)):
            rec.update({f"{side}_n": e.n, f"{side}_median": e.value, f"{side}_lo": e.lo, f"{side}_hi": e.hi,
                        f"{side}_confidence": e.confidence})
        rec.update(ratio=r.ratio.value, ratio_lo=r.ratio.lo, ratio_hi=r.ratio.hi, ratio_n=r.ratio.n,
                   ratio_confidence=r.ratio.confidence, ratio_paired=r.ratio.paired, interval_over=r.ratio.over,
                   verdict=r.verdict, **({"gate": _gate_cell(r)} if c.fail_above is not None else {}))
        records.append(rec)
    for side in SIDES:
        records += [dict(s, verdict=f"only in {side}") for s in c.only[side]]
    cols = [*c.keys, *(f"{s}_{x}" for s in SIDES for x in ("n", "median", "lo", "hi", "confidence")), "ratio",
            "ratio_lo", "ratio_hi", "ratio_n", "ratio_confidence", "ratio_paired", "interval_over", "verdict",
            *(["gate"] if c.fail_above is not None else [])]
    return csv_text(pd.DataFrame(records, columns=cols))


def comparison_json(c: Comparison, rows: list[Row] | None = None) -> str:
    doc = {"statistic": statistic(c.threshold, c.metric), "baseline": c.baseline_dir, "candidate": c.candidate_dir,
           "metric": c.metric, "fail_above": c.fail_above, "keys": c.keys, "ignored": c.ignored,
           "settings": [{"settings": r.settings, "baseline": r.baseline.as_dict(), "candidate": r.candidate.as_dict(),
                         "ratio": r.ratio.as_dict(), "verdict": r.verdict,
                         **({"fails": r.fails} if c.fail_above is not None else {})}
                        for r in (c.rows if rows is None else rows)],
           "complete": not c.problems, "problems": c.problems,
           "only_baseline": c.only["baseline"], "only_candidate": c.only["candidate"],
           "environment_differences": c.environment, "notes": c.notes,
           "gate": None if c.fail_above is None else {"passed": not c.failed and not c.problems,
                                                      "text": gate_text(c)}}
    return dumps(doc)
