"""The LoRA adapter and the reference's unmerged variant, ``linear(x) + alpha * (x @ A @ B)``; the
update's scale (the reference's alpha, or rsLoRA's alpha/√r: ``lora_scale``); and DoRA's unmerged
layer, whose column norm of ``W + s·(A·B)ᵀ`` comes from W's fixed row norms, ``W·A`` and A's
r × r Gram matrix without forming the merged weight (``dora_norm``; docs/variants.md)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

SCALINGS = ("alpha", "rslora")


def lora_scale(alpha: float, rank: int, scaling: str = "alpha") -> float:
    """The factor of the update ``x @ A @ B``: alpha itself (the reference's: not divided by the
    rank), or rsLoRA's alpha/√r, which keeps the update's size from shrinking as the rank grows."""
    if scaling == "alpha":
        return alpha
    if scaling == "rslora":
        return alpha / math.sqrt(rank)
    raise ValueError(f"lora scaling {scaling!r}: choose one of {', '.join(SCALINGS)}")


class LoRALayer(nn.Module):
    """A (in×r) kaiming-uniform from the global RNG, B (r×out) zeros. ``alpha`` is the factor the
    update is multiplied by, *not* divided by r (``lora_scale`` gives rsLoRA's)."""

    def __init__(self, in_dim: int, out_dim: int, rank: int, alpha: float):
        super().__init__()
        self.A = nn.Parameter(torch.empty(in_dim, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.B = nn.Parameter(torch.zeros(rank, out_dim))
        self.alpha = alpha

    def forward(self, x):
        return self.alpha * (x @ self.A @ self.B)


class LoRALinearBase(nn.Module):
    """Wraps a frozen-or-not ``nn.Linear``; subclasses differ only in how forward is computed.
    Parameter names (``linear.weight``, ``lora.A``, ``lora.B``) are shared by every variant, so a
    state dict moves between them."""

    variant = "base"

    def __init__(self, linear: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.linear = linear
        # A is drawn on the CPU from the global RNG (the reference's sequence), then joins the weight
        self.lora = LoRALayer(linear.in_features, linear.out_features, rank, alpha).to(linear.weight.device)

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def weight_changed(self) -> None:
        """Called once the frozen ``linear.weight`` is replaced (PiSSA's residual): a layer that keeps
        what it derives from the weight refreshes it. LoRA keeps nothing."""

    def extra_repr(self) -> str:
        return f"rank={self.lora.A.shape[1]}, alpha={self.lora.alpha}, variant={self.variant}"


class LinearWithLoRA(LoRALinearBase):
    """The reference's ``LinearWithLoRA``: two branches, added."""

    variant = "lora"

    def forward(self, x):
        return self.linear(x) + self.lora(x)


# -- DoRA ----------------------------------------------------------------------------------------
def merged_norm(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The norm of each output's row of the merged weight ``W + scale·(A·B)ᵀ`` (out × in), formed whole."""
    return (weight + scale * (a @ b).t()).norm(p=2, dim=1)


def dora_norm(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float | torch.Tensor,
              weight_sq: torch.Tensor | None = None) -> torch.Tensor:
    """``merged_norm`` without the merged weight: for output j, with W_j its row of W (out × in) and
    (A·B)_j its column of A·B (in × out),
    ‖W_j + s·(A·B)_j‖² = ‖W_j‖² + 2s·⟨W_j, (A·B)_j⟩ + s²·‖(A·B)_j‖², where ⟨W_j, (A·B)_j⟩ is row j of
    W·A (out × r) dotted with column j of B, and ‖(A·B)_j‖² = B_jᵀ·(AᵀA)·B_j with A's r × r Gram
    matrix. ``weight_sq`` holds the ‖W_j‖² of a frozen W, computed once (None: computed here).
    A pack's points (``packed_layer.PackedDoRALinear``) give A and B, and W where each has its own, a
    leading dimension of points, and ``scale`` as a tensor of one value per point (points × 1)."""
    bt = b.transpose(-2, -1)  # (out, r)
    if weight_sq is None:
        weight_sq = weight.pow(2).sum(-1)
    cross = ((weight @ a) * bt).sum(-1)  # ⟨W_j, (A·B)_j⟩: one pass over W, r columns
    update_sq = ((bt @ (a.transpose(-2, -1) @ a)) * bt).sum(-1)  # ‖(A·B)_j‖² from the r × r Gram matrix
    return (weight_sq + (2 * scale) * cross + (scale * scale) * update_sq).clamp_min(0).sqrt()


class HoldsWeightSq(nn.Module):
    """A DoRA layer's ‖W_j‖² of its frozen W (``frozen_weight``; None: no shared W to hold them for),
    in the non-persistent buffer ``weight_sq``: formed by ``hold_weight_sq``, and again after
    ``Module.to`` and its kin (a float64 copy's from its float64 weight, not the float32 norms cast)
    and after ``load_state_dict``."""

    def frozen_weight(self) -> torch.Tensor | None:
        raise NotImplementedError

    def hold_weight_sq(self) -> None:
        self.register_buffer("weight_sq", torch.empty(0), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, _keys: module.refresh_weight_sq())
        self.refresh_weight_sq()

    @torch.no_grad()
    def refresh_weight_sq(self) -> None:
        """‖W_j‖² from the weight as it is held now."""
        w = self.frozen_weight()
        if w is not None:
            self.weight_sq = w.detach().pow(2).sum(1)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.refresh_weight_sq()
        return out


class DoRALinearBase(HoldsWeightSq, LoRALinearBase):
    """DoRA: the weight ``m ⊙ (W + s·(A·B)ᵀ) / ‖W + s·(A·B)ᵀ‖``, each output's row scaled to the
    trained magnitude ``m`` (out), which starts as W's row norms, so the layer starts as ``linear``
    (B being zero). ``detach_norm``: the norm is a constant in backward (DoRA's paper trains so)."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float, *, detach_norm: bool = False):
        super().__init__(linear, rank, alpha)
        self.detach_norm = detach_norm
        self.m = nn.Parameter(torch.empty(linear.out_features, dtype=linear.weight.dtype,
                                          device=linear.weight.device))
        self.hold_weight_sq()
        self.weight_changed()

    def frozen_weight(self) -> torch.Tensor:
        return self.linear.weight

    def weight_changed(self) -> None:
        """W's row norms again, and the magnitude reset to the current weight's: the layer computes
        what ``linear`` with the current adapter computes."""
        self.refresh_weight_sq()
        with torch.no_grad():
            self.m.copy_(merged_norm(self.linear.weight, self.lora.A, self.lora.B, self.lora.alpha))

    def norm(self) -> torch.Tensor:
        """‖W_j + s·(A·B)_j‖ per output (``dora_norm``), detached with ``detach_norm``."""
        w = self.linear.weight
        sq = None if w.requires_grad else self.weight_sq  # a trained W (the head) changes every step
        n = dora_norm(w, self.lora.A, self.lora.B, self.lora.alpha, sq)
        return n.detach() if self.detach_norm else n

    def extra_repr(self) -> str:
        return super().extra_repr() + (", norm=detached" if self.detach_norm else "")


class LinearWithDoRA(DoRALinearBase):
    """DoRA unmerged: ``(m / ‖W + s·(A·B)ᵀ‖) ⊙ (x·Wᵀ + s·(x·A)·B) + b``, the norm from ``dora_norm``."""

    variant = "dora"

    def forward(self, x):
        y = F.linear(x, self.linear.weight) + self.lora(x)
        y = y * (self.m / self.norm())
        return y if self.linear.bias is None else y + self.linear.bias
