"""``lora-bench train``: one run. Its setting options are generated from the settings'
declaration (``lora_bench.config``); the command merges the defaults, a ``--config`` file, the
flags and ``key=value`` overrides, checks the result once, asks the machine (``preflight``), runs,
and prints the phase table."""

from __future__ import annotations

import inspect
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from lora_bench.cli.options import (
    OUTPUT_PANEL,
    PRECEDENCE,
    Logger,
    NoProgress,
    Overrides,
    PrintConfig,
    console,
    err_console,
    output_dir,
    print_config,
    results_dir_option,
    setting_parameters,
)
from lora_bench.config import (
    DATA,
    DEFAULTS,
    SETTINGS,
    TrainConfig,
    coerce,
    flag_name,
    key_name,
    parse_overrides,
    problem,
    read_settings_file,
    render,
    settings_problems,
)
from lora_bench.errors import ConfigError, Interrupted, LoraBenchError, SaveError
from lora_bench.escaping import markup

HELP = f"""Fine-tune GPT-2 on SMS spam and record accuracy and per-phase timings.

{PRECEDENCE}

Examples:

[bold]lora-bench train --trainable-layers lora --lora-rank 16 --lora-alpha 16[/bold]

[bold]lora-bench train --config run.yaml precision=bf16 lora_rank=4[/bold]
"""

ConfigFile = Annotated[Optional[Path], typer.Option(
    "--config", "-c", metavar="FILE.yaml", show_default=False,
    help="YAML file of settings: the keys of a sweep file's base (lora_rank: 16). Relative paths in it are "
         "read from its folder.")]
CacheDir = Annotated[Optional[Path], typer.Option("--cache-dir", envvar="LORA_BENCH_CACHE", rich_help_panel=DATA,
                                                  help="Download cache (default ~/.cache/lora-bench).")]
Overwrite = Annotated[bool, typer.Option("--overwrite", rich_help_panel=OUTPUT_PANEL,
                                         help="Replace the run of the same --run-id, if any.")]
RunId = Annotated[Optional[str], typer.Option(help="Run id (default: settings hash + time).",
                                              rich_help_panel=OUTPUT_PANEL)]


def _from_command_line(ctx: typer.Context, name: str) -> bool:
    """Was option ``name`` given on the command line (not left at its default)? By the source's
    name: typer may bring its own copy of click's enum."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def scaled_warmup(values: dict[str, Any], *, chosen: set[str]) -> str | None:
    """A run shorter than twice the default warm-up leaves at most half its steps out of the timing
    summaries, so that a short run (``--max-steps 3``) runs and still measures steps. Only where
    the warm-up was left at its default (not in ``chosen``, the settings given); changes
    ``values`` and returns the line that says so, else None."""
    steps, warmup = values.get("max_steps"), values.get("warmup_steps")
    if "warmup_steps" in chosen or values.get("timing") == "off" or not isinstance(steps, int) \
            or isinstance(steps, bool) or not isinstance(warmup, int) or steps < 1 or warmup <= steps // 2:
        return None
    values["warmup_steps"] = steps // 2
    return (f"warm-up: {steps // 2} of the {steps} steps left out of the timing summaries (the default is "
            f"{warmup}; --warmup-steps sets it)")


def settings_from(ctx: typer.Context, *, config: Path | None, overrides: list[str],
                  given: dict[str, Any]) -> tuple[TrainConfig, Any, str | None]:
    """The run's settings by precedence (defaults < file < flags and overrides), every problem at
    once; how to name each setting in later messages: as the flag, or as the key where the file
    or an override gave it; and the line that says the warm-up was scaled down (``scaled_warmup``),
    if it was."""
    values = dict(DEFAULTS)
    as_key: set[str] = set()
    if config is not None:
        from_file = read_settings_file(config)
        values.update(from_file)
        as_key |= set(from_file)
    flags = {n: v for n, v in given.items() if _from_command_line(ctx, n)}
    values.update(flags)
    as_key -= set(flags)
    parsed, problems = parse_overrides(overrides)
    for name in sorted(set(parsed) & set(flags)):
        problems.append(problem(name, "{setting} is given twice: as " + flag_name(name) + " and as " + name + "=…"))
    values.update(parsed)
    as_key |= set(parsed)

    def name_of(name: str) -> str:
        return key_name(name) if name in as_key else flag_name(name)

    scaled = None if problems else scaled_warmup(values, chosen=as_key | set(flags))
    problems += settings_problems(values)
    if problems:
        raise ConfigError(render(problems, name_of))
    return TrainConfig(**{k: coerce(k, v) for k, v in values.items()}), name_of, scaled


def train(ctx: typer.Context, *, given: dict[str, Any], overrides: list[str] | None, config: Path | None,
          results_dir: Path, run_id: str | None, overwrite: bool, cache_dir: Path | None, no_progress: bool,
          logger: str | None = None) -> None:
    """What ``lora-bench train`` does, with ``given`` the setting options' values, through one error
    path: every outcome becomes an exit code here; a domain error is one line (naming the rank
    under torchrun), and only a bug shows a traceback. With ``--nproc N`` it starts N copies of
    this command under torchrun (``lora_bench.train.torchrun``); a copy sees torchrun's environment,
    pins its rank's GPU before anything touches CUDA, runs, and ends its process itself."""
    env = None
    try:
        # the settings alone first: a bad value or file answers before torch and the training stack load
        cfg, name_of, scaled = settings_from(ctx, config=config, overrides=overrides or [], given=given)
        from lora_bench.train.distributed import rank_env, rank_errors

        env = rank_env()
        if scaled and (env is None or env.is_main):
            console.print(scaled, highlight=False, markup=False)
        with rank_errors(env):
            code = _run(cfg, env=env, name_of=name_of, results_dir=results_dir, run_id=run_id, overwrite=overwrite,
                        cache_dir=cache_dir, progress=not no_progress, logger=logger)
    except Interrupted as e:  # recorded, and the run said where: 128 + the signal, as a shell reports
        code = e.exit_code
    except LoraBenchError as e:
        if isinstance(e, SaveError) and e.row.get("timing_clock") not in (None, "off"):
            from lora_bench.report.phase_table import phase_table

            console.print(phase_table(e.row))  # the numbers on the terminal at least, whatever the folder kept
        rank = f"rank {env.rank}: " if env is not None else ""
        err_console.print(f"[bold red]error:[/bold red] {rank}{markup(e, newlines=True)}", highlight=False)
        code = e.exit_code
    except BaseException:
        if env is None:
            raise
        traceback.print_exc()  # a rank's bug, where the launcher collects its output
        code = 1
    if env is not None:  # a rank ends its process itself (see distributed.exit_rank)
        from lora_bench.train.distributed import exit_rank

        exit_rank(code)
    if code:
        raise typer.Exit(code)


