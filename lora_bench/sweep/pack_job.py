"""One pack of a sweep (lora_bench.sweep.packs), isolated as a single run is
(lora_bench.sweep.isolation): in a child process (``python -m lora_bench.sweep.child PACK.json``,
which holds every run's claim) or inline. The pack's log goes to each of its runs' worker.log. Each
run is then settled as a single run's job is: a child that died without recording leaves every
run of its pack failed (or interrupted) with the exit code and the log's tail."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import traceback
from pathlib import Path

from rich.console import Console

from lora_bench.errors import EXIT_INTERRUPTED, EXIT_NOT_SAVED, SaveError
from lora_bench.fileio import atomic_write_text
from lora_bench.results.claims import RunClaim
from lora_bench.results.save import NO_ROOM
from lora_bench.results.store import FINISHED, RUN_RECORD
from lora_bench.sweep.isolation import CHILD_MODULE, Interrupts, Job, _wait, settle_job
from lora_bench.train import pack as train_pack

PACK_SPEC = "pack.json"


def pack_extra(jobs: list[Job]) -> list[Job]:
    """The jobs with the pack's columns in their extra row columns (also in a row the sweep writes
    for a pack that died without recording)."""
    pack = {"pack_size": len(jobs), "pack_id": train_pack.pack_id_of([j.run_id for j in jobs])}
    return [Job(cfg=j.cfg, run_id=j.run_id, results_dir=j.results_dir, extra={**j.extra, **pack},
                cache_dir=j.cache_dir) for j in jobs]


def run_pack_job(jobs: list[Job], *, isolation: str, interrupts: Interrupts, claims: list[RunClaim]) -> list[dict]:
    """Run the pack whose folders the caller has claimed; returns each run's recorded row. Never
    raises for a failed pack: the failure is in every row."""
    jobs = pack_extra(jobs)
    for job in jobs:
        job.run_dir.mkdir(parents=True, exist_ok=True)
        (job.run_dir / RUN_RECORD).unlink(missing_ok=True)  # not to be taken for this attempt's record
    log = jobs[0].run_dir / "worker.log"
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    try:
        if isolation == "inline":
            rc = _inline(jobs, log, interrupts, claims)
        else:
            rc = _process(jobs, log, interrupts, claims)
        for job in jobs[1:]:
            shutil.copyfile(log, job.run_dir / "worker.log")
    except OSError as e:
        if e.errno not in NO_ROOM:
            raise
        raise SaveError(f"cannot start the pack of {jobs[0].run_id}: {e.filename or jobs[0].run_dir}: "
                        f"{e.strerror or e}; free some space there") from None
    rows, not_saved = [], None
    for job in jobs:
        try:
            rows.append(settle_job(job, rc=rc, log=log, interrupts=interrupts, started=started))
        except SaveError as e:  # every run is settled; the sweep then stops, naming a run not saved in full
            row = e.row or {"run_id": job.run_id, "status": "failed", "error": str(e)}
            if not_saved is None or (row.get("status") not in FINISHED
                                     and (not_saved.row or {}).get("status") in FINISHED):
                not_saved = e
            rows.append(row)
    if not_saved is not None:
        not_saved.rows = rows
        raise not_saved
    return rows


def _points(jobs: list[Job]) -> list[train_pack.PackPoint]:
    return [train_pack.PackPoint(cfg=j.cfg, run_id=j.run_id, extra=j.extra) for j in jobs]


def _inline(jobs: list[Job], log: Path, interrupts: Interrupts, claims: list[RunClaim]) -> int:
    with open(log, "w") as f:
        console = Console(file=f, width=120, force_terminal=False)
        try:
            train_pack.execute_pack(_points(jobs), results_dir=jobs[0].results_dir, console=console, progress=False,
                                    cache_dir=jobs[0].cache_dir, overwrite=True, claims=claims,
                                    handle_signals=False)
            return 0
        except KeyboardInterrupt as e:
            interrupts.signum = interrupts.signum or getattr(e, "signum", signal.SIGINT)
            return EXIT_INTERRUPTED
        except SaveError as e:
            print(f"error: {e}", file=f)
            return EXIT_NOT_SAVED
        except Exception:  # recorded by execute_pack, or by settle_job from this traceback
            traceback.print_exc(file=f)
            return 1


def _process(jobs: list[Job], log: Path, interrupts: Interrupts, claims: list[RunClaim]) -> int:
    spec = jobs[0].run_dir / PACK_SPEC
    atomic_write_text(spec, json.dumps({
        "pack": [{"config": j.cfg.to_dict(), "run_id": j.run_id, "extra": j.extra} for j in jobs],
        "results_dir": str(jobs[0].results_dir), "cache_dir": str(jobs[0].cache_dir) if jobs[0].cache_dir else None,
        "claim_fds": [c.fd for c in claims], "parent_pid": os.getpid()}, indent=1))
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE, str(spec)], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=tuple(c.fd for c in claims))
        interrupts.child = proc
        try:
            return _wait(proc, interrupts)
        finally:
            interrupts.child = None
