"""lora_bench.report.comparison and ``lora-bench compare``: runs matched by their settings (not run
ids, paths left out, seeds that vary per repeat left out), per-setting ratio, interval and verdict,
the --fail-above gate, a gate that cannot pass vacuously (nothing matched, settings missing on one
side, nothing with enough repeats), --ignore, --allow-missing, --only-changed, --sort, environment
warnings, the five formats and clear usage errors; then on real tiny sweeps: a copy of a one-run
sweep with every step time scaled by 1.2 gets no verdict (one run: too few repeats) and fails the
gate as judging nothing, two sweeps of the same file pass it; and the committed study against
itself passes while it fails against the two-repeat folder of other settings."""

from __future__ import annotations

import io
import json
import shutil
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
from tiny import SAMPLE

from lora_bench.fileio import atomic_write_text
from lora_bench.report import stats
from lora_bench.report.comparison import compare
from lora_bench.results.records import RUN_RECORD
from lora_bench.results.schema import STEP_COLUMNS, run_column_names
from lora_bench.results.store import read_run_table, read_steps, write_csv


# -- synthetic folders ---------------------------------------------------------------------------
def _rows(times: dict[str, list[float]], *, host: str = "h0", gpu: str = "NVIDIA H200", seeds: bool = False,
          prefix: str = "") -> list[dict]:
    """One row per repeat of each trainable-layer choice, with the given median step times."""
    rows = []
    for layers, values in times.items():
        for r, ms in enumerate(values):
            rows.append({"run_id": f"{prefix}{layers}-r{r}", "status": "done", "started_at": f"2026-01-01T00:{r:02d}",
                         "step_ms_median": ms, "forward_ms_median": ms / 2, "repeat": r, "cfg_model_size": "124M",
                         "cfg_trainable_layers": layers, "cfg_data_file": f"/{host}/sms.tsv",
                         "cfg_seed": 123 + r if seeds else 123, "gpu_name": gpu, "torch_version": "2.13.0",
                         "hostname": host})
    return rows


def _folder(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True)
    write_csv(path / "runs.csv", rows, run_column_names())
    return path


BASE = {"all": [50.0, 50.4, 49.8, 50.1, 50.2], "lora": [70.0, 70.5, 69.8, 70.2, 70.1]}


def test_runs_are_matched_by_settings_not_by_run_id(tmp_path):
    a = _folder(tmp_path / "a", _rows(BASE, seeds=True))
    slower = {"all": [v * 1.2 for v in BASE["all"]], "lora": BASE["lora"]}
    b = _folder(tmp_path / "b", _rows(slower, host="h1", seeds=True, prefix="other-id-"))  # other ids, other paths
    c = compare(a, b, fail_above=0.10)
    assert c.keys == ["trainable_layers"] and [r.settings for r in c.rows] == [{"trainable_layers": "all"},
                                                                              {"trainable_layers": "lora"}]
    all_, lora = c.rows
    assert (all_.baseline.n, all_.candidate.n) == (5, 5)  # the seeds vary per repeat: repeats, not settings
    assert all_.ratio.value == pytest.approx(1.2) and all_.ratio.lo > 1.1 and all_.verdict == stats.SLOWER
    assert all_.fails and not lora.fails and lora.verdict == stats.SAME
    assert [r.settings for r in c.failed] == [{"trainable_layers": "all"}]
    assert c.environment == [] and c.only == {"baseline": [], "candidate": []}


def test_settings_on_one_side_and_environment_differences_are_listed(tmp_path):
    a = _folder(tmp_path / "a", _rows(BASE))
    b = _folder(tmp_path / "b", _rows({"lora": BASE["lora"], "lora-kernel": [40.0, 40.1]}, gpu="NVIDIA A100"))
    c = compare(a, b)
    assert [r.settings for r in c.rows] == [{"trainable_layers": "lora"}]
    assert c.only == {"baseline": [{"trainable_layers": "all"}], "candidate": [{"trainable_layers": "lora-kernel"}]}
    assert c.environment == ["gpu_name: NVIDIA H200 (baseline) vs NVIDIA A100 (candidate)"]


