"""Saving a run's record (lora_bench.results.save): steps.csv, run.json and the runs.csv row agree
whatever stops the process at whatever write (a signal waits; SIGKILL leaves a record the next
reader and writer mark interrupted), and a folder that takes no more ends the save with one clear
error and the run recorded as failed as far as that fits."""

from __future__ import annotations

import csv
import errno
import os
import resource
import signal
import subprocess
import sys

import pytest

import lora_bench.fileio as fileio
from lora_bench.errors import SaveError
from lora_bench.results.claims import claim_run
from lora_bench.results.records import run_record
from lora_bench.results.save import begin_record, save_record
from lora_bench.results.lookup import find_run
from lora_bench.results.store import RUNS_CSV, read_run_table, result_rows, upsert_run
from lora_bench.signals import signals_deferred
from paths import FIXTURES

SAMPLE = FIXTURES / "sms_spam_sample.tsv"
STARTED = "2026-01-02T03:04:05+00:00"
EARLIER = "2026-01-01T00:00:00+00:00"
STEPS = 3


def _row(status: str, *, started: str = STARTED, seed: int = 7) -> dict:
    row = {"run_id": "r", "status": status, "started_at": started, "cfg_seed": seed}
    if status == "done":
        row.update(steps=STEPS, measured_steps=STEPS, step_ms_median=1.5)
    return row


def _steps() -> list[dict]:
    return [{"run_id": "r", "step": i, "epoch": 1, "warmup": False, "step_ms": 1.5} for i in range(STEPS)]


def _save_one_run(results) -> None:
    """What a run does: claim its folder, begin its record, train, finish its record."""
    with claim_run(results / "r"):
        begin_record(results, _row("running"))
        save_record(results, _row("done"), steps=_steps(), log=["trained"], curves={"train_losses": [0.5]})


def _in_child(results, *, stop_at: int, signum: int) -> tuple[int, int]:
    """Save a run in a forked process that sends itself ``signum`` as its ``stop_at``-th file
    write is about to be published (each atomic write is published once); returns (the writes
    it published, its wait status)."""
    reads, writes = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the default action for SIGTERM and SIGKILL, no test machinery
        code = 1
        try:
            os.close(reads)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            real, count = fileio.publish, [0]

            def publish(tmp, dest):
                if count[0] == stop_at:
                    os.kill(os.getpid(), signum)
                count[0] += 1
                os.write(writes, b".")
                real(tmp, dest)

            fileio.publish = publish
            _save_one_run(results)
            code = 0
        finally:
            os._exit(code)
    os.close(writes)
    published = 0
    while chunk := os.read(reads, 64):
        published += len(chunk)
    os.close(reads)
    _, status = os.waitpid(pid, 0)
    return published, status


def _files(results) -> tuple[dict | None, dict | None, int | None]:
    """(run.json's row, the runs.csv row, steps.csv's row count or None) of run r, as stored."""
    record = run_record(results / "r")
    table = read_run_table(results / RUNS_CSV) if (results / RUNS_CSV).is_file() else None
    row = next((r for r in table.rows if r["run_id"] == "r"), None) if table else None
    steps = results / "r" / "steps.csv"
    n = len(list(csv.DictReader(open(steps)))) if steps.is_file() else None
    return record, row, n


