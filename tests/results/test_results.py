"""Result files: concurrent writers of runs.csv (sweep shards sharing a folder)."""

from __future__ import annotations

import pandas as pd
import pytest


def _upsert_many(args):
    from lora_bench.results.store import upsert_run

    path, worker = args
    for i in range(15):
        upsert_run(path, {"run_id": f"w{worker}-{i}", "status": "done"})


@pytest.mark.slow
def test_concurrent_upserts_lose_no_row(tmp_path):
    """Sweep shards on several GPUs may share one results folder."""
    import multiprocessing as mp

    path = tmp_path / "runs.csv"
    with mp.get_context("spawn").Pool(4) as pool:
        pool.map(_upsert_many, [(path, w) for w in range(4)])
    df = pd.read_csv(path)
    assert len(df) == 60 and df["run_id"].is_unique


def test_atomic_writes_leave_ordinary_permissions(tmp_path):
    """mkstemp makes 0600 files; results and data files must be readable like any other file."""
    import os
    import stat

    from lora_bench.fileio import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
    finally:
        os.umask(old)


# Text a spreadsheet would run as a formula (OWASP's CSV-injection list, with the full-width forms),
# text that starts with the escape's own quote, and numbers, which must stay numbers.
HOSTILE_CELLS = ['=HYPERLINK("http://example.invalid","x")', "+1+1", "-2+3", "@SUM(A1:A2)", "\t=1", "\r=1",
                 "＝1+1", "'quoted", "''", "plain text", "-1.5", "+2", "1e-05", "-inf"]
FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "＝")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def test_runs_csv_cells_never_start_a_formula_and_read_back_unchanged(tmp_path):
    """The writer stores a formula-like text cell with a leading quote (a number as it is); the
    reader gives back exactly what was recorded, also after the table is rewritten row by row."""
    import csv

    from lora_bench.results.store import read_run_table, read_runs, upsert_run

    path = tmp_path / "runs.csv"
    for i, text in enumerate(HOSTILE_CELLS):
        upsert_run(path, {"run_id": f"r{i}", "status": "done", "sweep_label": text, "error": text,
                          "step_ms_median": -1.5})
    with open(path, newline="") as f:
        written = list(csv.reader(f))
    head = written[0]
    for rec in written[1:]:
        for name in ("sweep_label", "error"):
            cell = rec[head.index(name)]
            assert not cell.startswith(FORMULA_START) or _is_number(cell), (name, cell)
        assert rec[head.index("step_ms_median")] == "-1.5"
    by_id = {r["run_id"]: r for r in read_run_table(path).rows}
    assert [by_id[f"r{i}"]["sweep_label"] for i in range(len(HOSTILE_CELLS))] == HOSTILE_CELLS
    assert [by_id[f"r{i}"]["error"] for i in range(len(HOSTILE_CELLS))] == HOSTILE_CELLS
    df = read_runs(path)
    assert (df["step_ms_median"] == -1.5).all() and sorted(df["sweep_label"]) == sorted(HOSTILE_CELLS)


def test_a_carriage_return_inside_a_cell_keeps_its_row(tmp_path):
    """A lone carriage return in a value (an error message) is quoted: the row is neither cut in
    two nor lost when the table is rewritten."""
    from lora_bench.results.store import read_run_table, upsert_run

    path = tmp_path / "runs.csv"
    upsert_run(path, {"run_id": "a", "status": "failed", "error": "first\rsecond"})
    upsert_run(path, {"run_id": "b", "status": "failed", "error": "x\r\ny"})
    table = read_run_table(path)
    assert {r["run_id"]: r["error"] for r in table.rows} == {"a": "first\rsecond", "b": "x\r\ny"}
    assert not table.torn


def test_a_huge_or_foreign_runs_csv_is_refused_without_being_read_or_quoted(tmp_path, run_cli):
    import time

    path = tmp_path / "runs.csv"
    with open(path, "wb") as f:
        f.truncate(2 * 2**30)  # holes: no disk space
    t0 = time.monotonic()
    for args in (("show", tmp_path), ("report", tmp_path)):
        code, out = run_cli(*args)
        assert code == 2 and "2,147,483,648 bytes, more than the 1,073,741,824 a runs.csv may have" in out, out
    assert time.monotonic() - t0 < 10
    path.write_text("secret-" + "s" * 300 + ",b\n1,2\n")  # another program's file: its header is cut short
    code, out = run_cli("report", tmp_path)
    assert code == 2 and "has no run_id and status columns" in out and "s" * 30 not in out, out


def test_a_run_json_past_its_size_limit_is_not_read(tmp_path):
    """A run.json holds one row, its log and its curves (kilobytes): one larger than MAX_RECORD_BYTES,
    even valid JSON, is no record (it is not read into memory)."""
    import json

    from lora_bench.results.records import MAX_RECORD_BYTES, RUN_RECORD, run_record

    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    text = json.dumps({"row": {"run_id": "r1", "status": "done"}, "log": []})
    (run_dir / RUN_RECORD).write_text(text)
    assert run_record(run_dir)["status"] == "done"
    (run_dir / RUN_RECORD).write_text(text + " " * (MAX_RECORD_BYTES + 1 - len(text)))  # still valid JSON
    assert run_record(run_dir) is None
