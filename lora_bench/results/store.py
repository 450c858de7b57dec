"""A results folder's runs: ``runs.csv`` is an index of the folder's run records.

Each run's ``<run_id>/run.json`` is its record (lora_bench.results.records, a save's commit point).
``rebuild_index``, the one writer of runs.csv, rewrites it atomically, under a lock, from those
records whenever one is saved or removed; a row without a record (its folder removed) stays, and a
row cut mid-way goes to its run's record or, verbatim, to ``runs-torn.csv``. Readers (``result_rows``, ``lookup.find_run``) take run.json over the row, so a process
stopped between its record and the index loses nothing. The text format is ``runs_csv``'s."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import json
from pathlib import Path
from typing import Callable, Iterable


from lora_bench.errors import UsageError
from lora_bench.fileio import check_writable_dir, names_file, refusing
from lora_bench.results.claims import is_claimed
from lora_bench.results.folder_files import LOCK_SUFFIX, RUNS_CSV, TORN_CSV  # noqa: F401
from lora_bench.results.records import DIED, RUN_RECORD, RUNNING, run_record, settle_run
# the table's text format, also imported from here by its readers
from lora_bench.results.runs_csv import RunTable, csv_text, read_run_table, read_runs, read_steps  # noqa: F401
from lora_bench.results.runs_csv import stderr_warning, text_value, write_csv
from lora_bench.results.schema import run_column_names

# ran to their end: a resume does not run them again (a diverged run would diverge again)
FINISHED = ("done", "diverged")


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive advisory lock beside ``path`` (``<name>.lock``), so processes sharing a results
    folder (sweep shards on several GPUs) rewrite ``runs.csv`` one at a time. The lock file is
    removed when the lock is let go, so a folder at rest holds none. A folder that takes no lock
    file (read-only, full) is refused with ``fileio.NotWritable`` naming it."""
    path = Path(path)
    lock = path.with_name(path.name + LOCK_SUFFIX)
    while True:
        with refusing(path.parent):
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(lock, "a")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX)
        except BaseException:
            fh.close()
            raise
        if names_file(lock, fh.fileno()):
            break
        fh.close()  # its holder removed the file on letting go: lock the one there now
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)  # while held: a waiter on this file sees it gone and locks anew
        fh.close()


def rebuild_index(results_dir: Path, *, drop: Iterable[str] = (), rows: Iterable[dict] = ()) -> int:
    """Rewrite ``runs.csv`` from the folder's run.json records, under the lock (``write_index``).
    ``drop``: run ids whose rows go; ``rows``: rows to index for runs that have no record (a run's
    record, where it has one, wins). Returns how many rows went."""
    with locked(Path(results_dir) / RUNS_CSV):
        return write_index(results_dir, drop=drop, rows=rows)


def write_index(results_dir: Path, *, drop: Iterable[str] = (), rows: Iterable[dict] = ()) -> int:
    """``rebuild_index`` for a caller that holds the lock. Rows keep their places (the order the runs
    began: a run's record is first saved as it begins); a record not yet indexed is added in start
    order, a record left running by a process that died is recorded as interrupted
    (``records.settle_run``)."""
    results_dir = Path(results_dir)
    path, drop = results_dir / RUNS_CSV, set(drop)
    table = read_run_table(path) if path.is_file() else RunTable(header=["run_id"])
    index = {r["run_id"]: r for r in table.rows if r["run_id"] not in drop}
    index.update((r["run_id"], r) for r in rows if r["run_id"] not in drop)
    new = []
    for record in sorted(results_dir.glob(f"*/{RUN_RECORD}")):
        row = settle_run(record.parent) if record.parent.name not in drop else None
        if row is not None:
            new += [] if row["run_id"] in index else [row]
            index[row["run_id"]] = row
    for row in sorted(new, key=lambda r: (text_value(r.get("started_at")), r["run_id"])):
        index[row["run_id"]] = index.pop(row["run_id"])
    torn = [t for t, run_id in zip(table.torn, table.torn_ids()) if run_id not in index and run_id not in drop]
    if torn:  # nothing is lost: a cut row without its run's record is kept as it was, apart
        new_file = not (results_dir / TORN_CSV).exists()
        with refusing(results_dir), open(results_dir / TORN_CSV, "a", newline="") as f:
            csv.writer(f).writerows([table.header] * new_file + torn)
    if index or path.is_file():
        keys = dict.fromkeys(k for r in index.values() for k in r)  # one row lacks: blank, not NaN (3 stays 3)
        write_csv(path, [{k: _cell(r.get(k)) for k in keys} for r in index.values()], run_column_names())
    return len([r for r in table.rows if r["run_id"] in drop])


