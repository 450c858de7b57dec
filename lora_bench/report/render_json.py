"""A report as JSON, for programs: the statistic used, every group with the median of each metric
and its interval (n, the confidence it reaches), the ratio to the baseline with its interval and verdict, and the notes.
NaN becomes null, so the text is strict JSON."""

from __future__ import annotations

import json
import math

from lora_bench.escaping import json_text
from lora_bench.report import stats
from lora_bench.report.order_stats import MIN_REPEATS
from lora_bench.report.aggregate import Report, estimate_of, rule
from lora_bench.report.labels import column_label, value_text


def statistic(threshold: float, metric: str = "step_ms_median") -> dict:
    """What every number of a report or comparison is, for the reader of its JSON (the verdict rule
    in the words of ``metric``'s verdicts)."""
    return {"center": "median over repeats (each run's value: for times its median over its measured steps)",
            "interval": f"median with its {stats.STATISTIC} (each estimate's confidence; confidence_at_least: a lower bound); "
                        f"{stats.RESAMPLING}; over the steps of the one run where a group has one run "
                        "(interval_over = steps)",
            "target_confidence": stats.CONFIDENCE, "min_repeats": MIN_REPEATS,
            "threshold": threshold, "verdict_rule": rule(threshold, metric), "steps_note": stats.STEPS_NOTE}


def groups_json(rep: Report) -> list[dict]:
    out = []
    for rec in rep.groups.to_dict("records"):
        g = {"settings": {column_label(k): value_text(rec[k]) for k in rep.keys}, "n": int(rec["n"]), "metrics": {}}
        for m in [*rep.metrics, *rep.extras]:
            if m in rep.text_metrics:
                g["metrics"][m] = {"value": rec[m] if isinstance(rec[m], str) else None}
            else:
                g["metrics"][m] = estimate_of(rec, m).as_dict()
        if rep.baseline:
            ratio = estimate_of(rec, "ratio")
            g["ratio"] = ratio.as_dict() if ratio.known else None
            g["verdict"] = rec.get("verdict") or None
            g["is_baseline"] = bool(rec.get("is_baseline"))
        out.append(g)
    return out


def report_json(rep: Report, *, notes: list[str]) -> str:
    doc = {"statistic": statistic(rep.threshold, rep.primary), "metric": rep.primary, "metrics": rep.metrics,
           "extras": rep.extras, "keys": [column_label(k) for k in rep.keys],
           "baseline": {column_label(k): v for k, v in rep.baseline.items()},
           "groups": groups_json(rep), "excluded": rep.excluded, "notes": [*rep.notes, *notes]}
    return dumps(doc)


def dumps(doc: dict) -> str:
    """Strict JSON (no NaN), indented, with a final newline; control and bidirectional characters
    written as escapes (``escaping.json_text``)."""
    return json_text(json.dumps(_clean(doc), indent=1, ensure_ascii=False, allow_nan=False)) + "\n"


def _clean(v):
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalars
        return _clean(v.item())
    return v
