"""A report's document written in the format asked for: the terminal's tables, Markdown (its
figures linked beside it), one self-contained HTML page, the CSV or the JSON of its groups. The
one place the renderers are called."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from lora_bench.fileio import atomic_write_text
from lora_bench.report.group_table import to_csv
from lora_bench.report.render_html import to_html
from lora_bench.report.render_json import report_json
from lora_bench.report.render_markdown import to_markdown
from lora_bench.report.render_terminal import print_document


def emit(fmt: str, *, doc, rep, drawn: dict, output: Path | None, console) -> None:
    """``doc`` (or, for CSV and JSON, the table ``rep``) in ``fmt`` to ``output`` or the console;
    ``drawn``: the figures' files, embedded PNGs and notes (report_command._draw)."""
    if fmt == "csv":
        _emit(to_csv(rep), output, console)
    elif fmt == "json":
        _emit(report_json(rep, notes=drawn["notes"]), output, console)
    elif fmt == "markdown":
        links = {k: _relative(p, output) for k, p in drawn["files"].items()}
        _emit(to_markdown(doc, figures=links), output, console)
    elif fmt == "html":
        _emit(to_html(doc, figures=drawn["embedded"]), output, console)
    elif output:
        with open(output, "w") as fh:
            print_document(doc, Console(file=fh, no_color=True, width=120))
    else:
        print_document(doc, console)


def _relative(path: Path, output: Path | None) -> str:
    if output is None:
        return str(path)
    return os.path.relpath(Path(path).resolve(), Path(output).resolve().parent)


def _emit(text: str, output: Path | None, console) -> None:
    if output:
        atomic_write_text(Path(output), text)
    else:
        console.out(text, end="", highlight=False)