def _cell(v):
    """A recorded value as the index stores it: numbers as numbers, lists and dicts as JSON, None blank."""
    return json.dumps(v) if isinstance(v, (dict, list)) else "" if v is None else v


def upsert_run(path: Path, row: dict) -> None:
    """Index ``row`` in the runs.csv at ``path`` (its place kept, if it has one): ``rebuild_index``,
    so the run's record, where it has one, wins over ``row``."""
    rebuild_index(Path(path).parent, rows=[row])


def remove_runs(path: Path, run_ids: Iterable[str]) -> int:
    """Drop the rows of ``run_ids`` from the runs.csv at ``path``; returns how many went."""
    return rebuild_index(Path(path).parent, drop=run_ids) if Path(path).is_file() else 0


def result_rows(results_dir: Path, *, warn: Callable[[str], None] | None = stderr_warning) -> list[dict]:
    """Rows (as text, like runs.csv) of one results folder: runs.csv's, each replaced by its run's
    run.json where it has one, plus any run.json runs.csv lacks. A row cut mid-way counts only
    through its run.json; without one it is left out, with a warning."""
    results_dir = Path(results_dir)
    table = read_run_table(results_dir / RUNS_CSV) if (results_dir / RUNS_CSV).is_file() else RunTable(["run_id"])
    rows: dict[str, dict] = {}
    for r in table.rows:
        if r.get("status") == RUNNING and is_run_folder_name(r["run_id"]) and not is_claimed(results_dir / r["run_id"]):
            r = {**r, "status": "interrupted", "error": DIED}  # no process executes it (its run.json may say more)
        rows[r["run_id"]] = r
    for path in sorted(results_dir.glob(f"*/{RUN_RECORD}")):
        row = run_record(path.parent)
        if row is not None:  # a half-copied or foreign file is not a result
            rows[row["run_id"]] = {k: text_value(v) for k, v in row.items()}
    for run_id in table.torn_ids():
        if run_id not in rows and warn is not None:
            warn(f"{results_dir / RUNS_CSV}: the row of run {run_id or '?'} is cut mid-way and the run has no "
                 f"{RUN_RECORD}; it is left out")
    return list(rows.values())


def is_run_folder_name(run_id) -> bool:
    return isinstance(run_id, str) and run_id not in ("", ".", "..") and "/" not in run_id and "\0" not in run_id


def check_results_dir(results_dir: Path) -> None:
    """Before any work: the results folder takes new files and its runs.csv (if any) parses, so
    that a finished run is never lost at the end for want of a place to record it."""
    results_dir = Path(results_dir)
    if why := check_writable_dir(results_dir):
        raise UsageError(f"results folder {results_dir}: {why}")
    for name in (RUNS_CSV, "manifest.json"):
        if (results_dir / name).exists() and not (results_dir / name).is_file():
            raise UsageError(f"{results_dir / name} is not a file (a folder where lora-bench keeps its {name}, "
                             "perhaps a run named so by an older version); move it aside and run again")
    if (results_dir / RUNS_CSV).is_file():
        read_run_table(results_dir / RUNS_CSV)
