"""Every table of a report as plain text cells (one model for the terminal, Markdown and HTML
renderers): the header facts, the crossover, where the time goes, kernel profiles, accuracy over
seeds, and the table of all groups."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from lora_bench.escaping import csv_cell
from lora_bench.report.aggregate import RULE, Report
from lora_bench.report.names import LAYER_HELP, column_label, count_text, is_blank
from lora_bench.report.study import Group, Study
from lora_bench.results.metrics import HOST_BOUND_RATIO
from lora_bench.results.schema import column_index
from lora_bench.timing import PHASES

SHORT = {"data": "data", "forward": "fwd", "backward": "bwd", "optimizer": "opt"}


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
def base_name(study: Study) -> str:
    """'all' for trainable_layers=all; the whole spec when it has several keys."""
    return study.baseline_text.split("=", 1)[-1] if len(study.baseline) == 1 else study.baseline_text


def ratio_cell(g: Group | None) -> str:
    if g is None or math.isnan(g.ratio):
        return "-"
    mark = {True: " ≈", False: "", None: " ?"}[g.within]
    rng = ""
    if g.n > 1 or g.step.n > 1:
        rng = f"\n({g.ratio_lo:.2f}–{g.ratio_hi:.2f})"  # a second line where the renderer allows one
    return f"{g.ratio:.2f}×{mark}{rng}"


def crossover_table(study: Study) -> Table:
    """Per mode and condition: the baseline's median step ms by size, then each variant's ratio."""
    with_cond = any(study.conditions())
    head = ["execution mode", *(["condition"] if with_cond else []), "variant", *study.sizes]
    rows, starts = [], []
    for cond in study.conditions():
        for mode in study.modes():
            base = {g.size: g for g in study.groups if g.is_baseline and g.condition == cond and g.mode == mode}
            lines = [ln for ln in study.lines if ln.condition == cond and ln.mode == mode]
            if not lines or not any(g.step.known for g in [*base.values(), *(g for ln in lines for g in ln.groups)]):
                continue
            starts.append(len(rows))
            rows.append([mode or "-", *([cond or "-"] if with_cond else []), f"{base_name(study)}: step ms"] +
                        [num(base[s].step.median) if s in base else "-" for s in study.sizes])
            for ln in lines:
                by = {g.size: g for g in ln.groups}
                rows.append(["", *([""] if with_cond else []), f"{ln.variant} / {base_name(study)}"] +
                            [ratio_cell(by.get(s)) for s in study.sizes])
    notes = [(f"ratio = median step time over repeats / the baseline's ({study.baseline_text}) at the same size, "
             "mode and condition; (lo–hi): the ratio's range over repeats, min/max to max/min"),
             RULE]
    if legend(study):
        notes.append(legend(study))
    return Table(title=f"LoRA crossover: step time relative to {study.baseline_text} ({study.device})", head=head,
                 rows=rows, notes=notes, n_keys=3 if with_cond else 2, groups=starts)


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
    head = ["size", "variant", "n", "step ms (IQR)", *[f"{SHORT[p]} ms dev / host" for p in ("forward", "backward", "optimizer")],
            "host-bound", *(["kernels fwd·bwd·opt", "kernel ms"] if profiled else []), "opt share", "tokens/s", "MFU"]
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
                     f"{num(g.step.median)} ({num(g.step.iqr, 2)})",
                     *[_dev_host(g, p) for p in ("forward", "backward", "optimizer")], _bound(g, min_share=min_share),
                     *([kern, num(k[1]) if k else "-"] if profiled else []), share, num(g.tokens_per_s, 0), num(g.mfu, 2)])
    notes = [(f"fwd, bwd, opt: forward, backward, optimizer; dev: device time (CUDA events), host: host time "
             "(perf_counter); medians over repeats of each run's median. host-bound: every repeat recorded host ≥ "
             f"{HOST_BOUND_RATIO} × device for the phase ('mixed': the repeats disagree); phases under "
             f"{100 * min_share:.0f} % of the step are not listed")]
    if profiled:
        notes.append("kernels (launched per step) and kernel ms (their device time per step): torch.profiler counts "
                     "of a profiled run with the same step shape and mode (see Kernel profiles)")
    notes.append("opt share: the optimizer's device time in % of the step; MFU: achieved / datasheet peak FLOP/s")
    return Table(title=title, head=head, rows=rows, notes=notes, n_keys=2, groups=starts)


def _dev_host(g: Group, phase: str) -> str:
    p = g.phases[phase]
    return f"{num(p.device.median)} / {num(p.host.median)}" if p.device.known or p.host.known else "-"


def _bound(g: Group, *, min_share: float) -> str:
    out = []
    for ph in PHASES:
        p = g.phases[ph]
        if not p.device.known or p.device.median < min_share * g.step.median:
            continue
        if p.bound == "host":
            out.append(SHORT[ph])
        elif "host" in p.bound:
            out.append(SHORT[ph] + " (mixed)")
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


# -- accuracy over seeds -------------------------------------------------------------------------
def accuracy_table(study: Study) -> Table | None:
    metric = study.accuracy_metric
    if not metric:
        return None
    label = column_label(metric)
    with_cond = any(study.conditions())
    head = ["execution mode", *(["condition"] if with_cond else []), "size", "variant", "seeds", "step ms",
            "step ratio", f"{label} median", "min–max", "IQR", "Δ vs baseline", "within seed noise"]
    rows = []
    for g in study.groups:
        a = g.accuracy.get(metric)
        if a is None:
            continue
        d, w = study.accuracy_vs_base(g)
        mark = "baseline" if g.is_baseline else {True: "≈ yes", False: "no", None: "? (one run)"}[w]
        rows.append([g.mode or "-", *([g.condition or "-"] if with_cond else []), g.size, g.variant,
                     f"{len(g.seeds)} ({', '.join(g.seeds)})" if g.seeds else str(g.n), num(g.step.median),
                     ratio_cell(g) if not g.is_baseline else "1.00×", num(a.median, 2),
                     f"{num(a.lo, 2)}–{num(a.hi, 2)}", num(a.iqr, 2),
                     "-" if math.isnan(d) or g.is_baseline else f"{d:+.2f}", mark])
    over = "seeds vary across repeats" if study.seeds_vary else "repeats share one seed: the spread is run-to-run only"
    notes = [(f"{label}: median, min–max and IQR over the repeats of each group ({over}); within seed noise: "
             "|Δ median| ≤ max(IQR of the group, IQR of the baseline)")]
    return Table(title=f"{label} over seeds", head=head, rows=rows, notes=notes, n_keys=4 if with_cond else 3)


# -- every group ---------------------------------------------------------------------------------
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


def groups_table(rep: Report, *, title: str = "") -> Table:
    """Every group with its metrics (median, IQR of the first), the ratio to the baseline."""
    head = [column_label(k) for k in rep.keys] + ["n"]
    for i, m in enumerate(rep.metrics):
        head += [column_label(m)] + (["IQR"] if i == 0 else [])
    if rep.baseline:
        head.append("vs " + ",".join(f"{column_label(k)}={v}" for k, v in rep.baseline.items()))
    rows = []
    digits = {m: _digits(rep.groups[m], m) for m in rep.metrics}
    for rec in rep.groups.to_dict("records"):
        row = [str(rec[k]) if not is_blank(rec[k]) else "-" for k in rep.keys] + [str(rec["n"])]
        for i, m in enumerate(rep.metrics):
            row.append(_cell(rec[m], digits[m]))
            if i == 0:
                row.append(_cell(rec[f"{m}_iqr"], _digits(rep.groups[f"{m}_iqr"], m)))
        if rep.baseline:
            row.append(_groups_ratio(rec))
        rows.append(row)
    notes = [f"median over repeats of each configuration; IQR of {column_label(rep.primary)} over repeats"]
    if rep.baseline and "ratio" in rep.groups:
        notes.append(f"ratio = median {column_label(rep.primary)} / the baseline's; {RULE}")
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
    mark = {True: " ≈", False: "", None: " ?"}[rec.get("within")]
    return f"{r:.2f}×{mark}"


def to_csv(rep: Report) -> str:
    """The table of groups as CSV, each text cell as ``escaping.csv_cell`` stores it (none runs as a
    spreadsheet formula); numbers stay numbers."""
    out = rep.groups.rename(columns={k: column_label(k) for k in rep.keys})
    text = out.select_dtypes(include=["object", "string"]).columns
    out[text] = out[text].map(csv_cell)
    out.columns = [csv_cell(c) for c in out.columns]
    return out.to_csv(index=False, float_format="%.6g")
