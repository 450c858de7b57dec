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


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/README.md", *[
    str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md"))]])
def test_relative_links_point_at_files(doc):
    path = ROOT / doc
    broken = []
    for target in LINK.findall(CODE.sub("", path.read_text())):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (path.parent / target).exists():
            broken.append(target)
    assert not broken, f"{doc}: {broken}"


RESULTS_PATH = re.compile(r"(?<![\w./-])results/[A-Za-z0-9_.*{}/-]*[A-Za-z0-9_/]")
DOCS_PATH = re.compile(r"(?<![\w./-])docs/[A-Za-z0-9_-]+\.md")
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


def _missing_paths(text: str) -> list[str]:
    """Cited paths that do not exist; a folder a command in the same text writes (--results-dir,
    --out, --output, --plot) is an output, not a citation."""
    outputs = tuple(p.rstrip("/.") for p in OUTPUT_FLAG.findall(text))
    out = []
    for path in RESULTS_PATH.findall(text) + DOCS_PATH.findall(text):
        path = path.rstrip("/.")
        if path.startswith(NOT_COMMITTED + outputs) or any(c in path for c in "*{}"):
            continue
        if not (ROOT / path).exists():
            out.append(path)
    return out


def test_every_cited_results_folder_and_doc_exists():
    """Every results/... and docs/... path that the docs, configs, package, benchmarks and committed
    reports name, code spans included, exists (the recorded commands in results/README.md are history
    and are not checked)."""
    missing = {str(p.relative_to(ROOT)): m for p in _cited_texts() if (m := _missing_paths(p.read_text()))}
    assert not missing, missing


def test_the_path_check_sees_a_missing_folder_inside_a_code_span():
    assert _missing_paths("see `results/answer/no-such-folder/` and docs/performance.md") == [
        "results/answer/no-such-folder", "docs/performance.md"]
    assert _missing_paths("`results/answer/study/`, results/runs/runs.csv") == []
