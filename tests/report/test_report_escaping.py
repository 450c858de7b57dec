"""Every report renderer shows hostile values (a run's label, any runs.csv cell) as text: no control
sequence reaches the terminal, no rich markup or Markdown/HTML is interpreted, no CSV cell starts a
spreadsheet formula. The escaping itself is tests/test_escaping.py's."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pandas as pd
from rich.console import Console

from lora_bench.report.aggregate import build_report
from lora_bench.report.document import Document, Section
from lora_bench.report.load import load_results
from lora_bench.report.render_markdown import table_markdown, to_markdown
from lora_bench.report.render_terminal import print_document
from lora_bench.report.group_table import groups_table, to_csv
from lora_bench.report.tables import Table
from lora_bench.results.store import read_run_table, write_csv
from paths import FIXTURES

REPORT_ROWS = FIXTURES / "report"
# a window title, clear screen, an 8-bit CSI, rich markup, a hyperlink, HTML, a table pipe, a formula
LABELS = ["\x1b]0;owned\x07title", "\x1b[2Jclear", "\x9b2Jcsi", "[bold red]markup[/bold red]",
          "[link=https://e.test]L[/link]", "<script>alert(1)</script>", "a | b `c`",
          '=HYPERLINK("http://example.invalid")', "-1+2", "@SUM(A1)"]


def _labelled(tmp_path: Path) -> Path:
    """The fixture's runs, one hostile label each (labels then split the groups), written by the
    project's own writer."""
    table = read_run_table(REPORT_ROWS / "runs.csv")
    rows = [{**r, "sweep_label": LABELS[i % len(LABELS)]} for i, r in enumerate(table.rows)]
    write_csv(tmp_path / "runs.csv", rows, [*table.header, "sweep_label"])
    return tmp_path


def _report(tmp_path: Path):
    return build_report(load_results([_labelled(tmp_path)]))


def _terminal(renderable_doc: Document) -> str:
    buf = io.StringIO()
    print_document(renderable_doc, Console(file=buf, width=200, force_terminal=True, color_system=None))
    return buf.getvalue()


def test_the_terminal_report_sends_no_control_sequence_and_no_markup(tmp_path):
    rep = _report(tmp_path)
    assert "sweep_label" in rep.keys
    table = groups_table(rep)
    doc = Document(title="t [bold]x[/bold]\x1b[2J", question="q\x1b]0;t\x07", setting="s", sections=[
        Section("Every group", tables=[table], first_screen=True, facts=[("device", "\x1b[31mred [i]x[/i]")]),
        Section("more", text=["a paragraph with [link](http://example.invalid) \x1b[2J"], tables=[table])])
    out = _terminal(doc)
    assert "\x1b]" not in out and "\x1b[2J" not in out and "\x9b" not in out and "\x07" not in out
    assert "\\x1b" in out  # shown, not sent
    assert "[bold red]markup[/bold red]" in out and "[link=https://e.test]L[/link]" in out
    assert "\x1b]8;" not in out  # no hyperlink (OSC 8) from any value


def test_markdown_cells_show_labels_literally(tmp_path):
    text = table_markdown(groups_table(_report(tmp_path)))
    assert "<script>" not in text and "&lt;script&gt;" in text and "\x1b" not in text
    widths = {len(list(csv.reader([line], delimiter="|", escapechar="\\"))[0]) for line in text.splitlines()
              if line.startswith("|")}
    assert len(widths) == 1, "a label's '|' split a cell"
    doc = Document(title="<b>t</b>", question="", setting="", sections=[
        Section("<img src=x onerror=alert(1)>", text=["**bold** stays; <script>x</script> does not"],
                facts=[("device", "<script>y</script>")])])
    md = to_markdown(doc)
    assert "<" not in md.replace("&lt;", "") and "**bold** stays" in md


def test_csv_report_cells_never_start_a_formula_and_numbers_stay_numbers(tmp_path):
    rep = _report(tmp_path)
    text = to_csv(rep)
    rows = list(csv.reader(io.StringIO(text)))
    col = rows[0].index("label")
    labels = [r[col] for r in rows[1:]]
    assert labels and all(not c.startswith(("=", "+", "-", "@")) for c in labels), labels
    assert "'=HYPERLINK(\"http://example.invalid\")" in labels and "'-1+2" in labels
    df = pd.read_csv(io.StringIO(text))
    assert pd.api.types.is_float_dtype(df["step_ms_median"])


def test_a_table_of_plain_text_renders_as_before():
    """Escaping leaves ordinary names alone: the Markdown of plain cells is unchanged."""
    t = Table(title="", head=["trainable_layers", "ms"], rows=[["lora_kernel (r16)", "1.5"]])
    assert table_markdown(t) == "| trainable_layers | ms |\n| --- | ---: |\n| lora_kernel (r16) | 1.5 |\n"
