"""``validate`` and ``sweep --dry-run`` ask this machine what the sweep asks before its first run,
so that what they accept the sweep runs and what the sweep refuses they refuse; and both say how
long the sweep will take here."""

from __future__ import annotations

import pytest
import torch
from tiny import SAMPLE, TINY_BASE

from lora_bench.config import TrainConfig
from lora_bench.sweep.plan_time import splits_of
from lora_bench.train.context import RunContext

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")


def sweep_file(tmp_path, extra: str, name: str = "s"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nbase:\n{TINY_BASE}{extra}grid:\n  lora_rank: [2, 4]\n")
    return path


def refused_alike(run_cli, path, tmp_path, needle: str) -> None:
    """validate, the dry run and the sweep itself: each exits 2 naming ``needle``; nothing runs."""
    results = tmp_path / "results"
    for args in (("validate", path), ("sweep", path, "--dry-run", "--results-dir", results),
                 ("sweep", path, "--results-dir", results, "--no-progress")):
        code, out = run_cli(*args)
        assert code == 2 and needle in out and "Traceback" not in out, (args, out)
    assert not (results / "runs.csv").exists()


@NO_CUDA
def test_cuda_graphs_without_a_cuda_device_is_refused_by_every_check(tmp_path, run_cli):
    path = sweep_file(tmp_path, "  cuda_graphs: true\n")
    text = path.read_text().replace("device: cpu", "device: auto")
    path.write_text(text)
    refused_alike(run_cli, path, tmp_path, "cuda_graphs needs a CUDA device, and none is available here")


@NO_CUDA
def test_validate_without_the_machine_checks_the_file_alone(tmp_path, run_cli):
    """A sweep for another machine: --no-machine checks the file as any machine would see it."""
    path = sweep_file(tmp_path, "  cuda_graphs: true\n")
    path.write_text(path.read_text().replace("device: cpu", "device: auto"))
    code, out = run_cli("validate", path, "--no-machine")
    assert code == 0 and "✓" in out and "estimate" not in out, out


@NO_CUDA
def test_a_cuda_device_the_machine_lacks_is_refused_by_every_check(tmp_path, run_cli):
    path = sweep_file(tmp_path, "")
    path.write_text(path.read_text().replace("device: cpu", "device: cuda"))
    refused_alike(run_cli, path, tmp_path, "but this machine has 0 CUDA device(s)")


def test_a_run_too_big_for_memory_is_refused_by_every_check(tmp_path, run_cli, monkeypatch):
    monkeypatch.setattr("lora_bench.sweep.machine.memory_problem",
                        lambda cfg, cuda: "needs about 9 GiB, 1 GiB is free" if cfg.lora_rank == 4 else None)
    refused_alike(run_cli, sweep_file(tmp_path, ""), tmp_path, "needs about 9 GiB, 1 GiB is free")


def test_a_missing_package_is_refused_by_every_check(tmp_path, run_cli, hide_package):
    hide_package("transformers")
    path = sweep_file(tmp_path, "  implementation: hf\n  trainable_layers: lora\n")
    refused_alike(run_cli, path, tmp_path, "transformers")


def test_validate_the_dry_run_and_the_sweep_say_how_long_the_sweep_takes(tmp_path, run_cli):
    path = sweep_file(tmp_path, "")
    code, out = run_cli("validate", path)
    assert code == 0 and "estimate: about " in out and "for 2 runs on this CPU" in out, out
    assert "starting their processes" in out
    code, out = run_cli("sweep", path, "--dry-run", "--isolation", "inline", "--results-dir", tmp_path / "r")
    assert code == 0 and "estimate: about " in out and "for 2 runs on this CPU" in out, out
    assert "starting their processes" not in out  # inline: no process is started per run
    code, out = run_cli("sweep", path, "--isolation", "inline", "--results-dir", tmp_path / "r", "--no-progress")
    assert code == 0 and out.index("estimate: about ") < out.index("✓ done"), out  # the sweep says it first


@pytest.mark.parametrize("changes", [dict(), dict(batch_size=3), dict(context_length="64")])
def test_the_estimate_reads_the_splits_the_run_trains_on(cache_dir, changes):
    cfg = TrainConfig(model_size="tiny", weights="random", device="cpu", data_file=str(SAMPLE), **changes)
    context = RunContext(cfg, cache_dir=cache_dir, progress=False)
    got = splits_of(cfg, {})
    assert (got.train_batches, got.val_batches, got.test_batches, got.length) == (
        len(context.loaders.train), len(context.loaders.val), len(context.loaders.test), context.loaders.max_length)


@NO_CUDA
def test_a_dry_run_without_the_machine_lists_a_plan_for_another_machine(tmp_path, run_cli):
    """A GPU's sweep listed where there is no GPU: --no-machine shows the plan (the shard and --only
    taken as the sweep takes them) and says this machine was not asked; without --dry-run it is refused."""
    path = sweep_file(tmp_path, "  cuda_graphs: true\n")
    path.write_text(path.read_text().replace("device: cpu", "device: auto"))
    results = tmp_path / "results"
    code, out = run_cli("sweep", path, "--dry-run", "--results-dir", results)
    assert code == 2 and "cuda_graphs needs a CUDA device" in out, out
    code, out = run_cli("sweep", path, "--dry-run", "--no-machine", "--only", "lora_rank=4", "--results-dir", results)
    text = " ".join(out.split())
    assert code == 0 and "Traceback" not in out, out
    assert "1 runs: 1 to run" in text and "not checked on this machine (--no-machine)" in text, out
    assert "lora_rank=4" in text and "lora_rank=2" not in text and "estimate" not in text, out
    code, out = run_cli("sweep", path, "--no-machine", "--results-dir", results)
    assert code == 2 and "it needs --dry-run" in " ".join(out.split()), out
    assert not (results / "runs.csv").exists()
