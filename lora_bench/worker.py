"""Run isolation for sweeps: one run either in a child process (``python -m lora_bench.worker
JOB.json``, the default) or inline, and the signal handling that lets Ctrl-C / SIGTERM stop a sweep
without losing or tearing any result.

Process mode: the child runs ``execute_run``, which records done / failed / interrupted itself.
When the child dies without recording (segfault, CUDA fatal error, OOM kill), the parent records
the run as failed with the exit code or signal and the tail of the child's log. The child runs in
its own session, so a terminal's Ctrl-C reaches only the parent, which forwards exactly one
signal (a second one kills the child) and records 'interrupted' if the child could not."""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from .config import TrainConfig
from .results import atomic_write_text, settings_columns, upsert_run

ISOLATION = ("process", "inline")
GRACE_S = 60.0  # after a forwarded signal, how long the child may take to record before SIGKILL
EXIT_INTERRUPTED = 130


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
    """SIGINT / SIGTERM while a sweep runs. The first signal is remembered and forwarded to the
    running child (process mode) or raised as KeyboardInterrupt (inline mode, as Ctrl-C would);
    a second one kills the child at once."""

    def __init__(self, *, inline: bool = False) -> None:
        self.signum: int | None = None
        self.child: subprocess.Popen | None = None
        self.inline = inline
        self._old: dict = {}

    def __enter__(self) -> "Interrupts":
        for s in (signal.SIGINT, signal.SIGTERM):
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
                self.child.send_signal(signum)
            else:
                self.child.kill()
        elif self.inline and first:
            raise KeyboardInterrupt

    @property
    def stopped(self) -> bool:
        return self.signum is not None


def run_job(job: Job, *, isolation: str, interrupts: Interrupts) -> dict:
    """Run one job and return its recorded row (status done, failed or interrupted). Never raises
    for a failed run: the failure is in the row."""
    job.run_dir.mkdir(parents=True, exist_ok=True)
    # a stale run.json from an earlier attempt must not be mistaken for this attempt's record
    (job.run_dir / "run.json").unlink(missing_ok=True)
    log = job.run_dir / "worker.log"
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    if isolation == "inline":
        rc = _run_inline(job, log, interrupts)
    else:
        rc = _run_process(job, log, interrupts)
    row = _recorded_row(job)
    if row is None or row.get("status") not in ("done", "failed", "interrupted"):
        # the run never reached its own bookkeeping: record it here
        status = "interrupted" if interrupts.stopped else "failed"
        row = {**_base_row(job), "started_at": started, "status": status, "error": _exit_text(rc, log)}
        atomic_write_text(job.run_dir / "run.json", json.dumps({"row": row, "log": []}, indent=1, default=str))
    elif interrupts.stopped and row["status"] == "failed":
        # an exception raised while the signal unwound the run is the interruption, not a bug
        row = {**row, "status": "interrupted"}
        atomic_write_text(job.run_dir / "run.json", json.dumps({"row": row, "log": []}, indent=1, default=str))
    # idempotent; also repairs runs.csv when the child died between run.json and runs.csv
    upsert_run(job.results_dir / "runs.csv", row)
    return row


def _run_inline(job: Job, log: Path, interrupts: Interrupts) -> int:
    from .run import execute_run

    with open(log, "w") as f:
        console = Console(file=f, width=120, force_terminal=False)
        try:
            execute_run(job.cfg, results_dir=job.results_dir, run_id=job.run_id, console=console, progress=False,
                        cache_dir=job.cache_dir, extra=job.extra)
            return 0
        except KeyboardInterrupt:
            interrupts.signum = interrupts.signum or signal.SIGINT
            return EXIT_INTERRUPTED
        except Exception:  # recorded by execute_run; the traceback goes to the run's log
            traceback.print_exc(file=f)
            return 1


def _run_process(job: Job, log: Path, interrupts: Interrupts) -> int:
    spec = job.run_dir / "job.json"
    atomic_write_text(spec, json.dumps({"config": job.cfg.to_dict(), "run_id": job.run_id,
                                        "results_dir": str(job.results_dir), "extra": job.extra,
                                        "cache_dir": str(job.cache_dir) if job.cache_dir else None}, indent=1))
    with open(log, "w") as f:
        # own session: Ctrl-C in a terminal goes to the parent only, which forwards it once
        proc = subprocess.Popen([sys.executable, "-m", "lora_bench.worker", str(spec)], stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
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
                stop_seen = stop_seen or time.monotonic()
                if time.monotonic() - stop_seen > GRACE_S:
                    proc.kill()


def _recorded_row(job: Job) -> dict | None:
    path = job.run_dir / "run.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["row"]
    except (ValueError, KeyError):
        return None


def _base_row(job: Job) -> dict:
    cfg = job.cfg
    return {"run_id": job.run_id, "model_size": cfg.model_size, "weights": cfg.weights,
            "trainable_layers": cfg.trainable_layers, "lora_rank": cfg.lora_rank if cfg.is_lora else None,
            "lora_alpha": cfg.lora_alpha if cfg.is_lora else None, "warmup_steps": cfg.warmup_steps,
            **settings_columns(cfg), **job.extra}


def _exit_text(rc: int, log: Path) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        what = f"worker killed by {name} (exit code {rc})"
        if -rc == signal.SIGKILL:
            what += "; killed from outside, often the out-of-memory killer"
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


# -- child side ----------------------------------------------------------------------------------
def _sigterm_to_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # so execute_run records 'interrupted' on SIGTERM as on Ctrl-C


def main(argv: list[str] | None = None) -> int:
    """Child entry point: run the job in JOB.json; exit 0 done, 1 failed, 130 interrupted."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m lora_bench.worker JOB.json", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    try:
        from .run import execute_run

        spec = json.loads(Path(argv[0]).read_text())
        cfg = TrainConfig.from_mapping(spec["config"])
        console = Console(file=sys.stdout, width=120, force_terminal=False)
        execute_run(cfg, results_dir=Path(spec["results_dir"]), run_id=spec["run_id"], console=console,
                    progress=False, cache_dir=spec.get("cache_dir"), extra=spec.get("extra") or {})
        return 0
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception:  # recorded by execute_run (or by the parent from this traceback in the log)
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
