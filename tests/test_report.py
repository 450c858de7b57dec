"""lora_bench.report.load / aggregate / tables and the ``report`` command on committed fixture
results (2 sizes × all / lora / lora-kernel × 3 repeats, one size with a single repeat, one failed
run): the table of groups against its expected file, the within-spread rule, merging by run id,
text metrics, why a metric is empty, and clear messages when there is nothing to report."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from lora_bench.errors import UsageError
from lora_bench.report.aggregate import build_report, default_keys, text_summary
from lora_bench.report.empty import why_empty
from lora_bench.report.load import MODE, load_results
from lora_bench.report.render_markdown import table_markdown
from lora_bench.report.tables import groups_table

FIXTURES = Path(__file__).parent / "fixtures" / "report"
STUDY = Path(__file__).parent / "fixtures" / "study"  # real rows: 124M and 1558M, two modes, two profiles


def test_groups_table_matches_the_expected_file():
    rep = build_report(load_results([FIXTURES]), baseline="trainable_layers=all")
    assert table_markdown(groups_table(rep)) == (FIXTURES / "expected.md").read_text()


def test_within_spread_rule_and_ratios():
    rep = build_report(load_results([FIXTURES]), baseline="trainable_layers=all")
    g = rep.groups.set_index(["cfg_model_size", "cfg_trainable_layers"])
    assert rep.keys == ["cfg_model_size", "cfg_trainable_layers"]  # data_file paths differ but are not a setting
    assert g.loc[("124M", "all"), "step_ms_median"] == pytest.approx(33.4)
    assert g.loc[("124M", "all"), "step_ms_median_iqr"] == pytest.approx(0.55)  # quartiles 33.2 and 33.75
    assert g.loc[("124M", "lora"), "ratio"] == pytest.approx(50.2 / 33.4)
    assert g.loc[("124M", "lora"), "within"] is False  # 16.8 ms apart, spreads ~0.5 ms
    assert g.loc[("124M", "lora-kernel"), "within"] is True  # 0.2 ms apart <= max IQR 0.6 ms
    assert g.loc[("1558M", "lora"), "ratio"] == pytest.approx(240.4 / 299.0)  # same-size baseline
    assert g.loc[("1558M", "lora-kernel"), "within"] is None  # one repeat: spread unknown
    assert bool(g.loc[("1558M", "all"), "is_baseline"])
    assert rep.excluded == {"failed": 1}


def test_group_by_metrics_and_csv(run_cli):
    code, out = run_cli("report", FIXTURES, "--group-by", "trainable_layers",
                        "--metrics", "backward_ms_median,step_ms_median", "--format", "csv")
    assert code == 0
    df = pd.read_csv(io.StringIO(out))
    assert list(df["trainable_layers"]) == ["all", "lora", "lora-kernel"]
    assert list(df.columns[:4]) == ["trainable_layers", "n", "backward_ms_median", "backward_ms_median_iqr"]
    assert list(df["n"]) == [6, 6, 4]


def test_terminal_report_and_plot(tmp_path, run_cli):
    png = tmp_path / "plots" / "report.png"
    code, out = run_cli("report", FIXTURES, "--plot", png)
    assert code == 0
    head = out[:out.index("Where the time goes")]  # the first screen: question, answer, crossover
    assert "Why are lora and lora-kernel faster or slower than all" in head
    assert "lora takes 1.50× all's step time at 124M and 0.80× at 1558M" in head
    assert "1.01× ≈" in head and "0.69× ?" in head  # within-spread and unknown-spread marks
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


def test_runs_merge_by_run_id_across_folders_and_run_json(tmp_path):
    a, b = tmp_path / "shard1", tmp_path / "shard2"
    shutil.copytree(FIXTURES, a)
    b.mkdir()
    rows = pd.read_csv(FIXTURES / "runs.csv", dtype=str, keep_default_na=False)
    # shard 2 finished the run shard 1 recorded as failed, and has one run only in its run.json
    fixed = rows[rows["status"] == "failed"].assign(status="done", error="", step_ms_median="250")
    fixed.to_csv(b / "runs.csv", index=False)
    extra = rows.iloc[0].to_dict() | {"run_id": "124M-all-extra-r3", "repeat": "3"}
    (b / extra["run_id"]).mkdir()
    (b / extra["run_id"] / "run.json").write_text(json.dumps({"row": extra, "log": []}))
    df = load_results([tmp_path])  # a folder of result folders
    assert df["run_id"].is_unique and len(df) == len(rows) + 1
    assert df.set_index("run_id").loc["1558M-lora-merged-fix999-r0", "status"] == "done"
    assert df.set_index("run_id").loc["124M-all-extra-r3", "run_dir"] == str(b / "124M-all-extra-r3")
    rep = build_report(df)
    assert rep.excluded == {} and ("1558M", "lora-merged") in set(
        zip(rep.groups["cfg_model_size"], rep.groups["cfg_trainable_layers"]))


def test_labels_lead_the_groups_only_where_they_split_runs():
    df = load_results([FIXTURES])
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
    df = load_results([FIXTURES])
    df["cfg_seed"] = [str(100 + int(r)) for r in df["repeat"]]
    assert "cfg_seed" not in default_keys(df[df["status"] == "done"])


def test_text_metrics_show_their_values(run_cli):
    code, out = run_cli("report", STUDY, "--metrics", "bound_forward,backend,step_ms_median", "--format", "csv")
    assert code == 0
    df = pd.read_csv(io.StringIO(out), keep_default_na=False)
    assert set(df["bound_forward"]) >= {"host", "device"}
    assert "cpp" in set(df["backend"]) and "fused" in set(df["backend"])  # runs recorded as "triton" read as fused
    code, out = run_cli("report", STUDY, "--metrics", "bound_forward", "--group-by", "model_size,trainable_layers")
    assert code == 0 and "host" in out and "device" in out
    assert text_summary(pd.Series(["host", "device", "host", ""])) == "host 2 · device 1"
    assert text_summary(pd.Series(["host", "host"])) == "host"


def test_an_empty_metric_says_why(run_cli, tmp_path):
    code, out = run_cli("report", STUDY, "--metrics", "test_acc", "--format", "markdown")
    assert code == 0 and "unknown metric" not in out
    assert "test_acc is empty: the runs skipped the final evaluation (skip_final_eval=True)" in out
    df = load_results([STUDY])
    off = df.assign(cfg_timing="off", bound_forward="")
    assert why_empty(off, "bound_forward") == "bound_forward is empty: phase timing was off (timing=off)"
    cpu = df.assign(device="cpu", bound_forward="", mfu=float("nan"))
    assert "the host clock is the only one" in why_empty(cpu, "bound_forward")
    assert "ran on the CPU" in why_empty(cpu, "mfu")
    code, out = run_cli("report", FIXTURES, "--metrics", "mfu")  # a schema column these results lack
    assert code == 0 and "mfu is empty: these results have no such column" in out


def test_nothing_to_report(tmp_path, run_cli):
    code, out = run_cli("report", tmp_path)
    assert code == 2 and "nothing to report" in out and "Traceback" not in out
    code, out = run_cli("report", tmp_path / "missing")
    assert code == 2 and "no such results folder" in out
    rows = pd.read_csv(FIXTURES / "runs.csv", dtype=str, keep_default_na=False)
    rows[rows["status"] == "failed"].to_csv(tmp_path / "runs.csv", index=False)
    code, out = run_cli("report", tmp_path)
    assert code == 2 and "none finished (1 failed)" in out


def test_bad_options_name_the_value_and_what_is_allowed(run_cli):
    df = load_results([FIXTURES])
    with pytest.raises(UsageError, match="did you mean 'trainable_layers'"):
        build_report(df, baseline="trainable_layer=all")
    with pytest.raises(UsageError, match="trainable_layers takes: all, lora, lora-kernel"):
        build_report(df, baseline="trainable_layers=everything")
    with pytest.raises(UsageError, match="unknown metric 'step_ms'"):
        build_report(df, metrics=["step_ms"])
    with pytest.raises(UsageError, match="key=value"):
        build_report(df, baseline="all")
    code, out = run_cli("report", FIXTURES, "--format", "pdf")
    assert code == 2 and "--format 'pdf' is not allowed; choose one of: table, markdown, csv, html" in out
