"""Provenance of results folders: manifests written at launch, joined by child processes,
reconstructed from rows; superseded sweep rows moved aside; the generated index."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from lora_bench.results import environment as env_mod
from lora_bench.results import manifest as man
from lora_bench.publish.results_index import render_index
from lora_bench.results.prune import SUPERSEDED, find_superseded, prune_superseded
from lora_bench.results.schema import run_column_names
from lora_bench.results.store import result_rows, write_csv
from paths import FIXTURES, ROOT

REPO = ROOT


@pytest.fixture
def fresh_invocation(monkeypatch):
    """No invocation inherited from earlier tests; restored afterwards."""
    monkeypatch.setenv(man.INVOCATION_ENV, "")
    env_mod.source_commit.cache_clear()
    yield
    env_mod.source_commit.cache_clear()


def test_command_argv_names_the_tool_not_the_machine():
    assert man.command_argv(["/opt/x/.venv/bin/lora-bench", "train", "--rank", "8"]) == ["lora-bench", "train",
                                                                                        "--rank", "8"]
    assert man.command_argv([str(REPO / "lora_bench" / "__main__.py"), "sweep", "f.yaml"]) == ["lora-bench", "sweep",
                                                                                              "f.yaml"]
    assert man.command_argv([str(REPO / "benchmarks" / "modes.py"), "--out", "d"]) == ["python", "-m",
                                                                                      "benchmarks.modes", "--out", "d"]
    assert man.command_argv(["/usr/bin/some-script", "a"]) == ["some-script", "a"]


def test_an_invocation_is_one_entry_with_its_runs(tmp_path, monkeypatch, fresh_invocation):
    monkeypatch.setattr(sys, "argv", ["/somewhere/bin/lora-bench", "sweep", "x.yaml"])
    monkeypatch.setenv(env_mod.COMMIT_ENV, "abc1234+dirty")
    man.record_invocation(tmp_path)
    man.record_invocation(tmp_path, run_ids=["r0"])
    man.record_invocation(tmp_path, run_ids=["r1", "r0"])
    data = man.read_manifest(tmp_path)
    [entry] = data["invocations"]
    assert entry["command"] == "lora-bench sweep x.yaml" and entry["run_ids"] == ["r0", "r1"]
    assert (entry["git_commit"], entry["git_dirty"], entry["commit_source"]) == ("abc1234", True, env_mod.COMMIT_ENV)
    assert entry["source"] == man.RECORDED and entry["started_at"].endswith("+00:00")
    assert entry["environment"]["torch_version"] and entry["lora_bench_version"]
    # the last write's time: moves with each record, never before the start (the sweep's wall time)
    first = entry["last_written_at"]
    now = man._now
    monkeypatch.setattr(man, "_now", lambda: "2999-01-01T00:00:00+00:00")
    man.record_invocation(tmp_path, run_ids=["r2"])
    [entry] = man.read_manifest(tmp_path)["invocations"]
    assert entry["started_at"] <= first <= entry["last_written_at"] == "2999-01-01T00:00:00+00:00"
    monkeypatch.setattr(man, "_now", now)
    # the same process running another command line: a new invocation
    monkeypatch.setattr(sys, "argv", ["lora-bench", "train"])
    man.record_invocation(tmp_path, run_ids=["t0"])
    entries = man.read_manifest(tmp_path)["invocations"]
    assert [e["command"] for e in entries] == ["lora-bench sweep x.yaml", "lora-bench train"]
    assert entries[1]["run_ids"] == ["t0"] and entries[0]["id"] != entries[1]["id"]


def test_a_child_process_joins_its_parents_invocation(tmp_path, monkeypatch, fresh_invocation):
    """A sweep's runs in child processes land in the sweep's entry, under the sweep's command line
    and the commit taken when the sweep started, also in a folder the parent never wrote."""
    monkeypatch.setattr(sys, "argv", ["lora-bench", "sweep", "s.yaml"])
    monkeypatch.setenv(env_mod.COMMIT_ENV, "feed123")
    parent = man.record_invocation(tmp_path / "a")
    code = ("import sys; from pathlib import Path; from lora_bench.results.manifest import record_invocation; "
            "record_invocation(Path(sys.argv[1]), run_ids=[sys.argv[2]])")
    child_env = dict(os.environ, LORA_BENCH_GIT_COMMIT="changed-since", PYTHONPATH=str(REPO))
    for folder, run_id in (("a", "c0"), ("b", "c1")):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / folder), run_id], env=child_env, check=True,
                       timeout=120)
    [a] = man.read_manifest(tmp_path / "a")["invocations"]
    [b] = man.read_manifest(tmp_path / "b")["invocations"]
    assert a["id"] == b["id"] == parent["id"] and a["run_ids"] == ["c0"] and b["run_ids"] == ["c1"]
    assert a["command"] == b["command"] == "lora-bench sweep s.yaml"
    assert a["git_commit"] == b["git_commit"] == "feed123"


def test_commit_from_git_or_unknown(monkeypatch, fresh_invocation):
    monkeypatch.delenv(env_mod.COMMIT_ENV, raising=False)
    commit = env_mod.source_commit()
    if (REPO / ".git").exists():
        assert commit.source == "git" and len(commit.sha) == 40 and commit.dirty in (True, False)
        assert env_mod.git_commit() == commit.sha + ("+dirty" if commit.dirty else "")
    else:
        assert (commit.sha, commit.source, env_mod.git_commit()) == ("", "unknown", "")
    env_mod.source_commit.cache_clear()
    monkeypatch.setenv(env_mod.COMMIT_ENV, "unknown")
    assert env_mod.source_commit().source in ("git", "unknown")  # 'unknown' is not a commit


def test_sweep_in_child_processes_records_one_invocation(sms_file, tmp_path, run_cli, fresh_invocation):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(textwrap.dedent(f"""\
        name: prov
        base: {{model_size: tiny, weights: random, device: cpu, data_file: {sms_file}, num_epochs: 1,
               max_steps: 3, eval_freq: 0, skip_final_eval: true, warmup_steps: 1}}
        runs:
          - {{label: a}}
        """))
    code, out = run_cli("sweep", sweep, "--results-dir", tmp_path / "r", "--cache-dir", tmp_path / "c",
                        "--no-progress")
    assert code == 0, out
    [entry] = man.read_manifest(tmp_path / "r")["invocations"]
    [row] = pd.read_csv(tmp_path / "r" / "runs.csv", dtype=str, keep_default_na=False).to_dict("records")
    assert entry["command"] == f"lora-bench sweep {sweep} --results-dir {tmp_path / 'r'} --cache-dir {tmp_path / 'c'} --no-progress"
    assert entry["run_ids"] == [row["run_id"]]
    # the run (in its own process) and the manifest name the same source
    assert row["git_commit"].removesuffix("+dirty") == ("" if entry["git_commit"] == "unknown" else entry["git_commit"])


def _row(run_id, *, started, commit="", sweep="s", repeat="0", **cfg):
    return {"run_id": run_id, "status": "done", "started_at": started, "sweep_name": sweep, "repeat": repeat,
            "git_commit": commit, "gpu_name": "GPU X", "torch_version": "2.0", "step_ms_median": "1.2345678901",
            **{f"cfg_{k}": v for k, v in cfg.items()}}


def test_reconstructed_entries_say_so_and_keep_unknowns():
    rows = [_row("a", started="2026-01-02T00:00:00+00:00", commit="abc+dirty"),
            _row("b", started="2026-01-01T00:00:00+00:00", commit="abc+dirty"),
            _row("c", started="2026-01-03T00:00:00+00:00")]
    first, second = man.reconstruct_entries(rows)
    assert first["source"] == second["source"] == man.RECONSTRUCTED and first["command"] == man.UNKNOWN
    assert (first["git_commit"], first["git_dirty"], first["run_ids"]) == ("abc", True, ["a", "b"])
    assert first["started_at"] == "2026-01-01T00:00:00+00:00"
    assert (second["git_commit"], second["git_dirty"], second["run_ids"]) == (man.UNKNOWN, None, ["c"])
    assert first["environment"]["gpu_name"] == "GPU X"
    assert man.reconstruct_entries(rows, outputs=["x.log"])[-1]["outputs"] == []  # beside rows: origin unknown
    [files_only] = man.reconstruct_entries([], outputs=["bench.csv"])
    assert files_only["outputs"] == ["bench.csv"] and files_only["git_commit"] == man.UNKNOWN


def test_superseded_rows_move_aside_with_their_numbers(tmp_path):
    rows = [
        _row("old", started="2026-01-01T00:00:00+00:00", model_size="124M", lora_alpha="16"),
        _row("new", started="2026-01-02T00:00:00+00:00", model_size="124M", lora_alpha="16.0", compile_scope=""),
        _row("other-repeat", started="2026-01-01T00:00:00+00:00", repeat="1", model_size="124M"),
        _row("other-size", started="2026-01-01T00:00:00+00:00", model_size="1558M"),
        {**_row("one-off", started="2026-01-01T00:00:00+00:00", model_size="124M"), "sweep_name": ""},
    ]
    [s] = find_superseded(rows)
    assert (s.run_id, s.superseded_by) == ("old", "new")
    write_csv(tmp_path / "runs.csv", rows, run_column_names())
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "steps.csv").write_text("x\n")
    assert prune_superseded(tmp_path, dry_run=True) == [s] and (tmp_path / "old").is_dir()
    assert prune_superseded(tmp_path) == [s]
    kept = pd.read_csv(tmp_path / "runs.csv", dtype=str, keep_default_na=False)
    moved = pd.read_csv(tmp_path / SUPERSEDED / "runs.csv", dtype=str, keep_default_na=False)
    assert sorted(kept["run_id"]) == ["new", "one-off", "other-repeat", "other-size"]
    assert moved[["run_id", "superseded_by", "step_ms_median"]].values.tolist() == [["old", "new", "1.2345678901"]]
    assert (tmp_path / SUPERSEDED / "old" / "steps.csv").is_file() and not (tmp_path / "old").exists()
    assert prune_superseded(tmp_path) == []  # nothing left to move


def test_index_lists_commands_commits_and_counts(tmp_path, monkeypatch, run_cli, fresh_invocation):
    study = tmp_path / "study"
    write_csv(study / "runs.csv", [_row("a", started="2026-01-01T00:00:00+00:00", commit="abc"),
                                   _row("b", started="2026-01-03T00:00:00+00:00")], run_column_names())
    (study / "notes.csv").write_text("x,y\n1,2\n3,4\n")
    code, out = run_cli("results", "reconstruct", study, "--description", "A study. Two rows.")
    assert code == 0, out
    monkeypatch.setattr(sys, "argv", ["lora-bench", "kernel-bench", "--out", "bench/k.csv"])
    man.record_invocation(tmp_path / "bench", outputs=["k.csv"])
    (tmp_path / "bench" / "k.csv").write_text("a\n1\n")
    text = render_index(tmp_path)
    assert "| [`study/`](#study) | A study | unknown | abc<br>unknown | GPU X | 2026-01-01 to 2026-01-03 | 2 |" in text
    assert "- command: unknown (reconstructed from rows)" in text and "abc, unknown" in text
    # the recorded command as it runs from a checkout: its output in the folder the index names
    shown = f"{tmp_path.name}/bench"
    assert "`notes.csv` (2 rows)" in text and f"`lora-bench kernel-bench --out {shown}/k.csv --results-dir {shown}`" in text
    assert run_cli("results", "index", tmp_path, "--check")[0] == 1
    assert run_cli("results", "index", tmp_path)[0] == 0
    assert run_cli("results", "index", tmp_path, "--check")[0] == 0
    code, out = run_cli("results", "reconstruct", study)
    assert code == 2 and "already has entries" in out
    code, out = run_cli("results", "prune", study)
    assert code == 2 and "--superseded" in out


def test_index_leaves_out_process_state_and_the_files_of_runs_in_nested_folders(tmp_path):
    """A study of studies (one-GPU and two-GPU runs in sub-folders): the index lists each sub-folder's
    runs.csv and the study's own files, not run folders' files, claims or write locks."""
    study = tmp_path / "study"
    for sub, rid in (("one", "r1"), ("two", "r2")):
        write_csv(study / sub / "runs.csv", [_row(rid, started="2026-01-01T00:00:00+00:00")], run_column_names())
        (study / sub / rid).mkdir()
        for name in ("run.json", "steps.csv", "job.json", ".claim"):
            (study / sub / rid / name).write_text("{}\n")
        (study / sub / "runs.csv.lock").write_text("")
    (study / "wall.log").write_text("part wall_s 1.0 exit 0\n")
    (study / ".claim").write_text("1")
    text = render_index(tmp_path)
    assert "`one/runs.csv` (1 row)" in text and "`two/runs.csv` (1 row)" in text and "`wall.log`" in text
    for left_out in ("run.json", "steps.csv", "job.json", ".claim", ".lock"):
        assert left_out not in text, left_out


def test_index_takes_provenance_and_runs_from_a_studys_sub_folders(tmp_path, monkeypatch, fresh_invocation):
    """A study whose runs live in sub-folders, each written by its own command: the study's entry in
    the index names those commands, their devices and dates, and counts the runs of every runs.csv."""
    study = tmp_path / "study"
    man.set_description(study, "Two machines. One row each.")
    for sub, rid, day in (("one", "r1", "2026-01-01"), ("two", "r2", "2026-01-02")):
        write_csv(study / sub / "runs.csv", [_row(rid, started=f"{day}T00:00:00+00:00")], run_column_names())
        monkeypatch.setattr(sys, "argv", ["lora-bench", "train", "--results-dir", str(study / sub)])
        man.record_invocation(study / sub, outputs=["runs.csv"])
    text = render_index(tmp_path)
    row, = (line for line in text.splitlines() if line.startswith("| [`study/`](#study) | Two machines |"))
    assert "GPU X" in row and "| 2026-01-01 to " in row and row.endswith("| 2 |") and "(+1 more)" in row, row
    # each as it runs from a checkout: into its folder, named from the index's root
    assert f"`lora-bench train --results-dir {tmp_path.name}/study/one`" in text, text
    assert f"`lora-bench train --results-dir {tmp_path.name}/study/two`" in text, text
    assert "- runs: 2 in `one/runs.csv`, `two/runs.csv` (2 done)" in text, text
    assert "- command: unknown" not in text.split("## study")[1]


def test_a_question_folder_gets_its_own_table_and_a_reproduce_command_stands_in_for_an_unknown_one(tmp_path):
    """A folder of results folders with a description and no runs of its own is a question: its
    folders are listed under it by their paths; a folder whose command the rows cannot tell shows
    the command its description gives to reproduce it."""
    man.set_description(tmp_path / "answer", "Why it is slower.", question=True)
    study = tmp_path / "answer" / "study"
    write_csv(study / "runs.csv", [_row("a", started="2026-01-01T00:00:00+00:00", commit="abc")], run_column_names())
    man.update_manifest(study, lambda d: d.update(description="The study. Reproduce: `lora-bench sweep s.yaml`.",
                                                  invocations=man.reconstruct_entries(result_rows(study))))
    text = render_index(tmp_path)
    assert "## answer: Why it is slower." in text
    assert (f"| [`answer/study/`](#answerstudy) | The study | reproduce: `lora-bench sweep s.yaml --results-dir "
            f"{tmp_path.name}/answer/study` | abc |") in text, text


def test_committed_results_have_manifests_and_an_up_to_date_index():
    """results/README.md is generated: `lora-bench results index results` reproduces it from the
    committed folders (runs of this checkout's own, e.g. results/runs/, are not committed)."""
    root = REPO / "results"
    try:
        tracked = subprocess.run(["git", "ls-files", "results"], cwd=REPO, capture_output=True, text=True,
                                 check=True, timeout=60).stdout.split()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc})")
    names = sorted({Path(f).parts[1] for f in tracked if len(Path(f).parts) > 2})
    assert names and all((root / n / man.MANIFEST).is_file() for n in names), names
    assert all(f"results/{n}/{man.MANIFEST}" in tracked for n in names)
    for n in names:
        assert json.loads((root / n / man.MANIFEST).read_text())["description"], n
    text = (root / "README.md").read_text()
    assert text == render_index(root, names=names), "run `lora-bench results index results`"
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| [`")]
    assert rows
    unrecorded = {"answer/whole-runs/row10", "method/modes/eager-vs-graphs"}  # rows from before commits were recorded
    for cells in rows:  # folder, what, command, commit, device, dates, runs: each folder names all three
        assert cells[2].strip() != man.UNKNOWN and cells[4].strip() != man.UNKNOWN, cells[0]
        name = cells[0].split("`")[1].rstrip("/")
        assert name in unrecorded or any(c and c != man.UNKNOWN for c in cells[3].split("<br>")), cells[0]


@pytest.mark.parametrize("blob, why", [(b"\xff\xd8\xff\xe0binary", "binary data"), (b"[1, 2]", "a JSON list"),
                                       (b'"text"', "a JSON str"), (b"{not json", "does not parse as JSON"),
                                       (b'{"invocations": {"a": 1}}', "not a list of objects"),
                                       (b'{"invocations": [{"git_commit": 5}]}', "git_commit is a int")])
def test_a_manifest_that_is_not_one_is_one_message_before_any_work(blob, why, tmp_path, run_cli, monkeypatch):
    import lora_bench.train.run as run_mod

    monkeypatch.setattr(run_mod, "RunContext", lambda *a, **k: pytest.fail("a run was started"))
    folder = tmp_path / "root" / "f"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_bytes(blob)
    sample = FIXTURES / "sms_spam_sample.tsv"
    code, out = run_cli("train", "--model-size", "tiny", "--weights", "random", "--device", "cpu", "--no-progress",
                        "--data-file", sample, "--results-dir", folder, "--run-id", "x")
    assert code == 2 and "Traceback" not in out, out
    assert str(folder / "manifest.json") in out and "not a lora-bench manifest" in out and why in out, out
    code, out = run_cli("results", "index", tmp_path / "root")
    assert code == 2 and "Traceback" not in out and "not a lora-bench manifest" in out, out
    assert (folder / "manifest.json").read_bytes() == blob and not (folder / "x").exists()


def test_index_shows_a_rows_device_as_text(tmp_path):
    """A device name from the rows (any text a runs.csv holds) cannot inject HTML or break the table."""
    row = {**_row("r1", started="2026-01-01T00:00:00+00:00"), "gpu_name": "<script>x</script> | [a](javascript:y)"}
    write_csv(tmp_path / "f" / "runs.csv", [row], run_column_names())
    text = render_index(tmp_path)
    assert "<script>" not in text and "&lt;script&gt;" in text and "\\[a\\]" in text
    table = [line for line in text.splitlines() if line.startswith("| [`f/`]")]
    # folder, what, command, commit, device, dates, runs: seven cells, the device's pipe escaped once
    assert len(table) == 1 and table[0].count(" | ") == 6 and "\\\\|" not in table[0], table
    assert "- device: &lt;script&gt;x&lt;/script&gt; \\| \\[a\\](javascript:y)" in text.splitlines(), text


def test_results_written_into_the_checkout_do_not_mark_the_source_modified(tmp_path):
    # a sweep's second shard finds the first's rows in the checkout's tracked results folder: that is
    # output, and the commit it ran is still the commit as checked out; a changed source file is not
    git = shutil.which("git")
    if git is None:
        pytest.skip("needs git")

    def run(*args):
        subprocess.run([git, *args], cwd=tmp_path, check=True, capture_output=True,
                       env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                            "GIT_COMMITTER_EMAIL": "t@t"})

    (tmp_path / "results" / "study").mkdir(parents=True)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "results" / "study" / "runs.csv").write_text("run_id\na\n")
    (tmp_path / "pkg" / "step.py").write_text("x = 1\n")
    run("init", "-q")
    run("add", ".")
    run("commit", "-q", "-m", "c")
    assert env_mod.source_modified(tmp_path) is False
    (tmp_path / "results" / "study" / "runs.csv").write_text("run_id\na\nb\n")
    assert env_mod.source_modified(tmp_path) is False
    (tmp_path / "pkg" / "step.py").write_text("x = 2\n")
    assert env_mod.source_modified(tmp_path) is True


