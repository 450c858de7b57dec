"""A report on the terminal (rich): the question, the generated answer and the crossover table
first, the details below. Tables print at their full width: a number is never clipped to fit a
narrow terminal or a log's 80 columns. Every text is shown as it is (``escaping.terminal``): no
control sequence reaches the terminal, no value is read as rich markup or as a link."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.markdown import Markdown
from rich.measure import Measurement
from rich.panel import Panel
from rich.rule import Rule
from rich.table import Table as RichTable
from rich.text import Text

from lora_bench.escaping import markdown_cell, markup, terminal
from lora_bench.report.document import Document, Section
from lora_bench.report.render_markdown import points_markdown
from lora_bench.report.tables import Table

KEY_WIDTH = 30  # widest a name column gets before it wraps


def table_rich(t: Table, *, title: str = "") -> RichTable:
    rt = RichTable(title=_text(title) if title else None, title_justify="left",
                   caption=_text("\n".join(t.notes), newlines=True) if t.notes else None,
                   caption_justify="left", box=box.SIMPLE_HEAD, title_style="bold")
    for i, h in enumerate(t.head):
        if i < t.n_keys:  # names may wrap onto a second line; numbers never do
            rt.add_column(_text(h), justify="left", max_width=KEY_WIDTH, overflow="fold")
        else:
            rt.add_column(_text(h), justify="right", no_wrap=True)
    for i, r in enumerate(t.rows):
        rt.add_row(*(_text(c, newlines=True) for c in r), end_section=(i + 1) in t.groups)
    return rt


def _text(value, *, newlines: bool = False, style: str = "") -> Text:
    """A value as rich shows it literally: no markup, no control character."""
    return Text(terminal(value, newlines=newlines), style=style)


def _markdown(text: str) -> Markdown:
    """Generated Markdown, its control characters escaped; a link shows its address instead of
    hiding it behind the text."""
    return Markdown(terminal(text, newlines=True), hyperlinks=False)


def _section(s: Section, *, details: bool) -> list:
    out = []
    if s.title and (details or not s.tables):
        out.append(Rule(_text(s.title), align="left", style="dim") if details else _text(s.title, style="bold"))
    for p in s.text:
        out.append(_markdown(p))
    if s.points:
        out.append(_markdown(points_markdown(s.points)))
    if s.facts:
        out.append(_markdown("\n".join(f"- **{markdown_cell(k)}:** {markdown_cell(v)}" for k, v in s.facts)))
    for t in s.tables:
        out.append(table_rich(t, title=t.title if t.title != s.title else ""))
    return out


def print_document(doc: Document, console: Console, *, notes: list[str] | None = None) -> None:
    first = [s for s in doc.sections if s.first_screen]
    rest = [s for s in doc.sections if not s.first_screen]
    head = []
    if doc.question:
        head.append(_text(doc.question, style="bold"))
    if doc.setting:
        head.append(_text(doc.setting, style="dim"))
    items = [x for s in first for x in _section(s, details=False)]
    if doc.question or doc.setting:
        console.print(Panel(Group(*head), title=_text(doc.title) if doc.title else None, title_align="left",
                            expand=False))
    elif doc.title:
        console.print(_text(doc.title, style="bold"))
    _print_wide(console, items)
    for s in rest:
        if not s.terminal:
            continue
        console.print()
        _print_wide(console, _section(s, details=True))
    for n in notes or []:
        console.print(markup(n, newlines=True), highlight=False)


def _print_wide(console: Console, items: list) -> None:
    """Tables fitted to the terminal by wrapping their names, wider than it where the numbers need
    it (a number is never clipped); text wrapped to the terminal."""
    for item in items:
        if isinstance(item, RichTable):
            width = max(console.width, Measurement.get(console, console.options.update_width(10_000), item).maximum)
            Console(file=console.file, width=width, force_terminal=console.is_terminal, no_color=console.no_color,
                    color_system=console.color_system and "auto").print(item)
        else:
            console.print(item)
