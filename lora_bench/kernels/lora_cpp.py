"""Build and load lora-kernel's C++ autograd op (plans "cpp" and "direct"; source: ``lora_op.cpp``):
the math of ``lora_bench.kernels.autograd.LoRAKernelFunction`` as a ``torch::autograd::Function``,
one pybind call per forward and no Python in backward. Built on first use into
``$LORA_BENCH_EXT_DIR``, else lora-bench's cache; later processes load the cached build. A failed
build warns once and ``module()`` returns None: callers fall back to the Python Function. A build
holds an ``flock`` that dies with its process, so a ``lock`` file a killed build left behind is
removed rather than waited on forever. Where and why: docs/kernel-design.md#the-implementations."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import warnings
from pathlib import Path

import torch

NAME = "lora_bench_lora_cpp"
SOURCE = Path(__file__).with_name("lora_op.cpp")
GRAD_FN_NAME = "torch::autograd::CppNode<lora_bench::LoRALinearCpp>"  # y.grad_fn.name() of its outputs


TORCH_LOCK = "lock"  # torch.utils.file_baton's file in the build folder
OUR_LOCK = ".lora-bench-build.lock"


def build_dir() -> Path:
    """Where the op is built: ``$LORA_BENCH_EXT_DIR``, else the cache's folder for this torch."""
    path = os.environ.get("LORA_BENCH_EXT_DIR")
    if path:
        return Path(path)
    cache = os.environ.get("LORA_BENCH_CACHE")
    root = Path(cache) if cache else Path.home() / ".cache" / "lora-bench"
    version = torch.__version__.replace("+", "-")
    return root / "extensions" / f"torch-{version}" / NAME


@contextlib.contextmanager
def build_lock(folder: Path):
    """Hold an exclusive ``flock`` on the build folder; inside it, remove torch's stale ``lock``.

    A second process waits here while the first builds, then loads the first one's build. Where
    ``fcntl`` is missing (Windows) nothing is locked and torch's own lock file is left alone.
    """
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        yield
        return
    with open(folder / OUR_LOCK, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            stale = folder / TORCH_LOCK
            if stale.exists():
                warnings.warn(f"lora-kernel: removing {stale}, left by a build that did not finish",
                              RuntimeWarning, stacklevel=3)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def compile_op():
    """Compile (or load the cached build of) ``lora_op.cpp`` and return the module; raises on failure."""
    from torch.utils import cpp_extension

    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:  # the pip package's binary is not on PATH in an unactivated venv
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
        except ImportError:
            pass
    folder = build_dir()
    try:
        with build_lock(folder):
            return cpp_extension.load(NAME, sources=[str(SOURCE)], extra_cflags=["-O3"],
                                      build_directory=str(folder), verbose=False)
    finally:
        os.environ["PATH"] = path


@functools.cache
def _built() -> tuple[object | None, str | None]:
    """(module, None) or (None, why it could not be built); warns once, on failure."""
    try:
        return compile_op(), None
    except Exception as exc:  # no compiler, no ninja, a compile error, an unwritable cache
        reason = f"{type(exc).__name__}: {exc}".strip()
        if len(reason) > 2000:
            reason = reason[:1000] + " ... " + reason[-1000:]
        warnings.warn(
            "lora-kernel: the C++ op could not be built (" + reason + "); lora-kernel layers use the "
            "Python autograd Function instead (correct, slower when host-bound). It needs a C++ "
            "compiler and ninja (pip install ninja).", RuntimeWarning, stacklevel=3)
        return None, reason


def module():
    """The built extension module (``.lora_linear``, ``.register_plan``), or None (one RuntimeWarning)."""
    return _built()[0]


def build_error() -> str | None:
    """Why the op could not be built (after ``module()`` returned None), else None."""
    return _built()[1]


def forget_build() -> None:
    """Forget the probe's answer: the next ``module()`` builds or loads again (tests)."""
    _built.cache_clear()


def cpp_available() -> bool:
    """True when the C++ op is built (builds it on first call)."""
    return module() is not None


def lora_linear_cpp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor,
                    B: torch.Tensor, scale: float) -> torch.Tensor:
    """y = x·Wᵀ + b + scale·(x·A)·B through the C++ autograd op (RuntimeError if it cannot be built)."""
    mod = module()
    if mod is None:
        raise RuntimeError("lora-kernel: the C++ op is unavailable: " + str(build_error()))
    return mod.lora_linear(x, weight, bias, A, B, float(scale))


__all__ = ["GRAD_FN_NAME", "NAME", "SOURCE", "build_dir", "build_error", "build_lock", "compile_op", "cpp_available", "forget_build",
           "lora_linear_cpp", "module"]
