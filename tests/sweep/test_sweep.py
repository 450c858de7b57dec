"""lora_bench.sweep.spec / lora_bench.sweep.runner: expansion and deterministic ids, validation of every run in
one pass, shards, and running tiny sweeps on the CPU — a failing and a crashing run are recorded
while the others finish, SIGINT leaves intact results and a resume runs only what is missing."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from tiny import SAMPLE, TINY_BASE, UNTIL_SIGNAL, interrupt_sweep

from lora_bench.errors import ConfigError, UsageError
from lora_bench.sweep.spec import load_sweep, parse_only, parse_shard, select_only, select_shard

TINY = TINY_BASE


def write(tmp_path: Path, body: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"# lora-bench sweep {name}\n" + textwrap.dedent(body))
    return path




def rows(results: Path) -> pd.DataFrame:
    return pd.read_csv(results / "runs.csv", dtype=str, keep_default_na=False)


# -- expansion -----------------------------------------------------------------------------------
def test_grid_repeats_and_deterministic_ids(tmp_path):
    path = write(tmp_path, "name: g\nbase:\n" + TINY + "grid:\n  trainable_layers: [all, lora]\n"
                 "  batch_size: [4, 8]\nrepeats: 2\n")
    sw = load_sweep(path)
    assert len(sw.runs) == 8 and len({r.run_id for r in sw.runs}) == 8
    assert [r.run_id for r in load_sweep(path).runs] == [r.run_id for r in sw.runs]
    # repeat-major, last grid key fastest
    assert [(r.repeat, r.cfg.trainable_layers, r.cfg.batch_size) for r in sw.runs[:4]] == [
        (0, "all", 4), (0, "all", 8), (0, "lora", 4), (0, "lora", 8)]
    assert sw.runs[0].run_id.endswith("-r0") and sw.runs[4].run_id == sw.runs[0].run_id[:-1] + "1"
    # environment overrides change what runs, not the ids (shards on other hosts merge by id)
    other = load_sweep(path, overrides={"device": "auto", "data_file": "/elsewhere/sms.tsv"})
    assert [r.run_id for r in other.runs] == [r.run_id for r in sw.runs]
    assert other.runs[0].cfg.device == "auto" and other.runs[0].cfg.data_file == "/elsewhere/sms.tsv"
    assert sw.provenance(sw.runs[5]) == {"sweep_name": "g", "sweep_file": path.as_posix(),
                                         "sweep_sha256": sw.sha256, "sweep_label": None, "repeat": 1}


def test_run_ids_survive_a_new_setting_with_a_default(tmp_path, monkeypatch):
    """A setting added in a later version (at a default that keeps the old behaviour) must not
    change the ids of existing runs, or a sweep's resume would run everything again."""
    from lora_bench.config import TrainConfig

    path = write(tmp_path, "name: g\nbase:\n" + TINY + "grid:\n  trainable_layers: [all, lora]\n")
    before = [r.run_id for r in load_sweep(path).runs]
    real = TrainConfig.to_dict
    monkeypatch.setattr(TrainConfig, "to_dict", lambda self: {**real(self), "a_new_option": "default"})
    assert [r.run_id for r in load_sweep(path).runs] == before
    # while a setting that differs from its default does change the id
    monkeypatch.setattr(TrainConfig, "to_dict", lambda self: {**real(self), "a_new_option": self.trainable_layers})
    assert TrainConfig().trainable_layers not in ("all", "lora")
    after = [r.run_id for r in load_sweep(path).runs]
    assert after[0] != before[0] and after[1] != before[1] and len(set(after)) == 2


