"""The repository speaks only of itself: no tracked file tells the story of its own development
(numbered sessions, rounds of work or runs on a remote GPU machine, issue numbers, version labels
of the code) and no script for driving a remote machine is tracked. Measured results are data and
are not searched; their index (``results/README.md``) is."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

HISTORY = [
    (re.compile(r"\bsessions? \d", re.I), "a numbered session"),
    (re.compile(r"(?<![A-Za-z0-9])s\d+call\d", re.I), "a session/call label"),
    (re.compile(r"(?<![A-Za-z0-9])calls? ?_?\d{1,2}\b", re.I), "a numbered call"),
    (re.compile(r"\bissues? #?\d+", re.I), "an issue number"),
    (re.compile(r"\bround \d", re.I), "a numbered round of work"),
    (re.compile(r"(?<![\w.@/-])v\d+\b(?!\.\d)"), "a version label"),
    (re.compile(r"device_(run|next|env)\w*"), "a remote-machine script"),
    (re.compile(r"\blent (gpu|machine|h200)|\blease\b", re.I), "a lent machine"),
    (re.compile(r"\$OUT\b|\$\{OUT\}|\.devdata|\.whl/"), "remote-machine glue"),
]
REMOTE_SCRIPT = re.compile(r"(^|/)device_[^/]*\.sh$")
# result data: measured values, logs and files the harness wrote (their index is searched)
DATA = re.compile(r"^results/.*\.(csv|json|log|txt|gz|png|pdf|svg)$")
# copies of such files kept as test fixtures, and third-party text (the SMS corpus: its messages say
# "Call 4" and "round 4" for reasons of their own)
FIXTURE_DATA = re.compile(r"^tests/fixtures/.*\.(csv|json|log|txt)$|\.tsv$")
BINARY = (".png", ".gz", ".pdf", ".whl", ".so", ".pt", ".pyc", ".jpg", ".zip")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True,
                             timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc})")
    return [f for f in out.split("\0") if f]


EMBEDDED = re.compile(r"data:[\w/+.-]+;base64,[A-Za-z0-9+/=]+")


def history_hits(files: list[str], *, root: Path = ROOT) -> list[str]:
    hits = []
    for rel in files:
        if rel == THIS or DATA.match(rel) or FIXTURE_DATA.search(rel) or rel.endswith(BINARY):
            continue
        if REMOTE_SCRIPT.search(rel):
            hits.append(f"{rel}: a remote-machine script")
            continue
        path = root / rel
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(EMBEDDED.sub("data:", text).splitlines(), 1):  # an image's bytes are no text
            for pattern, what in HISTORY:
                m = pattern.search(line)
                if m:
                    hits.append(f"{rel}:{number}: {what} ({m.group(0)!r}): {line.strip()[:120]}")
    return hits


def test_no_development_history_in_tracked_files():
    hits = history_hits(tracked_files())
    assert not hits, f"{len(hits)} hit(s):\n" + "\n".join(hits)


def test_the_search_finds_what_it_looks_for(tmp_path):
    """Each pattern fires on a sample of the language it exists to catch, and not on ordinary prose."""
    samples = {
        "a.md": "Measured in session 4 on the lent GPU machine (call 2), see issue 12; NOTES v7.",
        "b.py": "# kernel_bench_direct_s4call1_bf16.csv from device_next.sh, copied to $OUT and .devdata/",
        "c.md": ("Implementations are timed in rounds of 20 repeats; PyTorch 2.11; actions/checkout@v4; 1.0v2; "
                 "recall 3 things; Call 09061701461 now."),
        "scripts/device_run1.sh": "echo",
    }
    for name, text in samples.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    hits = history_hits(list(samples), root=tmp_path)
    found = {h.split(": ", 1)[1].split(" (")[0] for h in hits if h.startswith("a.md")}
    assert {"a numbered session", "a lent machine", "a numbered call", "an issue number", "a version label"} <= found
    assert sum(h.startswith("b.py") for h in hits) >= 3
    assert not [h for h in hits if h.startswith("c.md")], hits
    assert "scripts/device_run1.sh: a remote-machine script" in hits
