"""Many LoRA adapters on one frozen model ("packing"): N adapters train at once on a batch stacked
N times along the batch dimension, point p's rows being the p-th block of B rows.

``PackedLoRALinear`` replaces one ``nn.Linear``: its frozen base runs one product over all N·B
rows, and each adapter adds its own ``alpha · (x·A)·B`` to its own rows, all adapters in one
batched product; mixed ranks are stored zero-padded to the pack's largest rank, which changes
nothing they compute; a trainable base (the new head) holds one base per adapter. A point's
parameters read back under the names and shapes its solo model gives them (``point_state_dict``).
``PackedDoRALinear`` is DoRA's unmerged layer in a pack: each point's output scaled by its own
magnitude over its own norm. Why this way and what it costs: docs/packing.md#how."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lora_bench.lora.layer import HoldsWeightSq, LoRALayer, dora_norm


class PackedLoRALinear(nn.Module):
    """One linear layer of a packed model: a shared frozen ``linear``, or one trainable base per
    adapter (stacked in ``weight`` (N, out, in) and ``bias`` (N, out), from ``heads``), and the N
    adapters stacked in ``A`` (N, in, r) and ``B`` (N, r, out) at the pack's largest rank r.

    Stacked, not one parameter per adapter: the forward takes them as they are (no stack of N
    tensors in every layer, no split of their gradients in the backward), and the optimizer
    (``PackedAdamW``) updates a few large tensors instead of N times as many small ones."""

    def __init__(self, adapters: list[LoRALayer], *, linear: nn.Linear | None = None,
                 heads: list[nn.Linear] | None = None):
        super().__init__()
        if (linear is None) == (heads is None):
            raise ValueError("a packed layer has one shared base (linear) or one base per adapter (heads)")
        if heads is not None and len(heads) != len(adapters):
            raise ValueError(f"{len(heads)} heads for {len(adapters)} adapters")
        self.linear = linear
        self.ranks = [a.A.shape[1] for a in adapters]  # each adapter's own rank
        self.alpha_values = [float(a.alpha) for a in adapters]
        top = max(self.ranks)
        with torch.no_grad():  # padded with zeros up to the largest rank (module docstring)
            a = torch.stack([nn.functional.pad(x.A, (0, top - r)) for x, r in zip(adapters, self.ranks)])
            b = torch.stack([nn.functional.pad(x.B, (0, 0, 0, top - r)) for x, r in zip(adapters, self.ranks)])
        self.A = nn.Parameter(a, requires_grad=adapters[0].A.requires_grad)
        self.B = nn.Parameter(b, requires_grad=adapters[0].B.requires_grad)
        self.weight = self.bias = None
        if heads is not None:
            with torch.no_grad():
                self.weight = nn.Parameter(torch.stack([h.weight for h in heads]),
                                           requires_grad=heads[0].weight.requires_grad)
                if heads[0].bias is not None:
                    self.bias = nn.Parameter(torch.stack([h.bias for h in heads]),
                                             requires_grad=heads[0].bias.requires_grad)
        # the alphas as a buffer that moves with the model: made once here, not from a Python list
        # in the forward (a copy from the host, which a CUDA-graph capture refuses)
        self.register_buffer("alphas", torch.tensor(self.alpha_values).view(-1, 1, 1), persistent=False)

    @property
    def n(self) -> int:
        return len(self.ranks)

    @property
    def in_features(self) -> int:
        return self.A.shape[1]

    @property
    def out_features(self) -> int:
        return self.B.shape[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._products(x, bias=True).reshape(*x.shape[:-1], self.out_features)

    def _products(self, x: torch.Tensor, *, bias: bool) -> torch.Tensor:
        """Each point's base product plus its update, (N, rows of one point, out); with ``bias`` the
        base's bias added in the base product, as ``nn.Linear`` adds it."""
        n = self.n
        if x.shape[0] % n:
            raise ValueError(f"a packed layer of {n} adapters takes a batch of a multiple of {n} rows, "
                             f"got {x.shape[0]}")
        xs = x.reshape(n, -1, x.shape[-1])  # (N, rows of one point, in)
        if self.linear is not None:  # one product over every row
            base = (self.linear(x) if bias else F.linear(x, self.linear.weight)).reshape(n, -1, self.out_features)
        else:
            base = torch.bmm(xs, self.weight.transpose(1, 2))
            if bias and self.bias is not None:  # in the product's type, as nn.Linear adds it under autocast
                base = base + self.bias.unsqueeze(1).to(base.dtype)
        h = torch.bmm(xs, self.A)  # (N, rows, r)
        # alpha scales the r columns of x·A, not the out columns of the update, and the add to the
        # base rides in the second product: (alpha·x·A)·B + base is the solo layer's
        # base + alpha·((x·A)·B) in another rounding order (exact for a power-of-two alpha but for
        # the one rounding of the sum), without two passes over the (N, rows, out) output
        h = self.alphas.to(h.dtype) * h
        return torch.baddbmm(base, h, self.B)

    def point_adapter(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Adapter ``p``'s A and B as its solo layer holds them (views without the padding)."""
        r = self.ranks[p]
        return self.A[p, :, :r], self.B[p, :r]

    def point_base(self, p: int) -> dict[str, torch.Tensor]:
        """Point ``p``'s base as its solo ``nn.Linear`` names it: the shared one's parameters, or
        views of its own head's."""
        if self.linear is not None:
            return dict(self.linear.named_parameters())
        return {"weight": self.weight[p], **({"bias": self.bias[p]} if self.bias is not None else {})}

    def extra_repr(self) -> str:
        ranks = ",".join(str(r) for r in self.ranks)
        return f"adapters={self.n}, ranks={ranks}, base={'shared' if self.linear is not None else 'per adapter'}"


class PackedDoRALinear(HoldsWeightSq, PackedLoRALinear):
    """DoRA's unmerged layer (``layer.LinearWithDoRA``) for N points: point p's rows give
    ``(m_p / ‖W + s_p·(A_p·B_p)ᵀ‖) ⊙ (x·Wᵀ + s_p·(x·A_p)·B_p) + b``, the magnitudes stacked in ``m``
    (N, out). The norms of all points come from ``layer.dora_norm``'s terms, batched: ‖W_j‖² (held
    once for a frozen W), one product W·A over the stacked A (N, out, r) and each point's r × r Gram
    matrix; a rank's zero padding adds nothing to them. With ``detach_norm`` the norm is a constant
    in backward, as in the solo layer."""

    def __init__(self, adapters: list[LoRALayer], magnitudes: list[torch.Tensor], *, detach_norm: bool,
                 linear: nn.Linear | None = None, heads: list[nn.Linear] | None = None):
        super().__init__(adapters, linear=linear, heads=heads)
        if len(magnitudes) != self.n:
            raise ValueError(f"{len(magnitudes)} magnitudes for {self.n} adapters")
        self.detach_norm = detach_norm
        with torch.no_grad():
            self.m = nn.Parameter(torch.stack([m.detach() for m in magnitudes]),
                                  requires_grad=self.A.requires_grad)
        self.hold_weight_sq()

    def frozen_weight(self) -> torch.Tensor | None:
        """The shared W (per-point heads: none to hold norms for)."""
        return None if self.linear is None else self.linear.weight

    def norm(self) -> torch.Tensor:
        """‖W_j + s_p·(A_p·B_p)_j‖ per point and output (N, out) (``layer.dora_norm`` over the
        stacked A and B: W·A one product over the shared W for every point), detached with
        ``detach_norm``."""
        if self.linear is not None:
            w = self.linear.weight
            n = dora_norm(w, self.A, self.B, self.alphas.view(-1, 1), None if w.requires_grad else self.weight_sq)
        else:  # one trained head per point: its norms change every step
            n = dora_norm(self.weight, self.A, self.B, self.alphas.view(-1, 1))
        return n.detach() if self.detach_norm else n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._products(x, bias=False) * (self.m / self.norm()).unsqueeze(1)  # scale, then bias: the solo order
        if self.linear is not None and self.linear.bias is not None:
            y = y + self.linear.bias
        elif self.linear is None and self.bias is not None:
            y = y + self.bias.unsqueeze(1)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", variant=dora" + (", norm=detached" if self.detach_norm else "")


def lora_sites(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(path, parent, attribute, layer) of every ``nn.Linear`` below ``model``, in the order
    ``inject_lora`` wraps them (recursive, registration order), which is the order of the RNG
    draws that initialise their adapters."""
    out = []
    for name, module in model.named_children():
        path = f"{prefix}{name}"
        if isinstance(module, nn.Linear):
            out.append((path, model, name, module))
        else:
            out += lora_sites(module, prefix=f"{path}.")
    return out


def packed_layers(model: nn.Module) -> dict[str, PackedLoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, PackedLoRALinear)}


def point_state_dict(model: nn.Module, p: int) -> dict[str, torch.Tensor]:
    """Point ``p``'s model as its solo run names it: the shared tensors under their own names, and
    each packed layer as ``<path>.linear.weight``, ``<path>.linear.bias``, ``<path>.lora.A``,
    ``<path>.lora.B`` and DoRA's ``<path>.m`` (of its solo shapes: views of the stacked tensors
    without their padding)."""
    layers = packed_layers(model)
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if not any(name.startswith(f"{path}.") for path in layers):
            out[name] = t
    for path, layer in layers.items():
        for key, t in layer.point_base(p).items():
            out[f"{path}.linear.{key}"] = t
        out[f"{path}.lora.A"], out[f"{path}.lora.B"] = layer.point_adapter(p)
        if isinstance(layer, PackedDoRALinear):
            out[f"{path}.m"] = layer.m[p]
    return out
