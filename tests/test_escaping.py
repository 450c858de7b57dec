"""The escaping of text where lora-bench shows it (lora_bench.escaping): each function on its own;
the renderers, writers and the error printer that use it are tested beside them."""

from __future__ import annotations

import pytest

from lora_bench.escaping import csv_cell, csv_value, markdown_cell, markup, terminal

# A window title (OSC), clear screen (CSI), an 8-bit CSI (C1), a bell, a right-to-left override,
# a zero-width space, a line separator, a lone surrogate (an undecodable file-name byte).
CONTROLS = ["\x1b]0;title\x07", "\x1b[2J", "\x9b2J", "\x07", "\u202e", "\u200b", "\u2028", "\udcff", "\x00", "\x7f"]


@pytest.mark.parametrize("bad", CONTROLS)
def test_terminal_text_shows_control_characters_as_escapes(bad):
    out = terminal(f"a{bad}b")
    assert out.startswith("a") and out.endswith("b") and "\\" in out
    assert all(ch.isprintable() for ch in out), repr(out)
    out.encode("utf-8")  # writable to any UTF-8 terminal or file


def test_terminal_text_leaves_printable_text_alone_and_keeps_lines_when_asked():
    text = "LoRA r16 · 1.41× — ünïcödé [x]"
    assert terminal(text) == text
    assert terminal("one\ntwo\tthree") == "one\\ntwo\\tthree"
    assert terminal("one\ntwo\tthree\x1b", newlines=True) == "one\ntwo\tthree\\x1b"


def test_markup_escapes_rich_markup_too():
    from rich.console import Console
    from rich.text import Text

    text = "[bold]x[/bold] [link=http://example.invalid]y[/link]\x1b[2J"
    console = Console(width=200, record=True, color_system=None)
    console.print(markup(text))
    assert console.export_text().strip() == Text(terminal(text)).plain


@pytest.mark.parametrize("value", ["=1+1", "+x", "-x", "@x", "\tx", "\rx", "＝x", "'x", "''", "a", "", "-1.5",
                                   "+1e5", "-inf", "nan", "1"])
def test_a_csv_cell_reads_back_as_given_and_never_starts_a_formula(value):
    stored = csv_cell(value)
    assert csv_value(stored) == value
    numeric = value.lstrip("+-").replace(".", "", 1).replace("e5", "").isdigit() or value in ("-inf", "nan")
    if value.startswith(("=", "+", "-", "@", "\t", "\r", "＝", "'")) and not numeric:
        assert stored == "'" + value
    else:
        assert stored == value


def test_non_text_csv_cells_are_unchanged():
    assert csv_cell(-1.5) == -1.5 and csv_cell(None) is None and csv_cell(3) == 3


def test_a_markdown_cell_shows_its_text_literally():
    cell = markdown_cell("<script>alert(1)</script> | `code` [a](javascript:x) \\ line\nbreak \x1b")
    assert "<" not in cell and ">" not in cell and "\x1b" not in cell and "\n" not in cell
    assert "&lt;script&gt;" in cell and "\\|" in cell and "\\`code\\`" in cell and "\\[a\\]" in cell
    assert markdown_cell("trainable_layers=all, 1.41×") == "trainable_layers=all, 1.41×"


def test_markdown_text_escapes_html_outside_code_spans_only():
    from lora_bench.escaping import markdown_text

    out = markdown_text("run `a && b <c>` then <script>x</script> & more")
    assert "`a && b <c>`" in out  # a code span is shown literally by Markdown: no entity inside
    assert "<script>" not in out and "&lt;script&gt;" in out and "&amp; more" in out
