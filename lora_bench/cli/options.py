"""What the commands share: the consoles, the options several commands take, the check of an
output folder, and the ``train`` options generated from the settings' declaration.

Naming of output paths across commands: ``--results-dir DIR`` is the results folder a command
writes its tables into (``train``, ``sweep``, ``kernel-bench``); ``-o/--output PATH`` is the one
other thing a command writes (``report``'s file, ``data prepare``'s folder of splits)."""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from lora_bench.config import PANELS, SETTINGS, Setting
from lora_bench.errors import UsageError
from lora_bench.fileio import check_writable_dir
from lora_bench.report.threshold import THRESHOLD

CONTEXT = {"help_option_names": ["-h", "--help"]}
PRECEDENCE = ("Settings, from lowest to highest precedence: the defaults (the reference's book mode), a "
              "[bold]--config[/bold] file, then flags and [bold]key=value[/bold] overrides.")

PIPED_WIDTH = 160  # output to a pipe or file (logs, CI) gets room beyond rich's default 80 columns ...


def output_width() -> int | None:
    """The console's width: the terminal's, or $COLUMNS where set (... which says otherwise), else
    PIPED_WIDTH for output that goes to no terminal."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return None if sys.stdout.isatty() else PIPED_WIDTH


console = Console(width=output_width())
err_console = Console(stderr=True)

OUTPUT_PANEL = PANELS[-1]
CacheDir = Annotated[Optional[Path], typer.Option("--cache-dir", envvar="LORA_BENCH_CACHE",
                                                  help="Download cache (default ~/.cache/lora-bench).")]
NoProgress = Annotated[bool, typer.Option("--no-progress", rich_help_panel=OUTPUT_PANEL, metavar="",
                                          help="No progress bars (logs, CI).")]
Logger = Annotated[Optional[str], typer.Option(
    "--logger", metavar="mlflow|tensorboard", rich_help_panel=OUTPUT_PANEL, show_default=False,
    help="Also export each run, once saved, to MLflow or TensorBoard in the results folder "
         "(lora-bench\\[trackers]; docs/trackers.md).")]
PrintConfig = Annotated[bool, typer.Option(
    "--print-config", rich_help_panel=OUTPUT_PANEL, metavar="",
    help="Print the resolved settings as YAML (defaults, file, flags and overrides applied) and exit; nothing runs.")]
Overrides = Annotated[Optional[list[str]], typer.Argument(
    metavar="KEY=VALUE", show_default=False,
    help="Settings as in a YAML file, e.g. lora_rank=16 precision=bf16 (values read as YAML reads them).")]


# the verdict's threshold in percent, shared by report and compare
THRESHOLD_PCT = 100 * THRESHOLD
Threshold = Annotated[float, typer.Option(
    "--threshold", metavar="PCT", show_default=False,
    help=f"A ratio counts as slower / faster only where its whole interval lies beyond 1 ± PCT % "
         f"(default {THRESHOLD_PCT:g}).")]


# finding results, shared by report and compare
Pool = Annotated[bool, typer.Option(
    "--pool", metavar="", help="Read every results folder found as one set of runs (default: each folder on its "
                               "own).")]
Filters = Annotated[Optional[list[str]], typer.Option(
    "--filter", metavar="KEY=VALUE", show_default=False,
    help="Only the runs whose KEY (a setting or results column) is VALUE; repeatable, e.g. --filter "
         "model_size=124M --filter precision=bf16.")]
SHOWN_FOLDERS = 6  # the folders a one-line message names, at most


def folders_text(folders: list[Path]) -> str:
    """``a, b, c and 4 more``: folders named in one line."""
    shown = ", ".join(str(f) for f in folders[:SHOWN_FOLDERS])
    return shown + (f" and {len(folders) - SHOWN_FOLDERS} more" if len(folders) > SHOWN_FOLDERS else "")


def found_folders(paths: list[Path]) -> list[Path]:
    """The results folders ``paths`` name, found at any depth below each, each once, in order."""
    from lora_bench.report.load import result_dirs

    return list(dict.fromkeys(d for p in paths for d in result_dirs(Path(p))))


def threshold_fraction(pct: float, flag: str = "--threshold") -> float:
    """PCT as a fraction; refuses what no ratio can clear or what is not a number."""
    if not (0 <= pct < 100):  # also refuses NaN
        raise UsageError(f"{flag} {pct:g}: give a percentage from 0 up to (not including) 100")
    return pct / 100


def results_dir_option(help: str) -> Any:
    return typer.Option("--results-dir", help=help, rich_help_panel=OUTPUT_PANEL)


def output_dir(path: Path, flag: str) -> None:
    """A folder the command will write into: refuse a file in its place or a folder that takes no
    new file; create it now."""
    why = check_writable_dir(Path(path))
    if why:
        raise UsageError(f"{flag} {path}: {why}")


def print_config(data: dict) -> None:
    """What ``--print-config`` prints: ``data`` as YAML on stdout, keys in their order (a train
    run's settings read back as a ``--config`` file). safe_dump quotes and escapes any control
    character a value holds."""
    import yaml

    sys.stdout.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    sys.stdout.flush()


def split_list(text: str | None) -> list[str] | None:
    """``a, b,c`` -> ``['a', 'b', 'c']``; None for no text."""
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


# -- the settings as options ----------------------------------------------------------------
def setting_help(s: Setting) -> str:
    """A setting's help: its text, its allowed values (where its metavar cannot list them), its default."""
    parts = [s.spec.help]
    if s.spec.allowed_text() and not choices_metavar(s):
        parts.append(f"Allowed: {s.spec.allowed_text()}.")
    if s.spec.maximum is not None:
        parts.append(f"At most {s.spec.maximum:,}.")
    if s.default is not None and s.type is not bool:
        parts.append(f"Default: {s.default}.")
    if s.type is bool and s.default is True:
        parts.append(f"On by default; --no-{s.flags[0][2:]} turns it off.")
    return escape(" ".join(parts))


def choices_metavar(s: Setting) -> str:
    """A text setting's allowed values as its metavar, ``[a|b|c]`` as click shows a choice (a value
    of a pattern as the pattern reads: ``[auto|cpu|cuda|cuda:N]``); '' for a setting without choices
    or whose pattern reads as words (its help lists what is allowed).
    The values are checked with the other settings' rules, so a mistake gets the same message as in a file."""
    if s.type is not str or not s.spec.choices or " " in s.spec.pattern_text:  # a pattern in words stays in the help
        return ""
    return "[" + "|".join((*s.spec.choices, *([s.spec.pattern_text] if s.spec.pattern_text else []))) + "]"


def setting_parameter(s: Setting) -> inspect.Parameter:
    """The command-line option of one setting. Its default is the setting's, and a command learns
    from click which options were given (``ctx.get_parameter_source``)."""
    kind = Optional[s.type] if s.optional else s.type
    metavar = choices_metavar(s) or {int: "INT", float: "NUMBER", str: "TEXT"}.get(s.type)
    flags = s.flags
    if s.type is bool and s.default is True:  # an on-by-default switch also gets its off form
        flags = (f"{flags[0]}/--no-{flags[0][2:]}", *flags[1:])
    option = typer.Option(*flags, help=setting_help(s), rich_help_panel=s.spec.panel, show_default=False,
                          metavar=metavar if s.type is not bool else "",  # a switch takes no value: no type shown
                          autocompletion=_completer(s.spec.choices) if s.type is str and s.spec.choices else None)
    return inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[kind, option],
                             default=s.default)


def _completer(choices: tuple[str, ...]):
    """Shell completion of a setting's value: the choices that start with what was typed."""

    def complete(incomplete: str) -> list[str]:
        return [c for c in choices if c.startswith(incomplete)]

    return complete


def setting_parameters() -> list[inspect.Parameter]:
    """Every setting's option, grouped by help panel in the panels' order."""
    order = {p: i for i, p in enumerate(PANELS)}
    return [setting_parameter(s) for s in sorted(SETTINGS.values(), key=lambda s: order[s.spec.panel])]
