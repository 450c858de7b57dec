"""Hostile values through every output of report, compare, show and the results index: no raw
control or bidirectional character in an HTML or CSV report, a group-by key given twice, a setting
cell of thousands of digits, a run id of thousands of characters, a manifest whose description and
command line hold newlines, backticks, pipes, HTML and escape sequences."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lora_bench.results.store import read_run_table, write_csv
from paths import FIXTURES

RAW = ("\x1b", "\x07", "\u202e", "\x9b")
LABELS = ["\x1b]0;owned\x07title", "rtl \u202egnp.exe", "bell\x07", "\x9b2Jcsi"]


def _with(tmp_path: Path, name: str, change) -> Path:
    """The report fixture's runs with ``change(rows)`` applied, written by the project's writer."""
    table = read_run_table(FIXTURES / "report" / "runs.csv")
    rows = [dict(r) for r in table.rows]
    extra = change(rows) or []
    folder = tmp_path / name
    folder.mkdir()
    write_csv(folder / "runs.csv", rows, [*table.header, *extra])
    return folder


def _labelled(tmp_path: Path) -> Path:
    def label(rows):
        for i, r in enumerate(rows):
            r["sweep_label"] = LABELS[i % len(LABELS)]
        return ["sweep_label"]
    return _with(tmp_path, "labelled", label)


@pytest.mark.parametrize("fmt", ["html", "csv", "json"])
def test_html_csv_and_json_reports_send_no_control_or_bidi_character(fmt, tmp_path, run_cli):
    folder = _labelled(tmp_path)
    out_file = tmp_path / f"report.{fmt}"
    code, out = run_cli("report", folder, "--group-by", "model_size,label", "--format", fmt, "--output", out_file)
    assert code == 0, out
    text = out_file.read_text()
    assert not [c for c in RAW if c in text], [c for c in RAW if c in text]
    assert ("\\x1b" in text or "\\u001b" in text) and "\\u202e" in text  # shown, not sent
    if fmt == "json":  # escapes of JSON itself: the labels read back as they were given
        assert set(LABELS) <= set(_strings(json.loads(text)))


def _strings(v):
    if isinstance(v, dict):
        return [s for k, x in v.items() for s in (k, *_strings(x))]
    if isinstance(v, list):
        return [s for x in v for s in _strings(x)]
    return [v] if isinstance(v, str) else []


@pytest.mark.parametrize("keys", ["label,label", "sweep_label,label", "model_size,model_size"])
def test_a_group_by_key_given_twice_counts_once(keys, tmp_path, run_cli):
    folder = _labelled(tmp_path)
    code, out = run_cli("report", folder, "--group-by", keys, "--format", "csv")
    assert code == 0 and "Traceback" not in out, out
    head = out.splitlines()[0].split(",")
    assert len(head) == len(set(head)), head


def _long_setting(tmp_path: Path) -> Path:
    def change(rows):
        rows[0]["cfg_trainable_layers"] = "9" * 5000
    return _with(tmp_path, "long", change)


@pytest.mark.parametrize("fmt", ["table", "markdown", "html", "csv", "json"])
def test_a_setting_of_thousands_of_digits_is_cut_where_it_is_echoed(fmt, tmp_path, run_cli):
    folder = _long_setting(tmp_path)
    code, out = run_cli("report", folder, "--format", fmt)
    assert code == 0, out
    assert "9" * 300 not in out.replace("\n", "").replace("│", "")
    assert "(5,000 characters, #" in out.replace("\n", " ") or fmt == "table"


def test_compare_cuts_a_long_setting(tmp_path, run_cli):
    folder = _long_setting(tmp_path)
    code, out = run_cli("compare", FIXTURES / "report", folder)
    assert "Traceback" not in out, out
    assert "9" * 300 not in re.sub(r"\s|│", "", out)


def test_show_cuts_a_run_id_of_thousands_of_characters(tmp_path, run_cli):
    long_id = "r" * 5000

    def change(rows):
        rows[0]["run_id"] = long_id
    folder = _with(tmp_path, "ids", change)
    for args in (("show", folder, long_id), ("show", folder, "q" * 5000)):
        code, out = run_cli(*args)
        assert "Traceback" not in out, out
        assert len(out) < 20_000 and "r" * 300 not in re.sub(r"\s|│", "", out), len(out)


def test_the_index_escapes_descriptions_and_command_lines(tmp_path, run_cli):
    root = tmp_path / "root"
    folder = root / "res"
    folder.mkdir(parents=True)
    (folder / "runs.csv").write_bytes((FIXTURES / "report" / "runs.csv").read_bytes())
    hostile = "<script>alert(1)</script> \x1b[2J `tick` | pipe\n# injected heading\n| a | b |"
    entry = {"id": "x", "source": "recorded at launch", "command": "lora-bench train\n## cmd `x` | <b>y</b>\x1b]0;t\x07",
             "git_commit": "abc", "started_at": "2026-01-01T00:00:00+00:00", "run_ids": [], "outputs": []}
    (folder / "manifest.json").write_text(json.dumps({"description": hostile, "invocations": [entry]}))
    code, out = run_cli("results", "index", root)
    assert code == 0, out
    text = (root / "README.md").read_text()
    assert not [c for c in RAW if c in text]
    prose = re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", text)  # code spans show HTML as text
    assert "<script>" not in prose and "<b>" not in prose, prose
    lines = text.splitlines()
    assert not any(line.startswith(("# injected", "## cmd", "| a | b |")) for line in lines), text
    rows = [line for line in lines if line.startswith("| [`res/`]")]
    assert len(rows) == 1
    cells = re.split(r"(?<!\\)\|", rows[0].replace("\\`", ""))
    assert len(cells) == 9, rows[0]  # seven cells, no '|' of a value splitting the row


def test_a_report_name_past_the_file_systems_limit_is_one_message(tmp_path, run_cli):
    code, out = run_cli("report", FIXTURES / "report", "--format", "markdown", "--output",
                        tmp_path / ("report" + "x" * 300 + ".md"))
    assert code == 2 and "Traceback" not in out and "a file name has at most" in out, out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args", [("report", FIXTURES / "report", "--group-by", "k" * 5000),
                                  ("compare", FIXTURES / "report", FIXTURES / "report", "--metric", "m" * 5000)])
def test_an_option_value_of_thousands_of_characters_is_cut_in_the_message(args, run_cli):
    code, out = run_cli(*args)
    assert code == 2 and "Traceback" not in out, out
    assert "(5,0" in out and not re.search(r"[km]{300}", re.sub(r"\s", "", out)), out[:500]
