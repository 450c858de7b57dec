"""Superseded sweep runs: when a sweep ran the same settings and repeat more than once (a rerun
under another run id), the newest finished row is the result and the older ones are superseded.
``prune_superseded`` moves them, numbers untouched, to ``superseded/`` inside the folder:
their rows to ``superseded/runs.csv`` with a ``superseded_by`` column naming the row that replaced
each, their run folders beside it. ``runs.csv`` then holds one row per (sweep, settings, repeat)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from lora_bench.config import TrainConfig
from lora_bench.config.recorded import as_recorded
from lora_bench.errors import ResultsError
from lora_bench.results.guarded_read import results_file_problem
from lora_bench.results.schema import SETTING_PREFIX, run_column_names
from lora_bench.results.store import locked, read_run_table, text_value, write_csv, write_index

SUPERSEDED = "superseded"
# Settings that name paths or the device: they may differ between machines for the same run.
NOT_COMPARED = ("data_file", "weights_dir", "device")


def settings_key(row: dict) -> tuple:
    """A row's settings as comparable text, each as it compares (``config.recorded.as_recorded``: a
    ``cfg_`` column the row lacks or leaves empty, a setting added after the row was written, holds
    the default the row ran); numbers compare by value."""
    out = []
    for name in TrainConfig.field_names():
        if name in NOT_COMPARED:
            continue
        value = text_value(as_recorded(name, row.get(SETTING_PREFIX + name), lambda k: row.get(SETTING_PREFIX + k)))
        try:
            value = repr(float(value))
        except ValueError:
            pass
        out.append((name, value))
    return tuple(out)


@dataclass(frozen=True)
class Superseded:
    run_id: str
    superseded_by: str


def find_superseded(rows: list[dict]) -> list[Superseded]:
    """Finished sweep rows replaced by a newer finished row of the same sweep, repeat and settings
    (newest by ``started_at``). Rows outside a sweep, and unfinished rows, are left alone."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get("status") != "done" or not row.get("sweep_name"):
            continue
        key = (row["sweep_name"], str(row.get("repeat", "")), settings_key(row))
        groups.setdefault(key, []).append(row)
    out = []
    for group in groups.values():
        group.sort(key=lambda r: (str(r.get("started_at", "")), r["run_id"]))
        newest = group[-1]["run_id"]
        out += [Superseded(r["run_id"], newest) for r in group[:-1]]
    return sorted(out, key=lambda s: s.run_id)


def prune_superseded(results_dir: Path, *, dry_run: bool = False) -> list[Superseded]:
    """Move the superseded rows of ``results_dir/runs.csv`` and their run folders into
    ``results_dir/superseded/``; returns what was (or, with ``dry_run``, would be) moved."""
    results_dir = Path(results_dir)
    csv = results_dir / "runs.csv"
    if why := results_file_problem(csv, root=results_dir):
        raise ResultsError(f"{csv} {why}; nothing was moved")
    if not csv.is_file():
        return []
    if dry_run:  # writes nothing, not even the lock file: a read-only folder can be looked at
        return find_superseded(_rows(csv))
    with locked(csv):
        rows = _rows(csv)
        found = find_superseded(rows)
        if dry_run or not found:
            return found
        by = {s.run_id: s.superseded_by for s in found}
        moved = [{**r, "superseded_by": by[r["run_id"]]} for r in rows if r["run_id"] in by]
        dest = results_dir / SUPERSEDED
        old = dest / "runs.csv"
        if old.is_file():
            earlier = _rows(old)
            moved = [r for r in earlier if r["run_id"] not in by] + moved
        write_csv(old, moved, run_column_names() + ["superseded_by"])
        for s in found:
            if (results_dir / s.run_id).is_dir():
                shutil.move(str(results_dir / s.run_id), str(dest / s.run_id))
        write_index(results_dir, drop=by)
    return found


def _rows(csv: Path) -> list[dict]:
    """The rows of a table ``write_csv`` wrote, as text, each cell read back as it was given (read
    strictly, as runs.csv is: a row cut mid-way is no row)."""
    return read_run_table(csv).rows
