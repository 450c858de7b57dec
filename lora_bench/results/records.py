"""A run's own record, ``<run_id>/run.json``: ``{"row": {...}, "log": [...], curves...}``, read only
from the folder named by the run's id, written atomically, and the commit point of a save
(lora_bench.results.save). A record still ``running`` whose folder no process claims is one whose
process died: readers show it as interrupted (``run_record``), writers record it so (``settle_run``)."""

from __future__ import annotations

import json
from pathlib import Path

from lora_bench.errors import ResultsError
from lora_bench.fileio import atomic_write_text
from lora_bench.results.guarded_read import read_results_json
from lora_bench.results.claims import is_claimed, try_claim
from lora_bench.results.folder_files import RUN_RECORD, STEPS_CSV  # noqa: F401

RUNNING = "running"  # a record begun and not yet finished: the run's process is executing it, or died
# read only up to this size: a run.json holds one row, the run's log lines and its loss curves (kilobytes)
MAX_RECORD_BYTES = 64 << 20
DIED = ("its process ended before recording how the run ended (killed outright, e.g. by SIGKILL or the "
        "out-of-memory killer, or the machine stopped)")


def _record_row(run_dir: Path) -> dict | None:
    """The row stored in ``<run_dir>/run.json`` whatever run it names, or None when absent,
    half-written, past MAX_RECORD_BYTES (not read), or not a record."""
    try:
        row = read_results_json(Path(run_dir) / RUN_RECORD, limit=MAX_RECORD_BYTES, root=Path(run_dir).parent)["row"]
    except (ResultsError, KeyError, TypeError):  # not a record: a pipe, a link out, too large or deep, not JSON
        return None
    return row if isinstance(row, dict) and isinstance(row.get("run_id"), str) else None


def run_record(run_dir: Path) -> dict | None:
    """The row in ``<run_dir>/run.json``, or None when absent, half-written, foreign, or the
    record of another run: a run's record lives in the folder named by its run id, so a copy of
    the folder (``cp -r X X.bak``) never stands in for the run. A record still ``running`` whose
    claim no process holds is shown as interrupted (its process died; ``settle_run`` records so)."""
    row = _record_row(run_dir)
    if row is None or row["run_id"] != Path(run_dir).name:
        return None
    if row.get("status") == RUNNING and not is_claimed(run_dir):
        row = {**row, "status": "interrupted", "error": DIED}
    return row


def record_text(record: dict) -> str:
    """run.json's text: ``{"row": {...}, "log": [...], curves...}``."""
    return json.dumps(record, indent=1, default=str)


def write_record(run_dir: Path, text: str) -> None:
    """Write ``<run_dir>/run.json`` (``record_text``) atomically."""
    atomic_write_text(Path(run_dir) / RUN_RECORD, text)


def with_row(run_dir: Path, row: dict) -> dict:
    """The record in run.json with ``row`` in place of its own: the log and curves the run wrote stay."""
    try:
        record = read_results_json(Path(run_dir) / RUN_RECORD, limit=MAX_RECORD_BYTES, root=Path(run_dir).parent)
    except ResultsError:
        record = None
    if not isinstance(record, dict):
        record = {"log": []}
    return {**record, "row": row}


def rewrite_row(run_dir: Path, row: dict) -> None:
    """Replace the row in run.json, keeping the log and curves the run wrote."""
    write_record(run_dir, record_text(with_row(run_dir, row)))


def settle_run(run_dir: Path) -> dict | None:
    """``run_record``, and a record left ``running`` by a process that died is recorded as
    interrupted in run.json (under the run's claim, so never while a process executes it); its
    steps.csv, which no record describes, goes."""
    row = run_record(run_dir)
    if row is None or row.get("error") != DIED or row.get("status") != "interrupted":
        return row
    claim = try_claim(run_dir)
    if claim is None:  # claimed meanwhile: a process executes the run again
        return run_record(run_dir)
    with claim:
        row = _record_row(run_dir)
        if row is None or row.get("status") != RUNNING:
            return run_record(run_dir)
        row = {**row, "status": "interrupted", "error": DIED}
        (Path(run_dir) / STEPS_CSV).unlink(missing_ok=True)
        rewrite_row(run_dir, row)
    return row


def copied_record(run_dir: Path) -> str | None:
    """The run id named by ``<run_dir>/run.json`` when it is another run's (a copied folder)."""
    row = _record_row(run_dir)
    return row["run_id"] if row is not None and row["run_id"] != Path(run_dir).name else None
