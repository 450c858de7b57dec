"""How one run of a sweep — one job, or a pack of jobs trained at once (lora_bench.sweep.packs) —
is isolated: in a child process (``python -m lora_bench.sweep.child JOB.json``, the default) or
inline, and the signals that stop a sweep without losing or tearing a result.

Process mode: the parent claims each job's folder (lora_bench.results.claims) and passes the claims
to the child, which runs ``train.run.execute`` and records done / failed / interrupted itself. When
the child dies without recording (segfault, CUDA fatal error, OOM kill), the parent records each
of its jobs as failed with the exit code or signal and the tail of the child's log. The child runs
in its own session, so a terminal's Ctrl-C reaches only the parent, which forwards exactly one
signal (a second one kills the child) and records 'interrupted' if the child could not. The child dies with
its parent (``die_with_parent``): a sweep killed by SIGKILL leaves no worker behind."""

from __future__ import annotations

import ctypes
import dataclasses
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from lora_bench.config import TrainConfig
from lora_bench.errors import EXIT_INTERRUPTED, EXIT_NOT_SAVED, Interrupted, SaveError
from lora_bench.fileio import atomic_write_text
from lora_bench.results.claims import RunClaim
from lora_bench.results.records import RUN_RECORD, run_record
from lora_bench.results.save import NO_ROOM, save_row
from lora_bench.results.schema import cfg_columns
from lora_bench.results.store import FINISHED, upsert_run
from lora_bench.signals import TERMINATING_SIGNALS, signal_name, signals_deferred
from lora_bench.train import run as train_run
from lora_bench.train.pack import pack_columns

ISOLATION = ("process", "inline")
GRACE_S = 60.0  # after a forwarded signal, how long the child may take to record before SIGKILL
CHILD_MODULE = "lora_bench.sweep.child"
JOB_SPEC = "job.json"  # what the child runs, in the first job's folder
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCHDOG_S = 1.0


@dataclass(frozen=True)
class Job:
    cfg: TrainConfig
    run_id: str
    results_dir: Path
    extra: dict
    cache_dir: Path | None = None

    @property
    def run_dir(self) -> Path:
        return self.results_dir / self.run_id


class Interrupts:
    """SIGINT / SIGTERM / SIGHUP while a sweep runs. The first signal is remembered and forwarded
    to the running child (process mode) or raised as Interrupted (inline mode, as Ctrl-C would);
    a second one kills the child at once."""

    def __init__(self, *, inline: bool = False) -> None:
        self.signum: int | None = None
        self.child: subprocess.Popen | None = None
        self.forwarded = False
        self.killed = ""  # why this sweep killed its child, when it did
        self.inline = inline
        self._old: dict = {}

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for s in TERMINATING_SIGNALS:
                if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN:
                    self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, signum, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if self.child is not None and self.child.poll() is None:
            if first:
                self.forward()
            else:
                self.killed = f"a second {signal_name(signum)} to the sweep"
                self.child.kill()
        elif self.inline and first:
            raise Interrupted(signum)

    def forward(self) -> None:
        if self.child is not None and not self.forwarded:
            self.forwarded = True
            self.child.send_signal(self.signum)

    @property
    def stopped(self) -> bool:
        return self.signum is not None


def run_job(job: Job, *, isolation: str, interrupts: Interrupts, claim: RunClaim) -> dict:
    """``run_jobs`` of one job: its recorded row."""
    return run_jobs([job], isolation=isolation, interrupts=interrupts, claims=[claim])[0]


