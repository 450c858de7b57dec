"""Triton kernels compiled for an sm_90 (Hopper) target on a machine without a GPU: Triton's own
compiler and the ptxas its wheel bundles turn a kernel into PTX and a cubin, so a kernel that would
not compile on the GPU fails here. Where Triton cannot target sm_90 at all (no bundled ptxas), a test
skips: that is told apart from a kernel's own error by compiling a kernel with nothing of the
package's in it first."""

from __future__ import annotations

import functools

import pytest


def _probe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def probe(x_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1.0)

    return probe


def _compile(fn, sig: dict, consts: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    return triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32))


@functools.cache
def _why_not() -> str | None:
    """Why this machine cannot compile for sm_90 (None: it can)."""
    try:
        _compile(_probe_kernel(), {"x_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 16})
    except Exception as exc:  # e.g. a Triton without a bundled ptxas
        return str(exc)
    return None


def compile_sm90(fn, types: dict, consts: dict):
    """``fn`` compiled for sm_90 with its runtime arguments' Triton types (``types``: name → '*bf16',
    'i32', ...; an argument not named is a constexpr) and its constexprs' values (``consts``); skips
    where this machine cannot compile for sm_90 at all, and raises a kernel's own error."""
    pytest.importorskip("triton")
    why = _why_not()
    if why is not None:
        pytest.skip(f"cannot compile for sm_90 here: {why}")
    return _compile(fn, {n: types.get(n, "constexpr") for n in fn.arg_names}, consts)
