"""``lora-bench compare``: the command-line wrapper of ``lora_bench.report.compare``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from lora_bench.cli.options import THRESHOLD_PCT, Threshold, console, threshold_fraction
from lora_bench.errors import UsageError

HELP = """Compare two results folders setting by setting: candidate ÷ baseline, with intervals and n.

Runs are matched by their settings, never by run id. Exit code 1 where --fail-above is given and a setting is slower by more than PCT % with its whole interval (a CI gate); 2 for a usage error.

Example: [bold]lora-bench compare results/before results/after --fail-above 5[/bold]
"""
FORMATS = ("table", "markdown", "csv", "json")


def compare(
    baseline: Annotated[Path, typer.Argument(help="The results folder to compare against.", show_default=False)],
    candidate: Annotated[Path, typer.Argument(help="The results folder compared with it.", show_default=False)],
    metric: Annotated[str, typer.Option(help="The result column compared (a median over repeats).")] = "step_ms_median",
    threshold: Threshold = THRESHOLD_PCT,
    fail_above: Annotated[Optional[float], typer.Option(
        "--fail-above", metavar="PCT", help="Exit 1 where a setting is slower (worse) by more than PCT % with its "
                                            "whole 95 % interval past 1 + PCT %.")] = None,
    format: Annotated[str, typer.Option("--format", help="table (terminal), markdown, csv or json.")] = "table",
) -> None:
    """Compare a candidate results folder with a baseline one, setting by setting."""
    from lora_bench.report.compare import compare as run_compare
    from lora_bench.report.compare import gate_text
    from lora_bench.report.compare_render import comparison_csv, comparison_document, comparison_json
    from lora_bench.report.render_markdown import to_markdown
    from lora_bench.report.render_terminal import print_document

    if format not in FORMATS:
        raise UsageError(f"--format {format!r} is not allowed; choose one of: {', '.join(FORMATS)}")
    gate = threshold_fraction(fail_above, "--fail-above") if fail_above is not None else None
    c = run_compare(baseline, candidate, metric=metric, threshold=threshold_fraction(threshold), fail_above=gate)
    err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    if format == "table":
        print_document(comparison_document(c), console)
    elif format == "markdown":
        console.out(to_markdown(comparison_document(c)), end="", highlight=False)
    else:  # stdout stays machine-readable: the warnings go to stderr
        console.out(comparison_csv(c) if format == "csv" else comparison_json(c), end="", highlight=False)
        for line in c.environment:
            err.print(f"warning: environment differs: {line}", highlight=False, markup=False)
    if gate is not None and c.failed:
        err.print(gate_text(c), highlight=False, markup=False)
        raise typer.Exit(1)
