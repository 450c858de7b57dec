"""A run's bookkeeping in its results folder, for its N >= 1 points (each recorded as its own run):
before any work, the folder takes files, its manifest parses, no file is in the way of a point's
folder, each point's folder is claimed (no other process executes it meanwhile) and an id already
recorded is refused unless overwritten; then the invocation and a record that says running, under
deferred signals; and at the end every point's record (steps.csv, run.json, its row in runs.csv),
whatever state the run ended in, each tried on its own. It is train/'s one door to the results
folder's lifecycle (lora_bench.results): the launcher of data-parallel runs, a run's identity
check and its profile tables go through it too."""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path
from typing import Iterator

from rich.console import Console

from lora_bench.errors import Interrupted, SaveError, UsageError
from lora_bench.escaping import markup
from lora_bench.results.claims import RunClaim, claim_run, claimant, try_claim
from lora_bench.results.index import INDEX
from lora_bench.results.manifest import MANIFEST, read_manifest, record_invocation, start_invocation
from lora_bench.results.prune import SUPERSEDED
from lora_bench.results.records import RUN_RECORD, RUNNING, copied_record, run_record
from lora_bench.results.save import NO_ROOM, begin_record, save_record, save_row
from lora_bench.results.schema import cfg_columns
from lora_bench.results.store import (FINISHED, LOCK_SUFFIX, RUNS_CSV, TORN_CSV, check_results_dir, read_run_table,
                                      write_csv)
from lora_bench.signals import signal_name, signals_deferred

__all__ = ["FINISHED", "LOCK_SUFFIX", "RESERVED_IDS", "RESULTS_FILES", "RUN_RECORD", "RUNNING", "begin", "cfg_columns",
           "check_results_dir", "claim_run", "claimed", "ended_by", "existing_run", "free_run_id", "refuse_existing_run",
           "save_run", "save_runs", "settle_row", "start_invocation", "write_csv"]

# What a results folder holds beside its run folders: a run id naming one would turn it into a folder
RESULTS_FILES = (RUNS_CSV, TORN_CSV, MANIFEST, SUPERSEDED, INDEX)
RESERVED_IDS = frozenset(n.lower() for name in RESULTS_FILES for n in (name, name + LOCK_SUFFIX))


@contextlib.contextmanager
def claimed(results_dir: Path, run_ids: list[str], *, overwrite: bool,
            claims: list[RunClaim] | None = None) -> Iterator[None]:
    """Inside: the results folder takes files and its runs.csv and manifest parse, and every
    point's folder is claimed (``claims``: the caller's, one per point, which it releases) and
    holds no earlier record (``overwrite`` replaces one). A folder claimed here is released on
    the way out, and removed when the run left it empty (refused before it began)."""
    check_results_dir(results_dir)
    read_manifest(results_dir)  # a manifest it cannot add to is refused before any work
    held: list[RunClaim] = []
    try:
        if claims is None:
            for run_id in run_ids:
                run_dir = results_dir / run_id
                if run_dir.exists() and not run_dir.is_dir():
                    raise UsageError(f"run id {run_id!r}: a file is in the way of the run's folder {run_dir}; "
                                     "move it aside or choose another --run-id")
                held.append(claim_run(run_dir))
        if not overwrite:
            for run_id in run_ids:
                refuse_existing_run(results_dir, run_id)
        yield
    finally:
        for claim in held:
            claim.release()
            with contextlib.suppress(OSError):  # the folder of a run refused before it began: empty
                claim.run_dir.rmdir()


def begin(results_dir: Path, rows: list[dict]) -> None:
    """Say in the results folder that the points execute: the invocation, then a record of each
    that says running, so that a process killed outright leaves them marked interrupted."""
    with signals_deferred():  # a signal now comes once the run is begun, and is recorded
        try:
            record_invocation(results_dir, run_ids=[r["run_id"] for r in rows])
        except OSError as e:
            if e.errno not in NO_ROOM:
                raise
            what = f"run {rows[0]['run_id']}" if len(rows) == 1 else "the pack's runs"
            raise SaveError(f"cannot record {what} in {results_dir}: {e.strerror or e}; nothing was run. Free some "
                            "space there (or choose another --results-dir)") from None
        for row in rows:
            begin_record(results_dir, row)