def _run(cfg: TrainConfig, *, env, name_of, results_dir: Path, run_id: str | None, overwrite: bool,
         cache_dir: Path | None, progress: bool, logger: str | None) -> int:
    """The machine asked once (``preflight``), then the run: started under torchrun (``--nproc``),
    or executed here, by this process or this rank. Returns the exit code."""
    from lora_bench.train.distributed import rank_device
    from lora_bench.train.identity import make_run_id
    from lora_bench.train.preflight import preflight
    from lora_bench.train.run import execute_run

    if env is not None:
        rank_device(env, cfg.device)
    preflight(cfg, name_of=name_of)
    output_dir(results_dir, "--results-dir")
    if logger is not None:
        from lora_bench.trackers.export import check_logger

        check_logger(logger, results_dir)
    if cfg.nproc > 1 and env is None:
        from lora_bench.train.torchrun import launch_train

        return launch_train(cfg, argv=sys.argv[1:], results_dir=results_dir, overwrite=overwrite,
                            run_id=run_id or make_run_id(cfg), console=console)
    row = execute_run(cfg, results_dir=results_dir, run_id=run_id, console=console, progress=progress,
                      cache_dir=cache_dir, overwrite=overwrite, estimate=progress)
    if env is None or env.is_main:
        _report(row, results_dir, logger=logger)
    return 0


def _report(row: dict, results_dir: Path, *, logger: str | None = None) -> None:
    """The run's phase table and where its results are; the run exported where ``--logger`` asks."""
    from lora_bench.report.phase_table import phase_table

    if row.get("timing_clock") not in (None, "off"):
        console.print(phase_table(row))
    console.print(f"results: {results_dir / 'runs.csv'} (run_id {row['run_id']})")
    if logger is not None:
        from lora_bench.trackers.export import log_run

        log_run(results_dir, row["run_id"], to=logger, say=lambda line: console.print(markup(line), highlight=False))


def _parameter(name: str, annotation: Any, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)


def command() -> Any:
    """``train`` with one option per setting: a function whose signature typer reads."""

    def train_command(ctx: typer.Context, **kw: Any) -> None:
        fixed = {k: kw.pop(k) for k in ("overrides", "config", "results_dir", "run_id", "overwrite", "cache_dir",
                                         "no_progress", "logger")}
        if kw.pop("print_config"):  # the settings resolved as a run would resolve them, then exit 0
            cfg = settings_from(ctx, config=fixed["config"], overrides=fixed["overrides"] or [],
                               given={k: kw[k] for k in SETTINGS})[0]
            print_config(cfg.to_dict())
            return
        train(ctx, **fixed, given={k: kw[k] for k in SETTINGS})

    train_command.__signature__ = inspect.Signature([
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        _parameter("overrides", Overrides, None),
        _parameter("config", ConfigFile, None),
        *setting_parameters(),
        _parameter("results_dir", Annotated[Path, results_dir_option("Folder for runs.csv and per-run files.")],
                   Path("results/runs")),
        _parameter("run_id", RunId, None),
        _parameter("overwrite", Overwrite, False),
        _parameter("cache_dir", CacheDir, None),
        _parameter("no_progress", NoProgress, False),
        _parameter("logger", Logger, None),
        _parameter("print_config", PrintConfig, False),
    ])
    train_command.__doc__ = HELP
    return train_command
