"""Running a sweep's planned runs: the loop (resume, progress bar, summary) and the isolation of
each run, either in a child process (``python -m lora_bench.sweep.runner JOB.json``, the default) or
inline, with the signal handling that lets Ctrl-C / SIGTERM stop a sweep without losing or tearing
any result.

Process mode: the child runs ``execute_run``, which records done / failed / interrupted itself.
When the child dies without recording (segfault, CUDA fatal error, OOM kill), the parent records
the run as failed with the exit code or signal and the tail of the child's log. The child runs in
its own session, so a terminal's Ctrl-C reaches only the parent, which forwards exactly one
signal (a second one kills the child) and records 'interrupted' if the child could not."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from rich.console import Console

from lora_bench.config import TrainConfig, render
from lora_bench.errors import UsageError
from lora_bench.fileio import atomic_write_text
from lora_bench.results.schema import run_column_names, settings_columns
from lora_bench.results.store import locked, result_rows, text_value, upsert_run, write_csv
from lora_bench.sweep.spec import ID_AS_DECLARED, PlannedRun, Sweep, select_shard
from lora_bench.train.preflight import device_problems
from lora_bench.train.run import execute_run

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
        self.forwarded = False
        self.inline = inline
        self._old: dict = {}

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
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
                self.forward()
            else:
                self.child.kill()
        elif self.inline and first:
            raise KeyboardInterrupt

    def forward(self) -> None:
        if self.child is not None and not self.forwarded:
            self.forwarded = True
            self.child.send_signal(self.signum)

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
        _rewrite_record(job.run_dir / "run.json", row)
    elif interrupts.stopped and row["status"] != "done":
        # an exception raised while the signal unwound the run is the interruption, not a bug
        error = str(row.get("error") or "")
        cause = "" if error.startswith("KeyboardInterrupt") else f" ({error})"
        row = {**row, "status": "interrupted", "error": f"interrupted by {_signal_name(interrupts.signum)}{cause}"}
        _rewrite_record(job.run_dir / "run.json", row)
    # idempotent; also repairs runs.csv when the child died between run.json and runs.csv
    upsert_run(job.results_dir / "runs.csv", row)
    return row


def _run_inline(job: Job, log: Path, interrupts: Interrupts) -> int:
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
        proc = subprocess.Popen([sys.executable, "-m", "lora_bench.sweep.runner", str(spec)], stdout=f,
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
                interrupts.forward()  # the signal may have come between Popen and registering the child
                stop_seen = stop_seen or time.monotonic()
                if time.monotonic() - stop_seen > GRACE_S:
                    proc.kill()


def _rewrite_record(path: Path, row: dict) -> None:
    """Replace the row in run.json, keeping the log and curves the run wrote."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = {"log": []}
    atomic_write_text(path, json.dumps({**record, "row": row}, indent=1, default=str))


def _signal_name(signum: int | None) -> str:
    try:
        return signal.Signals(signum).name
    except (TypeError, ValueError):
        return f"signal {signum}"


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
        what = f"worker killed by {_signal_name(-rc)} (exit code {rc})"
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


# -- the sweep loop ------------------------------------------------------------------------------
@dataclass
class SweepResult:
    selected: int  # runs in this shard
    skipped: int  # finished earlier, not rerun
    rows: list[dict]  # rows recorded by this invocation
    interrupted: bool

    def count(self, status: str) -> int:
        return sum(r.get("status") == status for r in self.rows)

    @property
    def not_started(self) -> int:
        return self.selected - self.skipped - len(self.rows)

    @property
    def exit_code(self) -> int:
        """130 when interrupted (as a shell reports Ctrl-C), 1 when a run failed, else 0."""
        return EXIT_INTERRUPTED if self.interrupted else (1 if self.count("failed") else 0)


