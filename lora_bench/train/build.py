"""The model and optimizer of a run's N >= 1 points. One point: the book's classifier (or
transformers' peer), its frozen base stored as ``base_dtype`` says, and torch's AdamW. Several (a
pack, lora_bench.train.pack): one packed classifier whose adapters and heads hold every point
(lora_bench.classifier.packed_classifier), each point counted as its solo model is, and ``PackedAdamW`` with
each point's learning rate and weight decay. Each step draws what its solo run draws, in order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lora_bench.classifier.book import build_classifier, cast_frozen
from lora_bench.classifier.packed_classifier import build_packed_classifier
from lora_bench.config import TrainConfig
from lora_bench.lora.kernel import group_qkv
from lora_bench.lora.packed_layer import point_state_dict
from lora_bench.lora.quantized import base_weight_bytes, store_base
from lora_bench.model.gpt2 import count_params
from lora_bench.peers.hf import build_hf_classifier, cast_frozen_hf, hf_base_weight_bytes, unpacked_params
from lora_bench.train.packed_adamw import PackedAdamW
from lora_bench.train.setup import build_optimizer as solo_optimizer
from lora_bench.train.setup import prepare_precision


@dataclass
class Built:
    """The model on its device, and what the points' rows say of it."""

    model: torch.nn.Module
    trainable_params: list[int]  # per point, as its solo model counts them (no padding of a pack's ranks)
    total_params: list[int]
    base_weight_mib: float | None  # the frozen blocks' linear weights as held (after precision's cast)
    notes: list[str]  # what the run says about how it was built


def build_model(cfgs: list[TrainConfig], device: torch.device, *, cache_dir: Path, progress: bool) -> Built:
    """The points' model, built on the host, cast as precision says and moved to ``device``."""
    cfg = cfgs[0]
    if len(cfgs) > 1:
        model = build_packed_classifier(cfgs, cache_dir=cache_dir, progress=progress)
        states = [point_state_dict(model, p) for p in range(len(cfgs))]  # solo shapes: no padding counted
        trainable = [sum(t.numel() for t in st.values() if t.requires_grad) for st in states]
        total = [sum(t.numel() for t in st.values()) for st in states]
        cast, weight_bytes_of = cast_frozen, base_weight_bytes
    elif cfg.implementation == "hf":  # transformers' GPT-2 (and PEFT): its Conv1D layers are not nn.Linear
        # base_dtype=nf4: transformers and bitsandbytes load the body 4-bit on the device (QLoRA)
        model = build_hf_classifier(cfg, cache_dir=cache_dir, progress=progress, device=device)
        cast, weight_bytes_of = cast_frozen_hf, hf_base_weight_bytes
    else:
        model = build_classifier(cfg, cache_dir=cache_dir, progress=progress)
        cast, weight_bytes_of = cast_frozen, base_weight_bytes
    if len(cfgs) == 1:
        trainable = [count_params(model, trainable_only=True)]
        total = [count_params(model) + unpacked_params(model)]  # a 4-bit body's packed codes
    notes: list[str] = []
    if cfg.base_dtype != "precision" and cfg.implementation == "book":
        # stored on the device from the fp32 weights, before any cast
        _, notes = store_base(model, cfg.base_dtype, device)
    prepare_precision(model, cfg, cast)
    weight_bytes = weight_bytes_of(model)  # as the run holds them: after precision's cast
    model.to(device)
    if cfg.trainable_layers == "lora-kernel" and cfg.group_qkv and device.type == "cuda":
        group_qkv(model)  # after .to(), which gives every parameter its own storage
    return Built(model, trainable, total, weight_bytes / 2**20 if weight_bytes is not None else None, notes)


def build_optimizer(model: torch.nn.Module, cfgs: list[TrainConfig]) -> torch.optim.Optimizer:
    """AdamW after re-seeding with the run's seed (as the reference does); a pack's holds each
    point's learning rate and weight decay; bf16-true's steps float32 master copies."""
    cfg = cfgs[0]
    torch.manual_seed(cfg.seed)
    if len(cfgs) > 1:
        return PackedAdamW([t for t in model.parameters() if t.requires_grad], lrs=[c.learning_rate for c in cfgs],
                           weight_decays=[c.weight_decay for c in cfgs], **optimizer_options(cfg))
    return solo_optimizer(model, cfg, **optimizer_options(cfg))  # under bf16-true over fp32 master copies


def optimizer_options(cfg: TrainConfig) -> dict:
    """AdamW's options beyond the learning rate and weight decay: the fused update when asked, and
    a capturable one (its step count on the device) for a step captured as CUDA graphs."""
    opt_kw: dict = {"fused": True} if cfg.optimizer == "fused" else {}
    if cfg.cuda_graphs:
        opt_kw["capturable"] = True
    return opt_kw
