"""The declaration of every run setting: its type and default (a field of ``SettingFields``), and its
``Spec``: allowed values, bounds, help text, extra command-line spellings and help panel. From it
come the ``train`` flags (``--lora-rank``), the keys of settings and sweep files (``lora_rank``)
and the ``cfg_*`` columns of the results tables; ``SETTINGS`` reads it back, one ``Setting`` each."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from lora_bench.kernels.plan_names import (ADAPTER_GRADS, ADAPTER_GRADS_INLINE, ADAPTER_H, ADAPTER_H_GEMM, AUTO,
                                           DORA_NORM_LAUNCHES, GEMM_TILES, GEMM_TILES_PICKED, PLAN_NAMES)
from lora_bench.model.sizes import MAX_BLOCKS, MAX_WIDTH, MODEL_SIZES, REFERENCE_NAMES

# Allowed values: one place. The CLI, sweep validation, reports and docs read these.
MODEL_SIZE_NAMES = (*MODEL_SIZES, *REFERENCE_NAMES)
WEIGHTS = ("pretrained", "random")
WEIGHTS_SOURCES = ("openai", "hf")
IMPLEMENTATIONS = ("book", "hf")
# frozen: the floor of every parameter-efficient step. Nothing inside the transformer blocks trains, but
# the gradient goes back through all of them: only the position embedding (below the first block)
# and the classification head train.
FROZEN = "frozen"
TRAINABLE_LAYERS = (FROZEN, "last_layer", "last_block", "last_two_blocks", "all", "lora", "lora-merged",
                    "lora-kernel")
LORA_LAYERS = ("lora", "lora-merged", "lora-kernel")
# LoRA's variants (docs/variants.md): how the update is scaled (the reference's alpha, or rsLoRA's
# alpha/√r), which layer computes it (LoRA, or DoRA's magnitude and direction, with the norm's
# gradient exact or detached as DoRA's paper trains it), and how the adapters start (the reference's
# random A and zero B, or PiSSA's top singular vectors of the frozen weight).
LORA_SCALINGS = ("alpha", "rslora")
LORA_VARIANTS = ("lora", "dora")
DORA_NORMS = ("exact", "detached")
LORA_INITS = ("kaiming", "pissa")
TOKEN_POSITIONS = ("last", "first", "flexible")
CONTEXT_LENGTHS = ("longest_training_example", "model_context_length")
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
TIMING = ("events", "sync", "off")
PROFILES = ("none", "line", "torch", "kernels")
# bf16-true: every weight and activation in bfloat16, no autocast (litgpt's name); the trainable
# parameters' update runs on float32 master copies (lora_bench.train.master_weights).
BF16_TRUE = "bf16-true"
PRECISIONS = ("fp32", "tf32", "bf16", BF16_TRUE)
ATTENTION = ("book", "sdpa")
OPS = ("book", "fused")
ONE_LAUNCH = "one-launch"
OPTIMIZERS = ("book", "fused", ONE_LAUNCH)
COMPILE_SCOPES = ("model", "blocks")
KERNEL_PLANS = (AUTO, *PLAN_NAMES)
# How the frozen linear weights of the transformer blocks are stored (lora_bench.lora.quantized):
# as the precision setting says (today's behaviour), bfloat16, or quantized by torchao (fp8, int8,
# nf4) or bitsandbytes (nf4-bnb, and nf4-bnb-nodq without double quantization).
BASE_DTYPE_DEFAULT = "precision"
QUANTIZED_BASES = ("fp8", "int8", "nf4", "nf4-bnb", "nf4-bnb-nodq")
BASE_DTYPES = (BASE_DTYPE_DEFAULT, "bf16", *QUANTIZED_BASES)
# What trains on a base stored other than the precision setting says: adapters beside frozen layers
# (lora-kernel falls back to lora's layer), the head alone, or the head and the position embedding.
BASE_DTYPE_LAYERS = ("lora", "lora-kernel", "last_layer", FROZEN)
# What the Hugging Face implementation (transformers' GPT-2, PEFT's LoRA) can run: the trainable-layer
# choices it maps (PEFT trains unmerged adapters with its own layers: no merged or fused-kernel peer).
HF_TRAINABLE_LAYERS = ("all", "last_layer", "last_block", "last_two_blocks", "lora")

# Help panels of ``lora-bench train --help``, in the order they are shown.
MODEL, DATA, LORA, TRAINING, MODES, MEASUREMENT, OUTPUT = (
    "Model", "Data", "LoRA", "Training", "Execution modes", "Measurement", "Output")
PANELS = (MODEL, DATA, LORA, TRAINING, MODES, MEASUREMENT, OUTPUT)

MAX_INT = 2**63 - 1  # what torch and the results tables hold
MAX_BATCH = 1_048_576  # batch_size; MAX_WIDTH bounds emb_dim, n_heads and lora_rank, MAX_BLOCKS n_layers


@dataclass(frozen=True)
class Spec:
    """What a setting allows and how people see it; its type and default are the field's."""

    help: str
    panel: str
    choices: tuple[str, ...] = ()  # allowed values of a text setting
    pattern: str = ""  # a regular expression that also allows a value (cuda:N, an integer)
    pattern_text: str = ""  # how the pattern reads in messages and help ("cuda:N")
    minimum: float | None = None
    exclusive: bool = False  # the minimum itself is not allowed
    maximum: float | None = None  # a size beyond any model lora-bench trains (the memory check comes later)
    aliases: tuple[str, ...] = ()  # further command-line spellings (--rank for --lora-rank)
    path: bool = False  # a file or folder: relative values in a file are resolved against its folder

    def allowed_text(self) -> str:
        return ", ".join((*self.choices, *([self.pattern_text] if self.pattern_text else [])))


