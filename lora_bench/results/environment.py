"""The environment recorded with every result: versions, GPU, precision flags, git commit."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
from pathlib import Path

import torch

from lora_bench import __version__


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    """The commit of the lora-bench source: ``LORA_BENCH_GIT_COMMIT`` when set (a copy of the tree
    without its history, e.g. on a lent GPU machine), else git, marked ``+dirty`` when modified."""
    if os.environ.get("LORA_BENCH_GIT_COMMIT"):
        return os.environ["LORA_BENCH_GIT_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        proc = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=5)
        sha = proc.stdout.strip() if proc.returncode == 0 else ""
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return (sha + ("+dirty" if dirty else "")) if sha else ""


def _gpu_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0] if out else ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _triton_version() -> str:
    try:
        import triton  # noqa: PLC0415

        return triton.__version__
    except ImportError:
        return ""


def environment(device: torch.device) -> dict[str, str]:
    cuda = device.type == "cuda"
    return {
        "gpu_name": torch.cuda.get_device_name(device) if cuda else "",
        "gpu_driver": _gpu_driver() if cuda else "",
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "",
        "cudnn_version": str(torch.backends.cudnn.version() or "") if cuda else "",
        "triton_version": _triton_version() if cuda else "",
        "python_version": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpu": _cpu_model(),
        "hostname": socket.gethostname(),
        "git_commit": git_commit(),
        "lora_bench_version": __version__,
        "tf32_matmul": str(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": str(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
