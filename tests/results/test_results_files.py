"""The results folder as users and accidents leave it: runs.csv that is binary, empty, unbalanced,
another program's CSV or cut mid-row; a run id used twice; a run folder another process holds; a
folder that takes no file. Each gives one message (exit code 2) before any work, and no recorded
result is lost or read wrong."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil

import pytest

from lora_bench.results.claims import try_claim
from lora_bench.results.store import RUNS_CSV, TORN_CSV, read_run_table, result_rows
from paths import FIXTURES

SAMPLE = FIXTURES / "sms_spam_sample.tsv"
TINY = ["--model-size", "tiny", "--weights", "random", "--device", "cpu", "--no-progress", "--max-steps", "2",
        "--warmup-steps", "1", "--eval-freq", "0", "--skip-final-eval", "--data-file", str(SAMPLE)]
SWEEP = f"""\
name: s
base: {{model_size: tiny, weights: random, device: cpu, data_file: {SAMPLE}, max_steps: 2, warmup_steps: 1,
       eval_freq: 0, skip_final_eval: true}}
"""
BAD = {
    "binary": (bytes(range(256)) * 4, "binary data"),
    "empty": (b"", "it is empty"),
    "unbalanced": (b'run_id,status\n"abc,done\nx,done\n', "quote that is never closed"),
    "foreign": (b"name,value\na,1\nb,2\n", "has no run_id and status columns"),
}


def _clean_error(code: int, out: str, *needles: str) -> None:
    assert code == 2, out
    assert "Traceback" not in out
    for n in needles:
        assert n in out, out


@pytest.fixture
def no_training(monkeypatch):
    """Any attempt to build a run fails the test: refusals must come before the work."""
    import lora_bench.train.run as run_mod

    def forbidden(*a, **k):
        raise AssertionError("a run was started")

    monkeypatch.setattr(run_mod, "RunContext", forbidden)


@pytest.mark.parametrize("kind", sorted(BAD))
def test_unreadable_runs_csv_is_one_message_everywhere(kind, tmp_path, run_cli, no_training):
    blob, why = BAD[kind]
    (tmp_path / RUNS_CSV).write_bytes(blob)
    sweep = tmp_path / "s.yaml"
    sweep.write_text(SWEEP)
    for args in (["report", tmp_path], ["show", tmp_path], ["sweep", sweep, "--results-dir", tmp_path, "--dry-run"],
                 ["sweep", sweep, "--results-dir", tmp_path, "--isolation", "inline", "--no-progress"],
                 ["train", *TINY, "--results-dir", tmp_path]):
        code, out = run_cli(*args)
        _clean_error(code, out, str(tmp_path / RUNS_CSV), "not a lora-bench runs.csv", why)
    assert (tmp_path / RUNS_CSV).read_bytes() == blob  # left as it was
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # no run folder, no recorded row


def _two_runs(tmp_path, run_cli) -> dict:
    for rid in ("first", "second"):
        code, out = run_cli("train", *TINY, "--results-dir", tmp_path, "--run-id", rid)
        assert code == 0, out
    return {r["run_id"]: r for r in csv.DictReader(io.StringIO((tmp_path / RUNS_CSV).read_text()))}


def _cut_last_row(tmp_path, rows: dict) -> str:
    """Cut runs.csv in the middle of the second run's step median; returns the full value."""
    text = (tmp_path / RUNS_CSV).read_text()
    full = rows["second"]["step_ms_median"]
    at = text.index(full, re.search(r'\n"?second"?,', text).start()) + len(full) // 2
    (tmp_path / RUNS_CSV).write_text(text[:at])
    return full


def test_a_row_cut_mid_way_is_never_read_as_a_result(tmp_path, run_cli):
    rows = _two_runs(tmp_path, run_cli)
    full = _cut_last_row(tmp_path, rows)
    # with run.json beside it, the record is whole: show and report use it
    code, out = run_cli("show", tmp_path, "second")
    assert code == 0 and "second" in out and f"{float(full):.2f}" in out, out
    shutil.rmtree(tmp_path / "second")
    table = read_run_table(tmp_path / RUNS_CSV)
    assert [r["run_id"] for r in table.rows] == ["first"] and table.torn_ids() == ["second"]
    code, out = run_cli("show", tmp_path, "second")
    _clean_error(code, out, "run_id 'second'", "cut mid-way", "no run.json")
    code, out = run_cli("report", tmp_path, "--format", "csv")
    assert code == 0 and "the row of run second is cut mid-way" in out, out
    assert [r["run_id"] for r in result_rows(tmp_path, warn=None)] == ["first"]
    # the next write keeps every complete row and sets the torn one aside, verbatim
    code, out = run_cli("train", *TINY, "--results-dir", tmp_path, "--run-id", "third")
    assert code == 0, out
    table = read_run_table(tmp_path / RUNS_CSV)
    assert [r["run_id"] for r in table.rows] == ["first", "third"] and not table.torn
    assert table.rows[0]["step_ms_median"] == rows["first"]["step_ms_median"]
    torn = list(csv.reader(io.StringIO((tmp_path / TORN_CSV).read_text())))
    assert torn[1][0] == "second" and len(torn[1]) < len(torn[0])


