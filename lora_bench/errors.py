"""Domain exceptions, each mapped to an exit code by the CLI (no tracebacks for user mistakes)."""

from __future__ import annotations

EXIT_USAGE = 2
EXIT_RUNTIME = 1


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
    """A needed download failed on every URL (no network, bad size or hash)."""

    exit_code = EXIT_USAGE


class CheckpointError(LoraBenchError):
    """A checkpoint is missing files, corrupt, or does not match the model."""

    exit_code = EXIT_USAGE