def _assert_whole(results) -> str:
    """The invariant: readers see run r fully recorded (this attempt's or the earlier one's) or
    interrupted, never half; after the next write into the folder, the files themselves agree."""
    seen = find_run(results, "r")
    assert [r["run_id"] for r in result_rows(results) if r["run_id"] == "r"] == ["r"]
    status = seen["status"]
    assert status in ("done", "interrupted"), seen
    if status == "done":  # whole: steps.csv holds the steps the row counts
        assert _files(results)[2] == int(seen["steps"]) == STEPS
    upsert_run(results / RUNS_CSV, {"run_id": "other", "status": "done"})  # the next write
    record, row, steps = _files(results)
    assert record is not None and row is not None
    assert (record["status"], record["started_at"], float(record["cfg_seed"])) == (
        row["status"], row["started_at"], float(row["cfg_seed"])), (record, row)
    assert record["status"] == status
    if status == "done":
        assert steps == float(row["steps"]) == STEPS
    else:
        assert steps is None and record["started_at"] == STARTED  # this attempt, marked: nothing half
    return status


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_run_stopped_at_any_write_of_its_save_is_whole_or_marked_interrupted(signum, tmp_path):
    """Every write of begin_record and save_record, for a run replacing an earlier record of the
    same id: SIGKILL (no handler) at each, and SIGTERM (its default action), deferred by the save."""
    total = None
    at = 0
    while total is None or at < total:
        results = tmp_path / f"at{at}"
        results.mkdir()
        earlier = {**_row("done", started=EARLIER, seed=1)}
        save_record(results, earlier, steps=_steps(), log=[], curves={})
        published, status = _in_child(results, stop_at=at, signum=signum)
        if not os.WIFSIGNALED(status):  # no write left to stop at: the save ran through
            total = at
            assert os.WEXITSTATUS(status) == 0 and _assert_whole(results) == "done"
            assert float(find_run(results, "r")["cfg_seed"]) == 7
            break
        assert os.WTERMSIG(status) == signum
        outcome = _assert_whole(results)
        if signum == signal.SIGTERM:
            # a signal waits for the save it comes in: begun (the row, run.json), the run is
            # interrupted; the finished record (steps.csv, run.json, row) is never cut
            assert published in (2, 5), published
            assert outcome == ("done" if published == 5 else "interrupted")
        elif at == 0:  # killed before run.json says running: the earlier record stands, whole
            assert outcome == "done" and find_run(results, "r")["started_at"] == EARLIER
        at += 1
    assert total == 5  # begin: run.json, runs.csv; finish: steps.csv, run.json, runs.csv


def test_a_signal_during_a_deferred_block_comes_after_it_once(tmp_path):
    got = []
    old = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    previous = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    try:
        with signals_deferred() as pending:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            with signals_deferred():  # an inner block defers to the outer one
                os.kill(os.getpid(), signal.SIGTERM)
            assert got == [] and pending == [signal.SIGTERM] * 3
        assert got == [signal.SIGTERM]  # delivered to the handler in place, once
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGUSR1, old)


