"""Shared fixtures: the real corpus (skip when absent), tiny configs, a CUDA skip marker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_bench.config import TrainConfig

import os

# the corpus beside the checkout; LORA_BENCH_SMS_FILE points elsewhere (e.g. on a GPU machine)
SHARED_DATA = Path(os.environ.get("LORA_BENCH_SMS_FILE") or
                   Path(__file__).resolve().parents[2] / "shared" / "data" / "SMSSpamCollection.tsv")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sms_file() -> Path:
    if not SHARED_DATA.is_file():
        pytest.skip(f"real corpus not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def tiny_cfg(sms_file) -> TrainConfig:
    """A tiny random-weight model on the real data, a handful of steps."""
    return TrainConfig(model_size="tiny", weights="random", trainable_layers="all", device="cpu",
                       data_file=str(sms_file), num_epochs=1, max_steps=6, eval_freq=3, eval_iter=2,
                       skip_final_eval=True, warmup_steps=2)


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Run ``lora-bench ARGS`` in-process through ``main()`` (the real error mapping);
    returns (exit code, stdout + stderr)."""
    from lora_bench import cli

    def run(*args: str) -> tuple[int, str]:
        monkeypatch.setattr("sys.argv", ["lora-bench", *map(str, args)])
        monkeypatch.setenv("COLUMNS", "200")
        code = 0
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    return run
