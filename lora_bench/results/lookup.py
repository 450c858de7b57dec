"""Finding a run in a results folder for display: one run by id (or the latest started), and the
runs started after it that did not finish. Each run's run.json wins over its runs.csv row
(lora_bench.results.store reads them)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from lora_bench.errors import UsageError
from lora_bench.escaping import SHOWN_CHARS, clip
from lora_bench.results.cells import runs_frame
from lora_bench.results.folder_files import RUNS_CSV
from lora_bench.results.records import RUN_RECORD, copied_record
from lora_bench.results.runs_csv import read_run_table, stderr_warning
from lora_bench.results.store import is_run_folder_name, result_rows
from lora_bench.safe_yaml import short_repr


def find_run(results_dir: Path, run_id: str | None = None) -> dict:
    """One run's row (schema dtypes) for display: ``run_id``'s, or the latest started one. Its
    run.json wins over runs.csv; a row cut mid-way without a run.json is refused, by name. Text
    past ``escaping.SHOWN_CHARS`` (a run id, a setting) is cut as ``escaping.clip`` cuts it."""
    named = short_repr(run_id, SHOWN_CHARS)
    results_dir, csv_path = Path(results_dir), Path(results_dir) / RUNS_CSV
    if not csv_path.is_file() and not any(results_dir.glob(f"*/{RUN_RECORD}")):
        raise UsageError(f"no runs.csv in {results_dir}: run `lora-bench train --results-dir {results_dir}` first")
    rows = result_rows(results_dir, warn=None)
    hits = [r for r in rows if r["run_id"] == run_id] if run_id is not None else [latest_result(rows)] if rows else []
    if not hits and run_id is None:
        raise UsageError(f"{results_dir} holds no complete run")
    if not hits:
        if csv_path.is_file() and run_id in read_run_table(csv_path).torn_ids():
            raise UsageError(f"run_id {named}: its row in {csv_path} is cut mid-way and the run has no "
                             f"{RUN_RECORD}; its numbers cannot be trusted, so nothing is shown")
        copy_of = copied_record(results_dir / run_id) if is_run_folder_name(run_id) and len(run_id) < 256 else None
        if copy_of is not None:
            raise UsageError(f"{results_dir / run_id / RUN_RECORD} records run {copy_of!r}: the folder is a copy "
                             f"of another run's, and a run's record is read only from the folder named by its "
                             f"run id ({results_dir / copy_of})")
        latest = ", ".join(clip(r["run_id"], 80) for r in sorted(rows, key=lambda r: r.get("started_at") or "")[-5:])
        raise UsageError(f"run_id {named} not found in {results_dir}; latest runs: {latest or 'none'}")
    row = runs_frame(pd.DataFrame(hits[:1], dtype=object).astype(str), source=str(results_dir),
                     warn=stderr_warning).iloc[0].to_dict()
    return {k: clip(v) if isinstance(v, str) else v for k, v in row.items()}


def latest_result(rows: list[dict]) -> dict:
    """The run to show when none is named: the latest finished one (a newer run that failed before
    it measured anything, an offline start without weights, is no result), else the latest started."""
    order = _start_order(rows)
    done = [r for r in rows if r.get("status") == "done"]
    return max(done or rows, key=lambda r: order[r["run_id"]])


def _start_order(rows: list[dict]) -> dict[str, tuple[str, int]]:
    """Each run's place in start order: its start time (to the second), then its place in runs.csv,
    which indexes a run as it begins, so that two runs begun within one second keep their order."""
    return {r["run_id"]: (str(r.get("started_at") or ""), i) for i, r in enumerate(rows)}


def unfinished_since(results_dir: Path, row: dict) -> list[dict]:
    """The rows of runs started after ``row`` that did not finish (failed, interrupted, ...)."""
    rows = result_rows(results_dir, warn=None)
    order = _start_order(rows)
    after = order.get(row["run_id"], (str(row.get("started_at") or ""), -1))
    return sorted((r for r in rows if r.get("status") != "done" and order[r["run_id"]] > after),
                  key=lambda r: order[r["run_id"]])
