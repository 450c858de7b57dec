"""Many LoRA adapters on one frozen model ("packing"): N adapters train at once on a batch stacked
N times along the batch dimension, point p's rows being the p-th block of B rows.

``PackedLoRALinear`` replaces one ``nn.Linear``. Its frozen base weight runs one product over all
N·B rows (read once, not N times); each adapter then adds its own ``alpha · (x·A)·B`` to its own
rows, all adapters in one batched product. Mixed ranks are padded: each adapter's ``A`` (in×r)
and ``B`` (r×out) are stored with zero columns and rows up to the pack's largest rank, which
changes nothing they compute — the padded part of x·A is zero, its products with B's zero rows
add zeros, its gradients are exactly zero, so AdamW (weight decay included) keeps it zero. Grouping
the adapters by rank instead would cost a gather of each group's rows, a stack of its A's and
B's and the reassembly of the groups' outputs in every layer, forward and backward: about four
times the adapter path's kernels at four ranks. A layer whose base is trainable (the
classifier's new head) holds one base per adapter instead, applied to its adapter's rows with one
batched product.

A point's parameters read back under the names and shapes its solo model gives them
(``point_state_dict``: views of the stored tensors without their padding)."""

from __future__ import annotations

import torch
import torch.nn as nn

from lora_bench.lora.layer import LoRALayer


class PackedLoRALinear(nn.Module):
    """One linear layer of a packed model: a shared frozen ``linear``, or one trainable base per
    adapter (``heads``), and one ``LoRALayer`` per adapter (``adapters``)."""

    def __init__(self, adapters: list[LoRALayer], *, linear: nn.Linear | None = None,
                 heads: list[nn.Linear] | None = None):
        super().__init__()
        if (linear is None) == (heads is None):
            raise ValueError("a packed layer has one shared base (linear) or one base per adapter (heads)")
        if heads is not None and len(heads) != len(adapters):
            raise ValueError(f"{len(heads)} heads for {len(adapters)} adapters")
        self.linear = linear
        self.heads = nn.ModuleList(heads) if heads is not None else None
        self.adapters = nn.ModuleList(adapters)
        self.ranks = [a.A.shape[1] for a in adapters]  # each adapter's own rank
        top = max(self.ranks)
        for a, r in zip(adapters, self.ranks):
            if r < top:  # stored padded with zeros (module docstring)
                with torch.no_grad():
                    a.A = nn.Parameter(nn.functional.pad(a.A, (0, top - r)), requires_grad=a.A.requires_grad)
                    a.B = nn.Parameter(nn.functional.pad(a.B, (0, 0, 0, top - r)), requires_grad=a.B.requires_grad)
        # the alphas as a buffer that moves with the model: made once here, not from a Python list
        # in the forward (a copy from the host, which a CUDA-graph capture refuses)
        self.register_buffer("alphas", torch.tensor([float(a.alpha) for a in adapters]).view(-1, 1, 1),
                             persistent=False)

    @property
    def n(self) -> int:
        return len(self.adapters)

    @property
    def in_features(self) -> int:
        return self.adapters[0].A.shape[0]

    @property
    def out_features(self) -> int:
        return self.adapters[0].B.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.n
        if x.shape[0] % n:
            raise ValueError(f"a packed layer of {n} adapters takes a batch of a multiple of {n} rows, got {x.shape[0]}")
        lead = x.shape[:-1]
        xs = x.reshape(n, -1, x.shape[-1])  # (N, rows of one point, in)
        if self.linear is not None:
            base = self.linear(x).reshape(n, -1, self.out_features)  # one product over every row
        else:
            w = torch.stack([h.weight for h in self.heads])  # (N, out, in)
            base = torch.bmm(xs, w.transpose(1, 2))
            if self.heads[0].bias is not None:  # in the product's type, as nn.Linear adds it under autocast
                base = base + torch.stack([h.bias for h in self.heads]).unsqueeze(1).to(base.dtype)
        return (base + self._updates(xs)).reshape(*lead, self.out_features)

    def _updates(self, xs: torch.Tensor) -> torch.Tensor:
        """Each adapter's ``alpha · (x·A)·B`` on its own rows: (N, rows, out)."""
        a = torch.stack([adapter.A for adapter in self.adapters])  # (N, in, r)
        b = torch.stack([adapter.B for adapter in self.adapters])  # (N, r, out)
        out = torch.bmm(torch.bmm(xs, a), b)
        return self.alphas.to(out.dtype) * out  # in the product's type, as the solo layer scales

    def point_adapter(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Adapter ``p``'s A and B as its solo layer holds them (views without the padding)."""
        a, r = self.adapters[p], self.ranks[p]
        return (a.A, a.B) if r == a.A.shape[1] else (a.A[:, :r], a.B[:r])

    def point_parameters(self, p: int) -> list[nn.Parameter]:
        """Adapter ``p``'s trainable parameters (its head's base first, where it has one)."""
        own = list(self.heads[p].parameters()) if self.heads is not None else []
        return own + list(self.adapters[p].parameters())

    def extra_repr(self) -> str:
        ranks = ",".join(str(r) for r in self.ranks)
        return f"adapters={self.n}, ranks={ranks}, base={'shared' if self.linear is not None else 'per adapter'}"


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


def point_parameters(model: nn.Module, p: int) -> list[nn.Parameter]:
    """Every trainable parameter of point ``p``, in its solo model's parameter order."""
    return [t for layer in packed_layers(model).values() for t in layer.point_parameters(p)]


def point_state_dict(model: nn.Module, p: int) -> dict[str, torch.Tensor]:
    """Point ``p``'s model as its solo run names it: the shared tensors under their own names, and
    each packed layer as ``<path>.linear.weight``, ``<path>.linear.bias``, ``<path>.lora.A``,
    ``<path>.lora.B`` (of its solo shapes: views of padded adapters)."""
    layers = packed_layers(model)
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if not any(name.startswith(f"{path}.") for path in layers):
            out[name] = t
    for path, layer in layers.items():
        base = layer.linear if layer.linear is not None else layer.heads[p]
        for key, t in base.named_parameters():
            out[f"{path}.linear.{key}"] = t
        out[f"{path}.lora.A"], out[f"{path}.lora.B"] = layer.point_adapter(p)
    return out
