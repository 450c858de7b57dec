"""The HTML report is one self-contained page (no external reference: figures are base64 PNG, the
CSS inline, no script) that a real browser renders: headless Chromium opens it from a file, takes
a screenshot that must not be blank, and must log no console message (the page has no script, so
any message is an error: a blocked resource, a parse error). Skips where no Chromium is installed
(Debian: apt-get install -y chromium)."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from rich.console import Console

from lora_bench.report.report_command import report_command
from paths import FIXTURES

STUDY = FIXTURES / "study"
CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install -y chromium)")


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    """The study fixture's report as HTML, rendered once for the tests below."""
    path = tmp_path_factory.mktemp("html") / "report.html"
    report_command([STUDY], group_by=None, baseline=None, metrics=None, fmt="html", output=path, plot=None,
                   console=Console(file=io.StringIO()))
    return path


def test_the_page_is_self_contained(page):
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert "http://" not in text and "https://" not in text and "<script" not in text and "<link" not in text
    sources = re.findall(r'src="([^"]*)"', text)
    assert len(sources) == 2 and all(s.startswith("data:image/png;base64,") for s in sources)  # crossover, phases
    assert "url(" not in text
    # the first screen: the answer and the crossover come before the details
    assert text.index("<h2>Answer</h2>") < text.index("<h2>The crossover</h2>") < text.index("<h2>Where the time goes</h2>")
    assert "lora takes 1.54× [1.23–1.90] (n = 2, ≥ 0.0 %)" in text and "too few repeats" in text


def chromium_screenshot(page: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    """Open ``page`` in headless Chromium; (screenshot, console messages logged)."""
    shot = tmp_path / "shot.png"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1280,2000",
           "--enable-logging=stderr", "--v=0", page.resolve().as_uri()]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180)
    messages = [ln for ln in res.stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]
    return shot, messages


@needs_chromium
def test_chromium_renders_the_report_without_console_errors(page, tmp_path):
    shot, messages = chromium_screenshot(page, tmp_path)
    assert messages == []
    img = Image.open(shot).convert("RGB")
    assert img.size == (1280, 2000)
    small = img.resize((160, 250))
    pixels = list(small.getdata())
    inked = sum(1 for p in pixels if sum(p) < 600) / len(pixels)
    assert inked > 0.05, f"the screenshot is nearly blank ({inked:.1%} of it inked)"
    assert len(set(pixels)) > 50  # text, tables and the figure's colours, not one flat colour


@needs_chromium
def test_the_check_sees_console_errors(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><p>x</p><script>undefined_function();</script></body></html>")
    _, messages = chromium_screenshot(page, tmp_path)
    assert any("Uncaught ReferenceError" in m for m in messages)