def test_hosts_of_different_speed_are_named(tmp_path):
    """Two hosts that record the same environment but run torch ops at different speeds (the
    measured host_op_us) get a warning with both medians; a 5 % difference is one host's noise."""
    def with_probe(rows, us):
        return [{**r, "host_op_us": us} for r in rows]
    a = _folder(tmp_path / "a", with_probe(_rows(BASE), 6.0))
    b = _folder(tmp_path / "b", with_probe(_rows(BASE), 9.0))
    same = _folder(tmp_path / "c", with_probe(_rows(BASE), 6.3))
    assert compare(a, same).environment == []
    (warning,) = compare(a, b).environment
    assert warning.startswith("host_op_us: 6.00 µs (baseline) vs 9.00 µs (candidate), +50%"), warning
    broken = _folder(tmp_path / "d", with_probe(_rows(BASE), "inf")[:3] + with_probe(_rows(BASE), "x")[3:])
    assert compare(a, broken).environment == []  # cells that measure nothing are not a host


def test_absurd_host_speeds_are_named_in_a_short_line(tmp_path):
    """Probes far apart (a cell of 1e-300 µs against one of 1e300) still warn, in a line of
    three significant digits, not a number of hundreds of digits."""
    tiny = _folder(tmp_path / "a", [{**r, "host_op_us": "1e-300"} for r in _rows(BASE)])
    huge = _folder(tmp_path / "b", [{**r, "host_op_us": "1e300"} for r in _rows(BASE)])
    (warning,) = compare(tiny, huge).environment
    assert warning.startswith("host_op_us: 1e-300 µs (baseline) vs 1e+300 µs (candidate), inf×: "), warning
    (warning,) = compare(huge, _folder(tmp_path / "c", [{**r, "host_op_us": "2e302"} for r in _rows(BASE)])).environment
    assert warning.startswith("host_op_us: 1e+300 µs (baseline) vs 2e+302 µs (candidate), 200×: "), warning


def test_a_setting_that_differs_is_not_matched(tmp_path):
    a = _folder(tmp_path / "a", _rows(BASE))
    b = _folder(tmp_path / "b", [dict(r, cfg_batch_size=16) for r in _rows(BASE)])
    c = compare(a, b)
    assert c.rows == [] and len(c.only["baseline"]) == 2 and len(c.only["candidate"]) == 2
    assert "batch_size" in c.keys and any("nothing was compared" in p for p in c.problems)


def test_noise_makes_the_gate_pass_and_a_clear_slowdown_fails_it(tmp_path, run_cli):
    noisy = {"all": [40.0, 60.0, 50.0, 45.0, 55.0], "lora": [70.0, 70.1, 70.2, 70.05, 70.15]}
    a = _folder(tmp_path / "a", _rows(noisy))
    b = _folder(tmp_path / "b", _rows({"all": [60.0, 45.0, 72.0, 50.0, 66.0], "lora": [80.0, 80.2, 80.1, 80.05, 80.15]}))
    c = compare(a, b, fail_above=0.10)
    all_, lora = c.rows
    assert all_.ratio.value == pytest.approx(1.2) and all_.verdict == stats.UNCLEAR and not all_.fails
    assert lora.verdict == stats.SLOWER and lora.ratio.lo > 1.1 and lora.fails  # +14 %, repeats 0.3 % apart
    code, out = run_cli("compare", a, b, "--fail-above", "10")
    assert code == 1 and "gate failed: 1 setting(s) slower by more than 10 %" in out
    code, out = run_cli("compare", a, b, "--fail-above", "20")
    assert code == 0 and "gate passed" in out and "(2 setting(s) judged)" in out
    code, out = run_cli("compare", a, b)  # no gate: a slowdown is reported, the exit code stays 0
    assert code == 0 and "slower" in out


