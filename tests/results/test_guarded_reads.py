"""The files of a results folder as a hostile user leaves them: a steps.csv that is a pipe, a folder or
a link to /dev/zero, a manifest.json that is huge or nested a hundred thousand deep, a run.json
nested as deep, a runs.csv that is a link out of the folder, a folder link out of the index's root.
Each is read through the one guarded reader (results.guarded_read), in bounded time and memory, and
ends in one message naming the file, or, where a report can go on without it, leaves the file out."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from lora_bench.errors import ResultsError
from lora_bench.results.manifest import read_manifest
from lora_bench.results.records import run_record
from lora_bench.results.store import read_steps
from paths import FIXTURES

DEEP = b"[" * 100_000 + b"]" * 100_000


def _one_run(tmp_path):
    """The report fixture's runs, and a run folder with a record for its first run."""
    folder = tmp_path / "res"
    folder.mkdir()
    shutil.copy(FIXTURES / "report" / "runs.csv", folder / "runs.csv")
    return folder


@pytest.mark.parametrize("kind", ["fifo", "folder", "dev-zero", "outside"])
def test_a_steps_csv_that_is_no_file_of_the_folder_is_refused_at_once(kind, tmp_path):
    run = tmp_path / "res" / "r1"
    run.mkdir(parents=True)
    steps = run / "steps.csv"
    if kind == "fifo":
        os.mkfifo(steps)  # a plain read would wait for a writer forever
    elif kind == "folder":
        steps.mkdir()
    elif kind == "dev-zero":
        steps.symlink_to("/dev/zero")  # a plain read grows without bound
    else:
        (tmp_path / "elsewhere.csv").write_text("step,step_ms\n1,2\n")
        steps.symlink_to(tmp_path / "elsewhere.csv")
    t0 = time.monotonic()
    with pytest.raises(ResultsError) as e:
        read_steps(run)
    assert time.monotonic() - t0 < 5
    assert str(steps) in str(e.value) and "\n" not in str(e.value)
    why = {"fifo": "not a regular file", "folder": "a folder", "dev-zero": "leaves the results folder",
           "outside": "leaves the results folder"}[kind]
    assert why in str(e.value)


def test_a_link_inside_the_folder_is_read(tmp_path):
    from lora_bench.results.guarded_read import read_results_file

    folder = tmp_path / "res"
    (folder / "a").mkdir(parents=True)
    (folder / "a" / "f.csv").write_text("x\n1\n")
    (folder / "b").mkdir()
    (folder / "b" / "f.csv").symlink_to(folder / "a" / "f.csv")
    assert read_results_file(folder / "b" / "f.csv", limit=100, root=folder) == b"x\n1\n"
    assert read_results_file(folder / "b" / "none.csv", limit=100, root=folder) is None


def test_a_report_with_a_pipe_for_a_steps_csv_ends_in_bounded_time(tmp_path, run_cli):
    folder = _one_run(tmp_path)
    import csv

    rows = list(csv.DictReader(open(folder / "runs.csv")))
    # the one run of its group: a report reads its steps for the group's interval
    alone = [r for r in rows if sum(o["model_size"] == r["model_size"] and
                                    o["trainable_layers"] == r["trainable_layers"] for o in rows) == 1]
    run_id = alone[0]["run_id"]
    (folder / run_id).mkdir(exist_ok=True)
    (folder / run_id / "steps.csv").unlink(missing_ok=True)
    os.mkfifo(folder / run_id / "steps.csv")
    t0 = time.monotonic()
    code, out = run_cli("report", folder)
    assert time.monotonic() - t0 < 60
    assert code == 0 and "Traceback" not in out, out
    # the report says which file it refused and why, in one line
    said = [line for line in out.splitlines() if "steps.csv" in line and "not a regular file" in line]
    assert said and run_id in " ".join(out.split()), out


