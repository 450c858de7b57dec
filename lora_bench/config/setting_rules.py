"""Every rule about settings, checked once (``settings_problems``): each value on its own (type,
finiteness, size, allowed values, bounds; nothing formats a value before it is known to be a small
scalar, and values are shown cut to a few dozen characters), then the rules between settings. A
``Problem`` names the settings it is about by placeholder, and each surface spells them its own way
when it renders the message (``flag_name`` for the command line, ``key_name`` for YAML)."""

from __future__ import annotations

import difflib
import math
import re
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lora_bench.config.declaration import (BASE_DTYPE_DEFAULT, BASE_DTYPE_LAYERS, BASE_DTYPES, BF16_TRUE, BY_FLAG,
                                           DEFAULTS, FROZEN, HF_TRAINABLE_LAYERS, LORA_LAYERS, MAX_INT, SETTINGS,
                                           coerce, key_name)
from lora_bench.model.sizes import MODEL_SIZES, REFERENCE_NAMES, GPTConfig
from lora_bench.safe_yaml import short_repr

# settings of the fused LoRA layer alone: any other trainable-layer choice runs them at their default
KERNEL_LAYER_SETTINGS = ("kernel_plan", "adapter_grads", "adapter_h", "gemm_tiles", "dora_norm_launch")


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
    if s.spec.maximum is not None and value > s.spec.maximum:
        return [problem(name, "{setting}={v} is too large: at most {m}", v=raw(f"{value:,}"),
                        m=raw(f"{s.spec.maximum:,}"))]
    return []


def settings_problems(values: Mapping[str, Any]) -> list[Problem]:
    """Every problem of a full set of settings (``values`` maps every setting name to a value):
    each value on its own, then the rules between settings whose values are valid."""
    out = [p for name in SETTINGS for p in value_problems(name, values[name])]
    bad = {p.setting for p in out}
    return out + rule_problems({k: coerce(k, x) for k, x in values.items() if k not in bad}, bad=bad)


def rule_problems(v: Mapping[str, Any], *, bad: set[str] | frozenset[str] = frozenset()) -> list[Problem]:
    """The problems between settings: ``v`` maps each setting to its coerced value, valid on its
    own, except the settings named in ``bad``, whose rules are skipped. A sweep asks this alone for
    each of its runs, whose values it has checked one by one already."""
    out: list[Problem] = []

    def ok(*names: str) -> bool:
        return not bad or not bad.intersection(names)

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
    for name in KERNEL_LAYER_SETTINGS:
        if ok(name, "trainable_layers") and v[name] != DEFAULTS[name] and v["trainable_layers"] != "lora-kernel":
            out.append(problem(name, "{%s}={p} is only used with {trainable_layers}=lora-kernel" % name,
                               p=raw(v[name])))
    out += variant_problems(v, ok)
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
    if ok("base_dtype") and v["base_dtype"] != BASE_DTYPE_DEFAULT:
        out += base_dtype_problems(v, ok)
    return out


# LoRA's variants and the value of each that leaves the reference's LoRA as it is
VARIANT_DEFAULTS = {"lora_scaling": "alpha", "lora_variant": "lora", "lora_init": "kaiming", "loraplus_lr_ratio": 1.0}


def variant_problems(v: Mapping[str, Any], ok: Callable[..., bool] = lambda *names: True) -> list[Problem]:
    """What LoRA's variants (docs/variants.md) rule out, each with its reason."""
    out = []
    layers = v.get("trainable_layers")  # absent where its own value was refused
    for name, plain in VARIANT_DEFAULTS.items():
        if ok(name, "trainable_layers") and v[name] != plain and layers not in LORA_LAYERS:
            out.append(problem(name, "{setting}={p} is only used with {trainable_layers} one of: {allowed}",
                               p=raw(v[name]), allowed=raw(", ".join(LORA_LAYERS))))
    dora = ok("lora_variant") and v["lora_variant"] == "dora"
    if ok("dora_norm", "lora_variant") and v["dora_norm"] != "exact" and v["lora_variant"] != "dora":
        out.append(problem("dora_norm", "{dora_norm}={p} is only used with {lora_variant}=dora", p=raw(v["dora_norm"])))
    if ok("dora_norm_launch", "lora_variant") and v["dora_norm_launch"] != DEFAULTS["dora_norm_launch"] \
            and v["lora_variant"] != "dora":
        out.append(problem("dora_norm_launch", "{dora_norm_launch}={p} is only used with {lora_variant}=dora",
                           p=raw(v["dora_norm_launch"])))
    if ok("dora_norm_launch", "compile") and v["dora_norm_launch"] == "ahead" and v["compile"]:
        out.append(problem("dora_norm_launch", "{dora_norm_launch}=ahead with {compile} is refused: a compiled layer "
                                               "forms its norm with torch ops, inside what torch.compile traces, and "
                                               "would not use one formed ahead"))
    if dora and ok("base_dtype") and v["base_dtype"] != BASE_DTYPE_DEFAULT:
        out.append(problem("lora_variant", "{lora_variant}=dora with {base_dtype}={b} is refused: DoRA's norm reads "
                                           "the frozen weight itself (its row norms and W @ A), which a stored base "
                                           "holds only in its own format; with DoRA use {base_dtype}=precision",
                           b=raw(v["base_dtype"])))
    if ok("lora_init", "lora_alpha") and v["lora_init"] == "pissa" and v["lora_alpha"] == 0:
        out.append(problem("lora_init", "{lora_init}=pissa with {lora_alpha}=0 is refused: PiSSA moves the weight's "
                                        "top singular part into the update alpha * A @ B, which alpha 0 cannot hold"))
    return out