def run_sweep(sweep: Sweep, *, results_dir: Path, console, isolation: str = "process", fresh: bool = False,
              shard: tuple[int, int] | None = None, progress: bool = True,
              cache_dir: Path | None = None) -> SweepResult:
    """Run the (shard's) runs not yet done, each isolated; a failure is recorded and the sweep
    goes on; SIGINT / SIGTERM stops it after recording the interrupted run."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if isolation not in ISOLATION:
        raise UsageError(f"--isolation {isolation!r} is not allowed; choose one of: {', '.join(ISOLATION)}")
    results_dir = Path(results_dir)
    runs = select_shard(sweep.runs, shard)
    _preflight(runs, console)
    if fresh:
        forget_runs(results_dir, [r.run_id for r in runs])
    repair_runs_csv(results_dir)
    status = {} if fresh else resume_statuses(results_dir, runs, sweep.name)
    todo = [r for r in runs if status.get(r.run_id, ("",))[0] != "done"]
    result = SweepResult(selected=len(runs), skipped=len(runs) - len(todo), rows=[], interrupted=False)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[current]}"))
    with Interrupts(inline=isolation == "inline") as stop, \
            Progress(*columns, console=console, transient=True, disable=not progress) as bar:
        task = bar.add_task(sweep.name, total=len(todo), current="")
        try:
            for run in todo:
                if stop.stopped:
                    break
                bar.update(task, current=run.run_id)
                job = Job(cfg=run.cfg, run_id=run.run_id, results_dir=results_dir, extra=sweep.provenance(run),
                          cache_dir=cache_dir)
                t0 = time.monotonic()
                row = run_job(job, isolation=isolation, interrupts=stop)
                result.rows.append(row)
                _print_run(bar.console, run, row, time.monotonic() - t0, results_dir)
                bar.advance(task)
        except KeyboardInterrupt:  # inline mode: a signal between runs; every record is complete
            stop.signum = stop.signum or signal.SIGINT
        result.interrupted = stop.stopped
    repair_runs_csv(results_dir)
    return result


def _preflight(runs: list[PlannedRun], console) -> None:
    """Environment checks that `validate` cannot do on another machine: fail before the first run."""
    machines = {(r.cfg.device, r.cfg.cuda_graphs): r.cfg for r in runs}
    problems = sorted({p for cfg in machines.values() for p in render(device_problems(cfg))})
    if problems:
        raise UsageError("; ".join(problems))
    for path in sorted({r.cfg.data_file for r in runs if r.cfg.data_file}):
        if not Path(path).is_file():
            console.print(f"[yellow]warning:[/yellow] data_file {path} does not exist; runs using it will fail",
                          highlight=False)


def repair_runs_csv(results_dir: Path) -> int:
    """Bring runs.csv in line with the per-run run.json files (written first). Writers of runs.csv
    take a lock, so this only matters when a process died between its run.json and its runs.csv
    row; each sweep repairs that when it starts and ends. Returns the number of rows fixed."""
    csv = Path(results_dir) / "runs.csv"
    have = {}
    if csv.is_file():
        have = {r["run_id"]: r for r in pd.read_csv(csv, dtype=str, keep_default_na=False).to_dict("records")}
    fixed = 0
    for path in sorted(Path(results_dir).glob("*/run.json")):
        try:
            row = json.loads(path.read_text())["row"]
        except (OSError, ValueError, KeyError):
            continue
        old = have.get(row["run_id"], {})
        if (old.get("status"), old.get("started_at")) != (row.get("status"), row.get("started_at")):
            upsert_run(csv, row)
            fixed += 1
    return fixed


def run_statuses(results_dir: Path) -> dict[str, str]:
    return {r["run_id"]: r.get("status", "") for r in result_rows(Path(results_dir))}


def resume_statuses(results_dir: Path, runs: list[PlannedRun], sweep_name: str) -> dict[str, tuple[str, str]]:
    """Planned run id -> (status, id of the row that has it). A run without a row of its own id
    counts as done when a finished row of the same sweep and repeat holds the same settings:
    a row written under an older run-id scheme, or before a setting (now at its default) existed.
    Paths and the device are not compared (they may differ per machine, as in the ids)."""
    rows = result_rows(Path(results_dir))
    by_id = {r["run_id"]: r for r in rows}
    out: dict[str, tuple[str, str]] = {}
    finished = [r for r in rows if r.get("status") == "done" and r.get("sweep_name") == sweep_name]
    claimed: set[str] = set()
    defaults = TrainConfig()
    for run in runs:
        own = by_id.get(run.run_id)
        if own is not None and own.get("status") == "done":
            out[run.run_id] = ("done", run.run_id)
            continue
        match = next((r for r in finished if r["run_id"] not in claimed and r.get("repeat") == str(run.repeat)
                      and _same_settings(run.cfg, r, defaults, skip=ID_AS_DECLARED)), None)
        if match is not None:
            claimed.add(match["run_id"])
            out[run.run_id] = ("done", match["run_id"])
        elif own is not None:
            out[run.run_id] = (own.get("status", ""), run.run_id)
    return out


def _same_settings(cfg: TrainConfig, row: dict, defaults: TrainConfig, *, skip: tuple[str, ...]) -> bool:
    """Does a results row (text values, ``cfg_<name>`` columns) hold these settings? A column the
    row lacks, or leaves empty (runs.csv fills the columns of older rows with nothing), holds the
    setting's default."""
    for name in TrainConfig.field_names():
        if name in skip:
            continue
        want = text_value(getattr(cfg, name))
        got = row.get(f"cfg_{name}") or text_value(getattr(defaults, name))
        if want != got and not _same_number(want, got):
            return False
    return True


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def forget_runs(results_dir: Path, run_ids: list[str]) -> int:
    """``--fresh``: drop these runs' rows and folders (only this sweep's / shard's runs)."""
    ids = set(run_ids)
    csv = Path(results_dir) / "runs.csv"
    gone = 0
    with locked(csv):
        if csv.is_file():
            rows = pd.read_csv(csv, dtype=str, keep_default_na=False).to_dict("records")
            keep = [r for r in rows if r.get("run_id") not in ids]
            gone = len(rows) - len(keep)
            write_csv(csv, keep, run_column_names())
    for run_id in ids:
        if (Path(results_dir) / run_id).is_dir():
            shutil.rmtree(Path(results_dir) / run_id)
    return gone


def _print_run(console, run: PlannedRun, row: dict, seconds: float, results_dir: Path) -> None:
    st = str(row.get("status"))
    mark = {"done": "[green]✓[/green]", "failed": "[red]✗[/red]"}.get(st, "[yellow]![/yellow]")
    step = row.get("step_ms_median")
    step_text = f"step {step:7.2f} ms" if st == "done" and isinstance(step, (int, float)) else ""
    console.print(f"{mark} {st:<11} {seconds:6.1f} s  {step_text:<16} {run.run_id}  {run.describe()}",
                  highlight=False, no_wrap=True, overflow="ellipsis")
    if st != "done":
        err = str(row.get("error") or "").splitlines()[0][:300] if row.get("error") else ""
        console.print(f"    {err}\n    log: {results_dir / run.run_id / 'worker.log'}", highlight=False)


# -- child side ----------------------------------------------------------------------------------
def _sigterm_to_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # so execute_run records 'interrupted' on SIGTERM as on Ctrl-C


def main(argv: list[str] | None = None) -> int:
    """Child entry point: run the job in JOB.json; exit 0 done, 1 failed, 130 interrupted."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m lora_bench.sweep.runner JOB.json", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    try:
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
