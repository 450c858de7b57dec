"""lora_bench.progress: the training progress line costs less per step than the phase timer (a
ratio measured on the same machine, so the test holds on slow and fast hosts alike), formats
nothing on steps without a refresh, reads only losses the timer has resolved, and never garbles
what the console prints meanwhile."""

from __future__ import annotations

import io
import statistics
from types import SimpleNamespace

import torch
from rich.console import Console

from benchmarks.progress_overhead import refresh_cost_us, update_cost_us
from benchmarks.timer_overhead import timer_cost_us
from lora_bench.progress import CLEAR, TrainProgress


def _console(terminal: bool = True) -> Console:
    return Console(file=io.StringIO(), force_terminal=terminal, width=100)


def test_update_costs_less_than_the_timer_per_step():
    timer = statistics.median(timer_cost_us(torch.device("cpu"), steps=1000) for _ in range(3))
    update = statistics.median(update_cost_us(steps=20_000) for _ in range(3))
    refresh = statistics.median(refresh_cost_us(n=100) for _ in range(3))
    assert update < 0.25 * timer, (update, timer)
    # a 50 ms step (eager 124M) refreshes on one step in ten at 2 refreshes/s
    assert update + refresh * 0.1 < timer, (update, refresh, timer)


def test_no_formatting_between_refreshes(monkeypatch):
    with TrainProgress(_console(), total=10_000, enabled=True, refresh_per_s=0.01) as bar:
        calls = []
        real = bar.line
        monkeypatch.setattr(bar, "line", lambda now: calls.append(now) or real(now))
        for i in range(5000):
            bar.update(i, 1, None)
    assert len(calls) == 1 and bar.refreshes == 1  # the first step only


def test_reads_only_losses_the_timer_resolved():
    timer = SimpleNamespace(records=[SimpleNamespace(loss=0.25)])
    with TrainProgress(_console(), total=4, enabled=True, timer=timer) as bar:
        bar.update(0, 1, torch.tensor(9.0))
        assert "loss 0.250" in bar.line(0.0) and "1/4" in bar.line(0.0)
        timer.records.append(SimpleNamespace(loss=torch.tensor(7.0)))  # not resolved yet: keep the last float
        bar.refresh()
        assert "loss 0.250" in bar.line(0.0)


def test_console_output_clears_the_line_first():
    console = _console()
    with TrainProgress(console, total=3, enabled=True) as bar:
        bar.update(0, 1, None)
        console.print("Ep 1 (Step 000000): Train loss 0.693", highlight=False)
        bar.update(1, 1, None)  # within the refresh interval: nothing drawn
        bar.refresh()
    out = console.file.getvalue()
    shown = out.index("epoch 1")
    printed = out.index("Ep 1 (Step 000000)")
    assert shown < printed and CLEAR in out[shown:printed]  # the line is erased before the print
    assert out.endswith(CLEAR)  # and gone at the end


def test_nothing_drawn_when_disabled():
    for terminal in (True, False):
        console = _console(terminal=terminal)
        with TrainProgress(console, total=3, enabled=False) as bar:
            bar.update(0, 1, None)
        assert console.file.getvalue() == "" and bar.refreshes == 0


def test_off_a_terminal_plain_lines_show_the_run_moving():
    """A pipe or a log gets a plain line (nothing rewritten in place) on the first step, when each
    epoch begins, and after the last step; between them at most every plain_every_s seconds."""
    console = _console(terminal=False)
    timer = SimpleNamespace(records=[SimpleNamespace(loss=0.5)])
    with TrainProgress(console, total=9, enabled=True, timer=timer, plain_every_s=3600) as bar:
        for step in range(9):
            bar.update(step, 1 + step // 3, None)  # three epochs of three steps
    lines = console.file.getvalue().splitlines()
    assert [line.split("  ")[:2] for line in lines] == [["epoch 1", "1/9"], ["epoch 2", "4/9"], ["epoch 3", "7/9"],
                                                        ["epoch 3", "9/9"]]
    assert all("loss 0.500" in line for line in lines)
    assert "\r" not in console.file.getvalue() and "\x1b" not in console.file.getvalue()
    console = _console(terminal=False)
    with TrainProgress(console, total=50, enabled=True, plain_every_s=0) as bar:
        for step in range(50):
            bar.update(step, 1, None)
    assert len(console.file.getvalue().splitlines()) == 50  # every step once the interval has passed
