"""Run settings, each declared once: a field of ``TrainConfig`` gives its type and default, and its
``Spec`` the allowed values, bounds, help text, extra command-line spellings and help panel. From
this declaration come the ``train`` flags (``--lora-rank``), the keys of settings and sweep files
(``lora_rank``) and the ``cfg_*`` columns of the results tables.

Every rule about settings is checked here, once (``settings_problems``). A ``Problem`` names the
settings it is about by placeholder, and each surface spells them its own way when it renders the
message (``flag_name`` for the command line, ``key_name`` for YAML). Values are checked for their
type, finiteness and size before any message shows them, and shown cut to a few dozen characters."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from lora_bench.errors import ConfigError
from lora_bench.model.gpt2 import MODEL_SIZES, REFERENCE_NAMES, GPTConfig
from lora_bench.safe_yaml import load as load_yaml
from lora_bench.safe_yaml import parse_scalar, short_repr

# Allowed values: one place. The CLI, sweep validation, reports and docs read these.
MODEL_SIZE_NAMES = (*MODEL_SIZES, *REFERENCE_NAMES)
WEIGHTS = ("pretrained", "random")
WEIGHTS_SOURCES = ("openai", "hf")
IMPLEMENTATIONS = ("book", "hf")
TRAINABLE_LAYERS = ("last_layer", "last_block", "last_two_blocks", "all", "lora", "lora-merged", "lora-kernel")
LORA_LAYERS = ("lora", "lora-merged", "lora-kernel")
TOKEN_POSITIONS = ("last", "first", "flexible")
CONTEXT_LENGTHS = ("longest_training_example", "model_context_length")
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
TIMING = ("events", "sync", "off")
PROFILES = ("none", "line", "torch")
PRECISIONS = ("fp32", "tf32", "bf16")
ATTENTION = ("book", "sdpa")
OPS = ("book", "fused")
OPTIMIZERS = ("book", "fused")
COMPILE_SCOPES = ("model", "blocks")
# What the Hugging Face implementation (transformers' GPT-2, PEFT's LoRA) can run: the trainable-layer
# choices it maps (PEFT trains unmerged adapters with its own layers: no merged or fused-kernel peer).
HF_TRAINABLE_LAYERS = ("all", "last_layer", "last_block", "last_two_blocks", "lora")

# Help panels of ``lora-bench train --help``, in the order they are shown.
MODEL, DATA, LORA, TRAINING, MODES, MEASUREMENT, OUTPUT = (
    "Model", "Data", "LoRA", "Training", "Execution modes", "Measurement", "Output")
PANELS = (MODEL, DATA, LORA, TRAINING, MODES, MEASUREMENT, OUTPUT)

MAX_INT = 2**63 - 1  # what torch and the results tables hold


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
    aliases: tuple[str, ...] = ()  # further command-line spellings (--rank for --lora-rank)
    path: bool = False  # a file or folder: relative values in a file are resolved against its folder

    def allowed_text(self) -> str:
        return ", ".join((*self.choices, *([self.pattern_text] if self.pattern_text else [])))


def _s(default: Any, help: str, panel: str, **kw: Any) -> Any:
    return field(default=default, metadata={"spec": Spec(help=help, panel=panel, **kw)})


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of one training run. Defaults are the reference's (book mode)."""

    # model
    model_size: str = _s("124M", "GPT-2 size, by its short or its reference name; tiny is a 2-block model for "
                         "smoke runs and tests.", MODEL, choices=MODEL_SIZE_NAMES)
    emb_dim: int | None = _s(None, "Embedding width instead of the size's (random weights only).", MODEL, minimum=1)
    n_layers: int | None = _s(None, "Number of transformer blocks instead of the size's (random weights only).",
                              MODEL, minimum=1)
    n_heads: int | None = _s(None, "Number of attention heads instead of the size's (random weights only).",
                             MODEL, minimum=1)
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
                               "lora-kernel: the fused kernels).", TRAINING, choices=TRAINABLE_LAYERS)
    lora_rank: int = _s(8, "LoRA rank r.", LORA, minimum=1, aliases=("--rank",))
    lora_alpha: float = _s(8.0, "LoRA alpha; the update is alpha * A @ B, NOT divided by the rank (as in the "
                           "reference).", LORA, aliases=("--alpha",))
    trainable_token_pos: str = _s("last", "Token whose logits are trained and classified (flexible: the "
                                  "last token that is not padding).", TRAINING, choices=TOKEN_POSITIONS,
                                  aliases=("--token-position",))
    average_embeddings: bool = _s(False, "Classify from the mean of the outputs over all positions.", TRAINING)
    context_length: str = _s("longest_training_example", "Padded sequence length: the longest training text, "
                             "the model's context length, or a number of tokens.", DATA,
                             choices=CONTEXT_LENGTHS, pattern=r"[1-9][0-9]{0,8}", pattern_text="a positive integer")
    no_padding: bool = _s(False, "No padding: every text keeps its own length (needs batch size 1).", DATA)
    batch_size: int = _s(8, "Training batch size.", DATA, minimum=1)
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
                        "with fp32 master weights.", MODES, choices=PRECISIONS)
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
                        "AdamW(fused=True), the whole update in a few kernels.", MODES, choices=OPTIMIZERS)
    nproc: int = _s(1, "Data-parallel processes (DDP, one per GPU, started under torchrun on this host); "
                    "batch_size stays the global batch, split evenly over them.", MODES, minimum=1)
    # measurement
    timing: str = _s("events", "Phase timing: events (CUDA events), sync (synchronises after each phase, which "
                     "perturbs the step), off.", MEASUREMENT, choices=TIMING)
    warmup_steps: int = _s(5, "Steps left out of the timing summaries.", MEASUREMENT, minimum=0)
    profile: str = _s("none", "line: line_profiler over the step; torch: a torch.profiler trace.", MEASUREMENT,
                      choices=PROFILES)
    # inputs
    data_file: str | None = _s(None, "The raw SMSSpamCollection TSV (skips the download).", DATA, path=True)

    # -- helpers -----------------------------------------------------------------------------
    @property
    def is_lora(self) -> bool:
        return self.trainable_layers in LORA_LAYERS

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str | None = None,
                     name_of: Callable[[str], str] | None = None) -> TrainConfig:
        """Build from a mapping of settings (a YAML file's, a job's JSON) over the defaults; every
        problem (an unknown key with a close match, a bad value, a bad combination) at once."""
        problems = unknown_key_problems(data)
        values = {**DEFAULTS, **{k: v for k, v in data.items() if k in SETTINGS}}
        problems += settings_problems(values)
        if problems:
            raise ConfigError(render(problems, name_of), source=source)
        return cls(**{k: coerce(k, v) for k, v in values.items()})

    # -- validation --------------------------------------------------------------------------
    def problems(self) -> list[Problem]:
        """Every problem with these settings (empty when valid)."""
        return settings_problems(self.to_dict())

    def validate(self, *, source: str | None = None, name_of: Callable[[str], str] | None = None) -> TrainConfig:
        problems = self.problems()
        if problems:
            raise ConfigError(render(problems, name_of), source=source)
        return self


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


