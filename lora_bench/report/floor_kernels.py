"""Where a LoRA step's device time above the floor goes, kernel class by kernel class.

For each LoRA group of a study that has a floor group (``trainable_layers=frozen``) of the same
model, batch, context and execution mode, the latest profiled repeat of the group is set against
the latest profiled repeat of the floor: per phase and kernel class (lora_bench.report.kernel_classes)
the kernel ms and launches per step of both and their difference, and per phase the gap, the
timed group's device time less the profile's kernel time. A group replayed as CUDA graphs has a
profile of its own settings too: a profiler sees no kernel inside a replayed graph, so that profile
runs the steps one by one, each call choosing as a capture would (lora_bench.train.profiling), and
launches the kernels the graphs replay; the gap is then the replay's device time less those
kernels' time. A group without a profiled repeat, or whose floor has none, reads "not measured";
nothing is inferred for it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from lora_bench.config import FROZEN, LORA_LAYERS
from lora_bench.report.groups import same
from lora_bench.report.kernel_classes import KernelProfile, class_times, classes_text
from lora_bench.report.labels import MODE_FIELDS, count_text, value_text
from lora_bench.report.load import MODE, RUN_DIR
from lora_bench.report.per_layer import NOTE as PER_LAYER_NOTE, UNIT as PER_LAYER, per_layer_text
from lora_bench.report.study import ADAPTER_ONLY, KERNEL_ONLY, STEP_SHAPE, same_settings
from lora_bench.report.study_header import LAYERS
from lora_bench.report.study_model import NOT_MEASURED, Group, Study
from lora_bench.report.tables import Table, num
from lora_bench.results.schema import SETTING_PREFIX
from lora_bench.timing import PHASES

RANK = SETTING_PREFIX + "lora_rank"
# what decides the floor's kernels: the step's shape without what only the adapters use
FLOOR_KEY = tuple(c for c in STEP_SHAPE if c not in MODE_FIELDS and c not in (LAYERS, RANK, *ADAPTER_ONLY))
ROW_KEY = (*FLOOR_KEY, LAYERS, RANK, *ADAPTER_ONLY, *KERNEL_ONLY, SETTING_PREFIX + "group_qkv")
SHOWN_CLASSES = 3  # the largest class differences the summary names


@dataclass
class FloorRow:
    group: Group
    floor: Group
    row_profile: KernelProfile | None
    floor_profile: KernelProfile | None

    @property
    def measured(self) -> bool:
        return self.row_profile is not None and self.floor_profile is not None

    @property
    def why_not(self) -> str:
        if self.row_profile is None:
            return f"{NOT_MEASURED}: no profiled repeat of this group"
        return f"{NOT_MEASURED}: no profiled repeat of its floor"


def _profile_of(row, profiles: list[dict], key: tuple[str, ...]) -> KernelProfile | None:
    """The latest profiled run with ``row``'s settings in ``key`` and its execution mode that wrote
    kernel summaries (``profiles``: newest first)."""
    want = str(row.get(MODE, ""))
    for p in profiles:
        if str(p.get(MODE, "")) == want and same_settings(row, p, key):
            kp = class_times(str(p["run_id"]), p[RUN_DIR]) if RUN_DIR in p else None
            if kp is not None:
                return kp
    return None


def floor_rows(study: Study, profiled: pd.DataFrame) -> list[FloorRow]:
    """Each LoRA group that has a floor group in ``study``, with the profiles of both (None where
    there is none); ``profiled``: the runs with a profiler attached."""
    runs = profiled.sort_values("started_at", ascending=False).to_dict("records") if len(profiled) else []
    floors = [g for g in study.groups if same(g.runs.iloc[0].get(LAYERS, ""), FROZEN)]
    out = []
    for g in study.groups:
        me = g.runs.iloc[0]
        if str(me.get(LAYERS, "")) not in LORA_LAYERS:
            continue
        floor = next((f for f in floors if str(f.runs.iloc[0].get(MODE, "")) == str(me.get(MODE, ""))
                      and same_settings(me, f.runs.iloc[0], FLOOR_KEY)), None)
        if floor is None:
            continue
        out.append(FloorRow(group=g, floor=floor, row_profile=_profile_of(me, runs, ROW_KEY),
                            floor_profile=_profile_of(floor.runs.iloc[0], runs, (*FLOOR_KEY, LAYERS))))
    return out


def _device(g: Group, phase: str) -> float:
    p = g.phases.get(phase)
    return p.device.median if p is not None and p.device.known else math.nan


def _gap(g: Group, kp: KernelProfile) -> float:
    """Σ over the timed phases of device ms less kernel ms: what the timed step spends outside kernels."""
    gaps = [_device(g, ph) - kp.totals[ph][1] for ph in PHASES if ph in kp.totals and not math.isnan(_device(g, ph))]
    return sum(gaps) if gaps else math.nan


def _kernels(kp: KernelProfile) -> tuple[float, float]:
    return sum(a for a, _ in kp.totals.values()), sum(b for _, b in kp.totals.values())


def _class_deltas(r: FloorRow) -> dict[str, float]:
    """Kernel ms per step above the floor by class, over every phase."""
    out: dict[str, float] = {}
    for kp, sign in ((r.row_profile, 1.0), (r.floor_profile, -1.0)):
        for classes in kp.classes.values():
            for cls, t in classes.items():
                out[cls] = out.get(cls, 0.0) + sign * t.ms
    return out


def signed(v: float, digits: int = 2) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:+,.{digits}f}"


def summary_table(rows: list[FloorRow]) -> Table:
    head = ["size", "variant", "execution mode", "profiled repeats (group · floor)",
            f"largest class differences (ms / step, of {SHOWN_CLASSES})", "step ms above the floor (timed)",
            f"{PER_LAYER} (timed) [interval]", "kernel ms above the floor", "gap ms above the floor",
            "launches above the floor"]
    body = []
    for r in rows:
        g = r.group
        step = g.step.median - r.floor.step.median if g.step.known and r.floor.step.known else math.nan
        cells = [g.size, g.variant, str(g.runs.iloc[0].get(MODE, ""))]
        per_layer = per_layer_text(g.runs, r.floor.runs)
        if not r.measured:
            body.append([*cells, r.why_not, NOT_MEASURED, signed(step), per_layer, NOT_MEASURED, NOT_MEASURED,
                         NOT_MEASURED])
            continue
        deltas = sorted(((c, d) for c, d in _class_deltas(r).items() if round(d, 2)),
                        key=lambda kv: -abs(kv[1]))[:SHOWN_CLASSES]
        (rl, rms), (fl, fms) = _kernels(r.row_profile), _kernels(r.floor_profile)
        body.append([*cells, f"{r.row_profile.run_id} · {r.floor_profile.run_id}",
                     "; ".join(f"{cls} {signed(d)}" for cls, d in deltas) or "none", signed(step), per_layer,
                     signed(rms - fms),
                     signed(_gap(g, r.row_profile) - _gap(r.floor, r.floor_profile)), signed(rl - fl, 0)])
    notes = ["each LoRA group against the floor (trainable_layers=frozen) of the same size, batch, context and "
             "execution mode: step ms from the timed repeats (median over repeats); kernel ms and launches per step "
             "from the latest profiled repeat of each (torch.profiler, kernels_by_phase.csv and top_kernels.csv); "
             "gap: the timed device time of the phases less the profile's kernel time in them (time the GPU runs "
             "none of the phase's kernels); above the floor: the group's less the floor's",
             "a group run as CUDA graphs is profiled without them (a profiler sees no kernel inside a replayed "
             "graph): the same kernels launched one by one, so its gap is the replay's device time less their time",
             PER_LAYER_NOTE,
             f"{NOT_MEASURED}: the folder holds no profiled repeat of the group or of its floor "
             "(configs/floor-profile.yaml makes them); nothing is inferred for it"]
    return Table(title="Device time above the floor, by kernel class", head=head, rows=body, notes=notes, n_keys=5)


def phase_table(r: FloorRow) -> Table:
    """Per phase and class: floor and group kernel ms and launches per step and their difference;
    per phase its kernels in all, the timed device time and the gap."""
    head = ["phase", "kernel class", "the group's longest kernel of the class", "floor ms", "group ms", "Δ ms",
            "floor launches", "group launches", "Δ launches"]
    rows, starts = [], []
    rp, fp, g = r.row_profile, r.floor_profile, r.group
    phases = [ph for ph in (*PHASES, *sorted(set(rp.totals) | set(fp.totals))) if ph in rp.totals or ph in fp.totals]
    for ph in dict.fromkeys(phases):
        starts.append(len(rows))
        fc, rc = fp.classes.get(ph, {}), rp.classes.get(ph, {})
        for cls in dict.fromkeys([*rc, *fc]):
            f, c = fc.get(cls), rc.get(cls)
            fms, rms = (f.ms if f else 0.0), (c.ms if c else 0.0)
            fl, rl = (f.launches if f else 0.0), (c.launches if c else 0.0)
            rows.append([ph, cls, c.longest if c else "", num(fms, 3), num(rms, 3), signed(rms - fms, 3),
                         count_text(fl), count_text(rl), signed(rl - fl, 0)])
        (fl, fms), (rl, rms) = fp.totals.get(ph, (0.0, 0.0)), rp.totals.get(ph, (0.0, 0.0))
        rows.append([ph, "all kernels", "", num(fms, 3), num(rms, 3), signed(rms - fms, 3), count_text(fl),
                     count_text(rl), signed(rl - fl, 0)])
        fd, rd = _device(r.floor, ph), _device(g, ph)
        if not (math.isnan(fd) and math.isnan(rd)):
            rows.append([ph, "device time (timed)", "", num(fd, 3), num(rd, 3), signed(rd - fd, 3), "", "", ""])
            rows.append([ph, "gap (device time less kernels)", "", num(fd - fms, 3), num(rd - rms, 3),
                         signed((rd - rms) - (fd - fms), 3), "", "", ""])
    title = (f"{g.size} · {g.variant} · {value_text(g.runs.iloc[0].get(MODE, ''))}: "
             f"profile {rp.run_id} against the floor's {fp.run_id}")
    notes = ["ms and launches per step; Δ: the group's less the floor's; _lora_mm_kernel computes the frozen "
             "weight's product together with the adapters', so a group's time in them stands against the floor's "
             "GEMMs; the C++ op launches no kernel of its own name (the same Triton kernels, or cuBLAS GEMMs through "
             "ATen), so its work shows in those classes",
             classes_text()]
    return Table(title=title, head=head, rows=rows, notes=notes, n_keys=3, groups=starts)


def floor_tables(study: Study) -> tuple[Table, list[Table]] | None:
    """The summary and each measured group's table by phase, where the study has LoRA groups with a
    floor and the folder holds a profiled repeat of one of them or of a floor; None otherwise."""
    rows = floor_rows(study, study.profiled)
    if not any(r.row_profile is not None or r.floor_profile is not None for r in rows):
        return None
    return summary_table(rows), [phase_table(r) for r in rows if r.measured]
