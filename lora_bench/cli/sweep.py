"""``lora-bench validate`` and ``lora-bench sweep``: check sweep files; run one (resuming by
default), with ``key=value`` overrides applied to every run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from lora_bench.cli.options import (
    PRECEDENCE,
    CacheDir,
    Logger,
    NoProgress,
    Overrides,
    PrintConfig,
    console,
    print_config,
    results_dir_option,
)
from lora_bench.config import (
    ADAPTER_SETTINGS,
    PATH_SETTINGS,
    TrainConfig,
    flag_name,
    key_name,
    parse_overrides,
    problem,
    render,
    value_problems,
)
from lora_bench.errors import ConfigError, UsageError

SweepFiles = Annotated[list[Path], typer.Argument(help="Sweep YAML files.", show_default=False)]

SWEEP_HELP = f"""Run every configuration of a sweep file; resumes by default (finished runs are skipped).

A sweep file holds [bold]name[/bold], [bold]base[/bold] (the settings of every run), [bold]grid[/bold] \
(every combination of the listed values), [bold]runs[/bold] (explicit runs, each crossed with the grid), \
[bold]repeats[/bold] (default 1) and [bold]vary_seed[/bold]. By default every repeat uses the same seed, so \
repeats measure timing noise; with vary_seed: true repeat r runs with seed + r, so repeats also measure the \
spread of accuracy over seeds.

{PRECEDENCE.replace("a [bold]--config[/bold] file", "the sweep file")} Overrides apply to every run.

Examples:

[bold]lora-bench sweep configs/smoke.yaml[/bold]

