"""``lora-bench sweep``: validate a sweep file, then list its plan (``--dry-run``) or run it, and
print the summary."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import torch

from lora_bench.errors import UsageError
from lora_bench.escaping import markup, terminal
from lora_bench.optional import require
from lora_bench.results.manifest import start_invocation
from lora_bench.results.store import FINISHED
from lora_bench.sweep.machine import preflight_runs
from lora_bench.sweep.packs import describe_plan, plan_packs
from lora_bench.sweep.plan_time import plan_estimate
from lora_bench.sweep.resume import resume_statuses
from lora_bench.sweep.runner import run_sweep
from lora_bench.sweep.spec import PlannedRun, Sweep, load_sweep, parse_only, parse_shard, select_only, select_shard


def print_plan(sweep: Sweep, runs: list[PlannedRun], *, results_dir: Path, console) -> None:
    """``--dry-run``: every run of the shard and whether it would run, rerun or be skipped, one
    aligned line each, written as it is (a rich table takes minutes to lay out 100,000 rows, and
    rich's wrapping seconds), every value shown as text (``escaping.terminal``)."""
    status = resume_statuses(results_dir, runs, sweep.name)
    title = f"{sweep.path} → {results_dir}  (sweep {sweep.name}, sha256 {sweep.sha256[:12]})"
    rows, todo = [], 0
    for r in runs:
        st, row_id = status.get(r.run_id, (None, None))
        if st in FINISHED:
            action = f"skip ({st})" if row_id == r.run_id else f"skip ({st} as {row_id})"
        else:
            action = f"rerun ({st})" if st else "run"
        todo += st not in FINISHED
        rows.append((str(r.index), r.run_id, str(r.repeat), action, r.describe()))
    head = ("#", "run id", "repeat", "action", "settings")
    width = [max([len(head[i]), *(len(row[i]) for row in rows)]) for i in range(4)]

    def line(cells: tuple[str, ...]) -> str:
        n, run_id, repeat, action, settings = (terminal(c) for c in cells)
        return (f"{n:>{width[0]}}  {run_id:<{width[1]}}  {repeat:>{width[2]}}  {action:<{width[3]}}  "
                f"{settings}").rstrip()

    console.file.write("\n".join([terminal(title), line(head), *map(line, rows)]) + "\n")  # no rich wrapping
    console.print(f"{len(runs)} runs: {todo} to run, {len(runs) - todo} already finished", highlight=False)


def print_summary(sweep: Sweep, result, *, results_dir: Path, console) -> None:
    """Counts of done / failed / skipped (and diverged / interrupted / not started), then each run
    that failed or diverged."""
    parts = [f"{result.count('done')} done", f"{result.count('failed')} failed",
             f"{result.skipped} skipped (finished earlier)"]
    if result.count("diverged"):
        parts.insert(1, f"{result.count('diverged')} diverged")
    if result.elsewhere:
        parts.append(f"{result.elsewhere} done by another process")
    if result.count("interrupted") or result.not_started:
        parts += [f"{result.count('interrupted')} interrupted", f"{result.not_started} not started"]
    colour = "red" if result.count("failed") or result.interrupted or result.not_saved else "green"
    console.print(f"[bold {colour}]sweep {sweep.name}[/bold {colour}]: {result.selected} runs — "
                  + ", ".join(parts), highlight=False)
    for row in result.rows:
        if row.get("status") in ("failed", "diverged"):
            error = str(row.get("error") or "").splitlines()[0][:160] if row.get("error") else ""
            colour = "red" if row["status"] == "failed" else "yellow"
            console.print(f"  [{colour}]{markup(row['status'])}[/{colour}] {markup(row['run_id'])}: {markup(error)}",
                          highlight=False)
    if result.interrupted:
        console.print("interrupted: finished results are kept; run the same command again to resume",
                      highlight=False)
    if result.not_saved:
        console.print(f"[bold red]stopped:[/bold red] {markup(result.not_saved)}", highlight=False)
        console.print("the runs after it were not started; run the same command again to resume once there is room",
                      highlight=False)
    console.print(f"results: {markup(results_dir / 'runs.csv')}   report: lora-bench report {markup(results_dir)}",
                  highlight=False)


def sweep_command(file: Path, *, overrides: dict, results_dir: Path | None, cache_dir: Path | None,
                  isolation: str, fresh: bool, dry_run: bool, shard: str | None, progress: bool, console,
                  workers: int | None = None, scheduler: str | None = None, pack: int | None = None,
                  only: list[str] | None = None, machine: bool = True) -> int:
    """What ``lora-bench sweep`` does: validate, then list (dry run) or run, here or on a Dask
    cluster (see ``use_dask``); returns the exit code. ``pack``: --pack, over the file's key.
    ``only``: --only KEY=VALUE items; the shard is taken first, then the filter (so the shards of
    the whole plan stay what they are), and the runners get the runs that are left. ``machine``
    False (a dry run's --no-machine): the plan is listed without asking this machine about it."""
    sw = load_sweep(file, overrides=overrides)
    results_dir = Path(results_dir) if results_dir else Path("results") / sw.name
    selected = parse_shard(shard)
    wanted = parse_only(only)
    if wanted:
        sw = replace(sw, runs=tuple(select_only(select_shard(sw.runs, selected), wanted)))
        selected = None
    size = sw.pack if pack is None else pack
    if size > 1 and (scheduler is not None or workers):
        where = "--scheduler" if scheduler is not None else f"--workers {workers}"
        raise UsageError(f"packing ({'--pack' if pack is not None else 'the sweep key pack:'} {size}) trains its packs "
                         f"in this sweep's own process, not on a Dask cluster; drop {where}, or pack 1")
    if dry_run:
        runs = select_shard(sw.runs, selected)
        if scheduler is None and machine:  # a cluster's workers are asked by the sweep itself, on their machines
            preflight_runs(runs, console)
        print_plan(sw, runs, results_dir=results_dir, console=console)
        status = resume_statuses(results_dir, runs, sw.name)
        todo = [r for r in runs if status.get(r.run_id, ("",))[0] not in FINISHED]
        units, alone = plan_packs(todo, size)
        for line in describe_plan(units, alone, size):
            console.print(markup(line), highlight=False)
        if not machine:
            console.print("not checked on this machine (--no-machine): the sweep checks device, packages and "
                          "memory where it runs", highlight=False)
            return 0
        for line in plan_estimate(todo, process_each=isolation == "process"):
            console.print(markup(line), highlight=False)
        return 0
    dask = size <= 1 and use_dask(sw, workers=workers, scheduler=scheduler, isolation=isolation, console=console)
    start_invocation()  # its runs, also in child processes, record this command line and commit
    if dask:
        require("distributed", purpose="lora-bench sweep --workers / --scheduler", extra="distributed")
        from lora_bench.sweep.dask_runner import run_sweep_dask  # dask: an optional dependency

        result = run_sweep_dask(sw, results_dir=results_dir, console=console, workers=workers or None,
                                scheduler=scheduler, fresh=fresh, shard=selected, progress=progress,
                                cache_dir=cache_dir)
    else:
        result = run_sweep(sw, results_dir=results_dir, console=console, isolation=isolation, fresh=fresh,
                           shard=selected, progress=progress, cache_dir=cache_dir, pack=size)
    print_summary(sw, result, results_dir=results_dir, console=console)
    return result.exit_code


def use_dask(sw: Sweep, *, workers: int | None, scheduler: str | None, isolation: str, console) -> bool:
    """--scheduler or --workers N >= 1: Dask; --workers 0: here, one run at a time; unset: Dask with
    one worker per GPU when this machine has several, every run is for a GPU (device auto or cuda)
    and dask is installed, else here."""
    if workers is not None and workers < 0:
        raise UsageError(f"--workers {workers}: use 0 (one run at a time, here) or more")
    if (scheduler is not None or workers) and isolation != "process":
        raise UsageError("--workers / --scheduler run each run in a child process; drop --isolation inline")
    if scheduler is not None or workers:
        return True
    if workers == 0 or isolation != "process":
        return False
    if torch.cuda.device_count() < 2 or any(r.cfg.device not in ("auto", "cuda") for r in sw.runs):
        return False
    if importlib.util.find_spec("distributed") is None:
        console.print(f"{torch.cuda.device_count()} GPUs, but dask[distributed] is not installed: running one run "
                      "at a time (pip install 'lora-bench[distributed]' to use them all)", highlight=False)
        return False
    return True