def test_a_torn_row_with_its_run_json_is_repaired_on_the_next_write(tmp_path, run_cli):
    rows = _two_runs(tmp_path, run_cli)
    _cut_last_row(tmp_path, rows)
    code, out = run_cli("train", *TINY, "--results-dir", tmp_path, "--run-id", "third")
    assert code == 0, out
    table = read_run_table(tmp_path / RUNS_CSV)
    assert sorted(r["run_id"] for r in table.rows) == ["first", "second", "third"]
    second = next(r for r in table.rows if r["run_id"] == "second")
    assert float(second["step_ms_median"]) == pytest.approx(float(rows["second"]["step_ms_median"]))


def test_run_ids_are_never_silently_reused(tmp_path, run_cli):
    code, out = run_cli("train", *TINY, "--results-dir", tmp_path, "--run-id", "x", "--seed", "1")
    assert code == 0, out
    record = (tmp_path / "x" / "run.json").read_text()
    code, out = run_cli("train", *TINY, "--results-dir", tmp_path, "--run-id", "x", "--seed", "2")
    _clean_error(code, out, "run id 'x' already exists", "status done", "--overwrite")
    assert (tmp_path / "x" / "run.json").read_text() == record
    assert [r["cfg_seed"] for r in csv.DictReader(open(tmp_path / RUNS_CSV))] == ["1"]
    code, out = run_cli("train", *TINY, "--results-dir", tmp_path, "--run-id", "x", "--seed", "2", "--overwrite")
    assert code == 0, out
    assert [r["cfg_seed"] for r in csv.DictReader(open(tmp_path / RUNS_CSV))] == ["2"]
    assert json.loads((tmp_path / "x" / "run.json").read_text())["row"]["cfg_seed"] == 2


def test_a_run_held_by_another_process_is_not_run_again(tmp_path, run_cli, no_training):
    held = try_claim(tmp_path / "x")
    try:
        code, out = run_cli("train", *TINY, "--results-dir", tmp_path, "--run-id", "x")
        _clean_error(code, out, "run x is being executed by another process")
    finally:
        held.release()
    assert not (tmp_path / RUNS_CSV).exists() and not (tmp_path / "x" / "run.json").exists()


def test_folders_that_take_no_file_are_refused_before_any_work(unwritable_dir, tmp_path, run_cli, no_training):
    code, out = run_cli("train", *TINY, "--results-dir", unwritable_dir)
    _clean_error(code, out, str(unwritable_dir), "cannot write here")
    sweep = tmp_path / "s.yaml"
    sweep.write_text(SWEEP)
    code, out = run_cli("sweep", sweep, "--results-dir", unwritable_dir, "--isolation", "inline", "--no-progress")
    _clean_error(code, out, str(unwritable_dir), "cannot write here")
    code, out = run_cli("report", tmp_path, "--output", unwritable_dir / "r.md")
    _clean_error(code, out, "--output", "cannot write here")
    code, out = run_cli("report", tmp_path, "--output", tmp_path)
    _clean_error(code, out, "--output", "is a folder")
    code, out = run_cli("data", "prepare", "--out", unwritable_dir / "splits", "--data-file", SAMPLE)
    _clean_error(code, out, str(unwritable_dir / "splits"), "cannot")
    code, out = run_cli("train", *TINY[:-2], "--results-dir", tmp_path / "res", "--cache-dir", unwritable_dir)
    _clean_error(code, out, "cache folder", str(unwritable_dir))


