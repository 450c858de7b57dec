"""Every committed report.html, opened in a real browser (headless Chromium) at 1280 and 1920 px
wide, lays out as meant: no table, figure or text block cut off or sticking out sideways (its
scrollWidth beyond its clientWidth, or its right edge beyond the viewport; a table inside a
scrolling container the page provides, ``overflow-x: auto``, may be wider than the page, the
container may not), every image loads (naturalWidth > 0), and the answer (the first-screen block,
``.first``) and its figure start within the first viewport height.

The browser: $LORA_BENCH_BROWSER, else ``chromium``, ``chromium-browser`` or ``google-chrome`` on
PATH; without one that starts, these tests skip and say why. A copy of each page gets a small
script that measures the layout after the page has loaded and writes what it found into the DOM,
which ``--dump-dom`` prints; the committed pages themselves hold no script."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from paths import ROOT


PAGES = sorted((ROOT / "results").rglob("report.html"))
SIZES = ((1280, 800), (1920, 1080))  # window sizes; the viewport is what the window leaves
BROWSERS = ("chromium", "chromium-browser", "google-chrome")

pytestmark = pytest.mark.browser

PROBE = r"""
window.addEventListener('load', () => {
  const vw = document.documentElement.clientWidth, vh = window.innerHeight, found = [];
  const name = el => {
    const img = el.tagName === 'IMG' ? el : el.querySelector('img');
    const text = (el.innerText || (img ? img.alt : '')).trim().replace(/\s+/g, ' ').slice(0, 60);
    return `<${el.tagName.toLowerCase()}${el.className ? ' class=' + el.className : ''}> "${text}"`;
  };
  const scroller = el => {
    for (let p = el.parentElement; p && p !== document.body; p = p.parentElement) {
      const o = getComputedStyle(p).overflowX;
      if (o === 'auto' || o === 'scroll') return p;
    }
    return null;
  };
  const sticksOut = (el, what) => {
    const right = el.getBoundingClientRect().right;
    if (right > vw + 1) found.push(`${what} ${name(el)} ends at ${Math.round(right)} px, beyond the ${vw} px viewport`);
    if (el.scrollWidth > el.clientWidth + 1 && el.tagName !== 'IMG')
      found.push(`${what} ${name(el)} is cut off: ${el.scrollWidth} px of content in ${el.clientWidth} px`);
  };
  if (document.documentElement.scrollWidth > vw + 1)
    found.push(`the page scrolls sideways: ${document.documentElement.scrollWidth} px wide in a ${vw} px viewport`);
  const checked = new Set();
  for (const el of document.querySelectorAll('table, img, pre, dl, p, ul, h1, h2, h3')) {
    const box = scroller(el);
    if (box) {  // an intended scrolling container: it scrolls, and it has to fit the page
      if (!checked.has(box)) { checked.add(box); const r = box.getBoundingClientRect().right;
        if (r > vw + 1) found.push(`the scrolling container of ${name(el)} ends at ${Math.round(r)} px, beyond the ${vw} px viewport`); }
      continue;
    }
    sticksOut(el, el.tagName === 'TABLE' ? 'table' : el.tagName === 'IMG' ? 'figure' : 'block');
  }
  for (const img of document.images)
    if (!img.complete || img.naturalWidth === 0) found.push(`figure ${name(img)} does not load`);
  const first = document.querySelector('.first');
  if (!first) found.push('no answer block (.first) on the page');
  else if (first.getBoundingClientRect().top + window.scrollY >= vh)
    found.push(`the answer starts at ${Math.round(first.getBoundingClientRect().top + window.scrollY)} px, below the first screen (${vh} px)`);
  const figure = first && first.querySelector('img');
  if (first && !figure) found.push('no figure in the answer block (.first)');
  else if (figure && figure.getBoundingClientRect().top + window.scrollY >= vh)
    found.push(`the figure starts at ${Math.round(figure.getBoundingClientRect().top + window.scrollY)} px, below the first screen (${vh} px)`);
  const out = document.createElement('pre');
  out.id = 'lora-bench-probe';
  out.textContent = JSON.stringify({viewport: [vw, vh], images: document.images.length, problems: found});
  document.body.appendChild(out);
});
"""


def _works(path: str) -> str:
    """'' when the browser at ``path`` starts, else why not."""
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{path} does not start ({e})"
    if done.returncode != 0 or "chrom" not in done.stdout.lower():
        return f"{path} --version answered {done.returncode}: {(done.stdout + done.stderr).strip()[:200]}"
    return ""


@pytest.fixture(scope="session")
def browser() -> str:
    """A headless-capable Chromium, or a skip naming what was looked for."""
    asked = os.environ.get("LORA_BENCH_BROWSER")
    candidates = [asked] if asked else [p for p in map(shutil.which, BROWSERS) if p]
    if not candidates:
        pytest.skip(f"needs a browser: none of {', '.join(BROWSERS)} on PATH (or set LORA_BENCH_BROWSER)")
    why = []
    for path in candidates:
        problem = _works(path)
        if not problem:
            return path
        why.append(problem)
    pytest.skip("needs a browser that starts: " + "; ".join(why))


def layout(browser: str, page: Path, size: tuple[int, int], tmp: Path) -> dict:
    """What the probe found on a copy of ``page`` in a window of ``size``."""
    copy = tmp / f"{page.parent.name}-{size[0]}.html"
    text = page.read_text()
    assert "</body>" in text, page
    copy.write_text(text.replace("</body>", f"<script>{PROBE}</script>\n</body>"))
    args = [browser, "--headless", "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp / 'profile'}",
            f"--window-size={size[0]},{size[1]}", "--dump-dom", copy.as_uri()]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
    done = subprocess.run(args, capture_output=True, text=True, timeout=180)
    found = re.search(r'<pre id="lora-bench-probe">(.*?)</pre>', done.stdout, re.S)
    assert found, f"the browser printed no layout (exit {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def test_there_are_pages_to_check():
    assert PAGES, "no committed report.html under results/"


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}px" for w, _ in SIZES])
@pytest.mark.parametrize("page", PAGES, ids=[str(p.parent.relative_to(ROOT / "results")) for p in PAGES])
def test_committed_report_lays_out_in_a_browser(browser, tmp_path, page, size):
    found = layout(browser, page, size, tmp_path)
    assert found["viewport"][0] <= size[0] and found["viewport"][0] > 0.9 * size[0], found["viewport"]
    assert found["images"] == page.read_text().count("<img "), found
    assert not found["problems"], f"{page.relative_to(ROOT)} at {size[0]} px:\n" + "\n".join(found["problems"])


def _edited(tmp_path: Path, change) -> Path:
    page = ROOT / "results" / "answer" / "peers" / "report.html"
    out = tmp_path / "edited" / "report.html"
    out.parent.mkdir()
    text = page.read_text()
    edited = change(text)
    assert edited != text
    out.write_text(edited)
    return out


def test_the_check_fails_on_a_table_wider_than_the_page(browser, tmp_path):
    wide = "<table><tr>" + "".join(f"<td>column {i} of a table wider than any page</td>" for i in range(40)) + "</tr></table>"
    page = _edited(tmp_path, lambda t: t.replace("<h2>Where the time goes</h2>", wide + "<h2>Where the time goes</h2>", 1))
    problems = layout(browser, page, SIZES[0], tmp_path)["problems"]
    assert any(p.startswith('table <table> "column 0') and "beyond the" in p for p in problems), problems
    assert any("the page scrolls sideways" in p for p in problems), problems


def test_the_check_fails_on_a_figure_that_does_not_load_and_an_answer_below_the_first_screen(browser, tmp_path):
    def change(text):
        text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "data:image/png;base64,bm90IGEgcG5n", text, count=1)
        return text.replace('<div class="first">', '<div style="height: 3000px">tall</div>\n<div class="first">', 1)

    problems = layout(browser, _edited(tmp_path, change), SIZES[1], tmp_path)["problems"]
    assert sum("does not load" in p for p in problems) == 1, problems
    assert any("below the first screen" in p for p in problems), problems


def test_a_wide_table_in_the_pages_scrolling_container_passes(browser, tmp_path):
    """The page's own scrolling container (.scroll) is meant for tables wider than the page: the
    check accepts it, so that the failures above are about the layout, not about wide tables."""
    wide = ('<div class="scroll"><table><tr>' + "".join(f"<td>column {i}</td>" for i in range(200))
            + "</tr></table></div>")
    page = _edited(tmp_path, lambda t: t.replace("<h2>Where the time goes</h2>", wide + "<h2>Where the time goes</h2>", 1))
    assert layout(browser, page, SIZES[0], tmp_path)["problems"] == []
