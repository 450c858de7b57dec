"""Numerical helpers shared by the kernel tests: relative error against a reference, fresh inputs."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖; an exactly-zero reference must be matched exactly (NaN never passes)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if out.isnan().any():
        return float("inf")
    if ref.norm() == 0:
        return 0.0 if out.norm() == 0 else float("inf")
    return float((out - ref).norm() / ref.norm())


def fresh(*shape, device, dtype, scale=1.0) -> torch.Tensor:
    """Random normal values drawn anew on every call (no fixed seed), cast to ``dtype``."""
    return (torch.randn(*shape, device=device) * scale).to(dtype)
