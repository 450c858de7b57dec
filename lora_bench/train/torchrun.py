"""``lora-bench train --nproc N``: re-execute the same ``train`` command under torchrun with N
processes on this host, one per GPU, and settle the run's record afterwards (a failed rank's error
becomes the run's). The contract in full: docs/data-parallel.md."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from lora_bench.config import TrainConfig
from lora_bench.errors import EXIT_INTERRUPTED
from lora_bench.escaping import markup
from lora_bench.train import recording
from lora_bench.train.distributed import NO_MULTICAST_ENV, RANK_ERRORS_ENV
from lora_bench.train.identity import check_run_id as check_name

TORCHRUN = (sys.executable, "-m", "torch.distributed.run")


def torchrun_command(nproc: int, target: list[str]) -> list[str]:
    """torchrun on this host (a free port chosen by --standalone), no restarts: a failure fails the run."""
    return [*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", *target]


def launch_environ(environ: dict[str, str], *, errors_dir: Path | None = None) -> dict[str, str]:
    env = {**environ, **NO_MULTICAST_ENV}
    if errors_dir is not None:
        env[RANK_ERRORS_ENV] = str(errors_dir)
    return env


def strip_option(argv: list[str], name: str) -> list[str]:
    """``argv`` without ``name VALUE`` / ``name=VALUE``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def check_run_id(results_dir: Path, run_id: str, *, overwrite: bool) -> None:
    """The run id names a folder and is free (``recording.free_run_id``): a rank that dies before
    recording cannot leave an old record standing."""
    check_name(run_id)
    recording.free_run_id(results_dir, run_id, overwrite=overwrite)


@dataclass
class Launched:
    returncode: int
    signum: int | None  # the first signal this process received while torchrun ran


def run_torchrun(cmd: list[str], *, env: dict[str, str], timeout_s: float | None = None) -> Launched:
    """Run torchrun in its own session, forwarding SIGINT / SIGTERM to it; ``timeout_s`` (tests)
    stops it with SIGTERM, then kills it 30 s later."""
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    got: list[int] = []

    def forward(signum, frame):
        got.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                late = time.monotonic() - t0 - timeout_s if timeout_s is not None else -1.0
                if late > 30:
                    proc.kill()
                elif late > 0:
                    proc.terminate()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return Launched(returncode=rc, signum=got[0] if got else None)


def rank_failures(errors_dir: Path) -> list[dict]:
    """The ranks' error records, first failure first."""
    out = []
    for path in sorted(Path(errors_dir).glob("rank*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda r: r.get("time", 0.0))


def root_cause(failures: list[dict]) -> dict | None:
    """The first rank that failed on its own (a rank stopped by a signal follows the failure)."""
    own = [f for f in failures if not f.get("interrupted")]
    return (own or failures or [None])[0]


def launch_train(cfg: TrainConfig, *, argv: list[str], results_dir: Path, run_id: str, overwrite: bool = False,
                 extra: dict | None = None, console, timeout_s: float | None = None) -> int:
    """Run ``lora-bench ARGV`` (a ``train`` command line) under torchrun with ``cfg.nproc``
    processes as run ``run_id``; returns the exit code (0 done, 1 failed, 130 interrupted)."""
    results_dir = Path(results_dir)
    recording.check_results_dir(results_dir)
    check_run_id(results_dir, run_id, overwrite=overwrite)
    run_dir = results_dir / run_id
    errors_dir = run_dir / "ranks"
    shutil.rmtree(errors_dir, ignore_errors=True)
    errors_dir.mkdir(parents=True)
    recording.start_invocation()  # the ranks inherit this command line as their invocation
    # torchrun's own parser sees the whole line, and --nproc is ambiguous to it: the ranks take
    # nproc from torchrun's world size instead (a file's or an override's nproc agrees with it)
    target = ["-m", "lora_bench", *strip_option(strip_option(argv, "--nproc"), "--run-id"), "--run-id", run_id]
    started = time.time()
    launched = run_torchrun(torchrun_command(cfg.nproc, target),
                            env=launch_environ(dict(os.environ), errors_dir=errors_dir), timeout_s=timeout_s)
    with recording.claim_run(run_dir):
        return settle(cfg, run_id=run_id, results_dir=results_dir, launched=launched, errors_dir=errors_dir,
                      extra=extra or {}, started=started, console=console)


def settle(cfg: TrainConfig, *, run_id: str, results_dir: Path, launched: Launched, errors_dir: Path, extra: dict,
           started: float, console) -> int:
    """Make rank 0's record tell what happened to the whole job."""
    record_path = results_dir / run_id / recording.RUN_RECORD
    record: dict = {"log": []}
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
        except ValueError:
            record = {"log": []}
    row = record.get("row")
    failures = rank_failures(errors_dir)
    cause = root_cause(failures)
    if row is not None and row.get("status") in recording.FINISHED:
        if launched.returncode != 0:
            console.print(f"[yellow]warning:[/yellow] the run was recorded, but torchrun exited with code "
                          f"{launched.returncode}" + (f" (rank {cause['rank']}: {markup(cause['error'])})" if cause else ""),
                          highlight=False)
        return 0
    if launched.signum is not None:
        status, error = "interrupted", f"interrupted by {signal.Signals(launched.signum).name}"
    elif cause is not None and not cause.get("interrupted"):
        status, error = "failed", f"rank {cause['rank']} failed: {cause['error']}"
    else:
        status = "failed"
        error = (f"torchrun exited with code {launched.returncode}: a rank process died without recording an "
                 "error (killed by a signal, e.g. the out-of-memory killer); see torchrun's output above")
    own = str(row.get("error") or "") if row else ""
    if own and cause is not None and cause.get("rank") != 0:
        error += f" (rank 0: {own.splitlines()[0][:300]})"
    if row is None:  # rank 0 recorded nothing: the run's settings, as every row has them
        begun = dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat(timespec="seconds")
        row = {"run_id": run_id, "started_at": begun, **recording.cfg_columns(cfg), **extra}
    row = {**row, "status": status, "error": error[:2000]}
    recording.settle_row(results_dir, row)
    console.print(f"[red]{status}[/red]: {markup(error, newlines=True)}", highlight=False)
    return EXIT_INTERRUPTED if status == "interrupted" else 1
