"""Run settings: one frozen dataclass that is the single source for CLI flags, YAML keys and the
settings columns of the results tables. ``validate`` collects every problem and raises once."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from typing import Any

from lora_bench.errors import ConfigError
from lora_bench.model.gpt2 import gpt_config, resolve_model_size

# Allowed values: one place. The CLI, sweep validation and docs read these.
WEIGHTS = ("pretrained", "random")
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


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of one training run. Defaults are the reference's (book mode)."""

    # model
    model_size: str = _f("124M", "GPT-2 size: 124M, 355M, 774M, 1558M (or 'gpt2-small (124M)' ...), or tiny")
    emb_dim: int | None = _f(None, "override embedding width (random weights only)")
    n_layers: int | None = _f(None, "override number of transformer blocks (random weights only)")
    n_heads: int | None = _f(None, "override number of attention heads (random weights only)")
    weights: str = _f("pretrained", "pretrained (OpenAI checkpoint) or random")
    weights_dir: str | None = _f(None, "local checkpoint folder (OpenAI TF files); skips the download")
    # what is trained and how
    trainable_layers: str = _f("last_block", "which parameters train: " + ", ".join(TRAINABLE_LAYERS))
    lora_rank: int = _f(8, "LoRA rank r")
    lora_alpha: float = _f(8.0, "LoRA alpha (NOT divided by the rank, as in the reference)")
    trainable_token_pos: str = _f("last", "token whose logits are trained: last, first, flexible")
    average_embeddings: bool = _f(False, "average the output over all positions instead")
    context_length: str = _f("longest_training_example", "longest_training_example, model_context_length, or an int")
    no_padding: bool = _f(False, "no padding (requires batch size 1)")
    batch_size: int = _f(8, "training batch size")
    accumulation_steps: int = _f(1, "gradient accumulation steps")
    num_epochs: int = _f(5, "epochs")
    learning_rate: float = _f(5e-5, "AdamW learning rate")
    weight_decay: float = _f(0.1, "AdamW weight decay")
    disable_causal_mask: bool = _f(False, "disable the causal attention mask")
    ignore_index: int = _f(-100, "cross-entropy ignore_index")
    seed: int = _f(123, "the reference's seed (used before model build, head, and optimizer)")
    eval_freq: int = _f(50, "periodic loss evaluation every N global steps (0 = never)")
    eval_iter: int = _f(5, "batches per periodic evaluation")
    max_steps: int | None = _f(None, "stop after N training steps (timing runs)")
    skip_final_eval: bool = _f(False, "skip the final full-loader accuracies")
    # execution
    device: str = _f("auto", "auto, cpu, cuda, or cuda:N")
    precision: str = _f("fp32", "fp32 (book), tf32, or bf16 (autocast, fp32 master weights)")
    attention: str = _f("book", "book (hand-written) or sdpa (scaled_dot_product_attention)")
    ops: str = _f("book", "book (hand-written LayerNorm/GELU) or fused (torch built-ins)")
    compile: bool = _f(False, "torch.compile the model")
    compile_scope: str = _f("model", "with compile: the whole model, or each transformer block (blocks: one "
                            "compiled graph serves every block, so the compile time does not grow with depth)")
    cuda_graphs: bool = _f(False, "capture and replay the training step (and evaluation forwards) as CUDA graphs")
    optimizer: str = _f("book", "book (torch.optim.AdamW's default multi-tensor update) or fused "
                        "(AdamW(fused=True): the whole update in a few kernels)")
    # measurement
    timing: str = _f("events", "events (CUDA events, default), sync (perturbing), off")
    warmup_steps: int = _f(5, "steps excluded from the timing summaries")
    profile: str = _f("none", "none, line (line_profiler), torch (torch.profiler trace)")
    # inputs
    data_file: str | None = _f(None, "raw SMSSpamCollection TSV (skips the download)")

    # -- helpers -----------------------------------------------------------------------------
    @property
    def is_lora(self) -> bool:
        return self.trainable_layers in LORA_LAYERS

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_mapping(cls, data: dict[str, Any], *, source: str | None = None) -> "TrainConfig":
        """Build from a YAML/dict mapping; unknown keys are reported with a close-match suggestion."""
        problems = unknown_key_problems(data) + type_problems(
            {k: v for k, v in data.items() if k in _FIELD_TYPES})
        if problems:
            raise ConfigError(problems, source=source)
        cfg = cls(**{k: _coerce(k, v) for k, v in data.items()})
        cfg.validate(source=source)
        return cfg

    # -- validation --------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every problem with these settings (empty when valid)."""
        p: list[str] = []

        def choice(name: str, allowed: tuple[str, ...]) -> None:
            val = getattr(self, name)
            if val not in allowed:
                p.append(f"{name}={val!r} is not allowed; choose one of: {', '.join(allowed)}")

        try:
            resolve_model_size(self.model_size)
        except ValueError as e:
            p.append(str(e))
        choice("weights", WEIGHTS)
        choice("trainable_layers", TRAINABLE_LAYERS)
        choice("trainable_token_pos", TOKEN_POSITIONS)
        choice("timing", TIMING)
        choice("profile", PROFILES)
        choice("precision", PRECISIONS)
        choice("attention", ATTENTION)
        choice("ops", OPS)
        choice("optimizer", OPTIMIZERS)
        choice("compile_scope", COMPILE_SCOPES)
        if self.compile_scope in COMPILE_SCOPES and self.compile_scope != "model" and not self.compile:
            p.append(f"compile_scope={self.compile_scope!r} needs compile (it says what torch.compile compiles)")
        if not _valid_device(self.device):
            p.append(f"device={self.device!r} is not allowed; choose auto, cpu, cuda or cuda:N")
        if self.context_length not in CONTEXT_LENGTHS:
            try:
                if int(self.context_length) < 1:
                    raise ValueError
            except (TypeError, ValueError):
                p.append(
                    f"context_length={self.context_length!r} is not allowed; use "
                    "longest_training_example, model_context_length, or a positive integer"
                )
        for name in ("batch_size", "accumulation_steps", "num_epochs", "eval_iter", "lora_rank"):
            if int(getattr(self, name)) < 1:
                p.append(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("eval_freq", "warmup_steps"):
            if int(getattr(self, name)) < 0:
                p.append(f"{name}={getattr(self, name)} must be 0 or more")
        if self.max_steps is not None and self.max_steps < 1:
            p.append(f"max_steps={self.max_steps} must be at least 1 (or unset)")
        if self.learning_rate <= 0:
            p.append(f"learning_rate={self.learning_rate} must be positive")
        if self.weight_decay < 0:
            p.append(f"weight_decay={self.weight_decay} must be 0 or more")
        if self.no_padding and self.batch_size != 1:
            p.append(f"no_padding needs batch_size=1 (got batch_size={self.batch_size}): "
                     "unpadded texts of different lengths cannot be stacked")
        overrides = [n for n in ("emb_dim", "n_layers", "n_heads") if getattr(self, n) is not None]
        if self.weights == "pretrained":
            for n in overrides:
                p.append(f"{n}={getattr(self, n)} needs weights=random (a checkpoint fixes the model's shape)")
        for n in overrides:
            if getattr(self, n) < 1:
                p.append(f"{n}={getattr(self, n)} must be at least 1")
        if not any(getattr(self, n) is not None and getattr(self, n) < 1 for n in overrides):
            p += model_shape_problems(self.to_dict())
        if self.trainable_token_pos == "flexible" and self.average_embeddings:
            p.append("trainable_token_pos=flexible and average_embeddings exclude each other")
        if self.weights_dir and self.weights != "pretrained":
            p.append("weights_dir is only used with weights=pretrained")
        if self.cuda_graphs and self.device == "cpu":
            p.append("cuda_graphs needs a CUDA device (device=cpu given)")
        if self.cuda_graphs and self.no_padding:
            p.append("cuda_graphs needs static shapes; no_padding gives every batch its own length")
        if self.cuda_graphs and int(self.accumulation_steps) > 1:
            p.append(f"cuda_graphs needs accumulation_steps=1 (got {self.accumulation_steps}): a replayed "
                     "backward overwrites the gradients instead of accumulating them")
        if (self.max_steps is not None and self.timing != "off" and 0 < self.max_steps <= int(self.warmup_steps)):
            p.append(f"max_steps={self.max_steps} with warmup_steps={self.warmup_steps}: no step would be measured "
                     "(lower warmup_steps, or use timing=off)")
        if self.cuda_graphs and self.profile != "none":
            p.append(f"profile={self.profile} cannot see inside a replayed CUDA graph (line_profiler finds no Python "
                     "lines, torch.profiler no kernels: measured on an H200, a graph step showed only its copies); "
                     "profile the same settings without cuda_graphs")
        return p

    def validate(self, *, source: str | None = None) -> "TrainConfig":
        problems = self.problems()
        if problems:
            raise ConfigError(problems, source=source)
        return self


def model_shape_problems(s: dict) -> list[str]:
    """Problems only the model's shape reveals: a size without a checkpoint, a width the heads
    don't divide, a context length the model doesn't have. ``s`` maps setting names to values
    (a TrainConfig's, or a sweep run's before it is built)."""
    try:
        size = resolve_model_size(s["model_size"])
    except ValueError:
        return []  # reported with the other choices
    out = []
    if size == "tiny" and s["weights"] == "pretrained":
        out.append("model_size=tiny has no pretrained checkpoint; use weights=random")
    try:
        mcfg = gpt_config(size, emb_dim=s["emb_dim"], n_layers=s["n_layers"], n_heads=s["n_heads"])
    except ValueError as e:
        return out + [str(e)]
    ctx = str(s["context_length"])
    if ctx.isdigit() and int(ctx) > mcfg.context_length:
        out.append(f"context_length={ctx} exceeds the model's context length {mcfg.context_length}")
    return out


def _valid_device(dev: str) -> bool:
    if dev in ("auto", "cpu", "cuda"):
        return True
    if dev.startswith("cuda:"):
        return dev[5:].isdigit()
    return False


_FIELD_TYPES = {f.name: f.type for f in fields(TrainConfig)}


def _coerce(name: str, value: Any) -> Any:
    """YAML gives ints where floats are meant (alpha: 16) and ints for context_length; normalise."""
    t = str(_FIELD_TYPES.get(name, ""))
    if value is None:
        return None
    if t.startswith("float") and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if name == "context_length":
        return str(value)
    return value


def unknown_key_problems(data: dict[str, Any]) -> list[str]:
    names = TrainConfig.field_names()
    out = []
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            out.append(f"unknown setting {key!r}{hint}")
    return out


def type_problems(data: dict[str, Any]) -> list[str]:
    """Type checks for values coming from YAML (the CLI gets these from typer)."""
    out = []
    for key, value in data.items():
        t = str(_FIELD_TYPES.get(key, ""))
        if value is None:
            if "None" not in t:
                out.append(f"{key}: null is not allowed")
            continue
        base = t.split(" |")[0]
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, (str, int)) if key == "context_length" else isinstance(value, str),
        }.get(base, True)
        if not ok:
            out.append(f"{key}={value!r} should be of type {base}")
    return out
