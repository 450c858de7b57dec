"""Sweep files: parse a YAML sweep (``name``, ``base``, ``grid``, ``runs``, ``repeats``), report
every problem of every run it expands to at once, expand it into planned runs with
deterministic ids, and run the plan: shard selection, resume (finished runs are skipped; failed and
interrupted ones rerun), a progress bar over runs and a summary. How one run is isolated and
interrupted lives in ``worker``.

Precedence of settings: defaults < ``base`` < the ``grid`` point < the explicit ``runs`` entry <
CLI overrides (``--device``, ``--data-file``). Relative ``data_file`` / ``weights_dir`` values are
resolved against the YAML file's folder, so a sweep file can point at data shipped beside it.
Run ids hash the settings *as the file declares them* (before CLI overrides and path resolution):
the same sweep run on two machines with different data paths or devices yields the same ids, so
their results merge by run id."""

from __future__ import annotations

import difflib
import hashlib
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .config import TrainConfig, type_problems, unknown_key_problems
from .errors import ConfigError, UsageError

SWEEP_KEYS = ("name", "base", "grid", "runs", "repeats")
PATH_SETTINGS = ("data_file", "weights_dir")  # resolved against the YAML file's folder
OVERRIDABLE = ("device", "data_file")  # environment-specific: may differ per machine, not in the id
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: its id, repeat index, label, what sets it apart, and its settings."""

    index: int
    run_id: str
    repeat: int
    label: str
    point: dict  # the grid / runs values of this run (what differs from base)
    cfg: TrainConfig  # effective settings: paths resolved, CLI overrides applied

    def describe(self) -> str:
        return self.label or _describe(self.point)


@dataclass(frozen=True)
class Sweep:
    name: str
    path: Path
    sha256: str
    repeats: int
    runs: tuple[PlannedRun, ...]

    def provenance(self, run: PlannedRun) -> dict:
        """Extra result columns that tie a run to the file it came from."""
        return {"sweep_name": self.name, "sweep_file": self.path.as_posix(), "sweep_sha256": self.sha256,
                "sweep_label": run.label or None, "repeat": run.repeat}


# -- loading and validation ----------------------------------------------------------------------
def load_sweep(path: Path, *, overrides: dict[str, Any] | None = None) -> Sweep:
    """Parse, validate and expand a sweep file; ConfigError lists every problem found."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"sweep file not found: {path}")
    raw = path.read_bytes()
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError([f"not valid YAML: {e}"], source=str(path)) from None
    problems: list[str] = []
    name, base, grid, runs, repeats = _structure(data, problems)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    points = _points(grid, runs, problems)
    planned: list[tuple[str, dict, TrainConfig, TrainConfig]] = []
    by_message: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    for label, point in points:
        declared = {**base, **point}
        effective = {**_resolve_paths(declared, path.parent), **overrides}
        desc = label or _describe(point)
        try:
            cfg = TrainConfig.from_mapping(effective)
            errs = _combination_problems(cfg)
        except ConfigError as e:
            cfg, errs = None, e.problems
        for msg in errs:
            by_message.setdefault(msg, []).append(desc)
        if cfg is None or errs:
            continue
        # the id is the file's own settings: a --data-file or --device override leaves it alone
        id_cfg = cfg.replace(**{k: declared.get(k, getattr(TrainConfig(), k)) for k in (*PATH_SETTINGS, "device")})
        from .run import settings_hash  # torch import: only once the file parsed

        key = settings_hash(id_cfg)
        if key in seen:
            problems.append(f"{desc} has the same settings as {seen[key]} (they would share run ids); "
                            "remove one or give it a setting that differs")
            continue
        seen[key] = desc
        planned.append((label, point, cfg, id_cfg))
    problems += [_group_message(msg, descs, len(points)) for msg, descs in by_message.items()]
    if problems:
        raise ConfigError(problems, source=str(path))
    from .run import make_run_id

    runs_out = []
    for repeat in range(repeats):  # repeat-major: drift over a long sweep spreads over every setting
        for label, point, cfg, id_cfg in planned:
            runs_out.append(PlannedRun(index=len(runs_out), run_id=make_run_id(id_cfg, repeat=repeat),
                                       repeat=repeat, label=label, point=point, cfg=cfg))
    return Sweep(name=name, path=path, sha256=hashlib.sha256(raw).hexdigest(), repeats=repeats,
                 runs=tuple(runs_out))


