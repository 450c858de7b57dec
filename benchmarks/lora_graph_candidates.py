"""Study: one LoRA layer's forward+backward under CUDA-graph replay, candidate plans against the
frozen layer.

Layer: y = x·Wᵀ + b + s·(x·A)·B, W frozen; x N×k, W n×k, A k×r, B r×n (N tokens, 2-D input).
Under CUDA-graph replay only device time counts, so the question is which plan gets the rank-r
work closest to the frozen layer's cost (one cuBLAS GEMM each way). Candidates:

  frozen           F.linear with a frozen W, input requiring grad: the floor
  lora             F.linear(x, W, b) + s·((x·A)·B): the plain reference layer (LinearWithLoRA's math)
  lora-kernel      the project's layer as it runs today (``project_layer``: its graph plan under capture)
  cublas-beta      the rank-r term first, the big GEMM accumulates onto it (beta = 1):
                   fwd  h = x·A; y = b + s·h·B; y += x·Wᵀ
                   bwd  us = s·g·Bᵀ; gx = us·Aᵀ; gx += g·W; grad_A = xᵀ·us; grad_B = s·hᵀ·g
  cublas-beta+ugb  the same, us and grad_B from one Triton launch (lora_bench/kernels/lora_ugb.py)
  ncat             the adapters live in one buffer with W, P = [W | Bᵀ ; Aᵀ | ·] ((n+r)×(k+r)),
                   A and B are views of it; the big GEMMs grow by r output columns:
                   fwd  [y | h] = x·[W ; Aᵀ]ᵀ + [b | 0]; y += s·h·B
                   bwd  [gx | u] = g·[W | Bᵀ]; gx += s·u·Aᵀ; grad_A = s·xᵀ·u; grad_B = s·hᵀ·g
                   (y and grad_x are row-strided views: leading dimension n+r / k+r)
  ncat+ab          ncat, grad_A and grad_B in one launch of the project's Triton ``lora_grad_ab``
  ncat-copy+ab     ncat+ab with A and B as separate tensors, copied into the buffer on every call
  kcat             K-concatenation: fwd y = [x | s·h]·[W | Bᵀ]ᵀ + b, bwd grad_x = [g | s·u]·[W ; Aᵀ],
                   the activations copied into preallocated [x | ·] / [g | ·] buffers, s·h and s·u
                   written straight into them; grad_A = xᵀ·(s·u), grad_B = (s·h)ᵀ·g
  kcat-cat         kcat with torch.cat building the concatenated activations
  kcat+ugb         kcat, the [g | s·u] buffer and grad_B written by one Triton launch that reads g once
  tma+ab           one Hopper-grade Triton GEMM each way that does the rank-r work inside it
                   (lora_bench/kernels/lora_tma.py: TMA descriptors, persistent grid, data-parallel or
                   stream-K schedule, config chosen per launch shape by timing a handful):
                   fwd  [y, h] = one launch: y = x·Wᵀ + b + s·h·B, h = x·A (h from the same x tiles)
                   bwd  [gx, u] = one launch: gx = g·W + s·u·Aᵀ, u = g·Bᵀ; grad_A, grad_B from one launch
                   of the project's ``lora_grad_ab`` (as ncat+ab): 1 + 2 kernels
  tma-fused        tma+ab with the adapter gradients inside the backward GEMM: 1 + 1 kernels
                   fwd  as tma+ab
                   bwd  one launch (lora_tma.lora_bwd_ab): gx = g·W + s·u·Aᵀ, u = g·Bᵀ in the K loop;
                   grad_B = s·hᵀ·g from the K loop's g tiles, grad_A = s·xᵀ·u in the epilogue, summed
                   over row tiles by fp32 atomics, converted by each column's last row tile
  tma-frozen       diagnostic: the frozen layer through the same TMA kernel without the rank-r work
                   (1 + 1 kernels, adapters=False), so its ratio to frozen is the Triton GEMM against
                   cuBLAS, and tma+ab minus tma-frozen is what the rank-r work and lora_grad_ab cost
  streams          the project's layer with its ``streams`` plan forced: cuBLAS for x·Wᵀ and g·W,
                   the rank-r work (x·A; g·Bᵀ, then grad_A and grad_B in one Triton launch) on a
                   second, high-priority stream beside them; the caller's stream runs only the big
                   GEMM and one rank-r update each way (y += s·h·B, grad_x += s·u·Aᵀ)

Predictions for the TMA candidates (bf16, × frozen under graph replay, shapes 768→768, 768→3072,
3072→768, 1600→1600, 1600→6400, 6400→1600), written before any GPU run, from docs/kernel-design.md:
cuBLAS's GEMMs (9.8 / 30.9 / 31.8 us forward, 9.3 / 33.2 / 30.6 us g·W at 1558M), lora-kernel's
fused plan (the same 1 + 2 kernel structure: 42.4 / 111.6 / 117.9 us at 1558M), which leaves
~12 us for lora_grad_ab (bf16 gradients: one split, a latency-bound loop over 960 rows) plus ~4.5 us
of graph overhead, and the assumption that the TMA GEMM reaches ~85 % of cuBLAS (the present
Triton GEMM: 60-75 %) except at 768→768, where the fused kernel already matches cuBLAS:
  tma-frozen       1.00   1.08   1.08   1.08   1.08   1.13
  tma+ab           1.84   1.66   1.70   1.71   1.36   1.50
  tma-fused        1.10   1.30   1.30   1.27   1.23   1.36
tma+ab cannot reach 1.10×: by this estimate lora_grad_ab alone costs ~0.5× of the frozen 1600²
layer. The number to read is tma-frozen (the GEMM's own speed); the goal needs the adapter
gradients inside the backward GEMM too, which tma-fused does (its derivation: ``TMAFused``): it
predicts ~2-4 us for them instead of ~12, so the rest of the gap is the GEMM's speed against
cuBLAS and the rank-r MMAs in the K loop.

Prediction for streams, written before its first GPU run: the caller's stream carries the frozen
layer's GEMMs plus one small accumulate each way (an N×n or N×k read-modify-write with K = r: about
2 us of memory traffic at 1600 and 3-4 us with its launch gap under replay), and the side stream's
kernels fit in the SMs the big GEMM leaves idle (960 rows make ~100 output tiles on 132 SMs):
  streams          1.45   1.25   1.25   1.30   1.10   1.12

For each shape and candidate, on CUDA:
  1. check y, grad_x, grad_A, grad_B against float64 on fresh random inputs (not zeros), eagerly
     (the caching allocator's free blocks and every buffer a candidate allocates itself are NaN-filled
     first) and replayed from a CUDA graph (its outputs NaN-filled before the replay), with
     dtype-aware tolerances;
  2. count the nodes of the captured graphs, forward alone and forward+backward (the graph's DOT
     dump: kernels, memsets, memcpys; the kernel names go to OUT.kernels.txt);
  3. time forward+backward device time under graph replay: one graph per input set, sets rotated
     (together more than twice the L2), candidates interleaved in rounds (order rotating) so
     host and clock drift hit all alike, a spin kernel ahead of each block so the host is ahead
     of the GPU; median, p10, p90 and the ratio to frozen as the median of per-round ratios;
  4. the same for eager forward+backward (back to back, host cost included, as training pays it).

    python benchmarks/lora_graph_candidates.py --out results/lora-graph-candidates.csv \\
        --shapes 124m 1558m --dtypes bf16 fp32 --repeats 200
    python benchmarks/lora_graph_candidates.py --cpu-check           # CPU: the math only
    TRITON_INTERPRET=1 python benchmarks/lora_graph_candidates.py --cpu-check --dtypes fp32 fp16

``--cpu-check`` runs step 1 on the CPU (torch ops; the Triton candidates only under Triton's
interpreter, TRITON_INTERPRET=1, which gets bf16 dots wrong: use fp32/fp16 there).
``--count-only`` (CUDA) runs steps 1 and 2. ``--candidates frozen,lora-kernel,tma+ab`` (commas or
spaces) runs only those; ``--candidates frozen,tma-frozen,tma+ab,tma-fused`` the TMA ones. The
short table prints last.

A candidate that cannot run somewhere says so instead of failing: the TMA candidates are skipped,
with the reason printed and in the CSV's note, without a Hopper-class GPU and a Triton with TMA
descriptors (on the CPU: without Triton's interpreter), and where d_in or d_out make rows that are
not 16-byte aligned. On CUDA they first choose their tile configs (the log lists every config
tried, its time, and the ones that failed to compile or run); the row's note names the chosen ones.
A candidate whose check raises is reported as failed, not timed, and the study goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import torch.profiler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the checkout's lora_bench

from lora_bench.bench.kernel_bench import Shape, resolve_shapes  # noqa: E402
from lora_bench.fileio import atomic_write_text  # noqa: E402
from lora_bench.results.manifest import record_invocation  # noqa: E402
from lora_bench.results.metrics import median_p10_p90  # noqa: E402
from lora_bench.train.graph_nodes import graph_nodes, new_graph  # noqa: E402

ALPHA = 2.0  # the layer's s (kernel-bench's value)
ROUND = 20  # repeats per candidate per round
L2_DEFAULT = 60 << 20  # an H200's L2, when the device does not say
MAX_SETS = 32
SPIN_CYCLES_PER_REPLAY = 100_000  # ~50 us at ~2 GHz: the host queues a block while the GPU spins
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
DEFAULT_SHAPES = ["124m", "1558m"]
CPU_SHAPES = ["37:70->53:r1", "3x41:96->130:r4", "45:33->45:r16", "64:48->96:r16", "150:128->192:r64"]
GRADS = ("y", "grad_x", "grad_A", "grad_B")
COLUMNS = [
    "shape", "tokens", "d_in", "d_out", "rank", "dtype", "candidate", "check",
    "err_y", "err_grad_x", "err_grad_A", "err_grad_B", "tol",
    "kernels_fwd", "kernels_bwd", "other_nodes_fwd", "other_nodes_bwd",
    "graph_us", "graph_p10_us", "graph_p90_us", "graph_x_frozen",
    "eager_us", "eager_p10_us", "eager_p90_us", "eager_x_frozen",
    "repeats", "sets", "device", "torch", "triton", "note",
]

# Candidates allocate their own buffers through ``_alloc``; the checks set this to NaN-fill them,
# so an element a candidate forgets to write shows up in the comparison.
POISON = False


class UsageProblem(Exception):
    """A bad command-line value: reported in one line, exit code 2."""


def _alloc(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if POISON:
        return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _mm_scaled(a: torch.Tensor, b: torch.Tensor, s: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """s·a·b in one GEMM (alpha = s, beta = 0: whatever ``out`` held is ignored, NaN included);
    ``out`` may be a row-strided view (the right part of a concatenated buffer)."""
    out = _alloc((a.shape[0], b.shape[1]), a) if out is None else out
    return out.addmm_(a, b, beta=0, alpha=s)


# ------------------------------------------------------------------------ imported pieces


def project_layer() -> tuple[Callable, Callable]:
    """The project's lora-kernel layer, as (functional ``lora_linear(x, W, b, A, B, scale)``,
    ``graph_plan`` context manager: inside it calls choose the plan a CUDA-graph capture uses, so
    warm-ups compile and launch what the capture records). The only place this script names the
    project's layer module."""
    from lora_bench.kernels.autograd import lora_linear
    from lora_bench.kernels.policy import graph_plan

    return lora_linear, graph_plan


