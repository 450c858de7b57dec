"""The model and optimizer of a run's N >= 1 points. One point: the book's classifier (or
transformers' peer), its frozen base stored as ``base_dtype`` says, and torch's AdamW. Several (a
pack, lora_bench.train.pack): one packed classifier whose adapters and heads hold every point
(lora_bench.classifier.packed_classifier), each point counted as its solo model is, and ``PackedAdamW`` with
each point's learning rate and weight decay. Each step draws what its solo run draws, in order."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_bench.classifier.book import build_classifier, cast_frozen
from lora_bench.classifier.packed_classifier import build_packed_classifier
from lora_bench.config import TrainConfig
from lora_bench.kernels.plan_names import AUTO, DORA_NORM_AHEAD
from lora_bench.lora import pissa_init
from lora_bench.lora.kernel import group_qkv, install_norms_ahead
from lora_bench.lora.packed_layer import PackedLoRALinear, point_state_dict
from lora_bench.lora.quantized import base_weight_bytes, store_base
from lora_bench.model.gpt2 import count_params
from lora_bench.peers.hf import build_hf_classifier, cast_frozen_hf, hf_base_weight_bytes, unpacked_params
from lora_bench.train.master_weights import MasterWeights
from lora_bench.train.packed_adamw import PackedAdamW
from lora_bench.train.setup import build_optimizer as solo_optimizer
from lora_bench.train.setup import adamw_class, over_masters, prepare_precision


@dataclass
class Built:
    """The model on its device, and what the points' rows say of it."""

    model: torch.nn.Module
    trainable_params: list[int]  # per point, as its solo model counts them (no padding of a pack's ranks)
    total_params: list[int]
    base_weight_mib: float | None  # the frozen blocks' linear weights as held (after precision's cast)
    notes: list[str]  # what the run says about how it was built
    adapter_init_s: float | None = None  # PiSSA's one-time initialisation (its SVDs), apart from the steps


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
    init_s = None
    if cfg.lora_init == "pissa" and cfg.implementation == "book":  # PEFT's peer factors its weights itself
        init_s = _timed_pissa(model, device)  # on the full-precision weights, before any is stored or cast
    if cfg.base_dtype != "precision" and cfg.implementation == "book":
        # stored on the device from the fp32 weights, before any cast
        _, notes = store_base(model, cfg.base_dtype, device)
    prepare_precision(model, cfg, cast)
    weight_bytes = weight_bytes_of(model)  # as the run holds them: after precision's cast
    model.to(device)
    if cfg.trainable_layers == "lora-kernel" and cfg.group_qkv and device.type == "cuda":
        group_qkv(model)  # after .to(), which gives every parameter its own storage
    if norms_ahead(cfg, device):
        install_norms_ahead(model)  # after the grouping: a group's norms form as one
    return Built(model, trainable, total, weight_bytes / 2**20 if weight_bytes is not None else None, notes,
                 init_s if init_s is not None else getattr(model, "adapter_init_s", None))


def norms_ahead(cfg: TrainConfig, device: torch.device) -> bool:
    """Do the fused DoRA layers form their norms ahead (``dora_norm_launch``)? Where asked, and by
    default (auto) where the step is replayed from CUDA graphs on one GPU, one process, not compiled:
    there it measured faster than inline at both of the variants study's sizes (docs/variants.md)."""
    if cfg.trainable_layers != "lora-kernel" or cfg.lora_variant != "dora":
        return False
    if cfg.dora_norm_launch == DORA_NORM_AHEAD:
        return True
    return (cfg.dora_norm_launch == AUTO and cfg.cuda_graphs and not cfg.compile and cfg.nproc == 1
            and device.type == "cuda")


def _timed_pissa(model: torch.nn.Module, device: torch.device) -> float:
    """PiSSA's initialisation of ``model``'s adapters, its SVDs on ``device``; its wall time in seconds."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    pissa_init(model, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def build_optimizer(model: torch.nn.Module, cfgs: list[TrainConfig]) -> torch.optim.Optimizer:
    """AdamW after re-seeding with the run's seed (as the reference does); a pack's holds each
    point's learning rate and weight decay; bf16-true's (a pack's too) steps float32 master copies."""
    cfg = cfgs[0]
    torch.manual_seed(cfg.seed)
    if len(cfgs) > 1:
        return packed_optimizer(model, cfgs)
    if cfg.loraplus_lr_ratio != 1:
        return loraplus_optimizer(model, cfg, **optimizer_options(cfg))
    return solo_optimizer(model, cfg, **optimizer_options(cfg))  # under bf16-true over fp32 master copies


def packed_optimizer(model: torch.nn.Module, cfgs: list[TrainConfig]) -> PackedAdamW | MasterWeights:
    """A pack's ``PackedAdamW``: each point's learning rate and weight decay, and with LoRA+ every
    stacked B in a group of its own at each point's rate times its ratio (a ratio of 1: its rate);
    under bf16-true over float32 master copies."""
    trainable = [t for t in model.parameters() if t.requires_grad]
    lrs = [c.learning_rate for c in cfgs]
    b_lrs = [c.learning_rate * c.loraplus_lr_ratio for c in cfgs]
    stacked_b = {id(m.B) for m in model.modules() if isinstance(m, PackedLoRALinear)}
    is_b = [id(t) in stacked_b for t in trainable] if b_lrs != lrs else [False] * len(trainable)

    def make(params: list[torch.Tensor]) -> PackedAdamW:
        groups = [{"params": [p for p, b in zip(params, is_b) if not b]},
                  {"params": [p for p, b in zip(params, is_b) if b], "lrs": b_lrs}]
        return PackedAdamW([g for g in groups if g["params"]], lrs=lrs, weight_decays=[c.weight_decay for c in cfgs],
                           **optimizer_options(cfgs[0]))

    return over_masters(cfgs[0], trainable, make)


def is_lora_b(name: str) -> bool:
    """Whether a parameter name is a LoRA B: the book's ``<layer>.lora.B``, PEFT's ``lora_B.<adapter>.weight``."""
    return name.endswith("lora.B") or ".lora_B." in name


def loraplus_optimizer(model: torch.nn.Module, cfg: TrainConfig, **options):
    """LoRA+: AdamW with two parameter groups, every B at ``learning_rate × loraplus_lr_ratio``, every
    other trainable parameter at ``learning_rate`` (under bf16-true over float32 master copies)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    is_b = [is_lora_b(n) for n, _ in named]
    lr, ratio = cfg.learning_rate, cfg.loraplus_lr_ratio

    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        groups = [{"params": [p for p, b in zip(params, is_b) if not b], "lr": lr},
                  {"params": [p for p, b in zip(params, is_b) if b], "lr": lr * ratio}]
        return adamw_class(cfg)([g for g in groups if g["params"]], lr=lr, weight_decay=cfg.weight_decay,
                                **options)

    return over_masters(cfg, [p for _, p in named], make)


def optimizer_options(cfg: TrainConfig) -> dict:
    """AdamW's options beyond the learning rate and weight decay: the fused update when asked, and
    a capturable one (its step count on the device) for a step captured as CUDA graphs (the one-launch
    update takes both and needs neither)."""
    opt_kw: dict = {"fused": True} if cfg.optimizer == "fused" else {}
    if cfg.cuda_graphs:
        opt_kw["capturable"] = True
    return opt_kw
