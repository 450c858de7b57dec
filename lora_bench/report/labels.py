"""Human names for what a reader sees: execution modes built from the settings columns (never from
run labels), model sizes, trainable-layer choices, and settings as ``key=value`` text."""

from __future__ import annotations

from collections.abc import Mapping

from lora_bench.config.recorded import blank as is_blank  # noqa: F401  re-exported: the reports' name for it
from lora_bench.results.schema import SETTING_PREFIX, column_index

# the settings that make an execution mode (how a step runs, not what it trains)
MODE_FIELDS = tuple(SETTING_PREFIX + f for f in ("compile", "compile_scope", "cuda_graphs", "precision",
                                                  "attention", "ops", "optimizer"))
PRECISION_NAMES = {"fp32": "fp32", "tf32": "TF32", "bf16": "bf16", "fp16": "fp16"}
# what each trainable-layer choice trains, for a legend under tables
LAYER_HELP = {
    "all": "every weight trains (full fine-tuning)",
    "frozen": "the floor: nothing in the blocks trains, the gradient goes back through all of them",
    "lora": "LoRA adapters in PyTorch (x·A·B beside each frozen linear layer)",
    "lora-kernel": "LoRA through the fused LoRA kernel",
    "lora-merged": "LoRA with the adapters merged into the weight every step",
    "last_layer": "only the classification head",
    "last_block": "the last transformer block and the head",
    "last_two_blocks": "the last two transformer blocks and the head",
}


def truthy(v) -> bool:
    return not is_blank(v) and str(v).strip().lower() in ("true", "1", "yes")


def mode_name(row: Mapping) -> str:
    """'eager fp32', 'CUDA graphs + bf16 + SDPA + fused ops + fused AdamW', 'block-compiled + CUDA
    graphs + bf16 + …' — from the cfg_* columns; settings a row lacks count as their defaults."""
    def get(field: str, default: str) -> str:
        v = row.get(SETTING_PREFIX + field)
        return default if is_blank(v) else str(v)

    head = []
    if truthy(get("compile", "False")):
        head.append("block-compiled" if get("compile_scope", "model") == "blocks" else "torch.compile")
    if truthy(get("cuda_graphs", "False")):
        head.append("CUDA graphs")
    precision = get("precision", "fp32")
    name = " + ".join(head) + " + " if head else "eager "
    name += PRECISION_NAMES.get(precision, precision)
    extras = [("attention", "sdpa", "SDPA"), ("ops", "fused", "fused ops"), ("optimizer", "fused", "fused AdamW"),
              ("optimizer", "one-launch", "one-launch AdamW")]
    name += "".join(f" + {text}" for field, value, text in extras if get(field, "book") == value)
    return name


def setting_name(col: str) -> str:
    return col.removeprefix(SETTING_PREFIX)


def value_text(v) -> str:
    """A setting's value as a reader writes it: 16 not 16.0, True/False, '-' for blank."""
    if is_blank(v):
        return "-"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    s = str(v)
    try:
        f = float(s)
    except ValueError:
        return s
    return str(int(f)) if f.is_integer() and "." in s and "e" not in s.lower() else s


def condition_text(settings: Mapping) -> str:
    """'batch 8', 'batch 32 · timing=sync': the settings besides size, variant and mode that
    tell two lines apart."""
    parts = []
    for col, v in settings.items():
        if col == SETTING_PREFIX + "batch_size":
            parts.append(f"batch {value_text(v)}")
        else:
            parts.append(f"{setting_name(col)}={value_text(v)}")
    return " · ".join(parts)


def count_text(n: float) -> str:
    """1,805 · 2.7M · 1.56B: launch counts and parameter counts as people say them."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n:,.0f}"


COLUMN_LABELS = {"step_ms_median": "step ms", "training_time_s": "train s", "val_acc": "val acc %",
                 "test_acc": "test acc %", "train_acc": "train acc %", "tokens_per_s": "tokens/s",
                 "sweep_label": "label", "mode": "execution mode"}


def column_label(col: str) -> str:
    """'step ms', 'forward ms', 'model_size': a results column as a table heading."""
    if col in COLUMN_LABELS:
        return COLUMN_LABELS[col]
    if col.startswith(SETTING_PREFIX):
        return col.removeprefix(SETTING_PREFIX)
    unit = getattr(column_index().get(col), "unit", "")
    name = col.removesuffix("_median").removesuffix(f"_{unit}").replace("_", " ")
    return f"{name} {unit}".strip()