def test_formats(tmp_path, run_cli):
    a = _folder(tmp_path / "a", _rows(BASE))
    b = _folder(tmp_path / "b", _rows({"all": BASE["all"], "lora-kernel": [40.0, 40.1]}, gpu="NVIDIA A100"))
    code, out = run_cli("compare", a, b, "--format", "json", "--allow-missing")
    assert code == 0
    doc = json.loads(out[:out.rindex("}") + 1])  # the environment warning follows on stderr
    assert doc["metric"] == "step_ms_median" and doc["statistic"]["threshold"] == 0.02
    (row,) = doc["settings"]
    assert row["settings"] == {"trainable_layers": "all"} and row["verdict"] in stats.VERDICTS
    assert row["ratio"]["lo"] <= row["ratio"]["value"] <= row["ratio"]["hi"]
    assert row["ratio"]["n"] == 5 and row["ratio"]["confidence_at_least"] and doc["complete"] and doc["problems"] == []
    assert doc["only_baseline"] == [{"trainable_layers": "lora"}]
    assert doc["only_candidate"] == [{"trainable_layers": "lora-kernel"}]
    assert doc["environment_differences"][0].startswith("gpu_name:") and "warning: environment differs" in out
    code, out = run_cli("compare", a, b, "--format", "csv", "--allow-missing")
    assert code == 0
    df = pd.read_csv(io.StringIO(out.split("warning:")[0]), keep_default_na=False)
    assert list(df["verdict"])[1:] == ["only in baseline", "only in candidate"]
    assert {"baseline_median", "baseline_lo", "candidate_hi", "ratio_lo", "ratio_hi", "interval_over", "ratio_n",
            "ratio_confidence", "baseline_confidence"} <= set(df.columns)
    code, out = run_cli("compare", a, b, "--format", "markdown", "--allow-missing")
    assert code == 0 and "| trainable_layers |" in out and "only in the candidate (1)" in out and "(n = 5, " in out
    code, out = run_cli("compare", a, b, "--format", "html", "--allow-missing")
    assert code == 0 and out.startswith("<!DOCTYPE html>") and "<table" in out and "only in the candidate (1)" in out
    assert "<script" not in out
    code, out = run_cli("compare", a, b, "--format", "table", "--allow-missing")
    assert code == 0 and "environment differs" in out and "candidate ÷ baseline" in out


def test_a_comparison_that_matched_nothing_fails_with_the_reason(tmp_path, run_cli):
    """Folders that differ in a setting match nothing: exit 1 with the reason, with or without a
    gate; --ignore that setting matches them."""
    a = _folder(tmp_path / "a", [dict(r, cfg_max_steps=30) for r in _rows(BASE)])
    b = _folder(tmp_path / "b", [dict(r, cfg_max_steps=60) for r in _rows(BASE)])
    for gate in ((), ("--fail-above", "5")):
        code, out = run_cli("compare", a, b, *gate)
        assert code == 1 and "no setting is on both sides: nothing was compared" in out and "gate passed" not in out
    c = compare(a, b, ignore=["max_steps"])
    assert [r.settings for r in c.rows] == [{"trainable_layers": "all"}, {"trainable_layers": "lora"}]
    assert c.problems == [] and "max_steps" not in c.keys and c.ignored == ["max_steps"]
    code, out = run_cli("compare", a, b, "--ignore", "max_steps", "--fail-above", "5")
    assert code == 0 and "gate passed" in out and "left out of the matching (--ignore): max_steps" in out
    assert compare(a, b, ignore=["cfg_max_steps", "batch_size"]).problems == []  # repeatable, either spelling


def test_settings_missing_on_one_side_fail_unless_allowed(tmp_path, run_cli):
    a = _folder(tmp_path / "a", _rows(BASE))
    b = _folder(tmp_path / "b", _rows({"lora": BASE["lora"]}))
    c = compare(a, b, fail_above=0.05)
    assert [r.settings for r in c.rows] == [{"trainable_layers": "lora"}] and not c.failed
    assert c.problems == ["settings missing on one side (1 only in the baseline): --allow-missing accepts that"]
    code, out = run_cli("compare", a, b, "--fail-above", "5")
    assert code == 1 and "gate failed: settings missing on one side (1 only in the baseline)" in out
    code, out = run_cli("compare", a, b)  # no gate: still incomplete
    assert code == 1 and "incomplete: settings missing on one side" in out
    code, out = run_cli("compare", a, b, "--fail-above", "5", "--allow-missing")
    assert code == 0 and "gate passed" in out
    assert compare(a, b, allow_missing=True).problems == []


