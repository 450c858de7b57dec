"""The estimates count what LoRA's variants compute and keep: ``flops_per_step`` (through
``adapter_flops``) and the memory estimate (``train.memory.estimate``), each held to a count made
independently on CPU.

- Matrix products: ``torch.utils.flop_counter.FlopCounterMode`` over one layer's forward and
  backward (and over a tiny classifier's). It counts every matrix product at 2 per multiply-add,
  as the estimate does, and nothing else, so the two agree exactly.
- Elementwise work: a dispatch mode that counts, for every pointwise or reducing aten op, the
  elements of the largest tensor it touches. It sees every such op; the estimate counts only the
  passes over N×out and out×in tensors that a variant adds to LoRA's layer, so the test subtracts
  LoRA's layer from the variant's and counts the ops whose largest tensor is at least that large
  (the shapes keep every n×r, r×r and N×r tensor smaller): the two agree exactly.
- Memory: the tensors a tiny classifier's forward keeps for backward (``saved_tensors_hooks``,
  each storage once, parameters and buffers apart) and its parameters, DoRA's against LoRA's. The
  estimate, a floor, counts DoRA's products before the scale (batch × tokens × out per layer) and
  its magnitudes exactly; what the layers keep beyond that (the norm's n×r, r×r and per-output
  tensors) is bounded by what they hold: 2·n·r + r² + 4·n values per layer.

rsLoRA's scale, LoRA+'s learning rates and PiSSA's start change neither count: a test runs them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from lora_bench.classifier.book import make_trainable
from lora_bench.config import TrainConfig
from lora_bench.lora import LinearWithDoRA, LinearWithDoRAMerged, LinearWithLoRA, LinearWithLoRAMerged
from lora_bench.model.gpt2 import build_random_model, gpt_config
from lora_bench.results.metrics import adapted_layers, adapter_flops, flops_per_step
from lora_bench.train.memory import FLOAT, estimate

ROWS = 30  # tokens of one layer's input
SHAPES = ((48, 40), (37, 53))  # (in, out)
RANKS = (1, 7)
LAYERS = {  # (trainable_layers, lora_variant, dora_norm) -> the layer and its options
    ("lora", "lora", "exact"): (LinearWithLoRA, {}),
    ("lora-merged", "lora", "exact"): (LinearWithLoRAMerged, {}),
    ("lora", "dora", "exact"): (LinearWithDoRA, {}),
    ("lora", "dora", "detached"): (LinearWithDoRA, {"detach_norm": True}),
    ("lora-merged", "dora", "exact"): (LinearWithDoRAMerged, {}),
    ("lora-merged", "dora", "detached"): (LinearWithDoRAMerged, {"detach_norm": True}),
}


class ElementCount(TorchDispatchMode):
    """Elements of the largest tensor each pointwise or reducing aten op touches, op by op."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.Tag.pointwise in func.tags or torch.Tag.reduction in func.tags:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.sizes.append(max(t.numel() for t in tensors))
        return out


def _layer(key, k: int, n: int, r: int, *, trained: bool):
    cls, options = LAYERS[key]
    torch.manual_seed(0)
    linear = nn.Linear(k, n)
    linear.requires_grad_(trained)
    layer = cls(linear, r, 2.0, **options)
    with torch.no_grad():
        layer.lora.B.normal_()  # a zero B would leave parts of the graph constant
    return layer


def _counted(layer, k: int) -> tuple[int, list[int]]:
    """Matrix-product FLOPs and element counts of one forward and backward of ``layer``."""
    x = torch.randn(ROWS, k, requires_grad=True)
    with FlopCounterMode(display=False) as flops, ElementCount() as elements:
        y = layer(x)
        y.backward(torch.randn_like(y))
    return flops.get_total_flops(), elements.sizes


def _estimated(key, k: int, n: int, r: int, *, trained: bool) -> tuple[float, float]:
    layers, variant, norm = key
    return adapter_flops(k, n, rank=r, tokens=ROWS, trainable_layers=layers, lora_variant=variant, dora_norm=norm,
                         weight_trained=trained)