# base_dtype values the transformers peer stores (with bitsandbytes: QLoRA), and why it takes no other
HF_BASE_DTYPES = ("nf4",)
CPU_BASE_DTYPES = tuple(b for b in BASE_DTYPES if b != "fp8")  # what the CPU runs: all but fp8's float8 GEMMs
HF_BASE_REFUSALS = {
    "bf16": "the peer's bfloat16 base is {precision}=bf16 with {base_dtype}=precision, which casts its frozen "
            "weights to bfloat16 once",
    "int8": "bitsandbytes' int8 linear (LLM.int8) quantizes the activations to int8 as well, with float16 "
            "outlier columns, a different product from the int8 weight-only base the book model runs",
    "fp8": "bitsandbytes stores no float8 weights",
    "nf4-bnb": "the peer's nf4 is bitsandbytes' NF4 already (QLoRA); nf4-bnb runs the book model's layers on "
               "bitsandbytes' kernels",
    "nf4-bnb-nodq": "the peer's nf4 is bitsandbytes' NF4 with double quantization (QLoRA); nf4-bnb-nodq runs the "
                    "book model's layers on bitsandbytes' kernels without it",
}


def base_dtype_problems(v: Mapping[str, Any], ok: Callable[..., bool] = lambda *names: True) -> list[Problem]:
    """What a frozen base stored other than the precision setting says rules out, each with its reason
    (docs/quantized-base.md)."""
    out = []
    t, b = v.get("trainable_layers"), v["base_dtype"]
    allowed = raw(", ".join(BASE_DTYPE_LAYERS))
    if ok("trainable_layers") and t == "lora-merged":
        out.append(problem("base_dtype", "{base_dtype}={b} with {trainable_layers}=lora-merged is refused: merging "
                                         "the full-precision update into the stored weight rounds the sum to {b} "
                                         "again, which changes the frozen base every step; with {base_dtype}={b} choose "
                                         "{trainable_layers} one of: {allowed}", b=raw(b), allowed=allowed))
    elif ok("trainable_layers") and t not in BASE_DTYPE_LAYERS:
        out.append(problem("base_dtype", "{base_dtype}={b} with {trainable_layers}={t} is refused: {t} trains "
                                         "weights of the transformer blocks, which {base_dtype}={b} stores frozen "
                                         "(no gradient, no optimizer state); with {base_dtype}={b} choose "
                                         "{trainable_layers} one of: {allowed}", b=raw(b), t=raw(t),
                           allowed=allowed))
    if ok("implementation") and v["implementation"] == "hf" and b in HF_BASE_REFUSALS:
        out.append(problem("base_dtype", "{base_dtype}={b} with {implementation}=hf is refused: " + HF_BASE_REFUSALS[b]
                           + "; with {implementation}=hf choose {base_dtype} one of: {allowed}", b=raw(b),
                           allowed=raw(", ".join((BASE_DTYPE_DEFAULT, *HF_BASE_DTYPES)))))
    if ok("device") and b == "fp8" and v["device"] == "cpu":
        out.append(problem("base_dtype", "{base_dtype}=fp8 needs a CUDA GPU of compute capability 8.9 or newer "
                                         "(its products are torch._scaled_mm's float8 rowwise GEMMs, which the CPU "
                                         "does not run); {device}=cpu given: on the CPU choose {base_dtype} one "
                                         "of: {allowed}", allowed=raw(", ".join(CPU_BASE_DTYPES))))
    return out


# why the floor (trainable_layers=frozen) is the book model's alone
HF_FROZEN_REFUSAL = ("the floor is measured on lora-bench's own GPT-2, the model every lora variant runs; "
                     "compare the peer with the book model's frozen run")


