"""LoRA's variants in the transformers + PEFT peer (lora_bench.peers.hf) against the book model's: rsLoRA's
scale, DoRA (PEFT's ``use_dora``, its norm detached: the book's ``dora_norm=detached``) computing the
same outputs and adapter gradients in float64, PiSSA's start equal to the base model's with its
one-time cost recorded, LoRA+'s groups finding PEFT's B's, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import dot_tol, rel_err

from lora_bench.classifier.book import make_trainable
from lora_bench.config import TrainConfig
from lora_bench.model.gpt2 import GPTConfig, build_random_model
from lora_bench.model.hf_checkpoint import hf_state_from_gpt
from lora_bench.train.build import build_optimizer
from lora_bench.train.evaluate import calc_loss_batch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lora_bench.peers.hf import (  # noqa: E402
    HFClassifier,
    build_hf_classifier,
    build_hf_model,
    make_hf_trainable,
    unsupported_settings,
)

E, L, H, R = 16, 2, 2, 4
MCFG = GPTConfig(vocab_size=50257, context_length=32, emb_dim=E, n_layers=L, n_heads=H, ops="fused")
ADAPTER = "default"


def _inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 1000, (3, 9), generator=g), torch.tensor([0, 1, 1])


def _pair(**variant):
    """(book classifier, HF classifier) from the same seeded random body with LoRA and ``variant``'s
    settings, float64."""
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora", lora_rank=R, lora_alpha=2.5,
                      seed=5, **variant)
    book = build_random_model(MCFG, seed=1)
    hf = build_hf_model(MCFG, hf_state_from_gpt(book), attn_implementation="eager", activation="gelu_pytorch_tanh")
    make_trainable(book, cfg)
    trained = make_hf_trainable(hf, trainable_layers="lora", seed=cfg.seed, lora_rank=R, lora_alpha=cfg.lora_alpha,
                                lora_scaling=cfg.lora_scaling, lora_variant=cfg.lora_variant)
    return book.double(), HFClassifier(trained, mcfg=MCFG, peft=True).double()


def _peft_layers(hf):
    return [m for m in hf.modules() if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)]


def test_rslora_scale_is_the_books():
    book, hf = _pair(lora_scaling="rslora")
    want = 2.5 / math.sqrt(R)
    assert {m.scaling[ADAPTER] for m in _peft_layers(hf)} == {want}
    assert {m.lora.alpha for m in book.modules() if hasattr(m, "lora")} == {want}


def test_dora_matches_the_books_detached_dora():
    """With A_q = A_k = A_v (the one arrangement PEFT's fused c_attn expresses), c_attn's B the book's
    three side by side and its magnitude their three m's, PEFT's DoRA computes the book's DoRA with
    the norm detached: the same logits and, for every block adapter, the same gradients of A, B and
    m (c_attn's A: the sum of the book's three). The head's B is zero and its m W's norms, so it
    passes the same gradient back as PEFT's plain head (``weight_changed``: its m taken again in
    float64, not the float32 norms cast)."""
    book, hf = _pair(lora_variant="dora", dora_norm="detached")
    g = torch.Generator().manual_seed(9)
    rnd = lambda t, s=0.3: torch.randn(t.shape, generator=g, dtype=t.dtype) * s  # noqa: E731
    core = hf.classifier()
    with torch.no_grad():
        for i, blk in enumerate(book.trf_blocks):
            att, ff, hb = blk.att, blk.ff.layers, core.transformer.h[i]
            qkv = (att.W_query, att.W_key, att.W_value)
            for lin in (*qkv, att.out_proj, ff[0], ff[2]):
                lin.lora.A.copy_(rnd(lin.lora.A))
                lin.lora.B.copy_(rnd(lin.lora.B))
                lin.m.mul_(1 + rnd(lin.m, 0.1))
            for lin in qkv[1:]:
                lin.lora.A.copy_(att.W_query.lora.A)
            pairs = {hb.attn.c_proj: att.out_proj, hb.mlp.c_fc: ff[0], hb.mlp.c_proj: ff[2]}
            for layer, lin in pairs.items():
                layer.lora_A[ADAPTER].weight.copy_(lin.lora.A.t())
                layer.lora_B[ADAPTER].weight.copy_(lin.lora.B.t())
                layer.lora_magnitude_vector[ADAPTER].weight.copy_(lin.m)
            c_attn = hb.attn.c_attn
            c_attn.lora_A[ADAPTER].weight.copy_(att.W_query.lora.A.t())
            c_attn.lora_B[ADAPTER].weight.copy_(torch.cat([lin.lora.B for lin in qkv], dim=1).t())
            c_attn.lora_magnitude_vector[ADAPTER].weight.copy_(torch.cat([lin.m for lin in qkv]))
    book.out_head.weight_changed()  # the head's m: W's norms in float64 (built in float32), so it is W itself
    x, y = _inputs()
    close = dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(hf(x), book(x), **close)
    calc_loss_batch(x, y, book, token_pos="flexible").backward()
    calc_loss_batch(x, y, hf, token_pos="flexible").backward()
    for i, blk in enumerate(book.trf_blocks):
        att, ff, hb = blk.att, blk.ff.layers, core.transformer.h[i]
        for layer, lin in {hb.attn.c_proj: att.out_proj, hb.mlp.c_fc: ff[0], hb.mlp.c_proj: ff[2]}.items():
            torch.testing.assert_close(layer.lora_A[ADAPTER].weight.grad, lin.lora.A.grad.t(), **close)
            torch.testing.assert_close(layer.lora_B[ADAPTER].weight.grad, lin.lora.B.grad.t(), **close)
            torch.testing.assert_close(layer.lora_magnitude_vector[ADAPTER].weight.grad, lin.m.grad, **close)
        qkv = (att.W_query, att.W_key, att.W_value)
        c_attn = hb.attn.c_attn
        torch.testing.assert_close(c_attn.lora_A[ADAPTER].weight.grad, sum(lin.lora.A.grad for lin in qkv).t(),
                                   **close)
        torch.testing.assert_close(c_attn.lora_B[ADAPTER].weight.grad,
                                   torch.cat([lin.lora.B.grad for lin in qkv], dim=1).t(), **close)
        torch.testing.assert_close(c_attn.lora_magnitude_vector[ADAPTER].weight.grad,
                                   torch.cat([lin.m.grad for lin in qkv]), **close)


def test_pissa_peer_starts_as_the_base_model_and_records_its_cost():
    """PEFT's PiSSA (in float32) moves each Conv1D's top singular part into its adapter: the peer's
    logits are the base peer's to float32 rounding, its adapters nonzero, its cost recorded."""
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora", lora_rank=R, lora_init="pissa")
    base = build_hf_classifier(cfg.replace(trainable_layers="last_layer", lora_init="kaiming"), cache_dir=None)
    hf = build_hf_classifier(cfg, cache_dir=None)
    assert hf.adapter_init_s is not None and hf.adapter_init_s > 0
    assert all(m.lora_B[ADAPTER].weight.any() for m in _peft_layers(hf))
    x, _ = _inputs()
    with torch.no_grad():
        got, want = hf(x), base(x)
    e = hf.cfg.emb_dim
    # every block's two residual branches carry one rounding of the split (W_res + s·A·B: 4e + r terms)
    assert rel_err(got, want) <= dot_tol(torch.float32, 2 * hf.cfg.n_layers * (4 * e + R + 2))