def test_resume_finds_finished_runs_by_their_settings(tmp_path):
    """Rows written under another id scheme (or before a setting existed) still count as done when
    the same sweep and repeat holds the same settings; anything else is still to run."""
    from lora_bench.results.schema import settings_columns
    from lora_bench.results.store import upsert_run
    from lora_bench.sweep.resume import resume_statuses

    path = write(tmp_path, "name: g\nbase:\n" + TINY + "grid:\n  trainable_layers: [all, lora, last_block]\n"
                 "repeats: 2\n")
    sw = load_sweep(path)
    res = tmp_path / "res"
    res.mkdir()

    def legacy(run, run_id, **change):
        row = {"run_id": run_id, "status": "done", "sweep_name": "g", "repeat": str(run.repeat),
               **{k: ("" if v is None else str(v)) for k, v in settings_columns(run.cfg).items()}}
        row["cfg_data_file"] = "/another/machine/sms.tsv"  # paths and devices are not compared
        row["cfg_device"] = "cuda"
        row.pop("cfg_compile_scope")  # a setting the old version did not have (at its default now)
        row.update(change)
        upsert_run(res / "runs.csv", row)

    r = {(x.cfg.trainable_layers, x.repeat): x for x in sw.runs}
    legacy(r["all", 0], "old-all-0")
    legacy(r["lora", 0], "old-lora-0", cfg_lora_rank="4")  # other settings: not this run
    legacy(r["lora", 1], "old-lora-1", status="failed")  # not finished
    legacy(r["all", 1], "old-all-other", sweep_name="other")  # another sweep
    legacy(r["last_block", 1], "old-lb-5", repeat="5")  # a repeat this plan does not have
    legacy(r["last_block", 0], "old-lb-0b", cfg_batch_size="8.0")  # numbers compare as numbers
    st = resume_statuses(res, list(sw.runs), "g")
    done = {k: st[x.run_id][1] for k, x in r.items() if st.get(x.run_id, ("",))[0] == "done"}
    assert done == {("all", 0): "old-all-0", ("last_block", 0): "old-lb-0b"}
    # the run's own row wins over a settings match
    upsert_run(res / "runs.csv", {"run_id": r["all", 0].run_id, "status": "done", "sweep_name": "g", "repeat": "0"})
    assert resume_statuses(res, list(sw.runs), "g")[r["all", 0].run_id] == ("done", r["all", 0].run_id)


