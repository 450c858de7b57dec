"""Reading and writing the results tables: ``runs.csv`` (one row per run, read-modify-written under
a lock) and the per-step CSVs, each written atomically.

``runs.csv`` is read strictly: a file that is not lora-bench's table (binary, empty, a quote never
closed, another program's CSV without ``run_id``) raises one ResultsError naming the file, and a
row cut mid-way (fewer fields than the header, or a last line without its newline) is never read as
a result. Each run's ``<run_id>/run.json`` wins over its row: it is the commit point of a save
(lora_bench.results.save), and only the folder named by a run's id holds its record."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd

from lora_bench.errors import ResultsError, UsageError
from lora_bench.escaping import csv_cell, csv_value
from lora_bench.fileio import TooLarge, atomic_write_text, check_writable_dir, names_file, read_capped
from lora_bench.results.cells import runs_frame
from lora_bench.results.claims import is_claimed
from lora_bench.results.records import DIED, RUN_RECORD, RUNNING, STEPS_CSV, copied_record, run_record, settle_run
from lora_bench.results.schema import run_column_names
from lora_bench.safe_yaml import short_repr

RUNS_CSV = "runs.csv"
STEPS_MAX_BYTES = 512 * 2**20  # a million steps of every column is about 200 MiB
TORN_CSV = "runs-torn.csv"  # rows cut mid-way, set aside verbatim when runs.csv is rewritten
LOCK_SUFFIX = ".lock"  # ``<name>.lock`` beside a file that processes read-modify-write in turn
REQUIRED = ("run_id", "status")
# ran to their end: a resume does not run them again (a diverged run would diverge again)
FINISHED = ("done", "diverged")
# Read only up to this size: a 100,000-run sweep's runs.csv holds about 300 MB (3 KB a row)
MAX_TABLE_BYTES = 1 << 30


def csv_text(rows: Iterable[dict], columns: list[str]) -> str:
    """Rows as lora-bench's result tables hold them: ``columns`` first, in order, then any other key
    the rows have; every text cell as ``escaping.csv_cell`` stores it (no cell runs as a spreadsheet
    formula; ``read_run_table`` reads each back unchanged), and quoted: the csv module leaves a lone
    carriage return in a cell unquoted, which a reader takes for the end of the row."""
    df = pd.DataFrame(list(rows))
    extra = [c for c in df.columns if c not in columns]
    df = df.reindex(columns=columns + extra)
    text = df.select_dtypes(include=["object", "string"]).columns
    df[text] = df[text].map(csv_cell)
    df.columns = [csv_cell(c) for c in df.columns]
    return df.to_csv(index=False, quoting=csv.QUOTE_NONNUMERIC)


def write_csv(path: Path, rows: Iterable[dict], columns: list[str]) -> None:
    """The one writer of lora-bench's result tables (``csv_text``), atomically."""
    atomic_write_text(path, csv_text(rows, columns))


@dataclass
class RunTable:
    """``runs.csv`` as text: the header, the complete rows, and the torn ones (field lists)."""

    header: list[str] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    torn: list[list[str]] = field(default_factory=list)

    def torn_ids(self) -> list[str]:
        at = self.header.index("run_id") if "run_id" in self.header else 0
        return [t[at] if len(t) > at else "" for t in self.torn]


def _not_a_table(path: Path, why: str) -> ResultsError:
    return ResultsError(f"{path} is not a lora-bench runs.csv: {why}. Move it aside and run again "
                        f"(every run's record is also kept in <results folder>/<run_id>/{RUN_RECORD})")


class _Lines:
    """The lines of a text for csv.reader, remembering where the last complete record ended."""

    def __init__(self, text: str):
        self._lines = io.StringIO(text, newline="")
        self._pos = 0
        self.marked = 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = self._lines.readline()
        if not line:
            raise StopIteration
        self._pos += len(line)
        return line

    def mark(self) -> None:
        self.marked = self._pos


