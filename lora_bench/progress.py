"""Progress of a training run on the terminal — epoch, step, the last resolved loss, elapsed and
remaining time — at a cost per step below the phase timer's own: ``update`` only stores the step
and checks the clock; at most ``refresh_per_s`` times a second one line is rewritten in place, with
no thread and no GPU sync. Off a terminal a plain line is printed now and then; ``enabled=False``
(``--no-progress``) prints nothing. Work counted in items, such as the final evaluation's batches,
shows the same line (``CountProgress``). Why this way: docs/measuring.md#the-progress-line."""

from __future__ import annotations

import math
import time

from rich.console import Console, RenderHook
from rich.control import Control
from rich.segment import ControlType

REFRESH_PER_S = 2.0
PLAIN_EVERY_S = 30.0  # off a terminal: a line at most this often (and at each epoch)
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
                 refresh_per_s: float = REFRESH_PER_S, plain_every_s: float = PLAIN_EVERY_S):
        self.console = console
        self.enabled = enabled and console.is_terminal  # the line rewritten in place
        self.plain = enabled and not console.is_terminal  # a pipe or a log: plain lines now and then
        self.timer = timer
        self.total = total
        self.interval = 1.0 / refresh_per_s if self.enabled else plain_every_s
        self._shown_step = -1  # the step of the last plain line
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
        elif self.plain and self._step > self._shown_step:  # where the run ended
            self.refresh()
        return False

    def update(self, step: int, epoch: int, loss) -> None:
        """Called after every step: a clock read and a comparison; a redraw when one is due (off a
        terminal also when an epoch begins)."""
        if not (self.enabled or self.plain):
            return
        new_epoch = epoch != self._epoch
        self._step, self._epoch = step, epoch
        now = time.perf_counter()
        if now < self._next and not (self.plain and new_epoch):
            return
        self._next = now + self.interval
        self.refresh(now)

    def refresh(self, now: float | None = None) -> None:
        """Read the last loss the timer has resolved (no sync), format the line and draw it (off a
        terminal: print it)."""
        if self.timer is not None and self.timer.records:
            last = self.timer.records[-1].loss
            if isinstance(last, float):
                self._last_loss = last
        now = time.perf_counter() if now is None else now
        if self.enabled:
            self._line.show(self.line(now))
        else:
            self.console.print(self.line(now), markup=False, highlight=False)
            self._shown_step = self._step
        self.refreshes += 1

    def line(self, now: float) -> str:
        """'epoch 1  ━━━━━━━━━━━━──────────  120/450  loss 0.512  0:00:12 < 0:00:33'; off a terminal
        without the bar."""
        loss = "-" if math.isnan(self._last_loss) else f"{self._last_loss:.3f}"
        return f"epoch {self._epoch}  {self._count()}  loss {loss}  {self._times(now)}"

    def _fraction(self) -> float:
        return min((self._step + 1) / self.total, 1.0) if self.total else 0.0

    def _count(self) -> str:
        """The bar (on a terminal) and 'done/total'."""
        bar = ""
        if self._line is not None:
            width = max(10, min(40, self._line.width - 60))
            filled = int(self._fraction() * width)
            bar = f"{'━' * filled}{'─' * (width - filled)}  "
        return f"{bar}{self._step + 1}/{self.total}"

    def _times(self, now: float) -> str:
        """'elapsed < remaining'."""
        frac, elapsed = self._fraction(), now - self._t0
        eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
        return f"{_clock(elapsed)} < {_clock(eta)}"


def _clock(seconds: float) -> str:
    if math.isnan(seconds):
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class CountProgress(TrainProgress):
    """The same line for work counted in items rather than training steps (the final evaluation's
    batches, a report's runs): 'final evaluation  ━━━━────  12/40  0:00:05 < 0:00:12'. ``advance``
    after each item; ``counted`` wraps an iterable (a data loader, keeping its ``len``) to advance
    as each of its items is done."""

    def __init__(self, console: Console, *, total: int, label: str, enabled: bool, **kw):
        super().__init__(console, total=total, enabled=enabled, **kw)
        self.label = label
        self._done = 0

    def advance(self, n: int = 1) -> None:
        self._done += n
        self.update(self._done - 1, 1, None)

    def counted(self, items) -> "Counted":
        return Counted(items, self.advance)

    def line(self, now: float) -> str:
        return f"{self.label}  {self._count()}  {self._times(now)}"


class Counted:
    """``items`` (any iterable with a ``len``) calling ``advance()`` as each item is done: when the
    next one is asked for, or the iteration ends."""

    def __init__(self, items, advance):
        self.items, self.advance = items, advance

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        for item in self.items:
            yield item
            self.advance()
