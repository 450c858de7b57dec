"""The index's commands reproduce: each command in results/README.md runs from a fresh clone as
written (a config or script in the tree, results into the folder the index names, no path of the
machine it ran on), and no folder's command or commit reads unknown."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from lora_bench.publish.results_index import DATA_FILE, reproducible

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "results" / "README.md"
STARTS = ("lora-bench ", "python -m ", "git checkout ", "taskset ", "OMP_NUM_THREADS=")
SCRATCH = re.compile(r"(^|[\s=/])(\.glue|\.device|/work|/home|/tmp|~)(/|$)|^/|\bDIR\b")
WRITERS = ("train", "sweep", "kernel-bench")
SUBCOMMANDS = (*WRITERS, "results", "report", "compare", "show")


def _commands() -> list[str]:
    text = INDEX.read_text(encoding="utf-8")
    return list(dict.fromkeys(c.replace("\\|", "|") for c in re.findall(r"`([^`]+)`", text) if c.startswith(STARTS)))


def _at_commit(sha: str, path: str) -> bool | None:
    """Whether ``path`` exists at commit ``sha``; None where the history is not here (a shallow clone)."""
    if shutil.which("git") is None:
        return None
    r = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{sha}:{path}"], capture_output=True)
    if r.returncode == 0:
        return True
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{sha}^{{commit}}"], capture_output=True)
    return False if known.returncode == 0 else None


def test_the_index_lists_commands():
    assert len(_commands()) > 20


@pytest.mark.parametrize("command", _commands())
def test_each_command_runs_from_a_fresh_clone(command):
    commit = ""
    m = re.match(r"git checkout ([0-9a-f]{7,40}) && (.*)", command)
    if m:
        commit, command = m.groups()
    tokens = shlex.split(command)
    for t in tokens:
        assert not SCRATCH.search(t), f"a path of the machine it ran on: {t!r} in {command!r}"
    env = [t for t in tokens if re.match(r"^[A-Z_]+=", t)]
    tokens = tokens[len(env):]
    if tokens[:1] == ["taskset"]:
        tokens = tokens[3:]
    if tokens[0] == "lora-bench":
        assert tokens[1] in SUBCOMMANDS, command
        configs = [t for t in tokens if t.endswith(".yaml")]
        assert tokens[1] != "sweep" or configs, command
        for c in configs:
            assert (ROOT / c).is_file(), f"no config {c} in the tree: {command!r}"
    else:
        assert tokens[:2] == ["python", "-m"], command
        script = tokens[2].replace(".", "/") + ".py"
        if commit:  # a script no longer in the tree runs from the commit that recorded it
            assert not (ROOT / script).is_file(), f"{script} is in the tree: no checkout needed"
            assert _at_commit(commit, script) is not False, f"{script} is not in commit {commit}"
        else:
            assert (ROOT / script).is_file(), f"no script {script} in the tree: {command!r}"
    for opt in ("--results-dir", "--out"):
        for i, t in enumerate(tokens[:-1]):
            if t == opt:
                assert tokens[i + 1].startswith("results/"), f"{opt} outside results/: {command!r}"
                assert (ROOT / tokens[i + 1]).exists() or (ROOT / tokens[i + 1]).parent.is_dir(), command
    for i, t in enumerate(tokens[:-1]):
        if t == "--data-file":
            assert (ROOT / tokens[i + 1]).is_file(), command
    if tokens[0] == "lora-bench" and tokens[1] in WRITERS:
        assert "--results-dir" in tokens, f"results would go to the default folder: {command!r}"
    else:  # a reader: the folders it reads are in the tree
        for t in tokens:
            assert not t.startswith("results/") or (ROOT / t).exists(), command


def test_no_command_or_commit_reads_unknown():
    tables = INDEX.read_text(encoding="utf-8").split("\n## ", 1)[1]  # past the preamble, which defines the word
    assert "unknown" not in tables


def test_reproducible_rewrites_machine_paths_and_nothing_else():
    assert reproducible("lora-bench sweep configs/a.yaml --shard 1/5 --data-file .device/data/SMSSpamCollection.tsv "
                        "--results-dir .glue/study/answer/study", folder="results/answer/study") == (
        f"lora-bench sweep configs/a.yaml --shard 1/5 --data-file {DATA_FILE} --results-dir results/answer/study")
    assert reproducible("lora-bench train --results-dir a --overwrite --results-dir b --run-id x", folder="results/f") == (
        "lora-bench train --overwrite --results-dir results/f --run-id x")
    assert reproducible("lora-bench train --weights random", folder="results/f") == (
        "lora-bench train --weights random --results-dir results/f")
    assert reproducible("python -m benchmarks.modes --steps 40 --results-dir DIR", folder="results/f") == (
        "python -m benchmarks.modes --steps 40 --results-dir results/f")
    assert reproducible("python -m benchmarks.gone --out results/old/x.csv", folder="results/f", commit="abc1234") == (
        "git checkout abc1234 && python -m benchmarks.gone --out results/f/x.csv")
    assert reproducible("python -m benchmarks.timer_overhead --blocks 16", folder="results/f") == (
        "python -m benchmarks.timer_overhead --blocks 16")


def test_no_manifest_records_a_path_of_the_machine_it_ran_on():
    """The recorded command lines name the tree's own paths: no scratch folder or absolute path a
    reader of a fresh clone cannot have."""
    import json

    bad = []
    for manifest in sorted((ROOT / "results").rglob("manifest.json")):
        for entry in json.loads(manifest.read_text(encoding="utf-8")).get("invocations", []):
            command = str(entry.get("command") or "")
            if any(SCRATCH.search(t) for t in command.split()):
                bad.append(f"{manifest.relative_to(ROOT)}: {command}")
    assert not bad, "\n".join(bad)


MACHINE_PATH = re.compile(r"(?<![\w.~-])(/tmp|/work|/home|/root|/opt|/usr|/var|/mnt|/private)/|(^|[\s=\"'(])\.(glue|device)/")


def test_no_committed_result_names_a_path_of_the_machine_it_ran_on():
    """Logs, tables, profiles and records under results/ name files by the tree's own paths: a path
    on the machine a run was made on means nothing to a reader of a fresh clone."""
    bad = []
    for path in sorted((ROOT / "results").rglob("*")):
        if not path.is_file() or path.suffix in (".png", ".gz"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:160]}")
    assert not bad, "\n".join(bad[:40])


def test_the_machine_path_rule_catches_scratch_paths_and_passes_tree_paths():
    assert MACHINE_PATH.search("results: /tmp/res/row10/runs.csv")
    assert MACHINE_PATH.search("File: /work/main/lora_bench/train.py")
    assert MACHINE_PATH.search('"data_file": ".glue/SMSSpamCollection.tsv"')
    assert not MACHINE_PATH.search("results: results/answer/whole-runs/row10/runs.csv")
    assert not MACHINE_PATH.search("File: lora_bench/train.py  ~/.cache/lora-bench/gpt2 at 1/5 steps")
