"""A run's record, saved as one: ``<run_id>/steps.csv``, ``<run_id>/run.json`` and the run's row in
``runs.csv`` always tell the same story.

A record is begun before the run trains (``begin_record``: run.json says ``running``, replacing an
earlier attempt's record) and finished when the run ends (``save_record``: steps.csv, then
run.json); each save then rebuilds the folder's index, runs.csv, from the records
(lora_bench.results.store). run.json is the commit point: readers take its row over runs.csv's, so
a process stopped between two writes leaves runs.csv one step behind, never a record at odds with
itself, and the next rebuild brings the row in line. Terminating signals that arrive during a save
wait until it is done
(lora_bench.signals.signals_deferred). A process killed outright (SIGKILL, the out-of-memory
killer, a power cut) leaves a ``running`` record that no process claims: readers show it as
interrupted and the next write records it so (``records.settle_run``).

A file system that takes no more (full, over quota, a file-size limit) ends a save with a
SaveError naming the folder and the space the record needs; the run is then recorded as failed
with that reason, in the smallest form that fits (its row, every measured column kept), where even
that fits."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
from pathlib import Path

from lora_bench.errors import SaveError
from lora_bench.fileio import atomic_write_bytes, atomic_write_text, overwrite_in_place
from lora_bench.results.records import RUN_RECORD, STEPS_CSV, record_text, with_row, write_record
from lora_bench.results.schema import STEP_COLUMNS
from lora_bench.results.runs_csv import csv_text
from lora_bench.results.store import FINISHED, RUNS_CSV, rebuild_index
from lora_bench.signals import signals_deferred

# what a file system says when it takes no more: full, over quota, past the file-size limit
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def begin_record(results_dir: Path, row: dict) -> None:
    """Before the run trains: its record says ``running`` (run.json, which replaces an earlier
    attempt's record, then the index), and an earlier attempt's steps.csv goes. A folder without
    room for this much is refused now, before any work, with a SaveError, and left as it was where
    that fits (the earlier record put back, or none left)."""
    results_dir = Path(results_dir)
    run_dir = results_dir / row["run_id"]
    record = record_text({"row": row, "log": []})
    with signals_deferred():
        earlier = _contents(run_dir / RUN_RECORD)
        written = False
        try:
            write_record(run_dir, record)
            written = True
            rebuild_index(results_dir)
        except OSError as e:
            if e.errno not in NO_ROOM:
                raise
            with contextlib.suppress(OSError):  # a run that never started leaves no record of its own
                if written and earlier is not None:
                    atomic_write_bytes(run_dir / RUN_RECORD, earlier)
                elif written:
                    (run_dir / RUN_RECORD).unlink()
            raise SaveError(f"cannot record run {row['run_id']} in {results_dir}: {_why(e, results_dir)}; nothing "
                            f"was run. Free some space there (or choose another --results-dir)", row=row) from None
        (run_dir / STEPS_CSV).unlink(missing_ok=True)


def save_record(results_dir: Path, row: dict, *, steps: list[dict] | None, log: list[str], curves: dict) -> dict:
    """The finished record: steps.csv (``steps``; None: the run measured no steps, and an earlier
    steps.csv goes), run.json, then the index. Returns the row as recorded. Where the folder takes
    no more, the run is recorded as failed with the reason and its measured columns, as far as
    that fits, and a SaveError says what was kept."""
    results_dir = Path(results_dir)
    run_dir = results_dir / row["run_id"]
    steps_file = csv_text(steps, [c.name for c in STEP_COLUMNS]) if steps is not None else None
    record = record_text({"row": row, "log": log, **curves})
    with signals_deferred():
        try:
            if steps_file is not None:
                atomic_write_text(run_dir / STEPS_CSV, steps_file)
            else:
                (run_dir / STEPS_CSV).unlink(missing_ok=True)
            write_record(run_dir, record)
        except OSError as e:
            if e.errno not in NO_ROOM:
                raise
            need = len(record) + len(steps_file or "") + _size(results_dir / RUNS_CSV) + len(record) // 2
            _save_what_fits(results_dir, row, log=log, error=e, need=need)
        try:
            rebuild_index(results_dir)
        except OSError as e:
            if e.errno not in NO_ROOM:
                raise
            raise SaveError(f"run {row['run_id']} is recorded in {run_dir / 'run.json'} (status {row['status']}), "
                            f"but {results_dir / RUNS_CSV} could not be rewritten: {_why(e, results_dir)}; "
                            f"about {_kb(_size(results_dir / RUNS_CSV) + len(record))} is needed. Readers take the "
                            "run from run.json meanwhile, and the next write into the folder, once there is room, "
                            "brings runs.csv in line", row=row) from None
    return row


def _save_what_fits(results_dir: Path, row: dict, *, log: list[str], error: OSError, need: int) -> None:
    """The full record did not fit: record the run as failed, row and log only (steps.csv goes,
    freeing its space), then raise the SaveError that says what was kept."""
    run_dir = results_dir / row["run_id"]
    why = _why(error, results_dir)
    head = f"cannot save run {row['run_id']} in {results_dir}: {why}; its record needs about {_kb(need)}"
    (run_dir / STEPS_CSV).unlink(missing_ok=True)
    earlier = f"{row['error']}; " if row.get("error") else ""
    failed = {**row, "status": "failed" if row.get("status") in FINISHED else row.get("status"),
              "error": f"{earlier}not saved in full: {why} (the measured columns are kept, steps.csv is not)"}
    try:
        _write_compact(run_dir, record_text({"row": failed, "log": log}))
    except OSError as e:
        if e.errno not in NO_ROOM:
            raise
        raise SaveError(f"{head}. Nothing of it could be written (the folder's copy says the run was interrupted); "
                        "its numbers are only those printed here", row=row) from None
    try:
        rebuild_index(results_dir)
    except OSError as e:
        if e.errno not in NO_ROOM:
            raise
        raise SaveError(f"{head}. It is recorded as failed, with its measured columns, in {run_dir / 'run.json'} "
                        f"only ({results_dir / RUNS_CSV} takes it at the next write once there is room)",
                        row=failed) from None
    raise SaveError(f"{head}. It is recorded as failed, with its measured columns but without steps.csv, in "
                    f"{run_dir / 'run.json'} and {results_dir / RUNS_CSV}", row=failed)


def _write_compact(run_dir: Path, text: str) -> None:
    """run.json, atomically where a temporary copy fits, else over the begun record's own blocks
    (a reader refuses the file if this is stopped midway, and the run counts as interrupted)."""
    try:
        write_record(run_dir, text)
    except OSError as e:
        data = text.encode()
        if e.errno not in NO_ROOM or len(data) > _room_in(run_dir / RUN_RECORD):
            raise
        overwrite_in_place(run_dir / RUN_RECORD, data)


def _room_in(path: Path) -> int:
    """Bytes a rewrite of ``path`` in place surely has: the blocks it holds, within the file-size
    limit (0 when it does not exist)."""
    try:
        held = os.stat(path).st_blocks * 512
    except OSError:
        return 0
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return held if limit == resource.RLIM_INFINITY else min(held, limit)


def _why(e: OSError, where: Path) -> str:
    """The file system's reason, with the room there is: free bytes, or the file-size limit."""
    text = e.strerror or str(e)
    if e.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return f"{text} (a file may have at most {_kb(limit)} here: ulimit -f)"
        return text
    try:
        return f"{text} ({_kb(shutil.disk_usage(where).free)} free)"
    except OSError:
        return text


def _contents(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _kb(n: int) -> str:
    return f"{n / 1024:,.0f} KiB" if n < 10 * 2**20 else f"{n / 2**20:,.0f} MiB"


def save_row(results_dir: Path, row: dict) -> dict:
    """A run's outcome recorded by someone other than the run (a sweep whose worker died): the row
    replaces the one in run.json (its log and curves stay), then the index, signals deferred; a
    steps.csv that no finished record describes goes. SaveError where the folder takes no more."""
    results_dir = Path(results_dir)
    run_dir = results_dir / row["run_id"]
    with signals_deferred():
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            if row.get("status") not in FINISHED:
                (run_dir / STEPS_CSV).unlink(missing_ok=True)
            _write_compact(run_dir, record_text(with_row(run_dir, row)))
            rebuild_index(results_dir)
        except OSError as e:
            if e.errno not in NO_ROOM:
                raise
            raise SaveError(f"cannot record run {row['run_id']} ({row.get('status')}) in {results_dir}: "
                            f"{_why(e, results_dir)}; free some space there", row=row) from None
    return row
