"""The sweep loop: select the shard's runs, skip the finished ones, run the rest one unit at a time
(a run alone, or a pack of runs trained at once, lora_bench.sweep.packs; each isolated, see
lora_bench.sweep.isolation), and stop cleanly on a signal.

Several sweeps may share a results folder (shards on several GPUs, or the same sweep started
twice): each run is executed only by the process holding its folder's claim. A run claimed by
another process is left for later; when its turn comes again the sweep waits for the claim and
runs it only if the other process did not finish it."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from lora_bench.errors import EXIT_INTERRUPTED, EXIT_NOT_SAVED, Interrupted, SaveError, UsageError
from lora_bench.escaping import markup
from lora_bench.results.claims import RunClaim, claimant, try_claim, wait_for_claim
from lora_bench.results.manifest import read_manifest
from lora_bench.results.records import run_record
from lora_bench.results.store import FINISHED, check_results_dir, result_rows
from lora_bench.sweep.isolation import ISOLATION, Interrupts, Job, run_jobs
from lora_bench.sweep.machine import preflight_runs
from lora_bench.sweep.packs import describe_plan, pack_memory_problem, plan_packs
from lora_bench.sweep.plan_time import plan_estimate
from lora_bench.sweep.resume import forget_runs, repair_runs_csv, resume_statuses
from lora_bench.sweep.spec import PlannedRun, Sweep, select_shard


def sweep_progress(console: Console, *, progress: bool, current: bool = False) -> Progress:
    """The sweep's progress bar: runs done of the total, elapsed, ETA, and (``current``) the run now
    running; transient, and off with ``progress=False``."""
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn()]
    if current:
        columns.append(TextColumn("{task.fields[current]}"))
    return Progress(*columns, console=console, transient=True, disable=not progress)


@dataclass
class SweepResult:
    selected: int  # runs in this shard
    skipped: int  # finished earlier, not rerun
    rows: list[dict]  # rows recorded by this invocation
    interrupted: bool
    elsewhere: int = 0  # finished meanwhile by another process sharing the results folder
    not_saved: str = ""  # why the sweep stopped early: a run's record did not fit in the results folder

    def count(self, status: str) -> int:
        return sum(r.get("status") == status for r in self.rows)

    @property
    def not_started(self) -> int:
        return self.selected - self.skipped - self.elsewhere - len(self.rows)

    @property
    def exit_code(self) -> int:
        """130 when interrupted (as a shell reports Ctrl-C), 4 when a record did not fit (the sweep
        stopped there), 1 when a run failed, else 0."""
        if self.interrupted:
            return EXIT_INTERRUPTED
        if self.not_saved:
            return EXIT_NOT_SAVED
        return 1 if self.count("failed") else 0


def start_sweep(sweep: Sweep, *, results_dir: Path, console, fresh: bool, shard: tuple[int, int] | None,
                check_machine: bool = True) -> tuple[list[PlannedRun], SweepResult]:
    """What every sweep runner does before its first run: the shard's runs, this machine's
    problems with them (``check_machine``), a results folder to record in, earlier rows forgotten
    (``fresh``) or repaired; returns the runs not yet done and the result to fill."""
    runs = select_shard(sweep.runs, shard)
    if check_machine:
        preflight_runs(runs, console)
    check_results_dir(results_dir)  # a place to record, before the first run
    read_manifest(results_dir)
    if fresh:
        forget_runs(results_dir, [r.run_id for r in runs])
    repair_runs_csv(results_dir)
    status = {} if fresh else resume_statuses(results_dir, runs, sweep.name)
    todo = [r for r in runs if status.get(r.run_id, ("",))[0] not in FINISHED]
    return todo, SweepResult(selected=len(runs), skipped=len(runs) - len(todo), rows=[], interrupted=False)


def run_sweep(sweep: Sweep, *, results_dir: Path, console, isolation: str = "process", fresh: bool = False,
              shard: tuple[int, int] | None = None, progress: bool = True,
              cache_dir: Path | None = None, pack: int | None = None) -> SweepResult:
    """Run the (shard's) runs not yet done, each isolated; a failure is recorded and the sweep
    goes on; SIGINT / SIGTERM / SIGHUP stops it after recording the interrupted run. ``pack``
    (default: the sweep file's): train up to that many compatible runs at once on one model
    (lora_bench.sweep.packs); a pack is isolated as one run is."""
    if isolation not in ISOLATION:
        raise UsageError(f"--isolation {isolation!r} is not allowed; choose one of: {', '.join(ISOLATION)}")
    results_dir = Path(results_dir)
    todo, result = start_sweep(sweep, results_dir=results_dir, console=console, fresh=fresh, shard=shard)
    size = sweep.pack if pack is None else pack
    units, alone = plan_packs(todo, size)
    for line in describe_plan(units, alone, size) + plan_estimate(todo, process_each=isolation == "process"):
        console.print(markup(line), highlight=False)
    if too_big := pack_memory_problem(units):  # before the first pack allocates
        raise UsageError(too_big)
    seen = planned_records(results_dir)
    with Interrupts(inline=isolation == "inline") as stop, \
            sweep_progress(console, progress=progress, current=True) as bar:
        task = bar.add_task(sweep.name, total=len(todo), current="")
        started: list[str] = []

        def execute(runs: list[PlannedRun], claims: list[RunClaim]) -> None:
            """Train the claimed runs at once (one: alone); each finished meanwhile by another process is
            left as it is."""
            try:
                mine = []
                for run, claim in zip(runs, claims):
                    if finished_elsewhere(results_dir, run.run_id, seen):
                        result.elsewhere += 1
                        bar.console.print(f"[green]✓[/green] done elsewhere {'':>22}{run.run_id}  (by another "
                                          "process)", highlight=False)
                        claim.release()
                    else:
                        mine.append((run, claim))
                if not mine:
                    return
                runs, claims = [r for r, _ in mine], [c for _, c in mine]
                bar.update(task, current=runs[0].run_id if len(runs) == 1 else f"pack of {len(runs)}: {runs[0].run_id} …")
                for run in runs:
                    started.append(run.run_id)
                    if progress and not bar.console.is_terminal:  # a log has no live bar: say what starts
                        bar.console.print(f"started {len(started)}/{len(todo)}  {run.run_id}  {markup(run.describe())}",
                                          highlight=False)
                jobs = [Job(cfg=r.cfg, run_id=r.run_id, results_dir=results_dir, extra=sweep.provenance(r),
                            cache_dir=cache_dir) for r in runs]
                t0 = time.monotonic()
                try:
                    rows = run_jobs(jobs, isolation=isolation, interrupts=stop, claims=claims)
                except SaveError as e:  # the folder takes no more: so would every later run's record
                    result.not_saved = str(e)
                    rows = getattr(e, "rows", None) or [{"run_id": r.run_id, "status": "failed", "error": str(e)}
                                                        for r in runs]
                result.rows.extend(rows)
                for run, row in zip(runs, rows):
                    print_run(bar.console, run, row, time.monotonic() - t0, results_dir)
            finally:
                for claim in claims:
                    claim.release()

        try:
            later = []
            for unit in units:
                if stop.stopped or result.not_saved:
                    break
                claimed, runs = [], []
                for run in unit.runs:
                    claim = try_claim(results_dir / run.run_id)
                    if claim is None:
                        pid = claimant(results_dir / run.run_id)
                        bar.console.print(f"[yellow]…[/yellow] {run.run_id} is running in another process"
                                          f"{f' (pid {pid})' if pid else ''}; coming back to it later"
                                          f"{' (alone)' if len(unit.runs) > 1 else ''}", highlight=False)
                        later.append(run)
                    else:
                        claimed.append(claim)
                        runs.append(run)
                execute(runs, claimed)
                bar.advance(task, len(runs))
            for run in later:
                if stop.stopped or result.not_saved:
                    break
                claim = wait_for_claim(results_dir / run.run_id, stop=lambda: stop.stopped)
                if claim is None:
                    break
                execute([run], [claim])
                bar.advance(task)
        except KeyboardInterrupt as e:  # inline mode: a signal between runs; every record is complete
            stop.signum = stop.signum or (e.signum if isinstance(e, Interrupted) else signal.SIGINT)
        result.interrupted = stop.stopped
    if not result.not_saved:  # a folder that takes no more would only refuse the repair too
        repair_runs_csv(results_dir)
    return result


def planned_records(results_dir: Path) -> dict[str, str | None]:
    """{run id: start of its record} as the folder holds them when the sweep is planned."""
    return {r["run_id"]: r.get("started_at") for r in result_rows(results_dir, warn=None)}


def finished_elsewhere(results_dir: Path, run_id: str, planned: dict[str, str | None]) -> bool:
    """Whether another process sharing the folder finished ``run_id`` since the plan was made: its
    record is done and is not the one seen then. Asked while holding the run's claim."""
    mine = run_record(results_dir / run_id)
    return mine is not None and mine.get("status") in FINISHED and mine.get("started_at") != planned.get(run_id)


def print_run(console, run: PlannedRun, row: dict, seconds: float, results_dir: Path) -> None:
    st = str(row.get("status"))
    mark = {"done": "[green]✓[/green]", "failed": "[red]✗[/red]", "diverged": "[yellow]~[/yellow]"}.get(
        st, "[yellow]![/yellow]")
    step = row.get("step_ms_median")
    step_text = f"step {step:7.2f} ms" if st == "done" and isinstance(step, (int, float)) else ""
    console.print(f"{mark} {st:<11} {seconds:6.1f} s  {step_text:<16} {run.run_id}  {markup(run.describe())}",
                  highlight=False, no_wrap=True, overflow="ellipsis")
    if st != "done":
        err = str(row.get("error") or "").splitlines()[0][:300] if row.get("error") else ""
        console.print(f"    {markup(err)}\n    log: {markup(results_dir / run.run_id / 'worker.log')}", highlight=False)