def test_where_git_cannot_tell_the_source_is_neither_clean_nor_modified(tmp_path, monkeypatch):
    if shutil.which("git") is None:
        pytest.skip("needs git")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    (tmp_path / "not-a-checkout").mkdir()
    assert env_mod.source_modified(tmp_path / "not-a-checkout") is None


def _timed_rows(folder: Path, n: int = 2) -> None:
    """n finished runs with a step time, a throughput and an accuracy, written as a sweep writes them."""
    rows = [{"run_id": f"r{i}", "status": "done", "model_size": "124M", "trainable_layers": "lora",
             "step_ms_median": 5.0 + i, "forward_ms_median": 2.0, "tokens_per_s": 1000.0, "eval_s": 1.5,
             "training_time_s": 30.0, "val_acc": 90.0 + i, "peak_mem_allocated_mib": 100.0} for i in range(n)]
    folder.mkdir(parents=True)
    write_csv(folder / "runs.csv", rows, run_column_names())


def test_a_folder_whose_runs_shared_their_gpu_is_read_without_its_times(tmp_path, run_cli):
    """`results describe --timings shared`: the folder's rows read with every timed column blank
    (steps, phases, rates, evaluation and training times) and the rest kept (accuracy, memory), the
    report's note naming the folder; another folder read beside it keeps its times; `--timings
    measured` undoes it. A bad value is a usage error that writes nothing, and so is a call with
    nothing to set."""
    from lora_bench.report.load import SHARED_GPU, load_results, shared_gpu_note
    from lora_bench.results.schema import timed_columns

    shared, alone = tmp_path / "accuracy", tmp_path / "timing"
    _timed_rows(shared)
    _timed_rows(alone)
    code, out = run_cli("results", "describe", shared, "--timings", "shared")
    assert code == 0 and man.read_manifest(shared)[man.TIMINGS] == man.TIMINGS_SHARED, out
    df = load_results([tmp_path])
    mine, other = df[df["results_dir"] == str(shared)], df[df["results_dir"] == str(alone)]
    for col in ("step_ms_median", "forward_ms_median", "tokens_per_s", "eval_s", "training_time_s"):
        assert col in timed_columns() and mine[col].isna().all() and other[col].notna().all(), col
    assert list(mine["val_acc"]) == [90.0, 91.0] and mine["peak_mem_allocated_mib"].notna().all()
    assert list(mine[SHARED_GPU]) == [True, True] and not other[SHARED_GPU].any()
    assert str(shared) in shared_gpu_note(df) and str(alone) not in shared_gpu_note(df)
    code, _ = run_cli("results", "describe", shared, "--timings", "measured")
    assert code == 0 and man.TIMINGS not in man.read_manifest(shared)
    assert load_results([shared])["step_ms_median"].notna().all() and shared_gpu_note(load_results([shared])) == ""
    before = (shared / "manifest.json").read_text()
    code, out = run_cli("results", "describe", shared, "now described", "--timings", "sometimes")
    assert code == 2 and "sometimes" in out and "measured, shared" in out, out
    code, out = run_cli("results", "describe", shared)
    assert code == 2 and "nothing to set" in out, out
    assert (shared / "manifest.json").read_text() == before


def test_a_manifest_with_an_unknown_timings_value_is_refused_by_name(tmp_path):
    _timed_rows(tmp_path / "f")
    (tmp_path / "f" / "manifest.json").write_text(json.dumps({"description": "", "invocations": [],
                                                              "timings": "sometimes"}))
    with pytest.raises(Exception, match="timings is 'sometimes', not one of measured, shared"):
        man.read_manifest(tmp_path / "f")
    assert not man.timings_shared(tmp_path / "f")  # the report reads its times; the writers name the file
