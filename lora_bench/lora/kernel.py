"""``--trainable-layers lora-kernel``: the LoRA layer with a hand-written backward.

Same parameters, init and alpha semantics as ``lora`` (y = x·Wᵀ + b + alpha·(x·A)·B, alpha not
divided by the rank); only forward/backward differ. One autograd Function does the minimal work
(docs performance.md, "LoRA layer, minimal work"):

    forward   h = x·A;  y = x·Wᵀ + b + s·h·B                 saves x and h (N×r), nothing N×n
    backward  u = g·Bᵀ; grad_x = g·W + s·u·Aᵀ; grad_A = s·xᵀ·u; grad_B = s·hᵀ·g
              grad_W = gᵀ·x and grad_b = Σg only if W/b require grad (a trainable head)

Where it runs (``_plan``; ``LORA_BENCH_KERNEL_MODE=fwd[:bwd]`` overrides, for measurements):
  fused   Triton: one launch forward (big GEMM with the rank-r path folded in), two backward
  cublas  cuBLAS for the GEMMs (torch ops), one Triton launch for grad_A and grad_B together
  torch   torch ops only: the CPU path, and the fallback on CUDA without Triton
"""

from __future__ import annotations

import os
import warnings

import torch

from .layer import LoRALinearBase

_MODES = ("fused", "cublas", "torch")
_triton_state: dict[str, object] = {}  # "module" -> lora_triton, or "error" -> reason


def _parse_mode(text: str | None) -> tuple[str, str] | None:
    if not text:
        return None
    parts = text.split(":")
    fwd, bwd = parts[0], parts[-1]
    if fwd not in _MODES or bwd not in _MODES or len(parts) > 2:
        raise ValueError(f"LORA_BENCH_KERNEL_MODE={text!r}: expected MODE or FWD:BWD with modes {_MODES}")
    return fwd, bwd


_mode_override = _parse_mode(os.environ.get("LORA_BENCH_KERNEL_MODE"))


def set_kernel_mode(mode: str | None) -> None:
    """Force a plan ("fused", "cublas", "torch" or "fwd:bwd"); None restores the default."""
    global _mode_override
    _mode_override = _parse_mode(mode)


def _triton():
    """The Triton kernels module, or None (with one clear warning) if Triton cannot be used."""
    if "module" in _triton_state:
        return _triton_state["module"]
    if "error" in _triton_state:
        return None
    try:
        from lora_bench.kernels import lora_triton

        _triton_state["module"] = lora_triton
        return lora_triton
    except Exception as exc:  # ImportError, or a Triton that fails to initialise
        _triton_state["error"] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            "lora-kernel: Triton is unavailable (" + str(_triton_state["error"]) + "); the CUDA "
            "path falls back to plain torch ops (correct, but slower). Install the 'triton' extra.",
            RuntimeWarning, stacklevel=3,
        )
        return None


def lora_kernel_backend(device: torch.device | str) -> str:
    """'triton' when lora-kernel layers on ``device`` run the project's Triton kernels, else 'torch'."""
    device = torch.device(device)
    if device.type != "cuda" or _mode_override == ("torch", "torch"):
        return "torch"
    return "triton" if _triton() is not None else "torch"


def _plan(x: torch.Tensor, rank: int) -> tuple[str, str]:
    """(forward mode, backward mode) for this input; see the module docstring."""
    if x.device.type != "cuda" and not (_mode_override and os.environ.get("TRITON_INTERPRET") == "1"):
        return "torch", "torch"  # (a forced mode under Triton's CPU interpreter is for tests)
    tk = _triton()
    if tk is None or rank > tk.MAX_RANK:
        return "torch", "torch"
    if _mode_override is not None:
        return _mode_override
    if x.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        # exact fp32 GEMMs: cuBLAS's fp32 path; Triton's ieee dots would be far slower
        return "cublas", "cublas"
    return "fused", "fused"


# ------------------------------------------------------------------------------- the math


