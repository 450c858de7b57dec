"""``lora-bench results export`` round trips: a results folder written by a real (tiny) sweep run,
exported to a real local MLflow store and real TensorBoard event files, read back with MLflow's
client and TensorBoard's EventAccumulator; the parameters, metric histories (values and steps) and
tags are the run's own, read from its steps.csv, run.json and row."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from lora_bench.results.records import rewrite_row
from tests.paths import ROOT, SAMPLE

mlflow_tracking = pytest.importorskip("mlflow.tracking", reason="the trackers extra is not installed")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="the trackers extra is not installed")
# what a sweep label may hold (printable text), aimed at SQL, HTML, Markdown, the shell and CSV
HOSTILE = "x'; DROP TABLE runs; -- </td><script>alert(1)</script> | *b* `$(id)` \"q\" \\ =1+1 ✓"
PHASE_COLUMNS = [f"{host}{p}_ms" for host in ("", "host_")
                 for p in ("data", "forward", "backward", "optimizer", "step")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A results folder holding one finished run of a tiny sweep whose run has a hostile label."""
    where = tmp_path_factory.mktemp("export")
    sweep = where / "tiny.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "tiny", "runs": [{"label": HOSTILE}],
        "base": {"model_size": "tiny", "weights": "random", "device": "cpu", "data_file": str(SAMPLE),
                 "max_steps": 4, "warmup_steps": 1, "eval_freq": 2, "eval_iter": 1}}))
    results = where / "results"
    out = subprocess.run([sys.executable, "-m", "lora_bench", "sweep", str(sweep), "--results-dir", str(results),
                          "--isolation", "inline", "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return results


def _run(folder):
    """The run's row, steps (as text) and run.json, read with the standard library."""
    (run_dir,) = [p.parent for p in folder.glob("*/run.json")]
    record = json.loads((run_dir / "run.json").read_text())
    with open(run_dir / "steps.csv", newline="") as f:
        steps = list(csv.DictReader(f))
    return record["row"], steps, record


def _expected_histories(row, steps, record) -> dict[str, list[tuple[int, float]]]:
    out = {f"step/{c}": [(int(s["step"]), float(s[c])) for s in steps] for c in ["loss", *PHASE_COLUMNS]}
    every = row["cfg_eval_freq"]
    out["eval/train_loss"] = [(i * every, v) for i, v in enumerate(record["train_losses"])]
    out["eval/val_loss"] = [(i * every, v) for i, v in enumerate(record["val_losses"])]
    last = row["steps"] - 1
    out["eval/train_acc"] = [(last, 100 * record["train_accs"][0])]  # one epoch, ending at the last step
    out["eval/val_acc"] = [(last, 100 * record["val_accs"][0])]
    for name in ("train_acc", "val_acc", "test_acc", "step_ms_median", "host_forward_ms_median", "tokens_per_s"):
        out[f"run/{name}"] = [(last, row[name])]
    return out


def _params(row) -> dict[str, str]:
    return {k[len("cfg_"):]: "" if v is None else str(v) for k, v in row.items() if k.startswith("cfg_")}


@pytest.mark.slow
def test_mlflow_round_trip(folder, tmp_path, run_cli):
    copy = shutil.copytree(folder, tmp_path / "results")
    code, out = run_cli("results", "export", "--to", "mlflow", copy)
    assert code == 0, out
    row, steps, record = _run(copy)
    assert f"written: {row['run_id']}" in out
    client = mlflow_tracking.MlflowClient(tracking_uri=f"sqlite:///{copy / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("results")  # named after the folder
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.params == _params(row)
    tags = run.data.tags
    assert tags["lora_bench.run_id"] == row["run_id"] and tags["lora_bench.status"] == "done"
    assert tags["lora_bench.sweep_label"] == HOSTILE
    assert tags["lora_bench.git_commit"] == row["git_commit"]
    assert tags["lora_bench.torch_version"] == row["torch_version"]
    assert tags["lora_bench.command"].startswith("lora-bench sweep ")
    assert run.info.status == "FINISHED" and run.info.run_name == row["run_id"]
    for name, expected in _expected_histories(row, steps, record).items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert history == expected, name
    (artifact,) = client.list_artifacts(run.info.run_id)
    assert artifact.path == "run.json"
    fetched = client.download_artifacts(run.info.run_id, "run.json", str(tmp_path))
    assert open(fetched, "rb").read() == (copy / row["run_id"] / "run.json").read_bytes()


@pytest.mark.slow
def test_tensorboard_round_trip(folder, tmp_path, run_cli):
    from tensorboard.plugins.hparams import plugin_data_pb2

    code, out = run_cli("results", "export", "--to", "tensorboard", folder, "--output", tmp_path / "tb")
    assert code == 0, out
    row, steps, record = _run(folder)
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb" / row["run_id"]),
                                                size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    for name, expected in _expected_histories(row, steps, record).items():
        # TensorBoard keeps a scalar as a 32-bit float
        assert [(e.step, e.value) for e in events.Scalars(name)] == [(s, float(np.float32(v))) for s, v in expected]
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert {k: v.string_value for k, v in hparams.items()} == _params(row)

    def text(tag: str) -> str:
        return events.Tensors(tag)[0].tensor_proto.string_val[0].decode()

    assert text("lora_bench.sweep_label") == HOSTILE
    assert text("lora_bench.run_id") == row["run_id"] and text("lora_bench.git_commit") == row["git_commit"]


@pytest.mark.slow
def test_a_second_export_skips_an_unchanged_run_and_replaces_a_recorded_one(folder, tmp_path, run_cli):
    from lora_bench.trackers.export import log_folder, log_run

    copy = shutil.copytree(folder, tmp_path / "results")
    row, steps, _ = _run(copy)
    for to in ("mlflow", "tensorboard"):
        assert run_cli("results", "export", "--to", to, copy)[0] == 0
        code, out = run_cli("results", "export", "--to", to, copy)
        assert code == 0 and f"unchanged: {row['run_id']}" in out, out
    rewrite_row(copy / row["run_id"], {**row, "sweep_label": "relabelled"})  # the run recorded again
    said: list[str] = []
    log_run(copy, row["run_id"], to="mlflow", say=said.append)
    assert said == [f"mlflow: {row['run_id']} replaced"]
    log_folder(copy, to="tensorboard", say=said.append)
    assert said[1:] == [f"tensorboard: {row['run_id']} replaced"]

    client = mlflow_tracking.MlflowClient(tracking_uri=f"sqlite:///{copy / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("results").experiment_id])
    assert run.data.tags["lora_bench.sweep_label"] == "relabelled"
    assert len(client.get_metric_history(run.info.run_id, "step/loss")) == len(steps)
    logdir = copy / "tensorboard" / row["run_id"]
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    events = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert len(events.Scalars("step/loss")) == len(steps)


def test_a_folder_without_runs_is_one_line_and_exit_2(tmp_path, run_cli):
    for to in ("mlflow", "tensorboard"):
        code, out = run_cli("results", "export", "--to", to, tmp_path)
        assert code == 2, out
        assert out.strip() == (f"error: {tmp_path} holds no runs (no rows in runs.csv, no <run_id>/run.json): "
                               "nothing to export")
    assert list(tmp_path.iterdir()) == []  # no store or event folder made for nothing
    code, out = run_cli("results", "export", "--to", "wandb", tmp_path)
    assert code == 2 and "choose one of: mlflow, tensorboard" in out


@pytest.mark.parametrize("to, package", [("mlflow", "mlflow"), ("mlflow", "sqlalchemy"),
                                         ("tensorboard", "tensorboard")])
def test_without_the_extra_the_command_says_what_installs_it(to, package, tmp_path, run_cli, hide_package):
    hide_package(package)
    code, out = run_cli("results", "export", "--to", to, tmp_path)
    assert code == 2, out
    assert f"'{package}'" in out and 'pip install "lora-bench[trackers]"' in " ".join(out.split())
    assert "Traceback" not in out


def test_a_logger_is_checked_before_a_run(tmp_path, hide_package):
    from lora_bench.errors import UsageError
    from lora_bench.trackers.export import check_logger

    for to in ("mlflow", "tensorboard"):
        check_logger(to, tmp_path)
    with pytest.raises(UsageError, match="--logger 'wandb' is not a tracker lora-bench writes"):
        check_logger("wandb", tmp_path)
    hide_package("tensorboard")
    with pytest.raises(UsageError, match=r"pip install \"lora-bench\[trackers\]\""):
        check_logger("tensorboard", tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_train_with_a_logger_exports_its_run_once_saved(tmp_path, run_cli):
    results = tmp_path / "results"
    code, out = run_cli("train", "--model-size", "tiny", "--weights", "random", "--device", "cpu",
                        "--data-file", SAMPLE, "--max-steps", "3", "--warmup-steps", "1", "--eval-freq", "0",
                        "--skip-final-eval", "--no-progress", "--results-dir", results, "--logger", "tensorboard")
    assert code == 0, out
    (run_dir,) = [p.parent for p in results.glob("*/run.json")]
    with open(run_dir / "steps.csv", newline="") as f:
        steps = list(csv.DictReader(f))
    events = event_accumulator.EventAccumulator(str(results / "tensorboard" / run_dir.name),
                                                size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("step/loss")] == \
        [(int(s["step"]), float(np.float32(s["loss"]))) for s in steps]


def test_a_bad_logger_is_refused_before_the_run(tmp_path, run_cli):
    code, out = run_cli("train", "--model-size", "tiny", "--weights", "random", "--device", "cpu",
                        "--data-file", SAMPLE, "--max-steps", "3", "--warmup-steps", "1", "--results-dir", tmp_path / "r",
                        "--logger", "wandb")
    assert code == 2 and "wandb" in out and "Traceback" not in out
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").glob("*/run.json"))
