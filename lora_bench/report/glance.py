"""The answer at a glance: at most three lines, first on a report, one per execution mode and
condition (as the answer's bullets), each naming each variant's crossover against the baseline
(``answer.crossover``, else its verdict at each size) with its ratio at the smallest and the
largest size and that ratio's interval; a line of many variants names the VARIANTS that differ
most from the baseline (in the line's order) and counts the rest. Where no step time is compared
(timing off, or runs that shared their GPU), the accuracy's sentence. The full answer, with n and
confidence, follows below."""

from __future__ import annotations

import math

from lora_bench.report.answer import accuracy_sentence, crossover, verdict
from lora_bench.report.stats import span_text
from lora_bench.report.study_model import Group, Study

LINES = 3  # a glance, not a list: the rest is in the answer below
VARIANTS = 5  # named on one line; the rest counted


def glance(study: Study) -> list[str]:
    """Up to LINES lines (Markdown-style **bold** heading); [] where nothing is compared."""
    base = study.baseline_name
    out = []
    for cond in study.conditions():
        for mode in study.modes():
            lines = [ln for ln in study.lines if ln.condition == cond and ln.mode == mode]
            shown = [(ln.variant, gs) for ln in lines if (gs := [g for g in ln.groups if not math.isnan(g.ratio)])]
            if not shown:
                continue
            rest = len(shown) - VARIANTS
            if rest > 0:  # the VARIANTS farthest from the baseline, in the line's order
                far = sorted(range(len(shown)), key=lambda i: -_distance(shown[i][1]))[:VARIANTS]
                shown = [shown[i] for i in sorted(far)]
            where = " · ".join(p for p in (mode, cond) if p)
            more = f"; {rest} more in the answer below" if rest > 0 else ""
            lead = f"**{where}**, step time" if where else "Step time"  # a baseline naming the mode: no head
            out.append(f"{lead} against {base}: "
                       + "; ".join(_variant(name, gs) for name, gs in shown) + more + ".")
    if not out and (acc := accuracy_sentence(study)):  # no step times to compare (timing off, or shared)
        out.append(f"**Accuracy**: {acc}")
    if len(out) > LINES:
        shown = out[:LINES - 1]
        return shown + [f"… and {len(out) - len(shown)} more settings: see the answer below."]
    return out


def _distance(groups: list[Group]) -> float:
    """How far a variant's step lies from the baseline's: the largest |log ratio| at its sizes."""
    return max(abs(math.log(g.ratio)) for g in groups)


def _variant(name: str, groups: list[Group]) -> str:
    """'lora crosses over between 774M and 1558M (1.42× [1.36–1.51] at 124M, 0.83× [0.74–0.86] at 1558M)'."""
    if not groups:
        return ""
    where = crossover(groups)
    if where.startswith("between"):
        said = f"{name} crosses over {where}"
    elif where:
        said = f"{name} {where}"
    else:
        said = f"{name} " + _verdicts(_ends(groups))
    return said + " (" + ", ".join(f"{g.ratio:.2f}× {span_text(g.ratio_estimate, told=False)} at {g.size}"
                                   for g in _ends(groups)) + ")"


def _verdicts(groups: list[Group]) -> str:
    """'too few repeats at 124M and 1558M'; 'slower at 124M, unclear at 1558M'."""
    said = [verdict(g) for g in groups]
    if len(set(said)) == 1:
        return f"{said[0]} at " + " and ".join(g.size for g in groups)
    return ", ".join(f"{v} at {g.size}" for v, g in zip(said, groups))


def _ends(groups: list[Group]) -> list[Group]:
    return [groups[0], groups[-1]] if len(groups) > 1 else groups[:1]
