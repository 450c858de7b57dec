"""The answer paragraph, generated from the study by explicit rules (never written by hand). Each
rule is a small function of the measured groups and returns one clause or sentence:

- ``verdict``: a group is 'slower' / 'faster' than its baseline where the interval of the
  ratio of step times clears 1 ± the threshold, 'no difference' where it lies inside that
  band, 'unclear' otherwise (lora_bench.report.stats.verdict); every ratio and median stated
  carries its interval in brackets;
- ``crossover``: the two adjacent sizes between which a variant turns from slower to faster (it
  must stay faster at every larger size);
- ``host_bound_phases``: the phases where the GPU waits for Python, measured: the kernel time a
  profiled repeat saw in the phase is under STARVED of the phase's device time in the timed repeats
  (study.Phase.cause), left out when the phase takes less than MIN_SHARE of the step; without a
  profiled repeat the cause is not stated;
- ``launches_and_work``: the change in kernels launched per step and in their summed device time
  (torch.profiler counts, where a profile exists), else in analytic FLOPs per step;
- ``phase_deltas``: the phases whose device time changes by at least MIN_CHANGE of the baseline's step;
- ``why_slower`` / ``why_faster``: these clauses for the primary variant at the smallest size where
  it is slower and the largest size where it is faster, in each mode;
- ``accuracy_sentence``: the differences in accuracy from the baseline whose interval leaves
  out 0 (outside the spread over seeds; judged from MIN_REPEATS repeats a side), or the largest
  one when none does;
- ``answer``: one bullet per mode and condition, explanations for the first condition, accuracy last."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lora_bench.report import stats
from lora_bench.report.labels import count_text
from lora_bench.report.order_stats import MIN_REPEATS
from lora_bench.report.stats import Estimate, span_text
from lora_bench.report.study_model import STARVED, Group, Line, Study
from lora_bench.timing import PHASES

MIN_SHARE = 0.05  # a phase under 5 % of the step is not worth naming as host-bound
MIN_CHANGE = 0.02  # nor a change of a phase under 2 % of the baseline's step


def ratio_text(g: Group) -> str:
    """'1.50× [1.47–1.53] (n = 5, 93.8 %)': the ratio and its interval."""
    return f"{g.ratio:.2f}× {span_text(g.ratio_estimate)}"


def verdict(g: Group) -> str:
    """The group's verdict against its baseline (stats.verdict); 'unknown' without a ratio."""
    if math.isnan(g.ratio):
        return "unknown"
    return g.verdict or stats.UNCLEAR


def ms_text(e: Estimate) -> str:
    """'77.0 ms [76.1–78.0] (n = 5, 93.8 %)': a median step time and its interval."""
    return f"{e.median:.1f} ms {span_text(e, digits=1)}"


def crossover(groups: list[Group]) -> str:
    """'between 774M and 1558M'; 'faster at every size'; 'slower at every size'; '' when unknown."""
    known = [g for g in groups if not math.isnan(g.ratio)]
    if not known:
        return ""
    faster = [verdict(g) == "faster" for g in known]
    first = next((i for i in range(len(known)) if all(faster[i:])), len(known))
    if first == 0:
        return "faster at every size" if len(known) > 1 else f"faster at {known[0].size}"
    if first == len(known):
        if not any(faster) and all(verdict(g) == "slower" for g in known):
            return "slower at every size" if len(known) > 1 else f"slower at {known[0].size}"
        return ""
    return f"between {known[first - 1].size} and {known[first].size}"


def crossover_sentence(line: Line, *, base: str) -> str:
    """'lora takes 1.54× [1.50–1.58] all's step time at 124M and 0.84× [0.83–0.85] at 1558M: the
    crossover lies between 774M and 1558M'."""
    gs = [g for g in line.groups if not math.isnan(g.ratio)]
    if not gs:
        return f"{line.variant}: no {base} runs to compare with"
    where = crossover(gs)
    if len(gs) == 1:
        head = f"{line.variant} takes {ratio_text(gs[0])} {base}'s step time at {gs[0].size}"
    else:
        head = (f"{line.variant} takes {ratio_text(gs[0])} {base}'s step time at {gs[0].size} "
                f"and {ratio_text(gs[-1])} at {gs[-1].size}")
    unknown = " (no interval: one run per group)" if not any(g.ratio_estimate.has_interval for g in gs) else ""
    if where.startswith("between"):
        return f"{head}: the crossover lies {where}{unknown}"
    if where and len(gs) > 1:
        return f"{head}: {where}{unknown}"
    mixed = ", ".join(f"{verdict(g)} at {g.size}" for g in gs)
    return (f"{head} ({mixed})" if len(gs) > 1 else head) + unknown


