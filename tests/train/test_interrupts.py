"""Every terminating signal during `lora-bench train` records the run as interrupted, with the
summary of the steps measured so far, says where the files are, and exits 128 + the signal
(130 for Ctrl-C); `show` displays such a run."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from paths import FIXTURES

SAMPLE = FIXTURES / "sms_spam_sample.tsv"
LONG = ["--model-size", "tiny", "--weights", "random", "--device", "cpu", "--no-progress", "--data-file", str(SAMPLE),
        "--num-epochs", "1000", "--warmup-steps", "1", "--eval-freq", "0", "--skip-final-eval"]
SIGNAL_AFTER_STEPS = 4


def _row(results: Path) -> dict:
    rows = list(csv.DictReader(open(results / "runs.csv")))
    assert len(rows) == 1
    return rows[0]


def _assert_recorded(results: Path, out: str, name: str) -> dict:
    row = _row(results)
    assert row["status"] == "interrupted" and row["error"] == f"interrupted by {name}", row
    assert int(row["measured_steps"]) >= 1 and float(row["step_ms_median"]) > 0  # the steps measured so far
    assert f"interrupted by {name}" in out and "recorded as interrupted" in out
    assert str(results / "runs.csv") in out and str(results / "r") in out  # where the files are
    steps = list(csv.DictReader(open(results / "r" / "steps.csv")))
    assert len(steps) == int(row["steps"]) >= SIGNAL_AFTER_STEPS - 1
    return row


def _signal_after_steps(monkeypatch, sig: signal.Signals) -> None:
    """`lora-bench train` in this process sends ``sig`` to itself after SIGNAL_AFTER_STEPS real steps."""
    import lora_bench.train.run as run_mod

    real = run_mod.train_classifier

    def loop(*args, on_step, **kw):
        seen = []

        def step(*a, **k):
            on_step(*a, **k)
            seen.append(1)
            if len(seen) == SIGNAL_AFTER_STEPS:
                os.kill(os.getpid(), sig)

        return real(*args, on_step=step, **kw)

    monkeypatch.setattr(run_mod, "train_classifier", loop)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_during_train_records_the_run(sig, tmp_path, monkeypatch, run_cli):
    """In-process: the training loop sends the signal to its own process after a few real steps."""
    if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
        pytest.skip("SIGHUP is ignored in this process (started under nohup), and a run keeps ignoring it")
    _signal_after_steps(monkeypatch, sig)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    code, out = run_cli("train", *LONG, "--results-dir", tmp_path, "--run-id", "r")
    assert code == 128 + sig, out
    assert "Traceback" not in out
    _assert_recorded(tmp_path, out, sig.name)
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored after the run
    code, out = run_cli("show", tmp_path, "r")
    assert code == 0 and "interrupted" in out and f"interrupted by {sig.name}" in out, out
    assert re.search(r"steps\s+measured\s+[1-9]", out), out  # the summary of the measured steps


def test_a_run_started_under_nohup_keeps_ignoring_sighup(tmp_path, monkeypatch, run_cli):
    """SIGHUP ignored when the run starts (nohup): the run installs no handler for it, a SIGHUP
    after a few steps changes nothing, and the run finishes."""
    _signal_after_steps(monkeypatch, signal.SIGHUP)
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        short = [a if a != "1000" else "2" for a in LONG]  # two epochs of the sample's batches
        code, out = run_cli("train", *short, "--results-dir", tmp_path, "--run-id", "r")
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN  # still ignored after the run
    finally:
        signal.signal(signal.SIGHUP, old)
    assert code == 0, out
    row = _row(tmp_path)
    assert row["status"] == "done" and int(row["steps"]) > SIGNAL_AFTER_STEPS, row


def test_ctrl_c_in_a_real_train_process_exits_130(tmp_path):
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "lora_bench", "train", *LONG, "--eval-freq", "2", "--eval-iter", "1",
                             "--results-dir", str(tmp_path), "--run-id", "r"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stdout:  # the periodic evaluation prints once steps have been measured
        lines.append(line)
        if "Step 000004" in line:
            break
    proc.send_signal(signal.SIGINT)
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out
    assert "Traceback" not in out
    row = _row(tmp_path)
    assert row["status"] == "interrupted" and row["error"] == "interrupted by SIGINT", row
    assert int(row["measured_steps"]) >= 1 and "recorded as interrupted" in out and str(tmp_path / "r") in out


def test_a_signal_while_the_finished_run_is_saved_waits_for_the_save(tmp_path, monkeypatch, run_cli):
    """SIGTERM as the finished run's first file is written: the record is saved whole (done), the
    process says so and then stops as the signal asks."""
    import lora_bench.fileio as fileio

    real, sent = fileio.publish, []

    def publish(tmp, dest):
        if Path(dest).name == "steps.csv" and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
        real(tmp, dest)

    monkeypatch.setattr(fileio, "publish", publish)
    short = [a for a in LONG if a not in ("--num-epochs", "1000")] + ["--max-steps", "3"]
    code, out = run_cli("train", *short, "--results-dir", tmp_path, "--run-id", "r")
    assert sent and code == 128 + signal.SIGTERM, out
    assert "Traceback" not in out and "SIGTERM came while the finished run was being saved" in out, out
    row = _row(tmp_path)
    assert row["status"] == "done" and int(row["steps"]) == 3
    assert len(list(csv.DictReader(open(tmp_path / "r" / "steps.csv")))) == 3
    assert json.loads((tmp_path / "r" / "run.json").read_text())["row"]["status"] == "done"
