"""Provenance of a results folder: ``manifest.json``, one entry per invocation of the harness that
wrote into the folder (the command line, the source commit taken at launch, the environment, the
date, the lora-bench version, and the run ids and files it produced).

An invocation spans processes: the first ``record_invocation`` of a command stores its launch
record in the ``LORA_BENCH_INVOCATION`` environment variable, so the child processes a sweep
starts add their run ids to the same entry (or, in another folder, to an entry with the same launch
record) instead of describing themselves. Entries written afterwards from a folder's own rows say
so in ``source`` and leave what the rows cannot tell as ``unknown``."""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import socket
import sys
import uuid
from pathlib import Path
from typing import Iterable

from lora_bench import __version__
from lora_bench.errors import ResultsError, UsageError
from lora_bench.fileio import atomic_write_text, parse_json
from lora_bench.results.guarded_read import read_results_file
from lora_bench.results.environment import host_environment, source_commit
from lora_bench.results.folder_files import MANIFEST  # noqa: F401
from lora_bench.results.store import locked

INVOCATION_ENV = "LORA_BENCH_INVOCATION"
RECORDED = "recorded at launch"
RECONSTRUCTED = "reconstructed from rows"
UNKNOWN = "unknown"
# read only up to this size: a manifest holds an entry per command and the run ids each wrote (a
# 100,000-run sweep's ids are about 3 MB)
MAX_MANIFEST_BYTES = 64 << 20
# Whether the folder's runs had their GPU to themselves: "shared" where they ran side by side on one
# GPU (an accuracy sweep's seeds, say), so that their clocks measured each other too; reports then
# leave their timed columns out (lora_bench.report.load).
TIMINGS, TIMINGS_MEASURED, TIMINGS_SHARED = "timings", "measured", "shared"
TIMINGS_CHOICES = (TIMINGS_MEASURED, TIMINGS_SHARED)
MAX_DESCRIPTION = 4000  # characters: what a folder holds, in a sentence or two (or a short paragraph)


def description_problem(text: str) -> str | None:
    """Why ``text`` cannot be a folder's description (it is shown in a table row of the index), or None."""
    if len(text) > MAX_DESCRIPTION:
        return f"has {len(text):,} characters; a description has at most {MAX_DESCRIPTION:,} (a sentence or two)"
    if not text.isprintable():
        return ("holds a control character or a line break (e.g. \\n, ESC); a description is one line of "
                "printable text")
    return None


def command_argv(argv: list[str] | None = None) -> list[str]:
    """``sys.argv`` with the executable normalised: the console script and ``python -m lora_bench``
    become ``lora-bench``, a module run with ``-m`` becomes ``python -m <module>``, any other
    script its file name, so that the command reads the same on every machine."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ["python"]
    exe = Path(argv[0])
    if exe.name in ("lora-bench", "__main__.py") and (exe.name == "lora-bench" or exe.parent.name == "lora_bench"):
        return ["lora-bench", *argv[1:]]
    module = _module_of(exe)
    if module:
        return ["python", "-m", module, *argv[1:]]
    return [exe.name, *argv[1:]]


def _module_of(path: Path) -> str:
    """The dotted module name of a file of this repository's packages (``benchmarks.modes``), or ''."""
    if path.suffix != ".py":
        return ""
    parts = [path.stem]
    parent = path.resolve().parent
    while (parent / "__init__.py").is_file():
        parts.insert(0, parent.name)
        parent = parent.parent
    return ".".join(parts) if len(parts) > 1 else ""


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def start_invocation() -> dict:
    """This command's launch record (command line, source commit, start time): inherited from a
    parent process that started it, or made now and exported, so that the processes it starts
    inherit it. Writes nothing: a command that may stop before its first run (a usage error) calls
    this at launch, and its runs record the invocation where they write."""
    argv = command_argv()
    inherited = os.environ.get(INVOCATION_ENV)
    if inherited:
        try:
            launch = json.loads(inherited)
        except ValueError:
            launch = None
        # a child process joins its parent's invocation; in the same process, a new command line
        # (a command called again in-process) is a new invocation
        if isinstance(launch, dict) and (launch.get("pid") != os.getpid() or launch.get("argv") == argv):
            return launch
    commit = source_commit()
    started = _now()
    launch = {
        "id": f"{started}/{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}",
        "pid": os.getpid(),
        "argv": argv,
        "started_at": started,
        "git_commit": commit.sha or UNKNOWN,
        "git_dirty": commit.dirty,
        "commit_source": commit.source,
    }
    os.environ[INVOCATION_ENV] = json.dumps(launch)
    return launch


