"""The environment recorded with every result: versions, GPU, precision flags, source commit.

``host_environment()`` needs no device (it never initialises CUDA, so a sweep's parent process can
record it); ``environment(device)`` adds what only the device in use can tell."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_bench import __version__

COMMIT_ENV = "LORA_BENCH_GIT_COMMIT"  # for a copy of the source tree without its git history
DIRTY = "+dirty"


@dataclass(frozen=True)
class SourceCommit:
    """Which source produced a result. ``sha`` is empty when unknown; ``dirty`` is None when it
    cannot be told (a commit passed in without the ``+dirty`` mark is taken as clean)."""

    sha: str
    dirty: bool | None
    source: str  # "git", COMMIT_ENV or "unknown"

    def label(self) -> str:
        """The ``git_commit`` column: the sha, ``+dirty`` when modified, empty when unknown."""
        return self.sha + (DIRTY if self.dirty else "") if self.sha else ""


@functools.lru_cache(maxsize=1)
def source_commit() -> SourceCommit:
    """The commit of the lora-bench source, read once per process: ``LORA_BENCH_GIT_COMMIT`` when
    set (the tree is a copy without git history), else ``git rev-parse`` of the checkout the package
    is imported from, dirty when tracked files outside its results folder differ from it."""
    passed = os.environ.get(COMMIT_ENV, "").strip()
    if passed and passed.lower() != "unknown":
        return SourceCommit(passed.removesuffix(DIRTY), passed.endswith(DIRTY), COMMIT_ENV)
    root = Path(__file__).resolve().parents[2]
    try:
        proc = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=5)
        sha = proc.stdout.strip() if proc.returncode == 0 else ""
        if not sha:
            return SourceCommit("", None, "unknown")
        dirty = source_modified(root)
    except (OSError, subprocess.SubprocessError):
        return SourceCommit("", None, "unknown")
    return SourceCommit(sha, dirty, "git")


# The checkout's own results folder: runs write there, so a run that follows another in the same
# checkout finds its tracked result files modified. That is output, not a change to the source.
RESULTS_PATHSPEC = ":(exclude)results"


def source_modified(root: Path) -> bool | None:
    """Whether tracked files of the checkout at ``root`` differ from its commit, leaving out its
    ``results/`` folder (the harness's output); None where git cannot tell (the commit still counts)."""
    # no optional locks: asking must not write .git/index.lock, which a process killed meanwhile
    # (or past its file-size limit) would leave behind, blocking the user's next git command
    proc = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no", "--", ".",
                           RESULTS_PATHSPEC], cwd=root, capture_output=True, text=True, timeout=5)
    return bool(proc.stdout.strip()) if proc.returncode == 0 else None


def git_commit() -> str:
    """The ``git_commit`` column: sha (``+dirty`` when modified), or empty when unknown."""
    return source_commit().label()


def _nvidia_smi(query: str) -> list[str]:
    """One line per GPU from ``nvidia-smi --query-gpu`` (no CUDA context is created)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _gpu_driver() -> str:
    lines = _nvidia_smi("driver_version")
    return lines[0] if lines else ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cpu_mhz() -> float | None:
    """The CPU clock the OS reports: the median ``cpu MHz`` of /proc/cpuinfo over the CPUs this
    process may run on (None where the OS does not say)."""
    try:
        allowed = os.sched_getaffinity(0)
        mhz, cpu = [], None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "processor":
                cpu = int(value)
            elif key.strip() == "cpu MHz" and (cpu is None or cpu in allowed):
                mhz.append(float(value))
    except (OSError, ValueError, AttributeError):
        return None
    return sorted(mhz)[len(mhz) // 2] if mhz else None


def host_speed() -> dict:
    """What a host-bound step's time depends on besides the CPU model: the clock the OS reports,
    how many CPUs the process may use (pinning) and torch's intra-op threads."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {"cpu_mhz": _cpu_mhz(), "cpu_affinity": affinity, "torch_threads": torch.get_num_threads()}


def _triton_version() -> str:
    try:
        import triton  # noqa: PLC0415

        return triton.__version__
    except ImportError:
        return ""


def host_environment() -> dict[str, str]:
    """Versions, machine and GPUs as ``nvidia-smi`` lists them; no device is touched."""
    gpus = _nvidia_smi("name")
    return {
        "gpus": "; ".join(gpus),
        "gpu_driver": _gpu_driver() if gpus else "",
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "",
        "triton_version": _triton_version() if gpus else "",
        "python_version": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpu": _cpu_model(),
        "hostname": socket.gethostname(),
        "lora_bench_version": __version__,
    }


def environment(device: torch.device) -> dict[str, str]:
    """The environment columns of a run on ``device``."""
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
