"""lora_bench.sweep.dask_runner on a local Dask cluster of two CPU worker processes: every planned run is
recorded once, by the client; a worker killed mid-run leaves that run failed (its child dies with
it) while the others finish; SIGINT stops the running runs as interrupted, starts no more, and a
resume runs only what is missing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("distributed")
psutil = pytest.importorskip("psutil")

from rich.console import Console  # noqa: E402
from tiny import TINY_BASE, UNTIL_SIGNAL

from lora_bench.errors import UsageError  # noqa: E402
from lora_bench.sweep.dask_runner import local_workers, run_sweep_dask, start_local_cluster  # noqa: E402
from lora_bench.sweep.spec import load_sweep  # noqa: E402

TINY = TINY_BASE


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def rows(results: Path) -> pd.DataFrame:
    return pd.read_csv(results / "runs.csv", dtype=str, keep_default_na=False)


def run_child(run_id: str, timeout: float = 90, *, client: subprocess.Popen | None = None) -> psutil.Process:
    """The running child process (``python -m lora_bench.sweep.child .../<run_id>/job.json``) of a run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert client is None or client.poll() is None, client.communicate()[0]
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "lora_bench.sweep.child" in cmd and cmd[-1].endswith(f"{run_id}/job.json"):
                return p
        time.sleep(0.2)
    raise AssertionError(f"no child process for {run_id}")


@pytest.fixture(scope="module")
def cluster():
    """One local cluster (two single-threaded CPU workers) shared by the tests that use --scheduler."""
    c = start_local_cluster(local_workers(2, 0))
    yield c
    c.close()


@pytest.mark.slow
def test_two_workers_record_every_run_once_and_resume_skips_them(tmp_path):
    path = write(tmp_path, "name: d\nbase:\n" + TINY + "grid:\n  trainable_layers: [all, lora]\nrepeats: 2\n")
    sw = load_sweep(path)
    results = tmp_path / "res"
    result = run_sweep_dask(sw, results_dir=results, console=Console(), workers=2, cache_dir=tmp_path / "cache",
                            progress=False)
    df = rows(results)
    assert len(df) == len(sw.runs) == 4 and df["run_id"].is_unique
    assert set(df["run_id"]) == {r.run_id for r in sw.runs} and set(df["status"]) == {"done"}
    assert result.count("done") == 4 and result.exit_code == 0
    for run in sw.runs:  # the run's own files came back with its row
        folder = results / run.run_id
        assert {"run.json", "steps.csv", "worker.log", "job.json"} <= {p.name for p in folder.iterdir()}
        assert len(pd.read_csv(folder / "steps.csv")) == 2
    assert set(df["sweep_name"]) == {"d"} and sorted(df["repeat"]) == ["0", "0", "1", "1"]
    again = run_sweep_dask(sw, results_dir=results, console=Console(), workers=2, progress=False)
    assert again.skipped == 4 and again.rows == [] and len(rows(results)) == 4


@pytest.mark.slow
def test_a_killed_worker_fails_its_run_and_the_others_finish(tmp_path, cluster):
    path = write(tmp_path, "name: k\nbase:\n" + TINY + textwrap.dedent(f"""\
        runs:
          - {{label: slow, {UNTIL_SIGNAL}}}
          - {{label: a}}
          - {{label: b, seed: 7}}
        """))
    sw = load_sweep(path)
    slow = next(r.run_id for r in sw.runs if r.label == "slow")
    killed = {}

    def kill_the_slow_runs_worker():
        child = run_child(slow)
        time.sleep(1.0)
        killed["child"] = child
        killed["worker"] = child.ppid()
        os.kill(child.ppid(), signal.SIGKILL)  # the Dask worker process, not the run's child

    t = threading.Thread(target=kill_the_slow_runs_worker, daemon=True)
    t.start()
    results = tmp_path / "res"
    result = run_sweep_dask(sw, results_dir=results, console=Console(), scheduler=cluster.scheduler_address,
                            cache_dir=tmp_path / "cache", progress=False)
    t.join(timeout=5)
    status = dict(zip(rows(results)["sweep_label"], rows(results)["status"]))
    assert status == {"slow": "failed", "a": "done", "b": "done"}
    error = rows(results).set_index("sweep_label").loc["slow", "error"]
    assert "Dask worker running this run died" in error and "KilledWorker" in error
    assert result.exit_code == 1
    killed["child"].wait(timeout=10)  # the orphaned run died with its worker (no psutil.TimeoutExpired)