def run_jobs(jobs: list[Job], *, isolation: str, interrupts: Interrupts, claims: list[RunClaim]) -> list[dict]:
    """Run the jobs as one run of their points (one job: a solo run; several: a pack, each job a
    point), whose folders the caller has claimed, and return each one's recorded row (status
    done, failed or interrupted). Never raises for a failed run: the failure is in the rows. The
    run's log goes to each job's worker.log. A SaveError (the folder takes no more) comes once
    every job is settled, with the rows in its ``rows``."""
    jobs = with_pack_columns(jobs)
    for job in jobs:
        job.run_dir.mkdir(parents=True, exist_ok=True)
        # a stale run.json from an earlier attempt must not be mistaken for this attempt's record
        (job.run_dir / RUN_RECORD).unlink(missing_ok=True)
    log = jobs[0].run_dir / "worker.log"
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    try:
        if isolation == "inline":
            rc = _run_inline(jobs, log, interrupts, claims)
        else:
            rc = _run_process(jobs, log, interrupts, claims)
        for job in jobs[1:]:
            shutil.copyfile(log, job.run_dir / "worker.log")
    except OSError as e:  # the job's file or the worker's log: the folder takes no more
        if e.errno not in NO_ROOM:
            raise
        what = f"run {jobs[0].run_id}" if len(jobs) == 1 else f"the pack of {jobs[0].run_id}"
        raise SaveError(f"cannot start {what}: {e.filename or jobs[0].run_dir}: {e.strerror or e}; "
                        "free some space there") from None
    rows, not_saved = [], None
    for job in jobs:
        try:
            rows.append(settle_job(job, rc=rc, log=log, interrupts=interrupts, started=started))
        except SaveError as e:  # every job is settled; the sweep then stops, naming a run not saved in full
            row = e.row or {"run_id": job.run_id, "status": "failed", "error": str(e)}
            if not_saved is None or (row.get("status") not in FINISHED
                                     and (not_saved.row or {}).get("status") in FINISHED):
                not_saved = e
            rows.append(row)
    if not_saved is not None:
        not_saved.rows = rows
        raise not_saved
    return rows


def with_pack_columns(jobs: list[Job]) -> list[Job]:
    """The jobs with their pack's columns in their extra row columns (also in a row the sweep
    writes for a pack that died without recording); one job has none."""
    pack = pack_columns([j.run_id for j in jobs])
    return [dataclasses.replace(j, extra={**j.extra, **pack}) for j in jobs] if pack else jobs


def settle_job(job: Job, *, rc: int, log: Path, interrupts: Interrupts, started: str) -> dict:
    """After the job's process (or call) ended with ``rc``: its row as recorded, recorded here when
    the run could not record it itself; SaveError when the folder took no more."""
    row = run_record(job.run_dir)
    if row is None or row.get("status") not in (*FINISHED, "failed", "interrupted"):
        # the run never reached its own bookkeeping (or never finished it): record it here
        status = "interrupted" if interrupts.stopped else "failed"
        row = {**(row or base_row(job)), "started_at": (row or {}).get("started_at") or started, "status": status,
               "error": _exit_text(rc, log, interrupts)}
        save_row(job.results_dir, row)
    elif interrupts.stopped and row["status"] not in (*FINISHED, "interrupted"):
        # an exception raised while the signal unwound the run is the interruption, not a bug (a
        # run that recorded itself interrupted keeps its record: the steps it trained stay)
        error = str(row.get("error") or "")
        cause = "" if error.startswith("interrupted by") else f" ({error})"
        row = {**row, "status": "interrupted", "error": f"interrupted by {signal_name(interrupts.signum)}{cause}"}
        save_row(job.results_dir, row)
    else:  # idempotent; also repairs runs.csv when the child died between run.json and runs.csv
        with signals_deferred():
            try:
                upsert_run(job.results_dir / "runs.csv", row)
            except OSError as e:
                if e.errno not in NO_ROOM:
                    raise
                raise SaveError(f"cannot record run {job.run_id} in {job.results_dir / 'runs.csv'}: "
                                f"{e.strerror or e}; free some space there", row=row) from None
    if rc == EXIT_NOT_SAVED:  # the run's own save found the folder full: the next run's would too
        raise SaveError(f"run {job.run_id} could not be saved in full in {job.results_dir} (the folder takes no "
                        f"more): {str(row.get('error') or '').splitlines()[0][:300] if row.get('error') else ''}",
                        row=row)
    return row