def ended_by(exc: BaseException) -> dict:
    """The status and error columns of a run that ``exc`` ended."""
    interrupted = isinstance(exc, KeyboardInterrupt)
    if isinstance(exc, Interrupted):
        error = str(exc)[:2000]
    elif interrupted:
        error = "interrupted by SIGINT"
    else:
        error = f"{type(exc).__name__}: {exc}"[:2000]
    return {"status": "interrupted" if interrupted else "failed", "error": error}


def save_run(row: dict, *, steps: list[dict] | None, results_dir: Path, log: list[str], curves: dict,
             console: Console, pending: list[int]) -> None:
    """Save the run's steps.csv (``steps``: None, none to save), run.json and runs.csv row as one
    (lora_bench.results.save), inside the caller's ``signals_deferred`` block: a terminating
    signal that came meanwhile (``pending``) ends the process once the record is saved, and a
    done run says so."""
    run_id = row["run_id"]
    row["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    save_record(results_dir, row, steps=steps, log=log, curves=curves)
    if row["status"] == "interrupted":
        console.print(f"{markup(row['error'])} after {row.get('steps') or 0} step(s): recorded as interrupted "
                      f"(run_id {run_id}); results: {results_dir / 'runs.csv'}, files: {results_dir / run_id}",
                      highlight=False)
    elif pending and row["status"] == "done":
        console.print(f"{signal_name(pending[0])} came while the finished run was being saved: it is recorded "
                      f"as done (run_id {run_id}, results: {results_dir / 'runs.csv'}); stopping now",
                      highlight=False)


def save_runs(rows: list[dict], *, steps: list[list[dict] | None], results_dir: Path, logs: list[list[str]],
              curves: list[dict], console: Console, pending: list[int]) -> None:
    """Every point's record (``save_run``); one that does not fit leaves the others theirs, and
    the first SaveError is raised once all were tried."""
    not_saved: SaveError | None = None
    for row, point_steps, log, point_curves in zip(rows, steps, logs, curves):
        try:
            save_run(row, steps=point_steps, results_dir=results_dir, log=log, curves=point_curves, console=console,
                     pending=pending)
        except SaveError as e:
            not_saved = not_saved or e
    if not_saved is not None:
        raise not_saved


def existing_run(results_dir: Path, run_id: str) -> dict | None:
    """The recorded row of ``run_id`` in this results folder (run.json, else runs.csv), if any."""
    row = run_record(results_dir / run_id)
    if row is not None:
        return row
    copy_of = copied_record(results_dir / run_id)
    if copy_of is not None:  # a copied folder (X.bak): replacing its record would lose the copy
        return {"run_id": run_id, "status": f"a copy of run {copy_of!r}'s record is in its folder"}
    csv = results_dir / RUNS_CSV
    if csv.is_file():
        table = read_run_table(csv)
        for r in table.rows:
            if r.get("run_id") == run_id:
                return r
        if run_id in table.torn_ids():
            return {"run_id": run_id, "status": "unknown (its runs.csv row is cut mid-way)"}
    return None


def refuse_existing_run(results_dir: Path, run_id: str) -> None:
    """UsageError when ``run_id`` is already recorded in ``results_dir``: ids are never reused silently."""
    old = existing_run(results_dir, run_id)
    if old is not None:
        raise UsageError(f"run id {run_id!r} already exists in {results_dir} (status {old.get('status')}, "
                         f"started {old.get('started_at') or '?'}); choose another --run-id, or pass "
                         "--overwrite to replace it")


def free_run_id(results_dir: Path, run_id: str, *, overwrite: bool) -> None:
    """The run id is free (no process runs it; no earlier record, unless ``overwrite``, which drops
    it now, so that a process that dies before recording cannot leave the old record standing)."""
    run_dir = Path(results_dir) / run_id
    claim = try_claim(run_dir)
    if claim is None:
        pid = claimant(run_dir)
        raise UsageError(f"run id {run_id!r} is running in another process{f' (pid {pid})' if pid else ''}")
    with claim:
        if not overwrite:
            refuse_existing_run(Path(results_dir), run_id)
        (run_dir / RUN_RECORD).unlink(missing_ok=True)


def settle_row(results_dir: Path, row: dict) -> None:
    """Record ``row`` as its run's final row, written by a process other than the run's own (the
    launcher of a data-parallel run)."""
    record_invocation(results_dir, run_ids=[row["run_id"]])
    save_row(results_dir, row)
