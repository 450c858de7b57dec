"""Committed reports are what their runs give today: every report a results folder's manifest
declares is rendered again from the committed runs into a temporary folder and compared with the
committed file (``lora_bench.publish.committed``), as ``lora-bench results render --check`` does.

What is compared, and why: Markdown, CSV and JSON exactly; an HTML page exactly except for its
embedded figures, which are cut out and compared as PNG files; a PNG by its pixel size and the
digest of what it draws (every text and data coordinate, stored in the file when it is drawn), not
by its pixels: matplotlib and FreeType versions differ from machine to machine in antialiasing and
glyph shapes, never in what a figure says, and the digest changes whenever a number or label does."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
from pathlib import Path

import pytest

from lora_bench.errors import ResultsError
from lora_bench.publish.committed import (
    CONTENT_KEY,
    EMBEDDED_PNG,
    REPORT_FILE,
    compare_file,
    declared_folders,
    png_facts,
    recipes,
    stale_reports,
)
from paths import ROOT


RESULTS = ROOT / "results"


@pytest.mark.slow
def test_committed_reports_are_what_their_runs_give():
    stale = [f"{p.relative_to(ROOT)}: {why}" for p, why in stale_reports(RESULTS)]
    assert not stale, "out of date, run `lora-bench results render`:\n" + "\n".join(stale)


def test_every_committed_report_is_declared():
    holding = {p.parent for p in RESULTS.rglob("report*") if REPORT_FILE.fullmatch(p.name)}
    assert holding, "no committed report found"
    assert holding <= set(declared_folders(RESULTS))


def _copy(folder: str, tmp_path: Path) -> tuple[Path, Path]:
    """A results root in tmp_path holding a copy of one committed folder."""
    root = tmp_path / "results"
    dest = root / folder
    shutil.copytree(RESULTS / folder, dest)
    return root, dest


@pytest.mark.slow
def test_a_hand_edited_report_is_named(tmp_path, run_cli):
    """The check can fail: an edited Markdown line, swapped figure files and swapped embedded
    figures in the HTML are each named, with why; the untouched files are not."""
    root, peers = _copy("answer/peers", tmp_path)
    assert stale_reports(root) == []  # the copy renders as committed (its inputs are named the same)
    md = peers / "report.md"
    md.write_text(md.read_text().replace("30.6 (no interval, n = 1)", "29.9 (no interval, n = 1)", 1))
    a, b = (peers / "report-crossover.png").read_bytes(), (peers / "report-phases.png").read_bytes()
    (peers / "report-crossover.png").write_bytes(b)
    (peers / "report-phases.png").write_bytes(a)
    page = (peers / "report.html").read_text()
    first, second = EMBEDDED_PNG.findall(page)
    (peers / "report.html").write_text(page.replace(first, "FIRST").replace(second, first).replace("FIRST", second))
    stale = {p.name: why for p, why in stale_reports(root)}
    assert set(stale) == {"report.md", "report-crossover.png", "report-phases.png", "report.html"}, stale
    assert "29.9 (no interval, n = 1)" in stale["report.md"] and "30.6 (no interval, n = 1)" in stale["report.md"]
    assert "px" in stale["report-crossover.png"]  # the phase figure has another size
    assert stale["report.html"].startswith("embedded figure 1")

    code, out = run_cli("results", "render", "--root", root, "--check")
    assert code == 1 and "report.md" in out and "out of date" in out
    (root / "README.md").write_text("# Results\n\nan index older than the reports\n")
    code, out = run_cli("results", "render", "--root", root)
    assert code == 0 and stale_reports(root) == []  # rendering puts them right
    assert run_cli("results", "index", root, "--check")[0] == 0, out  # and the index that lists them


def test_a_report_no_recipe_writes_and_a_folder_without_recipes_are_named(tmp_path):
    root, peers = _copy("answer/peers", tmp_path)
    (peers / "report-old.md").write_text("left over\n")
    undeclared = root / "other"
    undeclared.mkdir()
    (undeclared / "report.md").write_text("# written by hand\n")
    stale = {p.relative_to(root).as_posix(): why for p, why in stale_reports(root)}
    assert stale == {"answer/peers/report-old.md": "no recipe of the folder's manifest writes it",
                     "other": "it holds reports but its manifest.json declares no reports"}


def _png(data: bytes, *, digest: str | None = None, size: tuple[int, int] | None = None, shade: int = 0) -> bytes:
    from PIL import Image, ImageDraw
    from PIL.PngImagePlugin import PngInfo

    img = Image.open(io.BytesIO(data)).convert("RGBA")
    if size:
        img = img.resize(size)
    ImageDraw.Draw(img).rectangle((0, 0, 40, 40), fill=(shade, 0, 0, 255))  # other pixels
    info = PngInfo()
    info.add_text(CONTENT_KEY, png_facts(data)[2] if digest is None else digest)
    out = io.BytesIO()
    img.save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def test_png_comparison_reads_size_and_content_not_pixels(tmp_path):
    committed = (RESULTS / "answer" / "peers" / "report-crossover.png").read_bytes()
    w, h, digest = png_facts(committed)
    assert digest.startswith("sha256:")
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(committed)
    b.write_bytes(_png(committed, shade=200))  # other pixels (another rasteriser), same size and content
    assert compare_file(a, b) is None
    b.write_bytes(_png(committed, digest="sha256:" + "0" * 64))
    assert "other numbers or labels" in compare_file(a, b)
    b.write_bytes(_png(committed, size=(w + 1, h)))
    assert f"{w}×{h} px" in compare_file(a, b)
    b.write_bytes(_png(committed, digest=""))
    a.write_bytes(b.read_bytes())  # a figure drawn without the digest is never taken as current
    b.write_bytes(committed)
    assert "no content digest" in compare_file(a, b)


def test_html_text_outside_its_figures_is_compared_exactly(tmp_path):
    page = (RESULTS / "answer" / "peers" / "report.html").read_text()
    a, b = tmp_path / "a.html", tmp_path / "b.html"
    a.write_text(page)
    first = EMBEDDED_PNG.findall(page)[0]
    other = base64.b64encode(_png(base64.b64decode(first), shade=90)).decode()
    b.write_text(page.replace(first, other))
    assert compare_file(a, b) is None  # the same figure drawn with other pixels
    b.write_text(page.replace("<h2>Answer</h2>", "<h2>Answer </h2>"))
    assert re.match(r"line \d+ differs", compare_file(a, b))


def _manifest(folder: Path, reports) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"description": "", "invocations": [], "reports": reports}))


@pytest.mark.parametrize("reports, needle", [
    ({"format": "html"}, "must be a list"),
    ([{"format": "pdf", "output": "r.pdf"}], "format 'pdf' is not allowed; choose one of"),
    ([{"format": "html", "output": "r.html", "colour": "red"}], "unknown key 'colour'; allowed: format, output"),
    ([{"format": "html"}], "output is missing"),
    ([{"format": "html", "output": "/tmp/r.html"}], "must be a file name in the folder itself starting with 'report'"),
    ([{"format": "markdown", "output": "report.md", "plot": "../report.png"}], "plot '../report.png' must be a file name"),
    ([{"format": "html", "output": "r.html", "inputs": ["absent"]}], "input 'absent' is not a folder"),
    ([{"format": "html", "output": "r.html", "threshold": 100}], "threshold 100: give a percentage"),
])
def test_a_bad_recipe_is_refused_with_what_is_allowed(tmp_path, reports, needle):
    _manifest(tmp_path / "results" / "x", reports)
    with pytest.raises(ResultsError, match=re.escape(needle)):
        recipes(tmp_path / "results" / "x", root=tmp_path / "results")


@pytest.mark.parametrize("reports, needle", [
    ([{"format": "csv", "output": "runs.csv"}], "output 'runs.csv' must be a file name in the folder itself"),
    ([{"format": "json", "output": "manifest.json"}], "output 'manifest.json' must be"),
    ([{"format": "markdown", "output": "report.md", "plot": "runs.csv"}], "plot 'runs.csv' must be"),
    ([{"format": "markdown", "output": "run-1/run.json"}], "output 'run-1/run.json' must be"),
    ([{"format": "markdown", "output": "report/x.md"}], "output 'report/x.md' must be"),
    ([{"format": "markdown", "output": "."}], "output '.' must be"),
    ([{"format": "markdown", "output": "report\x1b[2J.md"}], "without control characters"),
    ([{"format": "markdown", "output": "report\x00.md"}], "without control characters"),
    ([{"format": "markdown", "output": "report.md"}, {"format": "html", "output": "report.md"}],
     "reports[1]: it writes 'report.md', which reports[0] writes too"),
    ([{"format": "markdown", "output": "report.md", "plot": "report.png"}, {"format": "csv", "output": "report-phases.png"}],
     "reports[1]: it writes 'report-phases.png', which reports[0] writes too"),
])
def test_a_recipe_never_writes_over_the_folders_results(tmp_path, reports, needle):
    folder = tmp_path / "results" / "x"
    _manifest(folder, reports)
    (folder / "run-1").mkdir()
    with pytest.raises(ResultsError, match=re.escape(needle)):
        recipes(folder, root=tmp_path / "results")


@pytest.mark.parametrize("link", ["report.md", "report-phases.png"])
def test_a_recipe_never_writes_through_a_link(tmp_path, link):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("kept")
    folder = tmp_path / "results" / "x"
    _manifest(folder, [{"format": "markdown", "output": "report.md"}])
    (folder / link).symlink_to(outside / "victim")
    with pytest.raises(ResultsError, match=re.escape(f"'{link}' in {folder} is a link")):
        recipes(folder, root=tmp_path / "results")


def test_a_recipe_reads_no_input_outside_its_folder(tmp_path):
    (tmp_path / "outside").mkdir()
    folder = tmp_path / "results" / "x"
    _manifest(folder, [{"format": "markdown", "output": "report.md", "inputs": ["w1"]}])
    (folder / "w1").symlink_to(tmp_path / "outside")
    with pytest.raises(ResultsError, match=re.escape("input 'w1' is not a folder inside")):
        recipes(folder, root=tmp_path / "results")


def test_render_refuses_a_folder_without_recipes(tmp_path, run_cli):
    (tmp_path / "results" / "x").mkdir(parents=True)
    code, out = run_cli("results", "render", "--root", tmp_path / "results", tmp_path / "results" / "x")
    assert code == 2 and "declares no reports" in out and "Traceback" not in out
    _manifest(tmp_path / "results" / "y", [{"format": "html", "output": "r.html", "colour": "red"}])
    code, out = run_cli("results", "render", "--root", tmp_path / "results")
    assert code == 2 and "unknown key 'colour'" in out and "Traceback" not in out


def test_a_recipe_reads_as_its_report_command():
    (r,) = [r for r in recipes(RESULTS / "scaling" / "ddp-2gpu", root=RESULTS) if r.format == "markdown"]
    assert r.command() == ("lora-bench report results/scaling/ddp-2gpu/w1 results/scaling/ddp-2gpu/one "
                           "results/scaling/ddp-2gpu/ddp --pool --group-by "
                           "model_size,trainable_layers,precision,cuda_graphs,nproc,batch_size --format markdown "
                           "--output results/scaling/ddp-2gpu/report.md")
