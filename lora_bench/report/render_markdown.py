"""A report as Markdown: figures referenced by path (written beside the file by the command). Table
cells, titles and facts are shown literally (``escaping.markdown_cell``); the generated paragraphs keep
their **bold** and `code` marks, with HTML and control characters escaped (``markdown_text``)."""

from __future__ import annotations

from lora_bench.escaping import markdown_cell, markdown_text
from lora_bench.report.document import Document
from lora_bench.report.tables import Table


def table_markdown(t: Table) -> str:
    align = ["---"] * t.n_keys + ["---:"] * (len(t.head) - t.n_keys)
    lines = ["| " + " | ".join(markdown_cell(c) for c in r) + " |" for r in (t.head, *t.rows)]
    lines.insert(1, "| " + " | ".join(align) + " |")
    out = "\n".join(lines) + "\n"
    if t.notes:
        out += "\n" + "\n".join(f"- {markdown_text(n)}" for n in t.notes) + "\n"
    return out


def points_markdown(points) -> str:
    lines = []
    for p in points:
        lines.append(f"- **{markdown_cell(p.heading)}**")
        lines += [f"  - {markdown_text(x)}" for x in p.sentences]
    return "\n".join(lines) + "\n"


def to_markdown(doc: Document, *, figures: dict[str, str] | None = None) -> str:
    """``figures``: figure key -> path (relative to the Markdown file) to link."""
    figures = figures or {}
    parts = []
    if doc.title:
        parts.append(f"# {markdown_cell(doc.title)}\n")
    if doc.question:
        parts.append(f"**Question.** {markdown_text(doc.question)}\n")
    if doc.setting:
        parts.append(f"*{markdown_cell(doc.setting)}*\n")
    if doc.glance:  # the answer at a glance and its figure, before the details
        parts.append("\n".join(f"- {markdown_text(x)}" for x in doc.glance) + "\n")
        if doc.glance_figure in figures:
            parts.append(f"![{doc.glance_figure}]({figures[doc.glance_figure]})\n")
    for s in doc.sections:
        if s.title:
            parts.append(f"## {markdown_cell(s.title)}\n")
        for p in s.text:
            parts.append(markdown_text(p) + "\n")
        if s.points:
            parts.append(points_markdown(s.points))
        if s.facts:
            parts.append("\n".join(f"- **{markdown_cell(k)}:** {markdown_cell(v)}" for k, v in s.facts) + "\n")
        figure = [f"![{s.figure}]({figures[s.figure]})\n"] if s.figure in figures else []
        if s.figure_first:
            parts += figure
        for t in s.tables:
            if t.title and t.title != s.title:
                parts.append(f"**{markdown_cell(t.title)}**\n")
            parts.append(table_markdown(t))
        if not s.figure_first:
            parts += figure
    return "\n".join(parts)
