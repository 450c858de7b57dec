"""Every table of a study report as plain text cells (one model for the terminal, Markdown and HTML
renderers): the header facts, the crossover, where the time goes, kernel profiles and accuracy
over seeds (the table of all groups: lora_bench.report.group_table). Every median and every ratio carries its interval in
brackets with n and the confidence it reaches (lora_bench.report.stats), marked † where it is
over the steps of one run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from lora_bench.report.aggregate import rule
from lora_bench.report.labels import LAYER_HELP, column_label, count_text, is_blank
from lora_bench.report.order_stats import MIN_REPEATS
from lora_bench.report.per_layer import NOTE as PER_LAYER_NOTE, UNIT as PER_LAYER
from lora_bench.report.per_layer import against_floor, is_lora, per_layer_text
from lora_bench.report.stats import RESAMPLING, STATISTIC, STEPS_MARK, STEPS_NOTE, TOO_FEW, Estimate, span_text
from lora_bench.report.study_header import LAYERS
from lora_bench.report.study_model import GPU_BOUND, STARVED, Group, Study
from lora_bench.timing import PHASES

SHORT = {"data": "data", "forward": "fwd", "backward": "bwd", "optimizer": "opt"}
CI = "[interval]"
STEP_STATISTIC = "median over repeats of each run's median step"
STEPS_FOOTNOTE = f"{STEPS_MARK}: {STEPS_NOTE}"


@dataclass
class Table:
    title: str
    head: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)
    n_keys: int = 1  # leading text columns (left-aligned); the rest are numbers
    groups: list[int] = field(default_factory=list)  # row indices that start a new block


def num(v, digits: int = 1) -> str:
    return "-" if v is None or is_blank(v) or (isinstance(v, float) and math.isnan(v)) else f"{float(v):,.{digits}f}"


def est(e: Estimate, digits: int = 1, *, lines: bool = False) -> str:
    """A median and its interval: '33.4 [33.0–33.9] (n = 5, 93.8 %)', on two lines where the renderer allows one."""
    if not e.known:
        return "-"
    return f"{e.value:,.{digits}f}{chr(10) if lines else ' '}{span_text(e, digits=digits)}"


NO_INTERVAL_NOTE = "(no interval): a group of one run with no steps.csv (or no per-step values) to take one from"


def interval_notes(*estimates: Estimate) -> list[str]:
    """The footnotes for † (an interval over the steps of one run) and for a value without an
    interval, where any of ``estimates`` is one."""
    out = [STEPS_FOOTNOTE] if any(e.per_step for e in estimates) else []
    return out + ([NO_INTERVAL_NOTE] if any(e.known and not e.has_interval for e in estimates) else [])


# -- header --------------------------------------------------------------------------------------
def header_facts(study: Study) -> list[tuple[str, str]]:
    """(label, text) pairs under the title: device, software, commits, dates, runs, what varies and
    what is held fixed."""
    h = study.header
    facts = [("device", study.device + (f" ({h.hosts} hosts)" if h.hosts > 1 else ""))]
    facts.append(("software", ", ".join(f"{k} {v}" for k, v in h.versions.items())))
    known = any(c != "unknown" for c, _ in h.commits)
    facts.append(("commits", ", ".join(f"{c} ({n} runs)" for c, n in h.commits) if known else "not recorded"))
    if h.first:
        facts.append(("runs started", h.first[:16].replace("T", " ") + " – " + h.last[:16].replace("T", " ") + " UTC"))
    runs = f"{h.n_runs} finished"
    if h.excluded:
        runs += ", not included: " + ", ".join(f"{v} {k}" for k, v in sorted(h.excluded.items()))
    reps = sorted({g.n for g in study.groups})
    runs += f"; {len(study.groups)} groups of {reps[0]}" + (f"–{reps[-1]}" if len(reps) > 1 else "") + " repeat(s)"
    facts.append(("runs", runs))
    facts.append(("varies", ", ".join(h.varying) or "nothing"))
    facts.append(("held fixed", ", ".join(f"{k}={v}" for k, v in h.fixed.items())))
    return facts


def legend(study: Study) -> str:
    used = list(dict.fromkeys(g.variant for g in study.groups))
    return "; ".join(f"{v}: {LAYER_HELP[v]}" for v in used if v in LAYER_HELP)


# -- the crossover -------------------------------------------------------------------------------
def ratio_cell(g: Group | None) -> str:
    """'1.50× slower' over '[1.47–1.53]' (a second line where the renderer allows one)."""
    if g is None or math.isnan(g.ratio):
        return "-"
    word = f" {g.verdict}" if g.verdict else ""
    return f"{g.ratio:.2f}×{word}\n{span_text(g.ratio_estimate)}"


def _per_layer_cell(g: Group | None, floor: Group | None) -> str:
    """The adapters' µs per adapted layer above the floor (lora_bench.report.per_layer), '-' without the group."""
    if g is None:
        return "-"
    return per_layer_text(g.runs, floor.runs if floor is not None else None, lines=True)