def _run_inline(jobs: list[Job], log: Path, interrupts: Interrupts, claims: list[RunClaim]) -> int:
    with open(log, "w") as f:
        console = Console(file=f, width=120, force_terminal=False)
        try:
            train_run.execute(points(jobs), results_dir=jobs[0].results_dir, console=console, progress=False,
                              cache_dir=jobs[0].cache_dir, overwrite=True, claims=claims, handle_signals=False)
            return 0
        except KeyboardInterrupt as e:
            interrupts.signum = interrupts.signum or getattr(e, "signum", signal.SIGINT)
            return EXIT_INTERRUPTED
        except SaveError as e:  # recorded as far as it fitted; the message says what was kept
            print(f"error: {e}", file=f)
            return EXIT_NOT_SAVED
        except Exception:  # recorded by the run; the traceback goes to the run's log
            traceback.print_exc(file=f)
            return 1


def points(jobs: list[Job]) -> list[train_run.Point]:
    return [train_run.Point(cfg=j.cfg, run_id=j.run_id, extra=j.extra) for j in jobs]


def _run_process(jobs: list[Job], log: Path, interrupts: Interrupts, claims: list[RunClaim]) -> int:
    spec = jobs[0].run_dir / JOB_SPEC
    atomic_write_text(spec, json.dumps({
        "points": [{"config": j.cfg.to_dict(), "run_id": j.run_id, "extra": j.extra} for j in jobs],
        "results_dir": str(jobs[0].results_dir), "cache_dir": str(jobs[0].cache_dir) if jobs[0].cache_dir else None,
        "claim_fds": [c.fd for c in claims], "parent_pid": os.getpid()}, indent=1))
    with open(log, "w") as f:
        # own session: Ctrl-C in a terminal goes to the parent only, which forwards it once;
        # the claims' descriptors go along, so the child holds the runs' folders too
        proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE, str(spec)], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=tuple(c.fd for c in claims))
        interrupts.child = proc
        try:
            return _wait(proc, interrupts)
        finally:
            interrupts.child = None


def _wait(proc: subprocess.Popen, interrupts: Interrupts) -> int:
    stop_seen = None
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            if interrupts.stopped:
                interrupts.forward()  # the signal may have come between Popen and registering the child
                stop_seen = stop_seen or time.monotonic()
                if time.monotonic() - stop_seen > GRACE_S:
                    interrupts.killed = (f"it had not stopped {GRACE_S:.0f} s after the sweep passed on "
                                         f"{signal_name(interrupts.signum)}")
                    proc.kill()


def die_with_parent(parent_pid: int, signum: int = signal.SIGTERM) -> None:
    """In a child process: get ``signum`` when the parent process dies, so that a sweep killed
    outright (SIGKILL, OOM killer) leaves no worker running on. Linux delivers it through
    prctl(PR_SET_PDEATHSIG); a watchdog thread that polls the parent's pid covers other systems
    and the case where the thread that started the child ends before the parent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog alone
        pass
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signum)
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_S)
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def base_row(job: Job) -> dict:
    """The row of a run recorded by someone other than the run itself: its settings and provenance."""
    return {"run_id": job.run_id, **cfg_columns(job.cfg), **job.extra}


def _exit_text(rc: int, log: Path, interrupts: Interrupts) -> str:
    if rc < 0:
        what = f"worker killed by {signal_name(-rc)} (exit code {rc})"
        if -rc == signal.SIGKILL and interrupts.killed:
            what += f"; the sweep killed it: {interrupts.killed}"
        elif -rc == signal.SIGKILL:
            what += "; killed from outside this sweep, often by the out-of-memory killer"
    elif rc == EXIT_NOT_SAVED:
        what = "the worker could not save the run: the results folder takes no more"
    else:
        what = f"worker exited with code {rc} before recording the run"
    tail = [line.strip() for line in _tail(log) if line.strip()]
    return (what + (": " + " | ".join(tail[-4:]) if tail else ""))[:2000]


def _tail(path: Path, size: int = 4000) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - size))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
