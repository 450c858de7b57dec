"""GPT-2's shapes without torch: the model's configuration and the named sizes. The settings'
declaration reads these, and ``lora-bench --help`` imports the declaration, so nothing here may
import torch."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    context_length: int = 1024
    emb_dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    drop_rate: float = 0.0
    qkv_bias: bool = True
    disable_causal_mask: bool = False
    attention: str = "book"  # book | sdpa
    ops: str = "book"  # book | fused


# The largest shapes lora-bench builds or reads: 10 to 40 times GPT-2 1558M's (1600 wide, 48 blocks,
# 25 heads), so an extra zero in a setting or a checkpoint's header is caught before anything is
# allocated for it; whether a model fits the machine is estimated from its settings
# (lora_bench.train.memory).
MAX_WIDTH = 65_536  # emb_dim, n_heads, a LoRA rank
MAX_BLOCKS = 2_048  # transformer blocks
MAX_VOCAB = 1 << 20  # a checkpoint's vocabulary (GPT-2's: 50,257)
MAX_CONTEXT = 1 << 16  # a checkpoint's positions (GPT-2's: 1,024)

# name -> (emb_dim, n_layers, n_heads); the reference's long names map onto these.
MODEL_SIZES: dict[str, tuple[int, int, int]] = {
    "124M": (768, 12, 12),
    "355M": (1024, 24, 16),
    "774M": (1280, 36, 20),
    "1558M": (1600, 48, 25),
    "tiny": (32, 2, 2),  # smoke runs and tests; random weights only
}
REFERENCE_NAMES = {
    "gpt2-small (124M)": "124M",
    "gpt2-medium (355M)": "355M",
    "gpt2-large (774M)": "774M",
    "gpt2-xl (1558M)": "1558M",
}
# folder names of the OpenAI checkpoints
CHECKPOINT_NAMES = {"124M": "124M", "355M": "355M", "774M": "774M", "1558M": "1558M"}


def resolve_model_size(name: str) -> str:
    """Canonical size name ('124M', ...) for a short or reference name; ValueError otherwise."""
    if name in MODEL_SIZES:
        return name
    if name in REFERENCE_NAMES:
        return REFERENCE_NAMES[name]
    allowed = ", ".join(list(MODEL_SIZES) + [repr(n) for n in REFERENCE_NAMES])
    raise ValueError(f"model_size={name!r} is not allowed; choose one of: {allowed}")


def gpt_config(
    model_size: str,
    *,
    emb_dim: int | None = None,
    n_layers: int | None = None,
    n_heads: int | None = None,
    **kw,
) -> GPTConfig:
    e, L, h = MODEL_SIZES[resolve_model_size(model_size)]
    cfg = GPTConfig(emb_dim=emb_dim or e, n_layers=n_layers or L, n_heads=n_heads or h)
    if cfg.emb_dim % cfg.n_heads:
        raise ValueError(f"emb_dim={cfg.emb_dim} is not divisible by n_heads={cfg.n_heads}")
    return replace(cfg, **kw)


def matmul_params(cfg: GPTConfig) -> int:
    """Parameters in the blocks' matrix products (about 12·L·e²), for analytic FLOP counts."""
    e = cfg.emb_dim
    return cfg.n_layers * (4 * e * e + 8 * e * e)
