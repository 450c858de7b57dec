"""lora_bench.fileio's bounded reads: a file past the limit is refused before more than the limit is
read, whatever its size claims, and a pipe or device is refused without waiting on it."""

from __future__ import annotations

import os
import threading

import pytest

from lora_bench.fileio import TooLarge, read_capped


def test_a_file_within_the_limit_is_read_whole(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert read_capped(path, 100) == b"x" * 100


def test_a_file_past_the_limit_is_refused_by_its_size(tmp_path):
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(3 * 2**30)  # 3 GiB of holes: nothing is written to the disk
    with pytest.raises(TooLarge) as e:
        read_capped(path, 1000)
    assert e.value.size == 3 * 2**30 and e.value.limit == 1000


def test_a_file_whose_size_says_nothing_is_still_bounded():
    """/proc files report size 0: at most limit + 1 bytes are read, and the file is refused."""
    with pytest.raises(TooLarge) as e:
        read_capped("/proc/self/maps", 10)
    assert e.value.size == 11


def test_a_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result: list = []

    def read() -> None:
        try:
            read_capped(fifo, 10)
        except OSError as exc:
            result.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "reading a pipe blocked"
    assert result and "not a regular file" in str(result[0])


def test_not_a_file_says_what_is_there(tmp_path):
    from lora_bench.fileio import not_a_file

    (tmp_path / "f").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    assert not_a_file(tmp_path / "f") is None
    assert not_a_file(tmp_path) == "a folder, not a file"
    assert not_a_file(tmp_path / "fifo").startswith("not a regular file")
    assert not_a_file("/dev/zero").startswith("not a regular file")
    assert not_a_file(tmp_path / "missing") == "no such file"
