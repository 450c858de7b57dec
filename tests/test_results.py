"""Result files: concurrent writers of runs.csv (sweep shards sharing a folder)."""

from __future__ import annotations

import pandas as pd


def _upsert_many(args):
    from lora_bench.results.store import upsert_run

    path, worker = args
    for i in range(15):
        upsert_run(path, {"run_id": f"w{worker}-{i}", "status": "done"})


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
