"""Running a sweep's planned runs on a Dask distributed cluster (a local one, one worker per GPU,
or ``--scheduler``'s): each task runs one planned run in a child process as process isolation
does; only this client writes the results folder, holding each run's claim until it is stored; a
dead worker's run is recorded failed, a task it held unstarted is submitted again; the first
signal stops the sweep and stores the interrupted rows. The whole: docs/sweeps.md#on-a-dask-cluster."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import dask
import torch
from distributed import Client, Nanny, Scheduler, SpecCluster, WorkerPlugin, get_worker, wait
from rich.console import Console

from lora_bench.config import TrainConfig
from lora_bench.errors import UsageError
from lora_bench.fileio import atomic_write_bytes
from lora_bench.results.claims import CLAIM_NAME, RunClaim, claim_run, claimant, try_claim
from lora_bench.results.manifest import record_invocation
from lora_bench.results.save import save_row
from lora_bench.results.store import rebuild_index
from lora_bench.sweep.isolation import GRACE_S, Interrupts, Job, base_row, run_job
from lora_bench.sweep.runner import (
    SweepResult,
    finished_elsewhere,
    planned_records,
    print_run,
    start_sweep,
    sweep_progress,
)
from lora_bench.sweep.spec import PlannedRun, Sweep, select_shard
from lora_bench.train.distributed import NO_MULTICAST_ENV

ALLOWED_FAILURES = 0  # a run whose worker died is recorded failed, not run again on another worker
REQUEUES = 2  # how often a task that a dying worker held before starting it is submitted again
STARTED = "lora-bench-started"  # scheduler event topic: {"key": task key} when a task begins its run
SETTLE_S = GRACE_S + 30  # after a stop, how long the client waits for running runs to report back

# -- worker side: these run inside Dask worker processes ------------------------------------------
_stopped: set[str] = set()  # sweep tokens stopped by their client
_running: dict[str, list[Interrupts]] = {}  # sweep token -> the interrupt handles of its running runs
_lock = threading.Lock()


def stop_sweep(token: str, signum: int) -> int:
    """Called on every worker by a stopping client: start no more runs of this sweep and pass the
    signal to the running ones (their tasks forward it to the child). Returns how many ran."""
    with _lock:
        _stopped.add(token)
        handles = list(_running.get(token, []))
    for h in handles:
        h.signum = h.signum or signum
    return len(handles)


def run_planned(spec: dict) -> dict:
    """The Dask task: one planned run, isolated in a child process, in a scratch results folder;
    returns its row and files for the client to store."""
    token = spec["token"]
    interrupts = Interrupts()
    with _lock:
        if token in _stopped:
            return {"not_started": True}
        _running.setdefault(token, []).append(interrupts)
    worker = get_worker()
    worker.log_event(STARTED, {"key": spec["key"]})
    os.environ.update(NO_MULTICAST_ENV)
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=worker.local_directory))
    t0 = time.monotonic()
    try:
        job = Job(cfg=TrainConfig.from_mapping(spec["config"]), run_id=spec["run_id"], results_dir=scratch,
                  extra=spec["extra"], cache_dir=Path(spec["cache_dir"]) if spec["cache_dir"] else None)
        with claim_run(job.run_dir) as claim:  # the scratch folder's: the child runs with it, as in a sweep
            row = run_job(job, isolation="process", interrupts=interrupts, claim=claim)
        files = {p.relative_to(job.run_dir).as_posix(): p.read_bytes()
                 for p in sorted(job.run_dir.rglob("*")) if p.is_file() and p.name != CLAIM_NAME}
        return {"row": row, "files": files, "seconds": time.monotonic() - t0, "worker": worker.address,
                "host": socket.gethostname(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}
    finally:
        with _lock:
            _running.get(token, []).remove(interrupts)
        shutil.rmtree(scratch, ignore_errors=True)


class _IgnoreSigint(WorkerPlugin):
    """Worker plugin of the local cluster: its processes share the client's terminal, whose Ctrl-C
    is the client's to handle (it stops the runs in order); a worker killed by it would turn
    interrupted runs into failed ones. Also applies to workers the nanny restarts."""

    name = "lora-bench-ignore-sigint"

    def setup(self, worker) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


# -- client side ---------------------------------------------------------------------------------
def local_workers(workers: int | None, gpus: int) -> list[dict[str, str]]:
    """The environment of each local worker: GPU i for worker i (round robin when there are more
    workers than GPUs), nothing pinned without GPUs."""
    n = workers if workers is not None else gpus
    if n < 1:
        raise UsageError(f"--workers {n}: use at least 1 worker")
    return [{**NO_MULTICAST_ENV, **({"CUDA_VISIBLE_DEVICES": str(i % gpus)} if gpus else {})} for i in range(n)]


def start_local_cluster(envs: list[dict[str, str]]):
    """A local cluster with one single-threaded worker process per entry of ``envs``; no memory
    limit (the runs' children are not the worker's memory), no dashboards."""
    worker_opts = dict(nthreads=1, memory_limit=0, dashboard=False, host="127.0.0.1", silence_logs=logging.ERROR)
    # saturation 1.0: a single-threaded worker is handed its next task only when it is free
    with dask.config.set({"distributed.scheduler.allowed-failures": ALLOWED_FAILURES,
                          "distributed.scheduler.worker-saturation": 1.0}):
        return SpecCluster(
            scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1", "port": 0, "dashboard": False,
                                                     "allowed_failures": ALLOWED_FAILURES}},
            workers={i: {"cls": Nanny, "options": {**worker_opts, "env": env, "name": f"w{i}"}}
                     for i, env in enumerate(envs)},
            silence_logs=logging.ERROR, name="lora-bench")


def connect(*, workers: int | None, scheduler: str | None, console):
    """(client, cluster or None): the scheduler named, or a new local cluster."""
    if scheduler is not None:
        try:
            client = Client(scheduler, timeout="20s")
        except OSError as e:
            raise UsageError(f"--scheduler {scheduler}: cannot connect ({e})") from None
        info = client.scheduler_info(n_workers=-1)["workers"]
        crowded = sorted(w.get("name", a) for a, w in info.items() if w.get("nthreads", 1) > 1)
        if crowded:
            console.print(f"[yellow]warning:[/yellow] worker(s) {', '.join(map(str, crowded))} run several tasks at "
                          "once: their runs would share a GPU (start workers with --nthreads 1)", highlight=False)
        return client, None
    cluster = start_local_cluster(local_workers(workers, torch.cuda.device_count()))
    client = Client(cluster)
    client.register_plugin(_IgnoreSigint())
    return client, cluster


def check_devices(runs: list[PlannedRun]) -> None:
    """Each worker sees its own GPU as cuda:0: a run pinned to another index cannot run there."""
    pinned = sorted({r.cfg.device for r in runs if r.cfg.device.startswith("cuda:") and r.cfg.device != "cuda:0"})
    if pinned:
        raise UsageError(f"device={pinned[0]!r}: on a Dask cluster each worker sees one GPU, as cuda:0; "
                         "use device auto or cuda (or --device cuda)")


class _Stop:
    """SIGINT / SIGTERM in the client: the first stops the sweep, a second stops waiting."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self._old: dict = {}

    def __enter__(self) -> "_Stop":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, lambda signum, frame: self.signals.append(signum))
                         for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def store_result(results_dir: Path, payload: dict) -> dict:
    """Put a finished run's files into the results folder, index it in runs.csv and add it to this
    invocation's manifest entry (the one writer)."""
    row = payload["row"]
    run_dir = Path(results_dir) / row["run_id"]
    record_invocation(results_dir, run_ids=[row["run_id"]])
    for rel, data in payload["files"].items():
        if rel == "job.json":  # the spec of the run as it ran, pointing at the real results folder
            spec = json.loads(data)
            spec["results_dir"] = str(results_dir)
            data = json.dumps(spec, indent=1).encode()
        atomic_write_bytes(run_dir / rel, data)
    rebuild_index(results_dir)
    return row


