"""The documentation matches the code and the committed results: the schema page and every generated
table are what ``docs/generate.py`` makes of them today, the README stays short, and relative links
point at files that exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_docs_are_up_to_date():
    gen = _generator()
    stale = [str(p.relative_to(ROOT)) for p in gen.outdated()]
    assert not stale, f"out of date, run `python docs/generate.py`: {stale}"


def test_the_schema_page_lists_every_column():
    from lora_bench.config import TrainConfig
    from lora_bench.results.schema import ENV_COLUMNS, RUN_COLUMNS, SETTING_PREFIX, STEP_COLUMNS

    page = (ROOT / "docs" / "results-schema.md").read_text()
    names = [c.name for c in RUN_COLUMNS + ENV_COLUMNS + STEP_COLUMNS]
    names += [SETTING_PREFIX + n for n in TrainConfig.field_names()]
    missing = [n for n in names if f"`{n}`" not in page]
    assert not missing, missing


def test_a_generated_block_follows_its_source(tmp_path, monkeypatch):
    """The check can fail: a table edited by hand, or a block naming no known table, is caught."""
    gen = _generator()
    text = "intro\n<!-- generated:answer -->\n| edited by hand |\n<!-- /generated -->\n"
    rendered = gen.render_blocks(text)
    assert rendered != text and "| edited by hand |" not in rendered and gen.table_answer() in rendered
    with pytest.raises(KeyError, match="unknown generated block"):
        gen.render_blocks("<!-- generated:nothing -->\n<!-- /generated -->")


def test_readme_is_short_and_answers_first():
    text = (ROOT / "README.md").read_text()
    words = len(re.sub(r"<!--.*?-->", " ", text, flags=re.S).split())
    assert words <= 1600, words
    first_screen = "\n".join(text.splitlines()[:40])
    assert "<!-- generated:answer -->" in first_screen and "make run" in text[:4000] and "make test" in text[:4000]


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)  # code is not a link: `kernel[grid](...)`
CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)  # a fenced block's lines are not headings


ANCHORED_LINK = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The anchors a Markdown page's headings get: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading numbered (-1, -2, ...), as GitHub renders them."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", CODE_BLOCK.sub("", page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/README.md", *[
    str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md"))]])
def test_relative_links_point_at_files(doc):
    """Every relative link names a file that exists, and a link to a section of a Markdown page
    (``page.md#section``, ``#section``) names a heading of that page."""
    path = ROOT / doc
    text = CODE.sub("", path.read_text())
    broken = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (path.parent / target).exists():
            broken.append(target)
    for target, anchor in ANCHORED_LINK.findall(text):
        page = path.parent / target if target else path
        if "://" not in target and page.suffix == ".md" and page.exists() and anchor not in _anchors(page):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{doc}: {broken}"


RESULTS_PATH = re.compile(r"(?<![\w./-])results/[A-Za-z0-9_.*{}/-]*[A-Za-z0-9_/]")
# a docs page cited by path (docs/measuring.md) or by name after "docs" (docs measuring.md), with its
# section where one is named (docs/measuring.md#a-drifting-host)
DOCS_PATH = re.compile(r"(?<![\w./-])docs[/ ]([A-Za-z0-9_-]+\.md)(?:#([A-Za-z0-9_-]+))?")
# folders a command writes by default, never committed (.gitignore), and placeholders in examples
NOT_COMMITTED = ("results/runs", "results/smoke", "results/kernel-bench", "results/tmp", "results/DIR",
                 "results/FILE", "results/before", "results/after",
                 *(f"results/{p.stem}" for p in (ROOT / "configs").glob("*.yaml")))  # a sweep's default folder
OUTPUT_FLAG = re.compile(r"--(?:results-dir|out|output|plot)[ =](results/[^\s`'\"]+)")


def _cited_texts():
    yield from (ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md")))
    yield from sorted((ROOT / "configs").glob("*.yaml"))
    yield from sorted((ROOT / "lora_bench").rglob("*.py"))
    yield from sorted((ROOT / "benchmarks").glob("*.py"))
    yield from sorted((ROOT / "results").rglob("report.md"))


def _missing_docs(text: str) -> list[str]:
    """Cited docs pages that do not exist, and cited sections that their page does not have."""
    out = []
    for name, anchor in DOCS_PATH.findall(text):
        page = ROOT / "docs" / name
        if not page.exists():
            out.append(f"docs/{name}")
        elif anchor and anchor not in _anchors(page):
            out.append(f"docs/{name}#{anchor}")
    return out


def _missing_paths(text: str) -> list[str]:
    """Cited paths that do not exist (docs pages and their sections: ``_missing_docs``); a folder a
    command in the same text writes (--results-dir, --out, --output, --plot) is an output, not a
    citation."""
    outputs = tuple(p.rstrip("/.") for p in OUTPUT_FLAG.findall(text))
    out = []
    for path in RESULTS_PATH.findall(text):
        path = path.rstrip("/.")
        if path.startswith(NOT_COMMITTED + outputs) or any(c in path for c in "*{}"):
            continue
        if not (ROOT / path).exists():
            out.append(path)
    return out + _missing_docs(text)


def test_every_cited_results_folder_and_doc_exists():
    """Every results/... and docs/... path that the docs, configs, package, benchmarks and committed
    reports name, code spans included, exists, and every docs section they name (a page.md#section)
    is a heading of its page (the recorded commands in results/README.md are history and are not
    checked)."""
    missing = {str(p.relative_to(ROOT)): m for p in _cited_texts() if (m := _missing_paths(p.read_text()))}
    assert not missing, missing


def test_every_docs_page_and_section_the_tests_cite_exists():
    """Tests cite the docs page whose figures or rules they hold the code to; those pages and
    sections exist. (Their results/... paths are fixtures, not citations.)"""
    missing = {str(p.relative_to(ROOT)): m for p in sorted((ROOT / "tests").rglob("*.py"))
               if (m := _missing_docs(p.read_text()))}
    assert not missing, missing


MISSING_PAGE = "docs/" + "performance.md"  # spelled in two pieces: this file is one the check reads


def test_the_path_check_sees_a_missing_folder_inside_a_code_span():
    assert _missing_paths(f"see `results/answer/no-such-folder/` and {MISSING_PAGE}") == [
        "results/answer/no-such-folder", MISSING_PAGE]
    assert _missing_paths("`results/answer/study/`, results/runs/runs.csv") == []


def test_the_docs_check_sees_a_missing_page_by_name_and_a_missing_section():
    assert _missing_docs("(docs " + "performance.md, \"LoRA layer\")") == [MISSING_PAGE]
    assert _missing_docs("docs/measuring.md#a-drifting-host, docs/measuring.md#" + "no-such-section") == [
        "docs/measuring.md#" + "no-such-section"]
    assert "a-drifting-host" in _anchors(ROOT / "docs" / "measuring.md")
