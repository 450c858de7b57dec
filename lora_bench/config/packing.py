"""Which runs can train together in one pack (one process, one frozen base model, one adapter per
run; lora_bench.train.pack): runs whose settings agree on everything but their adapter's own, and
differ from each other (``repeat_problem``: repeats of one setting go to separate packs).
Nothing here imports torch (``lora-bench sweep --help`` names ADAPTER_SETTINGS)."""

from __future__ import annotations

from typing import Any

from lora_bench.config.declaration import BASE_DTYPE_DEFAULT, SettingFields

# What may differ between the runs of one pack: each adapter has its own rank and alpha, and its
# own learning rate (its B's times its LoRA+ ratio) and weight decay in the pack's optimizer.
ADAPTER_SETTINGS = ("lora_rank", "lora_alpha", "learning_rate", "weight_decay", "loraplus_lr_ratio")


def solo_reason(cfg: SettingFields) -> str | None:
    """Why a run with these settings cannot train in a pack (None: it can)."""
    if cfg.trainable_layers != "lora":
        if cfg.trainable_layers == "lora-kernel":
            return ("lora-kernel's op runs one adapter per call (its kernels take one A and one B), so its "
                    "points run one by one; pack them with trainable_layers=lora")
        if cfg.trainable_layers == "lora-merged":
            return "lora-merged materialises one merged weight per layer, which adapters cannot share"
        return f"trainable_layers={cfg.trainable_layers} trains no adapter (only lora packs)"
    if cfg.lora_init != "kaiming":
        return f"lora_init={cfg.lora_init}: each point would replace the frozen weight its pack shares by its own residual"
    if cfg.implementation != "book":
        return f"implementation={cfg.implementation}: only the book model packs"
    if cfg.base_dtype != BASE_DTYPE_DEFAULT:
        return f"base_dtype={cfg.base_dtype}: a packed model's frozen base is stored as its precision says"
    if cfg.nproc != 1:
        return f"nproc={cfg.nproc}: a packed run is one process"
    return None


def pack_key(cfg: SettingFields) -> tuple[tuple[str, Any], ...]:
    """Runs with equal keys can share a pack: every setting but the adapter's own."""
    return tuple((k, v) for k, v in sorted(cfg.to_dict().items()) if k not in ADAPTER_SETTINGS)


# Why two runs of one setting never share a pack: repeats are there to measure the spread from
# process to process, and the runs of a pack share one process, one base and every step's timing.
REPEATS_APART = ("repeats of one setting never share a pack: its runs share one process and every step's timing, "
                 "so the repeats would measure no spread between processes")


def setting_key(cfg: SettingFields) -> tuple[tuple[str, Any], ...]:
    """Every setting: runs with equal keys are repeats of one setting with one seed."""
    return tuple(sorted(cfg.to_dict().items()))


def repeat_problem(cfgs: list[SettingFields]) -> str | None:
    """Why these runs cannot share a pack because two of them are one setting (None: every run differs)."""
    first: dict[tuple, int] = {}
    for i, cfg in enumerate(cfgs):
        j = first.setdefault(setting_key(cfg), i)
        if j != i:
            return f"runs {j + 1} and {i + 1} of the pack have the same settings: {REPEATS_APART}"
    return None