def read_run_table(path: Path) -> RunTable:
    """Parse ``runs.csv`` strictly (see the module's docstring); raises ResultsError."""
    path = Path(path)
    try:
        data = read_capped(path, MAX_TABLE_BYTES)
    except TooLarge as e:
        raise _not_a_table(path, f"it has {e.size:,} bytes, more than the {MAX_TABLE_BYTES:,} a runs.csv may have") \
            from None
    except OSError as e:
        raise ResultsError(f"cannot read {path} ({e.strerror or e})") from None
    if not data.strip():
        raise _not_a_table(path, "it is empty")
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _not_a_table(path, "it holds binary data, not text") from None
    records: list[list[str]] = []
    cut = not text.endswith("\n")  # pandas and the csv module end every row with a newline
    lines = _Lines(text)
    try:
        for rec in csv.reader(lines, strict=True):
            if rec:
                records.append(rec)
            lines.mark()
    except csv.Error as e:
        if not cut:  # an error at the very end of a cut file is the cut itself
            raise _not_a_table(path, f"it does not parse as CSV ({e}; e.g. a quote that is never closed)") from None
        # the torn tail (cut inside a quoted field), read leniently for its run id
        records.append(next(csv.reader(io.StringIO(text[lines.marked:], newline="")), []))
    header = [csv_value(h) for h in records[0]] if records else []
    if not set(REQUIRED) <= set(header):
        shown = ", ".join(short_repr(h, 24) for h in (header or [])[:6])  # cut short: maybe not a table at all
        raise _not_a_table(path, f"its header ({shown}) has no {' and '.join(REQUIRED)} columns")
    table = RunTable(header=header)
    body = records[1:]
    for i, rec in enumerate(body):
        last = i == len(body) - 1
        if len(rec) != len(header) or (last and cut):
            table.torn.append(rec)
        else:
            table.rows.append(dict(zip(header, map(csv_value, rec))))
    return table


def read_runs(path, *, warn: Callable[[str], None] | None = None) -> pd.DataFrame:
    """runs.csv (a path, read strictly, without torn rows, its cells read back as written; or an open
    CSV text buffer of rows as they are, not written by ``write_csv``) with the schema's dtypes
    applied (see ``runs_frame``)."""
    if isinstance(path, (str, Path)):
        table = read_run_table(Path(path))
        df = pd.DataFrame(table.rows, columns=table.header, dtype=object).astype(str)
        source = str(path)
    else:
        df = pd.read_csv(path, dtype=str, keep_default_na=False)
        source = "the results"
    return runs_frame(df, source=source, warn=warn or _stderr_warning)


def read_steps(run_dir: Path) -> pd.DataFrame | None:
    """A run's ``steps.csv`` (schema dtypes), or None when the run wrote none. A file larger than
    STEPS_MAX_BYTES, or one that does not parse as CSV, raises ResultsError naming it."""
    path = Path(run_dir) / STEPS_CSV
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ResultsError(f"cannot read {path} ({e.strerror or e})") from None
    if size > STEPS_MAX_BYTES:
        raise ResultsError(f"{path} is {size / 2**20:.0f} MiB, more than the {STEPS_MAX_BYTES / 2**20:.0f} MiB "
                           "a steps table of lora-bench reaches; not read")
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path} is not a lora-bench steps table ({str(e).splitlines()[0][:200]})") from None
    return runs_frame(df)




