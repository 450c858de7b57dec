"""Many LoRA adapters on one frozen model ("packing"): N adapters train at once on a batch stacked
N times along the batch dimension, point p's rows being the p-th block of B rows.

``PackedLoRALinear`` replaces one ``nn.Linear``. Its frozen base weight runs one product over all
N·B rows (read once, not N times); each adapter then adds its own ``alpha · (x·A)·B`` to its own
rows, with one batched product per group of adapters of the same rank (mixed ranks are grouped,
not padded: no product on zeros). A layer whose base is trainable (the classifier's new head)
holds one base per adapter instead, applied to its adapter's rows with one batched product.

The adapters keep the parameter layout of ``LoRALayer`` (``A`` in×r, ``B`` r×out), so a point's
parameters read back under the names its solo model gives them (``point_state_dict``)."""

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
        ranks: dict[int, list[int]] = {}
        for p, a in enumerate(adapters):
            ranks.setdefault(a.A.shape[1], []).append(p)
        self.groups = list(ranks.values())  # points of one rank each, in order of first appearance
        # each group's alphas and rows, as buffers that move with the model: made once here, not
        # from Python lists in the forward (a copy from the host, which a CUDA-graph capture refuses)
        for i, group in enumerate(self.groups):
            self.register_buffer(f"alpha_{i}", torch.tensor([float(adapters[p].alpha) for p in group]).view(-1, 1, 1),
                                 persistent=False)
            self.register_buffer(f"index_{i}", torch.tensor(group, dtype=torch.long), persistent=False)

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
        parts: list[torch.Tensor | None] = [None] * self.n
        for i, group in enumerate(self.groups):
            a = torch.stack([self.adapters[p].A for p in group])  # (G, in, r)
            b = torch.stack([self.adapters[p].B for p in group])  # (G, r, out)
            xg = xs if len(group) == self.n else xs.index_select(0, getattr(self, f"index_{i}"))
            out = torch.bmm(torch.bmm(xg, a), b)
            out = getattr(self, f"alpha_{i}").to(out.dtype) * out  # in the product's type, as the solo layer scales
            if len(group) == self.n:
                return out
            for p, o in zip(group, out.unbind(0)):
                parts[p] = o
        return torch.stack(parts)

    def point_parameters(self, p: int) -> list[nn.Parameter]:
        """Adapter ``p``'s trainable parameters (its head's base first, where it has one)."""
        own = list(self.heads[p].parameters()) if self.heads is not None else []
        return own + list(self.adapters[p].parameters())

    def extra_repr(self) -> str:
        ranks = ",".join(str(a.A.shape[1]) for a in self.adapters)
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
    ``<path>.lora.B``."""
    layers = packed_layers(model)
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if not any(name.startswith(f"{path}.") for path in layers):
            out[name] = t
    for path, layer in layers.items():
        base = layer.linear if layer.linear is not None else layer.heads[p]
        for key, t in base.named_parameters():
            out[f"{path}.linear.{key}"] = t
        out[f"{path}.lora.A"] = layer.adapters[p].A
        out[f"{path}.lora.B"] = layer.adapters[p].B
    return out
