"""Finding results: ``report`` and ``compare`` read the results folders found at any depth below a
path (a folder holding runs.csv or run folders), each on its own unless ``--pool``, say which they
read, and keep only the runs ``--filter KEY=VALUE`` names."""

from __future__ import annotations

import io
import shutil

import pandas as pd
import pytest

from lora_bench.report.filters import filter_runs
from lora_bench.report.load import find_results_folders, load_results
from paths import FIXTURES, ROOT

REPORT_ROWS = FIXTURES / "report"


def _committed_folders() -> set:
    """Every committed results folder, found independently of the walk: a runs.csv's folder or the
    folder above a run.json, leaving out rows moved to superseded/."""
    held = {p.parent for p in (ROOT / "results").rglob("runs.csv")}
    held |= {p.parent.parent for p in (ROOT / "results").rglob("run.json")}
    return {p for p in held if "superseded" not in p.relative_to(ROOT / "results").parts}


def test_every_committed_results_folder_is_found_from_results():
    found = find_results_folders(ROOT / "results")
    assert found == sorted(found) and len(found) == len(set(found))
    assert set(found) == _committed_folders()
    assert len(found) > 30 and ROOT / "results" / "scaling" / "ddp-2gpu" / "w1" in found


@pytest.fixture
def tree(tmp_path):
    """a/ (runs), b/c/ (runs, two levels down), b/c/superseded/ (runs a newer run replaced),
    .hidden/ (runs), and a folder of notes without runs."""
    for rel in ("a", "b/c", "b/c/superseded", ".hidden"):
        shutil.copytree(REPORT_ROWS, tmp_path / rel)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("no runs here")
    return tmp_path


def test_folders_are_found_at_any_depth_past_superseded_and_hidden_ones(tree):
    assert find_results_folders(tree) == [tree / "a", tree / "b" / "c"]
    assert find_results_folders(tree / "b" / "c" / "superseded") == [tree / "b" / "c" / "superseded"]  # when named
    assert load_results([tree])["results_dir"].nunique() == 2


def test_report_reports_each_folder_on_its_own_and_says_which_it_read(run_cli, tree):
    code, out = run_cli("report", tree, "--format", "markdown")
    assert code == 0, out
    assert out.count("# Study report:") == 2
    assert f"*results folder {tree / 'a'}*" in out and f"*results folder {tree / 'b' / 'c'}*" in out
    said = " ".join(out.split())
    assert "reading 2 results folders, each on its own (--pool reads them as one)" in said
    assert "reports" in said and "2/2" in said  # the progress line over the folders, at its end
    assert "run id(s) appear in more than one folder" not in out  # nothing pooled
    code, table = run_cli("report", tree)
    assert code == 0 and table.count("Study report:") == 2


def test_report_pools_the_folders_when_told(run_cli, tree):
    code, out = run_cli("report", tree, "--pool", "--format", "csv")
    assert code == 0, out
    csv, said = out.split("reading ")  # the table on stdout, then what was read on stderr
    assert " ".join(said.split()).startswith("2 results folders as one:")
    one = pd.read_csv(REPORT_ROWS / "runs.csv")
    assert pd.read_csv(io.StringIO(csv))["n"].sum() == 2 * (one["status"] == "done").sum()


def test_one_file_holds_one_report(run_cli, tree, tmp_path):
    for args in (("--format", "html"), ("--format", "json"), ("--output", tmp_path / "r.md", "--format", "markdown"),
                 ("--plot", tmp_path / "r.png")):
        code, out = run_cli("report", tree, *args)
        assert code == 2 and "2 results folders found" in out and "--pool" in out and "Traceback" not in out, args
    assert not (tmp_path / "r.md").exists() and not (tmp_path / "r.png").exists()


def test_filter_keeps_the_runs_it_names(run_cli, tmp_path):
    df = load_results([REPORT_ROWS])
    kept = filter_runs(df, ["model_size=124M", "trainable_layers=lora"])
    assert len(kept) and set(kept["cfg_model_size"]) == {"124M"} and set(kept["cfg_trainable_layers"]) == {"lora"}
    assert len(kept) == ((df["cfg_model_size"] == "124M") & (df["cfg_trainable_layers"] == "lora")).sum()
    either = filter_runs(df, ["trainable_layers=lora", "trainable_layers=all"])  # one key twice: either value
    assert set(either["cfg_trainable_layers"]) == {"lora", "all"}
    assert filter_runs(df, None) is df
    code, out = run_cli("report", REPORT_ROWS, "--filter", "model_size=124M", "--format", "csv")
    assert code == 0 and pd.read_csv(io.StringIO(out))["n"].sum() == (kept_done := df[
        (df["cfg_model_size"] == "124M") & (df["status"] == "done")]).shape[0] and len(kept_done)


@pytest.mark.parametrize("item, says", [("model_size=999M", "no run matches --filter model_size=999M: "
                                                            "cfg_model_size holds 124M, 1558M"),
                                        ("modle_size=124M", "did you mean 'model_size'"),
                                        ("model_size", "give KEY=VALUE")])
def test_a_filter_that_keeps_nothing_or_names_nothing_is_a_usage_error(run_cli, item, says):
    code, out = run_cli("report", REPORT_ROWS, "--filter", item)
    assert code == 2 and says in " ".join(out.split()) and "Traceback" not in out


def test_compare_finds_folders_below_each_side_and_pools_only_when_told(run_cli, tree, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    shutil.copytree(REPORT_ROWS, other / "deep" / "down")
    code, out = run_cli("compare", tree, other)  # no folder at the same place below both sides
    assert code == 2 and "no results folder lies at the same place below" in out and "--pool" in out
    code, out = run_cli("compare", tree / "a", other, "--format", "csv")
    assert code == 0, out
    assert f"candidate: reading {other / 'deep' / 'down'}" in " ".join(out.split())
    code, out = run_cli("compare", tree, other, "--pool", "--filter", "model_size=124M", "--format", "csv")
    rows = pd.read_csv(io.StringIO(out[:out.index("baseline: reading")]))
    assert code in (0, 1) and len(rows) and "model_size" not in rows  # one size left: no column to tell them apart
    code, out = run_cli("compare", tree, other, "--pool", "--format", "csv")
    assert len(pd.read_csv(io.StringIO(out[:out.index("baseline: reading")]))) > len(rows)


def test_compare_sets_folders_at_the_same_place_side_by_side(run_cli, tree, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    for rel in ("a", "b/c", "only-here"):
        shutil.copytree(REPORT_ROWS, other / rel)
    code, out = run_cli("compare", tree, other, "--format", "markdown")
    said = " ".join(out.split())
    assert f"*{other / 'a'} against {tree / 'a'}*" in out and f"*{other / 'b' / 'c'} against {tree / 'b' / 'c'}*" in out
    assert all(f"{other / rel} against {tree / rel}: step" in said for rel in ("a", "b/c"))  # each pair's comparison
    assert "comparing 2 pair(s) of folders" in said
    assert f"incomplete: only in the candidate: {other / 'only-here'}" in said
    assert code == 1  # a folder on one side only leaves the comparison incomplete
    code, out = run_cli("compare", tree, other, "--allow-missing")
    assert code == 0, out
    code, out = run_cli("compare", tree, other, "--format", "json")
    assert code == 2 and "holds one comparison" in out