@pytest.mark.slow
def test_sigint_stops_running_runs_and_resume_runs_only_the_missing(tmp_path, cluster, monkeypatch):
    path = write(tmp_path, "name: i\nbase:\n" + TINY + textwrap.dedent(f"""\
        runs:
          - {{label: quick}}
          - {{label: slow1, {UNTIL_SIGNAL}}}
          - {{label: slow2, {UNTIL_SIGNAL}, seed: 5}}
          - {{label: after, seed: 7}}
        """))
    sw = load_sweep(path)
    ids = {r.label: r.run_id for r in sw.runs}
    results = tmp_path / "res"
    cluster_client_code = (
        "import sys; from pathlib import Path; from rich.console import Console;"
        "from lora_bench.sweep.spec import load_sweep; from lora_bench.sweep.dask_runner import run_sweep_dask;"
        f"r = run_sweep_dask(load_sweep(Path({str(path)!r})), results_dir=Path({str(results)!r}), console=Console(),"
        f" scheduler={cluster.scheduler_address!r}, cache_dir=Path({str(tmp_path / 'cache')!r}), progress=False);"
        "sys.exit(r.exit_code)")
    proc = subprocess.Popen([sys.executable, "-c", cluster_client_code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    run_child(ids["slow1"], timeout=120, client=proc)
    run_child(ids["slow2"], timeout=120, client=proc)  # both workers busy; 'after' waits in the queue
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out
    df = rows(results)
    assert df["run_id"].is_unique
    assert dict(zip(df["sweep_label"], df["status"])) == {"quick": "done", "slow1": "interrupted",
                                                          "slow2": "interrupted"}  # 'after' never started

    import lora_bench.sweep.runner as runner_mod
    import lora_bench.train.run as train_run

    calls, real = [], train_run.execute

    def short(points, **kw):  # rerun for real, but a few steps only (the id stays the sweep's)
        calls.extend(p.run_id for p in points)
        return real([replace(p, cfg=p.cfg.replace(max_steps=2)) for p in points], **kw)

    monkeypatch.setattr(train_run, "execute", short)  # the name the inline runner calls
    again = runner_mod.run_sweep(sw, results_dir=results, console=Console(), isolation="inline", progress=False,
                      cache_dir=tmp_path / "cache")
    assert calls == [ids["slow1"], ids["slow2"], ids["after"]] and again.skipped == 1
    df = rows(results)
    assert len(df) == 4 and df["run_id"].is_unique and set(df["status"]) == {"done"}


def test_usage_errors():
    with pytest.raises(UsageError, match="--workers 0"):
        local_workers(0, 2)
    envs = local_workers(3, 2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "0"]
    assert all(e["NCCL_NVLS_ENABLE"] == "0" and e["NVSHMEM_DISABLE_NVLS"] == "1" for e in envs)
    assert [e.get("CUDA_VISIBLE_DEVICES") for e in local_workers(None, 2)] == ["0", "1"]
    assert "CUDA_VISIBLE_DEVICES" not in local_workers(2, 0)[0]


def test_workers_with_a_scheduler_is_refused_before_anything_is_written(tmp_path):
    sweep = load_sweep(write(tmp_path, "name: x\nbase:\n" + TINY_BASE))
    with pytest.raises(UsageError, match="exclude each other"):
        run_sweep_dask(sweep, results_dir=tmp_path / "r", console=Console(quiet=True), workers=2,
                       scheduler="tcp://127.0.0.1:9")
    assert not (tmp_path / "r").exists()