SETTINGS: dict[str, Setting] = {f.name: _setting(f) for f in fields(TrainConfig)}
DEFAULTS: dict[str, Any] = {name: s.default for name, s in SETTINGS.items()}
_BY_FLAG = {flag.removeprefix("--"): name for name, s in SETTINGS.items() for flag in s.flags}
PATH_SETTINGS = tuple(name for name, s in SETTINGS.items() if s.spec.path)


# -- problems ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One problem with settings. ``text`` names settings by placeholder, spelled by the renderer:
    ``{setting}`` for the one it is about, ``{lora_rank}`` for any other; other placeholders are
    values, already shown (``args``)."""

    setting: str | None  # the setting it is mainly about (None: not one setting's, e.g. an unknown key)
    text: str
    args: tuple[tuple[str, str], ...] = ()

    def render(self, name_of: Callable[[str], str] | None = None) -> str:
        name_of = name_of or key_name
        used = {f for _, f, _, _ in string.Formatter().parse(self.text) if f}
        names = {n: name_of(n) for n in used if n in SETTINGS}
        if "setting" in used and self.setting is not None:
            names["setting"] = name_of(self.setting)
        return self.text.format_map({**names, **dict(self.args)})


class _Raw(str):
    """A value shown as it is (a number, a choice already checked)."""


def raw(text: Any) -> _Raw:
    return _Raw(str(text))


def problem(setting: str | None, text: str, **values: Any) -> Problem:
    """A Problem whose ``values`` are shown as reprs cut to 80 characters, or as they are when
    wrapped in ``raw``."""
    return Problem(setting, text, tuple((k, v if isinstance(v, _Raw) else short_repr(v)) for k, v in values.items()))


def render(problems: Iterable[Problem], name_of: Callable[[str], str] | None = None) -> list[str]:
    return [p.render(name_of) for p in problems]


SCALARS = (str, int, float, bool, type(None))
_KIND = {str: "text", int: "a whole number", float: "a number", bool: "true or false"}


def value_problems(name: str, value: Any) -> list[Problem]:
    """The problems of one setting's value on its own: type, finiteness, size, allowed values,
    bounds. Nothing formats the value before it is known to be a small scalar."""
    s = SETTINGS[name]
    t = s.type
    if value is None:
        return [] if s.optional else [problem(name, "{setting} needs a value (null/empty is not allowed)")]
    if not isinstance(value, SCALARS):
        kind = "mapping" if isinstance(value, Mapping) else "list" if isinstance(value, (list, tuple)) else \
            type(value).__name__
        return [problem(name, "{setting} takes one value, not a {kind}", kind=raw(kind))]
    is_int = isinstance(value, int) and not isinstance(value, bool)
    numeric = is_int or (isinstance(value, float) and not isinstance(value, bool))
    ok = {str: isinstance(value, str) or (bool(s.spec.pattern) and is_int), int: is_int, float: numeric,
          bool: isinstance(value, bool)}[t]
    if not ok:
        return [problem(name, "{setting}={v} should be {kind}", v=value, kind=raw(_KIND[t]))]
    if is_int and abs(value) > MAX_INT:
        return [problem(name, "{setting}={v} is too large", v=value)]
    if t is float and not math.isfinite(value):
        return [problem(name, "{setting}={v} must be a finite number", v=raw(value))]
    if t is str and (s.spec.choices or s.spec.pattern):
        text = str(value)
        if text not in s.spec.choices and not (s.spec.pattern and re.fullmatch(s.spec.pattern, text[:64])):
            return [problem(name, "{setting}={v} is not allowed; choose one of: {allowed}", v=value,
                            allowed=raw(s.spec.allowed_text()))]
    if s.spec.minimum is not None and (value <= s.spec.minimum if s.spec.exclusive else value < s.spec.minimum):
        low = s.spec.minimum
        need = ("must be positive" if s.spec.exclusive and low == 0 else
                f"must be above {low:g}" if s.spec.exclusive else
                "must be 0 or more" if low == 0 else f"must be at least {low:g}")
        unset = " (or unset)" if s.optional else ""
        return [problem(name, "{setting}={v} {need}", v=raw(value), need=raw(need + unset))]
    return []


def settings_problems(values: Mapping[str, Any]) -> list[Problem]:
    """Every problem of a full set of settings (``values`` maps every setting name to a value):
    each value on its own, then the rules between settings whose values are valid."""
    out = [p for name in SETTINGS for p in value_problems(name, values[name])]
    bad = {p.setting for p in out}
    v = {k: coerce(k, x) for k, x in values.items() if k not in bad}

    def ok(*names: str) -> bool:
        return not bad.intersection(names)

    if ok("compile_scope", "compile") and v["compile_scope"] != "model" and not v["compile"]:
        out.append(problem("compile_scope", "{compile_scope}={v} needs {compile} (it says what torch.compile "
                                            "compiles)", v=v["compile_scope"]))
    if ok("no_padding", "batch_size") and v["no_padding"] and v["batch_size"] != 1:
        out.append(problem("no_padding", "{no_padding} needs {batch_size}=1 (got {batch_size}={v}): unpadded texts "
                                         "of different lengths cannot be stacked", v=raw(v["batch_size"])))
    out += _model_shape_problems(v, ok)
    if ok("trainable_token_pos", "average_embeddings") and v["trainable_token_pos"] == "flexible" \
            and v["average_embeddings"]:
        out.append(problem("average_embeddings", "{trainable_token_pos}=flexible and {average_embeddings} "
                                                 "exclude each other"))
    if ok("weights_dir", "weights") and v["weights_dir"] and v["weights"] != "pretrained":
        out.append(problem("weights_dir", "{weights_dir} is only used with {weights}=pretrained"))
    if ok("weights_source", "weights") and v["weights_source"] != "openai" and v["weights"] != "pretrained":
        out.append(problem("weights_source", "{weights_source} is only used with {weights}=pretrained"))
    if ok("max_steps", "warmup_steps", "timing") and v["max_steps"] is not None and v["timing"] != "off" \
            and v["max_steps"] <= v["warmup_steps"]:
        out.append(problem("max_steps", "{max_steps}={m} with {warmup_steps}={w}: no step would be measured "
                                        "(lower {warmup_steps}, or use {timing}=off)",
                           m=raw(v["max_steps"]), w=raw(v["warmup_steps"])))
    if ok("cuda_graphs") and v["cuda_graphs"]:
        out += _cuda_graph_problems(v, ok)
    if ok("implementation") and v["implementation"] == "hf":
        out += hf_problems(v, ok)
    if ok("nproc") and v["nproc"] > 1:
        out += _data_parallel_problems(v, ok)
    return out


def hf_problems(v: Mapping[str, Any], ok: Callable[..., bool] = lambda *names: True) -> list[Problem]:
    """What has no peer in the Hugging Face implementation, each with its reason."""
    out = []
    if ok("trainable_layers") and v["trainable_layers"] not in HF_TRAINABLE_LAYERS:
        out.append(problem("trainable_layers", "{trainable_layers}={t} has no Hugging Face peer (PEFT trains "
                                               "unmerged adapters with its own layers); with {implementation}=hf "
                                               "choose one of: {allowed}", t=v["trainable_layers"],
                           allowed=raw(", ".join(HF_TRAINABLE_LAYERS))))
    if ok("disable_causal_mask") and v["disable_causal_mask"]:
        out.append(problem("disable_causal_mask", "{disable_causal_mask} has no Hugging Face peer: transformers' "
                                                  "GPT-2 always applies the causal mask; use {implementation}=book"))
    if ok("cuda_graphs") and v["cuda_graphs"]:
        out.append(problem("cuda_graphs", "{cuda_graphs} with {implementation}=hf is refused: transformers' GPT-2 "
                                          "captured and replayed as CUDA graphs does not compute what it computes "
                                          "eagerly (the losses differ); use torch.compile ({compile}) for its "
                                          "fastest mode"))
    return out


def _data_parallel_problems(v: Mapping[str, Any], ok: Callable[..., bool]) -> list[Problem]:
    """What several data-parallel processes rule out: a global batch they cannot share equally, one
    GPU named for all of them, a captured step (DDP's all-reduces are not captured)."""
    out = []
    n = v["nproc"]
    if ok("batch_size") and v["batch_size"] % n:
        fits = ", ".join(str(k) for k in range(1, v["batch_size"] + 1) if v["batch_size"] % k == 0)
        out.append(problem("batch_size", "{batch_size} {b} does not split over {n} processes ({nproc}={n}): the "
                                         "batch size is the global batch and each process takes an equal slice; "
                                         "use a batch size divisible by {n}, or {nproc} one of {fits}",
                           b=raw(v["batch_size"]), n=raw(n), fits=raw(fits)))
    if ok("device") and v["device"].startswith("cuda:"):
        out.append(problem("device", "{device}={d} with {nproc}={n}: each process uses the GPU of its rank; use "
                                     "{device}=cuda or auto", d=v["device"], n=raw(n)))
    if ok("cuda_graphs") and v["cuda_graphs"]:
        out.append(problem("nproc", "{nproc}={n} cannot be combined with {cuda_graphs} (DDP's all-reduces are not "
                                    "captured); drop one of them", n=raw(n)))
    return out


def _cuda_graph_problems(v: Mapping[str, Any], ok: Callable[..., bool]) -> list[Problem]:
    """What a captured and replayed training step rules out (whether a CUDA device is there to
    capture on is the machine's question: ``lora_bench.train.preflight``)."""
    out = []
    if ok("device") and v["device"] == "cpu":
        out.append(problem("cuda_graphs", "{cuda_graphs} needs a CUDA device ({device}=cpu given)"))
    if ok("no_padding") and v["no_padding"]:
        out.append(problem("cuda_graphs", "{cuda_graphs} needs static shapes; {no_padding} gives every batch "
                                          "its own length"))
    if ok("accumulation_steps") and v["accumulation_steps"] > 1:
        out.append(problem("cuda_graphs", "{cuda_graphs} needs {accumulation_steps}=1 (got {n}): a replayed "
                                          "backward overwrites the gradients instead of accumulating them",
                           n=raw(v["accumulation_steps"])))
    if ok("profile") and v["profile"] != "none":
        out.append(problem("profile", "{profile}={p} cannot see inside a replayed CUDA graph (line_profiler finds "
                                      "no Python lines, torch.profiler no kernels); profile the same settings "
                                      "without {cuda_graphs}", p=raw(v["profile"])))
    return out


def _model_shape_problems(v: Mapping[str, Any], ok: Callable[..., bool]) -> list[Problem]:
    """What the model's shape rules out: a size without a checkpoint, a width the heads don't
    divide, a context length the model doesn't have."""
    out = []
    overrides = [n for n in ("emb_dim", "n_layers", "n_heads") if ok(n) and v[n] is not None]
    if ok("weights") and v["weights"] == "pretrained":
        out += [problem(n, "{setting}={v} needs {weights}=random (a checkpoint fixes the model's shape)",
                        v=raw(v[n])) for n in overrides]
    if not ok("model_size", "emb_dim", "n_heads"):
        return out
    size = REFERENCE_NAMES.get(v["model_size"], v["model_size"])
    if size == "tiny" and ok("weights") and v["weights"] == "pretrained":
        out.append(problem("model_size", "{model_size}={s} has no pretrained checkpoint; use {weights}=random",
                           s=raw(v["model_size"])))
    width, _, heads = MODEL_SIZES[size]
    width, heads = v["emb_dim"] or width, v["n_heads"] or heads
    if width % heads:
        what = "{emb_dim}={w}" if v["emb_dim"] else "the width {w} of {size}"
        out.append(problem("n_heads", what + " is not divisible by {n_heads}={h}", w=raw(width), size=raw(size),
                           h=raw(heads)))
    ctx = v.get("context_length") if ok("context_length") else None
    if ctx and ctx.isdigit() and int(ctx) > GPTConfig.context_length:
        out.append(problem("context_length", "{context_length}={c} exceeds the model's context length {n}",
                           c=raw(ctx), n=raw(GPTConfig.context_length)))
    return out


def unknown_key_problems(data: Iterable[Any]) -> list[Problem]:
    """A problem for each key that is not a setting, with the closest setting as a suggestion (a
    flag's spelling, such as lr or lora-rank, suggests its setting)."""
    out = []
    for key in data:
        if key in SETTINGS:
            continue
        text = str(key)[:100]
        close = [_BY_FLAG[text]] if text in _BY_FLAG else difflib.get_close_matches(text, list(SETTINGS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        out.append(problem(None, "unknown setting {k}" + hint, k=key))
    return out


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


def parse_overrides(items: Iterable[str]) -> tuple[dict[str, Any], list[Problem]]:
    """``key=value`` command-line overrides: the values read as YAML reads a value (``4``, ``1e-5``,
    ``true``, ``null``); every malformed item or unknown key is a problem."""
    out: dict[str, Any] = {}
    problems: list[Problem] = []
    for item in items:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            problems.append(problem(None, "{item}: write overrides as key=value, e.g. lora_rank=16", item=item))
            continue
        if key not in SETTINGS:
            problems += unknown_key_problems([key])
            continue
        if key in out:
            problems.append(problem(key, "{setting} is overridden twice"))
            continue
        try:
            out[key] = parse_scalar(text)
        except ConfigError as e:
            why = e.problems[0].splitlines()[0].removesuffix(":")
            problems.append(problem(key, "{setting}={v}: {why}", v=text, why=raw(why)))
    return out, problems


def resolve_paths(settings: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """Path settings of a file, relative to the file's folder (``~`` expanded)."""
    out = dict(settings)
    for key in PATH_SETTINGS:
        value = out.get(key)
        if isinstance(value, str) and value:
            path = Path(value).expanduser()
            out[key] = str(path if path.is_absolute() else (folder / path).resolve())
    return out


def read_settings_file(path: Path) -> dict[str, Any]:
    """The settings of a YAML file holding one mapping of settings (the keys of a sweep file's
    ``base``), path settings resolved against the file's folder; ConfigError (naming the file)
    lists every unknown key and bad value."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"no such file{' (a folder)' if path.is_dir() else ''}"], source=str(path))
    data = load_yaml(path.read_bytes(), source=str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"a settings file is one mapping of settings (such as lora_rank: 16), not "
                           f"{short_repr(data)}"], source=str(path))
    if isinstance(data.get("base"), dict) and not set(data) & set(SETTINGS):
        raise ConfigError(["this is a sweep file (it has base:); run it with `lora-bench sweep`, or give a file "
                           "of settings such as the contents of its base"], source=str(path))
    problems = unknown_key_problems(data)
    problems += [p for k, v in data.items() if k in SETTINGS for p in value_problems(k, v)]
    if problems:
        raise ConfigError(render(problems), source=str(path))
    return resolve_paths(data, path.parent)
