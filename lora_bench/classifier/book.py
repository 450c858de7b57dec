"""Turn a GPT-2 into the reference's spam classifier: load weights, freeze everything, seed, new
2-class head, then unfreeze the chosen layers or inject LoRA (in the reference's RNG order)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from lora_bench.config import FROZEN, TrainConfig
from lora_bench.errors import UsageError
from lora_bench.lora import inject_lora, lora_class, lora_scale
from lora_bench.model import checkpoints as weights
from lora_bench.model.gpt2 import GPTConfig, GPTModel, build_random_model, gpt_config, resolve_model_size
from lora_bench.model.hf_checkpoint import load_gpt_from_hf

NUM_CLASSES = 2


def model_config(cfg: TrainConfig) -> GPTConfig:
    return gpt_config(
        cfg.model_size,
        emb_dim=cfg.emb_dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        disable_causal_mask=cfg.disable_causal_mask,
        attention=cfg.attention,
        ops=cfg.ops,
    )


_RANDOM_BASE: dict = {}  # (GPTConfig, seed) -> state dict of a random base model built earlier
_RANDOM_BASE_KEEP = 4  # sizes kept (a sweep over the four GPT-2 sizes builds each once)


def _random_base(mcfg: GPTConfig, seed: int) -> GPTModel:
    """The seeded random model. Building 1558M on a CPU takes ~20 s, so the last state built is
    kept (a few sizes) and reused within a process (studies run many configurations); the values are those of a
    fresh build, and the RNG is re-seeded right after by ``make_trainable``, so reuse changes no
    number of the run."""
    key = (mcfg, seed)
    if key not in _RANDOM_BASE:
        while len(_RANDOM_BASE) >= _RANDOM_BASE_KEEP:
            _RANDOM_BASE.pop(next(iter(_RANDOM_BASE)))
        model = build_random_model(mcfg, seed=seed)
        _RANDOM_BASE[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return model
    with torch.device("meta"):
        model = GPTModel(mcfg)
    model.load_state_dict({k: v.clone() for k, v in _RANDOM_BASE[key].items()}, assign=True)
    for name, buf in list(model.named_buffers()):  # non-persistent buffers (the causal mask) are rebuilt
        if buf.is_meta:
            n = mcfg.context_length
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            parent.register_buffer("mask", torch.triu(torch.ones(n, n), diagonal=1), persistent=False)
    torch.manual_seed(seed)
    return model


def load_base_model(cfg: TrainConfig, mcfg: GPTConfig, *, cache_dir: Path, progress: bool = True) -> GPTModel:
    """The base GPT-2: the seeded random model, or the pretrained weights from the OpenAI checkpoint
    (``cache_dir``, or ``weights_dir``) or the Hugging Face safetensors (``weights_source=hf``)."""
    if cfg.weights == "random":
        return _random_base(mcfg, cfg.seed)

    size = resolve_model_size(cfg.model_size)
    if size == "tiny":
        raise UsageError("model_size=tiny has no pretrained checkpoint; use --weights random")
    if cfg.weights_source == "hf":  # the Hugging Face safetensors, from the Hub's cache (not cache_dir)
        return load_gpt_from_hf(mcfg, model_size=size, weights_dir=cfg.weights_dir, progress=progress)
    folder = Path(cfg.weights_dir) if cfg.weights_dir else weights.ensure_checkpoint(
        size, cache_dir=cache_dir, progress=progress)
    model = GPTModel(mcfg)
    weights.load_pretrained_into(model, folder)
    model.eval()
    return model


def make_trainable(model: GPTModel, cfg: TrainConfig) -> None:
    """Freeze, reseed, replace the head, and unfreeze / wrap the chosen layers."""
    for p in model.parameters():
        p.requires_grad = False
    torch.manual_seed(cfg.seed)
    model.out_head = nn.Linear(model.cfg.emb_dim, NUM_CLASSES)
    layers = cfg.trainable_layers
    if layers in ("last_block", "last_two_blocks"):
        blocks = [model.trf_blocks[-1]] + ([model.trf_blocks[-2]] if layers == "last_two_blocks" else [])
        for module in blocks + [model.final_norm]:
            for p in module.parameters():
                p.requires_grad = True
    elif layers == "all":
        for p in model.parameters():
            p.requires_grad = True
    elif cfg.is_lora:
        options = {"detach_norm": cfg.dora_norm == "detached"} if cfg.lora_variant == "dora" else {}
        inject_lora(model, cls=lora_class(layers, cfg.lora_variant), rank=cfg.lora_rank,
                    alpha=lora_scale(cfg.lora_alpha, cfg.lora_rank, cfg.lora_scaling), **options)
    elif layers == FROZEN:  # below every block: its gradient is the one sent back through all of them
        model.pos_emb.weight.requires_grad = True
    # last_layer: only the new head, which is trainable on creation


def build_classifier(cfg: TrainConfig, *, cache_dir: Path, progress: bool = True) -> GPTModel:
    """The classifier on the CPU, exactly as the reference builds it (move it to the device after)."""
    mcfg = model_config(cfg)
    model = load_base_model(cfg, mcfg, cache_dir=cache_dir, progress=progress)
    make_trainable(model, cfg)
    return model


def cast_frozen(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen weights and biases of linear layers in ``dtype`` once (bf16 mode), so
    autocast does not cast them every step. Trainable parameters stay fp32 (master weights);
    embeddings and norms stay fp32 so the residual stream keeps fp32. Returns how many tensors."""
    n = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            for p in module.parameters(recurse=False):
                if not p.requires_grad and p.dtype != dtype:
                    p.data = p.data.to(dtype)
                    n += 1
    return n
