"""Export a results folder's runs to a tracker: ``export_folder`` for ``lora-bench results export``;
for ``--logger`` on ``train`` and ``sweep``, ``check_logger`` before the run, then ``log_run`` for
the run just saved or ``log_folder`` for a sweep's folder. Each says what it did per run (written,
replaced, or unchanged since the last export)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lora_bench.errors import UsageError
from lora_bench.fileio import refusing
from lora_bench.trackers import mlflow_store, tensorboard_files
from lora_bench.trackers.exported_run import run_exports

TRACKERS = ("mlflow", "tensorboard")


def check_tracker(to: str, *, option: str = "--to") -> str:
    if to not in TRACKERS:
        raise UsageError(f"{option} {to!r} is not a tracker lora-bench writes; choose one of: {', '.join(TRACKERS)}")
    return to


def _require(to: str, *, folder: Path, tracking_uri: str | None) -> None:
    if to == "mlflow":
        mlflow_store.modules(tracking_uri or mlflow_store.default_uri(folder))
    else:
        tensorboard_files.modules()


def check_logger(to: str, results_dir: Path) -> None:
    """``--logger``: its value a tracker and the tracker's extra installed, checked before a run starts."""
    check_tracker(to, option="--logger")
    _require(to, folder=Path(results_dir), tracking_uri=None)


def export_folder(folder: Path, *, to: str, tracking_uri: str | None = None, output: Path | None = None,
                  experiment: str | None = None, run_ids: list[str] | None = None) -> list[tuple[str, str]]:
    """Write every run of ``folder`` (or those of ``run_ids``) to the tracker ``to``; returns
    (run id, what happened) per run. A folder without runs is a UsageError."""
    check_tracker(to)
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"{folder}: no such results folder")
    if to != "mlflow" and (tracking_uri is not None or experiment is not None):
        raise UsageError("--tracking-uri and --experiment apply to --to mlflow")
    if to != "tensorboard" and output is not None:
        raise UsageError("--output applies to --to tensorboard (MLflow writes to --tracking-uri)")
    _require(to, folder=folder, tracking_uri=tracking_uri)  # a missing extra answers before anything is read
    runs = run_exports(folder, run_ids)
    if not runs:
        raise UsageError(f"{folder} holds no runs (no rows in runs.csv, no <run_id>/run.json): nothing to export")
    if to == "mlflow":
        return mlflow_store.export_mlflow(folder, runs, tracking_uri=tracking_uri, experiment=experiment)
    where = output if output is not None else folder / tensorboard_files.OUTPUT
    with refusing(where):  # a read-only or full folder: one message naming it
        return tensorboard_files.export_tensorboard(runs, output=where)


def log_folder(results_dir: Path, *, to: str, say: Callable[[str], None] = print) -> None:
    """``--logger`` on a sweep: export the folder's runs once the sweep ends (runs exported before
    and unchanged are skipped)."""
    for rid, what in export_folder(results_dir, to=to):
        say(f"{to}: {rid} {what}")


def log_run(results_dir: Path, run_id: str, *, to: str, say: Callable[[str], None] = print) -> None:
    """``--logger``: export one saved run of ``results_dir`` to the tracker ``to``, in its default
    store (MLflow: ``results_dir/mlflow``; TensorBoard: ``results_dir/tensorboard``)."""
    for rid, what in export_folder(results_dir, to=to, run_ids=[run_id]):
        say(f"{to}: {rid} {what}")