def read_manifest(results_dir: Path) -> dict:
    """The folder's manifest: ``{"description": str, "invocations": [entry, ...]}`` (empty when none).
    A file that is not one (binary, not JSON, not an object, entries that are not objects) raises
    one ResultsError naming it: it is never overwritten by a command that could not read it."""
    path = Path(results_dir) / MANIFEST
    if not os.path.lexists(path):
        return {"description": "", "invocations": []}

    def refuse(why: str) -> ResultsError:
        return ResultsError(f"{path} is not a lora-bench manifest: {why}. Move it aside and run again (a new one is "
                            "started; `lora-bench results reconstruct` rebuilds one from the folder's rows)")

    data = read_results_file(path, limit=MAX_MANIFEST_BYTES)
    try:
        data = parse_json(data.decode("utf-8")) if data is not None else {}
    except UnicodeDecodeError:
        raise refuse("it holds binary data, not text") from None
    except ValueError as e:
        raise refuse(f"it does not parse as JSON ({str(e)[:160]})") from None
    if not isinstance(data, dict):
        raise refuse(f"it holds a JSON {type(data).__name__}, not an object")
    data.setdefault("description", "")
    data.setdefault("invocations", [])
    if not isinstance(data["description"], str):
        raise refuse("its description is not text")
    if len(data["description"]) > MAX_DESCRIPTION:  # shown in the index: its control characters are escaped there
        raise refuse(f"its description {description_problem(data['description'])}")
    if data.get(TIMINGS, TIMINGS_MEASURED) not in TIMINGS_CHOICES:
        raise refuse(f"its {TIMINGS} is {str(data[TIMINGS])[:40]!r}, not one of {', '.join(TIMINGS_CHOICES)}")
    if not isinstance(data["invocations"], list) or not all(isinstance(e, dict) for e in data["invocations"]):
        raise refuse("its invocations are not a list of objects")
    for i, entry in enumerate(data["invocations"]):
        for key, kind in ENTRY_TYPES.items():
            if key in entry and entry[key] is not None and not isinstance(entry[key], kind):
                raise refuse(f"invocation {i + 1}'s {key} is a {type(entry[key]).__name__}, not a {kind.__name__}")
    return data


# The fields of an invocation entry that readers use, and their JSON types.
ENTRY_TYPES = {"id": str, "source": str, "command": str, "git_commit": str, "commit_source": str, "started_at": str,
               "last_written_at": str,
               "lora_bench_version": str, "git_dirty": bool, "environment": dict, "run_ids": list, "outputs": list}


def _write(results_dir: Path, data: dict) -> None:
    atomic_write_text(Path(results_dir) / MANIFEST, json.dumps(data, indent=1, sort_keys=False) + "\n")


def update_manifest(results_dir: Path, change) -> dict:
    """Read-modify-write the manifest under the folder's lock (sweep shards share folders)."""
    results_dir = Path(results_dir)
    with locked(results_dir / MANIFEST):
        data = read_manifest(results_dir)
        change(data)
        _write(results_dir, data)
    return data


def record_invocation(results_dir: Path, *, run_ids: Iterable[str] = (), outputs: Iterable[str] = ()) -> dict:
    """Record that the running command writes into ``results_dir``: its entry is added on the first
    call (command line, commit, environment, date, version) and the run ids and output files (paths
    relative to the folder) given now and later are added to it, and ``last_written_at`` is set to
    now. Returns the entry."""
    launch = start_invocation()
    run_ids, outputs = list(run_ids), [str(o) for o in outputs]
    entry: dict = {}

    def change(data: dict) -> None:
        nonlocal entry
        for e in data["invocations"]:
            if e.get("id") == launch["id"]:
                entry = e
                break
        else:
            entry = {
                "id": launch["id"],
                "source": RECORDED,
                "command": shlex.join(launch["argv"]),
                "git_commit": launch["git_commit"],
                "git_dirty": launch["git_dirty"],
                "commit_source": launch["commit_source"],
                "started_at": launch["started_at"],
                "lora_bench_version": __version__,
                "environment": host_environment(),
                "run_ids": [],
                "outputs": [],
            }
            data["invocations"].append(entry)
        entry["run_ids"] += [r for r in run_ids if r not in entry["run_ids"]]
        entry["outputs"] += [o for o in outputs if o not in entry["outputs"]]
        # when the command last wrote here: for a sweep, its last run's row, so that
        # last_written_at - started_at is the whole sweep's wall time (to the second)
        entry["last_written_at"] = _now()

    update_manifest(results_dir, change)
    return entry