def _shown(groups: list[Group]) -> list[Estimate]:
    """The step medians and the ratios a table of these groups shows."""
    return [*(g.step for g in groups), *(g.ratio_estimate for g in groups if not g.is_baseline)]


def crossover_table(study: Study) -> Table:
    """Per mode and condition: the baseline's median step ms by size, then each variant's ratio."""
    with_cond = any(study.conditions())
    floor = against_floor(study.baseline)
    head = ["execution mode", *(["condition"] if with_cond else []), "variant", *study.sizes]
    rows, starts = [], []
    for cond in study.conditions():
        for mode in study.modes():
            base = {g.size: g for g in study.groups if g.is_baseline and g.condition == cond and g.mode == mode}
            lines = [ln for ln in study.lines if ln.condition == cond and ln.mode == mode]
            if not lines or not any(g.step.known for g in [*base.values(), *(g for ln in lines for g in ln.groups)]):
                continue
            starts.append(len(rows))
            rows.append([mode or "-", *([cond or "-"] if with_cond else []), f"{study.baseline_name}: step ms {CI}"] +
                        [est(base[s].step, lines=True) if s in base else "-" for s in study.sizes])
            for ln in lines:
                by = {g.size: g for g in ln.groups}
                rows.append(["", *([""] if with_cond else []), f"{ln.variant} / {study.baseline_name}"] +
                            [ratio_cell(by.get(s)) for s in study.sizes])
                if floor and any(is_lora(g.runs) for g in ln.groups):
                    rows.append(["", *([""] if with_cond else []), f"{ln.variant}: {PER_LAYER} {CI}"] +
                                [_per_layer_cell(by.get(s), base.get(s)) for s in study.sizes])
    notes = [(f"step ms: {STEP_STATISTIC}; ratio to the baseline's ({study.baseline_text}) at the "
              "same size, mode and condition, then its verdict; [lo–hi] (n, confidence): its interval, the repeats "
              f"it stands on and the confidence it reaches ({RESAMPLING})"),
             rule(study.threshold), *interval_notes(*_shown(study.groups))]
    if floor:
        notes.append(PER_LAYER_NOTE)
    if legend(study):
        notes.append(legend(study))
    return Table(title=f"LoRA crossover: step time relative to {study.baseline_text} ({study.device})", head=head,
                 rows=rows, notes=notes, n_keys=3 if with_cond else 2, groups=starts)


LORA_LAYERS = ("lora", "lora-merged", "lora-kernel")


