"""The header of a study: what the runs held fixed and what varied, the device, the software, the
commits and dates, and the question the runs can answer."""

from __future__ import annotations

import pandas as pd

from lora_bench.report.aggregate import NOT_GROUPED, collapse_modes, order_key, varying_settings
from lora_bench.report.load import MODE
from lora_bench.report.labels import is_blank, setting_name, value_text
from lora_bench.report.study_model import Header
from lora_bench.results.schema import SETTING_PREFIX

SIZE = SETTING_PREFIX + "model_size"
LAYERS = SETTING_PREFIX + "trainable_layers"

ENV = (("torch", "torch_version"), ("CUDA", "cuda_version"), ("driver", "gpu_driver"), ("cuDNN", "cudnn_version"),
       ("Triton", "triton_version"), ("Python", "python_version"), ("TF32 matmul", "tf32_matmul"),
       ("transformers", "transformers_version"), ("PEFT", "peft_version"))


def _values(df: pd.DataFrame, col: str) -> list[str]:
    if col not in df:
        return []
    return sorted({str(v) for v in df[col] if not is_blank(v)}, key=lambda v: order_key(v))


def header(df: pd.DataFrame, done: pd.DataFrame, timed: pd.DataFrame, *, title: str, spec: dict) -> Header:
    commits = done["git_commit"].fillna("").astype(str).value_counts() if "git_commit" in done else pd.Series(dtype=int)
    started = sorted(str(v) for v in done.get("started_at", pd.Series(dtype=str)) if not is_blank(v))
    fixed = {}
    for c in sorted(c for c in timed.columns if c.startswith(SETTING_PREFIX) and c not in NOT_GROUPED):
        vals = _values(timed, c)
        if len(vals) == 1:
            fixed[setting_name(c)] = value_text(vals[0])
    varying = [setting_name(k) if k != MODE else "execution mode" for k in collapse_modes(varying_settings(timed))]
    seeds = _values(timed, SETTING_PREFIX + "seed")
    if len(seeds) > 1:
        varying.append(f"seed ({len(seeds)} seeds over repeats)")
    names = _values(done, "sweep_name")
    sizes = sorted(_values(timed, SIZE), key=order_key)
    layers = sorted(_values(timed, LAYERS), key=order_key)
    return Header(title=title or (names[0] if len(names) == 1 else "results"),
                  question=_question(spec, sizes, layers, modes=len(_values(timed, MODE))),
                  gpus=_values(done, "gpu_name"), devices=[d.upper() for d in _values(done, "device")],
                  versions={k: ", ".join(_values(done, c)) for k, c in ENV if _values(done, c)},
                  commits=[(str(c) or "unknown", int(n)) for c, n in commits.items()],
                  first=started[0] if started else "", last=started[-1] if started else "", fixed=fixed,
                  varying=varying, n_runs=len(done),
                  excluded={str(k): int(v) for k, v in df.loc[df["status"] != "done", "status"].value_counts().items()},
                  hosts=len(_values(done, "hostname")))


# what a baseline of trainable layers stands for, in a report's question
BASELINE_NAMES = {"all": "full fine-tuning", "frozen": "the floor: the frozen model's step"}


def _question(spec: dict, sizes: list[str], layers: list[str], *, modes: int) -> str:
    """The question the runs can answer, from what varies in them."""
    span = f"{sizes[0]} to {sizes[-1]}" if len(sizes) > 1 else (sizes[0] if sizes else "")
    how = " and how does the execution mode change that" if modes > 1 else ""
    if spec:
        base = ", ".join(value_text(v) for v in spec.values())
        if list(spec) == [LAYERS]:
            others = [v for v in layers if v != spec[LAYERS]]
            who = " and ".join(others) or "the other runs"
            verb = "is" if len(others) == 1 else "are"
            where = f"at model sizes from {span}" if len(sizes) > 1 else f"at {span}"
            what = f" ({BASELINE_NAMES[spec[LAYERS]]})" if spec[LAYERS] in BASELINE_NAMES else ""
            return f"Why {verb} {who} faster or slower than {base}{what} {where}{how}?"
        named = ", ".join(f"{setting_name(k)}={value_text(v)}" for k, v in spec.items())  # several settings: named
        return f"How do the runs compare with {named}{' from ' + span if len(sizes) > 1 else ''}, and why{how}?"
    return f"Where does the step time go{' from ' + span if span else ''}{how}?"
