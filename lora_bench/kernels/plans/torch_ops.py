"""The ``torch`` plan: the minimal LoRA work in plain torch ops. It needs nothing but torch, so it
runs everywhere: the CPU, CUDA without Triton, ranks above the Triton kernels' limit.

Host time matters as much as device time in these functions: at GPT-2 sizes a layer's
forward+backward is host-bound on a fast GPU, so they avoid views, no-op casts and context
managers they do not need (each costs microseconds of Python/dispatcher time per call)."""

from __future__ import annotations

import torch

from lora_bench.kernels.call import Call

FALLBACK = None


def runs(call: Call) -> bool:
    return True


def forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, a: torch.Tensor, bm: torch.Tensor,
            s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y (N×n), h (N×r) for x (N×k), w (n×k), a (k×r), bm (r×n)."""
    h = x @ a  # (N, r)
    y = torch.addmm(b, x, w.t()) if b is not None else x @ w.t()  # (N, n)
    y.addmm_(h, bm, alpha=s)  # in place: no N×n temporary
    return y, h


def grad_x_u(g: torch.Tensor, w: torch.Tensor, a: torch.Tensor, bm: torch.Tensor,
             s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_x = g·W + s·u·Aᵀ (N×k) and u = g·Bᵀ (N×r)."""
    u = g @ bm.t()  # (N, r)
    gx = g @ w  # (N, k)
    gx.addmm_(u, a.t(), alpha=s)
    return gx, u


def grad_ab(x: torch.Tensor, u: torch.Tensor, h: torch.Tensor, g: torch.Tensor, s: float, *, do_a: bool,
            do_b: bool, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """grad_A = s·xᵀ·u (k×r), grad_B = s·hᵀ·g (r×n), in the parameters' dtype."""
    ga = torch.mm(x.t(), u).mul_(s).to(dtype) if do_a else None
    gb = torch.mm(h.t(), g).mul_(s).to(dtype) if do_b else None
    return ga, gb
