"""A comparison (lora_bench.report.compare) as a report document (for the terminal and Markdown
renderers), as CSV (one row per setting, those on one side only included) and as JSON."""

from __future__ import annotations

import pandas as pd

from lora_bench.report import stats
from lora_bench.report.compare import SIDES, Comparison, gate_text
from lora_bench.report.document import Document, Section
from lora_bench.report.group_table import csv_text
from lora_bench.report.names import column_label
from lora_bench.report.render_json import dumps, statistic
from lora_bench.report.stats import span_text
from lora_bench.report.tables import CI, Table, est, interval_notes

FORMATS = ("table", "markdown", "csv", "json")


def _digits(c: Comparison) -> int:
    top = max([abs(e.value) for r in c.rows for e in (r.baseline, r.candidate) if e.known] or [0.0])
    return 1 if top >= 100 else 2 if top >= 1 else 3


def comparison_table(c: Comparison) -> Table:
    label, d = column_label(c.metric), _digits(c)
    head = [*c.keys, "n", f"baseline {label} {CI}", f"candidate {label} {CI}", f"candidate ÷ baseline {CI}",
            "verdict"]
    if c.fail_above is not None:
        head.append(f"gate {stats.threshold_text(c.fail_above)}")
    rows = []
    for r in c.rows:
        row = [*(r.settings[k] for k in c.keys), f"{r.baseline.n} / {r.candidate.n}", est(r.baseline, d),
               est(r.candidate, d), f"{r.ratio.value:.3f}× {span_text(r.ratio, digits=3)}" if r.ratio.known else "-",
               r.verdict]
        if c.fail_above is not None:
            row.append("fail" if r.fails else "pass")
        rows.append(row)
    notes = [f"{label}: median over repeats (n: baseline / candidate runs) with its 95 % interval; ratio: the "
             "candidate's median ÷ the baseline's, its interval from each side's repeats resampled on their own; "
             "runs matched by their settings (paths left out, and the seed where it varies across repeats)",
             stats.rule_text(c.threshold),
             *interval_notes(*(e for r in c.rows for e in (r.baseline, r.candidate, r.ratio)))]
    if c.environment:
        notes.append("environment differs, so the comparison mixes machines or software: " + "; ".join(c.environment))
    for side in SIDES:
        if c.only[side]:
            listed = "; ".join(" · ".join(f"{k}={v}" for k, v in s.items()) for s in c.only[side])
            notes.append(f"only in the {side} ({len(c.only[side])}): {listed}")
    notes += c.notes
    if c.fail_above is not None:
        notes.append(gate_text(c))
    title = f"{c.candidate_dir} against {c.baseline_dir}: {label}"
    return Table(title=title, head=head, rows=rows, notes=notes, n_keys=len(c.keys))


def comparison_document(c: Comparison) -> Document:
    return Document(title="", question="", setting="", sections=[Section("", tables=[comparison_table(c)],
                                                                         first_screen=True)])


def comparison_csv(c: Comparison) -> str:
    """One row per setting: its settings, each side's n, median and interval, the ratio with its
    interval and what it resamples, the verdict and the gate; settings on one side only included
    (verdict 'only in baseline' / 'only in candidate')."""
    records = []
    for r in c.rows:
        rec = dict(r.settings)
        for side, e in zip(SIDES, (r.baseline, r.candidate)):
            rec.update({f"{side}_n": e.n, f"{side}_median": e.value, f"{side}_lo": e.lo, f"{side}_hi": e.hi})
        rec.update(ratio=r.ratio.value, ratio_lo=r.ratio.lo, ratio_hi=r.ratio.hi, interval_over=r.ratio.over,
                   verdict=r.verdict, **({"gate": "fail" if r.fails else "pass"} if c.fail_above is not None else {}))
        records.append(rec)
    for side in SIDES:
        records += [dict(s, verdict=f"only in {side}") for s in c.only[side]]
    cols = [*c.keys, *(f"{s}_{x}" for s in SIDES for x in ("n", "median", "lo", "hi")), "ratio", "ratio_lo",
            "ratio_hi", "interval_over", "verdict", *(["gate"] if c.fail_above is not None else [])]
    return csv_text(pd.DataFrame(records, columns=cols))


def comparison_json(c: Comparison) -> str:
    doc = {"statistic": statistic(c.threshold), "baseline": c.baseline_dir, "candidate": c.candidate_dir,
           "metric": c.metric, "fail_above": c.fail_above, "keys": c.keys,
           "settings": [{"settings": r.settings, "baseline": r.baseline.as_dict(), "candidate": r.candidate.as_dict(),
                         "ratio": r.ratio.as_dict(), "verdict": r.verdict,
                         **({"fails": r.fails} if c.fail_above is not None else {})} for r in c.rows],
           "only_baseline": c.only["baseline"], "only_candidate": c.only["candidate"],
           "environment_differences": c.environment, "notes": c.notes,
           "gate": None if c.fail_above is None else {"passed": not c.failed, "text": gate_text(c)}}
    return dumps(doc)