def test_explicit_runs_times_grid_and_relative_data_file(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sms.tsv").write_text(SAMPLE.read_text())
    path = write(tmp_path, """\
        name: r
        base: {model_size: tiny, weights: random, data_file: data/sms.tsv, lora_rank: 2}
        grid: {trainable_layers: [lora, lora-merged]}
        runs:
          - {label: small, lora_alpha: 4}
          - {label: big, lora_alpha: 32, lora_rank: 16}
        """)
    sw = load_sweep(path)
    got = [(r.label, r.cfg.trainable_layers, r.cfg.lora_rank, r.cfg.lora_alpha) for r in sw.runs]
    assert got == [("small", "lora", 2, 4.0), ("small", "lora-merged", 2, 4.0),
                   ("big", "lora", 16, 32.0), ("big", "lora-merged", 16, 32.0)]
    assert sw.runs[0].cfg.data_file == str((tmp_path / "data" / "sms.tsv").resolve())


def test_validate_reports_every_problem_in_one_pass(tmp_path, monkeypatch, capsys, run_cli):
    path = write(tmp_path, """\
        name: bad
        repeat: 2
        base: {model_size: tiny, weights: random, lora_rnak: 4, no_padding: true}
        grid:
          trainable_layers: [all, lorra]
          max_steps: 5
        runs:
          - {label: odd-width, emb_dim: 30, n_heads: 4}
          - {label: pretrained-tiny, weights: pretrained}
        """)
    with pytest.raises(ConfigError) as e:
        load_sweep(path)
    text = "\n".join(e.value.problems)
    for expected in ("unknown top-level key 'repeat'; did you mean 'repeats'?",
                     "unknown setting 'lora_rnak'; did you mean 'lora_rank'?",
                     "grid.max_steps must be a non-empty list",
                     "trainable_layers='lorra' is not allowed",
                     "no_padding needs batch_size=1",
                     "emb_dim=30 is not divisible by n_heads=4",
                     "model_size=tiny has no pretrained checkpoint"):
        assert expected in text
    good = write(tmp_path, "name: ok\nbase:\n" + TINY, name="ok.yaml")
    code, out = run_cli("validate", path, good)
    assert code == 2
    assert "did you mean 'lora_rank'?" in out and "not divisible" in out and "Traceback" not in out
    assert "✓" in out and "ok.yaml" in out and "1 of 2 sweep file(s) have problems" in out


def test_duplicate_settings_and_clashing_keys_are_problems(tmp_path):
    path = write(tmp_path, """\
        name: dup
        base: {model_size: tiny, weights: random}
        grid: {batch_size: [4, 8]}
        runs:
          - {label: a}
          - {label: b}
          - {label: c, batch_size: 2}
        """)
    with pytest.raises(ConfigError) as e:
        load_sweep(path)
    text = "\n".join(e.value.problems)
    assert "has the same settings as a (batch_size=4)" in text
    assert "runs[2] sets batch_size, which grid also varies" in text


def test_shards_are_disjoint_and_cover_the_sweep(tmp_path):
    path = write(tmp_path, "name: sh\nbase:\n" + TINY + "grid:\n  trainable_layers: [all, lora, lora-merged]\n"
                 "  batch_size: [2, 4, 8]\nrepeats: 2\n")
    runs = load_sweep(path).runs
    for n in range(1, 6):
        parts = [{r.run_id for r in select_shard(runs, (i, n))} for i in range(1, n + 1)]
        assert set().union(*parts) == {r.run_id for r in runs}
        assert sum(map(len, parts)) == len(runs)  # disjoint
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert [r.run_id for p in range(1, n + 1) for r in select_shard(runs, (p, n))] == [r.run_id for r in runs]
    assert parse_shard("2/4") == (2, 4) and parse_shard(None) is None
    for bad in ("0/3", "4/3", "a/b", "3"):
        with pytest.raises(UsageError, match="I/N"):
            parse_shard(bad)


def test_only_keeps_the_runs_that_hold_every_key_at_one_of_its_values(tmp_path):
    path = write(tmp_path, "name: o\nbase:\n" + TINY + "runs:\n  - {label: ref, trainable_layers: all}\n"
                 "  - {label: ref, trainable_layers: lora}\n  - {label: fast, trainable_layers: lora, lora_rank: 4}\n"
                 "grid:\n  batch_size: [2, 4]\nrepeats: 2\n")
    runs = list(load_sweep(path).runs)
    got = select_only(runs, parse_only(["trainable_layers=lora", "batch_size=4"]))
    assert [(r.label, r.cfg.lora_rank, r.cfg.batch_size, r.repeat) for r in got] == [
        ("ref", 8, 4, 0), ("fast", 4, 4, 0), ("ref", 8, 4, 1), ("fast", 4, 4, 1)]
    # a repeated key is any of its values; the label is a key; numbers compare as numbers
    got = select_only(runs, parse_only(["label=fast", "batch_size=2", "batch_size=4.0"]))
    assert {r.run_id for r in got} == {r.run_id for r in runs if r.label == "fast"}
    assert select_only(runs, {}) == runs
    # a plan line names the label and what sets the run apart within it
    assert runs[0].describe() == "ref: batch_size=2, trainable_layers=all"
    # the shard is taken from the whole plan first: the filtered shards are the whole plan's, filtered
    for i in (1, 2):
        part = select_only(select_shard(runs, (i, 2)), parse_only(["label=ref"]))
        assert all(r.repeat == i - 1 and r.label == "ref" for r in part) and len(part) == 4


def test_only_refuses_what_keeps_nothing_or_names_no_setting(tmp_path):
    path = write(tmp_path, "name: o\nbase:\n" + TINY + "grid:\n  trainable_layers: [all, lora]\n")
    runs = list(load_sweep(path).runs)
    with pytest.raises(UsageError, match=r"keeps none of the 2 runs.*trainable_layers: all, lora"):
        select_only(runs, parse_only(["trainable_layers=lora-kernel"]))
    with pytest.raises(UsageError, match="did you mean trainable_layers"):
        parse_only(["trainable_layer=lora"])
    with pytest.raises(UsageError, match="KEY=VALUE"):
        parse_only(["lora"])


def test_only_runs_and_resumes_just_the_selected_runs(tmp_path, monkeypatch, run_cli):
    import lora_bench.train.run as run_mod

    calls, real = [], run_mod.execute
    monkeypatch.setattr(run_mod, "execute", lambda points, **kw: calls.extend(p.run_id for p in points) or real(points, **kw))
    path = write(tmp_path, "name: only-run\nbase:\n" + TINY + "grid:\n  trainable_layers: [all, lora]\nrepeats: 2\n")
    ids = {r.cfg.trainable_layers + str(r.repeat): r.run_id for r in load_sweep(path).runs}
    common = ("--cache-dir", tmp_path / "cache", "--isolation", "inline", "--no-progress", "--results-dir", tmp_path / "r")
    code, out = run_cli("sweep", path, "--only", "trainable_layers=lora", "--dry-run", "--results-dir", tmp_path / "r")
    assert code == 0 and ids["lora0"] in out and ids["lora1"] in out and ids["all0"] not in out
    assert run_cli("sweep", path, "--only", "trainable_layers=lora", "--shard", "2/2", *common)[0] == 0
    assert calls == [ids["lora1"]]
    assert run_cli("sweep", path, *common)[0] == 0  # the whole file resumes: the filtered run is done
    assert sorted(calls) == sorted(ids.values()) and len(rows(tmp_path / "r")) == 4
    code, out = run_cli("sweep", path, "--only", "model_size=124M", *common)
    assert code == 2 and "keeps none" in out and "Traceback" not in out


# -- running -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_failures_and_crashes_are_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys, run_cli):
    """Process isolation: a data error (exception) and a segfault (the child dies) each become a
    failed row; the good run finishes."""
    hook = tmp_path / "hook"
    hook.mkdir()
    # test-only crash: the worker child segfaults before running when its job has seed 666
    (hook / "sitecustomize.py").write_text(textwrap.dedent("""\
        import json, os, signal, sys
        if sys.argv and sys.argv[-1].endswith("job.json"):
            if any(p["config"]["seed"] == 666 for p in json.load(open(sys.argv[-1]))["points"]):
                os.kill(os.getpid(), signal.SIGSEGV)
        """))
    monkeypatch.setenv("PYTHONPATH", str(hook))
    path = write(tmp_path, "name: f\nbase:\n" + TINY + textwrap.dedent("""\
        runs:
          - {label: ok}
          - {label: bad-data, data_file: missing.tsv}
          - {label: crash, seed: 666}
        """))
    results = tmp_path / "res"
    code, out = run_cli("sweep", path, "--results-dir", results, "--cache-dir",
                        tmp_path / "cache", "--no-progress")
    assert code == 1, out
    df = rows(results).set_index("sweep_label")
    assert df.loc["ok", "status"] == "done"
    assert df.loc["bad-data", "status"] == "failed" and "data file not found" in df.loc["bad-data", "error"]
    assert df.loc["crash", "status"] == "failed" and "SIGSEGV" in df.loc["crash", "error"]
    assert set(df["sweep_name"]) == {"f"} and set(df["repeat"]) == {"0"}
    assert len(set(df["sweep_sha256"])) == 1 and len(df["sweep_sha256"].iloc[0]) == 64
    assert "1 done, 2 failed" in out


@pytest.mark.slow
def test_sigint_keeps_results_and_resume_runs_only_the_missing(tmp_path, monkeypatch, capsys, run_cli):
    path = write(tmp_path, "name: i\nbase:\n" + TINY + textwrap.dedent(f"""\
        runs:
          - {{label: quick}}
          - {{label: slow, {UNTIL_SIGNAL}}}
          - {{label: after, seed: 7}}
        """))
    results = tmp_path / "res"
    ids = {r.label: r.run_id for r in load_sweep(path).runs}
    code, out = interrupt_sweep(path, results, tmp_path / "cache", once=results / ids["slow"] / "job.json",
                                timeout=60)  # into the slow run
    assert code == 130, out
    df = rows(results)  # parses: no torn rows
    assert sorted(df["run_id"]) == sorted([ids["quick"], ids["slow"]])  # no duplicates, 'after' never started
    status = dict(zip(df["run_id"], df["status"]))
    assert status == {ids["quick"]: "done", ids["slow"]: "interrupted"}
    quick_started = df.set_index("run_id").loc[ids["quick"], "started_at"]

    import lora_bench.train.run as run_mod

    calls, real = [], run_mod.execute

    def short(points, **kw):  # rerun for real, but a few steps only (the id stays the sweep's)
        calls.extend(p.run_id for p in points)
        return real([replace(p, cfg=p.cfg.replace(max_steps=2)) for p in points], **kw)

    monkeypatch.setattr(run_mod, "execute", short)
    code, out = run_cli("sweep", path, "--results-dir", results, "--cache-dir",
                        tmp_path / "cache", "--isolation", "inline", "--no-progress")
    assert code == 0, out
    assert calls == [ids["slow"], ids["after"]]
    df = rows(results)
    assert len(df) == 3 and df["run_id"].is_unique and set(df["status"]) == {"done"}
    assert df.set_index("run_id").loc[ids["quick"], "started_at"] == quick_started
    assert "1 skipped" in out


def test_sigterm_inline_marks_the_run_interrupted_and_stops(tmp_path, monkeypatch, capsys, run_cli):
    import lora_bench.train.run as run_mod

    def killed(*args, **kwargs):  # the loop receives SIGTERM mid-run
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    monkeypatch.setattr(run_mod, "train_classifier", killed)
    before = signal.getsignal(signal.SIGTERM)
    path = write(tmp_path, "name: t\nbase:\n" + TINY + "grid:\n  trainable_layers: [all, lora]\n")
    results = tmp_path / "res"
    code, out = run_cli("sweep", path, "--results-dir", results, "--cache-dir",
                        tmp_path / "cache", "--isolation", "inline", "--no-progress")
    assert code == 130, out
    df = rows(results)
    assert list(df["status"]) == ["interrupted"] and "SIGTERM" in df["error"].iloc[0]
    assert "1 not started" in out
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored after the sweep


def test_resume_fresh_dry_run_and_default_results_dir(tmp_path, monkeypatch, capsys, run_cli):
    import lora_bench.train.run as run_mod

    calls, real = [], run_mod.execute
    monkeypatch.setattr(run_mod, "execute", lambda points, **kw: calls.extend(p.run_id for p in points) or real(points, **kw))
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "name: fr\nbase:\n" + TINY + "grid:\n  trainable_layers: [all, lora]\n")
    common = ("--cache-dir", tmp_path / "cache", "--isolation", "inline", "--no-progress")
    ids = [r.run_id for r in load_sweep(path).runs]
    code, out = run_cli("sweep", path, "--dry-run")
    assert code == 0 and all(i in out for i in ids) and "2 to run" in out
    assert not (tmp_path / "results").exists()
    assert run_cli("sweep", path, *common)[0] == 0
    assert len(calls) == 2 and (tmp_path / "results" / "fr" / "runs.csv").is_file()
    code, out = run_cli("sweep", path, *common)
    assert code == 0 and len(calls) == 2 and "2 skipped" in out
    assert "skip (done)" in run_cli("sweep", path, "--dry-run")[1]
    assert run_cli("sweep", path, "--fresh", *common)[0] == 0
    assert len(calls) == 4 and len(rows(tmp_path / "results" / "fr")) == 2


