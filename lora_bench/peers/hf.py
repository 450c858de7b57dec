"""The classifier built with Hugging Face transformers (``GPT2ForSequenceClassification``) and, for
LoRA, PEFT: a peer of the book model that the same harness trains (loop, loss, optimizer, timer).
Its shape, weights, head and token position map to the book model's, its LoRA to the book's
function, and ``base_dtype=nf4`` loads the body through bitsandbytes (QLoRA); what does not map is
refused up front. What maps, and how: docs/peers.md.
"""

from __future__ import annotations

import math
import sys
import time
import warnings

import torch
import torch.nn as nn

from lora_bench.classifier.book import NUM_CLASSES, load_base_model, model_config
from lora_bench.config import HF_TRAINABLE_LAYERS, TrainConfig, hf_problems, render
from lora_bench.data.tokenizer import PAD_TOKEN_ID
from lora_bench.errors import ConfigError, UsageError
from lora_bench.lora.quantized import NF4_BLOCK, bitsandbytes, cpu_row_problem, quant_state_bytes
from lora_bench.model.gpt2 import GPTConfig, resolve_model_size
from lora_bench.model.hf_checkpoint import ensure_hf_checkpoint, hf_state_from_gpt, load_hf_state, read_hf_state
from lora_bench.optional import installed_version, require

ATTN_IMPLEMENTATIONS = {"book": "eager", "sdpa": "sdpa"}  # the harness's attention -> transformers'
ACTIVATIONS = {"book": "gelu_new", "fused": "gelu_pytorch_tanh"}  # the harness's ops -> GPT2Config's
LORA_TARGETS = ("c_attn", "c_proj", "c_fc")  # every Conv1D of a block (c_proj: attention and MLP)
LORA_INITS = ("peft", "book", "pissa")  # PEFT's own A, the book's A (B zeros either way), or PiSSA's SVD
PEER_PACKAGES = ("transformers", "peft", "safetensors", "huggingface_hub")
QLORA_FORMATS = ("nf4",)  # base_dtype values the peer stores with bitsandbytes
SCORE = "score"  # the classification head's module name, never quantized
ADAPTER = "default"  # PEFT's adapter name


def unsupported_settings(cfg: TrainConfig) -> list[str]:
    """What in ``cfg`` has no transformers/PEFT peer, one message per setting (the rules are
    ``config.hf_problems``'s); empty when everything maps."""
    return render(hf_problems(cfg.to_dict()))


def gpt2_config(mcfg: GPTConfig, *, attn_implementation: str = "sdpa", activation: str = "gelu_new"):
    """transformers' GPT2Config for the book model's shape, no dropout, no cache, 2 labels."""
    transformers = require("transformers", purpose="implementation=hf")
    in_vocab = PAD_TOKEN_ID if PAD_TOKEN_ID < mcfg.vocab_size else None  # <|endoftext|>, when it exists
    return transformers.GPT2Config(
        vocab_size=mcfg.vocab_size, n_positions=mcfg.context_length, n_embd=mcfg.emb_dim,
        n_layer=mcfg.n_layers, n_head=mcfg.n_heads, n_inner=None, activation_function=activation,
        resid_pdrop=mcfg.drop_rate, embd_pdrop=mcfg.drop_rate, attn_pdrop=mcfg.drop_rate,
        layer_norm_epsilon=1e-5, num_labels=NUM_CLASSES, bos_token_id=in_vocab, eos_token_id=in_vocab,
        pad_token_id=None, use_cache=False, attn_implementation=attn_implementation)


