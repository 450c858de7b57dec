"""Progress of work counted in items (lora_bench.progress.CountProgress): the final evaluation
shows its batches moving, on a terminal and off one, and reading a loader through it changes
nothing the loader yields."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

from rich.console import Console
from tiny import SAMPLE

from lora_bench.config import TrainConfig
from lora_bench.progress import CLEAR, CountProgress
from lora_bench.train.run import execute_run

REPO = Path(__file__).resolve().parents[2]


def _console(terminal: bool) -> Console:
    return Console(file=io.StringIO(), force_terminal=terminal, width=100)


def test_counted_items_are_all_yielded_and_each_advances_the_line():
    console = _console(terminal=False)
    with CountProgress(console, total=4, label="final evaluation", enabled=True, plain_every_s=0) as bar:
        items = bar.counted([10, 20, 30, 40])
        assert len(items) == 4 and list(items) == [10, 20, 30, 40]
    lines = console.file.getvalue().splitlines()
    assert [line.split("  ")[:2] for line in lines] == [["final evaluation", f"{n}/4"] for n in range(1, 5)]
    console = _console(terminal=True)
    with CountProgress(console, total=4, label="final evaluation", enabled=True) as bar:
        list(bar.counted(range(4)))
    out = console.file.getvalue()
    assert out.startswith(CLEAR + "final evaluation  ━") and out.endswith(CLEAR)  # drawn in place, then cleared
    console = _console(terminal=False)
    with CountProgress(console, total=4, label="x", enabled=False) as bar:
        list(bar.counted(range(4)))
    assert console.file.getvalue() == ""


def test_the_final_evaluation_shows_its_progress(tmp_path, cache_dir):
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora", device="cpu",
                      data_file=str(SAMPLE), max_steps=2, warmup_steps=1, eval_freq=0)
    console = _console(terminal=False)
    row = execute_run(cfg, results_dir=tmp_path, run_id="r", console=console, progress=True, cache_dir=cache_dir)
    out = console.file.getvalue()
    total = sum(1 for line in out.splitlines() if line.startswith("final evaluation  "))
    assert total >= 1 and row["test_acc"] is not None
    last = [line for line in out.splitlines() if line.startswith("final evaluation  ")][-1]
    done, all_ = last.split("  ")[1].split("/")
    assert done == all_  # the last line: every batch evaluated
    assert out.index("final evaluation  ") < out.index("Test accuracy:")


def test_rendering_reports_shows_its_progress(tmp_path, run_cli):
    """`results render` and its --check say how far they are, folder by folder."""
    root = tmp_path / "results"
    shutil.copytree(REPO / "results" / "answer" / "peers", root / "answer" / "peers")
    code, out = run_cli("results", "render", "--root", root, "--check")
    assert code == 0 and "checking reports  1/1  " in out, out
    code, out = run_cli("results", "render", "--root", root)
    assert code == 0 and "rendering reports  1/1  " in out, out
