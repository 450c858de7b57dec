"""``lora-bench compare``: the command-line wrapper of ``lora_bench.report.comparison``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from lora_bench.cli.options import (
    THRESHOLD_PCT,
    Filters,
    Pool,
    Threshold,
    console,
    folders_text,
    found_folders,
    threshold_fraction,
)
from lora_bench.errors import UsageError
from lora_bench.escaping import markup

HELP = """Compare two results folders setting by setting: candidate ÷ baseline, with intervals and n.

Runs are matched by their settings, never by run id. Each side is a results folder, found at any depth below the path given; a side holding several needs --pool, which reads them as one set of runs. Exit code 1 when the comparison is incomplete (no setting on both sides; a setting on one side only, unless --allow-missing; with --fail-above, no setting with enough repeats for a verdict) or where --fail-above is given and a setting is slower by more than PCT % with its whole interval (a CI gate); 2 for a usage error.

Example: [bold]lora-bench compare results/before results/after --fail-above 5[/bold]
"""
FORMATS = ("table", "markdown", "html", "csv", "json")
SORTS = ("name", "ratio")


def compare(
    baseline: Annotated[Path, typer.Argument(help="The results folder to compare against.", show_default=False)],
    candidate: Annotated[Path, typer.Argument(help="The results folder compared with it.", show_default=False)],
    metric: Annotated[str, typer.Option(help="The result column compared (a median over repeats).")] = "step_ms_median",
    threshold: Threshold = THRESHOLD_PCT,
    fail_above: Annotated[Optional[float], typer.Option(
        "--fail-above", metavar="PCT", help="Exit 1 where a setting is slower (worse) by more than PCT % with its "
                                            "whole interval past 1 + PCT %.")] = None,
    ignore: Annotated[Optional[list[str]], typer.Option(
        "--ignore", metavar="KEY", help="Leave this setting out of the matching (repeatable), e.g. --ignore "
                                        "max_steps to compare folders that differ in it on purpose.")] = None,
    allow_missing: Annotated[bool, typer.Option(
        "--allow-missing", help="Accept settings found on one side only (otherwise exit 1).")] = False,
    only_changed: Annotated[bool, typer.Option(
        "--only-changed", help="Show only the settings with a verdict of a difference (faster, slower, higher, "
                               "lower).")] = False,
    sort: Annotated[str, typer.Option("--sort", help="name (the settings' order) or ratio (worst first).")] = "name",
    format: Annotated[str, typer.Option("--format", help="table (terminal), markdown, html (one page), csv or "
                                                         "json.")] = "table",
    pool: Pool = False,
    filters: Filters = None,
) -> None:
    """Compare a candidate results folder with a baseline one, setting by setting."""
    from lora_bench.report.comparison import compare as run_compare
    from lora_bench.report.comparison import gate_text
    from lora_bench.report.compare_render import comparison_csv, comparison_document, comparison_json
    from lora_bench.report.render_html import to_html
    from lora_bench.report.render_markdown import to_markdown
    from lora_bench.report.render_terminal import print_document

    if format not in FORMATS:
        raise UsageError(f"--format {format!r} is not allowed; choose one of: {', '.join(FORMATS)}")
    if sort not in SORTS:
        raise UsageError(f"--sort {sort!r} is not allowed; choose one of: {', '.join(SORTS)}")
    gate = threshold_fraction(fail_above, "--fail-above") if fail_above is not None else None
    err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    for side, path in (("baseline", baseline), ("candidate", candidate)):
        say_folders(side, path, pool=pool, err=err)
    c = run_compare(baseline, candidate, metric=metric, threshold=threshold_fraction(threshold), fail_above=gate,
                    ignore=ignore or (), allow_missing=allow_missing, filters=filters or ())
    rows = c.shown(only_changed=only_changed, sort=sort)
    if format == "table":
        print_document(comparison_document(c, rows), console)
    elif format in ("markdown", "html"):
        render = to_markdown if format == "markdown" else to_html
        console.out(render(comparison_document(c, rows)), end="", highlight=False)
    else:  # stdout stays machine-readable: the warnings go to stderr
        console.out(comparison_csv(c, rows) if format == "csv" else comparison_json(c, rows), end="", highlight=False)
        for line in c.environment:
            err.print(f"warning: environment differs: {line}", highlight=False, markup=False)
    if c.failed or c.problems:
        for line in [gate_text(c)] if gate is not None else [f"incomplete: {p}" for p in c.problems]:
            err.print(line, highlight=False, markup=False)
        raise typer.Exit(1)


def say_folders(side: str, path: Path, *, pool: bool, err: Console) -> None:
    """Say which results folders a side reads where they are not just the folder given; several without --pool are a usage error (a side is
    one set of runs: which of them to compare is the user's choice)."""
    folders = found_folders([path]) if path.exists() else []  # a missing folder: the comparison says so
    if len(folders) > 1 and not pool:
        raise UsageError(f"{side} {path}: {len(folders)} results folders found ({folders_text(folders)}); compare "
                         "one folder with another, or read each side's folders as one with --pool")
    if folders and folders != [Path(path)]:  # the path given is not itself the one folder read
        err.print(f"{side}: reading {markup(folders_text(folders))}", highlight=False)