@contextlib.contextmanager
def locked(path: Path):
    """An exclusive advisory lock beside ``path`` (``<name>.lock``), so processes sharing a results
    folder (sweep shards on several GPUs) read-modify-write ``runs.csv`` one at a time. The lock
    file is removed when the lock is let go, so a folder at rest holds none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + LOCK_SUFFIX)
    while True:
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


def _set_aside_torn(path: Path, table: RunTable) -> None:
    """Append torn rows, as they are, to ``runs-torn.csv`` beside ``runs.csv`` (nothing is lost)."""
    if not table.torn:
        return
    dest = path.with_name(TORN_CSV)
    new = not dest.exists()
    with open(dest, "a", newline="") as f:
        out = csv.writer(f)
        if new:
            out.writerow(table.header)
        out.writerows(table.torn)


def upsert_run(path: Path, row: dict) -> None:
    """Add (or replace, by run_id, in its place) one row of runs.csv, rewriting the file atomically
    so an interruption leaves either the old or the new table, never a torn row; under a lock, so
    concurrent writers lose no row. Rows stay in the order the runs began. A torn row found on the
    way is replaced by its run.json's row, or set aside in ``runs-torn.csv`` when the run has none."""
    path = Path(path)
    new_row = {k: _fmt(v) for k, v in row.items()}
    with locked(path):
        rows = []
        if path.exists():
            table = read_run_table(path)
            rows = [new_row if r.get("run_id") == row["run_id"] else _settled(path.parent, r) for r in table.rows]
            have = {r["run_id"] for r in rows} | {row["run_id"]}
            for run_id in table.torn_ids():
                record = settle_run(path.parent / run_id) if _is_run_folder_name(run_id) else None
                if record is not None and record["run_id"] not in have:
                    rows.append({k: _fmt(v) for k, v in record.items()})
            _set_aside_torn(path, table)
        if not any(r is new_row for r in rows):
            rows.append(new_row)
        write_csv(path, rows, run_column_names())


def _settled(results_dir: Path, row: dict) -> dict:
    """A row of runs.csv still ``running``, brought in line with its run's record: the run
    finished (its process stopped between run.json and runs.csv) or its process died."""
    if row.get("status") != RUNNING or not _is_run_folder_name(row.get("run_id")):
        return row
    record = settle_run(Path(results_dir) / row["run_id"])
    if record is None or record.get("status") == RUNNING:
        return row
    return {k: _fmt(v) for k, v in record.items()}


def _is_run_folder_name(run_id) -> bool:
    return isinstance(run_id, str) and run_id not in ("", ".", "..") and "/" not in run_id and "\0" not in run_id


def remove_runs(path: Path, run_ids: Iterable[str]) -> int:
    """Drop the rows of ``run_ids`` from runs.csv (atomically, under the lock); torn rows are set
    aside in ``runs-torn.csv``. Returns how many rows went."""
    path = Path(path)
    ids = set(run_ids)
    with locked(path):
        if not path.is_file():
            return 0
        table = read_run_table(path)
        keep = [r for r in table.rows if r.get("run_id") not in ids]
        _set_aside_torn(path, table)
        write_csv(path, keep, run_column_names())
        return len(table.rows) - len(keep)


def _fmt(v):
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return "" if v is None else v


def _stderr_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def result_rows(results_dir: Path, *, warn: Callable[[str], None] | None = _stderr_warning) -> list[dict]:
    """Rows (as text, like runs.csv) of one results folder: runs.csv, plus any ``<run_id>/run.json``
    it lacks. run.json is a save's commit point (runs.csv may lag it by one write), so it wins. A row of runs.csv
    cut mid-way counts only through its run.json; without one it is left out, with a warning."""
    rows: dict[str, dict] = {}
    csv_path = Path(results_dir) / RUNS_CSV
    table = read_run_table(csv_path) if csv_path.is_file() else RunTable()
    for r in table.rows:
        if r.get("status") == RUNNING and _is_run_folder_name(r["run_id"]) and not is_claimed(
                Path(results_dir) / r["run_id"]):
            r = {**r, "status": "interrupted", "error": DIED}  # no process executes it (its run.json may say more)
        rows[r["run_id"]] = r
    for path in sorted(Path(results_dir).glob(f"*/{RUN_RECORD}")):
        row = run_record(path.parent)
        if row is not None:  # a half-copied or foreign file is not a result
            rows[row["run_id"]] = {k: text_value(v) for k, v in row.items()}
    for run_id in table.torn_ids():
        if run_id not in rows and warn is not None:
            warn(f"{csv_path}: the row of run {run_id or '?'} is cut mid-way and the run has no "
                 f"{RUN_RECORD}; it is left out")
    return list(rows.values())