_TRITON: dict[str, object] = {}


def triton_kernels():
    """(lora_triton, lora_ugb) modules, or None when they cannot be imported (no Triton)."""
    if "mods" not in _TRITON:
        try:
            from lora_bench.kernels import lora_triton, lora_ugb

            _TRITON["mods"] = (lora_triton, lora_ugb)
        except Exception as exc:  # ImportError, or a Triton that fails to initialise
            _TRITON["mods"], _TRITON["error"] = None, f"{type(exc).__name__}: {exc}"
    return _TRITON["mods"]


_TMA: dict[str, object] = {}


def tma_kernels():
    """The lora_tma module (Hopper TMA kernels), or None when it cannot be imported (no Triton)."""
    if "mod" not in _TMA:
        try:
            from lora_bench.kernels import lora_tma

            _TMA["mod"] = lora_tma
        except Exception as exc:
            _TMA["mod"], _TMA["error"] = None, f"{type(exc).__name__}: {exc}"
    return _TMA["mod"]


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1)."""
    return triton_kernels() is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


# ------------------------------------------------------------------------ operands, params


@dataclass
class Operands:
    """One layer call's inputs: x (N×k, requires grad), W (n×k), b (n) or None, A (k×r), B (r×n),
    the output gradient g (N×n), the scale s."""

    x: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor | None
    a: torch.Tensor
    bm: torch.Tensor
    g: torch.Tensor
    s: float

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(N, k, n, r)"""
        return self.x.shape[0], self.x.shape[1], self.w.shape[0], self.a.shape[1]


