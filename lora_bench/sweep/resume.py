"""What a sweep finds in its results folder: which planned runs are done (by id, or by their
settings), forgetting runs for ``--fresh``, and rebuilding ``runs.csv`` from the run.json records."""

from __future__ import annotations

import shutil
from pathlib import Path

from lora_bench.config import TrainConfig
from lora_bench.config.recorded import as_recorded
from lora_bench.errors import RunClaimedError
from lora_bench.results.claims import CLAIM_NAME, claimant, try_claim
from lora_bench.results.runs_csv import same_number
from lora_bench.results.store import FINISHED, RUNS_CSV, rebuild_index, remove_runs, result_rows, text_value
from lora_bench.sweep.spec import ID_AS_DECLARED, PlannedRun


def repair_runs_csv(results_dir: Path) -> None:
    """Rebuild runs.csv from the per-run run.json records (``store.rebuild_index``): each sweep does
    so when it starts and ends, which also records a run left running by a dead process as
    interrupted."""
    rebuild_index(results_dir)


def resume_statuses(results_dir: Path, runs: list[PlannedRun], sweep_name: str) -> dict[str, tuple[str, str]]:
    """Planned run id -> (status, id of the row that has it). A run without a row of its own id
    counts as done when a finished row of the same sweep and repeat holds the same settings:
    a row written under another run-id scheme, or by a version without a setting now at its default.
    Paths and the device are not compared (they may differ per machine, as in the ids)."""
    rows = result_rows(Path(results_dir))
    by_id = {r["run_id"]: r for r in rows}
    out: dict[str, tuple[str, str]] = {}
    finished = [r for r in rows if r.get("status") == "done" and r.get("sweep_name") == sweep_name]
    claimed: set[str] = set()
    for run in runs:
        own = by_id.get(run.run_id)
        if own is not None and own.get("status") in FINISHED:
            out[run.run_id] = (own["status"], run.run_id)
            continue
        match = next((r for r in finished if r["run_id"] not in claimed and r.get("repeat") == str(run.repeat)
                      and _same_settings(run.cfg, r, skip=ID_AS_DECLARED)), None)
        if match is not None:
            claimed.add(match["run_id"])
            out[run.run_id] = ("done", match["run_id"])
        elif own is not None:
            out[run.run_id] = (own.get("status", ""), run.run_id)
    return out


def _same_settings(cfg: TrainConfig, row: dict, *, skip: tuple[str, ...]) -> bool:
    """Does a results row (text values, ``cfg_<name>`` columns) hold these settings? Each side as it
    compares (``config.recorded.as_recorded``): a column the row lacks, or leaves empty (runs.csv
    fills the columns of older rows with nothing), holds the default the row ran."""
    values = cfg.to_dict()
    for name in TrainConfig.field_names():
        if name in skip:
            continue
        want = text_value(as_recorded(name, values[name], values.get))
        got = text_value(as_recorded(name, row.get(f"cfg_{name}"), lambda k: row.get(f"cfg_{k}")))
        if want != got and not same_number(want, got):
            return False
    return True


def forget_runs(results_dir: Path, run_ids: list[str]) -> int:
    """``--fresh``: drop these runs' rows and files (only this sweep's / shard's runs). Refuses,
    before deleting anything, when another process is executing one of them."""
    results_dir = Path(results_dir)
    ids = sorted(set(run_ids))
    held = []
    try:
        for run_id in ids:
            if not (results_dir / run_id).is_dir():
                continue
            got = try_claim(results_dir / run_id)
            if got is None:
                pid = claimant(results_dir / run_id)
                raise RunClaimedError(f"--fresh: run {run_id} is being executed by another process"
                                      f"{f' (pid {pid})' if pid else ''}; wait for it or stop it first")
            held.append(got)
        gone = remove_runs(results_dir / RUNS_CSV, ids)
        for got in held:  # everything but the claim file, which other processes may be waiting on
            for path in got.run_dir.iterdir():
                if path.name == CLAIM_NAME:
                    continue
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        return gone
    finally:
        for got in held:
            got.release()
