"""lora_bench.report.load / aggregate / tables and the ``report`` command on committed fixture
results (2 sizes × all / lora / lora-kernel × 3 repeats, one size with a single repeat, one failed
run): the table of groups against its expected file, intervals and verdicts, a one-run group's
interval over its steps, rows of one run id kept per folder, text metrics, JSON and CSV output, why
a metric is empty, and clear messages when there is nothing to report."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from lora_bench.errors import UsageError
from lora_bench.report import stats
from lora_bench.report.aggregate import build_report, default_keys, text_summary
from lora_bench.report.empty import why_empty
from lora_bench.report.load import MODE, load_results
from lora_bench.report.render_markdown import table_markdown
from lora_bench.report.group_table import csv_cell, groups_table
from lora_bench.results.schema import STEP_COLUMNS
from lora_bench.results.store import write_csv
from paths import FIXTURES

REPORT_ROWS = FIXTURES / "report"
STUDY = FIXTURES / "study"  # real rows: 124M and 1558M, two modes, two profiles


def test_groups_table_matches_the_expected_file():
    rep = build_report(load_results([REPORT_ROWS]), baseline="trainable_layers=all")
    assert table_markdown(groups_table(rep)) == (REPORT_ROWS / "expected.md").read_text()


def test_intervals_verdicts_and_ratios():
    rep = build_report(load_results([REPORT_ROWS]), baseline="trainable_layers=all")
    g = rep.groups.set_index(["cfg_model_size", "cfg_trainable_layers"])
    assert rep.keys == ["cfg_model_size", "cfg_trainable_layers"]  # data_file paths differ but are not a setting
    assert g.loc[("124M", "all"), "step_ms_median"] == pytest.approx(33.4)
    # five repeats (33.0, 33.4, 34.1, 33.2, 33.8): the order-statistic interval is [min, max], 93.75 %
    assert (g.loc[("124M", "all"), "step_ms_median_lo"], g.loc[("124M", "all"), "step_ms_median_hi"]) == (
        pytest.approx(33.0), pytest.approx(34.1))
    assert g.loc[("124M", "all"), "step_ms_median_confidence"] == 0.9375
    assert g.loc[("124M", "all"), "step_ms_median_n"] == 5
    assert g.loc[("124M", "all"), "step_ms_median_over"] == stats.REPEATS
    # paired repeats: the median of the five per-repeat ratios
    assert g.loc[("124M", "lora"), "ratio"] == pytest.approx(50.2 / 33.4)
    assert g.loc[("124M", "lora"), "ratio_lo"] > 1.02 and g.loc[("124M", "lora"), "verdict"] == "slower"
    # 0.2 ms apart with repeats 1 ms wide, but each repeat's lora-kernel run 0.6-0.9 % above that
    # repeat's all: paired by repeat, the interval lies inside the ±2 % band: no difference
    lo, hi = g.loc[("124M", "lora-kernel"), ["ratio_lo", "ratio_hi"]]
    assert 1 <= lo <= hi < 1.02 and g.loc[("124M", "lora-kernel"), "verdict"] == "no difference"
    # the same values taken side by side: the interval spans 1.0 and leaves the band: unclear
    apart = stats.ratio_interval(stats.Sample.of([33.2, 33.6, 34.4, 33.45, 34.05]),
                                 stats.Sample.of([33.0, 33.4, 34.1, 33.2, 33.8]))
    assert apart.lo < 1 / 1.02 and apart.hi > 1.02 and stats.verdict(apart) == "unclear"
    assert g.loc[("1558M", "lora"), "ratio"] == pytest.approx(240.2 / 299.5)  # same-size baseline, paired
    assert g.loc[("1558M", "lora"), "verdict"] == "faster"
    # one repeat and no steps.csv: no interval, and too few repeats for a verdict
    one = g.loc[("1558M", "lora-kernel")]
    assert pd.isna(one["ratio_lo"]) and one["verdict"] == stats.TOO_FEW
    assert bool(g.loc[("1558M", "all"), "is_baseline"]) and g.loc[("1558M", "all"), "verdict"] == ""
    assert rep.excluded == {"failed": 1}
    # a wider threshold turns the clear slowdown's verdict only where its interval no longer clears it
    wide = build_report(load_results([REPORT_ROWS]), baseline="trainable_layers=all", threshold=0.6)
    assert set(wide.groups["verdict"]) <= {"", "no difference", "unclear", stats.TOO_FEW}


def _with_steps(tmp_path: Path) -> Path:
    """The fixture with a steps.csv for its one-run group (1558M lora-kernel: 25 measured steps
    around its recorded 205 ms median, after two warm-up steps)."""
    folder = tmp_path / "with-steps"
    shutil.copytree(REPORT_ROWS, folder)
    run = folder / "1558M-lora-kernel-fix016-r0"
    run.mkdir()
    ms = [900.0, 800.0, *(205.0 + 2.0 * ((i * 7) % 11 - 5) for i in range(25))]
    write_csv(run / "steps.csv", [{"run_id": run.name, "step": i, "warmup": i < 2, "step_ms": v}
                                  for i, v in enumerate(ms)], [c.name for c in STEP_COLUMNS])
    return folder


def test_a_one_run_group_gets_an_interval_over_its_steps_and_says_so(tmp_path, run_cli):
    folder = _with_steps(tmp_path)
    rep = build_report(load_results([folder]), baseline="trainable_layers=all")
    g = rep.groups.set_index(["cfg_model_size", "cfg_trainable_layers"]).loc[("1558M", "lora-kernel")]
    assert g["step_ms_median"] == 205.0 and g["step_ms_median_over"] == stats.STEPS
    assert 195 < g["step_ms_median_lo"] < 205 < g["step_ms_median_hi"] < 215  # warm-up steps left out
    # over one run's steps: an interval, but the spread between processes is unknown: no verdict
    assert g["ratio_over"] == stats.STEPS and g["ratio_hi"] < 1 / 1.02 and g["verdict"] == stats.TOO_FEW
    md = table_markdown(groups_table(rep))
    assert "205.0 \\[" in md and "\\]†" in md and f"†: {stats.STEPS_NOTE}" in md  # brackets escaped in Markdown
    for fmt, where in (("table", "†"), ("markdown", "†"), ("html", "†")):
        code, out = run_cli("report", folder, "--format", fmt)
        assert code == 0 and where in out and stats.STEPS_NOTE in out, fmt
    code, out = run_cli("report", folder, "--format", "json")
    doc = json.loads(out)
    one = next(x for x in doc["groups"] if x["settings"] == {"model_size": "1558M", "trainable_layers": "lora-kernel"})
    assert one["metrics"]["step_ms_median"]["interval_over"] == "steps" and one["ratio"]["interval_over"] == "steps"


def test_group_by_metrics_and_csv(run_cli):
    code, out = run_cli("report", REPORT_ROWS, "--group-by", "trainable_layers",
                        "--metrics", "backward_ms_median,step_ms_median", "--format", "csv")
    assert code == 0
    df = pd.read_csv(io.StringIO(out))
    assert list(df["trainable_layers"]) == ["all", "lora", "lora-kernel"]
    assert list(df.columns[:8]) == ["trainable_layers", "n", "backward_ms_median", "backward_ms_median_lo",
                                    "backward_ms_median_hi", "backward_ms_median_n", "backward_ms_median_confidence",
                                    "backward_ms_median_over"]
    assert list(df["n"]) == [10, 10, 6] and list(df["backward_ms_median_n"]) == [10, 10, 6]
    assert (df["backward_ms_median_lo"] <= df["backward_ms_median"]).all()
    assert (df["backward_ms_median"] <= df["backward_ms_median_hi"]).all()


def test_csv_and_json_carry_p10_p90_tokens_per_s_intervals_and_verdicts(tmp_path, run_cli):
    folder = tmp_path / "r"
    shutil.copytree(REPORT_ROWS, folder)
    rows = pd.read_csv(folder / "runs.csv", dtype=str, keep_default_na=False)
    step = pd.to_numeric(rows["step_ms_median"])
    rows = rows.assign(step_ms_p10=(step * 0.95).astype(str), step_ms_p90=(step * 1.1).astype(str),
                       tokens_per_s=(960 / step * 1e3).astype(str))
    rows.to_csv(folder / "runs.csv", index=False)
    code, out = run_cli("report", folder, "--format", "csv")
    assert code == 0
    df = pd.read_csv(io.StringIO(out), keep_default_na=False)
    for col in ("step_ms_median_lo", "step_ms_median_hi", "step_ms_p10", "step_ms_p90", "tokens_per_s",
                "tokens_per_s_lo", "tokens_per_s_hi", "ratio", "ratio_lo", "ratio_hi", "ratio_n", "ratio_confidence",
                "ratio_paired", "verdict"):
        assert col in df.columns, col
    lora = df[(df["model_size"] == "124M") & (df["trainable_layers"] == "lora")].iloc[0]
    assert lora["verdict"] == "slower" and float(lora["step_ms_p90"]) == pytest.approx(1.1 * 50.4)
    assert int(lora["ratio_n"]) == 5 and float(lora["ratio_confidence"]) == 0.9375 and str(lora["ratio_paired"]) == "True"
    code, out = run_cli("report", folder, "--format", "json")
    assert code == 0
    doc = json.loads(out)  # strict JSON: no NaN
    assert doc["statistic"]["target_confidence"] == 0.95 and doc["statistic"]["threshold"] == 0.02
    assert doc["statistic"]["min_repeats"] == 5
    assert doc["metric"] == "step_ms_median" and doc["baseline"] == {"trainable_layers": "all"}
    lora = next(x for x in doc["groups"] if x["settings"] == {"model_size": "124M", "trainable_layers": "lora"})
    m = lora["metrics"]["step_ms_median"]
    assert m["value"] == pytest.approx(50.4) and m["lo"] <= m["value"] <= m["hi"] and m["interval_over"] == "repeats"
    assert m["n"] == 5 and m["confidence"] == 0.9375 and m["confidence_at_least"] is False
    assert lora["verdict"] == "slower" and lora["ratio"]["lo"] > 1.02 and "tokens_per_s" in lora["metrics"]
    one = next(x for x in doc["groups"] if x["settings"] == {"model_size": "1558M", "trainable_layers": "lora-kernel"})
    assert one["ratio"]["lo"] is None and one["verdict"] == stats.TOO_FEW and one["ratio"]["n"] == 1
    assert any("not included" in n or "test_acc is empty" in n for n in doc["notes"])


def test_terminal_report_and_plot(tmp_path, run_cli):
    png = tmp_path / "plots" / "report.png"
    code, out = run_cli("report", REPORT_ROWS, "--plot", png)
    assert code == 0
    head = out[:out.index("Where the time goes")]  # the first screen: question, answer, crossover
    assert "Why are lora and lora-kernel faster or slower than all" in head
    assert ("lora takes 1.50× [1.50–1.52] (n = 5, 93.8 %) all's step time at 124M and 0.80× [0.80–0.81] "
            "(n = 5, 93.8 %) at 1558M") in head
    # the verdicts in the crossover: clear, no difference (paired repeats), and none for the one-run group
    assert "1.50× slower" in head and "1.01× no difference" in head and "0.68× too few repeats" in head
    assert "(no interval, n = 1)" in head and "the confidence they reach" in head
    assert "1 failed" in out
    for path in (png, tmp_path / "plots" / "report-phases.png"):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        assert f"wrote {path}" in out


def test_markdown_file_gets_its_figures_beside_it(tmp_path, run_cli):
    md = tmp_path / "out" / "report.md"
    code, _ = run_cli("report", STUDY, "--format", "markdown", "--output", md)
    assert code == 0
    text = md.read_text()
    assert text.index("## Answer") < text.index("## The crossover") < text.index("## Where the time goes")
    assert "![crossover](report-crossover.png)" in text and "![phases](report-phases.png)" in text
    assert (tmp_path / "out" / "report-crossover.png").is_file() and (tmp_path / "out" / "report-phases.png").is_file()


@pytest.mark.parametrize("args", [("--format", "csv", "--output", "runs.csv"),
                                  ("--format", "json", "--output", "manifest.json"),
                                  ("--format", "markdown", "--output", "prof-all/steps.csv"),
                                  ("--format", "markdown", "--output", "runs.csv.lock")])
def test_a_report_never_writes_over_a_results_file(tmp_path, run_cli, args):
    folder = tmp_path / "study"
    shutil.copytree(STUDY, folder)
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    args = [a if a.startswith("--") or a in ("csv", "json", "markdown") else folder / a for a in args]
    code, out = run_cli("report", folder, *args)
    assert code == 2 and "never writes over a results file" in out and "Traceback" not in out, out
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_rows_of_one_run_id_are_kept_per_folder_and_run_json_counts(tmp_path):
    a, b = tmp_path / "shard1", tmp_path / "shard2"
    shutil.copytree(REPORT_ROWS, a)
    b.mkdir()
    rows = pd.read_csv(REPORT_ROWS / "runs.csv", dtype=str, keep_default_na=False)
    # folder 2 finished the run folder 1 recorded as failed, and has one run only in its run.json
    fixed = rows[rows["status"] == "failed"].assign(status="done", error="", step_ms_median="250")
    fixed.to_csv(b / "runs.csv", index=False)
    extra = rows.iloc[0].to_dict() | {"run_id": "124M-all-extra-r3", "repeat": "3"}
    (b / extra["run_id"]).mkdir()
    (b / extra["run_id"] / "run.json").write_text(json.dumps({"row": extra, "log": []}))
    df = load_results([tmp_path])  # a folder of result folders
    assert len(df) == len(rows) + 2  # the failed row of folder 1 and the done row of folder 2 both stay
    merged = df[df["run_id"] == "1558M-lora-merged-fix999-r0"].set_index("results_dir")
    assert merged.loc[str(a), "status"] == "failed" and merged.loc[str(b), "status"] == "done"
    assert df.set_index("run_id").loc["124M-all-extra-r3", "run_dir"] == str(b / "124M-all-extra-r3")
    rep = build_report(df)
    assert rep.excluded == {"failed": 1} and ("1558M", "lora-merged") in set(
        zip(rep.groups["cfg_model_size"], rep.groups["cfg_trainable_layers"]))
    assert any("1 run id(s) appear in more than one folder" in n for n in rep.notes)


def test_a_report_names_its_folders_as_told_in_its_notes_too(tmp_path):
    """A report rendered from elsewhere (committed reports are checked from any root) names its
    input folders by the names it is given, in the shared-run-id note as in its title."""
    from rich.console import Console

    from lora_bench.report.report_command import report_command

    a, b = tmp_path / "shard1", tmp_path / "shard2"
    shutil.copytree(REPORT_ROWS, a)
    shutil.copytree(REPORT_ROWS, b)
    out = tmp_path / "report.md"
    report_command([a, b], group_by="model_size", baseline=None, metrics=None, fmt="markdown", output=out,
                   plot=None, console=Console(quiet=True), names=["results/x/shard1", "results/x/shard2"])
    text = out.read_text()
    assert "appear in more than one folder (results/x/shard1, results/x/shard2)" in text
    assert str(tmp_path) not in text


def test_one_folder_reached_twice_keeps_one_row_per_run_id(tmp_path):
    """Within one folder the precedence stays: a done row beats a failed one, else the later start."""
    folder = tmp_path / "r"
    shutil.copytree(REPORT_ROWS, folder)
    df = load_results([folder, folder / "runs.csv"])  # the same folder, named twice
    assert df["run_id"].is_unique and len(df) == len(pd.read_csv(REPORT_ROWS / "runs.csv"))
    assert build_report(df).notes == build_report(load_results([folder])).notes


def test_report_of_the_same_sweep_in_two_folders_keeps_both(tmp_path, run_cli):
    a, b = tmp_path / "machine-a", tmp_path / "machine-b"
    shutil.copytree(REPORT_ROWS, a)
    shutil.copytree(REPORT_ROWS, b)
    one = build_report(load_results([a]))
    both = build_report(load_results([a, b]))
    assert list(both.groups["n"]) == [2 * n for n in one.groups["n"]]  # every row of both folders counts
    code, out = run_cli("report", a, b, "--pool", "--format", "markdown")  # read as one set of runs
    assert code == 0 and "27 run id(s) appear in more than one folder" in out  # 26 done, 1 failed


def test_labels_lead_the_groups_only_where_they_split_runs():
    df = load_results([REPORT_ROWS])
    df["sweep_label"] = [f"row {i}" for i in range(len(df))]  # one label per run: it splits the repeats
    rep = build_report(df)
    assert rep.keys == ["sweep_label", "cfg_model_size", "cfg_trainable_layers"]
    labels = list(rep.groups["sweep_label"])
    assert labels[:3] == ["row 0", "row 1", "row 2"] and labels.index("row 2") < labels.index("row 10")
    assert "| label |" in table_markdown(groups_table(rep))
    study = load_results([STUDY])  # labels name settings (eager-fp32, …): the settings group, by mode name
    keys = default_keys(study[study["status"] == "done"])
    assert "sweep_label" not in keys and MODE in keys and "cfg_precision" not in keys


def test_seeds_that_vary_across_repeats_are_not_a_grouping_key():
    df = load_results([REPORT_ROWS])
    df["cfg_seed"] = [str(100 + int(r)) for r in df["repeat"]]
    assert "cfg_seed" not in default_keys(df[df["status"] == "done"])


def test_text_metrics_show_their_values(run_cli):
    code, out = run_cli("report", STUDY, "--metrics", "backend,step_ms_median", "--format", "csv")
    assert code == 0
    df = pd.read_csv(io.StringIO(out), keep_default_na=False)
    assert "cpp" in set(df["backend"]) and "fused" in set(df["backend"])  # runs recorded as "triton" read as fused
    code, out = run_cli("report", STUDY, "--metrics", "backend", "--group-by", "model_size")
    assert code == 0 and "cpp" in out and "fused" in out
    assert text_summary(pd.Series(["host", "device", "host", ""])) == "host 2 · device 1"
    assert text_summary(pd.Series(["host", "host"])) == "host"


def test_a_retired_column_is_refused_with_how_older_rows_read(run_cli):
    """bound_* (host ≈ device time) is in older rows but names no cause: report refuses it and says why."""
    code, out = run_cli("report", STUDY, "--metrics", "bound_forward")
    assert code == 2 and "bound_forward is no longer written" in out and "busy fraction" in out
    code, out = run_cli("report", STUDY, "--group-by", "bound_backward")
    assert code == 2 and "no longer written" in out


def test_an_empty_metric_says_why(run_cli, tmp_path):
    code, out = run_cli("report", STUDY, "--metrics", "test_acc", "--format", "markdown")
    assert code == 0 and "unknown metric" not in out
    assert "test_acc is empty: the runs skipped the final evaluation (skip_final_eval=True)" in out
    df = load_results([STUDY])
    off = df.assign(cfg_timing="off", host_forward_ms_median="")
    assert why_empty(off, "host_forward_ms_median") == "host_forward_ms_median is empty: phase timing was off (timing=off)"
    cpu = df.assign(device="cpu", mfu=float("nan"))
    assert "ran on the CPU" in why_empty(cpu, "mfu")
    code, out = run_cli("report", REPORT_ROWS, "--metrics", "mfu")  # a schema column these results lack
    assert code == 0 and "mfu is empty: these results have no such column" in out


def test_nothing_to_report(tmp_path, run_cli):
    code, out = run_cli("report", tmp_path)
    assert code == 2 and "nothing to report" in out and "Traceback" not in out
    code, out = run_cli("report", tmp_path / "missing")
    assert code == 2 and "no such results folder" in out
    rows = pd.read_csv(REPORT_ROWS / "runs.csv", dtype=str, keep_default_na=False)
    rows[rows["status"] == "failed"].to_csv(tmp_path / "runs.csv", index=False)
    code, out = run_cli("report", tmp_path)
    assert code == 2 and "none finished (1 failed)" in out


def test_bad_options_name_the_value_and_what_is_allowed(run_cli):
    df = load_results([REPORT_ROWS])
    with pytest.raises(UsageError, match="did you mean 'trainable_layers'"):
        build_report(df, baseline="trainable_layer=all")
    with pytest.raises(UsageError, match="trainable_layers takes: all, lora, lora-kernel"):
        build_report(df, baseline="trainable_layers=everything")
    with pytest.raises(UsageError, match="unknown metric 'step_ms'"):
        build_report(df, metrics=["step_ms"])
    with pytest.raises(UsageError, match="key=value"):
        build_report(df, baseline="all")
    code, out = run_cli("report", REPORT_ROWS, "--format", "pdf")
    assert code == 2 and "--format 'pdf' is not allowed; choose one of: table, markdown, csv, html" in out


def test_cells_reach_csv_and_terminal_as_written(tmp_path, run_cli):
    """A label from a results file is data: not a spreadsheet formula, not rich markup."""
    assert csv_cell("=HYPERLINK(1)") == "'=HYPERLINK(1)" and csv_cell("@x") == "'@x"
    assert csv_cell("-100") == "-100" and csv_cell("-") == "-" and csv_cell("lora") == "lora"
    folder = tmp_path / "r"
    shutil.copytree(REPORT_ROWS, folder)
    rows = pd.read_csv(folder / "runs.csv", dtype=str, keep_default_na=False)
    rows.assign(sweep_label=[f"[bold]row {i}[/bold]" if i % 2 else f"=cmd{i}" for i in range(len(rows))]).to_csv(
        folder / "runs.csv", index=False)
    code, out = run_cli("report", folder, "--group-by", "label")
    assert code == 0 and "[bold]row 1[/bold]" in out
    code, out = run_cli("report", folder, "--group-by", "label", "--format", "csv")
    df = pd.read_csv(io.StringIO(out), keep_default_na=False)
    assert code == 0 and "'=cmd0" in set(df["label"])


def test_a_setting_added_after_some_rows_reads_as_its_default_in_them(tmp_path):
    """Rows written before ``base_dtype`` existed leave it blank; beside rows that set it to its
    default they group as one setting (the same behaviour), while a row that sets another value
    stays apart; a setting blank in every row stays blank."""
    import csv
    rows = list(csv.DictReader((REPORT_ROWS / "runs.csv").open()))
    assert rows and "cfg_base_dtype" not in rows[0]  # the fixture's rows are older than the setting
    header = [*rows[0].keys(), "cfg_base_dtype"]
    newer = [dict(r, run_id=r["run_id"] + "-new", cfg_base_dtype="precision", repeat=str(int(r["repeat"] or 0) + 10))
             for r in rows]
    other = [dict(rows[0], run_id="quantized", cfg_base_dtype="int8")]
    with (tmp_path / "runs.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows([*rows, *newer, *other])
    df = load_results([tmp_path])
    assert set(df["cfg_base_dtype"]) == {"precision", "int8"}
    assert (df.loc[df["run_id"].isin([r["run_id"] for r in rows]), "cfg_base_dtype"] == "precision").all()
    assert "cfg_base_dtype" in default_keys(df)
    alone = load_results([REPORT_ROWS])
    assert "cfg_base_dtype" not in alone or alone["cfg_base_dtype"].map(lambda v: v in ("", None) or pd.isna(v)).all()
