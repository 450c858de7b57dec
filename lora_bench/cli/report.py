"""``lora-bench report``: the command-line wrapper of ``lora_bench.report.report_command``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lora_bench.cli.options import THRESHOLD_PCT, Threshold, console, output_dir, threshold_fraction
from lora_bench.errors import UsageError
from lora_bench.fileio import name_problem

PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def report(
    paths: Annotated[list[Path], typer.Argument(help="Results folders (or runs.csv files); every folder's rows "
                                                     "are kept, a run id once per folder.", show_default=False)],
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
    report_command(paths, group_by=group_by, baseline=baseline, metrics=metrics, fmt=format, output=output,
                   plot=plot, console=console, threshold=threshold_fraction(threshold))
