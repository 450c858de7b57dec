"""A report on the terminal (rich): the question, the generated answer and the crossover table
first, the details below. Everything fits the console's width: a table too wide for it is split
into several, each with the name columns and as many value columns as fit, and a cell wraps
within its column (at spaces, else folded), so no number is ever clipped or cut short. Every text
is shown as it is (``escaping.terminal``): no control sequence reaches the terminal, no value is
read as rich markup or as a link. Full widths: ``--format csv`` or ``json``."""

from __future__ import annotations

from dataclasses import replace

from rich import box
from rich.console import Console, Group
from rich.markdown import Markdown
from rich.measure import Measurement
from rich.panel import Panel
from rich.rule import Rule
from rich.table import Table as RichTable
from rich.text import Text

from lora_bench.escaping import markdown_cell, markdown_text, markup, terminal
from lora_bench.report.document import Document, Section
from lora_bench.report.render_markdown import points_markdown
from lora_bench.report.tables import Table

KEY_WIDTH = 30  # widest a name column gets before it wraps


def table_rich(t: Table, *, title: str = "") -> RichTable:
    rt = RichTable(title=_text(title) if title else None, title_justify="left",
                   caption=_text("\n".join(t.notes), newlines=True) if t.notes else None,
                   caption_justify="left", box=box.SIMPLE_HEAD, title_style="bold")
    for i, h in enumerate(t.head):
        if i < t.n_keys:  # names wrap first; a number wraps only where its column cannot hold it
            rt.add_column(_text(h), justify="left", max_width=KEY_WIDTH, overflow="fold")
        else:
            rt.add_column(_text(h), justify="right", overflow="fold")
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
    for t in s.tables:  # fitted to the console as it prints (``_print_wide``)
        out.append((t, t.title if t.title != s.title else ""))
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
    if doc.glance:
        console.print(_markdown("\n".join(f"- {markdown_text(x)}" for x in doc.glance)))
    _print_wide(console, items)
    for s in rest:
        if not s.terminal:
            continue
        console.print()
        _print_wide(console, _section(s, details=True))
    for n in notes or []:
        console.print(markup(n, newlines=True), highlight=False)


def _print_wide(console: Console, items: list) -> None:
    """Text wrapped to the console; each table fitted to it (``fitted``)."""
    for item in items:
        if isinstance(item, tuple):  # a table and its title
            for part in fitted(console, item[0], title=item[1]):
                console.print(part)
        else:
            console.print(item)


def fitted(console: Console, t: Table, *, title: str = "") -> list:
    """``t`` as rich renderables that fit ``console``: the whole table where its natural width
    fits, else parts split by value columns, each with the name columns repeated and as many value
    columns as fit (at least one; its cells wrap where even that is too wide), the title heading
    each part, and the notes after the last, as wide as the console."""
    whole = table_rich(t, title=title)
    if _width(console, whole) <= console.width or len(t.head) <= t.n_keys + 1:
        return [whole]
    parts: list[list[int]] = []
    for col in range(t.n_keys, len(t.head)):
        if parts and _width(console, table_rich(_columns(t, parts[-1] + [col]))) <= console.width:
            parts[-1].append(col)
        else:
            parts.append([col])
    out: list = [table_rich(_columns(t, cols), title=f"{title} ({i + 1} of {len(parts)})".lstrip())
                 for i, cols in enumerate(parts)]
    if t.notes:
        out.append(_text("\n".join(t.notes), newlines=True, style="table.caption"))
    return out


def _columns(t: Table, cols: list[int]) -> Table:
    """``t`` with its name columns and the value columns ``cols``, without its notes."""
    keep = list(range(t.n_keys)) + cols
    return replace(t, head=[t.head[i] for i in keep], rows=[[r[i] for i in keep] for r in t.rows], notes=[])


def _width(console: Console, table: RichTable) -> int:
    """The width ``table`` takes unwrapped."""
    return Measurement.get(console, console.options.update_width(10_000), table).maximum