def make_operands(dims: tuple[int, int, int, int], *, dtype: torch.dtype, device: torch.device, bias: bool = True,
                  scale: float = ALPHA, gen: torch.Generator | None = None) -> Operands:
    """Random operands for dims (N, k, n, r), scaled so x·Wᵀ, s·(x·A)·B and their gradients' two terms are all O(1) and
    comparable: an error in either path shows in the relative error."""

    def rnd(*shape, std=1.0):
        t = torch.randn(*shape, generator=gen, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        return (t * std).to(device=device, dtype=dtype)

    N, k, n, r = dims
    x = rnd(N, k).requires_grad_(True)
    return Operands(x=x, w=rnd(n, k, std=k ** -0.5), b=rnd(n, std=0.5) if bias else None, a=rnd(k, r, std=k ** -0.5),
                    bm=rnd(r, n, std=r ** -0.5), g=rnd(N, n), s=scale)


@dataclass
class Params:
    """What a candidate's call reads. ``leaves``: the adapter tensors gradients are taken for (A, B
    as the candidate holds them: for ncat/kcat, views of the concatenated buffer ``buf``)."""

    w: torch.Tensor
    b: torch.Tensor | None
    a: torch.Tensor
    bm: torch.Tensor
    s: float
    leaves: list[torch.Tensor] = field(default_factory=list)
    buf: torch.Tensor | None = None  # (n+r)×(k+r): rows [W | Bᵀ], then [Aᵀ | unused]
    bias_ext: torch.Tensor | None = None  # [b | 0]: the bias of the n+r-column forward GEMM
    n: int = 0
    k: int = 0


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def prepare_plain(op: Operands) -> Params:
    a, bm = _leaf(op.a.clone()), _leaf(op.bm.clone())
    return Params(w=op.w, b=op.b, a=a, bm=bm, s=op.s, leaves=[a, bm])


def prepare_frozen(op: Operands) -> Params:
    return Params(w=op.w, b=op.b, a=op.a, bm=op.bm, s=op.s, leaves=[])


def _concat_buffer(op: Operands) -> tuple[torch.Tensor, torch.Tensor | None]:
    N, k, n, r = op.dims
    buf = op.w.new_zeros(n + r, k + r)
    buf[:n, :k] = op.w
    buf[:n, k:] = op.bm.t()
    buf[n:, :k] = op.a.t()
    bias_ext = torch.cat([op.b, op.b.new_zeros(r)]) if op.b is not None else None
    return buf, bias_ext


def prepare_concat_views(op: Operands) -> Params:
    """A = buf[n:, :k]ᵀ and B = buf[:n, k:]ᵀ are the adapters themselves (an optimizer updating them
    in place updates the buffer): no copy per call."""
    N, k, n, r = op.dims
    buf, bias_ext = _concat_buffer(op)
    a, bm = _leaf(buf[n:, :k].t()), _leaf(buf[:n, k:].t())
    return Params(w=op.w, b=op.b, a=a, bm=bm, s=op.s, leaves=[a, bm], buf=buf, bias_ext=bias_ext, n=n, k=k)


def prepare_concat_copy(op: Operands) -> Params:
    """Separate adapter tensors; the call copies them into the buffer."""
    N, k, n, r = op.dims
    buf, bias_ext = _concat_buffer(op)
    a, bm = _leaf(op.a.clone()), _leaf(op.bm.clone())
    return Params(w=op.w, b=op.b, a=a, bm=bm, s=op.s, leaves=[a, bm], buf=buf, bias_ext=bias_ext, n=n, k=k)


# ------------------------------------------------------------------------ candidates' math


class CublasBeta(torch.autograd.Function):
    """fwd 3 GEMMs: h = x·A; y = b + s·h·B (bias through cuBLASLt's epilogue); y += x·Wᵀ (beta 1).
    bwd 5 GEMMs: us = s·g·Bᵀ; gx = us·Aᵀ; gx += g·W (beta 1); grad_A = xᵀ·us; grad_B = s·hᵀ·g —
    with ``ugb``, us and grad_B come from one Triton launch (4 launches). N×n temporaries: y only;
    N×k: grad_x only."""

    @staticmethod
    def forward(ctx, x, w, b, a, bm, s, ugb):
        h = torch.mm(x, a)
        y = torch.addmm(b, h, bm, alpha=s) if b is not None else _mm_scaled(h, bm, s)
        y.addmm_(x, w.t())
        ctx.save_for_backward(x, h, w, a, bm)
        ctx.s, ctx.ugb = s, ugb
        return y

    @staticmethod
    def backward(ctx, g):
        x, h, w, a, bm = ctx.saved_tensors
        s = ctx.s
        g = g.contiguous()
        if ctx.ugb:
            us, gb = triton_kernels()[1].lora_u_gb(g, bm, h, u_scale=s, gb_scale=s, grad_dtype=bm.dtype)
        else:
            us, gb = _mm_scaled(g, bm.t(), s), None
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.mm(us, a.t())
            gx.addmm_(g, w)
        ga = torch.mm(x.t(), us)
        if gb is None:
            gb = _mm_scaled(h.t(), g, s)
        return gx, None, None, ga, gb, None, None


class NCat(torch.autograd.Function):
    """fwd 2 GEMMs: [y | h] = x·[W ; Aᵀ]ᵀ + [b | 0] (one GEMM, n+r columns); y += s·h·B.
    bwd: [gx | u] = g·[W | Bᵀ] (one GEMM, k+r columns); gx += s·u·Aᵀ; grad_A = s·xᵀ·u and
    grad_B = s·hᵀ·g (two GEMMs, or one Triton launch with ``ab``). ``copy``: first copy A and B
    into the buffer (two small launches). A and B are read through ``p.buf``."""

    @staticmethod
    def forward(ctx, x, a, bm, p, ab, copy):
        n, k = p.n, p.k
        if copy:
            p.buf[n:, :k].copy_(a.t())
            p.buf[:n, k:].copy_(bm.t())
        wa_t = p.buf[:, :k].t()  # k×(n+r): [W ; Aᵀ]ᵀ
        out = torch.addmm(p.bias_ext, x, wa_t) if p.bias_ext is not None else torch.mm(x, wa_t)
        y, h = out[:, :n], out[:, n:]
        y.addmm_(h, p.buf[:n, k:].t(), alpha=p.s)
        ctx.save_for_backward(x, h)
        ctx.p, ctx.ab, ctx.a_dtype = p, ab, a.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        x, h = ctx.saved_tensors
        p = ctx.p
        n, k, s = p.n, p.k, p.s
        g = g.contiguous()
        gxu = torch.mm(g, p.buf[:n, :])  # [g·W | g·Bᵀ]
        gx, u = gxu[:, :k], gxu[:, k:]
        gx.addmm_(u, p.buf[n:, :k], alpha=s)
        if ctx.ab:
            ga, gb = triton_kernels()[0].lora_grad_ab(x, u, h, g, scale=s, grad_dtype=ctx.a_dtype)
        else:
            ga, gb = _mm_scaled(x.t(), u, s), _mm_scaled(h.t(), g, s)
        return (gx if ctx.needs_input_grad[0] else None), ga, gb, None, None, None


class KCat(torch.autograd.Function):
    """K-concatenation. fwd: xh = [x | s·h] (``mode`` "buffer": x copied into a preallocated
    buffer and s·h written into its last r columns by the GEMM itself; "cat": torch.cat), then
    y = xh·[W | Bᵀ]ᵀ + b, one GEMM with K = k+r. bwd: gu = [g | s·u] the same way (mode "ugb": g's
    copy, s·u and grad_B from one Triton launch), grad_x = gu·[W ; Aᵀ], one GEMM with K = n+r;
    grad_A = xᵀ·(s·u), grad_B = (s·h)ᵀ·g. The adapters are read through ``p.buf``."""

    @staticmethod
    def forward(ctx, x, a, bm, p, mode):
        N, k = x.shape
        r = a.shape[1]
        a_view = p.buf[p.n:, :k].t()
        if mode == "cat":
            xh = torch.cat([x, _mm_scaled(x, a_view, p.s)], dim=1)
        else:
            xh = _alloc((N, k + r), x)
            xh[:, :k].copy_(x)
            _mm_scaled(x, a_view, p.s, out=xh[:, k:])
        w_b = p.buf[:p.n, :]  # n×(k+r): [W | Bᵀ]
        y = torch.addmm(p.b, xh, w_b.t()) if p.b is not None else torch.mm(xh, w_b.t())
        ctx.save_for_backward(x, xh[:, k:])
        ctx.p, ctx.mode, ctx.b_dtype = p, mode, bm.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        x, hs = ctx.saved_tensors
        p, mode = ctx.p, ctx.mode
        n, k, s = p.n, p.k, p.s
        N, r = hs.shape
        g = g.contiguous()
        bt = p.buf[:n, k:]  # n×r: Bᵀ
        gb = None
        if mode == "cat":
            us = _mm_scaled(g, bt, s)
            gu = torch.cat([g, us], dim=1)
        else:
            gu = _alloc((N, n + r), g)
            us = gu[:, n:]
            if mode == "ugb":
                _, gb = triton_kernels()[1].lora_u_gb(g, bt.t(), hs, u_scale=s, gb_scale=1.0, u_out=us,
                                                      g_copy=gu[:, :n], grad_dtype=ctx.b_dtype)
            else:
                gu[:, :n].copy_(g)
                _mm_scaled(g, bt, s, out=us)
        gx = torch.mm(gu, p.buf[:, :k]) if ctx.needs_input_grad[0] else None  # [g | s·u]·[W ; Aᵀ]
        ga = torch.mm(x.t(), us)
        if gb is None:
            gb = torch.mm(hs.t(), g)
        return gx, ga, gb, None, None


class TMALoRA(torch.autograd.Function):
    """tma+ab. fwd 1 launch: y = x·Wᵀ + b + s·h·B and h = x·A (``lora_tma.lora_fwd``). bwd 2 launches:
    grad_x = g·W + s·u·Aᵀ and u = g·Bᵀ (``lora_tma.lora_bwd_x``), grad_A = s·xᵀ·u and grad_B = s·hᵀ·g
    (``lora_triton.lora_grad_ab``, gradients in the adapters' dtype, as ncat+ab). Saves x and h.

    Prediction (× frozen, graph replay, bf16; module docstring for the basis): 1.84 / 1.66 / 1.70 /
    1.71 / 1.36 / 1.50 at 768→768, 768→3072, 3072→768, 1600→1600, 1600→6400, 6400→1600."""

    @staticmethod
    def forward(ctx, x, w, b, a, bm, s):
        y, h = tma_kernels().lora_fwd(x, w, a, bm, b, s)
        ctx.save_for_backward(x, h, w, a, bm)
        ctx.s = s
        return y

    @staticmethod
    def backward(ctx, g):
        x, h, w, a, bm = ctx.saved_tensors
        s = ctx.s
        g = g.contiguous()
        gx, u = tma_kernels().lora_bwd_x(g, w, a, bm, s)
        ga, gb = triton_kernels()[0].lora_grad_ab(x, u, h, g, scale=s, grad_dtype=a.dtype)
        return (gx if ctx.needs_input_grad[0] else None), None, None, ga, gb, None


class TMAFused(TMALoRA):
    """tma-fused. fwd 1 launch, as tma+ab (``lora_tma.lora_fwd``: y and h). bwd 1 launch
    (``lora_tma.lora_bwd_ab``): the TMA GEMM g·W with u = g·Bᵀ in its K loop, grad_x = g·W + s·u·Aᵀ
    in its epilogue, and the adapter gradients from the tiles it loads anyway: grad_B = s·hᵀ·g from
    the g tiles of the K loop (each K block by the one column tile that owns it), grad_A = s·xᵀ·u
    from u and one x tile per output tile in the epilogue; both summed over the row tiles by fp32
    atomics into a workspace that the last row tile of each column converts to the adapters' dtype
    (and zeroes). Saves x and h, as tma+ab. 1 + 1 kernels.

    Prediction (× frozen, graph replay, bf16; written before any GPU run): 1.10 / 1.30 / 1.30 /
    1.27 / 1.23 / 1.36 at 768→768, 768→3072, 3072→768, 1600→1600, 1600→6400, 6400→1600.
    Derived from tma+ab's prediction (module docstring) less lora_grad_ab (~12 us, the same figure
    that prediction added), plus what the fused backward adds inside its one kernel, from its
    launch shape (960 rows: 8 row tiles of 128; columns k/128; K blocks n/64):
      * a K block that adds to grad_B costs its iteration the MMA pipelining (the small wgmma is
        synchronous: wait_group 0) plus 4 reductions per thread: ~0.15 us each; a column tile owns
        cdiv(K blocks, columns) of them: 2 / 8 / 1 / 2 / 8 / 1, and at 3072→768 and 6400→1600 a
        program runs two or three tiles: 0.3 / 1.2 / 0.3 / 0.3 / 1.2 / 0.3 us;
      * grad_A in the epilogue: one x tile loaded by TMA and waited for (~0.5 us), a 128×128×16
        MMA and 8 reductions per thread: ~0.7 us per tile a program runs in sequence: 0.7 / 0.7 /
        1.4 / 0.7 / 0.7 / 2.1 us;
      * the last row tile of each column reads back and converts its column's sums (fp32 reads
        from L2, 8-40 KB): ~1 us at the end of the kernel.
    Added 2.0 / 2.9 / 2.7 / 2.0 / 2.9 / 3.4 us; with tma+ab at 25.0 / 42.0 / 39.8 / 39.0 / 91.8 /
    90.2 us and frozen at 13.6 / 25.3 / 23.4 / 22.8 / 67.5 / 60.1 us (docs/kernel-design.md):
    15.0 / 32.9 / 30.5 / 29.0 / 82.7 / 81.6 us. What keeps it above 1.10× is what keeps tma-frozen
    at 1.08× (the Triton GEMM at ~85 % of cuBLAS) and the rank-r MMAs in the K loop (~8 %); the
    adapter gradients themselves now cost ~2-4 us instead of ~12."""

    @staticmethod
    def backward(ctx, g):
        x, h, w, a, bm = ctx.saved_tensors
        gx, ga, gb = tma_kernels().lora_bwd_ab(g.contiguous(), x, h, w, a, bm, ctx.s, grad_dtype=a.dtype)
        return (gx if ctx.needs_input_grad[0] else None), None, None, ga, gb, None


class TMALinear(torch.autograd.Function):
    """tma-frozen: fwd y = x·Wᵀ + b, bwd grad_x = g·W, one launch each of the TMA kernel without the
    rank-r work, in the configs chosen for the LoRA kernel of the same launch shape when those were
    tuned first (the GEMM inside tma+ab).

    Prediction (× frozen, graph replay, bf16): 1.00 / 1.08 / 1.08 / 1.08 / 1.08 / 1.13 at the six
    shapes above (the TMA GEMM at ~85 % of cuBLAS, the rank-r work's ~8 % taken off)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(w)
        return tma_kernels().linear_fwd(x, w, b)

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return tma_kernels().linear_bwd_x(g.contiguous(), w), None, None


@dataclass(frozen=True)
class Candidate:
    name: str
    prepare: Callable[[Operands], Params]
    call: Callable[[torch.Tensor, Params], torch.Tensor]
    triton: bool = False  # needs the project's Triton kernels
    adapters: bool = True  # False: the frozen layer (no LoRA term, no adapter gradients)
    # (operands, log) -> (why the candidate cannot run on them, or None; a note for its row). Runs
    # before the checks, on the check's operands: a candidate may compile and choose configs there.
    preflight: Callable[[Operands, Callable[[str], None]], tuple[str | None, str]] | None = None


def _tma_preflight(op: Operands, log: Callable[[str], None], *, lora: bool,
                   grad_ab: bool = False) -> tuple[str | None, str]:
    """The TMA candidates: skipped (with the reason) where TMA cannot run; on CUDA, configs tuned
    on these operands first (every config tried goes to ``log``; ``grad_ab``: the backward launch
    is the fused one); the note names the chosen ones."""
    mod = tma_kernels()
    if mod is None:
        return f"lora_tma unavailable ({_TMA.get('error')})", ""
    _, k, n, r = op.dims
    why = mod.unavailable(op.x.device) or mod.shape_unsupported(k, n, r, op.x.dtype)
    if why:
        return why, ""
    if op.x.is_cuda:
        from lora_bench.kernels.lora_tma_tune import tune_layer

        why = tune_layer(op.x, op.w, op.b, op.a, op.bm, op.g, op.s, lora=lora, grad_ab=grad_ab, log=log)
        if why:
            return f"no TMA config ran: {why}", ""
    return None, mod.chosen(op.x, op.w, grad_ab=grad_ab)


def _call_project(x, p):
    return project_layer()[0](x, p.w, p.b, p.a, p.bm, p.s)


def _call_project_plan(plan: str) -> Callable[[torch.Tensor, Params], torch.Tensor]:
    """The project's layer with one of its plans forced (``lora_bench.kernels.policy``)."""

    def call(x, p):
        from lora_bench.kernels.policy import PlanPolicy, use_policy

        with use_policy(PlanPolicy(forced=plan)):
            return _call_project(x, p)

    return call


CANDIDATES: dict[str, Candidate] = {c.name: c for c in [
    Candidate("frozen", prepare_frozen, lambda x, p: F.linear(x, p.w, p.b), adapters=False),
    Candidate("lora", prepare_plain, lambda x, p: F.linear(x, p.w, p.b) + p.s * (x @ p.a @ p.bm)),
    Candidate("lora-kernel", prepare_plain, _call_project),
    Candidate("cublas-beta", prepare_plain, lambda x, p: CublasBeta.apply(x, p.w, p.b, p.a, p.bm, p.s, False)),
    Candidate("cublas-beta+ugb", prepare_plain, lambda x, p: CublasBeta.apply(x, p.w, p.b, p.a, p.bm, p.s, True),
              triton=True),
    Candidate("ncat", prepare_concat_views, lambda x, p: NCat.apply(x, p.a, p.bm, p, False, False)),
    Candidate("ncat+ab", prepare_concat_views, lambda x, p: NCat.apply(x, p.a, p.bm, p, True, False), triton=True),
    Candidate("ncat-copy+ab", prepare_concat_copy, lambda x, p: NCat.apply(x, p.a, p.bm, p, True, True), triton=True),
    Candidate("kcat", prepare_concat_views, lambda x, p: KCat.apply(x, p.a, p.bm, p, "buffer")),
    Candidate("kcat-cat", prepare_concat_views, lambda x, p: KCat.apply(x, p.a, p.bm, p, "cat")),
    Candidate("kcat+ugb", prepare_concat_views, lambda x, p: KCat.apply(x, p.a, p.bm, p, "ugb"), triton=True),
    Candidate("tma+ab", prepare_plain, lambda x, p: TMALoRA.apply(x, p.w, p.b, p.a, p.bm, p.s), triton=True,
              preflight=functools.partial(_tma_preflight, lora=True)),
    Candidate("tma-fused", prepare_plain, lambda x, p: TMAFused.apply(x, p.w, p.b, p.a, p.bm, p.s), triton=True,
              preflight=functools.partial(_tma_preflight, lora=True, grad_ab=True)),
    Candidate("tma-frozen", prepare_frozen, lambda x, p: TMALinear.apply(x, p.w, p.b), triton=True, adapters=False,
              preflight=functools.partial(_tma_preflight, lora=False)),
    Candidate("streams", prepare_plain, _call_project_plan("streams")),
]}


# ------------------------------------------------------------------------ correctness


def reference(op: Operands, *, adapters: bool = True) -> dict[str, torch.Tensor]:
    """y and the gradients in float64 (closed form) from the operands' values; without
    ``adapters``, the frozen layer's y and grad_x."""
    x, w, a, bm, g = (t.detach().double() for t in (op.x, op.w, op.a, op.bm, op.g))
    s = op.s if adapters else 0.0
    h, u = x @ a, g @ bm.t()
    y = x @ w.t() + s * (h @ bm)
    if op.b is not None:
        y = y + op.b.double()
    return {"y": y, "grad_x": g @ w + s * (u @ a.t()), "grad_A": s * (x.t() @ u), "grad_B": s * (h.t() @ g)}


def rel_err(out: torch.Tensor | None, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or a missing output never pass."""
    if out is None:
        return math.inf
    out = out.detach().double()
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return math.inf
    den = float(ref.norm())
    num = float((out - ref.to(out.device)).norm())
    return num / den if den else (0.0 if num == 0 else math.inf)


def tolerance(dtype: torch.dtype) -> float:
    """Relative (Frobenius) error allowed against float64: a few roundings of the dtype at these
    reduction lengths; a wrong term (missing scale, wrong operand) is off by O(1)."""
    if dtype == torch.float64:
        return 1e-10
    if dtype == torch.float32:
        return 2e-5 if torch.get_float32_matmul_precision() == "highest" else 5e-3
    return {torch.bfloat16: 1e-2, torch.float16: 3e-3}[dtype]


def _outputs(cand: Candidate, op: Operands, p: Params) -> dict[str, torch.Tensor]:
    """One forward+backward: y and the gradients of x and the adapters (``GRADS`` order)."""
    y = cand.call(op.x, p)
    grads = torch.autograd.grad(y, [op.x, *p.leaves], op.g)
    return dict(zip(GRADS, (y, *grads)))


@contextlib.contextmanager
def poisoned():
    """Everything candidates allocate themselves is NaN-filled: this module's buffers and the
    outputs of the project's Triton wrappers (the TMA kernels' too, once loaded)."""
    global POISON
    mods = [*(triton_kernels() or ()), *([_TMA["mod"]] if _TMA.get("mod") is not None else [])]
    flags = [(m, m.POISON_OUTPUTS) for m in mods]
    POISON = True
    for m, _ in flags:
        m.POISON_OUTPUTS = True
    try:
        yield
    finally:
        POISON = False
        for m, old in flags:
            m.POISON_OUTPUTS = old


def poison_cuda_allocator(device: torch.device, nbytes: int = 1 << 30) -> None:
    """Fill free memory of the caching allocator with NaN, so tensors torch allocates next start as
    NaN: one large block (tensors above 1 MB are cut from it) and small-pool blocks."""
    big = torch.full((nbytes // 4,), float("nan"), device=device)
    small = [torch.full((1 << 16,), float("nan"), device=device) for _ in range(64)]  # 256 KB each
    del big, small


def errors(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative error of each output; NaN for gradients the candidate has no parameter for (frozen)."""
    return {k: rel_err(out[k], ref[k]) if k in out else math.nan for k in GRADS}


def check_eager(cand: Candidate, op: Operands, ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative errors of one eager forward+backward with poisoned buffers (and, on CUDA, a
    poisoned allocator) against ``ref``."""
    p = cand.prepare(op)
    with poisoned():
        if op.x.is_cuda:
            poison_cuda_allocator(op.x.device)
        out = _outputs(cand, op, p)
    return errors(out, ref)


# ------------------------------------------------------------------------ CUDA graphs


def _warm(fn: Callable, iters: int = 3) -> None:
    """Run ``fn`` on a side stream, as capture requires, in the plan a capture uses."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), project_layer()[1]():
        for _ in range(iters):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def capture(fn: Callable, *, debug: bool = False, warm: int = 3):
    """(graph, what ``fn`` returned during capture: the graph's static outputs)."""
    if warm:
        _warm(fn, warm)
    graph = new_graph(debug)
    with project_layer()[1](), torch.cuda.graph(graph):
        out = fn()
    return graph, out


def profiled_kernels(fn: Callable) -> list[str]:
    """Names of the CUDA kernels (and memcpy/memset) one eager call of ``fn`` runs in the plan a
    capture uses: the fallback count when the graph dump cannot be read."""
    with project_layer()[1]():
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def short_name(name: str) -> str:
    """A kernel name short enough for a table: cuBLAS/CUTLASS GEMMs by their tile, ATen kernels by
    their functor, Triton kernels as they are."""
    if len(name) <= 60:
        return name
    for key in ("gemm", "xmma", "cutlass", "elementwise", "copy", "reduce", "fill"):
        i = name.find(key)
        if i >= 0:
            return "…" + name[max(0, i - 12):i + 48] + "…"
    return name[:60] + "…"


@dataclass
class GraphCheck:
    errors: dict[str, float]
    kernels_fwd: list[str]
    kernels_bwd: list[str]
    other_fwd: int | None  # memset/memcpy/other nodes; None when counted by the profiler
    other_bwd: int | None
    note: str = ""


def _minus(items: list[str], remove: list[str]) -> list[str]:
    """``items`` without one occurrence of each of ``remove`` (a multiset difference, order kept)."""
    left = list(items)
    for name in remove:
        if name in left:
            left.remove(name)
    return left


def check_graph(cand: Candidate, op: Operands, ref: dict[str, torch.Tensor]) -> GraphCheck:
    """Capture forward alone and forward+backward (debug mode: node counts), NaN-fill the
    captured outputs, replay, compare."""
    p = cand.prepare(op)
    graph, _ = capture(lambda: cand.call(op.x, p), debug=True)
    nodes_fwd = graph_nodes(graph)
    del graph, _
    graph, outs = capture(lambda: _outputs(cand, op, p), debug=True)
    nodes_all = graph_nodes(graph)
    for t in outs.values():
        t.detach().fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    errs = errors(outs, ref)
    del graph, outs
    if nodes_fwd is not None and nodes_all is not None:
        kf, ka = nodes_fwd.get("KERNEL", []), nodes_all.get("KERNEL", [])
        of = sum(len(v) for kind, v in nodes_fwd.items() if kind != "KERNEL")
        oa = sum(len(v) for kind, v in nodes_all.items() if kind != "KERNEL")
        return GraphCheck(errs, kf, _minus(ka, kf), of, oa - of)
    kf = profiled_kernels(lambda: cand.call(op.x, p))
    ka = profiled_kernels(lambda: _outputs(cand, op, p))
    return GraphCheck(errs, kf, _minus(ka, kf), None, None,
                      "counts from the profiler (an eager call in the capture plan): graph dump unreadable")


# ------------------------------------------------------------------------ timing


def n_sets(dims: tuple[int, int, int, int], dtype: torch.dtype, l2_bytes: int) -> int:
    """Input sets to rotate so that together they exceed twice the L2 (3 to ``MAX_SETS``)."""
    N, k, n, r = dims
    elt = torch.tensor([], dtype=dtype).element_size()
    per_set = elt * (n * k + N * (k + n) + r * (k + n))
    return max(3, min(MAX_SETS, math.ceil(2 * l2_bytes / per_set)))


def _blocks(repeats: int) -> list[int]:
    rounds = max(1, math.ceil(repeats / ROUND))
    return [repeats // rounds + (1 if i < repeats % rounds else 0) for i in range(rounds)]


def interleaved(names: list[str], run_block: Callable[[str, int], list], repeats: int) -> dict[str, list[list[float]]]:
    """Per candidate, per round, the milliseconds of each repeat. ``run_block(name, count)`` queues
    ``count`` timed repeats and returns their (start, end) CUDA events; candidates take turns,
    the order rotating every round."""
    spans: dict[str, list[list]] = {c: [] for c in names}
    for rnd, count in enumerate(_blocks(repeats)):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for c in order:
            spans[c].append(run_block(c, count))
    torch.cuda.synchronize()
    return {c: [[s.elapsed_time(e) for s, e in blk] for blk in blocks] for c, blocks in spans.items()}


def summarize(ms: dict[str, list[list[float]]], base: str | None) -> dict[str, dict[str, float]]:
    """Median, p10, p90 in microseconds over all repeats; ``x``: the median over rounds of the
    ratio of this candidate's round median to the base's (drift within a round cancels)."""
    out = {}
    for c, rounds in ms.items():
        flat = [1e3 * v for blk in rounds for v in blk]
        med, p10, p90 = median_p10_p90(flat)
        row = {"us": med, "p10_us": p10, "p90_us": p90}
        if base in ms:
            row["x"] = statistics.median(statistics.median(a) / statistics.median(b)
                                         for a, b in zip(rounds, ms[base]))
        out[c] = row
    return out


def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def time_graphs(graphs: dict[str, list[torch.cuda.CUDAGraph]], repeats: int) -> dict[str, list[list[float]]]:
    turn = {c: 0 for c in graphs}

    def block(c: str, count: int) -> list:
        gs = graphs[c]
        torch.cuda._sleep(SPIN_CYCLES_PER_REPLAY * count)  # GPU busy while the host queues the block
        spans = []
        for _ in range(count):
            s, e = _events()
            s.record()
            gs[turn[c] % len(gs)].replay()
            e.record()
            turn[c] += 1
            spans.append((s, e))
        return spans

    for gs in graphs.values():  # warm: every graph once
        for gr in gs:
            gr.replay()
    torch.cuda.synchronize()
    return interleaved(list(graphs), block, repeats)


def time_eager(calls: dict[str, list[Callable]], repeats: int, warmup: int = 5) -> dict[str, list[list[float]]]:
    turn = {c: 0 for c in calls}
    first = set()

    def block(c: str, count: int) -> list:
        fns = calls[c]
        for i in range(warmup if c not in first else 2):  # later rounds: a short re-warm
            fns[i % len(fns)]()
        first.add(c)
        spans = []
        for _ in range(count):
            s, e = _events()
            s.record()
            fns[turn[c] % len(fns)]()
            e.record()
            turn[c] += 1
            spans.append((s, e))
        return spans

    return interleaved(list(calls), block, repeats)


# ------------------------------------------------------------------------ driver


def _dims(shape: Shape) -> tuple[int, int, int, int]:
    """(N tokens, k = d_in, n = d_out, r)"""
    return shape.tokens, shape.d_in, shape.d_out, shape.rank


def _shape_fields(shape: Shape) -> dict:
    return {"shape": shape.name, "tokens": shape.tokens, "d_in": shape.d_in, "d_out": shape.d_out, "rank": shape.rank}


def _versions() -> dict:
    mods = triton_kernels()
    tv = ""
    if mods is not None:
        tv = sys.modules["triton"].__version__
    return {"torch": torch.__version__, "triton": tv}


def _skip_notice(log: Callable[[str], None]) -> Callable[[str, str], None]:
    """Says each (candidate, reason) of a skip once."""
    said = set()

    def say(name: str, why: str) -> None:
        if (name, why) not in said:
            said.add((name, why))
            log(f"{name} skipped: {why}")

    return say


def _stderr(msg: str) -> None:
    print(f"lora_graph_candidates: {msg}", file=sys.stderr, flush=True)


def run_cpu_check(shapes: list[Shape], dtypes: list[str], names: list[str],
                  log: Callable[[str], None] = _stderr) -> list[dict]:
    """Step 1 on the CPU, eager only, with and without a bias."""
    device = torch.device("cpu")
    skipped = _skip_notice(log)
    rows = []
    for shape in shapes:
        for dt in dtypes:
            dtype = DTYPES[dt]
            for bias in (True, False):
                op = make_operands(_dims(shape), dtype=dtype, device=device, bias=bias)
                refs = {True: reference(op), False: reference(op, adapters=False)}
                for name in names:
                    cand = CANDIDATES[name]
                    row = {**_shape_fields(shape), "dtype": dt, "candidate": name, "device": "cpu",
                           "tol": tolerance(dtype), **_versions(), "note": "bias" if bias else "no bias"}
                    why = None
                    if cand.triton and not triton_usable(device):
                        why = "Triton skipped (needs Triton and TRITON_INTERPRET=1 on the CPU)"
                    elif cand.preflight is not None:
                        why, note = cand.preflight(op, log)
                        if note:
                            row["note"] += f"; {note}"
                    if why:
                        row["check"] = "skip"
                        row["note"] += f"; {why}"
                        skipped(name, why)
                    else:
                        errs = check_eager(cand, op, refs[cand.adapters])
                        row.update({f"err_{k}": v for k, v in errs.items()})
                        row["check"] = _verdict(errs, tolerance(dtype))
                    rows.append(row)
    return rows


def _verdict(errs: dict[str, float], tol: float) -> str:
    bad = [k for k, v in errs.items() if not math.isnan(v) and not v <= tol]
    return "ok" if not bad else "FAIL " + ",".join(bad)


def _worst(a: float, b: float) -> float:
    """The larger error of two checks (NaN: not applicable in both)."""
    if math.isnan(a) or math.isnan(b):
        return b if math.isnan(a) else a
    return max(a, b)


def run_cuda(shapes: list[Shape], dtypes: list[str], names: list[str], *, repeats: int, count_only: bool,
             log: Callable[[str], None], on_group: Callable[[list[dict], list[str]], None]) -> list[dict]:
    """Steps 1-4 for every (shape, dtype); ``on_group(rows so far, kernel log)`` after each, so a
    failure later loses nothing measured."""
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0) or L2_DEFAULT
    rows, kernel_log = [], [f"# {props.name}, torch {torch.__version__}: kernels of each captured graph, in order"]
    if any(CANDIDATES[n].triton for n in names) and not triton_usable(device):
        log(f"Triton unavailable ({_TRITON.get('error')}): skipping the Triton candidates")
        names = [n for n in names if not CANDIDATES[n].triton]
    base = "frozen" if "frozen" in names else None
    skipped = _skip_notice(log)
    for dt in dtypes:  # dtype by dtype: the first one listed is complete before the next starts
        for shape in shapes:
            t0 = time.perf_counter()
            dtype = DTYPES[dt]
            tol = tolerance(dtype)
            group, timed = {}, []
            op = make_operands(_dims(shape), dtype=dtype, device=device)
            refs = {True: reference(op), False: reference(op, adapters=False)}
            for name in names:
                cand = CANDIDATES[name]
                ref = refs[cand.adapters]
                row = group[name] = {**_shape_fields(shape), "dtype": dt, "candidate": name, "tol": tol,
                                     "repeats": repeats, "device": props.name, **_versions(), "note": ""}
                try:
                    why, note = cand.preflight(op, log) if cand.preflight is not None else (None, "")
                    if why:
                        row.update(check="skip", note=why)
                        skipped(name, why)
                        continue
                    eager_err = check_eager(cand, op, ref)
                    gc = check_graph(cand, op, ref)
                except Exception as exc:  # one candidate's failure is its row's, not the study's
                    with contextlib.suppress(Exception):
                        torch.cuda.synchronize()
                    row.update(check="FAIL (error)", note=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
                    log(f"{shape.name} {dt} {name}: failed: {row['note']}")
                    continue
                errs = {key: _worst(eager_err[key], gc.errors[key]) for key in GRADS}
                row.update({
                    "check": _verdict(errs, tol), **{f"err_{key}": v for key, v in errs.items()},
                    "kernels_fwd": len(gc.kernels_fwd), "kernels_bwd": len(gc.kernels_bwd),
                    "other_nodes_fwd": gc.other_fwd, "other_nodes_bwd": gc.other_bwd,
                    "note": "; ".join(filter(None, [note, gc.note])),
                })
                timed.append(name)
                kernel_log.append(f"{shape.name} {dt} {name}:\n  fwd: " + " | ".join(map(short_name, gc.kernels_fwd))
                                  + "\n  bwd: " + " | ".join(map(short_name, gc.kernels_bwd)))
            del op, refs
            log(f"{shape.name} {dt}: checks and counts done ({time.perf_counter() - t0:.1f} s)")
            if not count_only:
                _time_group(group, timed, _dims(shape), dtype=dtype, l2=l2, repeats=repeats,
                            base=base if base in timed else None, device=device)
            rows += [group[c] for c in names]
            torch.cuda.empty_cache()
            on_group(rows, kernel_log)
            log(f"{shape.name} {dt}: done ({time.perf_counter() - t0:.1f} s)")
    return rows


def _time_group(group: dict[str, dict], names: list[str], dims: tuple[int, int, int, int], *, dtype: torch.dtype,
                l2: int, repeats: int, base: str | None, device: torch.device) -> None:
    """Steps 3 and 4 for one (shape, dtype): every candidate on the same rotating input sets."""
    sets = [make_operands(dims, dtype=dtype, device=device) for _ in range(n_sets(dims, dtype, l2))]
    graphs, calls = {}, {}
    for name in names:
        cand = CANDIDATES[name]
        fns = [(lambda c=cand, op=op, p=cand.prepare(op): _outputs(c, op, p)) for op in sets]
        _warm(fns[0])
        graphs[name] = [capture(fn, warm=0)[0] for fn in fns]
        calls[name] = fns
    for name, stats in summarize(time_graphs(graphs, repeats), base).items():
        group[name].update(graph_us=stats["us"], graph_p10_us=stats["p10_us"], graph_p90_us=stats["p90_us"],
                           graph_x_frozen=stats.get("x"), sets=len(sets))
    del graphs
    for name, stats in summarize(time_eager(calls, repeats), base).items():
        group[name].update(eager_us=stats["us"], eager_p10_us=stats["p10_us"], eager_p90_us=stats["p90_us"],
                           eager_x_frozen=stats.get("x"))


def _fmt(v, spec: str) -> str:
    if v is None or v == "" or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def _columns(head: tuple[str, ...], lines: list[tuple[str, ...]], left: int) -> str:
    """Plain text table; the first ``left`` columns left-aligned."""
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:{'<' if i < left else '>'}{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head), *(fmt.format(*line) for line in lines)])


def _launches(r: dict) -> str:
    text = f"{_fmt(r.get('kernels_fwd'), 'd')}/{_fmt(r.get('kernels_bwd'), 'd')}"
    other = (r.get("other_nodes_fwd") or 0) + (r.get("other_nodes_bwd") or 0)
    return text + (f" +{other}" if other else "")


def render_rows(rows: list[dict]) -> str:
    """Every measured row: launches (kernel nodes fwd/bwd, + other graph nodes), check, medians."""
    head = ("shape", "dtype", "candidate", "launches f/b", "check", "graph us", "p10-p90", "x frozen",
            "eager us", "x frozen")
    lines = [(r["shape"], r["dtype"], r["candidate"], _launches(r), str(r.get("check", "")),
              _fmt(r.get("graph_us"), ".1f"), f"{_fmt(r.get('graph_p10_us'), '.1f')}-{_fmt(r.get('graph_p90_us'), '.1f')}",
              _fmt(r.get("graph_x_frozen"), ".2f"), _fmt(r.get("eager_us"), ".1f"), _fmt(r.get("eager_x_frozen"), ".2f"))
             for r in rows]
    return _columns(head, lines, 5)


def render_summary(rows: list[dict]) -> str:
    """The short table: per dtype, one line per candidate; per shape its graph-replay time as a
    multiple of frozen (eager multiple after the slash), or, without timings, the checks passed."""
    timed = any(r.get("graph_us") not in (None, "") for r in rows)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    out = []
    for dt in dict.fromkeys(r["dtype"] for r in rows):
        cands = list(dict.fromkeys(r["candidate"] for r in rows if r["dtype"] == dt))
        lines = []
        for c in cands:
            line = [c]
            for shape in shapes:
                rs = [r for r in rows if r["dtype"] == dt and r["candidate"] == c and r["shape"] == shape]
                if not rs:
                    line.append("")
                elif timed and rs[0].get("check") == "skip":
                    line.append("skip")
                elif timed:
                    r = rs[0]
                    flag = "" if r.get("check") == "ok" else "!"
                    line.append(f"{_fmt(r.get('graph_x_frozen'), '.2f')}/{_fmt(r.get('eager_x_frozen'), '.2f')}"
                                f" ({_launches(r)}){flag}")
                else:
                    done = [r for r in rs if r.get("check") != "skip"]
                    ok = sum(r.get("check") == "ok" for r in done)
                    counted = rs[0].get("kernels_fwd") not in (None, "")
                    line.append((f"{ok}/{len(done)} ok" if done else "skip") + (f" ({_launches(rs[0])})" if counted else ""))
            lines.append(tuple(line))
        counted = any(r.get("kernels_fwd") not in (None, "") for r in rows)
        what = ("graph/eager x frozen (kernels fwd/bwd; ! = check failed)" if timed
                else "checks passed (kernels fwd/bwd of the captured graphs)" if counted
                else "checks passed (with and without a bias)")
        out.append(f"{dt}: {what}\n" + _columns(("candidate", *shapes), lines, 1))
    return "\n\n".join(out)


def write_csv(rows: list[dict], path: Path) -> None:
    def cell(v):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        s = f"{v:.6g}" if isinstance(v, float) else str(v)
        return '"' + s.replace('"', '""') + '"' if any(ch in s for ch in ',"\n') else s

    text = ",".join(COLUMNS) + "\n" + "".join(",".join(cell(r.get(c)) for c in COLUMNS) + "\n" for r in rows)
    atomic_write_text(path, text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="CSV to write (also OUT.kernels.txt with the kernel names on CUDA)")
    ap.add_argument("--shapes", nargs="+", help="groups (124m, 1558m, guide) or 'N:IN->OUT:rR' specs; default "
                    f"{' '.join(DEFAULT_SHAPES)} (CUDA), {' '.join(CPU_SHAPES)} (--cpu-check)")
    ap.add_argument("--dtypes", nargs="+", help=f"of {', '.join(DTYPES)}; default bf16 (CUDA), fp32 fp64 (--cpu-check)")
    ap.add_argument("--repeats", type=int, default=200, help="timed repeats per candidate (rounds of %d)" % ROUND)
    ap.add_argument("--candidates", nargs="+", help=f"subset (commas or spaces) of {', '.join(CANDIDATES)}")
    ap.add_argument("--cpu-check", action="store_true", help="correctness only, on the CPU (no CUDA needed)")
    ap.add_argument("--count-only", action="store_true", help="CUDA: checks and graph node counts, no timing")
    return ap.parse_args(argv)


def validate(args: argparse.Namespace) -> tuple[list[Shape], list[str], list[str]]:
    try:
        shapes = resolve_shapes(args.shapes or (CPU_SHAPES if args.cpu_check else DEFAULT_SHAPES))
    except ValueError as exc:
        raise UsageProblem(str(exc)) from None
    dtypes = args.dtypes or (["fp32", "fp64"] if args.cpu_check else ["bf16"])
    for d in dtypes:
        if d not in DTYPES:
            raise UsageProblem(f"--dtypes {d!r}: expected one of {', '.join(DTYPES)}")
    names = [n for arg in args.candidates for n in arg.split(",") if n] if args.candidates else list(CANDIDATES)
    for c in names:
        if c not in CANDIDATES:
            raise UsageProblem(f"--candidates {c!r}: expected one of {', '.join(CANDIDATES)}")
    if args.repeats < 1:
        raise UsageProblem(f"--repeats {args.repeats}: expected a positive count")
    if not args.cpu_check:
        if not torch.cuda.is_available():
            raise UsageProblem("no CUDA device is visible: this study times on a GPU; use --cpu-check for the math")
        if args.out is None:
            raise UsageProblem("--out PATH is required for a CUDA run (the CSV of the measurements)")
    return shapes, dtypes, names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        shapes, dtypes, names = validate(args)
    except UsageProblem as exc:
        print(f"lora_graph_candidates: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    def save(rows: list[dict], kernel_log: list[str]) -> None:
        write_csv(rows, args.out)
        kernels = Path(str(args.out) + ".kernels.txt")
        atomic_write_text(kernels, "\n".join(kernel_log) + "\n")
        # the folder's manifest.json: this command line, the source commit, the environment
        record_invocation(args.out.parent, outputs=[args.out.name, kernels.name])

    if args.cpu_check:
        rows = run_cpu_check(shapes, dtypes, names, log)
        if args.out is not None:
            write_csv(rows, args.out)
    else:
        log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, shapes {[s.name for s in shapes]}, "
            f"dtypes {dtypes}, {len(names)} candidates, {args.repeats} repeats")
        rows = run_cuda(shapes, dtypes, names, repeats=args.repeats, count_only=args.count_only, log=log,
                        on_group=save)
        print(render_rows(rows) + "\n")
    print(render_summary(rows))
    failed = [r for r in rows if str(r.get("check", "")).startswith("FAIL")]
    if failed:
        print(f"lora_graph_candidates: {len(failed)} check(s) failed: "
              + ", ".join(f"{r['shape']} {r['dtype']} {r['candidate']} ({r['check']})" for r in failed[:8]),
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