def test_usage_errors_exit_2_without_traceback(tmp_path, monkeypatch, capsys, run_cli):
    path = write(tmp_path, "name: u\nbase:\n" + TINY)
    code, out = run_cli("sweep", path, "--shard", "5/4")
    assert code == 2 and "1 <= I <= N" in out and "Traceback" not in out
    code, out = run_cli("sweep", path, "--isolation", "thread", "--results-dir", tmp_path / "r")
    assert code == 2 and "choose one of: process, inline" in out
    code, out = run_cli("sweep", tmp_path / "nope.yaml")
    assert code == 2 and "sweep file not found" in out
    code, out = run_cli("sweep", path, "--device", "gpu", "--dry-run")
    assert code == 2 and "device='gpu' is not allowed" in out
    import torch

    if torch.cuda.device_count() < 8:  # checked before the first run, not failed run by run
        code, out = run_cli("sweep", path, "--device", "cuda:7", "--results-dir", tmp_path / "r")
        assert code == 2 and "CUDA device(s)" in out and not (tmp_path / "r").exists()


def test_labels_reach_the_terminal_as_text(tmp_path, monkeypatch, capsys, run_cli):
    """A label's rich markup is printed as it is written, in the plan and in each run's line; a
    label with a control character (a terminal escape sequence) is refused, the character shown
    as an escape."""
    label = "[bold]x[/bold] [link=https://e.test]L[/link]"
    path = write(tmp_path, "name: lab\nbase:\n" + TINY + f"runs:\n  - {{label: '{label}'}}\n")
    code, out = run_cli("sweep", path, "--dry-run", "--results-dir", tmp_path / "r")
    assert code == 0 and label in out, out
    code, out = run_cli("sweep", path, "--isolation", "inline", "--no-progress", "--results-dir", tmp_path / "r",
                        "--cache-dir", tmp_path / "cache")
    assert code == 0 and label in out, out
    bad = write(tmp_path, "name: esc\nbase:\n" + TINY + 'runs:\n  - {label: "\\e]0;owned\\a\\e[2J"}\n', "esc.yaml")
    for args in (("sweep", bad, "--dry-run"), ("validate", bad)):
        code, out = run_cli(*args)
        assert code == 2 and "\x1b" not in out and "\x07" not in out, out
        assert "runs[0].label" in out and "control character" in out and "\\x1b" in out, out