def record_lost(job: Job, *, status: str, error: str) -> dict:
    """A run whose task did not return a row (its worker died, the sweep stopped waiting)."""
    row = {**base_row(job), "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "status": status, "error": error[:2000]}
    record_invocation(job.results_dir, run_ids=[job.run_id])
    return save_row(job.results_dir, row)


def claim_runs(todo: list[PlannedRun], *, results_dir: Path, result: SweepResult, console) -> dict[str, RunClaim]:
    """Claim the folder of each run to submit. A run claimed by another process is left to it; one
    that another process finished since the plan was made counts as done elsewhere."""
    seen = planned_records(results_dir)
    claims: dict[str, RunClaim] = {}
    for run in todo:
        claim = try_claim(results_dir / run.run_id)
        if claim is None:
            pid = claimant(results_dir / run.run_id)
            console.print(f"[yellow]…[/yellow] {run.run_id} is running in another process"
                          f"{f' (pid {pid})' if pid else ''}; left to it", highlight=False)
            continue
        if finished_elsewhere(results_dir, run.run_id, seen):
            result.elsewhere += 1
            claim.release()
            continue
        claims[run.run_id] = claim
    return claims


def run_sweep_dask(sweep: Sweep, *, results_dir: Path, console: Console, workers: int | None = None,
                   scheduler: str | None = None, fresh: bool = False, shard: tuple[int, int] | None = None,
                   progress: bool = True, cache_dir: Path | None = None) -> SweepResult:
    """``runner.run_sweep`` on a Dask cluster: the same resume, claims, records and result."""
    if scheduler is not None and workers is not None:
        raise UsageError("--workers and --scheduler exclude each other: the scheduler's cluster has its own workers")
    results_dir = Path(results_dir)
    check_devices(select_shard(sweep.runs, shard))
    # the machine to ask is this one only for a local cluster
    todo, result = start_sweep(sweep, results_dir=results_dir, console=console, fresh=fresh, shard=shard,
                               check_machine=scheduler is None)
    if not todo:
        return result
    token = uuid.uuid4().hex[:12]
    # the cluster first: a scheduler that cannot be reached leaves no claimed run folder behind
    client, cluster = connect(workers=workers, scheduler=scheduler, console=console)
    claims: dict[str, RunClaim] = {}
    try:
        claims = claim_runs(todo, results_dir=results_dir, result=result, console=console)
        todo = [r for r in todo if r.run_id in claims]
        with _Stop() as stop:
            if todo:
                n = len(client.scheduler_info(n_workers=-1)["workers"])
                console.print(f"dask: {n} worker(s) at {client.scheduler.address}; {len(todo)} run(s) to go",
                              highlight=False)
                jobs = {}
                for run in todo:
                    job = Job(cfg=run.cfg, run_id=run.run_id, results_dir=results_dir, extra=sweep.provenance(run),
                              cache_dir=cache_dir)
                    spec = {"token": token, "config": run.cfg.to_dict(), "run_id": run.run_id, "extra": job.extra,
                            "cache_dir": str(cache_dir) if cache_dir else None}
                    fut = _submit(client, spec, key=f"lora-bench-{run.index:05d}-{run.run_id}-{token}")
                    jobs[fut.key] = (fut, run, job, spec)
                with sweep_progress(console, progress=progress) as bar:
                    task = bar.add_task(sweep.name, total=len(todo))
                    _collect(client, jobs, result, stop=stop, token=token, bar=bar, task=task,
                             results_dir=results_dir, claims=claims)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
        for claim in claims.values():
            claim.release()
    result.interrupted = bool(stop.signals)
    rebuild_index(results_dir)  # a record left running by a process that died is recorded interrupted
    return result


def _submit(client, spec: dict, *, key: str):
    return client.submit(run_planned, {**spec, "key": key}, key=key, pure=False, retries=0)


def _started(client, key: str) -> bool:
    try:
        return any(msg.get("key") == key for _, msg in client.get_events(STARTED))
    except Exception:  # the scheduler cannot say: count the run as begun (recorded failed, not re-run)
        return True


def _collect(client, jobs: dict, result: SweepResult, *, stop: _Stop, token: str, bar, task, results_dir: Path,
             claims: dict[str, RunClaim]) -> None:
    """Store each run as its future finishes; on a stop, stop the workers' runs and settle."""
    pending = {fut for fut, *_ in jobs.values()}
    stopped_at = None
    while pending:
        if stop.signals and stopped_at is None:
            stopped_at = time.monotonic()
            _stop_workers(client, jobs, pending, token, stop.signals[0])
        if stopped_at is not None and (len(stop.signals) > 1 or time.monotonic() - stopped_at > SETTLE_S):
            _give_up(client, jobs, pending, result)
            return
        try:
            done, pending = wait(pending, timeout=0.5, return_when="FIRST_COMPLETED")
        except TimeoutError:
            continue
        for fut in done:
            _, run, job, spec = jobs[fut.key]
            row, seconds, where = None, 0.0, ""
            if fut.status == "finished":
                payload = fut.result()
                if payload.get("not_started"):
                    continue
                row = store_result(results_dir, payload)
                seconds = payload["seconds"]
                where = f"{payload['host']} {payload['worker']}" + (f" GPU {payload['gpu']}" if payload["gpu"] else "")
            elif fut.status == "error":
                exc = fut.exception()
                attempt = fut.key.count("-again")
                if not stop.signals and attempt < REQUEUES and not _started(client, fut.key):
                    again = _submit(client, spec, key=f"{fut.key}-again")
                    jobs[again.key] = (again, run, job, spec)
                    pending.add(again)
                    continue
                row = record_lost(job, status="failed", error=f"the Dask worker running this run died or failed "
                                                            f"({type(exc).__name__}: {exc})")
            if row is None:  # cancelled
                continue
            result.rows.append(row)
            held = claims.pop(job.run_id, None)
            if held is not None:  # recorded: the folder is free again
                held.release()
            print_run(bar.console, run, row, seconds, results_dir)
            if where:
                bar.console.print(f"    ran on {where}", highlight=False, markup=False, style="dim")
            bar.advance(task)


def _stop_workers(client, jobs: dict, pending: set, token: str, signum: int) -> None:
    """Tell every worker to stop this sweep's runs; cancel the runs no worker has begun."""
    try:
        client.run(stop_sweep, token, signum)
        busy = {k for keys in client.processing().values() for k in keys}
    except Exception:  # a worker gone: its runs come back as errors
        busy = {fut.key for fut in pending}
    client.cancel([fut for fut in pending if fut.key not in busy])


def _give_up(client, jobs: dict, pending: set, result: SweepResult) -> None:
    """A second signal, or the grace time over: runs still out are recorded interrupted."""
    try:
        busy = {k for keys in client.processing().values() for k in keys}
    except Exception:
        busy = {fut.key for fut in pending}
    for fut in pending:
        _, run, job, _ = jobs[fut.key]
        if fut.key in busy:
            result.rows.append(record_lost(job, status="interrupted",
                                           error="interrupted: the sweep stopped before this run's worker reported back"))
    client.cancel(list(pending))
