"""Hopper-grade Triton kernels for the LoRA layer y = x·Wᵀ + b + s·(x·A)·B: TMA tensor descriptors,
a persistent grid, and the rank-r work inside the GEMM. A benchmark candidate
(``benchmarks/lora_graph_candidates.py``: ``tma+ab``, ``tma-fused``, ``tma-frozen``), not one of
lora-kernel's plans.

One kernel, ``_lora_tma_kernel``, computes out = X·Wt + bias + s·(X·P)·Q and H = X·P (the same
algebra as ``lora_triton.lora_mm``): forward (X, Wt, P, Q) = (x, Wᵀ, A, B) gives y and h; backward
(g, W, Bᵀ, Aᵀ) gives grad_x = g·W + s·u·Aᵀ and u = g·Bᵀ, and the fused backward (``lora_bwd_ab``)
grad_A and grad_B too. Shapes: x N×k, W n×k, A k×r, B r×n.

* X, W and the output move through TMA descriptors built on the host
  (``triton.tools.tensor_descriptor.TensorDescriptor``): asynchronous bulk copies into swizzled
  shared memory feeding warp-group MMAs, out-of-bounds rows and columns read as zeros and clipped
  on store, so no masks in the K loop. W is read as stored (n×k): the forward transposes its tile
  in shared memory, the backward reads it as K×N.
* The rank-r operand P (A, or Bᵀ) is a BLOCK_K×r tile loaded in the same K loop, so X is read
  once for both products: through a descriptor over A as stored (k×r, when its rows are 16-byte
  aligned: r a multiple of 8 in 16-bit dtypes) or over B as stored (r×n, the tile transposed in
  shared memory), else by pointer (correct, but not pipelined: slow). H is rounded to the input
  dtype and s·H·Q is added in the epilogue (Q: B, or Aᵀ as a strided view of A; Q and the bias
  are loaded before the K loop). Every column tile recomputes its rows' H (extra MMA work
  r/BLOCK_N); only column tile 0 stores it. x (or g), W and the output need 16-byte rows: k and n
  multiples of 8 in 16-bit dtypes, of 4 in fp32 (``shape_unsupported``).
* Persistent grid, two schedules (``TMAConfig.stream_k``):
  - data-parallel: min(tiles, per_sm·SMs) programs, each takes tiles round-robin (grouped order:
    neighbouring programs share X rows and W columns in L2);
  - stream-K: the tiles' K iterations are cut into equal contiguous ranges, one per program, so
    every SM does the same work even when the tile count is not a multiple of the SM count
    (N = 1600 at M = 960 makes 104 tiles of 128×128 for 132 SMs; power-of-two tiles cannot
    match cuBLAS's 128×96). A tile cut between programs is finished by the last one to arrive:
    each stores its fp32 partial (BM×(BN+BR)) in a workspace slot, then adds one to the tile's
    counter (barrier, then an acq_rel atomic); the one that sees the count complete sums the
    partials in program order (bit-for-bit repeatable), resets the counter to zero for the next
    launch and runs the epilogue. Nobody waits for anybody. Workspace and counters are kept per
    device and reused by every launch (launches on one stream follow each other; two launches
    running concurrently on different streams must not share them).
* The fused backward (``GRAD_AB``: the whole LoRA backward in one launch). The backward's output
  tile covers rows of g and columns of grad_x (k-columns of x); its K loop runs over n.
  - grad_B = s·hᵀ·g: a (row tile, K block) contributes h[rows]ᵀ·g[rows, block], and every column
    tile loads that g tile. Each K block is owned by one column tile (contiguous ranges:
    kb // cdiv(K blocks, column tiles) == pid_n), which multiplies the g tile already in shared
    memory by h[rows] (BM×r, loaded before the loop) in the same iteration; every other column
    tile skips it. So each contribution is counted once and the work is spread evenly over the
    column tiles (column tile 0 alone would lengthen its tiles by ~r/BN).
  - grad_A = s·xᵀ·u: when a tile's u (its rows, complete after the K loop, or after the stream-K
    fixup) reaches the epilogue, the tile loads x[rows, its columns] by TMA and adds
    x[rows, cols]ᵀ·(s·u rounded, as for grad_x) to grad_A[cols]. The columns are the tile's own,
    so this too is counted once.
  - Summed over the row tiles by fp32 atomic adds (``red.global.add.f32``: no return value, no
    wait) into per-device workspaces (k×BR and n×BR fp32), then a last-arriver step per column:
    after its adds a tile arrives at its column's counter (barrier, then an acq_rel atomic, as the
    stream-K fixup); the last of the column's row tiles reads back the column's grad_A rows and
    the grad_B rows of the K blocks it owns (``.cg``: from L2), stores them scaled and in the
    gradients' dtype, zeroes what it read and resets the counter. No zero-fill or cast launch, no
    second kernel: the gradients are done when the launch is. (Per-row-tile partials reduced in
    a fixed order would be repeatable, but the last arriver would then read one partial per row
    tile at the end of the kernel, 8 at 960 rows: up to ~320 KB per column at n = 6400, against
    ~40 KB.)
  - Cost, besides the MMAs (r/n of the GEMM's for grad_A, r/k for grad_B): the adds' order
    varies, so the gradients' last bits vary from run to run (grad_x's do not); a K block that
    adds to grad_B makes its iteration wait for the MMAs in flight (Triton issues the small
    conditional MMA synchronously); each tile waits once for its x tile in the epilogue; the last
    arriver of each column reads ~8-40 KB from L2 at the end. The workspaces must be zero when a
    launch starts: ``reset_scratch`` zeroes them (and the counters) after a launch that did not
    finish. The saved h is the forward's; u is not stored.

The tile configuration is chosen per launch shape by ``tune_layer``: a handful of configs
(``configs``), each compiled, checked against torch and timed as ten launches replayed from a
CUDA graph; the fastest correct one is kept. Without tuning a shape runs ``default_config``.
``LORA_TMA_CONFIGS=128x128x64w8s4,64x128x64w4s4sk`` limits the list (labels: ``TMAConfig.label``).

``lora_bwd_ab`` is tuned as its own launch shape (``tune_layer(..., grad_ab=True)``) over the
data-parallel configs only: its stream-K schedule returned wrong adapter gradients on an H200
(``_fused_ab_configs``), so it refuses a stream-K config; flattened configs are left out too (a
flattened loop with this epilogue is not pipelined).

Host cost is Triton's own launch path (the descriptors are encoded on the host each call): these
kernels are for CUDA-graph replay, where only device time counts.

This module imports Triton; import it lazily. ``unavailable`` says why the kernels cannot run
(no TMA descriptors in this Triton, no Hopper-class GPU, the CPU without Triton's interpreter).
"""