def test_two_repeats_give_no_verdict_and_a_gate_that_judged_nothing_fails(tmp_path, run_cli):
    """Two repeats a side, 60 % apart: an interval and n, but too few repeats for a verdict, in
    compare and in report; a gate over such settings only judged nothing and fails."""
    two = {"all": [50.0, 50.2], "lora": [80.0, 80.1]}
    a = _folder(tmp_path / "a", _rows(two))
    b = _folder(tmp_path / "b", _rows({"all": [80.0, 80.3], "lora": [80.0, 80.2]}))
    c = compare(a, b, fail_above=0.05)
    assert {r.verdict for r in c.rows} == {stats.TOO_FEW} and not c.failed
    assert c.rows[0].ratio.has_interval and c.rows[0].ratio.n == 2
    assert c.problems == ["no setting on both sides has 5 repeats a side: the gate judged nothing"]
    code, out = run_cli("compare", a, b, "--fail-above", "5")
    assert code == 1 and "the gate judged nothing" in out and "not judged" in out
    code, out = run_cli("compare", a, b)  # without a gate it is a complete comparison without verdicts
    assert code == 0 and "too few repeats" in out and "slower" not in out.split("verdict:")[0]
    code, out = run_cli("report", a, "--baseline", "trainable_layers=all", "--format", "json")
    assert code == 0
    lora = next(g for g in json.loads(out)["groups"] if g["settings"]["trainable_layers"] == "lora")
    assert lora["verdict"] == stats.TOO_FEW and lora["ratio"]["n"] == 2 and lora["ratio"]["lo"] > 1.5
    code, out = run_cli("report", a, "--baseline", "trainable_layers=all")
    assert code == 0 and "too few repeats" in out and "1.60× slower" not in out


def test_only_changed_and_sort(tmp_path, run_cli):
    a = _folder(tmp_path / "a", _rows({**BASE, "lora-kernel": [40.0, 40.1, 40.2, 40.05, 40.15]}))
    b = _folder(tmp_path / "b", _rows({"all": [v * 1.3 for v in BASE["all"]], "lora": BASE["lora"],
                                       "lora-kernel": [v * 0.8 for v in (40.0, 40.1, 40.2, 40.05, 40.15)]}))
    c = compare(a, b)
    assert [r.verdict for r in c.shown()] == [stats.SLOWER, stats.SAME, stats.FASTER]
    assert [r.settings["trainable_layers"] for r in c.shown(only_changed=True)] == ["all", "lora-kernel"]
    assert [r.settings["trainable_layers"] for r in c.shown(sort="ratio")] == ["all", "lora", "lora-kernel"]
    assert [r.settings["trainable_layers"] for r in compare(b, a).shown(sort="ratio")] == ["lora-kernel", "lora", "all"]
    code, out = run_cli("compare", a, b, "--only-changed", "--format", "csv")
    assert code == 0 and list(pd.read_csv(io.StringIO(out))["trainable_layers"]) == ["all", "lora-kernel"]
    code, out = run_cli("compare", b, a, "--sort", "ratio", "--format", "json")
    assert code == 0 and [s["settings"]["trainable_layers"] for s in json.loads(out)["settings"]] == [
        "lora-kernel", "lora", "all"]
    code, out = run_cli("compare", a, b, "--only-changed", "--format", "markdown")
    assert code == 0 and "2 of 3 setting(s) shown" in out


@pytest.mark.slow
def test_the_committed_gate_fails_on_unmatched_folders_and_passes_the_study_against_itself(run_cli):
    from paths import ROOT

    study, tokens = ROOT / "results/answer/study", ROOT / "results/answer/tokens-per-step"
    code, out = run_cli("compare", tokens, study, "--fail-above", "5")
    assert code == 1 and "nothing was compared" in out and "gate passed" not in out
    code, out = run_cli("compare", study, study, "--fail-above", "5")
    assert code == 0 and "gate passed" in out and "setting(s) judged" in out


