"""A report as Markdown: figures referenced by path (written beside the file by the command)."""

from __future__ import annotations

from lora_bench.report.document import Document
from lora_bench.report.tables import Table


def _esc(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table_markdown(t: Table) -> str:
    align = ["---"] * t.n_keys + ["---:"] * (len(t.head) - t.n_keys)
    lines = ["| " + " | ".join(_esc(c) for c in r) + " |" for r in (t.head, align, *t.rows)]
    out = "\n".join(lines) + "\n"
    if t.notes:
        out += "\n" + "\n".join(f"- {n}" for n in t.notes) + "\n"
    return out


def points_markdown(points) -> str:
    lines = []
    for p in points:
        lines.append(f"- **{p.heading}**")
        lines += [f"  - {x}" for x in p.sentences]
    return "\n".join(lines) + "\n"


def to_markdown(doc: Document, *, figures: dict[str, str] | None = None) -> str:
    """``figures``: figure key -> path (relative to the Markdown file) to link."""
    figures = figures or {}
    parts = []
    if doc.title:
        parts.append(f"# {doc.title}\n")
    if doc.question:
        parts.append(f"**Question.** {doc.question}\n")
    if doc.setting:
        parts.append(f"*{doc.setting}*\n")
    for s in doc.sections:
        if s.title:
            parts.append(f"## {s.title}\n")
        for p in s.text:
            parts.append(p + "\n")
        if s.points:
            parts.append(points_markdown(s.points))
        if s.facts:
            parts.append("\n".join(f"- **{k}:** {v}" for k, v in s.facts) + "\n")
        figure = [f"![{s.figure}]({figures[s.figure]})\n"] if s.figure in figures else []
        if s.figure_first:
            parts += figure
        for t in s.tables:
            if t.title and t.title != s.title:
                parts.append(f"**{t.title}**\n")
            parts.append(table_markdown(t))
        if not s.figure_first:
            parts += figure
    return "\n".join(parts)
