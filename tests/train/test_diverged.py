"""A run whose loss is not finite (NaN or inf) is recorded as diverged, with the first step where
the loss was not finite, and says so wherever the run is shown: train's output, show, report and
a sweep's summary. Training goes on as the reference's does (no extra synchronisation to look)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from lora_bench.results.lookup import find_run
from paths import FIXTURES

SAMPLE = FIXTURES / "sms_spam_sample.tsv"
TINY = ["--model-size", "tiny", "--weights", "random", "--device", "cpu", "--no-progress", "--max-steps", "4",
        "--warmup-steps", "0", "--skip-final-eval", "--data-file", str(SAMPLE)]


def _first_bad_step(run_dir: Path) -> int:
    rows = list(csv.DictReader(open(run_dir / "steps.csv")))
    return next(int(r["step"]) for r in rows if not math.isfinite(float(r["loss"] or "nan")))


def test_a_run_whose_loss_is_not_finite_is_recorded_diverged(tmp_path, run_cli):
    code, out = run_cli("train", *TINY, "--eval-freq", "0", "--learning-rate", "1e30", "--results-dir", tmp_path,
                        "--run-id", "hot")
    assert code == 0 and "Traceback" not in out, out
    bad = _first_bad_step(tmp_path / "hot")
    row = find_run(tmp_path, "hot")
    assert row["status"] == "diverged" and row["diverged_at_step"] == bad, row
    assert f"not finite from step {bad}" in row["error"] and f"not finite from step {bad}" in out, out
    assert int(row["steps"]) == 4  # as the reference, training went on
    code, out = run_cli("train", *TINY, "--eval-freq", "0", "--results-dir", tmp_path, "--run-id", "calm")
    assert code == 0 and find_run(tmp_path, "calm")["status"] == "done", out

    code, out = run_cli("show", tmp_path, "hot")
    flat = " ".join(out.split())  # the message may wrap at the console's width
    assert code == 0 and "diverged" in out and f"step {bad}" in flat, out
    code, out = run_cli("report", tmp_path, "--format", "markdown")
    assert code == 0 and "1 diverged" in out and f"hot (from step {bad})" in out, out


def test_periodic_evaluation_sees_divergence_too(tmp_path, run_cli):
    """Step 0's evaluation follows step 0's update: with lr 1e30 its loss is the first not finite."""
    code, out = run_cli("train", *TINY, "--eval-freq", "1", "--eval-iter", "1", "--learning-rate", "1e30",
                        "--results-dir", tmp_path, "--run-id", "hot")
    assert code == 0, out
    row = find_run(tmp_path, "hot")
    assert row["status"] == "diverged" and row["diverged_at_step"] <= _first_bad_step(tmp_path / "hot")
    assert "Train loss nan" in out


def test_a_sweep_names_its_diverged_runs_and_does_not_rerun_them(tmp_path, run_cli):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"name: s\nbase: {{model_size: tiny, weights: random, device: cpu, data_file: {SAMPLE}, "
                     "max_steps: 3, warmup_steps: 0, eval_freq: 0, skip_final_eval: true}\n"
                     "grid: {learning_rate: [5.0e-5, 1.0e30]}\n")
    args = ("sweep", sweep, "--results-dir", tmp_path / "r", "--isolation", "inline", "--no-progress")
    code, out = run_cli(*args)
    assert code == 0, out
    assert "1 done" in out and "1 diverged" in out and "diverged" in out.split("sweep s:")[1], out
    code, out = run_cli(*args)  # resumed: a diverged run would diverge again
    assert code == 0 and "2 skipped" in out, out


@pytest.mark.slow
def test_a_sweep_whose_runs_all_diverge_exits_0_in_worker_processes(tmp_path, run_cli):
    """A diverged run is a measured result, not a failure: a sweep whose runs all diverge (each in
    its own worker process, the default isolation) records them so and exits 0."""
    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"name: s\nbase: {{model_size: tiny, weights: random, device: cpu, data_file: {SAMPLE}, "
                     "max_steps: 2, warmup_steps: 0, eval_freq: 0, skip_final_eval: true, learning_rate: 1.0e30}\n"
                     "grid: {seed: [1, 2]}\n")
    code, out = run_cli("sweep", sweep, "--results-dir", tmp_path / "r", "--isolation", "process", "--no-progress")
    assert code == 0, out
    summary = " ".join(out.split("sweep s:")[1].split())
    assert "0 done, 2 diverged, 0 failed" in summary, out
    rows = list(csv.DictReader(open(tmp_path / "r" / "runs.csv")))
    assert [r["status"] for r in rows] == ["diverged", "diverged"], rows
