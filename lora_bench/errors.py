"""Domain exceptions, each mapped to an exit code by the CLI (no tracebacks for user mistakes)."""

from __future__ import annotations

import signal

EXIT_RUNTIME = 1  # a run failed
EXIT_USAGE = 2  # a bad option, value or input file: nothing ran
EXIT_DOWNLOAD = 3  # something needed could not be downloaded (no network, a mirror serving another file)
EXIT_NOT_SAVED = 4  # a result could not be saved in full (a full disk, a quota, a file-size limit)


class LoraBenchError(Exception):
    """Base class: an expected failure with a message meant for the user."""

    exit_code = EXIT_RUNTIME


class UsageError(LoraBenchError):
    """A bad option value or an impossible combination of options."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """One or more problems in a run configuration; ``problems`` lists every one."""

    def __init__(self, problems: list[str], *, source: str | None = None):
        self.problems = list(problems)
        head = f"{source}: " if source else ""
        if len(self.problems) == 1:
            msg = head + self.problems[0]
        else:
            msg = head + f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(msg)


class DataError(UsageError):
    """Missing or malformed input data (a path the user gave, a corrupt file)."""


class DownloadError(LoraBenchError):
    """A needed download failed on every URL (no network, bad size or hash): not a usage error,
    so it has its own exit code."""

    exit_code = EXIT_DOWNLOAD


class CheckpointError(LoraBenchError):
    """A checkpoint is missing files, corrupt, or does not match the model."""

    exit_code = EXIT_USAGE


class ResultsError(UsageError):
    """A results file (``runs.csv``) that cannot be read as lora-bench's table: binary, empty,
    unbalanced quotes, another program's CSV."""


class SaveError(LoraBenchError):
    """A run's record could not be saved in full: the folder takes no more. ``row`` is the run's
    row as far as it was recorded (its measured columns, for the terminal when nothing fit)."""

    exit_code = EXIT_NOT_SAVED

    def __init__(self, message: str, *, row: dict | None = None):
        super().__init__(message)
        self.row = row or {}


class RunClaimedError(UsageError):
    """The run's folder is claimed by another process that is executing the run."""


EXIT_INTERRUPTED = 130  # what a shell reports for Ctrl-C (128 + SIGINT)


class Interrupted(KeyboardInterrupt):
    """A terminating signal (SIGINT, SIGTERM, SIGHUP) stopped a run; a KeyboardInterrupt so that
    every ``except Exception`` lets it through, as Ctrl-C's own exception does."""

    def __init__(self, signum: int, reason: str = ""):
        self.signum = signum
        self.reason = reason
        super().__init__(signum, reason)

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process ended by that signal."""
        return 128 + self.signum

    def __str__(self) -> str:
        try:
            name = signal.Signals(self.signum).name
        except ValueError:
            name = f"signal {self.signum}"
        return f"interrupted by {name}" + (f" ({self.reason})" if self.reason else "")