def fastest_lora_table(study: Study) -> Table | None:
    """Per size, the LoRA group (lora, lora-merged or lora-kernel, any mode and condition) with the
    lowest median step time, and what it is; None when the study measured no LoRA step."""
    best: dict[str, Group] = {}
    for g in study.groups:
        layers = {str(v) for v in g.runs.get("cfg_trainable_layers", pd.Series(dtype=object)).dropna()}
        if not g.step.known or not layers or not layers <= set(LORA_LAYERS):
            continue
        if g.size not in best or g.step.median < best[g.size].step.median:
            best[g.size] = g
    if not best:
        return None
    with_cond = any(g.condition for g in best.values())
    # the groups' variant is their trainable layers only where the study compares those alone
    with_variant = study.variant_keys != [LAYERS]
    head = ["size", "trainable layers", *(["variant"] if with_variant else []), "execution mode",
            *(["condition"] if with_cond else []), f"step ms {CI}"]
    rows = [[s, *([", ".join(sorted({str(v) for v in best[s].runs[LAYERS].dropna()})), best[s].variant]
                  if with_variant else [best[s].variant]), best[s].mode or "-",
             *([best[s].condition or "-"] if with_cond else []), est(best[s].step, digits=2)]
            for s in study.sizes if s in best]
    notes = [f"the LoRA group with the lowest median step at each size, among those measured here; step ms: "
             f"{STEP_STATISTIC}; [lo–hi] (n, confidence): its {STATISTIC}", *interval_notes(*(g.step for g in best.values()))]
    if with_variant:
        notes.append(f"variant: the group's value of what the report compares ({study.baseline_text} is the baseline)")
    return Table(title=f"Fastest measured LoRA step per size ({study.device})", head=head, rows=rows, notes=notes,
                 n_keys=len(head) - 1)


# -- where the time goes -------------------------------------------------------------------------
def why_tables(study: Study, *, min_share: float) -> list[Table]:
    """One table per mode and condition: per size and variant, device / host ms per phase, the
    host-bound phases, kernels per step where profiled, the optimizer's share, tokens/s and MFU."""
    out = []
    for cond in study.conditions():
        for mode in study.modes():
            gs = [g for g in study.groups if g.condition == cond and g.mode == mode]
            if any(g.step.known for g in gs):
                out.append(_why(gs, title=" · ".join(p for p in (mode, cond) if p) or "all runs", min_share=min_share))
    return out


def _why(groups: list[Group], *, title: str, min_share: float) -> Table:
    profiled = any(g.kernels() for g in groups)
    head = ["size", "variant", "n", f"step ms {CI}",
            *[f"{SHORT[p]} ms dev / host {CI}" for p in ("forward", "backward", "optimizer")],
            "GPU busy", *(["kernels fwd·bwd·opt", "kernel ms"] if profiled else []), "opt share", f"tokens/s {CI}",
            f"MFU {CI}"]
    rows, starts, last = [], [], None
    for g in groups:
        if g.size != last:
            starts.append(len(rows))
            last = g.size
        k = g.kernels()
        kern = "·".join(count_text(g.phases[p].launches) if g.phases[p].launches is not None else "-"
                        for p in ("forward", "backward", "optimizer")) if k else "-"
        opt = g.phases["optimizer"].device
        share = f"{100 * opt.median / g.step.median:.0f} %" if opt.known and g.step.median else "-"
        rows.append([g.size if len(starts) and starts[-1] == len(rows) else "", g.variant, str(g.n),
                     est(g.step, lines=True),
                     *[_dev_host(g, p) for p in ("forward", "backward", "optimizer")], _bound(g, min_share=min_share),
                     *([kern, num(k[1]) if k else "-"] if profiled else []), share, est(g.tokens_per_s, 0, lines=True),
                     est(g.mfu, 2, lines=True)])
    notes = [(f"step ms: {STEP_STATISTIC}; fwd, bwd, opt: forward, backward, optimizer; dev: device time (CUDA "
              "events), host: host time (perf_counter); each a median over repeats of each run's median, with its "
              "interval. GPU busy: the kernel time a profiled repeat saw in the phase over the phase's "
              f"device time here (≥ {100 * GPU_BOUND:.0f} %: the GPU is the bottleneck; under {100 * STARVED:.0f} %: it waits for "
              f"Python to queue kernels; '-': no profiled repeat); phases under {100 * min_share:.0f} % of the step "
              "are not listed"),
             *interval_notes(*(g.step for g in groups))]
    if profiled:
        notes.append("kernels (launched per step) and kernel ms (their device time per step): torch.profiler counts "
                     "of a profiled run with the same step shape and mode (see Kernel profiles)")
    notes.append("opt share: the optimizer's device time in % of the step; MFU: achieved / datasheet peak FLOP/s")
    return Table(title=title, head=head, rows=rows, notes=notes, n_keys=2, groups=starts)


def _dev_host(g: Group, phase: str) -> str:
    p = g.phases[phase]
    return f"{est(p.device)} /\n{est(p.host)}" if p.device.known or p.host.known else "-"


