"""The adapters' cost per adapted layer: a LoRA group's step time less its floor's (the frozen
model's step, ``trainable_layers=frozen``, of the same size and mode), divided by the number of
layers an adapter wraps, in µs.

- the difference is taken per repeat where both sides ran the same repeats of one sweep, its
  median stated with the order-statistic interval of the median (lora_bench.report.stats,
  ``difference_interval``), with n and the confidence it reaches; otherwise the difference of the
  medians between the two medians' intervals. It is a size, not a comparison: no verdict;
- the layers are those of lora_bench.results.metrics.adapted_layers for the group's model shape
  and implementation: the book's six per block and the head, PEFT's four per block. ``lora-kernel``
  with grouped query/key/value runs the three in one call but counts them as three layers here:
  the figure is per layer, not per call;
- a LoRA group with no floor reads "no floor"; one without step times, "-".

The study report's crossover table (where its baseline is the floor), its summary of device time
above the floor (lora_bench.report.floor_kernels) and the docs' floor table all take it from here."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from lora_bench.config import FROZEN, LORA_LAYERS
from lora_bench.model.sizes import gpt_config
from lora_bench.report.labels import is_blank
from lora_bench.report.samples import sample
from lora_bench.report.stats import NONE, Estimate, difference_interval, span_text
from lora_bench.results.metrics import adapted_layers
from lora_bench.results.schema import SETTING_PREFIX

STEP = "step_ms_median"
UNIT = "µs per adapted layer"
NO_FLOOR = "no floor"
NOTE = ("µs per adapted layer: (the group's step − the floor's step) ÷ the layers an adapter wraps (the book's six "
        "per block and the head, PEFT's four per block), per repeat of one sweep paired, the median with its "
        "order-statistic interval (a size, no verdict); lora-kernel with grouped query/key/value runs those three "
        "in one call and counts three layers")


def against_floor(spec: dict) -> bool:
    """A baseline spec (column -> value) that is the floor: ``trainable_layers=frozen`` alone."""
    return len(spec) == 1 and all(str(k).removeprefix(SETTING_PREFIX) == "trainable_layers"
                                  and str(v).casefold() == FROZEN for k, v in spec.items())


def _setting(row, name: str):
    """``row``'s value of setting ``name`` (its ``cfg_`` column, else the plain one), None where blank."""
    for col in (SETTING_PREFIX + name, name):
        if col in row and not is_blank(row[col]):
            return row[col]
    return None


def _int(value) -> int | None:
    return None if value is None else int(float(value))


def layer_count(row) -> int | None:
    """The layers an adapter wraps in ``row``'s model (its size, width and depth overrides, and
    implementation); None where the row names no known size."""
    size = _setting(row, "model_size")
    if size is None:
        return None
    try:
        mcfg = gpt_config(str(size), emb_dim=_int(_setting(row, "emb_dim")), n_layers=_int(_setting(row, "n_layers")),
                          n_heads=_int(_setting(row, "n_heads")))
    except (ValueError, KeyError):
        return None
    return len(adapted_layers(mcfg, implementation=str(_setting(row, "implementation") or "book")))


def is_lora(runs: pd.DataFrame) -> bool:
    """The runs train LoRA adapters (one of the LoRA trainable-layer choices)."""
    return len(runs) > 0 and str(_setting(runs.iloc[0], "trainable_layers")) in LORA_LAYERS


def per_layer(runs: pd.DataFrame, floor: pd.DataFrame | None) -> Estimate:
    """µs per adapted layer of ``runs`` above the ``floor`` runs, with its interval (module); NONE
    without a floor, step times or a layer count."""
    if floor is None or floor.empty or runs.empty:
        return NONE
    layers = layer_count(runs.iloc[0])
    d = difference_interval(sample(runs, STEP), sample(floor, STEP))
    if not layers or not d.known:
        return NONE
    k = 1000.0 / layers  # ms -> µs, per layer
    return replace(d, value=d.value * k, lo=d.lo * k, hi=d.hi * k)


def per_layer_text(runs: pd.DataFrame, floor: pd.DataFrame | None, *, told: bool = True, lines: bool = False) -> str:
    """'11.6 [10.9–12.3] (n = 5, 93.8 %)' (the interval on a second line where ``lines``); 'no
    floor' without floor runs; '-' where no figure can be taken."""
    if floor is None or floor.empty:
        return NO_FLOOR
    e = per_layer(runs, floor)
    if not e.known:
        return "-"
    return f"{e.value:,.1f}{chr(10) if lines else ' '}{span_text(e, digits=1, told=told)}"
