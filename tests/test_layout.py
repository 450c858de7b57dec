"""The suite is laid out like the package: a test of ``lora_bench/<part>/`` lives in
``tests/<part>/``; the top of ``tests/`` holds the project-wide tests (layers, docs, history,
escaping, file reading) and the shared helpers."""

from __future__ import annotations

from collections import Counter

from paths import ROOT, TESTS

PACKAGE = ROOT / "lora_bench"
SHARED = {"fixtures"}


def test_every_test_folder_is_named_after_a_part_of_the_package():
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    parts = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders - SHARED <= parts, sorted(folders - SHARED - parts)
    assert all(any(p.glob("test_*.py")) for p in TESTS.iterdir() if p.name in parts)


def test_test_files_have_unique_names():
    """Test folders have no ``__init__.py``: pytest imports each test file by its bare name, so two
    files of one name in different folders would collide."""
    names = Counter(p.name for p in TESTS.rglob("test_*.py") if "fixtures" not in p.parts)
    assert [n for n, c in names.items() if c > 1] == []
