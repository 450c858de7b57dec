"""``sweep --pack N`` (or the sweep key ``pack: N``): which of a sweep's runs train together, up to N
at once on one model (lora_bench.train.pack, docs/packing.md). Runs whose settings agree on all but
their adapter's own (``config.ADAPTER_SETTINGS``) pack together, in the sweep's order; a run that
cannot pack, or that no other run left to do agrees with, trains on its own, and the sweep says
why. A resumed sweep packs the runs it has left."""

from __future__ import annotations

from dataclasses import dataclass

from lora_bench.config import ADAPTER_SETTINGS, pack_key, solo_reason
from lora_bench.sweep.spec import PlannedRun

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
        for lo in range(0, len(members), size):
            chunk = members[lo:lo + size]
            if len(chunk) == 1:
                alone.setdefault(ALONE, []).append(chunk[0])
            units.append(Pack(tuple(chunk)))
    units.sort(key=lambda u: u.index)
    return units, alone


def describe_plan(units: list[Pack], alone: dict[str, list[PlannedRun]], size: int) -> list[str]:
    """What the sweep prints before it starts: how many packs, and each reason runs train alone."""
    packs = [u for u in units if len(u.runs) > 1]
    if size <= 1:
        return []
    lines = [f"packing up to {size} runs at once: {sum(len(p.runs) for p in packs)} runs in {len(packs)} pack(s)"]
    for why, runs in alone.items():
        shown = ", ".join(r.run_id for r in runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
        lines.append(f"{len(runs)} run(s) train alone ({shown}): {why}")
    return lines
