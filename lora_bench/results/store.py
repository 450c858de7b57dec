"""Reading and writing the results tables: ``runs.csv`` (one row per run, read-modify-written under
a lock) and the per-step CSVs, each written atomically."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
from pathlib import Path
from typing import Iterable

import pandas as pd

from lora_bench.fileio import atomic_write_text
from lora_bench.results.schema import column_index, run_column_names


def write_csv(path: Path, rows: Iterable[dict], columns: list[str]) -> None:
    df = pd.DataFrame(list(rows))
    extra = [c for c in df.columns if c not in columns]
    df = df.reindex(columns=columns + extra)
    atomic_write_text(path, df.to_csv(index=False))


def read_runs(path: Path) -> pd.DataFrame:
    """runs.csv with the schema's dtypes applied."""
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    for name, col in column_index().items():
        if name in df.columns:
            df[name] = _convert(df[name], col.dtype)
    return df


def _convert(s: pd.Series, dtype: str) -> pd.Series:
    if dtype == "float64":
        return pd.to_numeric(s.replace("", None), errors="coerce").astype("float64")
    if dtype == "Int64":
        return pd.to_numeric(s.replace("", None), errors="coerce").astype("Int64")
    if dtype == "boolean":
        return s.map({"True": True, "False": False, "true": True, "false": False}).astype("boolean")
    return s


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive advisory lock beside ``path`` (``<name>.lock``), so processes sharing a results
    folder (sweep shards on several GPUs) read-modify-write ``runs.csv`` one at a time."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def upsert_run(path: Path, row: dict) -> None:
    """Add (or replace, by run_id) one row of runs.csv, rewriting the file atomically so an
    interruption leaves either the old or the new table, never a torn row; under a lock, so
    concurrent writers lose no row."""
    path = Path(path)
    with locked(path):
        rows = []
        if path.exists():
            old = pd.read_csv(path, dtype=str, keep_default_na=False)
            rows = [r for r in old.to_dict("records") if r.get("run_id") != row["run_id"]]
        rows.append({k: _fmt(v) for k, v in row.items()})
        write_csv(path, rows, run_column_names())


def _fmt(v):
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return "" if v is None else v


def result_rows(results_dir: Path) -> list[dict]:
    """Rows (as text, like runs.csv) of one results folder: runs.csv, plus any ``<run_id>/run.json``
    it lacks. run.json is written before runs.csv, so it is never older and wins."""
    rows: dict[str, dict] = {}
    csv = Path(results_dir) / "runs.csv"
    if csv.is_file():
        for r in pd.read_csv(csv, dtype=str, keep_default_na=False).to_dict("records"):
            rows[r["run_id"]] = r
    for path in sorted(Path(results_dir).glob("*/run.json")):
        try:
            row = json.loads(path.read_text())["row"]
        except (OSError, ValueError, KeyError):
            continue  # a half-copied or foreign file is not a result
        rows[row["run_id"]] = {k: text_value(v) for k, v in row.items()}
    return list(rows.values())


def text_value(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)
