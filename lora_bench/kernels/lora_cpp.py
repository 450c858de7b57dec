"""Build and load lora-kernel's C++ autograd op (plans "cpp" and "direct"; source: ``lora_op.cpp``).

Same math as ``lora_bench.kernels.autograd.LoRAKernelFunction``, written as a
``torch::autograd::Function``: one pybind call per forward, no Python at all in backward. An eager
layer on a fast GPU is host-bound, and the Python Function costs tens of microseconds of
apply/ctx work each way (docs/kernel-design.md).

Built on first use with ``torch.utils.cpp_extension.load`` (ninja; host C++ only, so one build
serves CPU and CUDA tensors) into torch's extension cache, or into ``$LORA_BENCH_EXT_DIR`` when
set; later processes load the cached build. A failed build (no C++ compiler, no ninja) warns once
and ``module()`` returns None: callers fall back to the Python Function.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from pathlib import Path

import torch

NAME = "lora_bench_lora_cpp"
SOURCE = Path(__file__).with_name("lora_op.cpp")
GRAD_FN_NAME = "torch::autograd::CppNode<lora_bench::LoRALinearCpp>"  # y.grad_fn.name() of its outputs


def _build_dir() -> str | None:
    path = os.environ.get("LORA_BENCH_EXT_DIR")
    if not path:
        return None  # torch's cache: $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/...
    os.makedirs(path, exist_ok=True)
    return path


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
    try:
        return cpp_extension.load(NAME, sources=[str(SOURCE)], extra_cflags=["-O3"],
                                  build_directory=_build_dir(), verbose=False)
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


__all__ = ["GRAD_FN_NAME", "NAME", "SOURCE", "build_error", "compile_op", "cpp_available", "forget_build",
           "lora_linear_cpp", "module"]
