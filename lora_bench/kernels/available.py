"""Whether the optional pieces of lora-kernel can run here: the Triton kernels and the C++ op.

Each probe runs once (importing Triton, or building / loading the C++ op) and keeps its answer;
a piece that cannot be used is reported by one RuntimeWarning, and its plans give way to the
ones that need nothing (``lora_bench.kernels.policy.choose``). Nothing is probed at import time.
``HAVE_TRITON`` / ``HAVE_TRITON_INTERPRETER`` / ``HAVE_CPP`` are the lazy truth values that
``choose`` takes: each runs its probe the first time its truth value is asked for.
"""

from __future__ import annotations

import functools
import os
import warnings

from lora_bench.kernels import lora_cpp


@functools.cache
def triton_kernels():
    """The Triton kernels module (``lora_bench.kernels.lora_triton``), or None with one warning."""
    try:
        from lora_bench.kernels import lora_triton

        return lora_triton
    except Exception as exc:  # ImportError, or a Triton that fails to initialise
        warnings.warn(f"lora-kernel: Triton is unavailable ({type(exc).__name__}: {exc}); the CUDA path falls "
                      "back to plain torch ops (correct, but slower). Install the 'triton' extra.",
                      RuntimeWarning, stacklevel=2)
        return None


def interpreting() -> bool:
    """Whether Triton runs its kernels on the CPU, in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cpp_op():
    """The built C++ op module (``.lora_linear``, ``.register_plan``), or None: ``lora_cpp`` warns
    once when it cannot be built."""
    return lora_cpp.module()


class _Probe:
    """A truth value that runs ``probe`` the first time it is asked for, then keeps the answer."""

    __slots__ = ("_probe", "_answer")

    def __init__(self, probe) -> None:
        self._probe = probe
        self._answer: bool | None = None

    def __bool__(self) -> bool:
        answer = self._answer
        if answer is None:
            answer = self._answer = self._probe() is not None
        return answer

    @property
    def answer(self) -> bool | None:
        """The answer if the probe has run, else None (without running it)."""
        return self._answer

    def forget(self) -> None:
        self._answer = None


HAVE_TRITON = _Probe(triton_kernels)
HAVE_TRITON_INTERPRETER = _Probe(lambda: triton_kernels() if interpreting() else None)
HAVE_CPP = _Probe(cpp_op)


def forget() -> None:
    """Forget every probe's answer: the next use imports Triton and builds / loads the C++ op again,
    warning again if it fails (tests that simulate a missing piece)."""
    triton_kernels.cache_clear()
    lora_cpp.forget_build()
    for probe in (HAVE_TRITON, HAVE_TRITON_INTERPRETER, HAVE_CPP):
        probe.forget()

__all__ = ["HAVE_CPP", "HAVE_TRITON", "HAVE_TRITON_INTERPRETER", "cpp_op", "forget", "interpreting",
           "triton_kernels"]
