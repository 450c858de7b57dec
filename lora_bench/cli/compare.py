"""``lora-bench compare``: the command-line wrapper of ``lora_bench.report.comparison``. It finds
the results folders at any depth below each side; several on a side are compared folder by folder
(the same place below each side), unless ``--pool`` reads each side as one set of runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.rule import Rule
from rich.text import Text

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
from lora_bench.escaping import markdown_cell, markup, terminal

HELP = """Compare two results folders setting by setting: candidate ÷ baseline, with intervals and n.

Runs are matched by their settings, never by run id. Results folders are found at any depth below each path; where a side holds several, the folders at the same place below each side are compared pair by pair (a folder on one side only leaves the comparison incomplete), unless --pool reads each side as one set of runs. Exit code 1 when the comparison is incomplete (no setting on both sides; a setting on one side only, unless --allow-missing; with --fail-above, no setting with enough repeats for a verdict) or where --fail-above is given and a setting is slower by more than PCT % with its whole interval (a CI gate); 2 for a usage error.

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
    if format not in FORMATS:
        raise UsageError(f"--format {format!r} is not allowed; choose one of: {', '.join(FORMATS)}")
    if sort not in SORTS:
        raise UsageError(f"--sort {sort!r} is not allowed; choose one of: {', '.join(SORTS)}")
    gate = threshold_fraction(fail_above, "--fail-above") if fail_above is not None else None
    err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    one = dict(metric=metric, threshold=threshold_fraction(threshold), gate=gate, ignore=ignore or (),
               allow_missing=allow_missing, filters=filters or (), only_changed=only_changed, sort=sort,
               format=format, err=err)
    sides = {side: found_folders([path]) if path.exists() else [] for side, path in  # a missing one: compare says so
             (("baseline", baseline), ("candidate", candidate))}
    if pool or all(len(f) <= 1 for f in sides.values()):
        for side, path in (("baseline", baseline), ("candidate", candidate)):
            if sides[side] and sides[side] != [path]:  # say what was read where it is not the folder named
                err.print(f"{side}: reading {markup(folders_text(sides[side]))}", highlight=False)
        if _compare_one(baseline, candidate, **one):
            raise typer.Exit(1)
        return
    if format in ("csv", "json", "html"):
        raise UsageError(f"{baseline} and {candidate} hold several results folders ({len(sides['baseline'])} and "
                         f"{len(sides['candidate'])}): --format {format} holds one comparison; compare them as "
                         "table or markdown, folder by folder, or read each side as one with --pool")
    pairs, alone = folder_pairs(baseline, candidate, sides["baseline"], sides["candidate"])
    if not pairs:
        raise UsageError(f"no results folder lies at the same place below {baseline} and {candidate} (baseline: "
                         f"{folders_text(sides['baseline'])}; candidate: {folders_text(sides['candidate'])}); name "
                         "the two folders to compare, or read each side as one with --pool")
    err.print(f"comparing {len(pairs)} pair(s) of folders at the same place below each side (--pool reads each side "
              "as one)", highlight=False)
    failed = False
    for b, c in pairs:
        if format == "markdown":
            console.out(f"\n---\n\n*{markdown_cell(str(c))} against {markdown_cell(str(b))}*\n", highlight=False)
        else:
            console.print(Rule(Text(terminal(f"{c} against {b}")), align="left"))
        failed |= _compare_one(b, c, **one)
    for line in alone:
        err.print(f"incomplete: {line}", highlight=False, markup=False)
    if failed or (alone and not allow_missing):
        raise typer.Exit(1)


def folder_pairs(baseline: Path, candidate: Path, base_folders: list[Path],
                 cand_folders: list[Path]) -> tuple[list[tuple[Path, Path]], list[str]]:
    """The folders at the same path below each side, paired; what lies on one side only."""
    b = {f.relative_to(baseline): f for f in base_folders}
    c = {f.relative_to(candidate): f for f in cand_folders}
    pairs = [(b[k], c[k]) for k in sorted(b) if k in c]
    alone = [f"only in the baseline: {b[k]}" for k in sorted(b) if k not in c]
    alone += [f"only in the candidate: {c[k]}" for k in sorted(c) if k not in b]
    return pairs, alone


def _compare_one(baseline: Path, candidate: Path, *, metric: str, threshold: float, gate: float | None, ignore,
                 allow_missing: bool, filters, only_changed: bool, sort: str, format: str, err: Console) -> bool:
    """One comparison, shown; True where it failed the gate or is incomplete (said on ``err``)."""
    from lora_bench.report.comparison import compare as run_compare
    from lora_bench.report.comparison import gate_text
    from lora_bench.report.compare_render import comparison_csv, comparison_document, comparison_json
    from lora_bench.report.render_html import to_html
    from lora_bench.report.render_markdown import to_markdown
    from lora_bench.report.render_terminal import print_document

    c = run_compare(baseline, candidate, metric=metric, threshold=threshold, fail_above=gate, ignore=ignore,
                    allow_missing=allow_missing, filters=filters)
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
        return True
    return False
