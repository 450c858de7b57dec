"""``runs.csv`` and ``steps.csv`` as text: the one writer of lora-bench's result tables
(``write_csv``: every text cell escaped and quoted, atomically) and their strict readers.

``read_run_table`` refuses a file that is not lora-bench's runs.csv (binary, empty, a quote never
closed, another program's CSV without ``run_id``) with one ResultsError naming it, and keeps a row
cut mid-way (a copy or a disk cut the file short; the writer never does) apart from the rows, so
that it is never read as a result. Which rows the folder's runs.csv holds is
lora_bench.results.store's business."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd

from lora_bench.errors import ResultsError
from lora_bench.escaping import csv_cell, csv_value
from lora_bench.fileio import TooLarge, atomic_write_text, read_capped
from lora_bench.results.guarded_read import read_results_file, results_file_problem
from lora_bench.results.cells import runs_frame
from lora_bench.results.folder_files import RUNS_CSV  # noqa: F401
from lora_bench.results.records import RUN_RECORD, STEPS_CSV
from lora_bench.safe_yaml import short_repr

STEPS_MAX_BYTES = 512 * 2**20  # a million steps of every column is about 200 MiB
REQUIRED = ("run_id", "status")
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
        at = self.header.index("run_id")
        return [t[at] if len(t) > at else "" for t in self.torn]


def _not_a_table(path: Path, why: str) -> ResultsError:
    return ResultsError(f"{path} is not a lora-bench runs.csv: {why}. Move it aside and run again "
                        f"(every run's record is also kept in <results folder>/<run_id>/{RUN_RECORD})")


def read_run_table(path: Path) -> RunTable:
    """Parse ``runs.csv`` strictly (see the module's docstring); raises ResultsError."""
    path = Path(path)
    if why := results_file_problem(path, root=path.parent):
        raise ResultsError(f"{path} {why}; not read")
    try:
        data = read_capped(path, MAX_TABLE_BYTES)
        text = data.decode("utf-8") if b"\0" not in data else None
    except TooLarge as e:
        raise _not_a_table(path, f"it has {e.size:,} bytes, more than the {MAX_TABLE_BYTES:,} a runs.csv may have") \
            from None
    except OSError as e:
        raise ResultsError(f"cannot read {path} ({e.strerror or e})") from None
    except UnicodeDecodeError:
        text = None
    if text is None or not text.strip():
        raise _not_a_table(path, "it holds binary data, not text" if text is None else "it is empty")
    cut = not text.endswith("\n")  # every row the writer writes ends with a newline
    try:  # a cut file is read leniently: its last record, maybe cut inside quotes, is torn anyway
        records = [r for r in csv.reader(io.StringIO(text, newline=""), strict=not cut) if r]
    except csv.Error as e:
        raise _not_a_table(path, f"it does not parse as CSV ({e}; e.g. a quote that is never closed)") from None
    header = [csv_value(h) for h in records[0]] if records else []
    if not set(REQUIRED) <= set(header):
        shown = ", ".join(short_repr(h, 24) for h in header[:6])  # cut short: maybe not a table at all
        raise _not_a_table(path, f"its header ({shown}) has no {' and '.join(REQUIRED)} columns")
    table = RunTable(header=header)
    for i, rec in enumerate(records[1:], start=2):
        if len(rec) != len(header) or (cut and i == len(records)):
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
    return runs_frame(df, source=source, warn=warn or stderr_warning)


def read_steps(run_dir: Path) -> pd.DataFrame | None:
    """A run's ``steps.csv`` (schema dtypes), or None when the run wrote none. A file that is not a
    results file to read (``guarded_read``: a pipe, a folder, a link out of the results folder,
    more than STEPS_MAX_BYTES) or that does not parse as CSV raises ResultsError naming it."""
    path = Path(run_dir) / STEPS_CSV
    data = read_results_file(path, limit=STEPS_MAX_BYTES, root=Path(run_dir).parent)
    if data is None:
        return None
    try:
        df = pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path} is not a lora-bench steps table ({str(e).splitlines()[0][:200]})") from None
    return runs_frame(df)


def text_value(v) -> str:
    """A recorded value as a cell of runs.csv holds it (None and NaN blank, lists and dicts as JSON)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def same_number(a: str, b: str) -> bool:
    """Two cells that read as the same number (``16`` and ``16.0``, ``1e-4`` and ``0.0001``)."""
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def stderr_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)