def _bound(g: Group, *, min_share: float) -> str:
    """The GPU's busy fraction per phase, measured in a profiled repeat ('fwd 38 %'), '-' without one."""
    out = []
    for ph in PHASES:
        p = g.phases[ph]
        if not p.device.known or p.device.median < min_share * g.step.median or p.busy is None:
            continue
        out.append(f"{SHORT[ph]} {100 * p.busy:.0f} %")
    return ", ".join(out) or "-"


def profiles_table(study: Study) -> Table | None:
    if not study.profiles:
        return None
    other = any("other" in p.counts for p in study.profiles)
    head = ["run", "size", "variant", "execution mode", "condition", *[f"{SHORT[p]} kernels" for p in PHASES],
            *(["outside phases"] if other else []), "kernels / step", "kernel ms / step", "timed step ms", "GPU busy"]
    rows = []
    for p in study.profiles:
        launches = sum(a for a, _ in p.counts.values())
        ms = sum(b for _, b in p.counts.values())
        step = p.group.step.median if p.group is not None else math.nan
        busy = f"{100 * ms / step:.0f} %" if p.group is not None and step else "-"
        rows.append([p.run_id, p.size, p.variant, p.mode, p.condition,
                     *[count_text(p.counts[ph][0]) if ph in p.counts else "-" for ph in PHASES],
                     *([count_text(p.counts["other"][0]) if "other" in p.counts else "-"] if other else []),
                     count_text(launches), num(ms), num(step), busy])
    notes = [("kernels launched and their summed device time per step, from torch.profiler (kernels_by_phase.csv); "
             "GPU busy = kernel ms / the timed group's median step ms: the rest of the step the GPU waits "
             "(for the host to queue work, or between kernels); '-': no timed group with this step shape and mode")]
    return Table(title="Kernel profiles", head=head, rows=rows, notes=notes, n_keys=5)


def _unjudged(d: Estimate) -> str:
    """Why a difference is not judged: too few repeats, or no interval at all."""
    return f"? ({TOO_FEW})" if d.has_interval else "? (no interval)"


# -- accuracy over seeds -------------------------------------------------------------------------
def accuracy_table(study: Study) -> Table | None:
    metric = study.accuracy_metric
    if not metric:
        return None
    label = column_label(metric)
    with_cond = any(study.conditions())
    head = ["execution mode", *(["condition"] if with_cond else []), "size", "variant", "seeds", f"step ms {CI}",
            f"step ratio {CI}", f"{label} median {CI}", "min–max", f"Δ vs baseline {CI}", "outside seed noise"]
    rows = []
    for g in study.groups:
        a = g.accuracy.get(metric)
        if a is None:
            continue
        d, outside = study.accuracy_vs_base(g)
        mark = "baseline" if g.is_baseline else {True: "yes", False: "no", None: _unjudged(d)}[outside]
        values = pd.to_numeric(g.runs[metric], errors="coerce").dropna()
        delta = "-" if not d.known or g.is_baseline else f"{d.value:+.2f} {span_text(d)}"
        rows.append([g.mode or "-", *([g.condition or "-"] if with_cond else []), g.size, g.variant,
                     f"{len(g.seeds)} ({', '.join(g.seeds)})" if g.seeds else str(g.n), est(g.step, lines=True),
                     ratio_cell(g) if not g.is_baseline else "1.00× (baseline)", est(a, 2),
                     f"{num(values.min(), 2)}–{num(values.max(), 2)}" if len(values) else "-", delta, mark])
    over = "seeds vary across repeats" if study.seeds_vary else "repeats share one seed: the spread is run-to-run only"
    notes = [(f"{label}: median over the repeats of each group with its {STATISTIC}, and their min–max ({over}); "
              f"Δ: the difference from the baseline, with its interval ({RESAMPLING.replace('ratio', 'difference')}); "
              f"outside seed noise: that interval leaves out 0, judged from {MIN_REPEATS} repeats a side"), "step ms and step ratio: as in the crossover table",
             *interval_notes(*_shown(study.groups))]
    return Table(title=f"{label} over seeds", head=head, rows=rows, notes=notes, n_keys=4 if with_cond else 3)