def _s(default: Any, help: str, panel: str, **kw: Any) -> Any:
    return field(default=default, metadata={"spec": Spec(help=help, panel=panel, **kw)})



@dataclass(frozen=True)
class SettingFields:
    """Every setting of one training run, declared: type and default (the field), allowed values,
    help and panel (its ``Spec``). Defaults are the reference's (book mode)."""

    # model
    model_size: str = _s("124M", "GPT-2 size, by its short or its reference name; tiny is a 2-block model for "
                         "smoke runs and tests.", MODEL, choices=MODEL_SIZE_NAMES)
    emb_dim: int | None = _s(None, "Embedding width instead of the size's (random weights only).", MODEL, minimum=1,
                             maximum=MAX_WIDTH)
    n_layers: int | None = _s(None, "Number of transformer blocks instead of the size's (random weights only).",
                              MODEL, minimum=1, maximum=MAX_BLOCKS)
    n_heads: int | None = _s(None, "Number of attention heads instead of the size's (random weights only).",
                             MODEL, minimum=1, maximum=MAX_WIDTH)
    weights: str = _s("pretrained", "pretrained: the OpenAI checkpoint; random: the reference's random "
                      "initialisation.", MODEL, choices=WEIGHTS)
    weights_source: str = _s("openai", "Where pretrained weights come from: openai, the OpenAI TensorFlow "
                             "checkpoint; hf, the Hugging Face safetensors (openai-community/gpt2*, through the Hub's "
                             "cache).", MODEL, choices=WEIGHTS_SOURCES)
    weights_dir: str | None = _s(None, "Local folder with the checkpoint files, which skips the download: the "
                                 "OpenAI TF files (checkpoint, hparams.json, model.ckpt.*), or model.safetensors "
                                 "with weights_source=hf.", MODEL, path=True)
    implementation: str = _s("book", "The model's code: book, the reference's GPT-2; hf, transformers' GPT-2 "
                             "(GPT2ForSequenceClassification) with PEFT for LoRA, trained by the same loop (needs "
                             'pip install "lora-bench[peers]").', MODEL, choices=IMPLEMENTATIONS)
    # what is trained and how
    trainable_layers: str = _s("last_block", "Which parameters train: a slice of the model, all of it, or "
                               "LoRA adapters (lora: the reference's layer; lora-merged: one merged weight; "
                               "lora-kernel: the fused kernels). frozen: the floor of a parameter-efficient "
                               "step, no weight of the transformer blocks trains but the gradient goes back "
                               "through all of them (only the position embedding and the head train).",
                               TRAINING, choices=TRAINABLE_LAYERS)
    lora_rank: int = _s(8, "LoRA rank r.", LORA, minimum=1, maximum=MAX_WIDTH, aliases=("--rank",))
    lora_alpha: float = _s(8.0, "LoRA alpha; the update is alpha * A @ B, NOT divided by the rank (as in the "
                           "reference).", LORA, aliases=("--alpha",))
    lora_scaling: str = _s("alpha", "How the update A @ B is scaled: alpha, by lora_alpha (the reference's); rslora: "
                           "by lora_alpha / sqrt(lora_rank) (rank-stabilised LoRA) (docs/variants.md).", LORA,
                           choices=LORA_SCALINGS)
    lora_variant: str = _s("lora", "The adapter: lora, the update added to the frozen layer; dora, DoRA: a trained "
                           "magnitude per output times the direction of W + s * (A @ B)^T, its norm computed from "
                           "W's row norms, W @ A and A's Gram matrix without forming the merged weight (with "
                           "trainable_layers lora: unmerged; lora-merged: the book's merged form; lora-kernel: the fused "
                           "op, then the norm and the scale) "
                           "(docs/variants.md).", LORA, choices=LORA_VARIANTS)
    dora_norm: str = _s("exact", "lora_variant=dora: the norm's gradient. exact: the full gradient; detached: the "
                        "norm treated as a constant in backward, as DoRA's paper trains it (and PEFT's DoRA "
                        "always does).", LORA, choices=DORA_NORMS)
    lora_init: str = _s("kaiming", "How the adapters start. kaiming: A kaiming-uniform, B zeros (the reference's); "
                        "pissa: PiSSA, A and B from the frozen weight's top lora_rank singular vectors and values, "
                        "the weight replaced by its residual, so the model starts as the base model (a one-time "
                        "cost before training, recorded as adapter_init_s) (docs/variants.md).", LORA,
                        choices=LORA_INITS)
    loraplus_lr_ratio: float = _s(1.0, "LoRA+: B's learning rate as a multiple of learning_rate (A and every other "
                                  "trainable parameter keep learning_rate); 1: plain LoRA (docs/variants.md).",
                                  LORA, minimum=0, exclusive=True)
    group_qkv: bool = _s(True, "lora-kernel on a GPU: store each block's query, key and value layers side by "
                         "side, so that where the Triton kernels run (CUDA graphs) the three run as one launch "
                         "forward and two backward (with DoRA, their norms and scales as one too). Same "
                         "parameters and values; eager and compiled steps run "
                         "the layers one by one either way.", LORA)
    kernel_plan: str = _s(AUTO, "lora-kernel: the plan its layers run. auto: chosen per call by lora-bench's rules "
                          "(docs/kernel-design.md); direct, cpp, fused, cublas, torch: that plan wherever it can "
                          "run (recorded in the backend column).", LORA, choices=KERNEL_PLANS)
    adapter_grads: str = _s(ADAPTER_GRADS_INLINE, "lora-kernel: where its adapter gradients run. inline: in each "
                            "layer's backward; deferred: on a side stream joined once per backward pass, off the "
                            "step's critical path (the Python plans fused, cublas and torch; the C++ op's plans and "
                            "torch.compile stay inline; refused with a process group) (docs/kernel-design.md).",
                            LORA, choices=ADAPTER_GRADS)
    adapter_h: str = _s(ADAPTER_H_GEMM, "lora-kernel: where its fused GEMMs form x·A (forward) and g·Bᵀ (backward). "
                        "gemm: in the GEMM's K loop, by every output tile; apart: by torch's GEMM before the "
                        "launch, for launches of 17 adapter columns or more (a block's query, key and value "
                        "side by side, a rank above 16), the K loop then running the frozen product alone; cublas: "
                        "those calls on torch's GEMMs (cuBLAS) altogether, s·H·B added by one batched GEMM over "
                        "the layers side by side (DoRA layers take apart). The fused plan on a GPU, not compiled "
                        "(docs/kernel-design.md).", LORA, choices=ADAPTER_H)
    gemm_tiles: str = _s(GEMM_TILES_PICKED, "lora-kernel: how its fused GEMMs' tiles are chosen. picked: by "
                         "the launch shape's waves on this GPU; timed: on each launch shape's first eager launch, "
                         "the fastest of five candidate tiles (four in fp32) timed on the launch's own operands "
                         "(device events, about a millisecond once per shape; the run's gemm_tiles column records "
                         "each choice). "
                         "The fused plan on a GPU (docs/kernel-design.md).", LORA, choices=GEMM_TILES)
    dora_norm_launch: str = _s(AUTO, "lora-kernel with lora_variant=dora: when each layer's norm is "
                               "launched. inline: in the layer's call, before its scale; ahead: every layer's at "
                               "the start of the model's forward, on a side stream beside the layers' products, each "
                               "call then launching only its scale (the Triton path: a GPU, not compiled); auto: "
                               "ahead where the step is replayed from CUDA graphs on one GPU (one process, not "
                               "compiled), where it measured faster; inline elsewhere (docs/variants.md).", LORA,
                               choices=DORA_NORM_LAUNCHES)
    base_dtype: str = _s(BASE_DTYPE_DEFAULT, "How the frozen linear weights of the transformer blocks are stored. "
                         "precision: as --precision says (fp32, or bf16 with --precision bf16 or bf16-true); bf16: "
                         "bfloat16; "
                         "fp8: float8 rowwise, float8 products (torch._scaled_mm, a CUDA GPU of compute "
                         "capability 8.9 or newer); int8: int8 weight-only, per output channel; nf4: QLoRA's "
                         "4-bit NormalFloat, per block of 64; nf4-bnb: the same NF4 through bitsandbytes' kernels; "
                         "nf4-bnb-nodq: nf4-bnb without double quantization (float32 scales). Adapters and the "
                         "head stay full precision. fp8, int8 and nf4 use torchao, the nf4-bnb ones "
                         "bitsandbytes; with --implementation hf only nf4 is taken, QLoRA through bitsandbytes "
                         "(both: pip install \"lora-bench[quant]\"); docs/quantized-base.md.",
                         LORA, choices=BASE_DTYPES)
    trainable_token_pos: str = _s("last", "Token whose logits are trained and classified (flexible: the "
                                  "last token that is not padding).", TRAINING, choices=TOKEN_POSITIONS,
                                  aliases=("--token-position",))
    average_embeddings: bool = _s(False, "Classify from the mean of the outputs over all positions.", TRAINING)
    context_length: str = _s("longest_training_example", "Padded sequence length: the longest training text, "
                             "the model's context length, or a number of tokens.", DATA,
                             choices=CONTEXT_LENGTHS, pattern=r"[1-9][0-9]{0,8}", pattern_text="a positive integer")
    no_padding: bool = _s(False, "No padding: every text keeps its own length (needs batch size 1).", DATA)
    batch_size: int = _s(8, "Training batch size.", DATA, minimum=1, maximum=MAX_BATCH)
    accumulation_steps: int = _s(1, "Gradient accumulation steps per optimizer update.", TRAINING, minimum=1)
    num_epochs: int = _s(5, "Epochs.", TRAINING, minimum=1, aliases=("--epochs",))
    learning_rate: float = _s(5e-5, "AdamW learning rate.", TRAINING, minimum=0, exclusive=True, aliases=("--lr",))
    weight_decay: float = _s(0.1, "AdamW weight decay.", TRAINING, minimum=0)
    disable_causal_mask: bool = _s(False, "Let every token attend to the tokens after it.", MODEL)
    ignore_index: int = _s(-100, "Target value the cross-entropy ignores.", TRAINING)
    seed: int = _s(123, "Random seed, set before the model, the head and the optimizer are built (the "
                   "reference uses 123).", TRAINING)
    eval_freq: int = _s(50, "Periodic loss evaluation every N global steps (0: never).", TRAINING, minimum=0)
    eval_iter: int = _s(5, "Batches per periodic evaluation.", TRAINING, minimum=1)
    max_steps: int | None = _s(None, "Stop after N training steps (timing runs).", TRAINING, minimum=1)
    skip_final_eval: bool = _s(False, "Skip the final accuracies over the whole train, validation and test "
                               "sets.", TRAINING)
    # execution
    device: str = _s("auto", "Where to run (auto: the first GPU if there is one, else the CPU).", MODES,
                     choices=("auto", "cpu", "cuda"), pattern=r"cuda:[0-9]{1,4}", pattern_text="cuda:N")
    precision: str = _s("fp32", "fp32: the reference; tf32: TF32 matrix products; bf16: autocast to bfloat16 "
                        "with fp32 master weights; bf16-true: every weight and activation in bfloat16, no "
                        "autocast, the loss in fp32, the trainable parameters updated through fp32 master "
                        "copies in the optimizer.", MODES, choices=PRECISIONS)
    attention: str = _s("book", "book: the hand-written attention; sdpa: scaled_dot_product_attention.", MODES,
                        choices=ATTENTION)
    ops: str = _s("book", "book: the hand-written LayerNorm and GELU; fused: torch's built-in ones.", MODES,
                  choices=OPS)
    compile: bool = _s(False, "torch.compile the model.", MODES)
    compile_scope: str = _s("model", "What torch.compile compiles: the whole model, or each transformer block "
                            "(one compiled graph serves every block, so compiling does not take longer for "
                            "deeper models).", MODES, choices=COMPILE_SCOPES)
    cuda_graphs: bool = _s(False, "Capture the training step (and the evaluation forwards) as CUDA graphs and "
                           "replay them.", MODES)
    optimizer: str = _s("book", "book: torch.optim.AdamW's default multi-tensor update; fused: "
                        "AdamW(fused=True), the whole update in a few kernels; one-launch: the fused update's "
                        "arithmetic in one Triton launch over every trainable tensor (under bf16-true also reading "
                        "the bfloat16 gradients and writing the bfloat16 parameters), torch's update on the CPU. A pack's "
                        "points train with their own packed AdamW whichever is chosen.",
                        MODES, choices=OPTIMIZERS)
    nproc: int = _s(1, "Data-parallel processes (DDP, one per GPU, started under torchrun on this host); "
                    "batch_size stays the global batch, split evenly over them.", MODES, minimum=1)
    ddp_bucket_mb: float = _s(25.0, "With nproc > 1: the size of DDP's gradient buckets in MiB (torch's default "
                              "25). Smaller buckets start the all-reduce earlier in backward; one bucket larger "
                              "than all trainable gradients exchanges them once, as backward ends.", MODES,
                              minimum=0, exclusive=True)
    # measurement
    timing: str = _s("events", "Phase timing: events (CUDA events), sync (synchronises after each phase, which "
                     "perturbs the step), off.", MEASUREMENT, choices=TIMING)
    warmup_steps: int = _s(5, "Steps left out of the timing summaries.", MEASUREMENT, minimum=0)
    profile: str = _s("none", "line: line_profiler over the step; torch: a torch.profiler trace and its kernel "
                      "summaries per phase; kernels: the summaries only (no trace file). With cuda_graphs, torch and "
                      "kernels capture no graph: the steps run one by one with the plans a capture chooses, so "
                      "the profile holds the kernels the graphs replay (line is refused). A profiled run's "
                      "step times are perturbed: profile a repeat of its own.", MEASUREMENT,
                      choices=PROFILES)
    # inputs
    data_file: str | None = _s(None, "The raw SMSSpamCollection TSV (default: the copy shipped with lora-bench).",
                               DATA, path=True)

    # -- helpers -----------------------------------------------------------------------------
    @property
    def is_lora(self) -> bool:
        return self.trainable_layers in LORA_LAYERS

    @property
    def quantized_base(self) -> bool:
        return self.base_dtype in QUANTIZED_BASES

    def replace(self, **changes: Any) -> SettingFields:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every setting by name. The values are scalars, so a shallow copy is the whole copy
        (``dataclasses.asdict`` deep-copies each one, 50 times slower: a 100,000-run sweep's ids
        are hashed from these)."""
        return dict(vars(self))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


# -- the declaration, read back ---------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One setting: its name (the YAML key), type, default and spec."""

    name: str
    type: type  # str, int, float or bool
    optional: bool  # None (unset) is allowed
    default: Any
    spec: Spec

    @property
    def flags(self) -> tuple[str, ...]:
        return (flag_name(self.name), *self.spec.aliases)


