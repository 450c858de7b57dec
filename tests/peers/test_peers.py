"""lora_bench.peers.hf: transformers' GPT-2 (and PEFT's LoRA) against the book model with equal
weights, in float64 on the CPU: the same outputs at every position and the same gradients (LoRA: with
the book's query/key/value A's equal, the one arrangement PEFT's fused c_attn can express), the
trainable parameter counts of each mapping, the refusals (CUDA graphs among them), the harness's loop
driving both to the same losses, and that the book path never imports transformers or peft."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from numerics import assert_same_function

from lora_bench.classifier.book import build_classifier, make_trainable
from lora_bench.config import TrainConfig, render
from lora_bench.data.tokenizer import PAD_TOKEN_ID
from lora_bench.errors import ConfigError, UsageError
from lora_bench.model.gpt2 import GPTConfig, build_random_model, count_params
from lora_bench.model.hf_checkpoint import hf_state_from_gpt
from lora_bench.timing import PhaseTimer
from lora_bench.train.evaluate import calc_loss_batch, select_logits
from lora_bench.train.loop import LoopSettings, train_classifier

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lora_bench.peers.hf import (  # noqa: E402
    HF_TRAINABLE_LAYERS,
    HFClassifier,
    build_hf_classifier,
    build_hf_model,
    cast_frozen_hf,
    lora_A_weights,
    make_hf_trainable,
    package_versions,
    unsupported_settings,
)

E, L, H, R = 16, 2, 2, 4
MCFG = GPTConfig(vocab_size=PAD_TOKEN_ID + 1, context_length=32, emb_dim=E, n_layers=L, n_heads=H)
ATTN = {"book": "eager", "sdpa": "sdpa"}
ACT = {"book": "gelu_new", "fused": "gelu_pytorch_tanh"}


def _inputs(seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 1000, (3, 9), generator=g)
    x[1, 6:] = PAD_TOKEN_ID  # padded rows, as the data's collate makes them
    x[2, 3:] = PAD_TOKEN_ID
    return x, torch.tensor([0, 1, 1])


def _pair(layers: str, *, attention="book", ops="fused", alpha=2.5):
    """(book classifier, HF classifier) from the same seeded random body, float64."""
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers=layers, lora_rank=R, lora_alpha=alpha,
                      seed=5)
    mcfg = GPTConfig(**{**MCFG.__dict__, "attention": "sdpa" if attention == "sdpa" else "book", "ops": ops})
    book = build_random_model(mcfg, seed=1)
    hf = build_hf_model(mcfg, hf_state_from_gpt(book), attn_implementation=ATTN[attention], activation=ACT[ops])
    make_trainable(book, cfg)
    trained = make_hf_trainable(hf, trainable_layers=layers, seed=cfg.seed, lora_rank=R, lora_alpha=alpha)
    return book.double(), HFClassifier(trained, mcfg=mcfg, peft=trained is not hf).double()


def _grads_in_hf_layout(book) -> dict[str, torch.Tensor]:
    """The book model's gradients, laid out as the HF body's parameters (by the tested converter)."""
    shadow = copy.deepcopy(book)
    for p, twin in zip(book.parameters(), shadow.parameters()):
        twin.data = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
    return hf_state_from_gpt(shadow)


@pytest.mark.parametrize("attention,ops", [("book", "fused"), ("sdpa", "fused"), ("book", "book"), ("sdpa", "book")])
def test_same_logits_at_every_position(attention, ops):
    """float64 agreement to rounding; with ops=book to 1e-6 only, since the book's GELU takes its
    √(2/π) from a float32 tensor (rounded at 1e-8 relative) and gelu_new computes it in float64."""
    book, hf = _pair("all", attention=attention, ops=ops)
    x, _ = _inputs()
    with torch.no_grad():
        ref, got = book(x), hf(x)
    assert got.shape == ref.shape == (3, 9, 2)
    tol = dict(rtol=1e-10, atol=1e-12) if ops == "fused" else dict(rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(got, ref, **tol)
    if ops == "book":
        assert not torch.allclose(got, ref, rtol=1e-10, atol=1e-12)  # the constant's rounding shows
    for pos in ("last", "first", "flexible"):  # so the harness's every choice matches too
        torch.testing.assert_close(select_logits(got, x, token_pos=pos, average_embeddings=False),
                                   select_logits(ref, x, token_pos=pos, average_embeddings=False))


def test_the_head_is_the_books():
    book, hf = _pair("last_layer")
    head = hf.classifier().score
    assert head.bias is not None
    assert torch.equal(head.weight, book.out_head.weight) and torch.equal(head.bias, book.out_head.bias)


@pytest.mark.parametrize("token_pos", ["last", "flexible"])
def test_gradients_match_book_when_all_train(token_pos):
    book, hf = _pair("all")
    x, y = _inputs()
    calc_loss_batch(x, y, book, token_pos=token_pos).backward()
    calc_loss_batch(x, y, hf, token_pos=token_pos).backward()
    expected = _grads_in_hf_layout(book)
    body = hf.classifier().transformer
    for name, p in body.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)
    score = hf.classifier().score
    torch.testing.assert_close(score.weight.grad, book.out_head.weight.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(score.bias.grad, book.out_head.bias.grad, rtol=1e-9, atol=1e-12)


def _units(names, *, hf: bool) -> set[str]:
    """Which parts of the model the trainable parameters belong to, in one vocabulary."""
    out = set()
    for n in names:
        n = n.replace("model.", "", 1) if hf else n
        if hf:
            n = n.replace("transformer.h.", "block.").replace("transformer.ln_f", "final_norm") \
                 .replace("transformer.wte", "emb").replace("transformer.wpe", "emb").replace("score", "head")
        else:
            n = n.replace("trf_blocks.", "block.").replace("tok_emb", "emb").replace("pos_emb", "emb") \
                 .replace("out_head", "head")
        parts = n.split(".")
        out.add(".".join(parts[:2]) if parts[0] == "block" else parts[0])
    return out


@pytest.mark.parametrize("layers", ["all", "last_layer", "last_block", "last_two_blocks"])
def test_trainable_parameters_equal_the_books(layers):
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers=layers)
    book = build_classifier(cfg, cache_dir=None)
    hf = build_hf_classifier(cfg, cache_dir=None)
    assert count_params(hf, trainable_only=True) == count_params(book, trainable_only=True)
    assert count_params(hf) == count_params(book)
    t_book = {n for n, p in book.named_parameters() if p.requires_grad}
    t_hf = {n for n, p in hf.named_parameters() if p.requires_grad}
    assert _units(t_hf, hf=True) == _units(t_book, hf=False)
    x, _ = _inputs()
    with torch.no_grad():  # and the same random start as the book: as close to its float64 evaluation
        assert_same_function(hf(x), book(x), copy.deepcopy(book).double()(x), what=layers)


def test_lora_parameter_counts_differ_as_documented():
    """PEFT's fused c_attn has one A and one B (e·r + r·3e) where the book's q/k/v have three of each
    (6·e·r); the book's head also gets an adapter ((e + 2)·r); PEFT keeps a frozen copy of the head
    (modules_to_save), which counts in the total only."""
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora", lora_rank=R)
    book = build_classifier(cfg, cache_dir=None)
    hf = build_hf_classifier(cfg, cache_dir=None)
    e, n_layers = book.cfg.emb_dim, book.cfg.n_layers
    head = e * 2 + 2
    assert count_params(book, trainable_only=True) - count_params(hf, trainable_only=True) == \
        n_layers * 2 * e * R + (e + 2) * R
    lora_hf = count_params(hf, trainable_only=True) - head
    assert count_params(hf) == count_params(build_classifier(cfg.replace(trainable_layers="last_layer"),
                                                             cache_dir=None)) + lora_hf + head
    assert len(lora_A_weights(hf)) == 4 * n_layers


def test_lora_matches_book_with_shared_qkv_a():
    """alpha·r as PEFT's lora_alpha gives the book's scale; with A_q = A_k = A_v and the book head's
    B = 0 (PEFT's head has no adapter), the outputs are the book's, and the gradients are: equal for
    c_proj / c_fc / the head, c_attn's B the book's three B's side by side, c_attn's A the sum of the
    book's three A gradients (one shared parameter)."""
    alpha = 2.5
    book, hf = _pair("lora", alpha=alpha)
    g = torch.Generator().manual_seed(9)
    rnd = lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.3  # noqa: E731
    core = hf.classifier()
    with torch.no_grad():
        for i, blk in enumerate(book.trf_blocks):
            att, ff, hb = blk.att, blk.ff.layers, core.transformer.h[i]
            for lin in (att.W_query, att.W_key, att.W_value, att.out_proj, ff[0], ff[2]):
                lin.lora.A.copy_(rnd(lin.lora.A))
                lin.lora.B.copy_(rnd(lin.lora.B))
            att.W_key.lora.A.copy_(att.W_query.lora.A)
            att.W_value.lora.A.copy_(att.W_query.lora.A)
            pairs = {hb.attn.c_proj: att.out_proj, hb.mlp.c_fc: ff[0], hb.mlp.c_proj: ff[2]}
            for layer, lin in pairs.items():
                layer.lora_A["default"].weight.copy_(lin.lora.A.t())
                layer.lora_B["default"].weight.copy_(lin.lora.B.t())
            hb.attn.c_attn.lora_A["default"].weight.copy_(att.W_query.lora.A.t())
            hb.attn.c_attn.lora_B["default"].weight.copy_(
                torch.cat([att.W_query.lora.B, att.W_key.lora.B, att.W_value.lora.B], dim=1).t())
            for layer in (hb.attn.c_attn, hb.attn.c_proj, hb.mlp.c_fc, hb.mlp.c_proj):
                assert layer.scaling["default"] == alpha
        book.out_head.lora.B.zero_()
    x, y = _inputs()
    torch.testing.assert_close(hf(x), book(x), rtol=1e-10, atol=1e-12)
    calc_loss_batch(x, y, book, token_pos="flexible").backward()
    calc_loss_batch(x, y, hf, token_pos="flexible").backward()
    close = dict(rtol=1e-9, atol=1e-12)
    for i, blk in enumerate(book.trf_blocks):
        att, ff, hb = blk.att, blk.ff.layers, core.transformer.h[i]
        for layer, lin in {hb.attn.c_proj: att.out_proj, hb.mlp.c_fc: ff[0], hb.mlp.c_proj: ff[2]}.items():
            torch.testing.assert_close(layer.lora_A["default"].weight.grad, lin.lora.A.grad.t(), **close)
            torch.testing.assert_close(layer.lora_B["default"].weight.grad, lin.lora.B.grad.t(), **close)
        qkv = (att.W_query, att.W_key, att.W_value)
        torch.testing.assert_close(hb.attn.c_attn.lora_A["default"].weight.grad,
                                   sum(lin.lora.A.grad for lin in qkv).t(), **close)
        torch.testing.assert_close(hb.attn.c_attn.lora_B["default"].weight.grad,
                                   torch.cat([lin.lora.B.grad for lin in qkv], dim=1).t(), **close)
        assert hb.attn.c_attn.base_layer.weight.grad is None  # frozen, as the book's
    score = core.score.modules_to_save["default"]
    torch.testing.assert_close(score.weight.grad, book.out_head.linear.weight.grad, **close)
    torch.testing.assert_close(score.bias.grad, book.out_head.linear.bias.grad, **close)
    assert core.score.original_module.weight.grad is None


def test_lora_init_choices():
    """PEFT draws A with bound 1/√in (fan_in = in_features), the book with 1/√r (its A is in×r);
    B starts at zero either way, so the adapted model starts as the base one."""
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora", lora_rank=R)
    base = build_hf_classifier(cfg.replace(trainable_layers="last_layer"), cache_dir=None)
    x, _ = _inputs()
    for init, bound_of in (("peft", lambda a: a.shape[1] ** -0.5), ("book", lambda a: R ** -0.5)):
        hf = build_hf_classifier(cfg, cache_dir=None, lora_init=init)
        a_weights = lora_A_weights(hf)
        for a in a_weights:
            assert a.abs().max() <= bound_of(a)
            assert a.abs().max() > 0.5 * bound_of(a)  # and the bound is actually used
        assert all(not m.lora_B["default"].weight.any() for m in hf.modules() if hasattr(m, "lora_B")
                   and isinstance(m.lora_B, nn.ModuleDict) and "default" in m.lora_B)
        with torch.no_grad():
            assert torch.equal(hf(x), base(x))


def test_flexible_is_transformers_own_pooling_and_last_is_position_minus_one():
    """transformers' forward (with a pad id) pools at the last non-pad token: the harness's
    'flexible'. The book's 'last' is position -1, a pad for padded rows, and differs there."""
    _, hf = _pair("all")
    x, _ = _inputs()
    core = hf.classifier()
    core.config.pad_token_id = PAD_TOKEN_ID
    with torch.no_grad():
        pooled = core(input_ids=x).logits  # (B, 2)
        out = hf(x)
    torch.testing.assert_close(pooled, select_logits(out, x, token_pos="flexible", average_embeddings=False),
                               rtol=1e-12, atol=1e-12)
    last = select_logits(out, x, token_pos="last", average_embeddings=False)
    assert torch.equal(last[0], pooled[0])  # unpadded row: the same token
    assert not torch.allclose(last[1:], pooled[1:])  # padded rows: a pad's logits


def test_harness_loop_trains_both_to_the_same_losses():
    """The unchanged loop, loss, AdamW and phase timer drive the HF model through the same steps."""
    losses = {}
    batches = [_inputs(seed) for seed in range(4)]
    for name, model in zip(("book", "hf"), _pair("all")):
        torch.manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        timer = PhaseTimer("events", torch.device("cpu"), warmup_steps=1)
        res = train_classifier(model, batches, batches[:2], opt, torch.device("cpu"),
                               settings=LoopSettings(num_epochs=2, eval_freq=2, eval_iter=2, token_pos="flexible"),
                               timer=timer)
        assert len(timer.step_rows("r")) == 8
        losses[name] = res.train_losses[0] + res.val_losses[0]
    assert len(losses["hf"]) == 8
    torch.testing.assert_close(torch.tensor(losses["hf"]), torch.tensor(losses["book"]), rtol=1e-9, atol=0)


def test_cast_frozen_hf_casts_the_frozen_linears_only():
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora", lora_rank=R)
    hf = build_hf_classifier(cfg, cache_dir=None)
    n_layers = hf.cfg.n_layers
    assert cast_frozen_hf(hf, torch.bfloat16) == n_layers * 4 * 2 + 2  # Conv1D weight+bias; the head's frozen copy
    for name, p in hf.named_parameters():
        if p.requires_grad or "wte" in name or "wpe" in name or "ln_" in name:
            assert p.dtype == torch.float32, name
    x, y = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = calc_loss_batch(x, y, hf)
    loss.backward()
    assert all(p.grad is not None for p in hf.parameters() if p.requires_grad)


@pytest.mark.slow
def test_blocks_under_the_book_name_and_a_graph_without_breaks():
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora", lora_rank=R, attention="sdpa")
    hf = build_hf_classifier(cfg, cache_dir=None)
    assert len(hf.trf_blocks) == hf.cfg.n_layers
    assert isinstance(hf.trf_blocks[0], transformers.models.gpt2.modeling_gpt2.GPT2Block)
    x, _ = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(hf, backend="aot_eager", fullgraph=True)  # fullgraph: a break would raise
    with torch.no_grad():
        assert_same_function(compiled(x), hf(x), copy.deepcopy(hf).double()(x), what="compiled")
    torch._dynamo.reset()


# -- refusals and optional packages ---------------------------------------------------------------------

@pytest.mark.parametrize("changes, needle", [
    (dict(trainable_layers="lora-kernel"), "trainable_layers='lora-kernel' has no Hugging Face peer"),
    (dict(trainable_layers="lora-merged"), "trainable_layers='lora-merged' has no Hugging Face peer"),
    (dict(disable_causal_mask=True), "disable_causal_mask has no Hugging Face peer"),
])
def test_what_does_not_map_is_refused(changes, needle):
    cfg = TrainConfig(model_size="tiny", weights="random", **changes)
    with pytest.raises(ConfigError, match=needle) as err:
        build_hf_classifier(cfg, cache_dir=None)
    assert err.value.exit_code == 2
    if "trainable_layers" in changes:
        assert ", ".join(HF_TRAINABLE_LAYERS) in str(err.value)


def test_every_problem_is_reported_at_once():
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora-kernel", disable_causal_mask=True)
    assert len(unsupported_settings(cfg)) == 2
    with pytest.raises(ConfigError, match="2 problems"):
        build_hf_classifier(cfg, cache_dir=None)
    ok = TrainConfig(model_size="tiny", weights="random", trainable_token_pos="first", average_embeddings=True)
    assert unsupported_settings(ok) == []  # every token choice maps: the harness picks the token


@pytest.mark.parametrize("missing, layers", [("transformers", "all"), ("peft", "lora")])
def test_missing_package_names_the_extra(monkeypatch, missing, layers):
    monkeypatch.setitem(sys.modules, missing, None)  # any `import <missing>` now fails
    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers=layers)
    with pytest.raises(UsageError, match=r'needs the Python package .*pip install "lora-bench\[peers\]"') as err:
        build_hf_classifier(cfg, cache_dir=None)
    assert repr(missing) in str(err.value)