def torn_run_ids(results_dir: Path) -> list[str]:
    """Run ids whose runs.csv row is cut mid-way."""
    csv_path = Path(results_dir) / RUNS_CSV
    return read_run_table(csv_path).torn_ids() if csv_path.is_file() else []


def find_run(results_dir: Path, run_id: str | None = None) -> dict:
    """One run's row (schema dtypes) for display: ``run_id``'s, or the latest started one. Its
    run.json wins over runs.csv; a row cut mid-way without a run.json is refused, by name."""
    results_dir = Path(results_dir)
    csv_path = results_dir / RUNS_CSV
    if not csv_path.is_file() and not any(results_dir.glob(f"*/{RUN_RECORD}")):
        raise UsageError(f"no runs.csv in {results_dir}: run `lora-bench train --results-dir {results_dir}` first")
    rows = result_rows(results_dir, warn=None)
    torn = torn_run_ids(results_dir)
    if run_id is None:
        if not rows:
            raise UsageError(f"{results_dir} holds no complete run")
        pick = latest_result(rows)
    else:
        hits = [r for r in rows if r["run_id"] == run_id]
        if not hits:
            if run_id in torn:
                raise UsageError(f"run_id {run_id!r}: its row in {csv_path} is cut mid-way and the run has no "
                                 f"{RUN_RECORD}; its numbers cannot be trusted, so nothing is shown")
            copy_of = copied_record(results_dir / run_id)
            if copy_of is not None:
                raise UsageError(f"{results_dir / run_id / RUN_RECORD} records run {copy_of!r}: the folder is a copy "
                                 f"of another run's, and a run's record is read only from the folder named by its "
                                 f"run id ({results_dir / copy_of})")
            latest = ", ".join(r["run_id"] for r in sorted(rows, key=lambda r: r.get("started_at") or "")[-5:])
            raise UsageError(f"run_id {run_id!r} not found in {results_dir}; latest runs: {latest or 'none'}")
        pick = hits[0]
    return runs_frame(pd.DataFrame([pick], dtype=object).astype(str), source=str(results_dir),
                      warn=_stderr_warning).iloc[0].to_dict()


def latest_result(rows: list[dict]) -> dict:
    """The run to show when none is named: the latest finished one (a newer run that failed
    before it measured anything, an offline start without weights, is no result), else the
    latest started."""
    order = _start_order(rows)
    done = [r for r in rows if r.get("status") == "done"]
    return max(done or rows, key=lambda r: order[r["run_id"]])


def _start_order(rows: list[dict]) -> dict[str, tuple[str, int]]:
    """Each run's place in start order: its start time (to the second), then its place in
    runs.csv, where a run's row is written when it begins, so that two runs begun within one
    second keep their order."""
    return {r["run_id"]: (str(r.get("started_at") or ""), i) for i, r in enumerate(rows)}


def unfinished_since(results_dir: Path, row: dict) -> list[dict]:
    """The rows of runs started after ``row`` that did not finish (failed, interrupted, ...)."""
    rows = result_rows(results_dir, warn=None)
    order = _start_order(rows)
    after = order.get(row["run_id"], (str(row.get("started_at") or ""), -1))
    return sorted((r for r in rows if r.get("status") != "done" and order[r["run_id"]] > after),
                  key=lambda r: order[r["run_id"]])


def check_results_dir(results_dir: Path) -> None:
    """Before any work: the results folder takes new files and its runs.csv (if any) parses, so
    that a finished run is never lost at the end for want of a place to record it."""
    results_dir = Path(results_dir)
    why = check_writable_dir(results_dir)
    if why:
        raise UsageError(f"results folder {results_dir}: {why}")
    for name in (RUNS_CSV, "manifest.json"):
        if (results_dir / name).exists() and not (results_dir / name).is_file():
            raise UsageError(f"{results_dir / name} is not a file (a folder where lora-bench keeps its {name}, "
                             "perhaps a run named so by an older version); move it aside and run again")
    if (results_dir / RUNS_CSV).is_file():
        read_run_table(results_dir / RUNS_CSV)


def text_value(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)