@pytest.mark.parametrize("args, message", [
    (("{a}", "{missing}"), "candidate {missing}: no such results folder"),
    (("{empty}", "{a}"), "not a results folder"),
    (("{a}", "{a}", "--metric", "step_ms"), "unknown metric 'step_ms'; did you mean"),
    (("{a}", "{a}", "--metric", "backend"), "a column of words, not numbers"),
    (("{a}", "{a}", "--metric", "test_acc"), "test_acc is empty"),
    (("{a}", "{a}", "--format", "xml"), "--format 'xml' is not allowed; choose one of: table, markdown, html, csv, json"),
    (("{a}", "{a}", "--sort", "size"), "--sort 'size' is not allowed; choose one of: name, ratio"),
    (("{a}", "{a}", "--ignore", "no_such_key"), "--ignore no_such_key: not a setting"),
    (("{a}", "{a}", "--fail-above", "-1"), "--fail-above -1: give a percentage"),
    (("{a}", "{a}", "--threshold", "150"), "--threshold 150: give a percentage"),
    (("{a}", "{a}", "--metric", "tokens_per_step", "--fail-above", "5"), "has no direction"),
])
def test_usage_errors_exit_2_with_one_clear_message(tmp_path, run_cli, args, message):
    where = {"a": _folder(tmp_path / "a", [dict(r, tokens_per_step=960) for r in _rows(BASE)]),
             "missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    where["empty"].mkdir()
    code, out = run_cli("compare", *(a.format(**where) for a in args))
    assert code == 2 and message.format(**where) in out and "Traceback" not in out


# -- real tiny sweeps ----------------------------------------------------------------------------
def _sweep_file(tmp: Path, name: str, *, base: str, rest: str) -> Path:
    """A sweep of the tiny model on the bundled sample; ``base`` adds settings, ``rest`` the grid."""
    path = tmp / f"{name}.yaml"
    path.write_text(f"# lora-bench sweep {name}.yaml\nname: {name}\nbase:\n  model_size: tiny\n  weights: random\n"
                    f"  device: cpu\n  data_file: {SAMPLE}\n  eval_freq: 0\n  skip_final_eval: true\n"
                    + textwrap.indent(textwrap.dedent(base), "  ") + textwrap.dedent(rest))
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread: the tiny model's CPU step is a few milliseconds of Python and small
    kernels, and threads fighting over two shared cores make it several times noisier."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sweep(run, path: Path, results: Path, cache: Path, *extra: str) -> None:
    code, out = run("sweep", path, "--results-dir", results, "--cache-dir", cache, "--isolation", "inline",
                    "--no-progress", *extra)
    assert code == 0, out


THROUGHPUTS = ("tokens_per_s", "achieved_tflops", "mfu")


def _copy_with_times(src: Path, dst: Path, *, row, steps) -> None:
    """A copy of a results folder whose times are rewritten through the project's readers and
    writers: ``row(col, value, row)`` for each cell of runs.csv and of each run's run.json row
    (which wins over runs.csv), ``steps(frame, row)`` for each run's steps.csv."""
    shutil.copytree(src, dst)
    table = read_run_table(dst / "runs.csv")
    write_csv(dst / "runs.csv", [{c: row(c, v, r) for c, v in r.items()} for r in table.rows], table.header)
    for record in dst.glob(f"*/{RUN_RECORD}"):
        doc = json.loads(record.read_text())
        doc["row"] = {c: row(c, v, doc["row"]) for c, v in doc["row"].items()}
        atomic_write_text(record, json.dumps(doc))
        frame = read_steps(record.parent)
        steps(frame, doc["row"])
        write_csv(record.parent / "steps.csv", frame.to_dict("records"), [c.name for c in STEP_COLUMNS])


def scale_times(src: Path, dst: Path, factor: float) -> None:
    """Every time (ms) multiplied by ``factor``, every throughput divided by it."""
    def row(col, v, _):
        if v in ("", None):
            return v
        if "_ms" in col:
            return float(v) * factor
        return float(v) / factor if col in THROUGHPUTS else v

    def steps(frame, _):
        for col in [c for c in frame.columns if c.endswith("_ms")]:
            frame[col] = frame[col] * factor

    _copy_with_times(src, dst, row=row, steps=steps)


def quieten(src: Path, dst: Path, by: float) -> None:
    """Each run's step times (and their p10 / p90) pulled ``by`` times closer to the run's own
    median: the harness's own series, its medians unchanged (the map is monotone), its scatter
    made small."""
    def towards(v, median):
        return median + (float(v) - median) / by

    def row(col, v, r):
        base = col.removesuffix("_p10").removesuffix("_p90")
        if col.startswith("step_ms_p") and v not in ("", None):
            return towards(v, float(r[f"{base}_median"]))
        return v

    def steps(frame, r):
        frame["step_ms"] = [towards(v, float(r["step_ms_median"])) for v in frame["step_ms"]]

    _copy_with_times(src, dst, row=row, steps=steps)


@pytest.mark.slow
def test_a_one_run_sweep_scaled_by_1_2_gets_no_verdict_and_the_gate_judges_nothing(tmp_path, run_cli, one_thread):
    """One run per setting: the intervals are over its measured steps (the copy's steps are the
    same steps, 1.2 × as long), which says nothing of the spread between processes: no verdict,
    and a gate over such settings only judged nothing and exits 1.

    On this shared machine the tiny model's CPU steps scatter by a factor of three, so the interval
    is checked on the same folder with each run's scatter pulled 20 times closer to its median
    (medians unchanged): it then lies above 1.10, and still gives no verdict."""
    path = _sweep_file(tmp_path, "scaled", base="""\
        num_epochs: 12
        max_steps: 50
        warmup_steps: 10
        trainable_layers: lora
        """, rest="""\
        grid:
          lora_rank: [4, 8]
        """)
    raw, raw_slow = tmp_path / "raw", tmp_path / "raw-slow"
    _sweep(run_cli, path, raw, tmp_path / "cache")
    scale_times(raw, raw_slow, 1.2)
    c = compare(raw, raw_slow, fail_above=0.10)
    assert all(r.ratio.value == pytest.approx(1.2) and r.verdict == stats.TOO_FEW and not r.fails for r in c.rows)
    assert c.problems == ["no setting on both sides has 5 repeats a side: the gate judged nothing"]

    base, slow = tmp_path / "base", tmp_path / "slow"
    quieten(raw, base, 20.0)
    scale_times(base, slow, 1.2)
    for record in base.glob(f"*/{RUN_RECORD}"):  # the quieter steps keep the median the run recorded
        steps = read_steps(record.parent)
        measured = steps.loc[~steps["warmup"].astype(bool), "step_ms"]
        assert measured.median() == pytest.approx(json.loads(record.read_text())["row"]["step_ms_median"])
    c = compare(base, slow, fail_above=0.10)
    assert [r.settings for r in c.rows] == [{"lora_rank": "4"}, {"lora_rank": "8"}]
    for r in c.rows:
        assert r.ratio.value == pytest.approx(1.2) and r.ratio.per_step and (r.baseline.n, r.candidate.n) == (1, 1)
        assert r.ratio.lo > 1.10 and r.verdict == stats.TOO_FEW and not r.fails, (r.ratio, r.verdict)
    code, out = run_cli("compare", base, slow, "--fail-above", "10")
    assert code == 1 and "the gate judged nothing" in out and stats.STEPS_MARK in out


@pytest.mark.slow
def test_two_sweeps_of_the_same_file_pass_the_gate_and_report_keeps_both(tmp_path, run_cli, one_thread):
    """Five repeats a setting, the two folders' repeats interleaved in time (shard k of one, then
    shard k of the other), so a drifting machine slows both alike: the noise widens the intervals
    (unclear passes) and no setting's whole interval lies 10 % above 1."""
    path = _sweep_file(tmp_path, "same", base="""\
        num_epochs: 1
        max_steps: 5
        warmup_steps: 1
        """, rest="""\
        grid:
          trainable_layers: [all, lora]
        repeats: 5
        vary_seed: true
        """)
    a, b = tmp_path / "a", tmp_path / "b"
    for k in range(1, 6):
        for folder in (a, b):
            _sweep(run_cli, path, folder, tmp_path / "cache", "--shard", f"{k}/5")
    c = compare(a, b, fail_above=0.10)
    assert [r.settings for r in c.rows] == [{"trainable_layers": "all"}, {"trainable_layers": "lora"}]
    assert all((r.baseline.n, r.candidate.n) == (5, 5) for r in c.rows)  # seeds vary: still five repeats
    assert not c.failed, [(r.settings, r.ratio) for r in c.rows]
    code, out = run_cli("compare", a, b, "--fail-above", "10")
    assert code == 0, out
    code, out = run_cli("report", a, b, "--pool", "--format", "json")  # the two folders read as one
    assert code == 0
    doc = json.loads(out[:out.rindex("}") + 1])  # then, on stderr, which folders it read
    assert sorted(g["n"] for g in doc["groups"]) == [10, 10]  # both folders' rows of the same run ids
    assert any("10 run id(s) appear in more than one folder" in n for n in doc["notes"])