def validate_files(paths: list[Path], *, console) -> list[Sweep]:
    """Check every file and print what each expands to; UsageError at the end if any had problems."""
    sweeps, bad = [], 0
    for path in paths:
        try:
            sw = load_sweep(path)
        except ConfigError as e:
            bad += 1
            console.print(f"[red]✗[/red] {e}", highlight=False)
            continue
        sweeps.append(sw)
        console.print(f"[green]✓[/green] {path}: sweep {sw.name!r}, {len(sw.runs)} runs "
                      f"({len(sw.runs) // sw.repeats} settings × {sw.repeats} repeats)", highlight=False)
    if bad:
        raise UsageError(f"{bad} of {len(paths)} sweep file(s) have problems (listed above)")
    return sweeps


def _structure(data: Any, problems: list[str]) -> tuple[str, dict, dict, list, int]:
    if not isinstance(data, dict):
        problems.append("a sweep file is a mapping with keys: " + ", ".join(SWEEP_KEYS))
        return "", {}, {}, [], 1
    fields = TrainConfig.field_names()
    for key in data:
        if key in SWEEP_KEYS:
            continue
        if key in fields:
            problems.append(f"{key!r} is a run setting: put it under base: (or grid: / runs:)")
        else:
            close = difflib.get_close_matches(str(key), SWEEP_KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"unknown top-level key {key!r}; {hint}allowed: {', '.join(SWEEP_KEYS)}")
    name = data.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        problems.append(f"name={name!r}: give the sweep a name of letters, digits, '.', '_' or '-' "
                        "(it names the results folder)")
    base = _settings(data.get("base"), "base", problems)
    grid = _grid(data.get("grid"), problems)
    runs = _runs(data.get("runs"), problems)
    repeats = data.get("repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        problems.append(f"repeats={repeats!r} must be a whole number of at least 1")
        repeats = 1
    return str(name), base, grid, runs, repeats


def _settings(mapping: Any, where: str, problems: list[str]) -> dict:
    """The valid settings of one mapping; every bad key or value is added to ``problems``."""
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        problems.append(f"{where} must be a mapping of settings, got {mapping!r}")
        return {}
    known = {k: v for k, v in mapping.items() if k in TrainConfig.field_names()}
    problems += [f"{where}: {p}" for p in unknown_key_problems(mapping)]
    bad = type_problems(known)
    problems += [f"{where}: {p}" for p in bad]
    return {k: v for k, v in known.items() if not type_problems({k: v})}


def _grid(grid: Any, problems: list[str]) -> dict[str, list]:
    if grid is None:
        return {}
    if not isinstance(grid, dict):
        problems.append(f"grid must map settings to lists of values, got {grid!r}")
        return {}
    problems += [f"grid: {p}" for p in unknown_key_problems(grid)]
    out = {}
    for key, values in grid.items():
        if key not in TrainConfig.field_names():
            continue
        if not isinstance(values, list) or not values:
            problems.append(f"grid.{key} must be a non-empty list of values, got {values!r} "
                            "(a single value belongs in base)")
            continue
        if len({repr(v) for v in values}) != len(values):
            problems.append(f"grid.{key} lists a value twice: {values!r}")
        good = []
        for v in values:
            bad = type_problems({key: v})
            problems += [f"grid: {p}" for p in bad]
            if not bad and v not in good:
                good.append(v)
        if good:
            out[key] = good
    return out


def _runs(runs: Any, problems: list[str]) -> list[tuple[str, dict]]:
    if runs is None:
        return []
    if not isinstance(runs, list) or not runs:
        problems.append(f"runs must be a non-empty list of setting mappings, got {runs!r}")
        return []
    out = []
    for i, entry in enumerate(runs):
        entry = dict(entry) if isinstance(entry, dict) else entry
        label = entry.pop("label", "") if isinstance(entry, dict) else ""
        if not isinstance(label, str):
            problems.append(f"runs[{i}].label must be text, got {label!r}")
            label = ""
        out.append((label, _settings(entry, f"runs[{i}]" + (f" ({label})" if label else ""), problems)))
    return out


def _points(grid: dict[str, list], runs: list[tuple[str, dict]], problems: list[str]) -> list[tuple[str, dict]]:
    """Explicit runs (outer) × the grid's cartesian product (inner, last key fastest)."""
    grid_points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    if not runs:
        return [("", g) for g in grid_points]
    out = []
    for i, (label, run) in enumerate(runs):
        clash = sorted(set(run) & set(grid))
        if clash:
            problems.append(f"runs[{i}] sets {', '.join(clash)}, which grid also varies; keep it in one place")
        out += [(label, {**g, **run}) for g in grid_points]
    return out


def _resolve_paths(settings: dict, folder: Path) -> dict:
    out = dict(settings)
    for key in PATH_SETTINGS:
        value = out.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            out[key] = str((folder / value).resolve())
        elif isinstance(value, str) and value:
            out[key] = str(Path(value).expanduser())
    return out


def _combination_problems(cfg: TrainConfig) -> list[str]:
    """Impossible combinations ``TrainConfig.problems`` leaves to run time (model-shape checks)."""
    from .model import gpt_config, resolve_model_size

    try:
        size = resolve_model_size(cfg.model_size)
    except ValueError:
        return []  # already reported
    out = []
    if size == "tiny" and cfg.weights == "pretrained":
        out.append("model_size=tiny has no pretrained checkpoint; use weights=random")
    try:
        mcfg = gpt_config(size, emb_dim=cfg.emb_dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads)
    except (ValueError, ZeroDivisionError) as e:
        return out + [str(e)]
    if str(cfg.context_length).isdigit() and int(cfg.context_length) > mcfg.context_length:
        out.append(f"context_length={cfg.context_length} exceeds the model's context length {mcfg.context_length}")
    return out


def _describe(point: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items()) or "base settings"


def _group_message(msg: str, descs: list[str], total: int) -> str:
    """One line per distinct problem, naming the runs it affects (not one line per run)."""
    if total > 1 and len(descs) == total:
        return f"all {total} runs: {msg}"
    if len(descs) == 1:
        return f"run ({descs[0]}): {msg}"
    shown = "; ".join(descs[:3]) + (f"; and {len(descs) - 3} more" if len(descs) > 3 else "")
    return f"{len(descs)} runs ({shown}): {msg}"


# -- shards --------------------------------------------------------------------------------------
def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``I/N`` with 1 <= I <= N (1-based, as a person counts shards)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not (1 <= int(m.group(1)) <= int(m.group(2))):
        raise UsageError(f"--shard {text!r} is not allowed; use I/N with 1 <= I <= N, e.g. 1/4 … 4/4")
    return int(m.group(1)), int(m.group(2))


def select_shard(runs: tuple[PlannedRun, ...] | list[PlannedRun], shard: tuple[int, int] | None) -> list[PlannedRun]:
    """Round-robin over the expanded order: disjoint, covering, balanced to within one run, and
    each shard gets a share of every model size (the grid's outer keys)."""
    if shard is None:
        return list(runs)
    i, n = shard
    return [r for r in runs if r.index % n == i - 1]


# -- running -------------------------------------------------------------------------------------
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
        from .worker import EXIT_INTERRUPTED

        return EXIT_INTERRUPTED if self.interrupted else (1 if self.count("failed") else 0)


def run_sweep(sweep: Sweep, *, results_dir: Path, console, isolation: str = "process", fresh: bool = False,
              shard: tuple[int, int] | None = None, progress: bool = True, cache_dir: Path | None = None) -> SweepResult:
    """Run the (shard's) runs not yet done, each isolated; a failure is recorded and the sweep
    goes on; SIGINT / SIGTERM stops it after recording the interrupted run."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .worker import ISOLATION, Interrupts, Job, run_job

    if isolation not in ISOLATION:
        raise UsageError(f"--isolation {isolation!r} is not allowed; choose one of: {', '.join(ISOLATION)}")
    results_dir = Path(results_dir)
    runs = select_shard(sweep.runs, shard)
    _preflight(runs, console)
    if fresh:
        forget_runs(results_dir, [r.run_id for r in runs])
    status = run_statuses(results_dir)
    todo = [r for r in runs if status.get(r.run_id) != "done"]
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
                bar.console.print(_run_line(run, row, time.monotonic() - t0, results_dir), highlight=False)
                bar.advance(task)
        except KeyboardInterrupt:  # inline mode: a signal between runs; every record is complete
            stop.signum = stop.signum or 2
        result.interrupted = stop.stopped
    return result


def _preflight(runs: list[PlannedRun], console) -> None:
    """Environment checks that `validate` cannot do on another machine: fail before the first run."""
    from .run import resolve_device

    for device in sorted({r.cfg.device for r in runs}):
        resolve_device(device)  # UsageError when CUDA is asked for and absent
    for path in sorted({r.cfg.data_file for r in runs if r.cfg.data_file}):
        if not Path(path).is_file():
            console.print(f"[yellow]warning:[/yellow] data_file {path} does not exist; runs using it will fail",
                          highlight=False)


def run_statuses(results_dir: Path) -> dict[str, str]:
    from .report import result_rows

    return {r["run_id"]: r.get("status", "") for r in result_rows(Path(results_dir))}


def forget_runs(results_dir: Path, run_ids: list[str]) -> int:
    """``--fresh``: drop these runs' rows and folders (only this sweep's / shard's runs)."""
    import shutil

    import pandas as pd

    from .results import run_column_names, write_csv

    ids = set(run_ids)
    csv = Path(results_dir) / "runs.csv"
    gone = 0
    if csv.is_file():
        rows = pd.read_csv(csv, dtype=str, keep_default_na=False).to_dict("records")
        keep = [r for r in rows if r.get("run_id") not in ids]
        gone = len(rows) - len(keep)
        write_csv(csv, keep, run_column_names())
    for run_id in ids:
        if (Path(results_dir) / run_id).is_dir():
            shutil.rmtree(Path(results_dir) / run_id)
    return gone


def _run_line(run: PlannedRun, row: dict, seconds: float, results_dir: Path) -> str:
    st = row.get("status")
    mark = {"done": "[green]✓[/green]", "failed": "[red]✗[/red]"}.get(st, "[yellow]![/yellow]")
    line = f"{mark} {st:<11} {run.run_id}  {run.describe()}  {seconds:.1f} s"
    step = row.get("step_ms_median")
    if st == "done" and isinstance(step, (int, float)):
        line += f"  step {step:.2f} ms"
    if st != "done":
        err = str(row.get("error") or "").splitlines()[0][:300] if row.get("error") else ""
        line += f"\n    {err}\n    log: {results_dir / run.run_id / 'worker.log'}"
    return line


def print_plan(sweep: Sweep, runs: list[PlannedRun], *, results_dir: Path, console) -> None:
    """``--dry-run``: every run of the shard and whether it would run, rerun or be skipped."""
    from rich.table import Table

    status = run_statuses(results_dir)
    table = Table(title=f"{sweep.path} → {results_dir}  (sweep {sweep.name}, sha256 {sweep.sha256[:12]})",
                  title_justify="left")
    for col in ("#", "run id", "repeat", "settings", "action"):
        table.add_column(col)
    todo = 0
    for r in runs:
        st = status.get(r.run_id)
        action = "skip (done)" if st == "done" else (f"rerun ({st})" if st else "run")
        todo += st != "done"
        table.add_row(str(r.index), r.run_id, str(r.repeat), r.describe(), action)
    console.print(table)
    console.print(f"{len(runs)} runs: {todo} to run, {len(runs) - todo} already done", highlight=False)


def print_summary(sweep: Sweep, result: SweepResult, *, results_dir: Path, console) -> None:
    parts = [f"{result.count('done')} done", f"{result.count('failed')} failed",
             f"{result.skipped} skipped (done earlier)"]
    if result.count("interrupted") or result.not_started:
        parts += [f"{result.count('interrupted')} interrupted", f"{result.not_started} not started"]
    colour = "red" if result.count("failed") or result.interrupted else "green"
    console.print(f"[bold {colour}]sweep {sweep.name}[/bold {colour}]: {result.selected} runs — "
                  + ", ".join(parts), highlight=False)
    for row in result.rows:
        if row.get("status") == "failed":
            console.print(f"  [red]failed[/red] {row['run_id']}: {str(row.get('error', ''))[:300]}", highlight=False)
    if result.interrupted:
        console.print("interrupted: finished results are kept; run the same command again to resume",
                      highlight=False)
    console.print(f"results: {results_dir / 'runs.csv'}   report: lora-bench report {results_dir}", highlight=False)


def sweep_command(file: Path, *, overrides: dict, results_dir: Path | None, cache_dir: Path | None,
                  isolation: str, fresh: bool, dry_run: bool, shard: str | None, progress: bool, console) -> int:
    """What ``lora-bench sweep`` does: validate, then list (dry run) or run; returns the exit code."""
    sw = load_sweep(file, overrides=overrides)
    results_dir = Path(results_dir) if results_dir else Path("results") / sw.name
    selected = parse_shard(shard)
    if dry_run:
        print_plan(sw, select_shard(sw.runs, selected), results_dir=results_dir, console=console)
        return 0
    result = run_sweep(sw, results_dir=results_dir, console=console, isolation=isolation, fresh=fresh,
                       shard=selected, progress=progress, cache_dir=cache_dir)
    print_summary(sw, result, results_dir=results_dir, console=console)
    return result.exit_code
