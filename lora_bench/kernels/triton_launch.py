"""Launch a Triton kernel with less host work than ``kernel[grid](...)``: the first call for a
key goes through Triton (compiling if needed) and keeps the ``CompiledKernel``; later calls hand
raw pointers straight to its C launcher. The key covers everything Triton specialises on, so a
cached binary is only reused where Triton would pick the same one; launch hooks are not called on
this path. Only for the Triton versions whose launch internals this code follows (3.6 to 3.9);
elsewhere, or with ``LORA_BENCH_TRITON_FAST_LAUNCH=0``, every call takes Triton's own path. Why:
docs/kernel-design.md#the-implementations."""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import warnings

import torch
import triton

_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
FAST = ((3, 6) <= _VERSION <= (3, 9) and os.environ.get("LORA_BENCH_TRITON_FAST_LAUNCH", "1") != "0"
        and os.environ.get("TRITON_INTERPRET") != "1")
# Triton 3.6's CudaLauncher.__call__ only allocates scratch (none for these kernels) and calls
# its C ``launch``; on 3.6 that C function is called directly. Other versions go through __call__.
_DIRECT_C = _VERSION == (3, 6)
_COMPILED: dict[tuple, tuple] = {}
# When a list: every launch appends (tag, grid, CompiledKernel or None); see ``recording``.
RECORD: list | None = None
_I32 = 1 << 31
_DTYPE = operator.attrgetter("dtype")
_PTR = torch.Tensor.data_ptr


@contextlib.contextmanager
def recording():
    """Collect (tag, grid, CompiledKernel or None) for every launch in the block: how
    ``lora_bench.kernels.plans.direct`` learns which compiled kernels a layer shape runs."""
    global RECORD
    prev, RECORD = RECORD, []
    try:
        yield RECORD
    finally:
        RECORD = prev


def _entry(kernel) -> tuple | None:
    """What a later launch needs from a CompiledKernel (the kernel itself last, for ``RECORD``);
    None if it cannot be reused safely."""
    if getattr(kernel, "function", None) is None:
        return None
    runner = kernel.run  # the CudaLauncher (handles are initialised by now)
    md = kernel.metadata
    if (_DIRECT_C and not getattr(md, "global_scratch_size", 0) and not getattr(md, "profile_scratch_size", 0)
            and hasattr(runner, "launch")):
        return (True, runner.launch, kernel.function, kernel.packed_metadata, runner.launch_cooperative_grid,
                runner.launch_pdl, kernel)
    return (False, runner, kernel.function, kernel.packed_metadata, None, None, kernel)


def _disable_direct(exc: BaseException) -> None:
    """A Triton whose C launcher takes other arguments: stop calling it directly, say so once."""
    global _DIRECT_C
    _DIRECT_C = False
    _COMPILED.clear()
    warnings.warn(f"lora-bench fast launch: direct C launch failed ({exc}); using the launcher object",
                  RuntimeWarning, stacklevel=3)


def launch(fn, grid: tuple[int, int, int], tensors: tuple, ints: tuple, tail: tuple, consts: tuple,
           *, tag: str, num_warps: int, num_stages: int) -> None:
    """Launch ``fn`` whose parameters are, in order: ``tensors`` (pointers), ``ints``, ``tail``
    (floats: not specialised by Triton), then ``consts`` (the constexprs, in signature order).

    The cache key holds the integer arguments themselves (finer than Triton's 'equal to 1' and
    'divisible by 16', so never wrong; a training run repeats a handful of shapes) and requires
    every pointer to be 16-byte aligned (torch's allocations are); anything else takes Triton's
    own path each time."""
    fast = FAST and all(-_I32 <= i < _I32 for i in ints)  # i64 arguments: Triton's own path
    if fast:
        ptrs = list(map(_PTR, tensors))
        fast = not (functools.reduce(operator.or_, ptrs) & 15)
    if fast:
        dev = tensors[0].get_device()
        key = (tag, dev, num_warps, num_stages, consts, ints, tuple(map(_DTYPE, tensors)))
        entry = _COMPILED.get(key)
        if entry is not None:
            direct, run, function, packed, coop, pdl, kernel = entry
            if RECORD is not None:
                RECORD.append((tag, grid, kernel))
            stream = torch._C._cuda_getCurrentRawStream(dev)
            if not direct:
                run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None, *ptrs, *ints, *tail, *consts)
                return
            try:
                run(grid[0], grid[1], grid[2], stream, function, coop, pdl, None, None, packed, None, None, None,
                    *ptrs, *ints, *tail, *consts)
                return
            except (TypeError, SystemError) as exc:  # argument parsing fails before anything launches
                _disable_direct(exc)
    kernel = fn[grid](*tensors, *ints, *tail, *consts, num_warps=num_warps, num_stages=num_stages)
    if RECORD is not None:
        RECORD.append((tag, grid, kernel))
    if fast:
        entry = _entry(kernel)
        if entry is not None:
            _COMPILED[key] = entry
