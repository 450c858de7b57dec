"""A run's claim on its folder: an exclusive advisory lock (``fcntl.flock``) on
``<run_dir>/.claim``, held by the process that executes the run for as long as it runs.

A resume, a second sweep into the same folder and a one-off ``train`` with the same run id all try
the claim before touching the folder, so one run is never executed twice at once and a finished
record is never overwritten by a process that lost the race. The lock belongs to the open file, so
a process that dies (even by SIGKILL) releases it; a sweep hands its claim to the run's child
process by passing the descriptor, and both hold it until both are done. The file's content, the
pid of the process holding it, is only for messages.

The process that made a claim removes the file when it lets go, while it still holds the lock; a
process that was waiting on the removed file notices (the path no longer names the file it locked)
and claims anew, so a finished run folder keeps no ``.claim`` and no run is ever held twice."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path
from typing import Callable

from lora_bench.errors import RunClaimedError
from lora_bench.fileio import names_file

CLAIM_NAME = ".claim"
# A reader asking whether a claim is held (``is_claimed``) holds a shared lock for a moment: a claim
# that finds the lock taken looks again a few times before it counts as held by another process.
RETRIES = 5
RETRY_S = 0.01


class RunClaim:
    """A held claim; ``release`` (or leaving the ``with`` block) gives it up."""

    def __init__(self, fd: int, run_dir: Path, *, owner: bool = True):
        self.fd = fd
        self.run_dir = Path(run_dir)
        self.owner = owner  # made the claim, so removes its file when letting go

    @classmethod
    def inherit(cls, fd: int, run_dir: Path) -> "RunClaim":
        """A claim taken by the parent process and passed down as descriptor ``fd``: the same
        lock, now also naming this process as its holder. The parent, which still holds it, is
        the one that removes the file."""
        claim = cls(fd, run_dir, owner=False)
        _write_pid(fd)
        return claim

    def release(self) -> None:
        if self.fd >= 0:
            if self.owner and names_file(self.run_dir / CLAIM_NAME, self.fd):
                (self.run_dir / CLAIM_NAME).unlink()  # still held: nobody else can hold this file now
            os.close(self.fd)  # closing the last descriptor of the open file drops the lock
            self.fd = -1

    def __enter__(self) -> "RunClaim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _write_pid(fd: int) -> None:
    """Name this process in the claim file, for messages; a file system with no room for the few
    bytes (a full disk) leaves it unnamed: the lock, not the content, is the claim."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise


def try_claim(run_dir: Path) -> RunClaim | None:
    """Claim ``run_dir`` (created if needed) now, or None when another process holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CLAIM_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            if not _lock(fd, fcntl.LOCK_EX):
                os.close(fd)
                return None
            if names_file(path, fd):
                break
            os.close(fd)  # its holder removed the file on letting go: claim the one there now
        except BaseException:
            os.close(fd)
            raise
    _write_pid(fd)
    return RunClaim(fd, run_dir)


def _lock(fd: int, kind: int) -> bool:
    for attempt in range(RETRIES):
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt + 1 < RETRIES:
                time.sleep(RETRY_S)
    return False


def is_claimed(run_dir: Path) -> bool:
    """Whether a process (this one included) holds ``run_dir``'s claim. Asks without taking it
    and without making a file: a run recorded as running whose claim nobody holds is one whose
    process died."""
    try:
        fd = os.open(Path(run_dir) / CLAIM_NAME, os.O_RDONLY)
    except OSError as e:
        return e.errno != errno.ENOENT  # a claim file that cannot be opened may well be held
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the shared lock, if taken


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
