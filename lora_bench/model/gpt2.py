"""GPT-2 exactly as the reference builds it (module names, construction order and RNG use), with
two opt-in execution choices that leave the parameters identical: ``attention='sdpa'`` and
``ops='fused'``, and the dtype of its logits (``GPTModel.logits_dtype``: float32 from a bfloat16
model)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lora_bench.model.sizes import (  # noqa: F401  re-exported
    CHECKPOINT_NAMES,
    MODEL_SIZES,
    REFERENCE_NAMES,
    GPTConfig,
    gpt_config,
    matmul_params,
    resolve_model_size,
)


class LayerNorm(nn.Module):
    def __init__(self, emb_dim: int, fused: bool = False):
        super().__init__()
        self.eps = 1e-5
        self.fused = fused
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        if self.fused:
            return F.layer_norm(x, (x.shape[-1],), self.scale, self.shift, self.eps)
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        norm_x = (x - mean) / torch.sqrt(var + self.eps)
        return self.scale * norm_x + self.shift


class GELU(nn.Module):
    def __init__(self, fused: bool = False):
        super().__init__()
        self.fused = fused

    def forward(self, x):
        if self.fused:
            return F.gelu(x, approximate="tanh")
        return 0.5 * x * (1 + torch.tanh(torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * torch.pow(x, 3))))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        e = cfg.emb_dim
        self.layers = nn.Sequential(nn.Linear(e, 4 * e), GELU(cfg.ops == "fused"), nn.Linear(4 * e, e))

    def forward(self, x):
        return self.layers(x)


class MultiHeadAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.emb_dim
        self.d_out = d
        self.num_heads = cfg.n_heads
        self.head_dim = d // cfg.n_heads
        self.sdpa = cfg.attention == "sdpa"
        self.disable_causal_mask = cfg.disable_causal_mask
        # construction order (query, key, value, out) fixes the RNG stream
        self.W_query = nn.Linear(d, d, bias=cfg.qkv_bias)
        self.W_key = nn.Linear(d, d, bias=cfg.qkv_bias)
        self.W_value = nn.Linear(d, d, bias=cfg.qkv_bias)
        self.out_proj = nn.Linear(d, d)
        self.dropout = nn.Dropout(cfg.drop_rate)
        # set by lora_bench.lora.kernel.group_qkv: one call for the three projections
        self.qkv = None
        if not cfg.disable_causal_mask:
            n = cfg.context_length
            self.register_buffer("mask", torch.triu(torch.ones(n, n), diagonal=1), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        if self.qkv is not None:
            queries, keys, values = self.qkv(x)
        else:
            keys = self.W_key(x)  # (B, T, D)
            queries = self.W_query(x)
            values = self.W_value(x)
        keys = keys.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        queries = queries.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        if self.sdpa:
            p = self.dropout.p if self.training else 0.0
            attended = F.scaled_dot_product_attention(queries, keys, values, dropout_p=p,
                                                 is_causal=not self.disable_causal_mask)
        else:
            scores = queries @ keys.transpose(2, 3)  # (B, H, T, T)
            if not self.disable_causal_mask:
                scores.masked_fill_(self.mask.bool()[:t, :t], -torch.inf)
            weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
            weights = self.dropout(weights)
            attended = weights @ values  # (B, H, T, hd)
        attended = attended.transpose(1, 2).contiguous().view(b, t, self.d_out)
        return self.out_proj(attended)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        fused = cfg.ops == "fused"
        self.att = MultiHeadAttention(cfg)
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg.emb_dim, fused)
        self.norm2 = LayerNorm(cfg.emb_dim, fused)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x):
        shortcut = x
        x = self.drop_shortcut(self.att(self.norm1(x)))
        x = x + shortcut
        shortcut = x
        x = self.drop_shortcut(self.ff(self.norm2(x)))
        return x + shortcut


class GPTModel(nn.Module):
    # the dtype the logits are returned in: None keeps the head's own; precision=bf16-true sets float32,
    # so the loss is computed from float32 logits of a bfloat16 model
    logits_dtype: torch.dtype | None = None

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.final_norm = LayerNorm(cfg.emb_dim, cfg.ops == "fused")
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)

    def forward(self, in_idx):
        _, t = in_idx.shape  # (B, T)
        x = self.tok_emb(in_idx) + self.pos_emb(torch.arange(t, device=in_idx.device))  # (B, T, C)
        x = self.drop_emb(x)
        x = self.trf_blocks(x)
        x = self.final_norm(x)
        logits = self.out_head(x)  # (B, T, classes)
        return logits if self.logits_dtype is None else logits.to(self.logits_dtype)


def build_random_model(cfg: GPTConfig, *, seed: int = 123) -> GPTModel:
    """The reference's random-weight model: seed immediately before construction, on the CPU."""
    torch.manual_seed(seed)
    return GPTModel(cfg)


def count_params(model: nn.Module, *, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
