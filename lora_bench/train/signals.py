"""Signals while a run executes: the first SIGINT, SIGTERM or SIGHUP ends it as Ctrl-C does."""

from __future__ import annotations

import signal
import threading

from lora_bench.errors import Interrupted

TERMINATING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RaiseOnSignal:
    """While a run executes: the first SIGINT, SIGTERM or SIGHUP raises Interrupted (a
    KeyboardInterrupt) in the main thread, so the run is recorded as interrupted whichever signal
    ended it; later signals are ignored until the record is written, so a second Ctrl-C cannot
    tear it. SIGHUP stays ignored when the process was started so (``nohup``)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self) -> "RaiseOnSignal":
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for s in TERMINATING_SIGNALS:
                if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN:
                    self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            raise Interrupted(signum)

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