def test_book_path_imports_neither_transformers_nor_peft():
    code = ("import sys, lora_bench, lora_bench.train.run, lora_bench.cli, lora_bench.sweep.spec, lora_bench.peers, "
            "lora_bench.peers.hf, lora_bench.model.hf_checkpoint\n"
            "print(sorted(m for m in ('transformers', 'peft', 'safetensors', 'huggingface_hub') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_package_versions_are_recorded():
    versions = package_versions()
    assert versions["transformers"] == transformers.__version__ and versions["peft"] == peft.__version__


# -- the run's execution modes (GPU tests marked; run on the device) ---------------------------------------

def _run_losses(*, impl="hf", layers="lora", device="cuda", precision="fp32", compile_scope=None,
                steps=12, float64=False) -> list[float]:
    """Per-step training losses of a tiny random-weight classifier driven as a run drives it: bf16 casts
    the frozen linears and autocasts, compile goes through run.compile_model; ``float64``: the model
    built as always, then cast to float64 (the reference of a float32 run)."""
    from lora_bench.classifier.book import cast_frozen
    from lora_bench.train.setup import amp_context, compile_model

    cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers=layers, lora_rank=R, lora_alpha=8.0,
                      attention="sdpa", ops="fused", precision=precision, learning_rate=1e-3, device=device)
    dev = torch.device(device)
    if impl == "hf":
        model = build_hf_classifier(cfg, cache_dir=None)
        cast = cast_frozen_hf
    else:
        model = build_classifier(cfg, cache_dir=None)
        cast = cast_frozen
    if float64:
        model.double()
        assert {p.dtype for p in model.parameters()} == {torch.float64}
    if precision == "bf16":
        cast(model, torch.bfloat16)
    model.to(dev)
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    if compile_scope:
        torch._dynamo.reset()
    fwd = compile_model(model, compile_scope) if compile_scope else model
    timer = PhaseTimer("events", dev, warmup_steps=1)
    batches = []
    for seed in range(steps):
        x, y = _inputs(seed)
        batches.append((x.repeat(2, 1)[:4], y.repeat(2)[:4]))  # one static shape: (4, 9)
    losses: list[float] = []
    train_classifier(fwd, batches, batches[:2], opt, dev,
                     settings=LoopSettings(num_epochs=1, eval_freq=4, eval_iter=2, token_pos="flexible"),
                     timer=timer, amp=amp_context(cfg, dev),
                     on_step=lambda step, epoch, loss: losses.append(loss.detach().item()))
    assert len(timer.step_rows("r")) == steps
    return losses


