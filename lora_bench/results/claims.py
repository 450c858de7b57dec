"""A run's claim on its folder: an exclusive advisory lock (``fcntl.flock``) on
``<run_dir>/.claim``, held by the process that executes the run for as long as it runs.

A resume, a second sweep into the same folder and a one-off ``train`` with the same run id all try
the claim before touching the folder, so one run is never executed twice at once and a finished
record is never overwritten by a process that lost the race. The lock belongs to the open file, so
a process that dies (even by SIGKILL) releases it; a sweep hands its claim to the run's child
process by passing the descriptor, and both hold it until both are done. The file's content, the
pid of the process holding it, is only for messages."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Callable

from lora_bench.errors import RunClaimedError

CLAIM_NAME = ".claim"


class RunClaim:
    """A held claim; ``release`` (or leaving the ``with`` block) gives it up."""

    def __init__(self, fd: int, run_dir: Path):
        self.fd = fd
        self.run_dir = Path(run_dir)

    @classmethod
    def inherit(cls, fd: int, run_dir: Path) -> "RunClaim":
        """A claim taken by the parent process and passed down as descriptor ``fd``: the same
        lock, now also naming this process as its holder."""
        claim = cls(fd, run_dir)
        _write_pid(fd)
        return claim

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor of the open file drops the lock
            self.fd = -1

    def __enter__(self) -> "RunClaim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _write_pid(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def try_claim(run_dir: Path) -> RunClaim | None:
    """Claim ``run_dir`` (created if needed) now, or None when another process holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / CLAIM_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    _write_pid(fd)
    return RunClaim(fd, run_dir)


def claimant(run_dir: Path) -> int | None:
    """The pid recorded by the claim's holder (for messages; the lock itself decides)."""
    try:
        return int((Path(run_dir) / CLAIM_NAME).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def claim_run(run_dir: Path) -> RunClaim:
    """Claim ``run_dir`` or raise RunClaimedError naming the process that holds it."""
    got = try_claim(run_dir)
    if got is None:
        pid = claimant(run_dir)
        raise RunClaimedError(f"run {Path(run_dir).name} is being executed by another process"
                              f"{f' (pid {pid})' if pid else ''} in {run_dir}; wait for it to finish or stop it")
    return got


def wait_for_claim(run_dir: Path, *, stop: Callable[[], bool] = lambda: False, poll_s: float = 0.2) -> RunClaim | None:
    """Claim ``run_dir`` once its holder lets go; None when ``stop()`` turns true first. Polls, so
    that a signal handler that only sets a flag can still end the wait."""
    while True:
        got = try_claim(run_dir)
        if got is not None or stop():
            return got
        time.sleep(poll_s)
