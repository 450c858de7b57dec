"""Folders that take no file: a read-only results folder for ``results index``, ``describe`` and
``prune``, a cache disk that fills while the data split is written, a report name longer than a
file name may be. Each ends in one line naming the place (exit 2), nothing written there, and a
dry run writes nothing at all, not even a lock file. (Root ignores file modes, so the file system's
refusal is stood in for where lora-bench asks it: the temporary file and the lock file.)"""

from __future__ import annotations

import errno
import json
import shutil

import pytest

from paths import FIXTURES, SAMPLE


def _folder(tmp_path):
    root = tmp_path / "root"
    folder = root / "res"
    folder.mkdir(parents=True)
    shutil.copy(FIXTURES / "report" / "runs.csv", folder / "runs.csv")
    (folder / "manifest.json").write_text(json.dumps({"description": "d", "invocations": []}))
    return root, folder


@pytest.fixture
def read_only(monkeypatch):
    """Every new file lora-bench makes (a temporary file, a lock file) is refused as on a read-only
    file system."""
    import tempfile

    import lora_bench.results.store as store

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    monkeypatch.setattr(store, "open", refuse, raising=False)


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("args", [("results", "index", "{root}"), ("results", "describe", "{folder}", "new"),
                                  ("results", "prune", "{folder}", "--superseded")])
def test_a_read_only_folder_is_one_line_naming_it(args, tmp_path, run_cli, read_only):
    root, folder = _folder(tmp_path)
    before = _snapshot(root)
    code, out = run_cli(*(a.format(root=root, folder=folder) for a in args))
    assert code == 2 and "Traceback" not in out and "Errno" not in out, out
    assert "Read-only file system" in out and str(root) in out.replace("\n", ""), out
    assert _snapshot(root) == before


def test_a_dry_run_of_prune_writes_nothing_not_even_a_lock(tmp_path, run_cli, read_only):
    _, folder = _folder(tmp_path)
    code, out = run_cli("results", "prune", folder, "--superseded", "--dry-run")
    assert code == 0 and "superseded run(s)" in out, out


@pytest.mark.parametrize("text", ["a\x1b[2Jb", "line one\n# a heading", "bell\x07", "rtl \u202e txt", "x" * 5000])
def test_describe_refuses_control_characters_line_breaks_and_length(text, tmp_path, run_cli):
    _, folder = _folder(tmp_path)
    before = _snapshot(folder)
    code, out = run_cli("results", "describe", folder, text)
    assert code == 2 and "Traceback" not in out and "nothing was written" in out, out
    assert _snapshot(folder) == before


def test_a_full_cache_disk_while_the_split_is_written_is_one_message(tmp_path, run_cli, monkeypatch):
    import pandas as pd

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_csv", full)
    out_dir = tmp_path / "splits"
    code, out = run_cli("data", "prepare", "--data-file", SAMPLE, "--output", out_dir)
    assert code == 2 and "Traceback" not in out and "Errno" not in out, out
    assert "No space left on device" in out and str(out_dir) in out.replace("\n", ""), out
    assert not out_dir.exists()


def test_a_report_name_longer_than_a_file_name_is_refused(tmp_path, run_cli):
    root, folder = _folder(tmp_path)
    name = "report" + "x" * 300 + ".md"
    (folder / "manifest.json").write_text(json.dumps({"reports": [{"format": "markdown", "output": name}]}))
    code, out = run_cli("results", "render", "--root", root)
    assert code == 2 and "Traceback" not in out and "a name of 309 bytes" in out, out
    assert "x" * 250 not in out


def test_a_name_past_the_file_systems_limit_is_refused_by_the_writer(tmp_path):
    from lora_bench.fileio import NotWritable, atomic_write_text

    with pytest.raises(NotWritable) as e:
        atomic_write_text(tmp_path / ("n" * 300), "x")
    assert e.value.errno == errno.ENAMETOOLONG and "(a name of 300 bytes)" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_render_takes_a_bounded_number_of_recipes(tmp_path, run_cli):
    root, folder = _folder(tmp_path)
    recipes = [{"format": "markdown", "output": f"report{i}.md"} for i in range(300)]
    (folder / "manifest.json").write_text(json.dumps({"reports": recipes}))
    code, out = run_cli("results", "render", "--root", root)
    assert code == 2 and "lists 300 recipes; a folder declares at most 64" in out, out
    assert not list(folder.glob("report*"))


def test_train_with_a_full_cache_disk_is_one_message(tmp_path, run_cli, monkeypatch):
    import pandas as pd

    real = pd.DataFrame.to_csv

    def full(self, path=None, *a, **k):  # a file fills the disk; text for runs.csv is still made
        if path is not None:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, path, *a, **k)

    monkeypatch.setattr(pd.DataFrame, "to_csv", full)
    cache = tmp_path / "cache"
    code, out = run_cli("train", "--model-size", "tiny", "--weights", "random", "--device", "cpu", "--no-progress",
                        "--max-steps", "1", "--warmup-steps", "0", "--eval-freq", "0", "--skip-final-eval", "--data-file", SAMPLE,
                        "--cache-dir", cache, "--results-dir", tmp_path / "res")
    assert code == 2 and "Traceback" not in out and "Errno" not in out, out
    assert "No space left on device" in out and str(cache) in out.replace("\n", ""), out


def test_a_tensorboard_export_into_a_read_only_folder_is_one_message(tmp_path, run_cli, read_only, monkeypatch):
    import os
    import pathlib

    _, folder = _folder(tmp_path)
    real = pathlib.Path.mkdir

    def mkdir(self, *a, **k):  # the export's own folders are refused too
        if "tensorboard" in self.parts:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    code, out = run_cli("results", "export", folder, "--to", "tensorboard")
    assert code == 2 and "Traceback" not in out and "Errno" not in out, out
    assert "Read-only file system" in out and str(folder / "tensorboard") in out.replace("\n", ""), out
    assert not os.path.exists(folder / "tensorboard")


def test_prune_names_a_runs_csv_that_is_no_file(tmp_path, run_cli):
    import os

    _, folder = _folder(tmp_path)
    (folder / "runs.csv").unlink()
    os.mkfifo(folder / "runs.csv")
    code, out = run_cli("results", "prune", folder, "--superseded")
    assert code == 2 and "runs.csv is not a regular file" in out and "nothing was moved" in out, out
