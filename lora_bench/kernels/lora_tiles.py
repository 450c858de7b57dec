"""Tile shapes and grid splits of the LoRA Triton kernels (:mod:`lora_bench.kernels.lora_triton`): the
configurations each launch shape takes on this GPU, the rank's padding and the fp32 product precision.
Host code only; it imports Triton for its integer helpers. Why these tiles:
docs/kernel-design.md#the-implementations."""

from __future__ import annotations

import statistics
from typing import NamedTuple

import torch
import triton

from lora_bench.kernels import tile_record, triton_launch


class MMConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class ABConfig(NamedTuple):
    block_m: int  # rows reduced per step
    block_d: int  # columns of x (or g) each program owns
    num_warps: int
    num_stages: int
    split_m: int = 0  # programs per strip, each reducing a share of the rows; 0: chosen on the host


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def block_r(rank: int) -> int:
    """Rank padded to a power of two, at least 16 (the smallest MMA tile side)."""
    return 16 if rank <= 16 else triton.next_power_of_2(rank)


def _precision(dtype: torch.dtype) -> str:
    """fp32 follows torch's matmul setting: tf32 only where torch itself would allow it."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


# (BM, BN, BK, warps, stages). 16-bit: BK=64 (128 B rows); fp32 halves BK to keep the
# shared-memory stages the same size. 128×256 is left out: compiled for sm_90 it spills
# (ptxas: 255 registers, 568 B stack) because the H accumulator sits beside the output tile.
_MM_CANDIDATES_16 = (MMConfig(64, 128, 64, 4, 4), MMConfig(128, 128, 64, 8, 4), MMConfig(128, 64, 64, 4, 4))
_MM_CANDIDATES_32 = (MMConfig(64, 128, 32, 4, 3), MMConfig(128, 128, 32, 8, 3), MMConfig(128, 64, 32, 4, 3))
# Relative throughput per tile shape. From a tile sweep on an H200 (docs/kernel-design.md; bf16,
# M=960, graph replay): 64×128 was fastest at all six GPT-2 1558M launch shapes, by 3-20 %, even
# where it needs twice the waves of 128×128, so it is weighted up.
_TILE_EFF = {(64, 128): 1.0, (128, 128): 0.85, (128, 64): 0.8}


# Measured best tiles for exact launch shapes (M, N, K, dtype); selfcheck fills it from its sweep.
TUNED: dict[tuple[int, int, int, torch.dtype], MMConfig] = {}


def pick_mm_config(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> MMConfig:
    """Tile shape for ``lora_mm``: fewest estimated waves-times-tile-cost on this GPU.

    A plain tile count heuristic, because M (batch×seq) is only ~1k rows in this project: a
    128×128 grid leaves most of 132 SMs idle for n=1600, and a smaller tile fills them."""
    if device.type != "cuda":  # the interpreter: small tiles, many programs, masks exercised
        return MMConfig(32, 32, 32, 4, 1)
    tuned = TUNED.get((M, N, K, dtype))
    if tuned is not None:
        return tuned
    sms = _sm_count(device)
    cands = _MM_CANDIDATES_32 if dtype == torch.float32 else _MM_CANDIDATES_16
    best, best_cost = cands[0], float("inf")
    for c in cands:
        tiles = triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n)
        waves = triton.cdiv(tiles, sms)
        cost = waves * c.block_m * c.block_n / _TILE_EFF.get((c.block_m, c.block_n), 0.8)
        if cost < best_cost:
            best, best_cost = c, cost
    return best


AB_PICKED: dict[tuple, ABConfig] = {}  # the config each lora_grad_ab launch shape took (kept, and read by tests)
_AB_PROGRAMS_PER_SM = 3  # split target: 2-4 programs per SM hide each one's short serial loop


def ab_split(M: int, block_m: int, strips: int, sms: int) -> int:
    """Row splits per strip for ``lora_grad_ab``: strips × splits ≈ 3 programs per SM, and at
    most one split per BLOCK_M rows (the kernel never launches a split without rows)."""
    return max(1, min(triton.cdiv(M, block_m), triton.cdiv(_AB_PROGRAMS_PER_SM * sms, max(strips, 1))))


def pick_ab_config(M: int, K: int, N: int, device: torch.device, *, do_a: bool = True,
                   do_b: bool = True) -> ABConfig:
    if device.type != "cuda":  # the interpreter: one split unless a test forces more
        return ABConfig(32, 16, 4, 1, 1)
    sms = _sm_count(device)
    # 64-wide strips unless that leaves most SMs idle; then 32 (twice the programs)
    wide = triton.cdiv(K, 64) + triton.cdiv(N, 64) >= sms
    bd = 64 if wide else 32
    strips = (triton.cdiv(K, bd) if do_a else 0) + (triton.cdiv(N, bd) if do_b else 0)
    return ABConfig(64, bd, 4, 3, ab_split(M, 64, strips, sms))


_PICKED: dict[tuple, MMConfig] = {}


def _mm_config(M: int, N: int, K: int, x: torch.Tensor) -> MMConfig:
    key = (M, N, K, x.dtype)
    c = TUNED.get(key) or _PICKED.get(key)
    if c is None:
        c = _PICKED[key] = pick_mm_config(M, N, K, x.dtype, x.device)
    return c


# ------------------------------------------------------------------------- tiles chosen by timing
# The gemm_tiles setting's timed: each launch shape, with the adapter columns its K loop carries, takes
# the fastest of these on its first eager launch (docs/kernel-design.md#tiles-chosen-by-timing). The five
# that a tile sweep of the GPT-2 launch shapes found within reach of the best; the 256-wide tiles spill.
_MM_TIMED_16 = (MMConfig(64, 128, 64, 4, 4), MMConfig(64, 128, 64, 4, 3), MMConfig(128, 128, 64, 8, 4),
                MMConfig(128, 128, 64, 8, 3), MMConfig(128, 64, 64, 4, 4))
_MM_TIMED_32 = (MMConfig(64, 128, 32, 4, 3), MMConfig(64, 128, 32, 4, 2), MMConfig(128, 128, 32, 8, 3),
                MMConfig(128, 64, 32, 4, 3))
_TIMING_ROUNDS = 3
_LAUNCHES_PER_ROUND = 4
_SLEEP_CYCLES = 2_000_000  # ~1 ms at Hopper clocks: the host queues every timed launch before they run


def timed_candidates(dtype: torch.dtype) -> tuple[MMConfig, ...]:
    return _MM_TIMED_32 if dtype == torch.float32 else _MM_TIMED_16


def fastest(times: dict[MMConfig, list[float]]) -> MMConfig:
    """The candidate of least median time (µs per launch over the rounds); ties go to the earlier
    candidate (the picker's order), so equal timings keep the picker's tile."""
    return min(times, key=lambda c: (statistics.median(times[c]), list(times).index(c)))


def can_time() -> bool:
    """Whether a launch may be timed here: on the GPU, eager (not captured in a CUDA graph, not
    traced by torch.compile), and not inside a launch recording (the C++ op's direct plan keeps
    the kernels it records; :mod:`lora_bench.kernels.plans.direct`)."""
    return (torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()
            and not torch.compiler.is_compiling() and triton_launch.RECORD is None)


def time_configs(run, candidates: tuple[MMConfig, ...], rounds: int = _TIMING_ROUNDS,
                 per_round: int = _LAUNCHES_PER_ROUND) -> dict[MMConfig, list[float]]:
    """µs per launch of ``run(config)`` for each candidate, ``rounds`` times, the candidates
    interleaved within each round. Device-side events; each candidate launched (and compiled) once
    before; each round starts behind a sleep kernel, so the events time the GPU and not the host's
    launch gaps. ``run`` must be idempotent (the GEMMs write their outputs and read only inputs)."""
    for c in candidates:
        run(c)
    torch.cuda.synchronize()
    times: dict[MMConfig, list[float]] = {c: [] for c in candidates}
    for _ in range(rounds):
        marks = []
        torch.cuda._sleep(_SLEEP_CYCLES)
        for c in candidates:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_round):
                run(c)
            end.record()
            marks.append((c, start, end))
        torch.cuda.synchronize()
        for c, start, end in marks:
            times[c].append(1000.0 * start.elapsed_time(end) / per_round)
    return times


def mm_config_for(tag: str, M: int, N: int, K: int, R: int, h_in: bool, x: torch.Tensor, run) -> MMConfig:
    """The tile of one GEMM launch: a measured one from ``TUNED``; under the ``gemm_tiles`` setting's
    timed, the fastest candidate timed on this launch's own operands at its first eager launch (cached
    per shape and adapter columns for the process, and noted in the run's record); else the picker's
    (``_mm_config``). A launch that cannot be timed (captured, compiled, recorded) before its shape
    was timed takes the picker's tile, and the record says why."""
    if tile_record.MODE.get() != tile_record.TIMED_MODE or x.device.type != "cuda" or (M, N, K, x.dtype) in TUNED:
        return _mm_config(M, N, K, x)
    key = (tag, M, N, K, x.dtype, block_r(R), bool(h_in))
    c = tile_record.TIMED.get(key)
    if c is None:
        if not can_time():
            tile_record.note(key, _why_not_timed())
            return _mm_config(M, N, K, x)
        times = time_configs(run, timed_candidates(x.dtype))
        c = tile_record.TIMED[key] = fastest(times)
        tile_record.TIMED_US[key] = {k: statistics.median(v) for k, v in times.items()}
    tile_record.note(key, None)
    return c


def _why_not_timed() -> str:
    if triton_launch.RECORD is not None:
        return "launch recorded for the direct plan"
    if torch.compiler.is_compiling():
        return "traced by torch.compile"
    return "first launched under CUDA-graph capture"
