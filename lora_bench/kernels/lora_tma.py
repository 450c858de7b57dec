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

The tile configuration is chosen per launch shape by ``lora_tma_tune.tune_layer``: a handful of
configs (``configs``), each compiled, checked against torch and timed as ten launches replayed from a
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
from typing import NamedTuple

import torch
import triton

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


from lora_bench.kernels.lora_tma_device import _lora_tma_kernel  # noqa: E402  (the device code)


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


def chosen(x: torch.Tensor, w: torch.Tensor, *, grad_ab: bool = False) -> str:
    """The configs a layer's forward and backward launches run, as 'fwd LABEL, bwd LABEL' (the
    backward: the fused one with ``grad_ab``, 'bwd+ab LABEL')."""
    n, k = w.shape
    f = _config(x, n, k, False, None)
    b = _config(x, k, n, True, None, grad_ab)
    return f"fwd {f.label}, bwd{'+ab' if grad_ab else ''} {b.label}"
