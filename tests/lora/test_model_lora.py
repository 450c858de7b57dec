"""GPT-2 structure and parameter counts, and the LoRA variants: wrapping, parity, frozen weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lora_bench.classifier.book import make_trainable
from lora_bench.config import TrainConfig
from lora_bench.lora import LinearWithLoRA, LinearWithLoRAMerged, LoRALinearBase, inject_lora
from lora_bench.model.gpt2 import GPTModel, build_random_model, count_params, gpt_config, resolve_model_size


def _classifier_on_meta(size: str, layers: str, rank: int = 16) -> GPTModel:
    cfg = TrainConfig(model_size=size, weights="random", trainable_layers=layers, lora_rank=rank, lora_alpha=16)
    with torch.device("meta"):
        model = GPTModel(gpt_config(size))
        make_trainable(model, cfg)
    return model


@pytest.mark.parametrize(
    "size, layers, trainable, total",
    [
        ("124M", "all", 124_441_346, 124_441_346),
        ("124M", "lora", 2_668_066, None),
        ("124M", "lora-merged", 2_668_066, None),
        ("124M", "lora-kernel", 2_668_066, None),
        ("1558M", "all", 1_557_614_402, 1_557_614_402),
        ("1558M", "lora", 22_147_234, None),
        ("1558M", "lora-merged", 22_147_234, None),
    ],
)
def test_trainable_parameter_counts(size, layers, trainable, total):
    model = _classifier_on_meta(size, layers)
    assert count_params(model, trainable_only=True) == trainable
    if total is not None:
        assert count_params(model) == total


def test_other_trainable_choices_124m():
    head = 768 * 2 + 2
    block = 12 * 768 * 768 + 9 * 768 + 4 * 768  # weights, 9e of biases, two norms (scale+shift)
    norm = 2 * 768
    assert count_params(_classifier_on_meta("124M", "last_layer"), trainable_only=True) == head
    assert count_params(_classifier_on_meta("124M", "last_block"), trainable_only=True) == head + block + norm
    assert count_params(_classifier_on_meta("124M", "last_two_blocks"), trainable_only=True) == head + 2 * block + norm


def test_model_sizes_and_names():
    assert resolve_model_size("gpt2-xl (1558M)") == "1558M"
    cfg = gpt_config("355M")
    assert (cfg.emb_dim, cfg.n_layers, cfg.n_heads, cfg.vocab_size, cfg.context_length) == (1024, 24, 16, 50257, 1024)
    with pytest.raises(ValueError, match="model_size='999M' is not allowed"):
        resolve_model_size("999M")


def test_random_build_is_seeded_and_mask_is_causal():
    a = build_random_model(gpt_config("tiny"), seed=123)
    b = build_random_model(gpt_config("tiny"), seed=123)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    mask = a.trf_blocks[0].att.mask
    assert mask[0, 1] == 1 and mask[1, 0] == 0 and mask[1, 1] == 0
    # construction order: query is built before key (the first RNG draws after the embeddings)
    torch.manual_seed(123)
    emb = nn.Embedding(50257, 32), nn.Embedding(1024, 32)
    q = nn.Linear(32, 32)
    assert torch.equal(q.weight, a.trf_blocks[0].att.W_query.weight)
    del emb


@pytest.mark.parametrize("cls", [LinearWithLoRA, LinearWithLoRAMerged])
def test_lora_wraps_every_linear_at_every_depth(cls):
    torch.manual_seed(0)
    model = build_random_model(gpt_config("tiny"))
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert inject_lora(model, cls=cls, rank=4, alpha=2.0) == n_linear == 2 * 6 + 1
    wrapped = [m for m in model.modules() if isinstance(m, LoRALinearBase)]
    assert len(wrapped) == n_linear and all(type(m) is cls for m in wrapped)
    # the innermost linear layers sit 3-4 modules deep (trf_blocks.0.ff.layers.0)
    assert isinstance(model.trf_blocks[1].ff.layers[2], cls)
    assert isinstance(model.trf_blocks[0].att.W_value, cls)


def test_lora_init_uses_global_rng_in_traversal_order():
    model = _tiny_lora(LinearWithLoRA, seed=7)
    torch.manual_seed(7)
    first = torch.empty(32, 4)
    nn.init.kaiming_uniform_(first, a=5 ** 0.5)
    assert torch.equal(model.trf_blocks[0].att.W_query.lora.A, first)
    assert torch.count_nonzero(model.trf_blocks[0].att.W_query.lora.B) == 0


def _tiny_lora(cls, seed: int = 1, rank: int = 4, alpha: float = 3.0) -> GPTModel:
    model = build_random_model(gpt_config("tiny"), seed=123)
    for p in model.parameters():
        p.requires_grad = False
    torch.manual_seed(seed)
    inject_lora(model, cls=cls, rank=rank, alpha=alpha)
    return model


def test_merged_equals_unmerged_outputs_and_gradients():
    a = _tiny_lora(LinearWithLoRA).double()
    b = _tiny_lora(LinearWithLoRAMerged).double()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():  # non-zero B so the adapters matter
        for m in a.modules():
            if isinstance(m, LoRALinearBase):
                m.lora.B.normal_()
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 50257, (3, 11))
    ya, yb = a(x), b(x)
    assert torch.allclose(ya, yb, rtol=1e-10, atol=1e-10)
    ya.square().mean().backward()
    yb.square().mean().backward()
    ga = {n: p.grad for n, p in a.named_parameters() if p.requires_grad}
    gb = {n: p.grad for n, p in b.named_parameters() if p.requires_grad}
    assert ga.keys() == gb.keys() and len(ga) == 2 * 13
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=1e-8, atol=1e-10), n


@pytest.mark.parametrize("cls", [LinearWithLoRA, LinearWithLoRAMerged])
def test_frozen_weights_unchanged_after_a_step(cls):
    model = _tiny_lora(cls)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model(torch.randint(0, 50257, (2, 9))).square().mean().backward()
    opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert p.grad is None and torch.equal(p, frozen[n]), n
    assert any(not torch.equal(p, adapters[n]) for n, p in model.named_parameters() if n in adapters)


def test_reused_random_base_equals_a_fresh_build():
    from lora_bench.classifier.book import _random_base

    cfg = gpt_config("tiny")
    first, second = _random_base(cfg, 123), _random_base(cfg, 123)
    fresh = build_random_model(cfg, seed=123)
    for (n, p), (_, q), (_, r) in zip(first.named_parameters(), second.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, r) and torch.equal(q, r), n
        assert p.data_ptr() != q.data_ptr()  # independent copies: one run's training cannot leak
    assert torch.equal(second.trf_blocks[1].att.mask, fresh.trf_blocks[1].att.mask)
