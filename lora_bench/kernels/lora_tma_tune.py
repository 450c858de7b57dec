"""Choosing the Hopper TMA kernel's launch configuration per launch shape: each candidate config
compiled, checked against float64 and timed as launches replayed from a CUDA graph; the fastest
correct one goes into :data:`lora_bench.kernels.lora_tma.TUNED`, which the launches read."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch

from lora_bench.kernels import lora_tma as T
from lora_bench.kernels.lora_triton import _precision


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


def _tune_one(key: tuple, run: Callable[[T.TMAConfig], list[torch.Tensor]], refs: list[torch.Tensor],
              cands: tuple[T.TMAConfig, ...]) -> tuple[T.TMAConfig | None, str]:
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
                T.reset_scratch()  # a wrong kernel may have left counters or workspaces dirty
                continue
            timed.append((_graph_us(lambda c=c: run(c)), c))
        except Exception as exc:  # compile errors, out of shared memory, ...
            failed.append(f"{c.label} {_brief(exc)}")
            T.reset_scratch()
    timed.sort(key=lambda t: t[0])
    text = ", ".join(f"{c.label} {us:.1f}" for us, c in timed)
    if failed:
        text += "; failed: " + "; ".join(failed)
    return (timed[0][1] if timed else None), text


def tune_layer(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor | None,
               b: torch.Tensor | None, g: torch.Tensor, scale: float, *, lora: bool = True, grad_ab: bool = False,
               log: Callable[[str], None] | None = None) -> str | None:
    """Choose the config of the layer's two launches (forward, and grad_x in the backward) on these
    operands (CUDA; x N×k, W n×k, A k×r, B r×n, g N×n): each config in ``T.configs`` is compiled,
    checked against torch (float64) and timed; the fastest correct one is kept in ``T.TUNED``
    (shapes tuned before are not tried again). ``lora=False``: the frozen kernels; ``grad_ab``: the
    backward launch is the fused one (``T.lora_bwd_ab``: grad_x, grad_A, grad_B). Returns None, or
    why no config ran (then the layer cannot use these kernels)."""
    x, w, g = T._aligned(x.detach()), T._aligned(w.detach()), T._aligned(g.detach())
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
            fwd = lambda c: list(T.lora_fwd(x, w, a, b, bias, scale, config=c, out=y, h_out=h))
            if grad_ab:
                h_in = h_ref.to(x.dtype)
                ga, gb = torch.empty_like(a), torch.empty_like(b)
                bwd = lambda c: list(T.lora_bwd_ab(g, x, h_in, w, a, b, scale, config=c, out=gx, ga_out=ga, gb_out=gb))
                bwd_job = ("bwd+ab", T._key(g, k, n, True, True), bwd, [gx_ref, ga_ref, gb_ref])
            else:
                bwd = lambda c: list(T.lora_bwd_x(g, w, a, b, scale, config=c, out=gx, u_out=u))
                bwd_job = ("bwd", T._key(g, k, n, True), bwd, [gx_ref, u_ref])
            jobs = (("fwd", T._key(x, n, k, False), fwd, [y_ref, h_ref]), bwd_job)
        else:
            fwd = lambda c: [T.linear_fwd(x, w, bias, config=c, out=y)]
            bwd = lambda c: [T.linear_bwd_x(g, w, config=c, out=gx)]
            jobs = (("fwd", T._key(x, n, k, False), fwd, [y_ref]), ("bwd", T._key(g, k, n, True), bwd, [gx_ref]))
        problems = []
        for name, key, run, refs in jobs:
            if key in T.TUNED:
                continue
            cands = T.configs(x.dtype, x.device)
            if key[6]:  # the fused backward: data-parallel T.configs only
                cands = T._fused_ab_configs(cands)
            best, text = _tune_one(key, run, refs, cands)
            T.TUNE_LOG[key] = f"{name} {key[2]}x{key[3]}x{key[4]}: {text}"
            if log is not None:
                log(T.TUNE_LOG[key])
            if best is None:
                problems.append(f"{name}: no config ran ({text})")
            else:
                T.TUNED[key] = best
    return "; ".join(problems) or None