@pytest.mark.parametrize("trained", [False, True], ids=["frozen-W", "trained-W"])
@pytest.mark.parametrize("r", RANKS)
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("key", list(LAYERS), ids=lambda key: "-".join(key))
def test_a_layers_products_are_counted_exactly(key, k, n, r, trained):
    """The layer's products are its frozen product and that product's input gradient (4·N·k·n, and
    a trained W's gradient 2·N·k·n, the merged weight's in a merged layer: counted with the model)
    and its adapter's."""
    counted, _ = _counted(_layer(key, k, n, r, trained=trained), k)
    own = 4 * ROWS * k * n + (2 * ROWS * k * n if trained else 0)
    assert counted == own + _estimated(key, k, n, r, trained=trained)[0]


@pytest.mark.parametrize("trained", [False, True], ids=["frozen-W", "trained-W"])
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("key", [key for key in LAYERS if key[1] == "dora"], ids=lambda key: "-".join(key))
def test_doras_elementwise_passes_are_counted_exactly(key, k, n, trained):
    """DoRA's passes over N×out and out×in tensors beyond those of LoRA's layer of the same form."""
    r = 4
    lora = (key[0], "lora", "exact")
    big = min(ROWS * n, k * n)
    assert max(ROWS, k, n) * r < big and r * r < big  # the norm's small tensors stay below the threshold
    passes = {}
    for which in (key, lora):
        _, sizes = _counted(_layer(which, k, n, r, trained=trained), k)
        passes[which] = sum(s for s in sizes if s >= big)
    assert passes[key] - passes[lora] == _estimated(key, k, n, r, trained=trained)[1]
    assert _estimated(lora, k, n, r, trained=trained)[1] == 0


def test_peft_dora_is_counted_exactly():
    """PEFT's DoRA over a GPT-2 Conv1D: B·A formed from an identity and the merged weight's norm,
    detached (no backward product), and its output combined from the base's and the adapter's."""
    peft = pytest.importorskip("peft")
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    k, n, r = 48, 40, 4
    counts = {}
    for dora in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential()
        model.add_module("c_fc", conv1d(n, k))
        model = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=8, target_modules=["c_fc"], use_dora=dora,
                                                           lora_dropout=0.0, fan_in_fan_out=True))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p)
        flops, sizes = _counted(model, k)
        counts[dora] = flops, sum(s for s in sizes if s >= min(ROWS * n, k * n))
    for dora in (False, True):
        matmul, _ = adapter_flops(k, n, rank=r, tokens=ROWS, lora_variant="dora" if dora else "lora",
                                  dora_norm="detached", implementation="hf")
        assert counts[dora][0] == 4 * ROWS * k * n + matmul
    _, elementwise = adapter_flops(k, n, rank=r, tokens=ROWS, lora_variant="dora", dora_norm="detached",
                                   implementation="hf")
    assert counts[True][1] - counts[False][1] == elementwise


# -- the whole classifier ------------------------------------------------------------------------------
def _classifier(**settings):
    cfg = TrainConfig(**{"model_size": "tiny", "weights": "random", "device": "cpu", "trainable_layers": "lora",
                         "lora_rank": 4, "lora_alpha": 2.0, **settings})
    model = build_random_model(gpt_config("tiny"))
    make_trainable(model, cfg)
    return cfg, model


def _step_counts(model, tokens: torch.Tensor) -> tuple[int, int, int]:
    """Matrix-product FLOPs of one forward and backward, the bytes of the tensors the forward keeps
    for backward (each storage once, parameters and buffers apart), and the trained parameters."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with FlopCounterMode(display=False) as flops:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            logits = model(tokens)[:, -1, :]
        logits.sum().backward()
    return flops.get_total_flops(), sum(kept.values()), sum(p.numel() for p in model.parameters() if p.requires_grad)


def _tokens(cfg: TrainConfig) -> torch.Tensor:
    """A batch of the shape the memory estimate assumes (batch_size × the longest training text)."""
    torch.manual_seed(1)
    return torch.randint(0, 50257, (cfg.batch_size, min(120, gpt_config("tiny").context_length)))


def _against_lora(**settings):
    """The tiny classifier with LoRA and with ``settings``: both configs, the step counts of each
    (``_step_counts``) on one batch, and that batch's token count."""
    lora_cfg, lora = _classifier()
    other_cfg, other = _classifier(**settings)
    tokens = _tokens(lora_cfg)
    return lora_cfg, other_cfg, _step_counts(lora, tokens), _step_counts(other, tokens), tokens.numel()