def test_a_copy_of_a_run_folder_never_stands_in_for_the_run(tmp_path, run_cli):
    """run.json names its run; only the folder of that name holds the run's record: a backup copy
    (``cp -r X X.bak``) is not read as run X, by readers or by the repair of runs.csv."""
    from lora_bench.results.lookup import find_run
    from lora_bench.sweep.resume import repair_runs_csv

    code, out = run_cli("train", *TINY, "--results-dir", tmp_path, "--run-id", "x")
    assert code == 0, out
    shutil.copytree(tmp_path / "x", tmp_path / "x.bak")
    code, out = run_cli("train", *TINY, "--results-dir", tmp_path, "--run-id", "x", "--overwrite",
                        "--trainable-layers", "all")
    assert code == 0, out
    assert [r["cfg_trainable_layers"] for r in result_rows(tmp_path)] == ["all"]
    assert find_run(tmp_path, "x")["cfg_trainable_layers"] == "all"
    repair_runs_csv(tmp_path)
    assert [r["cfg_trainable_layers"] for r in read_run_table(tmp_path / RUNS_CSV).rows] == ["all"]
    code, out = run_cli("show", tmp_path, "x.bak")
    _clean_error(code, out, "x.bak", "records run 'x'")


@pytest.mark.parametrize("run_id", ["runs.csv", "manifest.json", "runs.csv.lock", "manifest.json.lock",
                                    "runs-torn.csv", "superseded", "README.md", "RUNS.CSV"])
def test_a_run_id_naming_a_results_file_is_refused_before_any_work(run_id, tmp_path, run_cli, no_training):
    code, out = run_cli("train", *TINY, "--results-dir", tmp_path, "--run-id", run_id)
    _clean_error(code, out, repr(run_id), "reserved", "runs.csv", "manifest.json")
    assert not list(tmp_path.iterdir())  # nothing made, nothing claimed


def test_a_run_id_longer_than_a_file_name_is_refused_before_any_work(tmp_path, run_cli, no_training):
    code, out = run_cli("train", *TINY, "--results-dir", tmp_path, "--run-id", "r" * 256)
    _clean_error(code, out, "256", "255")
    assert not list(tmp_path.iterdir())
    from lora_bench.train.identity import check_run_id

    check_run_id("r" * 255)  # the longest name a folder can have


@pytest.mark.parametrize("value, column", [("abc", "steps"), ("1.5", "steps"), ("99999999999999999999999", "steps"),
                                           ("1e400", "measured_steps"), ("many", "step_ms_median"),
                                           ("12x", "world_size")])
def test_a_runs_csv_cell_its_column_cannot_hold_is_read_as_blank_with_a_warning(value, column, tmp_path, run_cli):
    for rid in ("a", "b"):
        code, out = run_cli("train", *TINY, "--results-dir", tmp_path, "--run-id", rid)
        assert code == 0, out
    shutil.rmtree(tmp_path / "a")  # runs.csv is a's only record
    rows = list(csv.DictReader(open(tmp_path / RUNS_CSV)))
    rows[0][column] = value
    with open(tmp_path / RUNS_CSV, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for args in (["show", tmp_path, "a"], ["report", tmp_path]):
        code, out = run_cli(*args)
        assert code == 0 and "Traceback" not in out, out
        assert f"column {column} holds 1 value(s)" in out and repr(value)[:40] in out and "read as blank" in out, out


def test_things_in_the_way_of_a_runs_files_are_refused_before_any_work(tmp_path, run_cli, no_training):
    (tmp_path / "a" / RUNS_CSV).mkdir(parents=True)  # runs.csv made a folder (by an older version's run id)
    code, out = run_cli("train", *TINY, "--results-dir", tmp_path / "a", "--run-id", "x")
    _clean_error(code, out, str(tmp_path / "a" / RUNS_CSV), "is not a file", "move it aside")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("a file")
    code, out = run_cli("train", *TINY, "--results-dir", tmp_path / "b", "--run-id", "x")
    _clean_error(code, out, "a file is in the way", str(tmp_path / "b" / "x"))
    assert (tmp_path / "b" / "x").read_text() == "a file"
    (tmp_path / "c" / "x.bak").mkdir(parents=True)  # a backup copy of run x's folder
    (tmp_path / "c" / "x.bak" / "run.json").write_text(json.dumps({"row": {"run_id": "x", "status": "done"}}))
    code, out = run_cli("train", *TINY, "--results-dir", tmp_path / "c", "--run-id", "x.bak")
    _clean_error(code, out, "run id 'x.bak' already exists", "a copy of run 'x'")
    assert json.loads((tmp_path / "c" / "x.bak" / "run.json").read_text())["row"]["run_id"] == "x"
