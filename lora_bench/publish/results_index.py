"""The index of a folder of results folders (``results/README.md``), generated from each folder's
``manifest.json`` and rows, never written by hand: what each folder holds, the commands and source
commits that wrote it, the device, the dates, and how many rows it has."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from lora_bench.errors import ResultsError
from lora_bench.escaping import markdown_cell, markdown_code, markdown_text
from lora_bench.fileio import atomic_write_text
from lora_bench.results.guarded_read import outside, read_results_file
from lora_bench.results.claims import CLAIM_NAME
from lora_bench.results.index import INDEX
from lora_bench.results.manifest import MANIFEST, RECONSTRUCTED, UNKNOWN, read_manifest
from lora_bench.results.prune import SUPERSEDED
from lora_bench.results.store import result_rows

# files every run folder has; the index counts runs, not these
PER_RUN_FILES = ("steps.csv", "run.json", "worker.log", "job.json")
MAX_LISTED_CSV_BYTES = 1 << 30  # a CSV file the index counts the rows of (runs.csv's own limit)


@dataclass
class FolderSummary:
    name: str
    description: str
    commands: list[str]
    commits: list[str]
    devices: list[str]
    dates: list[str]
    runs: int = 0
    done: int = 0
    superseded: int = 0
    superseded_commits: list[str] = field(default_factory=list)
    reconstructed: bool = False
    path: str = ""  # the folder as commands from the checkout name it (results/answer/study)
    row_files: list[str] = field(default_factory=list)  # the runs.csv files the runs come from
    files: list[tuple[str, str]] = field(default_factory=list)  # (path, what: row count or size)


def results_folders(root: Path) -> list[Path]:
    """Folders directly under ``root`` that hold a manifest, runs.csv or other result files; a link
    to a folder outside ``root`` is not followed (the index lists what the root holds)."""
    return sorted(p for p in Path(root).iterdir()
                  if p.is_dir() and not p.name.startswith(".") and not outside(p, root))


def _csv_rows(path: Path, root: Path) -> int:
    """The rows of a CSV file of the folder ``root`` (read through ``guarded_read``: a file that is
    not one, a link out, or past MAX_LISTED_CSV_BYTES counts 0 rows)."""
    try:
        data = read_results_file(path, limit=MAX_LISTED_CSV_BYTES, root=root)
        return len(pd.read_csv(io.BytesIO(data or b""), dtype=str, keep_default_na=False))
    except (ResultsError, pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError):
        return 0


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _size(path: Path) -> str:
    n = path.stat().st_size
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def _unique(values) -> list[str]:
    out: list[str] = []
    for v in values:
        v = str(v or "").strip()
        if v and v not in out:
            out.append(v)
    return out


def _commits(entries: list[dict]) -> list[str]:
    out = []
    for e in entries:
        sha = e.get("git_commit") or UNKNOWN
        label = sha if sha == UNKNOWN else sha[:12] + (" (uncommitted changes)" if e.get("git_dirty") else "")
        if e.get("commit_source") == "LORA_BENCH_GIT_COMMIT":
            label += " (passed in)"
        elif e.get("commit_source") == ROWS_ADDED:
            label += " (rows added; ran at or before it)"
        out.append(label)
    return _unique(out)


def _has_rows(folder: Path) -> bool:
    return (folder / "runs.csv").is_file() or any(folder.glob("*/run.json"))


def sub_studies(folder: Path) -> list[Path]:
    """Folders directly inside ``folder`` that are results folders of their own (a manifest or a
    runs.csv: e.g. a study's one-GPU and two-GPU runs), not run folders and not superseded rows."""
    return sorted(p for p in Path(folder).iterdir()
                  if p.is_dir() and p.name != SUPERSEDED and not p.name.startswith(".")
                  and not (p / "run.json").is_file() and ((p / MANIFEST).is_file() or (p / "runs.csv").is_file()))


def _shown(path: Path, root: Path | None) -> str:
    """The folder as a command from the checkout names it: results/answer/study."""
    if root is None:
        return Path(path).as_posix()
    return (Path(Path(root).resolve().name) / Path(path).resolve().relative_to(Path(root).resolve())).as_posix()


def summarise(folder: Path, *, root: Path | None = None) -> FolderSummary:
    """One folder's summary; the provenance and rows of its sub-studies count as its own. Its
    commands are as they run from a fresh clone (``reproducible``), into the folder under ``root``."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    parts = [folder, *sub_studies(folder)]
    located = [(part, e) for part in parts for e in read_manifest(part)["invocations"]]
    entries = [e for _, e in located]
    rows = [r for part in parts if _has_rows(part) for r in result_rows(part)]
    env = [e.get("environment", {}) for e in entries]
    devices = _unique([r.get("gpu_name") or r.get("device") for r in rows]
                      + [x.get("gpu_name") or x.get("gpus") for x in env])
    commits = _commits(entries)
    dates = sorted(_unique([str(r.get("started_at", ""))[:10] for r in rows]
                           + [str(e.get("started_at", ""))[:10] for e in entries if e.get("started_at") != UNKNOWN]))
    summary = FolderSummary(
        name=folder.name, description=manifest.get("description", ""),
        commands=_unique(e.get("command") if e.get("command") in (None, UNKNOWN) else
                         reproducible(e["command"], folder=_shown(part, root), commit=str(e.get("git_commit") or ""))
                         for part, e in located),
        commits=_unique(commits), devices=devices,
        dates=[dates[0], dates[-1]] if len(dates) > 1 else dates,
        runs=len(rows), done=sum(r.get("status") == "done" for r in rows),
        superseded=_csv_rows(folder / SUPERSEDED / "runs.csv", folder) if (folder / SUPERSEDED / "runs.csv").is_file() else 0,
        superseded_commits=_commits(read_manifest(folder / SUPERSEDED)["invocations"]),
        reconstructed=any(e.get("source") == RECONSTRUCTED for e in entries), path=_shown(folder, root),
        row_files=[(p.relative_to(folder) / "runs.csv").as_posix() for p in parts if _has_rows(p)])
    run_dirs = {r["run_id"] for r in rows}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if not path.is_file() or path.name in (MANIFEST, INDEX, CLAIM_NAME) or path.name.endswith(".lock"):
            continue  # the manifest is summarised above; claims and write locks are process state
        in_run_dir = rel.parts[0] in run_dirs or (path.parent / "run.json").is_file()  # also in nested folders
        if rel.parts[0] == SUPERSEDED or (len(rel.parts) > 1 and in_run_dir and path.name in PER_RUN_FILES):
            continue
        if path.is_symlink() and outside(path, folder):
            continue  # not the folder's own file
        what = _rows(_csv_rows(path, folder)) if path.suffix == ".csv" else _size(path)
        summary.files.append((rel.as_posix(), what))
    return summary


def _cell(items: list[str], *, code: bool = False) -> str:
    if not items:
        return UNKNOWN
    return "<br>".join(markdown_code(i) if code and i != UNKNOWN else markdown_cell(i) for i in items)


REPRODUCE = re.compile(r"Reproduce: `([^`]+)`")
DATA_FILE = "lora_bench/data/SMSSpamCollection.tsv"  # the data set the tree carries
ROWS_ADDED = "git history: the commit that added the rows"  # a manifest's commit_source, for rows older than it
_ROOT = Path(__file__).resolve().parents[2]  # the checkout: whether a benchmark script is still in it
WRITERS = ("lora-bench train", "lora-bench sweep", "lora-bench kernel-bench")  # take --results-dir


def reproducible(command: str, *, folder: str, commit: str = "") -> str:
    """A recorded command as it runs from a fresh clone: its results go to ``folder`` (the
    results folder the index names; a scratch folder of the machine it ran on, or a folder since
    renamed, is replaced), ``--data-file`` reads the data the tree carries, a benchmark script no
    longer in the tree runs after checking out ``commit``. Anything else is left as recorded."""
    tokens = command.split()
    out: list[str] = []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        key, eq, val = t.partition("=")
        if key in ("--results-dir", "--data-file", "--out") and (eq or i + 1 < len(tokens)):
            value = val if eq else tokens[i + 1]
            i += 1 if eq else 2
            if key == "--results-dir":
                out = _drop_option(out, key)  # given twice: the last one counted
                out += [key, folder]
            elif key == "--data-file":
                out += [key, DATA_FILE if value.endswith("/SMSSpamCollection.tsv") or value == "SMSSpamCollection.tsv"
                        else value]
            else:
                out += [key, f"{folder}/{value.rsplit('/', 1)[-1]}"]
            continue
        out.append("" if t == "DIR" else t)
        i += 1
    text = " ".join(t for t in out if t)
    if (text.startswith(WRITERS) or "DIR" in tokens) and "--results-dir" not in out:
        text += f" --results-dir {folder}"
    script = re.match(r"python -m (benchmarks\.\w+)", text)
    if script and commit and not (_ROOT / (script.group(1).replace(".", "/") + ".py")).is_file():
        text = f"git checkout {commit} && {text}"
    return text



def _drop_option(tokens: list[str], key: str) -> list[str]:
    if key not in tokens:
        return tokens
    at = tokens.index(key)
    return tokens[:at] + tokens[at + 2:]


def command_cell(s: FolderSummary) -> str:
    """The folder's command for the index: the one recorded (the first of several, counted), or,
    where the rows could not tell it, the command its description gives to reproduce it."""
    known = [c for c in s.commands if c != UNKNOWN]
    if known:
        more = f" (+{len(known) - 1} more)" if len(known) > 1 else ""
        return f"{markdown_code(known[0])}{more}"
    return reproduce_text(s)


def reproduce_text(s: FolderSummary) -> str:
    """'reproduce: `COMMAND`' from the folder's description, where the rows could not tell the
    command; unknown where the description names none."""
    m = REPRODUCE.search(s.description)
    return f"reproduce: {markdown_code(reproducible(m.group(1), folder=s.path))}" if m else UNKNOWN


def _what(text: str) -> str:
    """A description's first sentence in a table cell: its Markdown marks (`code`) kept, its HTML
    and control characters escaped, a ``|`` or a line break never splitting the row."""
    return markdown_text(text).replace("|", "/").replace("\n", " ")


def is_group(folder: Path) -> bool:
    """A folder of results folders grouped by the question they answer: its manifest says so
    (``lora-bench results describe FOLDER QUESTION --question``)."""
    return bool(read_manifest(folder).get("question"))


def render_index(root: Path, *, names: list[str] | None = None) -> str:
    """The Markdown index of every results folder under ``root`` (or of the folders ``names``): a
    short table per question (a group folder), then each folder's provenance in detail."""
    lines = [
        "# Results",
        "",
        "Generated by `lora-bench results index` from each folder's `manifest.json` and rows; do not edit.",
        "A manifest entry is written by the harness when a command writes into the folder: the command",
        "line, the source commit taken at launch, the environment, the date and the runs it produced.",
        f"Entries marked *{RECONSTRUCTED}* were rebuilt from the rows' own columns for results written",
        f"before the folder had a manifest; what the rows do not record reads *{UNKNOWN}* (the index then",
        "gives the command the folder's description names to reproduce it). Rows replaced by a newer run of",
        f"the same sweep settings and repeat are kept, numbers untouched, in `<folder>/{SUPERSEDED}/`.",
        "Commands read as they run from a fresh clone: results go to the folder named here, `--data-file` reads",
        "the data set the tree carries, and a benchmark script no longer in the tree runs after checking out",
        "the commit that recorded it; each `manifest.json` keeps the command line as recorded. There and in the",
        "run records a copy of the data set outside the checkout is named as the tree's own (the same bytes) and",
        "a scratch results folder as the folder the runs now lie in. A commit",
        "marked *rows added* is the one that added rows older than their manifest: they ran at or before it.",
    ]
    sections: list[tuple[str, str, list[FolderSummary]]] = []
    for f in results_folders(root):
        if names is not None and f.name not in names:
            continue
        if is_group(f):
            subs = []
            for p in results_folders(f):
                nested = [p] if (p / MANIFEST).is_file() or _has_rows(p) else results_folders(p)  # a folder of them
                for q in nested:
                    if (q / MANIFEST).is_file() or _has_rows(q):
                        sub = summarise(q, root=root)
                        sub.name = q.relative_to(root).as_posix()
                        subs.append(sub)
            sections.append((f.name, read_manifest(f)["description"], subs))
        else:
            sections.append(("", "", [summarise(f, root=root)]))
    for group, question, folders in sections:
        lines += ["", f"## {group}: {question}" if group else "## other", ""]
        lines += ["| folder | what | command | commit | device | dates | runs |", "|---|---|---|---|---|---|---|"]
        for s in folders:
            runs = f"{s.runs}" + (f" (+{s.superseded} superseded)" if s.superseded else "") if s.runs else "-"
            what = (s.description.split(". ")[0].rstrip(".") if s.description else "") or "-"
            anchor = s.name.replace("/", "")
            lines.append(f"| [{markdown_code(s.name + '/')}](#{anchor}) | {_what(what)} | "
                         f"{command_cell(s)} | "
                         f"{_cell(s.commits)} | {_cell(s.devices)} | {' to '.join(s.dates) or UNKNOWN} | {runs} |")
    for _, _, folders in sections:
        for s in folders:
            lines += ["", f"### {markdown_cell(s.name)}", ""]
            if s.description:  # its Markdown marks kept; HTML, control characters and line breaks not
                lines += [markdown_text(s.description).replace("\n", " "), ""]
            commands = ", ".join(dict.fromkeys(markdown_code(c) if c != UNKNOWN else reproduce_text(s)
                                               for c in s.commands)) or UNKNOWN
            if len(s.commands) > 3:  # a study of many commands: folded
                commands = f"<details><summary>{len(s.commands)} commands</summary>{commands}</details>"
            lines.append(f"- command{'s' if len(s.commands) > 1 else ''}: {commands}"
                         + (f" ({RECONSTRUCTED})" if s.reconstructed else ""))
            lines.append(f"- source commit{'s' if len(s.commits) > 1 else ''}: {', '.join(s.commits) or UNKNOWN}")
            lines.append(f"- device: {', '.join(map(markdown_cell, s.devices)) or UNKNOWN}")  # from the rows: any text
            lines.append(f"- dates (UTC): {' to '.join(s.dates) or UNKNOWN}")
            if s.runs:
                lines.append(f"- runs: {s.runs} in {_cell(s.row_files, code=True).replace('<br>', ', ')} "
                             f"({s.done} done)"
                             + (f"; {s.superseded} superseded in `{SUPERSEDED}/runs.csv`" if s.superseded else "")
                             + (f" (source commits {', '.join(s.superseded_commits)})" if s.superseded_commits else ""))
            if s.files:
                lines.append("- files: " + ", ".join(f"{markdown_code(p)} ({w})" for p, w in s.files))
    return "\n".join(lines) + "\n"


def write_index(root: Path) -> Path:
    path = Path(root) / INDEX
    atomic_write_text(path, render_index(root))
    return path
