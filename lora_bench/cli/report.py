"""``lora-bench report``: the command-line wrapper of ``lora_bench.report.report_command``.

It reads the results folders found at any depth below each path and says which (on stderr). Several
folders are reported one by one, each its own report, unless ``--pool`` reads them as one set of
runs; one file (``--output``, ``--plot``, HTML, CSV, JSON) holds one report, so there several
folders need ``--pool`` or one folder named."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.rule import Rule
from rich.text import Text

from lora_bench.cli.options import (
    THRESHOLD_PCT,
    Filters,
    Pool,
    Threshold,
    console,
    err_console,
    folders_text,
    found_folders,
    output_dir,
    threshold_fraction,
)
from lora_bench.errors import UsageError
from lora_bench.escaping import markdown_cell, markup, terminal
from lora_bench.fileio import name_problem

PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def report(
    paths: Annotated[list[Path], typer.Argument(help="Results folders (or runs.csv files), searched at any depth; "
                                                     "each folder found is reported on its own unless --pool.",
                                                show_default=False)],
    group_by: Annotated[Optional[str], typer.Option(help="Comma-separated settings (default: the run labels, or "
                                                         "the settings that vary).")] = None,
    baseline: Annotated[Optional[str], typer.Option(help="key=value runs to compare against, e.g. "
                                                         "trainable_layers=all.")] = None,
    metrics: Annotated[Optional[str], typer.Option(help="Comma-separated result columns; the first is "
                                                        "ratioed.")] = None,
    format: Annotated[str, typer.Option("--format", help="table (terminal), markdown, html (one self-contained "
                                                         "page), csv or json.")] = "table",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to this file instead "
                                                                          "of the terminal (Markdown gets its "
                                                                          "figures beside it).")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Also draw the crossover figure to FILE (.png, .pdf or .svg) "
                                                      "and the phases to FILE-phases (one model size: the phases "
                                                      "to FILE).")] = None,
    threshold: Threshold = THRESHOLD_PCT,
    pool: Pool = False,
    filters: Filters = None,
) -> None:
    """Explain results: the answer generated from the runs, the crossover against a baseline, where the time goes."""
    from lora_bench.report.report_command import report_command

    for flag, path in (("--output", output), ("--plot", plot)):  # room for a figure's "-crossover.png"
        if path is not None and (why := name_problem(path, room=16)):
            raise UsageError(f"{flag} {path}: {why}")
    if plot is not None:
        if plot.suffix.lower() not in PLOT_SUFFIXES:
            raise UsageError(f"--plot {plot}: the file name must end in one of {', '.join(PLOT_SUFFIXES)}")
        output_dir(plot.parent, "--plot")
    if output is not None:
        if output.is_dir():
            raise UsageError(f"--output {output} is a folder; give the report's file name")
        output_dir(output.parent, "--output")
    options = dict(group_by=group_by, baseline=baseline, metrics=metrics, fmt=format, output=output, plot=plot,
                   console=console, threshold=threshold_fraction(threshold), filters=filters)
    folders = found_folders(paths)
    if len(folders) <= 1 or pool:
        if folders and folders != [Path(p) for p in paths]:  # say what was read where it is not what was named
            many = len(folders) > 1
            err_console.print(f"reading {len(folders)} results folder{'s as one' if many else ''}: "
                              f"{markup(folders_text(folders))}", highlight=False)
        report_command(paths, **options)
        return
    one_file = [what for what, on in (("--output", output), ("--plot", plot), (f"--format {format}",
                                       format in ("html", "csv", "json"))) if on]
    if one_file:
        raise UsageError(f"{len(folders)} results folders found ({folders_text(folders)}): {one_file[0]} holds one "
                         "report; name one folder, or read them as one with --pool")
    by_folder(folders, options)


def by_folder(folders: list[Path], options: dict) -> None:
    """One report per folder, each headed by its folder; a folder with nothing to report says why
    and the others go on (a usage error when none had anything)."""
    from lora_bench.report.report_command import report_command

    err_console.print(f"reading {len(folders)} results folders, each on its own (--pool reads them as one): "
                      f"{markup(folders_text(folders))}", highlight=False)
    from lora_bench.progress import CountProgress

    skipped = []
    with CountProgress(err_console, total=len(folders), label="reports", enabled=True) as bar:
        for folder in folders:
            if options["fmt"] == "markdown":
                console.out(f"\n---\n\n*results folder {markdown_cell(str(folder))}*\n", highlight=False)
            else:
                console.print(Rule(Text(terminal(str(folder))), align="left"))
            try:
                report_command([folder], **options)
            except UsageError as e:
                skipped.append(folder)
                err_console.print(f"{markup(folder)}: {markup(e)}", highlight=False)
            bar.advance()
    if len(skipped) == len(folders):
        raise UsageError(f"nothing to report in any of the {len(folders)} folders (each says why above)")