def host_bound_phases(g: Group) -> list[str]:
    return g.host_bound_phases(min_share=MIN_SHARE)


def pct(new: float, old: float) -> float:
    return 100 * (new / old - 1)


def launches_and_work(g: Group, b: Group) -> str:
    """'lora launches 37 % more kernels per step (2,479 vs 1,807) while its kernels run 20 % less
    device time (20.2 vs 25.2 ms)'; from analytic FLOPs when no profile covers both."""
    kg, kb = g.kernels(), b.kernels()
    if kg and kb and kb[0] and kb[1]:
        dl, dw = pct(kg[0], kb[0]), pct(kg[1], kb[1])
        return (f"{g.variant} launches {abs(dl):.0f} % {'more' if dl >= 0 else 'fewer'} kernels per step "
                f"({count_text(kg[0])} vs {count_text(kb[0])}, torch.profiler) while its kernels run "
                f"{abs(dw):.0f} % {'less' if dw < 0 else 'more'} device time ({kg[1]:.1f} vs {kb[1]:.1f} ms)")
    if not (math.isnan(g.flops_per_step) or math.isnan(b.flops_per_step)) and b.flops_per_step:
        dw = pct(g.flops_per_step, b.flops_per_step)
        return (f"{g.variant}'s step does {abs(dw):.0f} % {'fewer' if dw < 0 else 'more'} FLOPs "
                f"({g.flops_per_step / 1e12:.2f} vs {b.flops_per_step / 1e12:.2f} TFLOP, analytic; "
                "no profile of these groups counts their kernel launches)")
    return ""


def phase_deltas(g: Group, b: Group) -> str:
    """'saves 37.8 ms in backward and 25.1 ms in optimizer and spends 11.0 ms more in forward'."""
    saves, spends = [], []
    for ph in PHASES:
        dg, db = g.phases[ph].device, b.phases[ph].device
        if not (dg.known and db.known):
            continue
        d = dg.median - db.median
        if abs(d) >= MIN_CHANGE * b.step.median:
            (saves if d < 0 else spends).append((abs(d), ph))
    parts = []
    if saves:
        parts.append("saves " + _and([f"{d:.1f} ms in {ph}" for d, ph in sorted(saves, reverse=True)]))
    if spends:
        parts.append("spends " + _and([f"{d:.1f} ms more in {ph}" for d, ph in sorted(spends, reverse=True)]))
    return " and ".join(parts)


def step_change(g: Group, b: Group) -> str:
    d = pct(g.step.median, b.step.median)
    return f"its step is {abs(d):.0f} % {'longer' if d > 0 else 'shorter'} ({ms_text(g.step)} vs {ms_text(b.step)})"


def why_slower(g: Group, b: Group) -> str:
    where = f"At {g.size}"
    hb = [ph for ph in host_bound_phases(b) if ph in host_bound_phases(g)]
    if hb:
        busy = ", ".join(f"{ph} {100 * b.phases[ph].busy:.0f} / {100 * g.phases[ph].busy:.0f} %" for ph in hb)
        bound = (f"{_and(hb)} {'phase is' if len(hb) == 1 else 'phases are'} host-bound for both {b.variant} and "
                 f"{g.variant} (in a profiled repeat the GPU ran kernels for {busy} of the phase's device time: "
                 "it waits for Python to queue them)")
        work = launches_and_work(g, b)
        return f"{where} the {bound}{', and ' + work if work else ''}: {step_change(g, b)}."
    deltas = phase_deltas(g, b)
    measured = _measured(b) and _measured(g)
    if measured:
        shown = [p for x in (b, g) for p in x.phases.values() if p.busy is not None and p.device.known
                 and p.device.median >= MIN_SHARE * x.step.median]
        cause = "no phase of both is host-bound" + (
            f" (in a profiled repeat of each the GPU ran kernels for {_busy_range(shown)} of a phase's device time)"
            if shown else "")
    else:
        cause = "the cause is not measured (no profiled repeat)"
    return f"{where} {cause}; {g.variant} {deltas or 'changes no phase by much'}: {step_change(g, b)}."


