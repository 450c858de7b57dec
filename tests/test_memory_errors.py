"""Asking for more memory than the machine has is a usage error naming what was asked for."""

from __future__ import annotations

from pathlib import Path

import pytest


def _overcommit_always() -> bool:
    try:  # with overcommit mode 1 a huge allocation "succeeds" and the OOM killer acts later
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(_overcommit_always(), reason="the kernel grants any allocation (overcommit_memory=1)")
def test_kernel_bench_shape_too_large_for_memory(run_cli, tmp_path):
    shape = "1x1:1000000->1000000:r1"  # a 4 TB weight
    code, out = run_cli("kernel-bench", "--device", "cpu", "--shapes", shape, "--dtypes", "fp32", "--impls", "frozen",
                        "--repeats", "1", "--warmup", "0", "--out", tmp_path / "kb.csv", "--no-progress")
    assert code == 2 and "Traceback" not in out, out
    assert f"shape {shape} (fp32) does not fit in cpu memory" in out and "choose a smaller shape" in out
    assert not (tmp_path / "kb.csv").exists()
