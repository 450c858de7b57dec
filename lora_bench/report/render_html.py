"""A report as one self-contained HTML page: inline CSS, figures embedded as base64 PNG, no
script and no external reference, so it opens from a file in any browser. The first screen holds
the answer at a glance and the crossover figure (``.first``), the details follow; nothing makes the
page scroll sideways: a table scrolls in its own container (``.scroll``), a figure is never wider
than the page, and long words break."""

from __future__ import annotations

import re

from lora_bench.escaping import html_text
from lora_bench.report.document import Document, Section
from lora_bench.report.tables import Table

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d1d1f;
       max-width: 1400px; margin: 1.5em auto; padding: 0 1.2em; overflow-wrap: anywhere; }
h1 { font-size: 1.6em; margin-bottom: .2em; }
h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
.question { font-size: 1.1em; margin: .3em 0; }
.setting { color: #555; font-size: .9em; }
.first { background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 6px; padding: .2em 1.2em 1em; }
.answer li { margin: .5em 0; }
.glance { margin: .6em 0; padding-left: 1.2em; }
.glance li { margin: .25em 0; }
.first img { max-height: 62vh; width: auto; }  /* the figure stays on the first screen */
table { border-collapse: collapse; font-size: .85em; margin: .6em 0; }
th, td { border: 1px solid #d0d7de; padding: .25em .55em; white-space: nowrap; }
th { background: #eef1f4; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.block td { border-top: 2px solid #8c959f; }
.scroll { overflow-x: auto; }
.notes { color: #555; font-size: .85em; margin: .2em 0 1em; padding-left: 1.2em; }
img { max-width: 100%; height: auto; border: 1px solid #eee; box-sizing: border-box; }  /* the border inside the width */
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: .2em 1em; font-size: .9em; }
dl.facts dt { font-weight: 600; }
dl.facts dd { margin: 0; }
code { background: #eef1f4; padding: 0 .25em; border-radius: 3px; }
"""


NUM_TD = '<td class="num">'


def _inline(text: str) -> str:
    """Escape, then the two Markdown marks the generated text uses: **bold** and `code`."""
    out = html_text(text)
    out = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", out)


def table_html(t: Table) -> str:
    head = "".join(f"<th>{html_text(h)}</th>" for h in t.head)
    rows = []
    for i, r in enumerate(t.rows):
        cells = "".join((NUM_TD if j >= t.n_keys else "<td>") + html_text(c).replace("\n", "<br>") + "</td>"
                        for j, c in enumerate(r))
        cls = ' class="block"' if i in t.groups and i else ""
        rows.append(f"<tr{cls}>{cells}</tr>")
    out = f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'
    if t.notes:
        out += '<ul class="notes">' + "".join(f"<li>{_inline(n)}</li>" for n in t.notes) + "</ul>"
    return out


def _section(s: Section, figures: dict[str, str]) -> str:
    out = [f"<h2>{html_text(s.title)}</h2>"] if s.title else []
    out += [f"<p>{_inline(p)}</p>" for p in s.text]
    if s.points:
        out.append('<ul class="answer">' + "".join(
            f"<li><strong>{html_text(p.heading)}</strong><ul>" + "".join(f"<li>{_inline(x)}</li>" for x in p.sentences)
            + "</ul></li>" for p in s.points) + "</ul>")
    if s.facts:
        out.append('<dl class="facts">' + "".join(f"<dt>{html_text(k)}</dt><dd>{html_text(v)}</dd>"
                                                  for k, v in s.facts) + "</dl>")
    figure = ([f'<p><img alt="{html_text(s.figure)} figure" src="data:image/png;base64,{figures[s.figure]}"></p>']
              if s.figure in figures else [])
    if s.figure_first:
        out += figure
    for t in s.tables:
        if t.title and t.title != s.title:
            out.append(f"<h3>{html_text(t.title)}</h3>")
        out.append(table_html(t))
    if not s.figure_first:
        out += figure
    return "\n".join(out)


def _glance(doc: Document, figures: dict[str, str]) -> str:
    lines = '<ul class="glance">' + "".join(f"<li>{_inline(x)}</li>" for x in doc.glance) + "</ul>"
    if doc.glance_figure not in figures:
        return lines
    return lines + (f'\n<p><img alt="{html_text(doc.glance_figure)} figure" '
                    f'src="data:image/png;base64,{figures[doc.glance_figure]}"></p>')


def to_html(doc: Document, *, figures: dict[str, str] | None = None) -> str:
    """``figures``: figure key -> base64 PNG."""
    figures = figures or {}
    first = [s for s in doc.sections if s.first_screen]
    rest = [s for s in doc.sections if not s.first_screen]
    top = []
    if doc.title:
        top.append(f"<h1>{html_text(doc.title)}</h1>")
    if doc.question:
        top.append(f'<p class="question"><strong>Question.</strong> {_inline(doc.question)}</p>')
    if doc.setting:
        top.append(f'<p class="setting">{html_text(doc.setting)}</p>')
    body = "\n".join(top)
    if doc.glance:  # the glance and its figure on the first screen, then every section in order
        body += '\n<div class="first">\n' + _glance(doc, figures) + "\n</div>"
        body += "\n" + "\n".join(_section(s, figures) for s in doc.sections)
    else:
        if first:
            body += '\n<div class="first">\n' + "\n".join(_section(s, figures) for s in first) + "\n</div>"
        body += "\n" + "\n".join(_section(s, figures) for s in rest)
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{html_text(doc.title or 'lora-bench report')}</title>\n<style>{CSS}</style>\n</head>\n"
            f"<body>\n{body}\n</body>\n</html>\n")
