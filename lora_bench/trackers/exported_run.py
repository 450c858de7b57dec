"""One run's record as a tracker takes it, from ``runs.csv``'s row (its run.json winning), its
``steps.csv`` and its run.json's curves:

- parameters: every setting (the ``cfg_*`` columns, named without the prefix), as recorded;
- metrics: ``step/<column>`` per training step (loss, device and host phase times, tokens, ...),
  ``eval/train_loss`` and ``eval/val_loss`` at the periodic evaluations' steps, ``eval/train_acc``
  and ``eval/val_acc`` (%) at each epoch's last step, and ``run/<column>``, every number of the
  row (final accuracies, phase medians, throughput, ...), at the run's last step;
- tags: ``lora_bench.<column>`` for every text column of the row (status, environment, git commit,
  sweep), the command that wrote the run (from manifest.json) and the results folder.

``digest`` changes whenever the record or this mapping does: a tracker holding a run of the same
digest holds this export."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lora_bench.errors import ResultsError
from lora_bench.results.guarded_read import read_results_file, read_results_json
from lora_bench.results.manifest import read_manifest
from lora_bench.results.records import MAX_RECORD_BYTES, RUN_RECORD, STEPS_CSV
from lora_bench.results.schema import ENV_COLUMNS, RUN_COLUMNS, SETTING_PREFIX, STEP_COLUMNS
from lora_bench.results.store import read_steps, result_rows

MAPPING = "lora-bench tracker mapping 1"  # part of every digest: a changed mapping exports again
TAG_PREFIX = "lora_bench."
RUN_ID_TAG = TAG_PREFIX + "run_id"
DIGEST_TAG = TAG_PREFIX + "record_sha256"
MAX_TEXT = 5000  # characters of a tag or parameter value (MLflow keeps up to 6000 / 8000)
NUMBERS = ("float64", "Int64")
STEP_METRICS = [c.name for c in STEP_COLUMNS if c.dtype in NUMBERS and c.name not in ("step", "epoch")]
RUN_METRICS = [c.name for c in RUN_COLUMNS if c.dtype in NUMBERS]
TEXT_COLUMNS = [c.name for c in RUN_COLUMNS + ENV_COLUMNS if c.dtype == "string"]
CURVES = {"train_losses": "eval/train_loss", "val_losses": "eval/val_loss"}
EPOCH_CURVES = {"train_accs": "eval/train_acc", "val_accs": "eval/val_acc"}  # fractions, logged in %


@dataclass(frozen=True)
class Metric:
    name: str
    step: int
    value: float


@dataclass(frozen=True)
class RunExport:
    run_id: str
    status: str
    params: dict[str, str]
    tags: dict[str, str]
    metrics: list[Metric]
    record: Path | None  # the run's run.json, where it has one
    digest: str
    start_ms: int | None
    end_ms: int | None


def clipped(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


def _number(text) -> float | None:
    try:
        return float(text) if text is not None and str(text).strip() else None
    except (TypeError, ValueError):
        return None


def _record(run_dir: Path) -> dict:
    """run.json as a whole (row, log, curves), or {} where it cannot be read as a record."""
    try:
        record = read_results_json(run_dir / RUN_RECORD, limit=MAX_RECORD_BYTES, root=run_dir.parent)
    except ResultsError:
        return {}
    return record if isinstance(record, dict) else {}


def _bytes(path: Path) -> bytes:
    try:
        return read_results_file(path, limit=MAX_RECORD_BYTES * 8, root=path.parent.parent) or b""
    except ResultsError:
        return b""


def _ms(started_at: str) -> int | None:
    try:
        when = dt.datetime.fromisoformat(started_at)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1000)


def commands(folder: Path) -> dict[str, str]:
    """Each run id's command line, from manifest.json (the last invocation that names the run)."""
    out = {}
    for entry in read_manifest(folder)["invocations"]:
        for run_id in entry.get("run_ids") or ():
            out[run_id] = entry.get("command") or ""
    return out


def _metrics(row: dict, record: dict, run_dir: Path) -> list[Metric]:
    out: list[Metric] = []
    steps = read_steps(run_dir) if (run_dir / STEPS_CSV).is_file() else None
    epoch_end: dict[int, int] = {}
    if steps is not None and len(steps):
        at = [int(s) for s in steps["step"]]
        for name in STEP_METRICS:
            if name in steps:
                out += [Metric(f"step/{name}", s, float(v)) for s, v in zip(at, steps[name]) if not pd.isna(v)]
        if "epoch" in steps:
            for s, e in zip(at, steps["epoch"]):
                if not pd.isna(e):
                    epoch_end[int(e)] = max(epoch_end.get(int(e), s), s)
    every = int(_number(row.get(SETTING_PREFIX + "eval_freq")) or 1)
    for key, name in CURVES.items():
        values = record.get(key)
        if isinstance(values, list):
            out += [Metric(name, i * every, float(v)) for i, v in enumerate(values) if _number(v) is not None]
    for key, name in EPOCH_CURVES.items():
        values = record.get(key)
        if isinstance(values, list):  # an epoch's accuracies at its last step (its number without steps.csv)
            out += [Metric(name, epoch_end.get(e, e), 100 * float(v))
                    for e, v in enumerate(values, start=1) if _number(v) is not None]
    n_steps = _number(row.get("steps"))
    last = max(int(n_steps) - 1, 0) if n_steps is not None else 0
    out += [Metric(f"run/{name}", last, _number(row.get(name))) for name in RUN_METRICS
            if _number(row.get(name)) is not None]
    return out


def run_export(folder: Path, row: dict, *, command: str = "") -> RunExport:
    """The export of one run (``row``: its text row, as ``result_rows`` gives it)."""
    run_id = row["run_id"]
    run_dir = folder / run_id
    record = _record(run_dir)
    params = {k[len(SETTING_PREFIX):]: clipped(str(v)) for k, v in row.items() if k.startswith(SETTING_PREFIX)}
    tags = {TAG_PREFIX + k: clipped(str(row[k])) for k in TEXT_COLUMNS if str(row.get(k) or "")}
    tags[RUN_ID_TAG] = run_id
    tags[TAG_PREFIX + "results_dir"] = clipped(str(folder.resolve()))
    if command:
        tags[TAG_PREFIX + "command"] = clipped(command)
    digest = hashlib.sha256(b"\0".join([MAPPING.encode(), json.dumps(row, sort_keys=True).encode(),
                                        command.encode(), _bytes(run_dir / RUN_RECORD),
                                        _bytes(run_dir / STEPS_CSV)])).hexdigest()
    tags[DIGEST_TAG] = digest
    start = _ms(str(row.get("started_at") or ""))
    took = _number(row.get("training_time_s"))
    return RunExport(run_id=run_id, status=str(row.get("status") or ""), params=params, tags=tags,
                     metrics=_metrics(row, record, run_dir),
                     record=run_dir / RUN_RECORD if record else None, digest=digest, start_ms=start,
                     end_ms=start + int(took * 1000) if start is not None and took is not None else None)


def run_exports(folder: Path, run_ids: list[str] | None = None) -> list[RunExport]:
    """Every run of the results folder (or those of ``run_ids``), in the order they began."""
    folder = Path(folder)
    rows = result_rows(folder)
    if run_ids is not None:
        rows = [r for r in rows if r["run_id"] in run_ids]
    lines = commands(folder)
    return [run_export(folder, r, command=lines.get(r["run_id"], "")) for r in rows]