def hf_problems(v: Mapping[str, Any], ok: Callable[..., bool] = lambda *names: True) -> list[Problem]:
    """What has no peer in the Hugging Face implementation, each with its reason."""
    out = []
    if ok("trainable_layers") and v["trainable_layers"] not in HF_TRAINABLE_LAYERS:
        why = (HF_FROZEN_REFUSAL if v["trainable_layers"] == FROZEN else
               "PEFT trains unmerged adapters with its own layers")
        out.append(problem("trainable_layers", "{trainable_layers}={t} has no Hugging Face peer (" + why + "); with "
                                               "{implementation}=hf choose one of: {allowed}", t=v["trainable_layers"],
                           allowed=raw(", ".join(HF_TRAINABLE_LAYERS))))
    if ok("precision") and v["precision"] == BF16_TRUE:
        out.append(problem("precision", "{precision}=bf16-true with {implementation}=hf is refused: the peer's "
                                        "model is built and cast by its own code, which keeps float32 master "
                                        "weights and computes in bfloat16 only under autocast ({precision}=bf16); "
                                        "bf16-true casts the book model; with {implementation}=hf choose "
                                        "{precision} one of: fp32, tf32, bf16"))
    if ok("disable_causal_mask") and v["disable_causal_mask"]:
        out.append(problem("disable_causal_mask", "{disable_causal_mask} has no Hugging Face peer: transformers' "
                                                  "GPT-2 always applies the causal mask; use {implementation}=book"))
    if ok("lora_variant", "dora_norm") and v["lora_variant"] == "dora" and v["dora_norm"] != "detached":
        out.append(problem("dora_norm", "{lora_variant}=dora with {implementation}=hf needs {dora_norm}=detached: "
                                        "PEFT's DoRA always treats the norm as a constant in backward, as DoRA's "
                                        "paper trains it"))
    if ok("lora_init", "base_dtype") and v["lora_init"] == "pissa" and v["base_dtype"] != BASE_DTYPE_DEFAULT:
        out.append(problem("lora_init", "{lora_init}=pissa with {implementation}=hf and {base_dtype}={b} is refused: "
                                        "PEFT factors the full-precision weight, which bitsandbytes has already "
                                        "stored 4-bit; with {implementation}=hf and PiSSA use {base_dtype}=precision",
                           b=raw(v["base_dtype"])))
    if ok("cuda_graphs") and v["cuda_graphs"]:
        out.append(problem("cuda_graphs", "{cuda_graphs} with {implementation}=hf is refused: transformers' GPT-2 "
                                          "captured and replayed as CUDA graphs does not compute what it computes "
                                          "eagerly (the losses differ); use torch.compile ({compile}) for its "
                                          "fastest mode"))
    return out


def _data_parallel_problems(v: Mapping[str, Any], ok: Callable[..., bool]) -> list[Problem]:
    """What several data-parallel processes rule out: a global batch they cannot share equally, one
    GPU named for all of them."""
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
    # torch.profiler sees no kernel inside a replayed graph: a kernel profile of a graphed step runs its
    # steps one by one instead, each call choosing as a capture would (``train.profiling.profiles_graphs``)
    if ok("profile") and v["profile"] == "line":
        out.append(problem("profile", "{profile}=line cannot see inside a replayed CUDA graph (line_profiler finds "
                                      "no Python lines to time); profile the same settings without {cuda_graphs}, "
                                      "or use {profile}=kernels or torch, which profile the kernels the graphs "
                                      "replay"))
    if ok("profile", "nproc") and v["profile"] not in ("none", "line") and v["nproc"] > 1:
        out.append(problem("profile", "{profile}={p} with {cuda_graphs} profiles one process's graphed step; with "
                                      "{nproc}={n} profile the same settings without {cuda_graphs}",
                           p=raw(v["profile"]), n=raw(v["nproc"])))
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
    length = v.get("context_length") if ok("context_length") else None
    if length and length.isdigit() and int(length) > GPTConfig.context_length:
        out.append(problem("context_length", "{context_length}={c} exceeds the model's context length {n}",
                           c=raw(length), n=raw(GPTConfig.context_length)))
    return out


NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")  # what a mistyped setting looks like: a word


def unknown_key_problems(data: Iterable[Any]) -> list[Problem]:
    """A problem for each key that is not a setting, with the closest setting as a suggestion (a
    flag's spelling, such as lr or lora-rank, suggests its setting). Keys that are not even words
    (a line of a file given here by mistake, such as a password file) are counted, not quoted."""
    out = []
    not_names = 0
    for key in data:
        if key in SETTINGS:
            continue
        if not (isinstance(key, str) and NAME.fullmatch(key)):
            not_names += 1
            continue
        close = [BY_FLAG[key]] if key in BY_FLAG else difflib.get_close_matches(key, list(SETTINGS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        out.append(problem(None, "unknown setting {k}" + hint, k=key))
    if not_names:
        out.append(problem(None, "{n} key(s) that are not setting names (a setting is a word such as lora_rank; "
                                 "they are not shown): is this a file of settings?", n=raw(not_names)))
    return out
