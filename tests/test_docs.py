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
