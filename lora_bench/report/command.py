"""``lora-bench report``: read result folders, build the study and its answer, render it to the
terminal, Markdown, one self-contained HTML page or CSV, and draw its figures.

With ``--metrics`` or ``--group-by`` (and for CSV) the output is the table of groups alone, as
asked. Figures: ``--plot FILE`` writes the crossover to FILE and the phases beside it
(FILE-phases.png); Markdown written to a file gets them beside it unless --plot names them; HTML
embeds them."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from lora_bench.errors import UsageError
from lora_bench.escaping import markup
from lora_bench.fileio import atomic_write_text
from lora_bench.report import figures as figs
from lora_bench.report.aggregate import FORMATS, build_report
from lora_bench.report.document import build_document, table_document
from lora_bench.report.load import load_results
from lora_bench.report.render_html import to_html
from lora_bench.report.render_markdown import to_markdown
from lora_bench.report.render_terminal import print_document
from lora_bench.report.study import build_study
from lora_bench.report.tables import to_csv

FIGURES = ("crossover", "phases")


def report_command(paths: list[Path], *, group_by: str | None, baseline: str | None, metrics: str | None,
                   fmt: str, output: Path | None, plot: Path | None, console) -> None:
    """What ``lora-bench report`` does: read, aggregate, explain, render, draw."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not allowed; choose one of: {', '.join(FORMATS)}")

    def split(text):
        return [s for s in (t.strip() for t in text.split(",")) if s] if text else None

    df = load_results(paths)
    table_only = bool(group_by or metrics) or fmt == "csv"
    rep = build_report(df, group_by=split(group_by), metrics=split(metrics), baseline=baseline)
    study = build_study(df, baseline=baseline, title=_title(paths))
    if not table_only and study.baseline_text and not baseline:  # the table of groups against the study's baseline
        rep = build_report(df, group_by=split(group_by), metrics=split(metrics), baseline=study.baseline_text)
    drawn = _draw(study, fmt=fmt, output=output, plot=plot, table_only=table_only)
    wrote = list(drawn["files"].values())
    if table_only:
        doc = table_document(rep, title=f"{len(rep.done)} finished runs from {', '.join(map(str, paths))}")
    else:
        doc = build_document(study, rep, figures=set(drawn["files"]) | set(drawn["embedded"]))
    if fmt == "csv":
        _emit(to_csv(rep), output, console)
    elif fmt == "markdown":
        links = {k: _relative(p, output) for k, p in drawn["files"].items()}
        _emit(to_markdown(doc, figures=links), output, console)
    elif fmt == "html":
        _emit(to_html(doc, figures=drawn["embedded"]), output, console)
    else:
        if output:
            with open(output, "w") as fh:
                print_document(doc, Console(file=fh, no_color=True, width=120))
        else:
            print_document(doc, console)
    if output:
        wrote.insert(0, output)
    for path in wrote:
        console.print(f"wrote {markup(path)}", highlight=False)


def _title(paths: list[Path]) -> str:
    return ", ".join(Path(p).resolve().name if Path(p).is_dir() else Path(p).resolve().parent.name for p in paths)


def _draw(study, *, fmt: str, output: Path | None, plot: Path | None, table_only: bool) -> dict:
    """Draw the figures the output needs: files (key -> path) and embedded (key -> base64 PNG)."""
    files: dict[str, Path] = {}
    if plot is not None:
        files = {"crossover": Path(plot), "phases": Path(plot).with_name(f"{Path(plot).stem}-phases{Path(plot).suffix}")}
    elif fmt == "markdown" and output is not None and not table_only:
        files = {k: Path(output).with_name(f"{Path(output).stem}-{k}.png") for k in FIGURES}
    embed = fmt == "html" and not table_only
    if not files and not embed:
        return {"files": {}, "embedded": {}}
    out = {"files": {}, "embedded": {}}
    for key, make in (("crossover", figs.crossover_figure), ("phases", figs.phase_figure)):
        fig = make(study)
        if fig is None:
            continue
        if key in files:
            out["files"][key] = figs.save(fig, files[key])
        if embed:
            out["embedded"][key] = figs.png_base64(fig)
        figs.close(fig)
    return out


def _relative(path: Path, output: Path | None) -> str:
    if output is None:
        return str(path)
    return os.path.relpath(Path(path).resolve(), Path(output).resolve().parent)


def _emit(text: str, output: Path | None, console) -> None:
    if output:
        atomic_write_text(Path(output), text)
    else:
        console.out(text, end="", highlight=False)