def test_a_worker_the_sweep_kills_on_a_second_signal_is_not_blamed_on_the_oom_killer(tmp_path, monkeypatch):
    """A worker that does not stop on the forwarded SIGTERM is killed by the sweep's second one: the
    record says so, instead of pointing at the out-of-memory killer."""
    import threading

    from lora_bench.config import TrainConfig
    from lora_bench.results.claims import try_claim
    from lora_bench.sweep import isolation

    (tmp_path / "stubborn.py").write_text(textwrap.dedent("""\
        import signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(120)
        """))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(isolation, "CHILD_MODULE", "stubborn")
    job = isolation.Job(cfg=TrainConfig(), run_id="r", results_dir=tmp_path / "res", extra={})
    log = job.run_dir / "worker.log"

    def two_signals():
        deadline = time.monotonic() + 60
        while not (log.is_file() and "ready" in log.read_text()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # forwarded to the worker, which ignores it
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)  # the second one kills it

    threading.Thread(target=two_signals, daemon=True).start()
    with isolation.Interrupts() as stop, try_claim(job.run_dir) as claim:
        row = isolation.run_job(job, isolation="process", interrupts=stop, claim=claim)
    assert row["status"] == "interrupted", row
    assert "killed by SIGKILL" in row["error"] and "a second SIGTERM to the sweep" in row["error"], row
    assert "out-of-memory" not in row["error"]


