"""Progress of a training run on the terminal — epoch, step, the last resolved loss, elapsed and
remaining time — at a cost per step below the phase timer's own.

``update`` runs every step inside the measured loop, so it does almost nothing: it stores the step
and compares the clock with the next refresh time. Only on a refresh (at most ``refresh_per_s``
times a second) does it read the last loss the timer has already resolved (reading a loss itself
would synchronise the GPU), format one line and rewrite it in place. There is no refresh thread (a
background redraw takes the GIL at random points of a host-bound step), and the line is written
directly rather than laid out by rich's Live/Progress, whose redraw costs a few milliseconds of
Python. Whatever the console prints meanwhile (evaluation lines) clears the line first, through a
rich render hook, so nothing is garbled; the next refresh draws it again below."""

from __future__ import annotations

import math
import time

from rich.console import Console, RenderHook
from rich.control import Control
from rich.segment import ControlType

REFRESH_PER_S = 2.0
CLEAR = "\r\x1b[2K"  # carriage return, erase the whole line


class _StatusLine(RenderHook):
    """One line at the bottom of a terminal, rewritten in place."""

    def __init__(self, console: Console):
        self.console = console
        self.file = console.file  # looked up once: rich resolves it (and the width) on every access
        self.width = console.width
        self.shown = False

    def show(self, text: str) -> None:
        self.file.write(CLEAR + text)
        self.file.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.file.write(CLEAR)
            self.file.flush()
            self.shown = False

    def process_renderables(self, renderables):
        if not self.shown:
            return renderables
        self.shown = False
        return [Control((ControlType.CARRIAGE_RETURN,), (ControlType.ERASE_IN_LINE, 2)), *renderables]


class TrainProgress:
    def __init__(self, console: Console, *, total: int, enabled: bool, timer=None,
                 refresh_per_s: float = REFRESH_PER_S):
        self.console = console
        self.enabled = enabled and console.is_terminal  # a log file gets the evaluation lines only
        self.timer = timer
        self.total = total
        self.interval = 1.0 / refresh_per_s
        self.refreshes = 0
        self._line = _StatusLine(console) if self.enabled else None
        self._last_loss = float("nan")
        self._step = -1
        self._epoch = 1
        self._next = 0.0
        self._t0 = 0.0

    def __enter__(self):
        self._t0 = time.perf_counter()
        if self.enabled:
            self.console.push_render_hook(self._line)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.console.pop_render_hook()
            self._line.clear()
        return False

    def update(self, step: int, epoch: int, loss) -> None:
        """Called after every step: a clock read and a comparison; a redraw when one is due."""
        if not self.enabled:
            return
        self._step, self._epoch = step, epoch
        now = time.perf_counter()
        if now < self._next:
            return
        self._next = now + self.interval
        self.refresh(now)

    def refresh(self, now: float | None = None) -> None:
        """Read the last loss the timer has resolved (no sync), format the line and draw it."""
        if self.timer is not None and self.timer.records:
            last = self.timer.records[-1].loss
            if isinstance(last, float):
                self._last_loss = last
        self._line.show(self.line(time.perf_counter() if now is None else now))
        self.refreshes += 1

    def line(self, now: float) -> str:
        """'epoch 1  ━━━━━━━━━━━━──────────  120/450  loss 0.512  0:00:12 < 0:00:33'"""
        done = self._step + 1
        frac = min(done / self.total, 1.0) if self.total else 0.0
        width = max(10, min(40, self._line.width - 60))
        filled = int(frac * width)
        elapsed = now - self._t0
        eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
        loss = "-" if math.isnan(self._last_loss) else f"{self._last_loss:.3f}"
        return (f"epoch {self._epoch}  {'━' * filled}{'─' * (width - filled)}  {done}/{self.total}  "
                f"loss {loss}  {_clock(elapsed)} < {_clock(eta)}")


def _clock(seconds: float) -> str:
    if math.isnan(seconds):
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
