"""lora_bench.report.aggregate / lora_bench.report.plots: from committed fixture results (2 sizes × all / lora /
lora-kernel × 3 repeats, one size with a single repeat, one failed run) — the Markdown table
against its expected file, the within-spread rule, merging by run id, plots, and clear messages
when there is nothing to report."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from lora_bench.errors import UsageError
from lora_bench.report.aggregate import build_report, load_results, to_markdown

FIXTURES = Path(__file__).parent / "fixtures" / "report"




def test_markdown_matches_the_expected_file(monkeypatch, capsys, run_cli):
    code, out = run_cli("report", FIXTURES, "--baseline", "trainable_layers=all",
                        "--format", "markdown")
    assert code == 0
    assert out == (FIXTURES / "expected.md").read_text()


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


def test_group_by_metrics_and_csv(monkeypatch, capsys, run_cli):
    code, out = run_cli("report", FIXTURES, "--group-by", "trainable_layers",
                        "--metrics", "backward_ms_median,step_ms_median", "--format", "csv")
    assert code == 0
    df = pd.read_csv(io.StringIO(out))
    assert list(df["trainable_layers"]) == ["all", "lora", "lora-kernel"]
    assert list(df.columns[:4]) == ["trainable_layers", "n", "backward_ms_median", "backward_ms_median_iqr"]
    assert list(df["n"]) == [6, 6, 4]


def test_rich_table_and_plot(tmp_path, monkeypatch, capsys, run_cli):
    png = tmp_path / "plots" / "report.png"
    code, out = run_cli("report", FIXTURES, "--baseline", "trainable_layers=all",
                        "--plot", png)
    assert code == 0 and "1.01× ≈" in out and "1 failed" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


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
    rep = build_report(df)
    assert rep.excluded == {} and ("1558M", "lora-merged") in set(
        zip(rep.groups["cfg_model_size"], rep.groups["cfg_trainable_layers"]))


def test_labels_group_by_default():
    df = load_results([FIXTURES])
    df["sweep_label"] = [f"row {i}" for i in range(len(df))]
    rep = build_report(df)
    assert rep.keys == ["sweep_label"]
    assert list(rep.groups["sweep_label"][:3]) == ["row 0", "row 1", "row 2"]  # natural order: 2 before 10
    assert list(rep.groups["sweep_label"]).index("row 2") < list(rep.groups["sweep_label"]).index("row 10")
    assert "| label |" in to_markdown(rep)


def test_nothing_to_report(tmp_path, monkeypatch, capsys, run_cli):
    code, out = run_cli("report", tmp_path)
    assert code == 2 and "nothing to report" in out and "Traceback" not in out
    code, out = run_cli("report", tmp_path / "missing")
    assert code == 2 and "no such results folder" in out
    rows = pd.read_csv(FIXTURES / "runs.csv", dtype=str, keep_default_na=False)
    rows[rows["status"] == "failed"].to_csv(tmp_path / "runs.csv", index=False)
    code, out = run_cli("report", tmp_path)
    assert code == 2 and "none finished (1 failed)" in out


def test_bad_options_name_the_value_and_what_is_allowed():
    df = load_results([FIXTURES])
    with pytest.raises(UsageError, match="did you mean 'trainable_layers'"):
        build_report(df, baseline="trainable_layer=all")
    with pytest.raises(UsageError, match="trainable_layers takes: all, lora, lora-kernel"):
        build_report(df, baseline="trainable_layers=everything")
    with pytest.raises(UsageError, match="unknown metric 'step_ms'"):
        build_report(df, metrics=["step_ms"])
    with pytest.raises(UsageError, match="key=value"):
        build_report(df, baseline="all")
