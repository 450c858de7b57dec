"""The C++ op's build folder and lock: a build killed half-way must not make every later process wait.

torch's ``cpp_extension.load`` waits for as long as a ``lock`` file exists in the build folder, and
a killed build leaves that file behind. lora-bench holds an ``flock`` around the build (released
by the operating system when its holder dies) and, holding it, removes torch's leftover file.
These tests need no compiler: ``cpp_extension.load`` is replaced where a build would start.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time

import pytest
from torch.utils import cpp_extension

from lora_bench.kernels import lora_cpp

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")


def test_build_dir_is_per_torch_version_and_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("LORA_BENCH_EXT_DIR", raising=False)
    monkeypatch.setenv("LORA_BENCH_CACHE", str(tmp_path / "cache"))
    folder = lora_cpp.build_dir()
    assert folder.parent.parent == tmp_path / "cache" / "extensions"
    assert folder.parent.name.startswith("torch-") and "+" not in folder.parent.name
    monkeypatch.setenv("LORA_BENCH_EXT_DIR", str(tmp_path / "ext"))
    assert lora_cpp.build_dir() == tmp_path / "ext"


def test_a_stale_torch_lock_is_removed_before_the_build(monkeypatch, tmp_path):
    folder = tmp_path / "ext"
    folder.mkdir()
    (folder / lora_cpp.TORCH_LOCK).write_text("")  # what a build killed half-way leaves
    monkeypatch.setenv("LORA_BENCH_EXT_DIR", str(folder))
    seen = {}

    def fake_load(name, sources, extra_cflags, build_directory, verbose):
        seen["dir"] = build_directory
        seen["lock_left"] = (folder / lora_cpp.TORCH_LOCK).exists()
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with pytest.warns(RuntimeWarning, match="did not finish"):
        assert lora_cpp.compile_op() == "module"
    assert seen == {"dir": str(folder), "lock_left": False}


def test_no_warning_and_nothing_removed_without_a_stale_lock(monkeypatch, tmp_path, recwarn):
    monkeypatch.setenv("LORA_BENCH_EXT_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: "module")
    assert lora_cpp.compile_op() == "module"
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert (tmp_path / "ext").is_dir()


def _hold_lock_then_sleep(folder: str, ready) -> None:
    from pathlib import Path

    with lora_cpp.build_lock(Path(folder)):
        (Path(folder) / lora_cpp.TORCH_LOCK).write_text("")  # as torch's baton during a build
        ready.set()
        time.sleep(600)


def test_a_killed_builder_releases_the_lock_and_its_leftover_is_removed(tmp_path):
    folder = tmp_path / "ext"
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_hold_lock_then_sleep, args=(str(folder), ready))
    child.start()
    try:
        assert ready.wait(60), "the child never took the lock"
        acquired = threading.Event()

        def take():
            with pytest.warns(RuntimeWarning, match="did not finish"):
                with lora_cpp.build_lock(folder):
                    acquired.set()

        waiter = threading.Thread(target=take, daemon=True)
        waiter.start()
        time.sleep(0.5)
        assert not acquired.is_set(), "the lock was taken while a live build held it"
        os.kill(child.pid, signal.SIGKILL)
        waiter.join(30)
        assert acquired.is_set(), "the lock of a killed builder was not released"
        assert not (folder / lora_cpp.TORCH_LOCK).exists()
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)
