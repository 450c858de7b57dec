"""Runs written to MLflow: one experiment per results folder, one MLflow run per lora-bench run,
found again by its ``lora_bench.run_id`` tag. A run already there with the same record digest is
skipped; one with another digest (the run was recorded again) is deleted and written anew, so an
export never holds a run twice.

Without ``tracking_uri`` the store is a SQLite file inside the results folder
(``FOLDER/mlflow/mlflow.db``, artifacts beside it in ``FOLDER/mlflow/artifacts``); no server is
needed. The experiment is named after the folder there, and by its absolute path in a store given
by URI (where folders of one name from several machines meet)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from lora_bench.errors import UsageError
from lora_bench.optional import require
from lora_bench.trackers.exported_run import DIGEST_TAG, RUN_ID_TAG, RunExport

EXTRA = "trackers"
STORE = "mlflow"  # FOLDER/mlflow: the default store
STATUS = {"done": "FINISHED", "diverged": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
PARAMS_PER_BATCH, METRICS_PER_BATCH = 100, 1000  # MLflow's limits on one log_batch


def default_uri(folder: Path) -> str:
    return f"sqlite:///{(Path(folder) / STORE / 'mlflow.db').resolve()}"


def experiment_name(folder: Path, *, tracking_uri: str | None) -> str:
    folder = Path(folder).resolve()
    return folder.name if tracking_uri is None else folder.as_posix()


@contextlib.contextmanager
def _quiet():
    """MLflow's and its database migrations' notes held at warnings while an export runs."""
    loggers = [logging.getLogger(n) for n in ("mlflow", "alembic")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def modules(uri: str):
    """MLflow's client, entities and exceptions (and what a SQLite store needs), or the UsageError
    naming the extra that installs them."""
    need = ["mlflow", "mlflow.tracking", "mlflow.entities", "mlflow.exceptions"]
    if uri.startswith("sqlite:"):  # MLflow's database stores, which mlflow-skinny leaves to these two
        need += ["sqlalchemy", "alembic"]
    loaded = [require(m, purpose="lora-bench's export to MLflow", extra=EXTRA) for m in need]
    return loaded[1:4]


def _existing(client, experiment_id: str) -> dict[str, list]:
    """The experiment's live runs by their lora-bench run id."""
    out: dict[str, list] = {}
    token = None
    while True:
        page = client.search_runs([experiment_id], max_results=1000, page_token=token)
        for run in page:
            rid = run.data.tags.get(RUN_ID_TAG)
            if rid is not None:
                out.setdefault(rid, []).append(run)
        token = page.token
        if not token:
            return out


def _write(client, entities, *, experiment_id: str, run: RunExport) -> str:
    created = client.create_run(experiment_id, start_time=run.start_ms, tags=run.tags, run_name=run.run_id)
    mid = created.info.run_id
    try:
        params = [entities.Param(k, v) for k, v in run.params.items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            client.log_batch(mid, params=params[i:i + PARAMS_PER_BATCH])
        stamp = run.start_ms or 0
        metrics = [entities.Metric(m.name, m.value, stamp, m.step) for m in run.metrics]
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            client.log_batch(mid, metrics=metrics[i:i + METRICS_PER_BATCH])
        if run.record is not None:
            client.log_artifact(mid, str(run.record))
        if run.status in STATUS:
            client.set_terminated(mid, status=STATUS[run.status], end_time=run.end_ms)
    except BaseException:
        client.delete_run(mid)  # no half-written run stays behind
        raise
    return mid


def export_mlflow(folder: Path, runs: list[RunExport], *, tracking_uri: str | None = None,
                  experiment: str | None = None) -> list[tuple[str, str]]:
    """Write ``runs`` to MLflow; returns (run id, 'written', 'replaced' or 'unchanged') per run."""
    uri = tracking_uri or default_uri(folder)
    tracking, entities, exceptions = modules(uri)
    name = experiment or experiment_name(folder, tracking_uri=tracking_uri)
    done = []
    try:
        with _quiet():
            if tracking_uri is None:
                (Path(folder) / STORE).mkdir(exist_ok=True)
            client = tracking.MlflowClient(tracking_uri=uri)
            found = client.get_experiment_by_name(name)
            if found is None:
                artifacts = (Path(folder) / STORE / "artifacts").resolve().as_uri() if tracking_uri is None else None
                experiment_id = client.create_experiment(name, artifact_location=artifacts)
            else:
                experiment_id = found.experiment_id
            existing = _existing(client, experiment_id)
            for run in runs:
                there = existing.get(run.run_id, [])
                keep = next((r for r in there if r.data.tags.get(DIGEST_TAG) == run.digest), None)
                for r in there:
                    if r is not keep:
                        client.delete_run(r.info.run_id)
                action = "unchanged" if keep is not None else "replaced" if there else "written"
                if action != "unchanged":
                    _write(client, entities, experiment_id=experiment_id, run=run)
                done.append((run.run_id, action))
    except exceptions.MlflowException as e:
        message = " ".join(str(e.message if hasattr(e, "message") else e).split())
        raise UsageError(f"MLflow at {uri}: {message[:400]}") from None
    return done
