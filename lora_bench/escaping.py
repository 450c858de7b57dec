"""Text from files and users, made safe where it is shown: a terminal (``terminal``, ``markup``),
a CSV cell (``csv_cell``, read back by ``csv_value``; ``report_csv_cell`` in a CSV report), HTML
(``html_text``), JSON (``json_text``), Markdown (``markdown_cell``, ``markdown_text``,
``markdown_code``). One function per place, applied where the text leaves lora-bench (the
renderers, the CSV writers, the error printer), so the values themselves stay as they were given."""

from __future__ import annotations

import hashlib
import html
import re
import unicodedata

from rich.markup import escape as _rich_escape

# Unicode categories never shown as themselves: controls (C0, DEL, C1), format characters (the
# bidirectional overrides and isolates, zero-width characters), line and paragraph separators, and
# lone surrogates (undecodable bytes of a file name), which cannot even be written out as UTF-8.
_HIDDEN = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs"))
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _shown(ch: str) -> str:
    if ch in _SHORT:
        return _SHORT[ch]
    n = ord(ch)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def terminal(text: object, *, newlines: bool = False) -> str:
    """``text`` with every control and invisible format character (C0, DEL, C1, and Unicode's
    invisible format characters such as the bidirectional overrides) shown as an escape (``\\x1b``,
    ``\\u202e``) instead of being sent: a value cannot retitle the window, clear the screen or
    reorder what is printed around it. ``newlines`` keeps line breaks (a multi-line message) and tabs."""
    text = str(text)
    if text.isprintable():  # the common case, at C speed: nothing to escape
        return text
    keep = "\n\t" if newlines else ""
    return "".join(_shown(ch) if ch not in keep and unicodedata.category(ch) in _HIDDEN else ch for ch in text)


SHOWN_CHARS = 200  # characters of one value echoed in a table, a heading or a message


def clip(text: object, limit: int = SHOWN_CHARS) -> str:
    """``text`` as echoed: at most about ``limit`` characters, a longer one cut, with its length
    and a digest of the whole said (``99999… (5,000 characters, #1a2b3c4d)``), so that one value
    from a file cannot flood a report and two long values that differ still read differently."""
    text = str(text)
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode(errors="surrogatepass")).hexdigest()[:8]
    return f"{text[: max(limit - 40, 8)]}… ({len(text):,} characters, #{digest})"


_LONG_WORD = re.compile(r"\S{%d,}" % (SHOWN_CHARS + 1))


def clip_words(text: object) -> str:
    """``text`` (a message) with every run of more than SHOWN_CHARS characters without a space cut
    as ``clip`` cuts it: a message quoting a value given by a user or a file stays readable."""
    return _LONG_WORD.sub(lambda m: clip(m.group()), str(text))


def markup(text: object, *, newlines: bool = False) -> str:
    """``terminal(text)`` with rich's markup (``[bold]``, ``[link=…]``) escaped: for text inside a
    string that rich parses."""
    return _rich_escape(terminal(text, newlines=newlines))


# -- CSV cells ------------------------------------------------------------------------------------
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\uff1d", "\uff0b", "\uff0d", "\uff20")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:inf|infinity|nan)", re.IGNORECASE)
QUOTE = "'"


def csv_cell(value: object) -> object:
    """A value as a CSV writer should store it: text a spreadsheet would run as a formula (it starts
    with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return, or their full-width forms) gets a
    leading ``'``, as OWASP's CSV-injection guidance recommends; a number (``-1.5``) and other
    values are returned unchanged. A text that starts with ``'`` itself gets one more, so every
    written cell reads back exactly through ``csv_value``."""
    if not isinstance(value, str) or not value:
        return value
    if value.startswith(QUOTE) or (value.startswith(_FORMULA_START) and not _NUMBER.fullmatch(value)):
        return QUOTE + value
    return value


def report_csv_cell(value: object) -> object:
    """A text cell of a CSV report (not a results table, which keeps values exactly): its control
    and invisible format characters shown as escapes (``terminal``), then ``csv_cell``."""
    return csv_cell(terminal(value)) if isinstance(value, str) else value


def csv_value(text: str) -> str:
    """A cell as ``csv_cell`` stored it, read back: one leading quote dropped (lora-bench's readers
    apply it to every cell)."""
    return text[1:] if isinstance(text, str) and text.startswith(QUOTE) else text


# -- HTML -----------------------------------------------------------------------------------------
def html_text(text: object) -> str:
    """``text`` as HTML text or an attribute value: its control and invisible format characters
    shown as escapes (``terminal``; line breaks kept), then ``&``, ``<``, ``>`` and quotes escaped."""
    return html.escape(terminal(text, newlines=True))


# -- JSON -----------------------------------------------------------------------------------------
def json_text(text: str) -> str:
    """A JSON document (``json.dumps(..., ensure_ascii=False)``) with every control and invisible
    format character its strings hold written as a ``\\uXXXX`` escape: the document reads back the
    same, and printing it sends no control sequence or bidirectional override."""
    if text.isprintable():
        return text

    def escaped(ch: str) -> str:
        if ch in "\n\t" or unicodedata.category(ch) not in _HIDDEN:
            return ch
        n = ord(ch)
        if n < 0x10000:
            return f"\\u{n:04x}"
        n -= 0x10000
        return f"\\u{0xD800 + (n >> 10):04x}\\u{0xDC00 + (n & 0x3FF):04x}"

    return "".join(map(escaped, text))


# -- Markdown -------------------------------------------------------------------------------------
_MD_SPECIAL = re.compile(r"([\\`|\[\]])")


def markdown_cell(text: object) -> str:
    """``text`` shown literally in a Markdown table cell (GitHub's and CommonMark's tables): ``|``
    cannot end the cell, backticks, brackets and HTML (``<script>``) are escaped, a line break
    becomes a space."""
    out = _MD_SPECIAL.sub(r"\\\1", markdown_text(text))
    return out.replace("\n", " ").replace("\t", " ")


def markdown_code(text: object) -> str:
    """``text`` as an inline code span inside a Markdown table cell: a fence longer than any run of
    backticks in it, ``|`` escaped (GitHub's tables split a row at it even inside code), control
    characters and line breaks shown as escapes (``\\n``), so that the row stays one row."""
    out = terminal(text).replace("|", "\\|")
    fence = "`" * (max(map(len, re.findall("`+", out)), default=0) + 1)
    pad = " " if out.startswith("`") or out.endswith("`") else ""
    return f"{fence}{pad}{out}{pad}{fence}"


_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def markdown_text(text: object) -> str:
    """Generated Markdown (a paragraph with **bold** and `code` marks) that may quote values: its
    HTML (``<script>``) and control characters escaped, its Markdown marks kept. A code span's
    text is left as it is (Markdown shows it literally: ``&&`` stays ``&&``, ``<b>`` is no tag)."""
    text, out, at = terminal(text, newlines=True), [], 0
    for m in _CODE_SPAN.finditer(text):
        out += [html.escape(text[at:m.start()], quote=False), m.group(0)]
        at = m.end()
    return "".join(out) + html.escape(text[at:], quote=False)