def key_name(name: str) -> str:
    """A setting as YAML files and ``key=value`` overrides spell it."""
    return name


def flag_name(name: str) -> str:
    """A setting as the ``train`` command line spells it (its first flag)."""
    return "--" + name.replace("_", "-")


_TYPES = {"str": str, "int": int, "float": float, "bool": bool}


def _setting(f: dataclasses.Field) -> Setting:
    base, _, rest = str(f.type).partition(" |")
    return Setting(name=f.name, type=_TYPES[base], optional="None" in rest, default=f.default,
                   spec=f.metadata["spec"])


SETTINGS: dict[str, Setting] = {f.name: _setting(f) for f in fields(SettingFields)}
DEFAULTS: dict[str, Any] = {name: s.default for name, s in SETTINGS.items()}
BY_FLAG = {flag.removeprefix("--"): name for name, s in SETTINGS.items() for flag in s.flags}
PATH_SETTINGS = tuple(name for name, s in SETTINGS.items() if s.spec.path)



# -- values -----------------------------------------------------------------------------------
def coerce(name: str, value: Any) -> Any:
    """The field's own type for a valid value: YAML and JSON give ints where floats are meant
    (alpha: 16) and for a context length (1024)."""
    s = SETTINGS.get(name)
    if s is None or value is None or isinstance(value, bool):
        return value
    if s.type is float and isinstance(value, int):
        return float(value)
    if s.type is str and isinstance(value, int):
        return str(value)
    return value