def test_loraplus_groups_find_pefts_bs():
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora", lora_rank=R,
                      implementation="hf", loraplus_lr_ratio=16.0, learning_rate=1e-3)
    hf = build_hf_classifier(cfg, cache_dir=None)
    opt = build_optimizer(hf, [cfg])
    plain, bs = opt.param_groups
    assert plain["lr"] == 1e-3 and bs["lr"] == 16e-3
    b_weights = {id(m.lora_B[ADAPTER].weight) for m in _peft_layers(hf)}
    assert {id(p) for p in bs["params"]} == b_weights
    trainable = [p for p in hf.parameters() if p.requires_grad]
    assert len(plain["params"]) + len(bs["params"]) == len(trainable)


@pytest.mark.parametrize("changes, needle", [
    (dict(lora_variant="dora"), "lora_variant=dora with implementation=hf needs dora_norm=detached"),
    (dict(lora_init="pissa", base_dtype="nf4"), "lora_init=pissa with implementation=hf and base_dtype=nf4 is "
                                                "refused"),
])
def test_what_peft_does_otherwise_is_refused(changes, needle):
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora")
    problems = unsupported_settings(cfg.replace(**changes))
    assert any(needle in p for p in problems), problems
    assert unsupported_settings(cfg.replace(lora_variant="dora", dora_norm="detached", lora_scaling="rslora",
                                            lora_init="pissa", loraplus_lr_ratio=4.0)) == []
