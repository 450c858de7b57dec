"""The one way lora-bench opens a file of a results folder for reading (runs.csv, steps.csv,
run.json, manifest.json, a report's inputs): ``read_results_file``. The file must be a regular file
(not a pipe, which would make the reader wait, a folder, or a device), reached inside the folder
(a link may point within it, never out of it: ``/dev/zero`` or another user's files are not
results), and at most ``limit`` bytes, checked before reading. Anything else is one ResultsError
naming the file and what is wrong. ``read_results_json`` adds the JSON nesting limit."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from lora_bench.errors import ResultsError
from lora_bench.fileio import TooLarge, parse_json, read_capped, shown_path


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


def outside(path: Path, root: Path) -> bool:
    """Whether ``path``, its links followed, lies outside the folder ``root``."""
    try:
        return not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))
    except (OSError, ValueError):
        return True


def results_file_problem(path: Path, *, root: Path) -> str | None:
    """Why ``path`` is not a results file to read (a few words), or None when it is one (or is absent)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISLNK(info.st_mode) and outside(path, root):
        return f"is a link that leaves the results folder {shown_path(root)}"
    try:
        info = os.stat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror or e}; a broken link?)"
    if stat.S_ISDIR(info.st_mode):
        return "is a folder, not a file"
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file (a pipe, device or socket)"
    return None


def read_results_file(path: Path, *, limit: int, root: Path | None = None) -> bytes | None:
    """The bytes of the results file ``path`` (see the module), or None when there is none;
    ``root``: the results folder it must lie in (default: its own folder)."""
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    if why := results_file_problem(path, root=root):
        raise ResultsError(f"{shown_path(path)} {why}; not read")
    try:
        return read_capped(path, limit)
    except FileNotFoundError:
        return None
    except TooLarge as e:
        raise ResultsError(f"{shown_path(path)} holds {_mib(e.size)}, more than the {_mib(limit)} such a file of "
                           "lora-bench holds; not read") from None
    except OSError as e:
        raise ResultsError(f"cannot read {shown_path(path)} ({e.strerror or e})") from None


def read_results_json(path: Path, *, limit: int, root: Path | None = None):
    """The JSON value of the results file ``path`` (``read_results_file``), or None when there is
    none; ResultsError when it is not UTF-8 JSON or nests too deep."""
    data = read_results_file(path, limit=limit, root=root)
    if data is None:
        return None
    try:
        return parse_json(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ResultsError(f"{shown_path(path)} holds binary data, not JSON text; not read") from None
    except ValueError as e:
        raise ResultsError(f"{shown_path(path)} is not valid JSON ({str(e)[:160]}); not read") from None
