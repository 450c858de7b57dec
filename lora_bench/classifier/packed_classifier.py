"""The spam classifier for a pack of LoRA points: one frozen base model, and for each point the
new 2-class head and the adapters (LoRA's, or DoRA's with their magnitudes) its solo run would
build, from the same RNG draws (each point re-seeds and draws its head, then its adapters in
``inject_lora``'s order, as ``book.make_trainable`` does), so every point starts from its solo
run's initial weights."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from lora_bench.classifier.book import NUM_CLASSES, load_base_model, model_config
from lora_bench.config import TrainConfig
from lora_bench.lora.layer import LoRALayer, lora_scale, merged_norm
from lora_bench.lora.packed_layer import PackedDoRALinear, PackedLoRALinear, lora_sites
from lora_bench.model.gpt2 import GPTModel


def build_packed_classifier(cfgs: list[TrainConfig], *, cache_dir: Path, progress: bool = True) -> GPTModel:
    """The packed classifier of ``cfgs`` (points that differ only in their adapter's settings), on
    the CPU: point p's head and adapters are those of ``build_classifier(cfgs[p])``."""
    cfg = cfgs[0]
    model = load_base_model(cfg, model_config(cfg), cache_dir=cache_dir, progress=progress)
    for p in model.parameters():
        p.requires_grad = False
    emb = model.cfg.emb_dim
    heads, adapters, magnitudes = [], [], []
    dora = cfg.lora_variant == "dora"
    for point in cfgs:
        torch.manual_seed(point.seed)
        head = nn.Linear(emb, NUM_CLASSES)
        model.out_head = head  # in its place among the model's layers: the sites' order is the solo model's
        heads.append(head)
        scale = lora_scale(point.lora_alpha, point.lora_rank, point.lora_scaling)
        adapters.append([LoRALayer(m.in_features, m.out_features, point.lora_rank, scale)
                         for _, _, _, m in lora_sites(model)])
        if dora:
            with torch.no_grad():  # DoRA's magnitudes start as the solo layer's: the rows' norms of W + s·(A·B)ᵀ
                magnitudes.append([merged_norm(m.weight, a.A, a.B, a.alpha)
                                   for (_, _, _, m), a in zip(lora_sites(model), adapters[-1])])
    for i, (_, parent, name, linear) in enumerate(lora_sites(model)):
        own = [a[i] for a in adapters]
        base = dict(heads=heads) if name == "out_head" and parent is model else dict(linear=linear)
        if dora:
            layer = PackedDoRALinear(own, [m[i] for m in magnitudes], detach_norm=cfg.dora_norm == "detached", **base)
        else:
            layer = PackedLoRALinear(own, **base)
        setattr(parent, name, layer)
    return model
