"""Rich progress for a training run: epoch, step, last resolved loss, ETA (no syncs added)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, console: Console, *, total: int, enabled: bool, timer=None):
        self.enabled = enabled
        self.timer = timer
        self._last_loss = float("nan")
        self._progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=console, transient=True, disable=not enabled,
            # the refresh thread takes the GIL; a host-bound training loop feels every redraw
            refresh_per_second=2,
        )
        self._task = None
        self.total = total

    def __enter__(self):
        self._progress.__enter__()
        self._task = self._progress.add_task("train", total=self.total, epoch=1, loss="-")
        return self

    def __exit__(self, *exc):
        return self._progress.__exit__(*exc)

    def update(self, step: int, epoch: int, loss) -> None:
        if not self.enabled:
            return
        # only losses the timer has already read at a sync point: reading here would sync the GPU
        if self.timer is not None and self.timer.records:
            last = self.timer.records[-1].loss
            if isinstance(last, float):
                self._last_loss = last
        self._progress.update(self._task, completed=step + 1, epoch=epoch, loss=f"{self._last_loss:.3f}")