[bold]lora-bench sweep configs/smoke.yaml max_steps=4 --results-dir results/smoke-short[/bold]
"""


def validate(files: SweepFiles, machine: Annotated[bool, typer.Option(
        "--machine/--no-machine", help="Also check the runs on this machine as the sweep does (device, packages, "
                                       "memory) and estimate their time here; --no-machine: the files alone, for "
                                       "another machine.")] = True) -> None:
    """Check every run of each sweep file and report all problems at once (nothing runs)."""
    from lora_bench.sweep.spec import validate_files

    validate_files(files, console=console, machine=machine)


def sweep_overrides(items: list[str], *, device: str | None,
                    data_file: Path | None) -> tuple[dict[str, Any], Callable[[str], str]]:
    """The overrides of every run: ``key=value`` items and the ``--device`` / ``--data-file`` flags,
    each value checked on its own (named as the user wrote it) and relative paths read from here."""
    values, problems = parse_overrides(items)
    flags = {k: v for k, v in (("device", device), ("data_file", str(data_file) if data_file else None)) if v}
    for name in sorted(set(values) & set(flags)):
        problems.append(problem(name, "{setting} is given twice: as " + flag_name(name) + " and as " + name + "=…"))
    values.update(flags)

    def name_of(name: str) -> str:
        return flag_name(name) if name in flags else key_name(name)

    problems += [p for k, v in values.items() for p in value_problems(k, v)]
    if problems:
        raise ConfigError(render(problems, name_of))
    for key in PATH_SETTINGS:
        if isinstance(values.get(key), str) and values[key]:
            values[key] = str(Path(values[key]).expanduser().resolve())
    return values, name_of


def sweep(
    file: Annotated[Path, typer.Argument(metavar="FILE.yaml", help="Sweep YAML file (see configs/).",
                                         show_default=False)],
    overrides: Overrides = None,
    device: Annotated[Optional[str], typer.Option(help="Every run's device: auto, cpu, cuda, cuda:N "
                                                       "(run ids stay those of the file).")] = None,
    data_file: Annotated[Optional[Path], typer.Option(help="Every run's data_file, the raw SMS TSV (run ids stay "
                                                           "those of the file).")] = None,
    results_dir: Annotated[Optional[Path], results_dir_option("Results folder (default: results/<name of the "
                                                              "sweep>).")] = None,
    cache_dir: CacheDir = None,
    isolation: Annotated[str, typer.Option(help="process (each run in a child process) or inline.")] = "process",
    fresh: Annotated[bool, typer.Option("--fresh", help="Forget earlier results of these runs and start over.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and list the runs; run nothing.")] = False,
    machine: Annotated[bool, typer.Option(
        "--machine/--no-machine", help="With --dry-run: also check the runs on this machine as the sweep does "
                                       "(device, packages, memory) and estimate their time here; --no-machine: "
                                       "list the plan for another machine (a GPU's sweep, listed on a laptop).")
    ] = True,
    shard: Annotated[Optional[str], typer.Option(help="Run only shard I of N (I/N, 1-based), e.g. 2/4.")] = None,
    only: Annotated[Optional[list[str]], typer.Option(
        metavar="KEY=VALUE", help="Run only the runs whose setting KEY (or label) is VALUE, e.g. --only label=best "
                                  "--only model_size=124M; repeat a key for more values. Run ids, resume and "
                                  "shards stay those of the whole file (the shard is taken first).",
        show_default=False)] = None,
    workers: Annotated[Optional[int], typer.Option(
        help="Runs at once on a local Dask cluster, worker i on GPU i (default: one per GPU where there are "
             "several; 0: one run at a time, here).", show_default=False)] = None,
    scheduler: Annotated[Optional[str], typer.Option(
        metavar="tcp://HOST:PORT", help="Run on an existing Dask cluster, through its scheduler (its workers: one "
                                        "thread and one GPU each).", show_default=False)] = None,
    pack: Annotated[Optional[int], typer.Option(
        metavar="N", help=f"Train up to N runs at once on one model, in one process (default: the sweep file's "
                          f"pack key, else 1): runs that differ only in {', '.join(ADAPTER_SETTINGS)} pack; "
                          "only trainable_layers=lora (docs/packing.md).", show_default=False)] = None,
    no_progress: NoProgress = False,
    logger: Logger = None,
    print_config_: PrintConfig = False,
) -> None:
    from lora_bench.sweep.sweep_command import sweep_command
    from lora_bench.sweep.isolation import ISOLATION
    from lora_bench.sweep.spec import pack_size_problem
    from lora_bench.train.preflight import input_problems

    if not machine and not dry_run:
        raise UsageError("--no-machine lists a plan for another machine: it needs --dry-run (a sweep that runs, "
                         "runs here and is checked here)")
    if isolation not in ISOLATION:
        raise UsageError(f"--isolation {isolation!r} is not allowed; choose one of: {', '.join(ISOLATION)}")
    if pack is not None and pack_size_problem(pack):
        raise UsageError(f"--pack {pack}: {pack_size_problem(pack)}")
    values, name_of = sweep_overrides(overrides or [], device=device, data_file=data_file)
    if print_config_:  # every run's settings as the sweep resolves them, then exit 0
        from lora_bench.sweep.spec import load_sweep

        planned = load_sweep(file, overrides=values)
        print_config({"name": planned.name, "runs": [{"run_id": r.run_id, "settings": r.cfg.to_dict()}
                                                     for r in planned.runs]})
        raise typer.Exit(0)
    paths = {k: v for k, v in values.items() if k in PATH_SETTINGS and v}
    missing = render(input_problems(TrainConfig(**paths)), name_of) if paths else []
    if missing:
        raise UsageError("; ".join(missing))
    if results_dir is not None and results_dir.exists() and not results_dir.is_dir():
        raise UsageError(f"--results-dir {results_dir}: a file is in the way of this folder")
    if logger is not None:
        from lora_bench.trackers.export import check_logger

        check_logger(logger, results_dir or Path("results"))
    code = sweep_command(file, overrides=values, results_dir=results_dir, cache_dir=cache_dir,
                                   isolation=isolation, fresh=fresh, dry_run=dry_run, shard=shard,
                                   progress=not no_progress, console=console, workers=workers,
                                   scheduler=scheduler, pack=pack, only=only, machine=machine)
    if logger is not None and not dry_run:
        from lora_bench.escaping import markup
        from lora_bench.sweep.spec import load_sweep
        from lora_bench.trackers.export import log_folder

        folder = results_dir or Path("results") / load_sweep(file, overrides=values).name
        log_folder(folder, to=logger, say=lambda line: console.print(markup(line), highlight=False))
    raise typer.Exit(code)