def build_hf_model(mcfg: GPTConfig, state: dict[str, torch.Tensor], *, attn_implementation: str = "sdpa",
                   activation: str = "gelu_new", base_dtype: str = "precision", device: torch.device | str = "cpu",
                   compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """``GPT2ForSequenceClassification`` with ``state`` (GPT2Model keys) as its body, built on the meta
    device so no weight is initialised twice. Its ``score`` is still transformers' (on meta):
    ``make_hf_trainable`` replaces it with the book's head. With ``base_dtype=nf4`` the body is
    loaded 4-bit by transformers and bitsandbytes on ``device`` instead (``load_qlora_model``)."""
    transformers = require("transformers", purpose="implementation=hf")
    config = gpt2_config(mcfg, attn_implementation=attn_implementation, activation=activation)
    if base_dtype in QLORA_FORMATS:
        return load_qlora_model(config, state, device=torch.device(device), compute_dtype=compute_dtype)
    with torch.device("meta"):
        model = transformers.GPT2ForSequenceClassification(config)
    load_hf_state(model.transformer, state)
    return model


def qlora_config(compute_dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for QLoRA as its paper runs it: NF4 codes, blocks of 64,
    double quantization of the absmaxes, products in ``compute_dtype``; the head left alone."""
    transformers = require("transformers", purpose="implementation=hf")
    bitsandbytes("base_dtype=nf4 with implementation=hf")
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype,
                                           bnb_4bit_quant_storage=torch.uint8, llm_int8_skip_modules=[SCORE])


def load_qlora_model(config, state: dict[str, torch.Tensor], *, device: torch.device,
                     compute_dtype: torch.dtype) -> nn.Module:
    """``GPT2ForSequenceClassification.from_pretrained`` of the body ``state`` with ``qlora_config``:
    transformers replaces each Conv1D by bitsandbytes' Linear4bit (weight transposed before it is
    quantized) and quantizes on ``device``; embeddings, norms and biases stay float32. Its ``score``
    is transformers' (missing from ``state``, so freshly initialised): ``make_hf_trainable`` replaces it."""
    transformers = require("transformers", purpose="implementation=hf")
    why = cpu_row_problem(config.n_embd) if device.type == "cpu" else None
    if why:
        raise UsageError(f"base_dtype=nf4 with implementation=hf on the CPU is refused: {why}; use a CUDA device "
                         f"or an emb_dim that is a multiple of {NF4_BLOCK}")
    where = "cpu" if device.type == "cpu" else (device.index if device.index is not None
                                                else torch.cuda.current_device())
    logging_ = transformers.utils.logging
    verbosity, bars = logging_.get_verbosity(), logging_.is_progress_bar_enabled()
    logging_.set_verbosity_error()  # the report of the head's weights, missing on purpose
    logging_.disable_progress_bar()
    try:
        model = transformers.GPT2ForSequenceClassification.from_pretrained(
            None, config=config, state_dict={f"transformer.{k}": v for k, v in state.items()},
            quantization_config=qlora_config(compute_dtype), device_map={"": where}, dtype=torch.float32)
    finally:
        logging_.set_verbosity(verbosity)
        if bars:
            logging_.enable_progress_bar()
    keep_training_layout(model)
    return model


def linear4bit_modules(model: nn.Module) -> list[nn.Module]:
    """bitsandbytes' 4-bit linear layers of ``model`` (PEFT's wrappers hold them as ``base_layer``)."""
    if "bitsandbytes" not in sys.modules:
        return []
    linear4bit = sys.modules["bitsandbytes"].nn.Linear4bit
    return [m for m in model.modules() if isinstance(m, linear4bit)]


def unpacked_params(model: nn.Module) -> int:
    """How many more weights ``model``'s 4-bit layers stand for than their packed parameters count
    (two codes a byte): add it to ``numel`` counts to get the model's parameter count."""
    return sum(m.weight.quant_state.shape.numel() - m.weight.numel() for m in linear4bit_modules(model))


def keep_training_layout(model: nn.Module) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight for inference the first time
    an eval-mode forward runs without gradients, and its training forward fails on the repacked
    weight afterwards; a run evaluates between steps, so the peer keeps the training layout. (CUDA
    has no such repacking.)"""
    for module in linear4bit_modules(model):
        module.support_avx512bf16_for_cpu = False


def make_hf_trainable(model: nn.Module, *, trainable_layers: str, seed: int, lora_rank: int = 8,
                      lora_alpha: float = 8.0, lora_init: str = "peft", lora_scaling: str = "alpha",
                      lora_variant: str = "lora") -> nn.Module:
    """Freeze, reseed, put the book's head in place of ``score``, and unfreeze the chosen layers (the
    book's ``make_trainable``, in its RNG order); for ``lora`` returns the PEFT model around ``model``,
    with rsLoRA's scale, DoRA or PiSSA's initialisation where asked (``lora_config``)."""
    if trainable_layers not in HF_TRAINABLE_LAYERS:
        raise ConfigError([f"trainable_layers={trainable_layers!r} has no Hugging Face peer; choose one of: "
                           + ", ".join(HF_TRAINABLE_LAYERS)])
    if lora_init not in LORA_INITS:
        raise ConfigError([f"lora_init={lora_init!r} is not allowed; choose one of: " + ", ".join(LORA_INITS)])
    model.requires_grad_(False)
    torch.manual_seed(seed)
    model.score = nn.Linear(model.config.n_embd, NUM_CLASSES)
    body = model.transformer
    if trainable_layers in ("last_block", "last_two_blocks"):
        blocks = list(body.h)[-1 if trainable_layers == "last_block" else -2:]
        for module in blocks + [body.ln_f]:
            module.requires_grad_(True)
    elif trainable_layers == "all":
        model.requires_grad_(True)
    elif trainable_layers == "lora":
        return _with_lora(model, rank=lora_rank, alpha=lora_alpha, init=lora_init, scaling=lora_scaling,
                          variant=lora_variant)
    return model  # last_layer: only the new head, trainable on creation


def lora_config(*, rank: int, alpha: float, conv1d: bool = True, scaling: str = "alpha", variant: str = "lora"):
    """PEFT's LoraConfig computing the book's ``linear(x) + alpha * (x @ A @ B)`` on every Conv1D
    (``conv1d``: weights stored in × out, PEFT's fan_in_fan_out) or on the Linear4bit layers that
    replace them in the 4-bit body (out × in). PEFT scales by ``lora_alpha / r``, so it is given
    alpha·r; with ``scaling=rslora`` its ``use_rslora`` scales by ``lora_alpha / √r``, so it is given
    alpha itself: alpha/√r either way, as the book model's rsLoRA. ``variant=dora``: PEFT's
    ``use_dora`` (its norm always detached). PiSSA is applied after (``_with_lora``)."""
    peft = require("peft", purpose="trainable_layers=lora with implementation=hf")
    rslora = scaling == "rslora"
    return peft.LoraConfig(r=rank, lora_alpha=alpha if rslora else alpha * rank, target_modules=list(LORA_TARGETS),
                           lora_dropout=0.0, bias="none", use_rslora=rslora, use_dora=variant == "dora",
                           init_lora_weights=True, fan_in_fan_out=conv1d,
                           modules_to_save=[SCORE])


def _with_lora(model: nn.Module, *, rank: int, alpha: float, init: str, scaling: str = "alpha",
               variant: str = "lora") -> nn.Module:
    # A 4-bit body gets no peft.prepare_model_for_kbit_training: of what it does, casting float16 and
    # bfloat16 parameters to float32 finds none here (the body loads in float32, and the harness's
    # casts come after), freezing the base is make_hf_trainable's, and its gradient checkpointing
    # (on by default) would recompute every block's activations in backward, a cost neither the book
    # model's runs nor the other peer runs pay, so the rows would no longer compare like with like.
    peft = require("peft", purpose="trainable_layers=lora with implementation=hf")
    conv1d = not getattr(model, "is_loaded_in_4bit", False)
    # PiSSA: the adapters made as LoRA's, then PEFT's own pissa_init on each layer, timed alone (its
    # one-time cost: the SVDs, on the host where the peer is built); with DoRA the magnitude taken
    # before is the same, W's norms (the residual plus the update is W)
    config = lora_config(rank=rank, alpha=alpha, conv1d=conv1d, scaling=scaling, variant=variant)
    with warnings.catch_warnings():  # PEFT asks transformers a question transformers renamed; no action here
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = peft.get_peft_model(model, config)
    if init == "pissa":
        start = time.perf_counter()
        for module in peft_model.modules():
            if isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and ADAPTER in module.lora_A:
                module.pissa_init(ADAPTER, "pissa")
        peft_model.adapter_init_s = time.perf_counter() - start
    if init == "book":
        with torch.no_grad():
            for a in lora_A_weights(peft_model):  # (r, in), registration order
                book_a = torch.empty(a.shape[1], a.shape[0], dtype=a.dtype)  # the book's A is in×r
                nn.init.kaiming_uniform_(book_a, a=math.sqrt(5))
                a.copy_(book_a.t())
    return peft_model


def lora_A_weights(model: nn.Module) -> list[torch.Tensor]:
    """PEFT's lora_A weights (r × in) in module registration order."""
    out = []
    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, nn.ModuleDict) and ADAPTER in lora_a:
            out.append(lora_a[ADAPTER].weight)
    return out


class HFClassifier(nn.Module):
    """transformers' GPT-2 behind the book model's call: (B, T) token ids -> (B, T, 2) logits at every
    position, so the harness's loss and accuracy pick the token exactly as for the book model."""

    implementation = "hf"

    def __init__(self, model: nn.Module, *, mcfg: GPTConfig, peft: bool = False):
        super().__init__()
        self.model = model  # GPT2ForSequenceClassification, or the PEFT model around it
        self.cfg = mcfg  # the book's description of the shape (FLOP counts, context length)
        self.is_peft = peft

    def classifier(self) -> nn.Module:
        """The GPT2ForSequenceClassification (PEFT injects its layers into it in place)."""
        return self.model.get_base_model() if self.is_peft else self.model

    @property
    def trf_blocks(self) -> nn.ModuleList:
        """The transformer blocks, under the book model's name (``compile_scope=blocks`` compiles each)."""
        return self.classifier().transformer.h

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        core = self.classifier()
        hidden = core.transformer(input_ids=input_ids, use_cache=False).last_hidden_state  # (B, T, E)
        return core.score(hidden)  # (B, T, classes)


def base_state(cfg, mcfg: GPTConfig, *, cache_dir, progress: bool = True) -> dict[str, torch.Tensor]:
    """The body's weights in GPT2Model's layout: the book's seeded random model or OpenAI checkpoint
    (converted from the book model), or the Hugging Face safetensors (read as they are)."""
    if cfg.weights == "pretrained" and cfg.weights_source == "hf":
        folder = ensure_hf_checkpoint(resolve_model_size(cfg.model_size), weights_dir=cfg.weights_dir,
                                      progress=progress)
        return read_hf_state(folder, shape=mcfg)
    return hf_state_from_gpt(load_base_model(cfg, mcfg, cache_dir=cache_dir, progress=progress))


def build_hf_classifier(cfg, *, cache_dir, progress: bool = True, lora_init: str = "peft",
                        device: torch.device | str = "cpu") -> HFClassifier:
    """The transformers/PEFT classifier for ``cfg`` on the CPU (move it to the device after), its body
    4-bit on ``device`` for ``base_dtype=nf4``; what does not map is refused up front with every
    reason (ConfigError)."""
    problems = unsupported_settings(cfg)
    if problems:
        raise ConfigError(problems)
    require("transformers", purpose="implementation=hf")
    if cfg.trainable_layers == "lora":
        require("peft", purpose="trainable_layers=lora with implementation=hf")
    mcfg = model_config(cfg)
    state = base_state(cfg, mcfg, cache_dir=cache_dir, progress=progress)
    compute = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    model = build_hf_model(mcfg, state, attn_implementation=ATTN_IMPLEMENTATIONS[cfg.attention],
                           activation=ACTIVATIONS[cfg.ops], base_dtype=cfg.base_dtype, device=device,
                           compute_dtype=compute)
    trained = make_hf_trainable(model, trainable_layers=cfg.trainable_layers, seed=cfg.seed,
                                lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                lora_init="pissa" if cfg.lora_init == "pissa" else lora_init,
                                lora_scaling=cfg.lora_scaling, lora_variant=cfg.lora_variant)
    out = HFClassifier(trained, mcfg=mcfg, peft=trained is not model)
    out.adapter_init_s = getattr(trained, "adapter_init_s", None)
    return out


def cast_frozen_hf(model: nn.Module, dtype: torch.dtype) -> int:
    """``classifier.cast_frozen`` for the transformers model: frozen weights and biases of the linear
    layers (transformers' Conv1D and nn.Linear) stored in ``dtype`` once; trainable parameters,
    embeddings, norms and 4-bit weights (bitsandbytes' packed codes) stay as they are. Returns how
    many tensors were cast."""
    conv1d = require("transformers.pytorch_utils", purpose="implementation=hf").Conv1D
    n = 0
    for module in model.modules():
        if isinstance(module, (nn.Linear, conv1d)):
            for p in module.parameters(recurse=False):
                if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
                    n += 1
    return n


def hf_base_weight_bytes(model: nn.Module) -> int | None:
    """Bytes the frozen weights of the blocks' linear layers hold as stored: a Conv1D's weight at its
    dtype, a Linear4bit's packed codes with its quant state; adapters, biases, embeddings and norms
    left out (``quantized.base_weight_bytes`` for the book model)."""
    blocks = getattr(model, "trf_blocks", None)
    if blocks is None:
        return None
    conv1d = require("transformers.pytorch_utils", purpose="implementation=hf").Conv1D
    four_bit = set(map(id, linear4bit_modules(blocks)))
    total = 0
    for module in blocks.modules():
        if id(module) in four_bit:
            w = module.weight
            total += w.numel() * w.element_size() + quant_state_bytes(w.quant_state)
        elif isinstance(module, conv1d):
            total += module.weight.numel() * module.weight.element_size()
    return total


def qlora_versions(base_dtype: str) -> dict[str, str | None]:
    """The quantization library's version column for a peer run whose body bitsandbytes stores."""
    return {"bitsandbytes_version": installed_version("bitsandbytes")} if base_dtype in QLORA_FORMATS else {}


def package_versions() -> dict[str, str | None]:
    """Installed versions of the peer packages (None when absent), for a run's provenance."""
    return {name: installed_version(name) for name in PEER_PACKAGES}