def test_compare_names_a_refused_steps_table(tmp_path, run_cli):
    import csv

    folder = _one_run(tmp_path)
    rows = list(csv.DictReader(open(folder / "runs.csv")))
    alone = [r for r in rows if sum(o["model_size"] == r["model_size"] and
                                    o["trainable_layers"] == r["trainable_layers"] for o in rows) == 1]
    run = folder / alone[0]["run_id"]
    run.mkdir(exist_ok=True)
    (run / "steps.csv").unlink(missing_ok=True)
    (run / "steps.csv").mkdir()
    code, out = run_cli("compare", folder, folder)
    assert "Traceback" not in out, out
    assert any("steps.csv" in line and "a folder" in line for line in out.splitlines()), out


def test_a_manifest_past_its_size_is_refused_before_it_is_read(tmp_path, run_cli):
    folder = _one_run(tmp_path)
    with open(folder / "manifest.json", "wb") as f:
        f.truncate(2 * 2**30)  # holes: no disk space, and nothing of it may be read
    t0 = time.monotonic()
    with pytest.raises(ResultsError, match="manifest.json holds 2,048.0 MiB, more than the 64.0 MiB"):
        read_manifest(folder)
    code, out = run_cli("results", "index", tmp_path)
    assert code == 2 and "manifest.json holds 2,048.0 MiB" in out and "Traceback" not in out, out
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("args", [("results", "index", "{root}"), ("results", "render", "--root", "{root}"),
                                  ("results", "describe", "{folder}", "x")])
def test_a_manifest_nested_deep_is_one_message(args, tmp_path, run_cli):
    folder = _one_run(tmp_path)
    (folder / "manifest.json").write_bytes(b'{"description": ' + DEEP + b"}")
    code, out = run_cli(*(a.format(root=tmp_path, folder=folder) for a in args))
    assert code == 2 and "Traceback" not in out and "RecursionError" not in out, out
    assert "manifest.json" in out and "nests more than 64 levels" in out, out


def test_a_run_json_nested_deep_is_no_record(tmp_path):
    run = tmp_path / "r1"
    run.mkdir()
    (run / "run.json").write_bytes(b'{"row": {"run_id": "r1", "status": "done", "x": ' + DEEP + b"}}")
    assert run_record(run) is None


def test_json_has_one_nesting_limit():
    from lora_bench.fileio import JsonTooDeep, parse_json

    assert parse_json("[" * 64 + "]" * 64) is not None
    for text in ("[" * 65 + "]" * 65, "[" * 100_000 + "]" * 100_000, '{"a": ' * 70 + "1" + "}" * 70):
        with pytest.raises(JsonTooDeep):
            parse_json(text)


def test_a_runs_csv_linked_out_of_the_folder_is_refused(tmp_path, run_cli):
    folder = tmp_path / "res"
    folder.mkdir()
    (folder / "runs.csv").symlink_to(FIXTURES / "report" / "runs.csv")
    for args in (("report", folder), ("show", folder)):
        code, out = run_cli(*args)
        assert code == 2 and "leaves the results folder" in out and "Traceback" not in out, out


def test_the_index_follows_no_folder_link_out_of_its_root(tmp_path, run_cli):
    root, outside = tmp_path / "root", tmp_path / "private"
    root.mkdir()
    _one_run(root)
    outside.mkdir()
    shutil.copy(FIXTURES / "report" / "runs.csv", outside / "runs.csv")
    (outside / "secret-notes.txt").write_text("x")
    (root / "linked").symlink_to(outside)
    (root / "res" / "notes.txt").symlink_to(outside / "secret-notes.txt")
    code, out = run_cli("results", "index", root)
    assert code == 0, out
    text = (root / "README.md").read_text()
    assert "res/" in text and "linked" not in text and "secret-notes" not in text and "notes.txt" not in text


def test_a_kernels_file_that_is_a_pipe_is_left_out(tmp_path):
    from lora_bench.report.load import kernel_counts

    run = tmp_path / "r1"
    run.mkdir()
    os.mkfifo(run / "kernels_by_phase.csv")
    with pytest.raises(ResultsError, match="not a regular file"):
        kernel_counts(run)