def why_faster(g: Group, b: Group, *, smallest: Group | None) -> str:
    deltas = phase_deltas(g, b)
    out = f"At {g.size} {g.variant} {deltas or 'changes no phase by much'}: {step_change(g, b)}."
    opt = b.phases.get("optimizer")
    if opt is not None and opt.device.known and b.step.median:
        out += f" The optimizer alone takes {100 * opt.device.median / b.step.median:.0f} % of {b.variant}'s step"
        out += "." if smallest is None else ""
    if smallest is not None and b.mfu.known and smallest.mfu.known and b.size != smallest.size:
        out += (f"{';' if out.endswith('step') else ''} {b.variant} reaches MFU {b.mfu.median:.2f} "
                f"{span_text(b.mfu)} at {b.size} against {smallest.mfu.median:.2f} {span_text(smallest.mfu)} at "
                f"{smallest.size}: more of its step is arithmetic, which LoRA reduces.")
    elif out.endswith("step"):
        out += "."
    return out


def _measured(g: Group) -> bool:
    return any(p.busy is not None for p in g.phases.values())


def _busy_range(phases: list) -> str:
    """'33–48 %' (or '48 %'): the measured busy fractions of ``phases``."""
    lo, hi = (f"{100 * f(p.busy for p in phases):.0f}" for f in (min, max))
    return f"{lo} %" if lo == hi else f"{lo}–{hi} %"


def host_bound_summary(groups: list[Group]) -> str:
    """The measured cause at the smallest and the largest size with a profiled repeat: 'at 124M
    forward and backward are host-bound for every variant; at 1558M no phase is host-bound for
    every variant (backward for lora and lora-kernel)', with the GPU's busy fraction of the largest
    phase; sizes without one are named as not measured."""
    sizes = list(dict.fromkeys(g.size for g in groups))
    measured = [s for s in sizes if any(_measured(g) for g in groups if g.size == s)]
    unmeasured = [s for s in sizes if s not in measured]
    tail = (f" (the cause is not measured at {_and(unmeasured)}: no profiled repeat)" if unmeasured else "")
    if not measured:
        return "the cause of each phase's time is not measured (no profiled repeat of these settings)"
    if not any(host_bound_phases(g) for g in groups):
        return (f"no phase is host-bound at {_and(measured)} (in a profiled repeat the GPU ran kernels for at least "
                f"{100 * STARVED:.0f} % of every phase)" + tail)
    parts = []
    for size in dict.fromkeys([measured[0], measured[-1]]):
        at = [g for g in groups if g.size == size]
        common = [ph for ph in PHASES if all(ph in host_bound_phases(g) for g in at)]
        if common:
            parts.append(f"at {size} {_and(common)} {'is' if len(common) == 1 else 'are'} host-bound for every variant "
                         f"(GPU busy {_busy_range([g.phases[ph] for g in at for ph in common])})")
            continue
        some: dict[str, list[Group]] = {}
        for g in at:
            for ph in host_bound_phases(g):
                some.setdefault(ph, []).append(g)
        detail = ", ".join(f"{ph} for {_and([g.variant for g in gs])} at {_busy_range([g.phases[ph] for g in gs])} busy"
                           for ph, gs in some.items())
        parts.append(f"at {size} no phase is host-bound for every variant" + (f" ({detail})" if detail else ""))
    return "; ".join(parts) + f", measured as the GPU running kernels for under {100 * STARVED:.0f} % of the phase" + tail


