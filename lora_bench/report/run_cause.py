"""The measured cause of one run's phase times, for ``lora-bench show``: per phase the GPU's busy
fraction, the kernel time a profiled repeat of the same step shape and execution mode in the same
folder saw in the phase (its ``kernels_by_phase.csv``) over this run's device time, and the cause
that fraction gives (lora_bench.report.study_model.cause_of). Where the folder holds no such repeat
every phase reads "not measured": no cause is inferred from host time against device time."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from lora_bench.errors import UsageError
from lora_bench.report.load import RUN_DIR, kernel_counts, load_results
from lora_bench.report.study import profiled_runs, same_step
from lora_bench.report.study_model import busy_fraction
from lora_bench.timing import PHASES


@dataclass(frozen=True)
class RunCause:
    profile: str = ""  # run id of the profiled repeat measured from ('' where none exists)
    busy: dict[str, float] = field(default_factory=dict)  # per phase, where measured


def measured_cause(df: pd.DataFrame, row: dict) -> RunCause:
    """The busy fraction of each phase of ``row`` from the latest profiled run of ``df`` (the
    folder's loaded runs) with the same step shape and mode that wrote kernel counts."""
    me = df[df["run_id"] == row.get("run_id")]
    if me.empty:
        return RunCause()
    me_row = me.iloc[0]
    done = df[df["status"] == "done"]
    for prof in profiled_runs(done).sort_values("started_at", ascending=False).to_dict("records"):
        if not same_step(me_row, prof):
            continue
        counts = kernel_counts(prof[RUN_DIR]) if RUN_DIR in prof else {}
        if not counts:
            continue
        busy = {}
        for ph in PHASES:
            b = busy_fraction(counts.get(ph, (None, None))[1], row.get(f"{ph}_ms_median"))
            if b is not None:
                busy[ph] = b
        return RunCause(profile=str(prof["run_id"]), busy=busy)
    return RunCause()


def folder_cause(results_dir: Path, row: dict) -> RunCause:
    """``measured_cause`` of ``row`` among the runs of its folder; not measured where the folder's
    runs cannot be read together (the row itself was read: show it, without a cause)."""
    try:
        df = load_results([Path(results_dir)])
    except UsageError:
        return RunCause()
    return measured_cause(df, row)
