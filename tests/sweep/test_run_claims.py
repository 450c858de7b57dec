"""A run is executed by one process at a time: its folder's claim is respected by resumes and by
concurrent sweeps, and a sweep's worker dies with it. Real processes where the claim must survive
(or end with) a process."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from tiny import TINY_BASE

from lora_bench.results import claims
from lora_bench.results.claims import claimant, try_claim
from lora_bench.results.records import run_record
from lora_bench.sweep.spec import load_sweep
from paths import FIXTURES

BASE = "base:\n" + TINY_BASE
TINY_TRAIN = ["--model-size", "tiny", "--weights", "random", "--device", "cpu", "--no-progress", "--max-steps", "2",
              "--warmup-steps", "1", "--eval-freq", "0", "--skip-final-eval", "--data-file",
              str(FIXTURES / "sms_spam_sample.tsv")]


def _sweep(tmp_path: Path, runs: str, name: str = "c") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\n" + BASE + textwrap.dedent(runs))
    return path


def is_claimed(run_dir: Path) -> bool:
    claim = try_claim(run_dir)
    if claim is None:
        return True
    claim.release()
    return False


def _rows(results: Path) -> list[dict]:
    return list(csv.DictReader(open(results / "runs.csv")))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_claim_is_exclusive_and_ends_with_its_process(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
        import sys, time
        from lora_bench.results.claims import try_claim
        claim = try_claim({str(tmp_path / "run")!r})
        print("held", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert try_claim(tmp_path / "run") is None and is_claimed(tmp_path / "run")
        assert claimant(tmp_path / "run") == holder.pid
    finally:
        holder.kill()  # SIGKILL: no clean-up code runs, the kernel drops the lock
        holder.wait()
    claim = try_claim(tmp_path / "run")
    assert claim is not None and claimant(tmp_path / "run") == os.getpid()
    claim.release()
    assert not is_claimed(tmp_path / "run")


@pytest.mark.slow
def test_a_killed_sweep_leaves_no_worker_and_the_resume_runs_the_run_once(tmp_path, monkeypatch, run_cli):
    path = _sweep(tmp_path, """\
        runs:
          - {label: slow, max_steps: 5000, num_epochs: 1000, eval_freq: 1, eval_iter: 1}
        """)
    results = tmp_path / "res"
    run_id = load_sweep(path).runs[0].run_id
    run_dir = results / run_id
    parent = subprocess.Popen([sys.executable, "-m", "lora_bench", "sweep", str(path), "--results-dir", str(results),
                               "--cache-dir", str(tmp_path / "cache"), "--no-progress"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: "Step" in _text(run_dir / "worker.log"), 180, "the worker to train")
        worker = claimant(run_dir)
        assert worker and worker != parent.pid and _alive(worker)
    finally:
        parent.kill()  # SIGKILL: the sweep cannot forward anything
        parent.wait()
    _wait_for(lambda: not _alive(worker), 30, "the worker to die with its sweep")
    _wait_for(lambda: not is_claimed(run_dir), 30, "the worker's last thread to let go of the run")
    row = run_record(run_dir)
    assert row["status"] == "interrupted" and f"the sweep process {parent.pid} died" in row["error"], row

    import lora_bench.train.run as run_mod

    calls, real = [], run_mod.execute

    def short(points, **kw):  # rerun for real, a few steps only (the id stays the sweep's)
        calls.extend(p.run_id for p in points)
        return real([replace(p, cfg=p.cfg.replace(max_steps=2, eval_freq=0)) for p in points], **kw)

    monkeypatch.setattr(run_mod, "execute", short)
    code, out = run_cli("sweep", path, "--results-dir", results, "--cache-dir", tmp_path / "cache",
                        "--isolation", "inline", "--no-progress")
    assert code == 0, out
    assert calls == [run_id]
    rows = _rows(results)
    assert [(r["run_id"], r["status"]) for r in rows] == [(run_id, "done")]


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_a_resume_waits_for_a_run_held_elsewhere_and_never_runs_it_twice(tmp_path, monkeypatch, run_cli):
    """Another process holds run a: the sweep runs b, then waits for a. When the other process
    finishes a, the sweep skips it; when it dies without finishing, the sweep runs it."""
    path = _sweep(tmp_path, """\
        runs:
          - {label: a}
          - {label: b, seed: 2}
        """)
    results = tmp_path / "res"
    a, b = (r.run_id for r in load_sweep(path).runs)

    import lora_bench.train.run as run_mod

    calls, real = [], run_mod.execute
    monkeypatch.setattr(run_mod, "execute", lambda points, **kw: calls.extend(p.run_id for p in points) or real(points, **kw))
    common = ("--results-dir", results, "--cache-dir", tmp_path / "cache", "--isolation", "inline", "--no-progress")

    def other_process(finish: bool) -> threading.Thread:
        held = try_claim(results / a)

        def work():
            _wait_for(lambda: b in calls, 120, "the sweep to move on to b")
            time.sleep(0.5)
            if finish:
                (results / a / "run.json").write_text(json.dumps(
                    {"row": {"run_id": a, "status": "done", "started_at": "2030-01-01T00:00:00+00:00",
                             "sweep_name": "c", "repeat": 0}, "log": []}))
            held.release()

        thread = threading.Thread(target=work)
        thread.start()
        return thread

    thread = other_process(finish=True)
    code, out = run_cli("sweep", path, *common)
    thread.join()
    assert code == 0, out
    assert calls == [b] and "running in another process" in out and "1 done by another process" in out
    statuses = {r["run_id"]: r["status"] for r in _rows(results)}
    assert statuses == {a: "done", b: "done"}

    calls.clear()
    results = tmp_path / "res2"  # now the other process lets go of a without finishing it
    common = ("--results-dir", results, *common[2:])
    thread = other_process(finish=False)
    code, out = run_cli("sweep", path, *common)
    thread.join()
    assert code == 0, out
    assert calls == [b, a]  # a ran once, after the other process let go
    assert {r["run_id"]: r["status"] for r in _rows(results)} == {a: "done", b: "done"}


def test_fresh_refuses_to_forget_a_run_held_elsewhere(tmp_path, run_cli):
    path = _sweep(tmp_path, "runs:\n  - {label: a}\n")
    results = tmp_path / "res"
    run_id = load_sweep(path).runs[0].run_id
    held = try_claim(results / run_id)
    (results / run_id / "keep.txt").write_text("x")
    try:
        code, out = run_cli("sweep", path, "--results-dir", results, "--fresh", "--isolation", "inline",
                            "--no-progress")
    finally:
        held.release()
    assert code == 2 and "being executed by another process" in out and "Traceback" not in out, out
    assert (results / run_id / "keep.txt").exists()


@pytest.mark.slow
def test_two_identical_sweeps_started_at_once_run_every_run_once(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    count = tmp_path / "executions.txt"
    # test-only: each worker child appends its run id when it starts
    (hook / "sitecustomize.py").write_text(textwrap.dedent(f"""\
        import json, sys
        if sys.argv and sys.argv[-1].endswith("job.json"):
            with open({str(count)!r}, "a") as f:
                f.write("".join(p["run_id"] + "\\n" for p in json.load(open(sys.argv[-1]))["points"]))
        """))
    path = _sweep(tmp_path, """\
        runs:
          - {label: a}
          - {label: b, seed: 2}
          - {label: c, seed: 3}
        """)
    results = tmp_path / "res"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "lora_bench", "sweep", str(path), "--results-dir", str(results), "--cache-dir",
           str(tmp_path / "cache"), "--no-progress"]
    sweeps = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
              for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in sweeps]
    assert [p.returncode for p in sweeps] == [0, 0], outs
    executed = count.read_text().split()
    ids = [r.run_id for r in load_sweep(path).runs]
    assert sorted(executed) == sorted(ids)  # each run executed exactly once, by one of the two
    rows = _rows(results)
    assert sorted(r["run_id"] for r in rows) == sorted(ids) and {r["status"] for r in rows} == {"done"}
    done_here = sum(int(_count(o, "done")) for o in outs)
    assert done_here == 3, outs


def _count(out: str, what: str) -> str:
    m = re.search(rf"(\d+) {what}\b", out)
    return m.group(1) if m else "0"


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_die_with_parent_delivers_the_signal(tmp_path):
    """A grandchild asks for SIGTERM at its parent's death; the parent is SIGKILLed."""
    marker = tmp_path / "got-signal"
    script = textwrap.dedent(f"""\
        import os, signal, subprocess, sys, time
        if sys.argv[1:] == ["child"]:
            from lora_bench.sweep.isolation import die_with_parent
            signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, "w").write("TERM"), os._exit(0)))
            die_with_parent(int(os.environ["PARENT"]))
            print("ready", flush=True)
            time.sleep(600)
        else:
            child = subprocess.Popen([sys.executable, __file__, "child"], env={{**os.environ, "PARENT": str(os.getpid())}})
            time.sleep(600)
        """)
    (tmp_path / "s.py").write_text(script)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "s.py")], stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "ready"
    parent.kill()
    parent.wait()
    # the file exists from open() on, before "TERM" is written: wait for the content
    _wait_for(lambda: marker.exists() and marker.read_text() == "TERM", 30, "the child to get SIGTERM")