@pytest.mark.parametrize("norm", ["exact", "detached"])
def test_a_dora_classifier_costs_what_the_estimates_add(norm):
    """DoRA against LoRA on the tiny classifier: the products its layers add (FlopCounterMode), equal
    to what flops_per_step adds for them; its trained magnitudes, equal to the estimate's; the
    tensors its forward keeps, at least the estimate's added activations (a floor), and no more
    than those plus the norm's small tensors."""
    lora_cfg, dora_cfg, (lora_flops, lora_kept, lora_trained), (dora_flops, dora_kept, dora_trained), n_tokens = \
        _against_lora(lora_variant="dora", dora_norm=norm)
    mcfg = gpt_config("tiny")
    matmul = sum(adapter_flops(k, n, rank=4, tokens=n_tokens, lora_variant="dora", dora_norm=norm, weight_trained=w)[0]
                 - adapter_flops(k, n, rank=4, tokens=n_tokens, weight_trained=w)[0]
                 for k, n, w in adapted_layers(mcfg))
    assert dora_flops - lora_flops == matmul > 0
    elementwise = sum(adapter_flops(k, n, rank=4, tokens=n_tokens, lora_variant="dora", dora_norm=norm,
                                    weight_trained=w)[1] for k, n, w in adapted_layers(mcfg))
    step = dict(trainable_layers="lora", tokens=n_tokens, rank=4)
    assert flops_per_step(mcfg, **step, lora_variant="dora", dora_norm=norm) - flops_per_step(mcfg, **step) \
        == matmul + elementwise

    lora_est, dora_est = estimate(lora_cfg), estimate(dora_cfg)
    outputs = sum(n for _, n, _ in adapted_layers(mcfg))
    assert dora_trained - lora_trained == dora_est.trainable - lora_est.trainable == outputs
    added = dora_est.activations - lora_est.activations
    assert added == FLOAT * n_tokens * outputs
    small = FLOAT * sum(2 * n * 4 + 4 * 4 + 4 * n for _, n, _ in adapted_layers(mcfg))
    assert added <= dora_kept - lora_kept <= added + small


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_a_merged_classifier_keeps_what_the_estimate_counts(variant):
    """The merged layers against the unmerged LoRA layer: the tensors they keep for backward hold
    at least the estimate's merged weights (a floor), and they add the products flops_per_step
    counts for them, but one: the first block's query, key and value read an input that needs no
    gradient, so the unmerged layers there skip the input gradient through A (2·N·e·r each, which
    the model's count, like the frozen product's input gradient there, includes)."""
    lora_cfg, merged_cfg, (lora_flops, lora_kept, _), (merged_flops, merged_kept, _), n_tokens = \
        _against_lora(trainable_layers="lora-merged", lora_variant=variant)
    mcfg = gpt_config("tiny")
    step = dict(tokens=n_tokens, rank=4)
    matmul = sum(adapter_flops(k, n, trainable_layers="lora-merged", lora_variant=variant, weight_trained=w, **step)[0]
                 - adapter_flops(k, n, weight_trained=w, **step)[0] for k, n, w in adapted_layers(mcfg))
    skipped = 3 * 2 * n_tokens * mcfg.emb_dim * 4
    assert merged_flops - lora_flops == matmul + skipped
    added = estimate(merged_cfg).activations - estimate(lora_cfg).activations
    assert 0 < added <= merged_kept - lora_kept + FLOAT * n_tokens * 4 * len(adapted_layers(mcfg))  # LoRA's x·A


@pytest.mark.parametrize("settings", [{"lora_scaling": "rslora"}, {"loraplus_lr_ratio": 16.0},
                                      {"lora_init": "pissa"}], ids=lambda s: next(iter(s)))
def test_rslora_loraplus_and_pissa_change_no_per_step_work(settings):
    """The same products and the same kept tensors as LoRA's step, and the same estimates: these
    variants change values (a scale, a learning rate, a start), not work."""
    from lora_bench.lora import pissa_init

    lora_cfg, lora = _classifier()
    cfg, model = _classifier(**settings)
    if cfg.lora_init == "pissa":
        pissa_init(model)
    tokens = _tokens(cfg)
    assert _step_counts(model, tokens) == _step_counts(lora, tokens)
    assert estimate(cfg) == estimate(lora_cfg)