def accuracy_sentence(study: Study) -> str:
    metric = study.accuracy_metric
    pairs = [(g, *study.accuracy_vs_base(g)) for g in study.groups if not g.is_baseline]
    pairs = [(g, d, w) for g, d, w in pairs if d.known]
    if not pairs:
        return ""
    name = "test accuracy" if metric == "test_acc" else "validation accuracy"
    n_seeds = max(len(g.seeds) for g in study.groups)
    over = f"median over {n_seeds} seeds" if study.seeds_vary else "repeats share one seed, so the spread is run-to-run only"
    outside = [(g, d) for g, d, w in pairs if w is True]
    unknown = sum(1 for _, _, w in pairs if w is None)

    def where(g: Group) -> str:
        return " · ".join(p for p in (g.size, g.mode, g.condition) if p)

    def points(d: Estimate) -> str:
        return f"{d.value:+.2f} points {span_text(d)}"

    if outside:
        listed = "; ".join(f"{g.variant} {points(d)} at {where(g)}" for g, d in
                           sorted(outside, key=lambda t: -abs(t[1].value))[:3])
        rest = len(pairs) - len(outside) - unknown
        text = (f"{_cap(name)} ({over}): outside the spread over seeds: {listed}"
                f"{f'; {rest} other difference(s) within it' if rest else ''}")
    else:
        g, d, _ = max(pairs, key=lambda t: abs(t[1].value))
        text = (f"{_cap(name)} ({over}): every difference from the baseline is within the spread over seeds"
                if unknown < len(pairs) else f"{_cap(name)} ({over}): too few repeats to judge (a verdict needs "
                f"{MIN_REPEATS} a side)")
        text += f" (largest: {g.variant} {points(d)} at {where(g)})"
    return text + (f"; {unknown} group(s) with too few repeats to judge" if unknown and outside else "") + "."


@dataclass
class Point:
    """One bullet of the answer: a bold heading (mode and condition) and its sentences."""
    heading: str
    sentences: list[str]


def answer(study: Study) -> list[Point]:
    """The answer as points: each mode of the first condition (e.g. batch 8) explained, the other
    conditions summarised, accuracy last."""
    if not study.lines:
        return []
    base = study.baseline_name
    out = []
    conditions = study.conditions()
    for ci, cond in enumerate(conditions):
        for mode in study.modes():
            lines = [ln for ln in study.lines if ln.condition == cond and ln.mode == mode
                     and any(not math.isnan(g.ratio) for g in ln.groups)]
            if not lines:  # no step times (timing off) or no baseline here: nothing to say
                continue
            tokens = next((g.tokens_per_step for ln in lines for g in ln.groups if not math.isnan(g.tokens_per_step)), math.nan)
            where = " · ".join(p for p in (mode, cond, f"{tokens:,.0f} tokens per step" if not math.isnan(tokens) else "") if p)
            sentences = [crossover_sentence(ln, base=base) + "." for ln in lines]
            groups = [g for g in study.groups if g.condition == cond and g.mode == mode]
            if ci == 0:
                sentences.append(_cap(host_bound_summary(groups)) + ".")
                sentences += _explain(study, lines[0])
            else:
                shift = _shift(study, lines, first=conditions[0])
                if shift:
                    sentences.append(shift)
            out.append(Point(heading=where, sentences=sentences))
    acc = accuracy_sentence(study)
    if acc:
        out.append(Point(heading="Accuracy", sentences=[acc]))
    return out


def _explain(study: Study, line: Line) -> list[str]:
    """Why the primary variant is slower at the smallest size and faster at the largest."""
    gs = [g for g in line.groups if not math.isnan(g.ratio)]
    parts = []
    slow = next((g for g in gs if verdict(g) == "slower"), None)
    fast = next((g for g in reversed(gs) if verdict(g) == "faster"), None)
    if slow is not None and (b := study.base_of(slow)) is not None:
        parts.append(why_slower(slow, b))
    if fast is not None and (b := study.base_of(fast)) is not None:
        smallest = study.base_of(gs[0]) if gs else None
        parts.append(why_faster(fast, b, smallest=smallest))
    return parts


def _shift(study: Study, lines: list[Line], *, first: str) -> str:
    """How the crossovers compare with the first condition's (e.g. more tokens per step move them)."""
    parts = []
    for ln in lines:
        other = next((o for o in study.lines if o.condition == first and o.mode == ln.mode and o.variant == ln.variant), None)
        if other is None or not crossover(ln.groups):
            continue
        was, now = crossover(other.groups), crossover(ln.groups)
        if was and was != now:
            parts.append(f"{ln.variant} {was}")
    return f"At {first} the crossovers were: {'; '.join(parts)}." if parts else ""


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _and(items: list[str]) -> str:
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]
