"""``sweep --pack N`` (or the sweep key ``pack: N``): which of a sweep's runs train together, up to N
at once on one model (lora_bench.train.pack, docs/packing.md). Runs whose settings agree on all but
their adapter's own (``config.ADAPTER_SETTINGS``) pack together, in the sweep's order; a run that
cannot pack, or that no other run left to do agrees with, trains on its own, and the sweep says
why. Repeats of one setting (every setting equal, the seed too) go to separate packs, never one
(``config.REPEATS_APART``), and the plan says so. A resumed sweep packs the runs it has left."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from lora_bench.config import ADAPTER_SETTINGS, REPEATS_APART, pack_key, setting_key, solo_reason
from lora_bench.sweep.spec import PlannedRun
from lora_bench.train.preflight import memory_problem

ALONE = (f"no other run left to do shares its settings but {', '.join(ADAPTER_SETTINGS)} "
         "(the settings in which packed runs may differ)")


@dataclass(frozen=True)
class Pack:
    """Runs to train at once on one model, in the sweep's order (one: a run alone)."""

    runs: tuple[PlannedRun, ...]

    @property
    def index(self) -> int:
        return self.runs[0].index


def plan_packs(runs: list[PlannedRun], size: int) -> tuple[list[Pack], dict[str, list[PlannedRun]]]:
    """The units a sweep runs, in its order (a pack goes where its first run was): packs of at most
    ``size`` compatible runs, and runs alone (packs of one); and, per reason, the runs that train
    alone for it (nothing when ``size`` is 1: packing is off)."""
    if size <= 1:
        return [Pack((run,)) for run in runs], {}
    alone: dict[str, list[PlannedRun]] = {}
    groups: dict[tuple, list[PlannedRun]] = {}
    units: list[Pack] = []
    for run in runs:
        why = solo_reason(run.cfg)
        if why:
            alone.setdefault(why, []).append(run)
            units.append(Pack((run,)))
        else:
            groups.setdefault(pack_key(run.cfg), []).append(run)
    for members in groups.values():
        copies = Counter(setting_key(r.cfg) for r in members)
        for chunk in _separated(members, size):
            if len(chunk) == 1:
                why = REPEATS_APART if copies[setting_key(chunk[0].cfg)] > 1 else ALONE
                alone.setdefault(why, []).append(chunk[0])
            units.append(Pack(tuple(chunk)))
    units.sort(key=lambda u: u.index)
    return units, alone


def _separated(members: list[PlannedRun], size: int) -> list[list[PlannedRun]]:
    """``members`` (runs that may pack together) in packs of at most ``size``, in order, each run in
    the first pack that has room and no run of its very settings."""
    packs: list[tuple[list[PlannedRun], set]] = []
    for run in members:
        key = setting_key(run.cfg)
        home = next((p for p in packs if len(p[0]) < size and key not in p[1]), None)
        if home is None:
            packs.append(([run], {key}))
        else:
            home[0].append(run)
            home[1].add(key)
    return [p for p, _ in packs]


def pack_memory_problem(units: list[Pack]) -> str | None:
    """Why a pack of ``units`` cannot fit in the CPU's memory (``train.preflight.memory_problem`` with
    every run's adapters, head and batch), or None; a GPU's is asked by the pack's own process."""
    for unit in units:
        if len(unit.runs) > 1:
            too_big = memory_problem(unit.runs[0].cfg, cuda=False, pack=[r.cfg for r in unit.runs])
            if too_big:
                return f"the pack of {_shown(list(unit.runs))}: {too_big} (or pack fewer runs: --pack)"
    return None


def describe_plan(units: list[Pack], alone: dict[str, list[PlannedRun]], size: int) -> list[str]:
    """What the sweep prints before it starts: how many packs, and each reason runs train alone."""
    packs = [u for u in units if len(u.runs) > 1]
    if size <= 1:
        return []
    lines = [f"packing up to {size} runs at once: {sum(len(p.runs) for p in packs)} runs in {len(packs)} pack(s)"]
    for why, runs in alone.items():
        lines.append(f"{len(runs)} run(s) train alone ({_shown(runs)}): {why}")
    copies = Counter(setting_key(r.cfg) for u in units for r in u.runs)
    apart = [r for p in packs for r in p.runs if copies[setting_key(r.cfg)] > 1]
    if apart:
        lines.append(f"{len(apart)} packed run(s) are repeats of one setting, each repeat in another pack "
                     f"({_shown(apart)}): {REPEATS_APART}")
    return lines


def _shown(runs: list[PlannedRun]) -> str:
    return ", ".join(r.run_id for r in runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