def test_piped_output_says_which_run_starts(tmp_path, monkeypatch, capsys, run_cli):
    """Off a terminal there is no live bar: each run's start is a plain line (and not with
    --no-progress); its end was one already."""
    path = write(tmp_path, "name: piped\nbase:\n" + TINY + "grid:\n  trainable_layers: [all, lora]\n")
    common = ("--isolation", "inline", "--cache-dir", tmp_path / "cache")
    code, out = run_cli("sweep", path, *common, "--results-dir", tmp_path / "a")
    assert code == 0, out
    ids = [r.run_id for r in load_sweep(path).runs]
    assert f"started 1/2  {ids[0]}" in out and f"started 2/2  {ids[1]}" in out, out
    assert out.index("started 1/2") < out.index("done") < out.index("started 2/2")
    assert "\r" not in out and "\x1b" not in out
    code, out = run_cli("sweep", path, *common, "--results-dir", tmp_path / "b", "--no-progress")
    assert code == 0 and "started 1/2" not in out, out


@pytest.mark.parametrize("pack", ["1", "2"])
def test_a_run_interrupted_in_a_sweep_keeps_the_steps_it_measured(tmp_path, monkeypatch, run_cli, pack):
    """SIGTERM after two steps (alone, or in a pack): each run's own record (its row and the
    steps.csv of the steps it trained) stays as the run saved it; the sweep's settling of the run
    does not drop the steps."""
    import lora_bench.train.run as run_mod

    def stop_after_two(real):
        def loop(*args, **kwargs):
            def on_step(step, *rest):
                if step == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
            return real(*args, **{**kwargs, "on_step": on_step})
        return loop

    monkeypatch.setattr(run_mod, "train_classifier", stop_after_two(run_mod.train_classifier))
    body = TINY.replace("max_steps: 2", "max_steps: 4").replace("warmup_steps: 1", "warmup_steps: 0")
    path = write(tmp_path, "name: ks\nbase:\n" + body + "  trainable_layers: lora\ngrid:\n  lora_rank: [2, 4]\n")
    results = tmp_path / "res"
    code, out = run_cli("sweep", path, "--pack", pack, "--results-dir", results, "--cache-dir", tmp_path / "cache",
                        "--isolation", "inline", "--no-progress")
    assert code == 130, out
    df = rows(results)
    stopped = df[df["status"] == "interrupted"]
    assert len(stopped) == (1 if pack == "1" else 2), out
    for run_id in stopped["run_id"]:
        steps = pd.read_csv(results / run_id / "steps.csv")
        assert list(steps["step"]) == [0, 1] and steps["loss"].notna().all()
