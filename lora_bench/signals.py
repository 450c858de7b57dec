"""Terminating signals: while a run executes, the first SIGINT, SIGTERM or SIGHUP ends it as
Ctrl-C does (``RaiseOnSignal``); while a record is written, they wait until it is written
(``signals_deferred``)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from lora_bench.errors import Interrupted

TERMINATING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def signal_name(signum: int | None) -> str:
    try:
        return signal.Signals(signum).name
    except (TypeError, ValueError):
        return f"signal {signum}"


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


_deferring = False


@contextlib.contextmanager
def signals_deferred() -> Iterator[list[int]]:
    """Run the block with SIGINT, SIGTERM and SIGHUP held back: one that arrives meanwhile is noted
    (in the list the block gets) and delivered once the block is done, to whatever was in place
    (a handler such as RaiseOnSignal's, the default action, or nothing where it is ignored). A
    block inside another defers to the outer one. A save in this block is never cut by a signal;
    only SIGKILL (or a power cut) can, which the save's order of writes is made for.

    Handlers can be set only in the main thread; elsewhere the block runs as it is."""
    global _deferring
    if _deferring or threading.current_thread() is not threading.main_thread():
        yield []
        return
    pending: list[int] = []
    old = {s: signal.getsignal(s) for s in TERMINATING_SIGNALS}
    held = [s for s, h in old.items() if h is not None]  # None: a handler set outside Python, left alone
    _deferring = True
    try:
        for s in held:
            signal.signal(s, lambda signum, frame: pending.append(signum))
        yield pending
    finally:
        for s in held:
            signal.signal(s, old[s])
        _deferring = False
        for s in dict.fromkeys(pending):  # each signal once, in the order they came
            signal.raise_signal(s)
