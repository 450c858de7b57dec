"""The ``gemm_tiles`` setting's state below the plan policy: the setting in force and the record a
run's tile choices go into, as context variables that :mod:`lora_bench.kernels.policy` sets with the
policy and its log, and the tiles timing chose, read by :mod:`lora_bench.kernels.lora_tiles`. No
Triton, no policy: both sides import this module, neither imports the other."""

from __future__ import annotations

import contextvars

from lora_bench.kernels.plan_names import GEMM_TILES_PICKED, GEMM_TILES_TIMED as TIMED_MODE

MODE: contextvars.ContextVar[str] = contextvars.ContextVar("lora_bench_gemm_tiles", default=GEMM_TILES_PICKED)
# the run's record (PlanLog.tiles) while one is recorded into: launch key -> None (timed) or why not
NOTES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("lora_bench_gemm_tile_notes", default=None)
TIMED: dict = {}  # (tag, M, N, K, dtype, BLOCK_R, H read in) -> the MMConfig timing chose, for the process
TIMED_US: dict = {}  # the same key -> {MMConfig: µs per launch} of every candidate


def note(key: tuple, why_not: str | None) -> None:
    """Record a launch shape's tile (``why_not``: None where it was timed, else why it took the picked
    one; a timed note replaces a why-not). Noted with gradients on or off: a shape is timed once, on
    its first launch, which may come in an evaluation."""
    notes = NOTES.get()
    if notes is not None and (why_not is None or key not in notes):
        notes[key] = why_not


def tile_name(c) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}"


def describe(key: tuple, why_not: str | None) -> str:
    """One launch shape's tile as a run records it: the timed choice with every candidate's µs per
    launch, or the picked one with the reason it was not timed."""
    tag, M, N, K, dtype, br, h_in = key
    shape = f"{tag} {M}x{K}->{N} {str(dtype).removeprefix('torch.')} R{br}{' H-in' if h_in else ''}"
    if why_not is not None or key not in TIMED:
        return f"{shape}: picked ({why_not or 'not timed'})"
    others = ", ".join(f"{tile_name(k)} {us:.1f}" for k, us in TIMED_US[key].items())
    return f"{shape}: {tile_name(TIMED[key])} ({others} µs)"


__all__ = ["MODE", "NOTES", "TIMED", "TIMED_MODE", "TIMED_US", "describe", "note", "tile_name"]