def _forward(mode: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
             a: torch.Tensor, bm: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y (N×n), h (N×r) for x (N×k), w (n×k), a (k×r), bm (r×n)."""
    if mode == "fused":
        return _triton().lora_mm(x, w.t(), a, bm, b, scale=s)
    h = x @ a  # (N, r)
    y = torch.addmm(b, x, w.t()) if b is not None else x @ w.t()  # (N, n)
    y.addmm_(h, bm, alpha=s)  # in place: no N×n temporary
    return y, h


def _grad_x_u(mode: str, g: torch.Tensor, w: torch.Tensor, a: torch.Tensor, bm: torch.Tensor,
              s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_x = g·W + s·u·Aᵀ (N×k) and u = g·Bᵀ (N×r)."""
    if mode == "fused":
        return _triton().lora_mm(g, w, bm.t(), a.t(), None, scale=s)
    u = g @ bm.t()  # (N, r)
    gx = g @ w  # (N, k)
    gx.addmm_(u, a.t(), alpha=s)
    return gx, u


def _grad_ab(mode: str, x: torch.Tensor, u: torch.Tensor, h: torch.Tensor, g: torch.Tensor, s: float,
             *, do_a: bool, do_b: bool, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """grad_A = s·xᵀ·u (k×r), grad_B = s·hᵀ·g (r×n), in the parameters' dtype."""
    if mode != "torch":
        return _triton().lora_grad_ab(x, u, h, g, scale=s, grad_dtype=dtype, do_a=do_a, do_b=do_b)
    ga = torch.mm(x.t(), u).mul_(s).to(dtype) if do_a else None
    gb = torch.mm(h.t(), g).mul_(s).to(dtype) if do_b else None
    return ga, gb


def _compute_dtype(x: torch.Tensor, params: list[torch.Tensor]) -> torch.dtype:
    """Autocast's dtype when autocast is on for x's device, else x's dtype (which must match)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.is_floating_point():
        return torch.get_autocast_dtype(dev)
    for p in params:
        if p.dtype != x.dtype:
            raise TypeError(f"lora-kernel: input is {x.dtype} but a parameter is {p.dtype} (use autocast to mix)")
    return x.dtype


class LoRAKernelFunction(torch.autograd.Function):
    """y = x·Wᵀ + b + s·(x·A)·B with the minimal backward. Inputs: x (..., k), weight (n, k),
    bias (n) or None, A (k, r), B (r, n), scale (a float)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, A, B, scale):
        k, n = weight.shape[1], weight.shape[0]
        params = [weight, A, B] + ([bias] if bias is not None else [])
        cdt = _compute_dtype(x, params)
        # Casts are done here, once, so every path (Triton too) sees one dtype; autocast is then
        # switched off so torch ops inside do not cast again.
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, k).to(cdt)  # (N, k); a copy only when the batch dims don't flatten
            w, a, bm = weight.to(cdt), A.to(cdt), B.to(cdt)
            b = bias.to(cdt) if bias is not None else None
            fwd_mode, bwd_mode = _plan(x2, A.shape[1])
            y, h = _forward(fwd_mode, x2, w, b, a, bm, float(scale))
        ctx.save_for_backward(x2, h, w, a, bm)
        ctx.scale = float(scale)
        ctx.bwd_mode = bwd_mode
        ctx.x_meta = (x.shape, x.dtype)
        ctx.param_dtypes = (weight.dtype, bias.dtype if bias is not None else None, A.dtype, B.dtype)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out):
        x2, h, w, a, bm = ctx.saved_tensors
        s, mode = ctx.scale, ctx.bwd_mode
        need_x, need_w, need_b, need_a, need_b_lora, _ = ctx.needs_input_grad
        w_dt, b_dt, a_dt, bl_dt = ctx.param_dtypes
        grad_x = grad_w = grad_b = grad_a = grad_bl = None
        with torch.autocast(x2.device.type, enabled=False):
            g = grad_out.reshape(-1, w.shape[0]).to(x2.dtype)  # (N, n)
            if need_x:
                gx, u = _grad_x_u(mode, g, w, a, bm, s)
                grad_x = gx.reshape(ctx.x_meta[0]).to(ctx.x_meta[1])
            elif need_a:
                u = g @ bm.t()  # input needs no gradient (first layer): skip the big GEMM
            else:
                u = None
            if need_a or need_b_lora:
                grad_a, grad_bl = _grad_ab(mode, x2, u if u is not None else h, h, g, s,
                                           do_a=need_a, do_b=need_b_lora, dtype=a_dt)
                if grad_bl is not None and grad_bl.dtype != bl_dt:
                    grad_bl = grad_bl.to(bl_dt)
            # Only a trainable base layer (the classification head) pays for these.
            if need_w:
                grad_w = (g.t() @ x2).to(w_dt)  # (n, k)
            if need_b:
                grad_b = g.sum(0).to(b_dt)
        return grad_x, grad_w, grad_b, grad_a, grad_bl, None


def lora_linear(x, weight, bias, A, B, scale):
    """Functional form of the lora-kernel layer."""
    return LoRAKernelFunction.apply(x, weight, bias, A, B, scale)


class LinearWithLoRAKernel(LoRALinearBase):
    """``lora`` with the minimal-work autograd Function (Triton kernels on CUDA)."""

    variant = "lora-kernel"

    def forward(self, x):
        return LoRAKernelFunction.apply(x, self.linear.weight, self.linear.bias, self.lora.A, self.lora.B,
                                        self.lora.alpha)


__all__ = ["LinearWithLoRAKernel", "LoRAKernelFunction", "lora_linear", "lora_kernel_backend", "set_kernel_mode"]