def test_finished_folders_keep_no_claim_or_lock_and_a_removed_claim_is_never_held_twice(tmp_path, run_cli):
    """The process that claims a run folder, or locks runs.csv or manifest.json, removes the file
    when it lets go; one that opened the file before its removal and locks it then sees that the
    path names another file, and claims anew: never two holders."""
    sweep = _sweep(tmp_path, "grid:\n  seed: [1, 2]\n")
    code, out = run_cli("sweep", sweep, "--results-dir", tmp_path / "r", "--no-progress")
    assert code == 0, out
    code, out = run_cli("train", *TINY_TRAIN, "--results-dir", tmp_path / "r", "--run-id", "one")
    assert code == 0, out
    left = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "r").rglob("*")
                  if p.name == ".claim" or p.name.endswith(".lock"))
    assert left == []

    first = try_claim(tmp_path / "x")
    early = os.open(tmp_path / "x" / ".claim", os.O_RDWR)  # a waiter that opened the file in time
    first.release()
    assert not (tmp_path / "x" / ".claim").exists()
    import fcntl

    fcntl.flock(early, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it gets the lock, on a file nobody can open now
    second = try_claim(tmp_path / "x")
    try:
        assert second is not None and try_claim(tmp_path / "x") is None and claims.is_claimed(tmp_path / "x")
    finally:
        second.release()
        os.close(early)
    assert not claims.is_claimed(tmp_path / "x")


def test_a_claim_holds_on_a_disk_with_no_room_for_its_pid(tmp_path, monkeypatch):
    """The pid in .claim is for messages; a full disk refusing those few bytes leaves the lock held,
    so the run is refused later for want of room to record it, with one message."""
    import errno

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    claim = try_claim(tmp_path / "x")
    assert claim is not None and try_claim(tmp_path / "x") is None
    claim.release()