def _full_disk(monkeypatch, *, refuse):
    """Writes for which ``refuse(path)`` holds fail as on a full file system."""
    real_write, real_in_place = fileio.atomic_write_bytes, fileio.overwrite_in_place

    def write(path, data):
        if refuse(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, data)

    def in_place(path, data):
        if refuse(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_in_place(path, data)

    monkeypatch.setattr(fileio, "atomic_write_bytes", write)
    monkeypatch.setattr("lora_bench.results.save.overwrite_in_place", in_place)


def _begun(results) -> None:
    claim = claim_run(results / "r")
    begin_record(results, _row("running"))
    return claim


def test_a_full_disk_records_the_run_failed_with_its_measurements(tmp_path, monkeypatch):
    claim = _begun(tmp_path)
    _full_disk(monkeypatch, refuse=lambda p: p.name == "steps.csv")
    with pytest.raises(SaveError) as err:
        save_record(tmp_path, _row("done"), steps=_steps(), log=["trained"], curves={})
    claim.release()
    msg = str(err.value)
    assert str(tmp_path) in msg and "No space left on device" in msg and "needs about" in msg and "KiB" in msg
    assert "recorded as failed" in msg and err.value.exit_code == 4
    record, row, steps = _files(tmp_path)
    assert record["status"] == row["status"] == "failed" and steps is None
    assert float(row["step_ms_median"]) == 1.5  # the measured columns are kept
    assert "not saved in full" in row["error"]


def test_a_disk_with_no_room_at_all_leaves_the_run_marked_interrupted(tmp_path, monkeypatch):
    claim = _begun(tmp_path)
    _full_disk(monkeypatch, refuse=lambda p: True)
    with pytest.raises(SaveError) as err:
        save_record(tmp_path, _row("done"), steps=_steps(), log=[], curves={})
    claim.release()
    assert "Nothing of it could be written" in str(err.value) and err.value.row["step_ms_median"] == 1.5
    assert find_run(tmp_path, "r")["status"] == "interrupted"


def test_runs_csv_without_room_lags_and_the_next_write_brings_it_in_line(tmp_path, monkeypatch):
    claim = _begun(tmp_path)
    with monkeypatch.context() as m:
        _full_disk(m, refuse=lambda p: p.name == RUNS_CSV)
        with pytest.raises(SaveError) as err:
            save_record(tmp_path, _row("done"), steps=_steps(), log=[], curves={})
    claim.release()
    assert "recorded in" in str(err.value) and "could not be rewritten" in str(err.value)
    assert find_run(tmp_path, "r")["status"] == "done"  # run.json is the record
    upsert_run(tmp_path / RUNS_CSV, {"run_id": "other", "status": "done"})
    record, row, steps = _files(tmp_path)
    assert record["status"] == row["status"] == "done" and steps == STEPS


def test_a_folder_without_room_for_the_begun_record_is_refused_before_the_run(tmp_path, monkeypatch):
    save_record(tmp_path, _row("done", started=EARLIER, seed=1), steps=_steps(), log=[], curves={})
    _full_disk(monkeypatch, refuse=lambda p: p.name == "run.json")
    with pytest.raises(SaveError) as err:
        begin_record(tmp_path, _row("running"))
    assert "nothing was run" in str(err.value)
    record, row, steps = _files(tmp_path)
    assert record["started_at"] == row["started_at"] == EARLIER and steps == STEPS  # the earlier record, whole


@pytest.mark.slow
def test_train_and_sweep_into_a_folder_that_takes_no_more_stop_with_one_message(tmp_path):
    """A real process under a file-size limit (RLIMIT_FSIZE: writes past it fail with EFBIG, as a
    full disk fails with ENOSPC): the run's record does not fit. train exits 4 with one message
    naming the folder; a sweep records the failure, starts no further run and exits 4."""
    from lora_bench.data.sms_spam import cached_splits

    cached_splits(SAMPLE, tmp_path / "cache")  # the splits exist before the limit applies
    limit = 3900  # the begun record fits (about 3.5-3.7 KB with its text cells quoted), the finished one (4.3 KB) does not

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "COLUMNS": "200", "LORA_BENCH_GIT_COMMIT": "0" * 40}  # no git under the limit
    tiny = ["--model-size", "tiny", "--weights", "random", "--device", "cpu", "--no-progress", "--max-steps", "2",
            "--warmup-steps", "0", "--eval-freq", "0", "--skip-final-eval", "--data-file", str(SAMPLE),
            "--cache-dir", str(tmp_path / "cache")]
    results = tmp_path / "train"
    proc = subprocess.run([sys.executable, "-m", "lora_bench", "train", *tiny, "--results-dir", str(results),
                           "--run-id", "x"], preexec_fn=limited, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4 and "Traceback" not in out, out
    assert f"cannot save run x in {results}" in out and "ulimit -f" in out and "needs about" in out, out
    assert "step" in out  # the measured phase table is printed
    assert find_run(results, "x")["status"] in ("failed", "interrupted")  # never a half-saved "done"

    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"name: s\nbase: {{model_size: tiny, weights: random, device: cpu, data_file: {SAMPLE}, "
                     "max_steps: 2, warmup_steps: 0, eval_freq: 0, skip_final_eval: true}\ngrid: {seed: [1, 2, 3]}\n")
    results = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "lora_bench", "sweep", str(sweep), "--results-dir", str(results),
                           "--cache-dir", str(tmp_path / "cache"), "--no-progress"], preexec_fn=limited, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4 and "Traceback" not in out, out
    assert "stopped:" in out and str(results) in out and "0 done, 1 failed" in out and "2 not started" in out, out
    assert [r["status"] for r in result_rows(results, warn=None)] in (["failed"], ["interrupted"])
