"""Why a results column holds no value: one sentence naming the setting (or the machine) that
left it empty, so a report says "test_acc is empty: the runs skipped the final evaluation" instead
of printing a column of dashes."""

from __future__ import annotations

import pandas as pd

from lora_bench.report.labels import is_blank, truthy
from lora_bench.results.schema import SETTING_PREFIX

ACCURACIES = ("train_acc", "val_acc", "test_acc")
TIMED_PREFIXES = ("data_ms", "forward_ms", "backward_ms", "optimizer_ms", "step_ms", "host_",
                  "phase_sum", "tokens_per", "achieved_tflops", "mfu", "measured_steps")


def is_empty(df: pd.DataFrame, col: str) -> bool:
    return col not in df or df[col].map(is_blank).all()


def why_empty(df: pd.DataFrame, col: str) -> str:
    """'test_acc is empty: the runs skipped the final evaluation (skip_final_eval=True)'."""
    return f"{col} is empty: {_reason(df, col)}"


def _all(df: pd.DataFrame, setting: str, test) -> bool:
    col = SETTING_PREFIX + setting
    return col in df and len(df) > 0 and df[col].map(test).all()


def _reason(df: pd.DataFrame, col: str) -> str:
    if col not in df:
        return "these results have no such column (their runs.csv was written without it)"
    on_cpu = "device" in df and len(df) > 0 and df["device"].fillna("").astype(str).str.startswith("cpu").all()
    if col in ACCURACIES and _all(df, "skip_final_eval", truthy):
        return "the runs skipped the final evaluation (skip_final_eval=True)"
    if col in ("final_train_loss", "final_val_loss") and _all(df, "eval_freq", lambda v: str(v) in ("0", "0.0")):
        return "periodic evaluation was off (eval_freq=0)"
    if col.startswith(TIMED_PREFIXES) and _all(df, "timing", lambda v: str(v) == "off"):
        return "phase timing was off (timing=off)"
    if col.startswith(("mfu", "peak_tflops", "achieved_tflops")):
        if on_cpu:
            return "MFU needs a GPU with a known datasheet peak; these runs ran on the CPU"
        gpus = sorted({str(v) for v in df.get("gpu_name", pd.Series(dtype=str)).dropna() if str(v)})
        return f"no datasheet peak is known for {', '.join(gpus) or 'the GPU'} at the runs' precision"
    if col.startswith("peak_mem") and on_cpu:
        return "CUDA memory is recorded on CUDA devices only; these runs ran on the CPU"
    if col == "backend" and _all(df, "trainable_layers", lambda v: str(v) != "lora-kernel"):
        return "the kernel backend is recorded for lora-kernel runs only"
    if col in ("lora_rank", "lora_alpha") and _all(df, "trainable_layers", lambda v: not str(v).startswith("lora")):
        return "only LoRA runs have a rank and alpha"
    if col.startswith("sweep_") or col == "repeat":
        return "the runs were not started by a sweep"
    return "no finished run records a value"