def set_description(results_dir: Path, text: str, *, question: bool = False) -> None:
    """What the folder holds, in one or two sentences (shown by ``lora-bench results index``);
    ``question``: the folder groups results folders by the question they answer, and ``text`` is it.
    Text with a control character or a line break, or past MAX_DESCRIPTION, is refused (UsageError)."""
    if why := description_problem(text.strip()):
        raise UsageError(f"the description {why}; nothing was written")
    def change(data: dict) -> None:
        data.update(description=text.strip())
        if question:
            data["question"] = True

    update_manifest(results_dir, change)


def set_timings(results_dir: Path, timings: str) -> None:
    """Say whether the folder's runs had their GPU to themselves (``TIMINGS_CHOICES``); "measured",
    the default, is stored as the key's absence. Any other value is refused (UsageError)."""
    if timings not in TIMINGS_CHOICES:
        raise UsageError(f"--timings {timings!r}: use one of {', '.join(TIMINGS_CHOICES)}")

    def change(data: dict) -> None:
        data.pop(TIMINGS, None)
        if timings != TIMINGS_MEASURED:
            data[TIMINGS] = timings

    update_manifest(results_dir, change)


def timings_shared(results_dir: Path) -> bool:
    """Whether the folder's manifest says its runs shared their GPU (a manifest that cannot be read
    says nothing here: the commands that write it name it)."""
    try:
        return read_manifest(results_dir).get(TIMINGS) == TIMINGS_SHARED
    except ResultsError:
        return False


# Row columns that describe where a run ran; a reconstructed entry takes them from the rows.
ROW_ENVIRONMENT = ("gpu_name", "gpu_driver", "torch_version", "cuda_version", "triton_version",
                   "python_version", "platform", "cpu", "hostname")


def reconstruct_entries(rows: list[dict], *, outputs: Iterable[str] = ()) -> list[dict]:
    """Manifest entries rebuilt from a folder's own rows, for results written before the harness
    kept a manifest: one entry per (git_commit, environment, version) group, dated by its earliest
    run. The command line was not recorded; a blank ``git_commit`` stays ``unknown``. Other files
    (``outputs``) are listed only in a folder without rows, in one entry that knows nothing else:
    beside rows, nothing tells which group wrote them."""
    groups: dict[tuple, dict] = {}
    for row in rows:
        env = {k: str(row.get(k) or "") for k in ROW_ENVIRONMENT}
        commit = str(row.get("git_commit") or "")
        version = str(row.get("lora_bench_version") or "") or UNKNOWN
        key = (commit, version, tuple(env.items()))
        g = groups.setdefault(key, {"commit": commit, "version": version, "env": env, "ids": [], "dates": []})
        g["ids"].append(str(row["run_id"]))
        if row.get("started_at"):
            g["dates"].append(str(row["started_at"]))
    entries = []
    for g in sorted(groups.values(), key=lambda g: min(g["dates"], default="")):
        sha = g["commit"].removesuffix("+dirty")
        entries.append({
            "id": f"rows/{len(entries)}",
            "source": RECONSTRUCTED,
            "command": UNKNOWN,
            "git_commit": sha or UNKNOWN,
            "git_dirty": g["commit"].endswith("+dirty") if sha else None,
            "commit_source": "git_commit column" if sha else UNKNOWN,
            "started_at": min(g["dates"], default=UNKNOWN),
            "lora_bench_version": g["version"],
            "environment": g["env"],
            "run_ids": g["ids"],
            "outputs": [],
        })
    outputs = [str(o) for o in outputs]
    if outputs and not entries:  # files without rows (a kernel bench's CSV): nothing tells their origin
        entries.append({"id": "rows/0", "source": RECONSTRUCTED, "command": UNKNOWN, "git_commit": UNKNOWN,
                        "git_dirty": None, "commit_source": UNKNOWN, "started_at": UNKNOWN,
                        "lora_bench_version": UNKNOWN, "environment": {}, "run_ids": [], "outputs": outputs})
    return entries