def _rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


def _assert_same_run(got, want, ref, what: str) -> None:
    """float32 losses ``got`` as close to the float64 run ``ref`` as ``want`` (numerics.same_function_tol)."""
    assert 0 < len(got) == len(want) == len(ref)
    assert_same_function(*(torch.tensor(t, dtype=torch.float64) for t in (got, want, ref)), what=what)


def test_bf16_run_mode_drives_the_peer_on_cpu():
    """The run's bf16 set-up (cast_frozen_hf + autocast) trains the peer close to fp32, and not as it."""
    ref = _run_losses(device="cpu", steps=6)
    got = _run_losses(device="cpu", precision="bf16", steps=6)
    assert len(got) == 6 and 0 < _rel(got, ref) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("layers", ["all", "last_block"])
def test_cuda_peer_trains_like_the_book(layers):
    """Same random start, same function: on the GPU in fp32 the two implementations' losses agree."""
    book = _run_losses(impl="book", layers=layers)
    ref = _run_losses(impl="book", layers=layers, float64=True)
    hf = _run_losses(impl="hf", layers=layers)
    _assert_same_run(hf, book, ref, what="hf")


@pytest.mark.parametrize("layers", ["all", "lora"])
@pytest.mark.parametrize("extra", [{}, {"compile": True}, {"precision": "bf16"}])
def test_cuda_graphs_are_refused_for_the_peer(layers, extra):
    """transformers' GPT-2 replayed from the harness's captured CUDA graphs does not compute what it
    computes eagerly (fp32, compiled, bf16 alike), so a run refuses the combination up front."""
    cfg = TrainConfig(model_size="tiny", weights="random", implementation="hf", trainable_layers=layers,
                      cuda_graphs=True, device="cuda", optimizer="fused", **extra)
    problems = render(cfg.problems())
    assert len(problems) == 1 and problems[0].startswith("cuda_graphs with implementation=hf is refused")
    assert render(cfg.replace(cuda_graphs=False).problems()) == []


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_compiled_peer_matches_eager(scope):
    eager = _run_losses(steps=10)
    ref = _run_losses(steps=10, float64=True)
    compiled = _run_losses(compile_scope=scope, steps=10)
    _assert_same_run(compiled, eager, ref, what="compiled")


@pytest.mark.gpu
def test_bf16_peer_on_cuda_close_to_fp32():
    ref = _run_losses(steps=12)
    got = _run_losses(precision="bf16", steps=12)
    assert _rel(got, ref) < 3e-2