from __future__ import annotations

import math
import os
import re
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lora_bench.kernels.lora_triton import _precision, block_r  # the same rank padding and fp32 rule

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.4
    TensorDescriptor = None

MAX_RANK = 128  # H lives in registers beside the output tile, as in lora_triton

# Tests set this to fill every output the wrappers allocate with NaN, so an element a kernel
# forgets to write shows up instead of hiding behind whatever memory held before.
POISON_OUTPUTS = False

INTERPRET_SMS = 5  # "SMs" under Triton's interpreter: several programs, tiles cut between them


class TMAConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    stream_k: bool = False
    flatten: bool = False  # data-parallel only: flatten the tile and K loops into one pipelined loop
    per_sm: int = 1  # persistent programs per SM

    @property
    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}"
                + ("sk" if self.stream_k else "") + ("fl" if self.flatten else "")
                + (f"o{self.per_sm}" if self.per_sm != 1 else ""))


def parse_config(label: str) -> TMAConfig:
    """The inverse of ``TMAConfig.label``: '128x128x64w8s4', '64x128x64w4s4sk', '64x128x64w4s3o2'."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(sk)?(fl)?(?:o(\d+))?", label.strip())
    if m is None:
        raise ValueError(f"not a TMA config label: {label!r} (e.g. 128x128x64w8s4, 64x128x64w4s4sk)")
    bm, bn, bk, w, s = (int(v) for v in m.groups()[:5])
    return TMAConfig(bm, bn, bk, w, s, stream_k=bool(m.group(6)), flatten=bool(m.group(7)),
                     per_sm=int(m.group(8) or 1))


# Shared memory per config, bf16 with r = 16, as Triton 3.6 compiles them for sm_90 (an H100/H200
# block may use 227 KB; no register spills): 128x128x64 s4 172 KB, 64x256x64 s4 208 KB,
# 128x256x64 s3 222 KB, 64x128x64 s3 98 KB (two programs per SM), the stream-K 128x128x64 s3
# 138 KB and 64x128x64 s4 124 KB, the flattened 128x128x64 s4 188 KB.
_CONFIGS_16 = (
    TMAConfig(128, 128, 64, 8, 4),
    TMAConfig(64, 256, 64, 4, 4),
    TMAConfig(128, 256, 64, 8, 3),
    TMAConfig(64, 128, 64, 4, 3, per_sm=2),
    TMAConfig(128, 128, 64, 8, 3, stream_k=True),
    TMAConfig(64, 128, 64, 4, 4, stream_k=True),
    TMAConfig(128, 128, 64, 8, 4, flatten=True),
)
_CONFIGS_32 = (  # fp32: half the K depth keeps the stages the same size
    TMAConfig(128, 128, 32, 8, 3),
    TMAConfig(64, 128, 32, 4, 3, stream_k=True),
)
# The interpreter: tiny tiles, so small operands make many tiles, K tails and cut tiles.
_CONFIGS_CPU = (TMAConfig(16, 16, 16, 4, 1, stream_k=True), TMAConfig(16, 32, 16, 4, 1))


def configs(dtype: torch.dtype, device: torch.device) -> tuple[TMAConfig, ...]:
    """The configs tried for a launch (``LORA_TMA_CONFIGS`` narrows them on CUDA)."""
    if device.type != "cuda":
        return _CONFIGS_CPU
    env = os.environ.get("LORA_TMA_CONFIGS", "").strip()
    if env:
        return tuple(parse_config(s) for s in env.split(",") if s.strip())
    return _CONFIGS_32 if dtype == torch.float32 else _CONFIGS_16


# ---------------------------------------------------------------------------------- kernels


@triton.jit
def _tile_mn(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles sweep the columns together (X rows and W columns in L2)."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_size
    pid_n = (tile % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _mainloop(x_desc, w_desc, p_arg, stride_pk, stride_pr, off_m, off_n, kb0, kb1, K, R, ht, wsb_ptr, pid_n, gb_per_n,
              W_KN: tl.constexpr, HAS_LORA: tl.constexpr, P_MODE: tl.constexpr, GRAD_AB: tl.constexpr,
              PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_R: tl.constexpr):
    """acc = X[rows, K blocks kb0..kb1)·Wt[.., cols], hacc = X[rows, ..]·P[.., :R] (fp32). GRAD_AB (the
    fused backward, X = g): the K blocks this column tile owns (kb // gb_per_n == pid_n) also add
    X[rows, block]ᵀ·ht (ht = h[rows, :]) into the grad_B workspace (K×BLOCK_R fp32), so each
    (row tile, K block) adds once however many column tiles load it."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    hacc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for kb in range(kb0, kb1):
        k0 = kb * BLOCK_K
        xt = x_desc.load([off_m, k0])  # (BM, BK); rows past M and columns past K read as zeros
        if W_KN:
            wt = w_desc.load([k0, off_n])  # (BK, BN)
        else:
            wt = w_desc.load([off_n, k0]).T  # W stored n×k: its (BN, BK) tile, transposed in shared memory
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        if HAS_LORA:
            if P_MODE == 1:  # P as stored, K×R (A in the forward)
                pt = p_arg.load([k0, 0])
            elif P_MODE == 2:  # P stored transposed, R×K (Bᵀ in the backward: B as stored)
                pt = p_arg.load([0, k0]).T
            else:  # rows not 16-byte aligned for TMA: pointer loads (not pipelined: slower)
                ks = k0 + tl.arange(0, BLOCK_K)
                offs_r = tl.arange(0, BLOCK_R)
                pt = tl.load(p_arg + ks[:, None] * stride_pk + offs_r[None, :] * stride_pr,
                             mask=(ks < K)[:, None] & (offs_r < R)[None, :], other=0.0)
            hacc = tl.dot(xt, pt.to(xt.dtype), hacc, input_precision=PRECISION)
        if GRAD_AB:  # noqa: SIM102 (a constexpr: the branch compiles away without it)
            if kb // gb_per_n == pid_n:  # this K block's share of grad_B belongs to this column tile
                part = tl.dot(xt.T, ht, input_precision=PRECISION)  # (BK, BR): g[rows, block]ᵀ·h[rows, :]
                ks_b = k0 + tl.arange(0, BLOCK_K)
                offs_rb = tl.arange(0, BLOCK_R)
                tl.atomic_add(wsb_ptr + ks_b[:, None] * BLOCK_R + offs_rb[None, :], part,
                              mask=(ks_b < K)[:, None] & (offs_rb < BLOCK_R)[None, :], sem="relaxed", scope="gpu")
    return acc, hacc


@triton.jit
def _tile_operands(q_ptr, bias_ptr, hb_ptr, off_m, off_n, M, N, R, stride_qr, stride_qn, stride_hbm, stride_hbr,
                   dt: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, GRAD_AB: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """The epilogue's Q tile (BR×BN) and bias (BN), and for GRAD_AB the forward's h rows (BM×BR) that
    the K loop multiplies into grad_B: loaded before the K loop so that their latency hides behind it."""
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    qt = tl.zeros((BLOCK_R, BLOCK_N), dtype=dt)
    bt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ht = tl.zeros((BLOCK_M, BLOCK_R), dtype=dt)
    if HAS_LORA:
        qt = tl.load(q_ptr + offs_r[:, None] * stride_qr + offs_n[None, :] * stride_qn,
                     mask=(offs_r < R)[:, None] & (offs_n < N)[None, :], other=0.0).to(dt)
    if HAS_BIAS:
        bt = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    if GRAD_AB:
        offs_m = off_m + tl.arange(0, BLOCK_M)
        ht = tl.load(hb_ptr + offs_m[:, None] * stride_hbm + offs_r[None, :] * stride_hbr,
                     mask=(offs_m < M)[:, None] & (offs_r < R)[None, :], other=0.0).to(dt)
    return qt, bt, ht


@triton.jit
def _grad_ab_tail(sh, xa_desc, ga_ptr, gb_ptr, wsa_ptr, wsb_ptr, cab_ptr, off_m, off_n, pid_n, num_pid_m, gb_per_n,
                  N, K, R, stride_gak, stride_gar, stride_gbr, stride_gbn, scale, PRECISION: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """The fused backward's adapter gradients, once per output tile (rows off_m.., columns off_n.. of
    grad_x, i.e. k-columns of x): sh = s·u[rows] rounded as in the epilogue; this row tile's share of
    grad_A[cols] = xᵀ·sh is added into the grad_A workspace (N×BLOCK_R fp32). Then the tile arrives at
    its column's counter; the last of the column's num_pid_m row tiles (every add of the column's
    grad_A rows and of its grad_B rows, K blocks [pid_n·gb_per_n, (pid_n+1)·gb_per_n), is in by
    then) converts them into grad_A and s·(grad_B workspace), zeroes the workspace rows it read and
    the counter for the next launch."""
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    xa = xa_desc.load([off_m, off_n])  # x[rows, cols] (BM, BN); zeros outside
    part = tl.dot(xa.T, sh, input_precision=PRECISION)  # (BN, BR)
    wa = wsa_ptr + offs_n[:, None] * BLOCK_R + offs_r[None, :]
    a_mask = (offs_n < N)[:, None] & (offs_r < BLOCK_R)[None, :]
    tl.atomic_add(wa, part, mask=a_mask, sem="relaxed", scope="gpu")
    tl.debug_barrier()  # every thread's adds (here and in the K loop) issued before the release below
    arrived = tl.atomic_add(cab_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == num_pid_m - 1:
        tl.store(ga_ptr + offs_n[:, None] * stride_gak + offs_r[None, :] * stride_gar,
                 tl.load(wa, mask=a_mask, other=0.0, cache_modifier=".cg").to(ga_ptr.dtype.element_ty),
                 mask=(offs_n < N)[:, None] & (offs_r < R)[None, :])
        tl.store(wa, tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32), mask=a_mask)
        # this column's grad_B rows: one contiguous range of K, read RB rows at a time
        RB: tl.constexpr = 4 * BLOCK_K
        k_hi = min((pid_n + 1) * gb_per_n * BLOCK_K, K)
        for k0 in range(pid_n * gb_per_n * BLOCK_K, k_hi, RB):
            ks = k0 + tl.arange(0, RB)
            wb = wsb_ptr + ks[:, None] * BLOCK_R + offs_r[None, :]
            b_mask = (ks < k_hi)[:, None] & (offs_r < BLOCK_R)[None, :]
            vb = tl.load(wb, mask=b_mask, other=0.0, cache_modifier=".cg") * scale
            tl.store(gb_ptr + offs_r[None, :] * stride_gbr + ks[:, None] * stride_gbn,
                     vb.to(gb_ptr.dtype.element_ty), mask=(ks < k_hi)[:, None] & (offs_r < R)[None, :])
            tl.store(wb, tl.zeros((RB, BLOCK_R), dtype=tl.float32), mask=b_mask)
        tl.atomic_xchg(cab_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _epilogue(acc, hacc, qt, bt, out_desc, h_ptr, off_m, off_n, pid_n, M, R, stride_hm, stride_hr, scale,
              HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_H: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """out tile = acc + s·H·Q + bias; H stored by column tile 0. Returns s·H rounded to the input dtype."""
    dt = h_ptr.dtype.element_ty  # the input dtype (h, or the output itself when there is no h)
    # H rounded to the input dtype (as torch's x @ A), s folded in before the rounding:
    # exact for a power-of-two s, one rounding of s·H otherwise
    sh = (hacc * scale).to(dt)
    if HAS_LORA:
        if WRITE_H:
            if pid_n == 0:
                offs_m = off_m + tl.arange(0, BLOCK_M)
                offs_r = tl.arange(0, BLOCK_R)
                tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_r[None, :] * stride_hr, hacc.to(dt),
                         mask=(offs_m < M)[:, None] & (offs_r < R)[None, :])
        acc = tl.dot(sh, qt, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += bt[None, :]
    out_desc.store([off_m, off_n], acc.to(dt))  # clipped to M×N by the descriptor
    return sh


@triton.jit
def _lora_tma_kernel(
    x_desc, w_desc, out_desc, p_arg, q_ptr, bias_ptr, h_ptr, ws_ptr, cnt_ptr,
    xa_desc, hb_ptr, ga_ptr, gb_ptr, wsa_ptr, wsb_ptr, cab_ptr,
    M, N, K, R, stride_pk, stride_pr, stride_qr, stride_qn, stride_hm, stride_hr, iters_per_prog, scale,
    stride_hbm, stride_hbr, stride_gak, stride_gar, stride_gbr, stride_gbn,
    W_KN: tl.constexpr, HAS_LORA: tl.constexpr, P_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
    WRITE_H: tl.constexpr, GRAD_AB: tl.constexpr, STREAM_K: tl.constexpr, FLATTEN: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
):
    dt: tl.constexpr = h_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    gb_per_n = tl.cdiv(k_tiles, num_pid_n)  # GRAD_AB: the K blocks of grad_B each column tile owns
    if STREAM_K:
        # this program's K iterations [start, end) of all tiles' (the host makes none empty)
        start = pid * iters_per_prog
        end = min(start + iters_per_prog, num_tiles * k_tiles)
        first_tile = start // k_tiles
        WS_N: tl.constexpr = BLOCK_N + BLOCK_R  # a workspace slot: BM rows of [acc | hacc], fp32
        offs_wm = tl.arange(0, BLOCK_M)
        offs_wn = tl.arange(0, BLOCK_N)
        offs_wr = tl.arange(0, BLOCK_R)
        for tile in range(first_tile, (end - 1) // k_tiles + 1):
            pid_m, pid_n = _tile_mn(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            kb0 = max(start - tile * k_tiles, 0)
            kb1 = min(end - tile * k_tiles, k_tiles)
            qt, bt, ht = _tile_operands(q_ptr, bias_ptr, hb_ptr, off_m, off_n, M, N, R, stride_qr, stride_qn,
                                        stride_hbm, stride_hbr, dt, HAS_LORA, HAS_BIAS, GRAD_AB, BLOCK_M, BLOCK_N,
                                        BLOCK_R)
            acc, hacc = _mainloop(x_desc, w_desc, p_arg, stride_pk, stride_pr, off_m, off_n, kb0, kb1, K, R, ht,
                                  wsb_ptr, pid_n, gb_per_n, W_KN, HAS_LORA, P_MODE, GRAD_AB, PRECISION, BLOCK_M,
                                  BLOCK_N, BLOCK_K, BLOCK_R)
            if (kb0 == 0) & (kb1 == k_tiles):  # the whole tile is this program's
                sh = _epilogue(acc, hacc, qt, bt, out_desc, h_ptr, off_m, off_n, pid_n, M, R, stride_hm, stride_hr,
                               scale, HAS_LORA, HAS_BIAS, WRITE_H, PRECISION, BLOCK_M, BLOCK_R)
                if GRAD_AB:
                    _grad_ab_tail(sh, xa_desc, ga_ptr, gb_ptr, wsa_ptr, wsb_ptr, cab_ptr, off_m, off_n, pid_n,
                                  num_pid_m, gb_per_n, N, K, R, stride_gak, stride_gar, stride_gbr, stride_gbn,
                                  scale, PRECISION, BLOCK_N, BLOCK_K, BLOCK_R)
            else:
                # a cut tile: this program's partial goes to its slot (slot 0: its first tile,
                # 1: its last; a program cuts at most those two)
                seg = (tile != first_tile).to(tl.int32)
                slot = ws_ptr + (pid * 2 + seg) * (BLOCK_M * WS_N)
                tl.store(slot + offs_wm[:, None] * WS_N + offs_wn[None, :], acc)
                if HAS_LORA:
                    tl.store(slot + offs_wm[:, None] * WS_N + BLOCK_N + offs_wr[None, :], hacc)
                tl.debug_barrier()  # every thread's partial stored before the release below
                p_lo = (tile * k_tiles) // iters_per_prog  # the programs that share this tile
                p_hi = ((tile + 1) * k_tiles - 1) // iters_per_prog
                arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
                if arrived == p_hi - p_lo:  # the last one: sum the partials in program order
                    tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    htot = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                    for p in range(p_lo, p_hi + 1):
                        seg_p = (((p * iters_per_prog) // k_tiles) != tile).to(tl.int32)
                        slot_p = ws_ptr + (p * 2 + seg_p) * (BLOCK_M * WS_N)
                        tot += tl.load(slot_p + offs_wm[:, None] * WS_N + offs_wn[None, :], cache_modifier=".cg")
                        if HAS_LORA:
                            htot += tl.load(slot_p + offs_wm[:, None] * WS_N + BLOCK_N + offs_wr[None, :],
                                            cache_modifier=".cg")
                    tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                    sh = _epilogue(tot, htot, qt, bt, out_desc, h_ptr, off_m, off_n, pid_n, M, R, stride_hm,
                                   stride_hr, scale, HAS_LORA, HAS_BIAS, WRITE_H, PRECISION, BLOCK_M, BLOCK_R)
                    if GRAD_AB:
                        _grad_ab_tail(sh, xa_desc, ga_ptr, gb_ptr, wsa_ptr, wsb_ptr, cab_ptr, off_m, off_n, pid_n,
                                      num_pid_m, gb_per_n, N, K, R, stride_gak, stride_gar, stride_gbr, stride_gbn,
                                      scale, PRECISION, BLOCK_N, BLOCK_K, BLOCK_R)
    else:
        # the epilogue's tile index is counted separately from the loop's (as Triton's persistent
        # matmul tutorial does), so a flattened loop need not carry one value into both
        tile_c = pid - nprog
        for tile in tl.range(pid, num_tiles, nprog, flatten=FLATTEN):
            pid_m, pid_n = _tile_mn(tile, num_pid_m, num_pid_n, GROUP_M)
            qt, bt, ht = _tile_operands(q_ptr, bias_ptr, hb_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, R,
                                        stride_qr, stride_qn, stride_hbm, stride_hbr, dt, HAS_LORA, HAS_BIAS, GRAD_AB,
                                        BLOCK_M, BLOCK_N, BLOCK_R)
            acc, hacc = _mainloop(x_desc, w_desc, p_arg, stride_pk, stride_pr, pid_m * BLOCK_M, pid_n * BLOCK_N,
                                  0, k_tiles, K, R, ht, wsb_ptr, pid_n, gb_per_n, W_KN, HAS_LORA, P_MODE, GRAD_AB,
                                  PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R)
            tile_c += nprog
            pid_m_c, pid_n_c = _tile_mn(tile_c, num_pid_m, num_pid_n, GROUP_M)
            sh = _epilogue(acc, hacc, qt, bt, out_desc, h_ptr, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N, pid_n_c, M, R,
                           stride_hm, stride_hr, scale, HAS_LORA, HAS_BIAS, WRITE_H, PRECISION, BLOCK_M, BLOCK_R)
            if GRAD_AB:
                _grad_ab_tail(sh, xa_desc, ga_ptr, gb_ptr, wsa_ptr, wsb_ptr, cab_ptr, pid_m_c * BLOCK_M,
                              pid_n_c * BLOCK_N, pid_n_c, num_pid_m, gb_per_n, N, K, R, stride_gak, stride_gar,
                              stride_gbr, stride_gbn, scale, PRECISION, BLOCK_N, BLOCK_K, BLOCK_R)


# ---------------------------------------------------------------------------------- host side


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable(device: torch.device) -> str | None:
    """Why these kernels cannot run on ``device`` (None: they can)."""
    if TensorDescriptor is None:
        return f"Triton {triton.__version__} has no triton.tools.tensor_descriptor (TMA descriptors: Triton >= 3.4)"
    if device.type == "cpu":
        return None if interpreting() else ("TMA kernels need an NVIDIA GPU of compute capability 9.0 or newer "
                                            "(or Triton's CPU interpreter, TRITON_INTERPRET=1)")
    if device.type != "cuda":
        return f"TMA kernels need CUDA, not {device.type}"
    if interpreting():
        return "TRITON_INTERPRET=1 with CUDA tensors: the interpreter runs on the CPU"
    if getattr(torch.version, "hip", None):
        return "TMA descriptors are NVIDIA-only"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] < 9:
        name = torch.cuda.get_device_name(device)
        return f"TMA needs compute capability 9.0 or newer (Hopper); {name} is {cap[0]}.{cap[1]}"
    return None


def shape_unsupported(k: int, n: int, r: int, dtype: torch.dtype) -> str | None:
    """Why a layer (d_in k, d_out n, rank r, dtype) cannot run these kernels (None: it can)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"TMA kernels take fp16, bf16 or fp32, not {dtype}"
    per16 = 16 // dtype.itemsize
    bad = [f"{name} {v}" for name, v in (("d_in", k), ("d_out", n)) if v % per16]
    if bad:
        return (f"TMA needs 16-byte rows: d_in and d_out multiples of {per16} in {str(dtype).replace('torch.', '')} "
                f"({', '.join(bad)})")
    if r > MAX_RANK:
        return f"rank {r} above {MAX_RANK}"
    return None


_SM_COUNT: dict[int, int] = {}


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRET_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _alloc(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    dtype = dtype or like.dtype
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


# Stream-K workspace (fp32 slots) and tile counters (int32, zero between launches), and the fused
# backward's gradient workspaces (fp32, zero between launches: the last arriver of each column zeroes
# what it read) and column counters, per device; grown by reallocation (zero-filled). Buffers that a
# captured CUDA graph may still point at are kept alive.
_WS: dict[tuple, torch.Tensor] = {}
_CNT: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def _scratch(store: dict, key: tuple, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    buf = store.get(key)
    if buf is None or buf.numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # memory from the graph's private pool must not outlive the graph in this cache
            raise RuntimeError("lora_tma: the stream-K workspace is allocated on a shape's first launch; run the "
                               "shape once outside CUDA-graph capture first (tune_layer does)")
        if buf is not None:
            _RETIRED.append(buf)
        buf = store[key] = torch.zeros(max(numel, 1024), dtype=dtype, device=device)
    return buf


def reset_scratch() -> None:
    """Zero every workspace and counter: after a launch that did not finish (an error, a wrong
    config under tuning) they may hold what the next launch must not see."""
    for store in (_WS, _CNT):
        for buf in store.values():
            buf.zero_()


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous rows (unit inner stride) on a 16-byte boundary, as TMA needs; copies otherwise."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
        t = t.contiguous()
        if t.data_ptr() % 16:
            t = t.clone()
    return t


def _plan(M: int, N: int, K: int, c: TMAConfig, device: torch.device) -> tuple[int, int]:
    """(programs, K iterations per program) of a launch; the latter 0 for the data-parallel schedule."""
    tiles = triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n)
    slots = c.per_sm * _sms(device)
    if not c.stream_k:
        return min(tiles, slots), 0
    total = tiles * triton.cdiv(K, c.block_k)
    ipp = triton.cdiv(total, min(slots, total))
    return triton.cdiv(total, ipp), ipp  # no program without work


def _tma_ok(t: torch.Tensor, row_stride: int) -> bool:
    return t.data_ptr() % 16 == 0 and (row_stride * t.element_size()) % 16 == 0


def _p_operand(p: torch.Tensor, ps: tuple[int, int], K: int, R: int, block_k: int, br: int):
    """The K-loop's rank-r operand P (K×R, strides ``ps`` into ``p``) as the kernel takes it:
    (a descriptor over P as stored, mode 1; over Pᵀ as stored, mode 2; or ``p`` itself, mode 0,
    when neither layout has 16-byte rows: pointer loads)."""
    if ps[1] == 1 and _tma_ok(p, ps[0]):
        return TensorDescriptor(p, [K, R], [ps[0], 1], [block_k, br]), 1
    if ps[0] == 1 and _tma_ok(p, ps[1]):
        return TensorDescriptor(p, [R, K], [ps[1], 1], [br, block_k]), 2
    return p, 0


def _launch(x, wt, w_kn, p, ps, q, qs, bias, out, h, R, scale, c: TMAConfig, lora: bool, ab=None) -> None:
    """out (M×N) = x·Wt + bias + scale·(x·P)·Q, h = x·P. ``wt`` is W as stored: K×N when ``w_kn``,
    else N×K (transposed tile by tile). P (K×R) and Q (R×N) come as (tensor, (row, col) strides).
    ``ab`` (the fused backward, x = g): (xa M×N, hb M×R, ga N×R, gb R×K), and the launch also
    writes ga = xaᵀ·(scale·x·P) and gb = scale·hbᵀ·x."""
    M, K = x.shape
    N = out.shape[1]
    br = block_r(R) if lora else 16
    x_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [c.block_m, c.block_k])
    if w_kn:
        w_desc = TensorDescriptor(wt, [K, N], [wt.stride(0), 1], [c.block_k, c.block_n])
    else:
        w_desc = TensorDescriptor(wt, [N, K], [wt.stride(0), 1], [c.block_n, c.block_k])
    out_desc = TensorDescriptor(out, [M, N], [out.stride(0), 1], [c.block_m, c.block_n])
    progs, ipp = _plan(M, N, K, c, x.device)
    if c.stream_k:
        dev = x.device
        ws = _scratch(_WS, (dev,), progs * 2 * c.block_m * (c.block_n + br), torch.float32, dev)
        cnt = _scratch(_CNT, (dev,), triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n), torch.int32, dev)
    else:
        ws = cnt = out
    if ab is not None:
        xa, hb, ga, gb = ab
        dev = x.device
        xa_desc = TensorDescriptor(xa, [M, N], [xa.stride(0), 1], [c.block_m, c.block_n])
        wsa = _scratch(_WS, (dev, "grad_A"), N * br, torch.float32, dev)
        wsb = _scratch(_WS, (dev, "grad_B"), K * br, torch.float32, dev)
        cab = _scratch(_CNT, (dev, "grad_AB"), triton.cdiv(N, c.block_n), torch.int32, dev)
        ab_strides = (*hb.stride(), *ga.stride(), *gb.stride())
    else:
        xa_desc, hb, ga, gb, wsa, wsb, cab, ab_strides = out_desc, out, out, out, out, out, out, (0,) * 6
    h_arg = h if h is not None else out
    hs = h_arg.stride()
    if lora:
        p_arg, p_mode = _p_operand(p, ps, K, R, c.block_k, br)
        q_arg = q
    else:
        p_arg, p_mode, q_arg, ps, qs = x, 0, x, (0, 0), (0, 0)
    _lora_tma_kernel[(progs,)](
        x_desc, w_desc, out_desc, p_arg, q_arg, bias if bias is not None else out, h_arg, ws, cnt,
        xa_desc, hb, ga, gb, wsa, wsb, cab,
        M, N, K, R, ps[0], ps[1], qs[0], qs[1], hs[0], hs[1], ipp, float(scale), *ab_strides,
        W_KN=w_kn, HAS_LORA=lora, P_MODE=p_mode, HAS_BIAS=bias is not None, WRITE_H=h is not None,
        GRAD_AB=ab is not None, STREAM_K=c.stream_k, FLATTEN=c.flatten and not c.stream_k and ab is None,
        PRECISION=_precision(x.dtype),
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, BLOCK_R=br, GROUP_M=8,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )


# -- configs: chosen per launch shape -----------------------------------------------------------

# (device, dtype, M, N, K, W read as K×N, fused adapter gradients) -> the config ``tune_layer`` chose;
# the LoRA and the frozen kernel of a launch shape share it (whichever is tuned first); the fused
# backward (``lora_bwd_ab``) has its own
TUNED: dict[tuple, TMAConfig] = {}
# the same key -> lines describing what tuning tried (for the benchmark's log)
TUNE_LOG: dict[tuple, str] = {}


def _key(x: torch.Tensor, N: int, K: int, w_kn: bool, grad_ab: bool = False) -> tuple:
    return (x.device, x.dtype, x.shape[0], N, K, w_kn, grad_ab)


def _fused_ab_configs(cands: tuple[TMAConfig, ...]) -> tuple[TMAConfig, ...]:
    """The configs the fused backward (``lora_bwd_ab``) may run: data-parallel ones only. Its
    stream-K schedule passed every interpreter case but returned wrong adapter gradients on an H200
    (relative error 0.18-0.24, 64x128x64w4s4sk at 960x1600->6400 and 6400->1600), an ordering fault
    between programs that the interpreter, running programs one after another, cannot show. A
    flattened config runs as its plain twin there, so it is left out too."""
    return tuple(c for c in cands if not c.stream_k and not c.flatten)


def default_config(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device,
                   grad_ab: bool = False) -> TMAConfig:
    """The untuned choice: the config with the fewest estimated MMA steps per SM, by a plain count
    (tiles or K iterations per program, times the tile's area, relative to 128×128; stream-K pays a
    cut tile's partials as two K steps). The interpreter: the first CPU config (stream-K; for the
    fused backward, the first data-parallel one)."""
    cands = configs(dtype, device)
    if grad_ab:
        cands = _fused_ab_configs(cands) or cands  # (none left: lora_bwd_ab refuses, naming the config)
    if device.type != "cuda":
        return cands[0]
    best, best_cost = None, math.inf
    for c in cands:
        progs, ipp = _plan(M, N, K, c, device)
        tiles = triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n)
        k_tiles = triton.cdiv(K, c.block_k)
        steps = ipp + 2 if c.stream_k else triton.cdiv(tiles, progs) * k_tiles
        per_sm = steps * triton.cdiv(progs, _sms(device)) if c.per_sm > 1 else steps
        cost = per_sm * c.block_m * c.block_n / (128 * 128) * (1.25 if c.block_m * c.block_n < 128 * 128 else 1.0)
        if cost < best_cost:
            best, best_cost = c, cost
    return best


def _config(x: torch.Tensor, N: int, K: int, w_kn: bool, config: TMAConfig | None, grad_ab: bool = False) -> TMAConfig:
    if config is not None:
        return config
    return TUNED.get(_key(x, N, K, w_kn, grad_ab)) or default_config(x.shape[0], N, K, x.dtype, x.device, grad_ab)


# -- the layer's launches ---------------------------------------------------------------------------


def lora_fwd(x, w, a, b, bias, scale: float, *, config: TMAConfig | None = None,
             out: torch.Tensor | None = None, h_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x·Wᵀ + bias + s·(x·A)·B and h = x·A for x (M×k), W (n×k), A (k×r), B (r×n)."""
    x, w = _aligned(x), _aligned(w)
    M, K = x.shape
    N, R = w.shape[0], a.shape[1]
    y = _alloc((M, N), x) if out is None else out
    h = _alloc((M, R), x) if h_out is None else h_out
    c = _config(x, N, K, False, config)
    _launch(x, w, False, a, a.stride(), b, b.stride(), bias, y, h, R, scale, c, True)
    return y, h


def lora_bwd_x(g, w, a, b, scale: float, *, config: TMAConfig | None = None,
               out: torch.Tensor | None = None, u_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_x = g·W + s·u·Aᵀ and u = g·Bᵀ for g (M×n): the kernel on (g, W, Bᵀ, Aᵀ), W read as K×N."""
    g, w = _aligned(g), _aligned(w)
    M, K = g.shape  # K here is n, the reduction
    N, R = w.shape[1], a.shape[1]
    gx = _alloc((M, N), g) if out is None else out
    u = _alloc((M, R), g) if u_out is None else u_out
    c = _config(g, N, K, True, config)
    bs, as_ = b.stride(), a.stride()
    _launch(g, w, True, b, (bs[1], bs[0]), a, (as_[1], as_[0]), None, gx, u, R, scale, c, True)
    return gx, u


def lora_bwd_ab(g, x, h, w, a, b, scale: float, *, config: TMAConfig | None = None,
                out: torch.Tensor | None = None, ga_out: torch.Tensor | None = None, gb_out: torch.Tensor | None = None,
                grad_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole LoRA backward in one launch: grad_x = g·W + s·u·Aᵀ (u = g·Bᵀ, not stored),
    grad_A = s·xᵀ·u and grad_B = s·hᵀ·g, for g (M×n), x (M×k), h = x·A (M×r, the forward's),
    W (n×k), A (k×r), B (r×n). The gradients come in ``grad_dtype`` (default A's dtype). One launch
    at a time per device: the gradient workspaces and counters are shared (module docstring)."""
    g, w, x = _aligned(g), _aligned(w), _aligned(x)
    M, K = g.shape  # K here is n, the reduction
    N, R = w.shape[1], a.shape[1]
    if x.shape != (M, N) or h.shape != (M, R):
        raise ValueError(f"lora_bwd_ab: x {tuple(x.shape)} and h {tuple(h.shape)} must be {(M, N)} and {(M, R)}")
    gd = grad_dtype or a.dtype
    gx = _alloc((M, N), g) if out is None else out
    ga = _alloc((N, R), g, gd) if ga_out is None else ga_out
    gb = _alloc((R, K), g, gd) if gb_out is None else gb_out
    c = _config(g, N, K, True, config, grad_ab=True)
    if c.stream_k:
        raise ValueError(f"lora_bwd_ab: {c.label}: the fused backward runs the data-parallel schedule only "
                         "(stream-K returned wrong adapter gradients on an H200 at the 6400-wide shapes)")
    bs, as_ = b.stride(), a.stride()
    _launch(g, w, True, b, (bs[1], bs[0]), a, (as_[1], as_[0]), None, gx, None, R, scale, c, True, ab=(x, h, ga, gb))
    return gx, ga, gb


def linear_fwd(x, w, bias, *, config: TMAConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x·Wᵀ + bias through the same kernel without the rank-r work (the frozen layer)."""
    x, w = _aligned(x), _aligned(w)
    M, K = x.shape
    N = w.shape[0]
    y = _alloc((M, N), x) if out is None else out
    _launch(x, w, False, None, None, None, None, bias, y, None, 0, 1.0, _config(x, N, K, False, config), False)
    return y


def linear_bwd_x(g, w, *, config: TMAConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """grad_x = g·W through the same kernel without the rank-r work."""
    g, w = _aligned(g), _aligned(w)
    M, K = g.shape
    N = w.shape[1]
    gx = _alloc((M, N), g) if out is None else out
    _launch(g, w, True, None, None, None, None, None, gx, None, 0, 1.0, _config(g, N, K, True, config), False)
    return gx


# -- tuning ------------------------------------------------------------------------------------------


def _tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 2e-5 if _precision(dtype) == "ieee" else 5e-3
    return {torch.bfloat16: 1e-2, torch.float16: 3e-3}[dtype]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    den = float(ref.norm())
    return float((out - ref).norm()) / den if den else float((out - ref).norm())


def _graph_us(fn: Callable[[], None], reps: int = 10, rounds: int = 5) -> float:
    """Device time of one ``fn`` (microseconds): ``reps`` calls captured in one CUDA graph, the
    median of ``rounds`` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(times)


def _brief(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def _tune_one(key: tuple, run: Callable[[TMAConfig], list[torch.Tensor]], refs: list[torch.Tensor],
              cands: tuple[TMAConfig, ...]) -> tuple[TMAConfig | None, str]:
    """Try each config: compile and run once, compare with ``refs``, time; keep the fastest correct one."""
    tol = _tolerance(key[1])
    timed, failed = [], []
    for c in cands:
        try:
            outs = run(c)
            torch.cuda.synchronize()
            err = max(_rel_err(o, r) for o, r in zip(outs, refs))
            if not err <= tol:
                failed.append(f"{c.label} wrong (rel err {err:.1e})")
                reset_scratch()  # a wrong kernel may have left counters or workspaces dirty
                continue
            timed.append((_graph_us(lambda c=c: run(c)), c))
        except Exception as exc:  # compile errors, out of shared memory, ...
            failed.append(f"{c.label} {_brief(exc)}")
            reset_scratch()
    timed.sort(key=lambda t: t[0])
    text = ", ".join(f"{c.label} {us:.1f}" for us, c in timed)
    if failed:
        text += "; failed: " + "; ".join(failed)
    return (timed[0][1] if timed else None), text


def tune_layer(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor | None,
               b: torch.Tensor | None, g: torch.Tensor, scale: float, *, lora: bool = True, grad_ab: bool = False,
               log: Callable[[str], None] | None = None) -> str | None:
    """Choose the config of the layer's two launches (forward, and grad_x in the backward) on these
    operands (CUDA; x N×k, W n×k, A k×r, B r×n, g N×n): each config in ``configs`` is compiled,
    checked against torch (float64) and timed; the fastest correct one is kept in ``TUNED``
    (shapes tuned before are not tried again). ``lora=False``: the frozen kernels; ``grad_ab``: the
    backward launch is the fused one (``lora_bwd_ab``: grad_x, grad_A, grad_B). Returns None, or
    why no config ran (then the layer cannot use these kernels)."""
    x, w, g = _aligned(x.detach()), _aligned(w.detach()), _aligned(g.detach())
    M, k = x.shape
    n = w.shape[0]
    R = a.shape[1] if lora else 0
    with torch.no_grad():
        xd, wd, gd = x.double(), w.double(), g.double()
        if lora:
            ad, bd = a.detach().double(), b.detach().double()
            h_ref = (xd @ ad).to(x.dtype).double()  # rounded as the kernel's (and torch's) h
            u_ref = (gd @ bd.t()).to(x.dtype).double()
            y_ref = xd @ wd.t() + scale * h_ref @ bd
            gx_ref = gd @ wd + scale * u_ref @ ad.t()
            ga_ref, gb_ref = scale * xd.t() @ u_ref, scale * h_ref.t() @ gd
        else:
            y_ref, gx_ref = xd @ wd.t(), gd @ wd
        if bias is not None:
            y_ref = y_ref + bias.detach().double()
        del xd, wd, gd
        y, gx = torch.empty(M, n, dtype=x.dtype, device=x.device), torch.empty(M, k, dtype=x.dtype, device=x.device)
        if lora:
            h, u = torch.empty(M, R, dtype=x.dtype, device=x.device), torch.empty(M, R, dtype=x.dtype, device=x.device)
            fwd = lambda c: list(lora_fwd(x, w, a, b, bias, scale, config=c, out=y, h_out=h))
            if grad_ab:
                h_in = h_ref.to(x.dtype)
                ga, gb = torch.empty_like(a), torch.empty_like(b)
                bwd = lambda c: list(lora_bwd_ab(g, x, h_in, w, a, b, scale, config=c, out=gx, ga_out=ga, gb_out=gb))
                bwd_job = ("bwd+ab", _key(g, k, n, True, True), bwd, [gx_ref, ga_ref, gb_ref])
            else:
                bwd = lambda c: list(lora_bwd_x(g, w, a, b, scale, config=c, out=gx, u_out=u))
                bwd_job = ("bwd", _key(g, k, n, True), bwd, [gx_ref, u_ref])
            jobs = (("fwd", _key(x, n, k, False), fwd, [y_ref, h_ref]), bwd_job)
        else:
            fwd = lambda c: [linear_fwd(x, w, bias, config=c, out=y)]
            bwd = lambda c: [linear_bwd_x(g, w, config=c, out=gx)]
            jobs = (("fwd", _key(x, n, k, False), fwd, [y_ref]), ("bwd", _key(g, k, n, True), bwd, [gx_ref]))
        problems = []
        for name, key, run, refs in jobs:
            if key in TUNED:
                continue
            cands = configs(x.dtype, x.device)
            if key[6]:  # the fused backward: data-parallel configs only
                cands = _fused_ab_configs(cands)
            best, text = _tune_one(key, run, refs, cands)
            TUNE_LOG[key] = f"{name} {key[2]}x{key[3]}x{key[4]}: {text}"
            if log is not None:
                log(TUNE_LOG[key])
            if best is None:
                problems.append(f"{name}: no config ran ({text})")
            else:
                TUNED[key] = best
    return "; ".join(problems) or None


def chosen(x: torch.Tensor, w: torch.Tensor, *, grad_ab: bool = False) -> str:
    """The configs a layer's forward and backward launches run, as 'fwd LABEL, bwd LABEL' (the
    backward: the fused one with ``grad_ab``, 'bwd+ab LABEL')."""
    n, k = w.shape
    f = _config(x, n, k, False, None)
    b = _config(x, k, n, True, None, grad_ab)
    return f"fwd {f.label}, bwd{'+ab' if grad_ab else ''} {b.label}"
