"""Reports at a glance: every committed report has an answer; an HTML report opens on the answer in
at most three lines beside the crossover figure, with the details below and nothing that makes the
page scroll sideways (its structure, read without a browser; test_report_browser.py measures the
layout where a browser runs); the terminal report fits the terminal's width, the CSV keeps every
column at full width; the README shows the crossover figure."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from html.parser import HTMLParser

import pandas as pd
import pytest
from rich.cells import cell_len
from rich.console import Console

from lora_bench.report.glance import LINES
from lora_bench.report.render_html import CSS
from lora_bench.report.report_command import report_command
from paths import ROOT

RESULTS = ROOT / "results"
PAGES = sorted(RESULTS.rglob("report.html"))
REPORTS = sorted([*RESULTS.rglob("report.md"), *PAGES])
WIDTH = 80
# committed folders of every shape: a five-repeat study, the floor, the peers, a quantized study, two
# whole-run folders, a two-repeat scaling shard
FOLDERS = ["answer/study", "answer/floor", "answer/peers", "answer/quantized", "answer/whole-runs/1558m",
           "answer/whole-runs/eager-bf16", "scaling/ddp-2gpu/w1"]


class _Page(HTMLParser):
    """The order of what a page shows: (tag, class) of each element, the first screen's items."""

    def __init__(self):
        super().__init__()
        self.order: list[tuple[str, str]] = []
        self.depth_first = 0  # > 0 inside <div class="first">
        self.first: list[tuple[str, str]] = []
        self.glance_items = 0
        self.in_glance = False
        self.scroll_stack: list[bool] = []  # for each open div: is it a .scroll container
        self.tables_outside_scroll = 0

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class") or ""
        self.order.append((tag, cls))
        if tag == "div":
            self.scroll_stack.append(cls == "scroll")
            if cls == "first" or self.depth_first:
                self.depth_first += 1
        elif self.depth_first:
            self.first.append((tag, cls))
        if tag == "ul" and cls == "glance":
            self.in_glance = True
        elif tag == "li" and self.in_glance:
            self.glance_items += 1
        if tag == "table" and not any(self.scroll_stack):
            self.tables_outside_scroll += 1

    def handle_endtag(self, tag):
        if tag == "div":
            self.scroll_stack.pop()
            if self.depth_first:
                self.depth_first -= 1
        if tag == "ul":
            self.in_glance = False


def _read(page) -> _Page:
    p = _Page()
    p.feed(page.read_text())
    return p


def test_there_are_committed_reports():
    assert len(PAGES) >= 5 and len(REPORTS) >= 10


@pytest.mark.parametrize("report", REPORTS, ids=[str(p.relative_to(RESULTS)) for p in REPORTS])
def test_every_committed_report_has_an_answer(report):
    text = report.read_text()
    assert re.search(r"^## Answer$|<h2>Answer</h2>", text, re.M), report
    before = text.split("## Answer")[0] if report.suffix == ".md" else text.split("<h2>Answer</h2>")[0]
    if "No comparison:" not in text:  # an answer to glance at, before the details: steps, else accuracy
        assert "step time against" in before or "**Accuracy**: " in before, report


@pytest.mark.parametrize("page", PAGES, ids=[str(p.parent.relative_to(RESULTS)) for p in PAGES])
def test_an_html_report_opens_on_the_answer_and_the_crossover_figure(page):
    p = _read(page)
    first = p.order.index(("div", "first"))
    assert not [t for t, _ in p.order[:first] if t in ("table", "img", "ul")], page  # only the title above it
    assert ("ul", "glance") in p.first and 1 <= p.glance_items <= LINES, page
    assert ("img", "") in p.first, f"{page}: no crossover figure on the first screen"
    assert not [t for t, _ in p.first if t == "table"], f"{page}: a table on the first screen"
    assert p.order.index(("img", "")) < next(i for i, (t, _) in enumerate(p.order) if t == "table")
    assert "crossover figure" in page.read_text().split('<div class="first">')[1].split("</div>")[0]
    assert p.tables_outside_scroll == 0, f"{page}: a table outside a scrolling container"


def test_the_pages_css_keeps_everything_within_the_page():
    rules = re.sub(r"\s+", " ", CSS)
    assert ".scroll { overflow-x: auto; }" in rules  # a wide table scrolls in its own box
    assert re.search(r"img \{ max-width: 100%;", rules)  # a figure never wider than the page
    assert "overflow-wrap: anywhere" in rules  # a long word (a path, a run id) breaks
    assert re.search(r"\.first img \{ max-height: \d+vh;", rules)  # the figure stays on the first screen


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_terminal_report_fits_80_columns(folder):
    buf = io.StringIO()
    report_command([RESULTS / folder], group_by=None, baseline=None, metrics=None, fmt="table", output=None,
                   plot=None, console=Console(file=buf, width=WIDTH, no_color=True))
    lines = buf.getvalue().splitlines()
    assert len(lines) > 20
    wide = [ln for ln in lines if cell_len(ln) > WIDTH]
    assert not wide, f"{len(wide)} of {len(lines)} lines wider than {WIDTH}:\n" + "\n".join(wide[:5])
    assert "Where the time goes" in buf.getvalue()


def test_a_table_too_wide_for_the_terminal_is_split_keeping_every_column_and_number():
    from lora_bench.report.render_terminal import fitted
    from lora_bench.report.tables import Table

    head = ["setting", *(f"metric {i}" for i in range(12))]
    rows = [[f"row {r}", *(f"{1000 * r + i:,}.5 [{r}.1–{r}.9] (n = 5, 93.8 %)" for i in range(12))] for r in range(3)]
    t = Table(title="wide", head=head, rows=rows, notes=["a note that follows the last part"])
    console = Console(file=io.StringIO(), width=WIDTH, no_color=True)
    parts = fitted(console, t, title="wide")
    assert len(parts) > 2
    for part in parts:
        console.print(part)
    out = console.file.getvalue()
    assert max(map(cell_len, out.splitlines())) <= WIDTH
    flat = " ".join(out.split())
    assert all(h in out for h in head) and flat.count("row 1") == len(parts) - 1  # names in every part
    assert all(f"{1000 * r + i:,}.5" in flat for r in range(3) for i in range(12))  # no number lost
    assert flat.endswith("a note that follows the last part") and "(1 of " in out


def test_the_command_fits_the_width_columns_names_and_csv_keeps_full_width():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(WIDTH)}
    command = [sys.executable, "-m", "lora_bench", "report", str(RESULTS / "answer" / "whole-runs" / "1558m")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert max(map(cell_len, done.stdout.splitlines())) <= WIDTH
    done = subprocess.run([*command, "--format", "csv"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert max(map(len, done.stdout.splitlines())) > WIDTH  # a CSV row is never wrapped
    assert "step_ms_median_lo" in pd.read_csv(io.StringIO(done.stdout)).columns


def test_the_readme_shows_the_crossover_figure():
    text = (ROOT / "README.md").read_text()
    shown = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert "results/answer/study/report.png" in shown and (ROOT / "results/answer/study/report.png").is_file()
    assert text.index("results/answer/study/report.png") < text.index("## Set up and run")  # on the first screen
