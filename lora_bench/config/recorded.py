"""How a recorded run's settings read where runs are compared with each other or with settings about
to run: run ids, a sweep's resume, superseded rows, the reports' groups.

A setting a run left out (a blank cell or a missing key: the run predates the setting) ran its
default. A setting whose default changed after runs were recorded under it (``FORMER_DEFAULTS``)
reads differently in two ways:

- where it applies, a run that left it out ran the former default, and a run id is hashed against
  the former default: the runs recorded before the change keep their ids, and a run on the new
  default gets an id of its own (a sweep's resume never takes an earlier run for it);
- where it does not apply, it did nothing, so every value of it reads as its default: the runs
  recorded before and after the change compare equal and keep their ids.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lora_bench.config.declaration import DEFAULTS
from lora_bench.kernels.plan_names import DORA_NORM_INLINE

# setting -> the default it had while runs were recorded under it
FORMER_DEFAULTS: dict[str, Any] = {"dora_norm_launch": DORA_NORM_INLINE}


def blank(value: Any) -> bool:
    """A value a run left out: None, NaN, or an empty (or None-spelled) cell."""
    return value is None or (isinstance(value, float) and math.isnan(value)) or str(value) in ("", "<NA>", "nan",
                                                                                                "None")


def applies(name: str, get: Callable[[str], Any]) -> bool:
    """Whether ``name``, a setting of ``FORMER_DEFAULTS``, changes what a run does; ``get``: the run's
    value of a setting by name (blank where it left it out)."""
    def value(key: str) -> str:
        v = get(key)
        return str(DEFAULTS[key] if blank(v) else v)
    # dora_norm_launch: the fused layer's DoRA norms, nothing else
    return value("trainable_layers") == "lora-kernel" and value("lora_variant") == "dora"


def former_defaults(get: Callable[[str], Any]) -> dict[str, Any]:
    """The former defaults of the settings of ``FORMER_DEFAULTS`` that apply to a run (``get``: its
    value of a setting by name): for these, what a run id leaves out and a run that left the
    setting out ran."""
    return {name: former for name, former in FORMER_DEFAULTS.items() if applies(name, get)}


def as_recorded(name: str, value: Any, get: Callable[[str], Any]) -> Any:
    """A run's ``value`` of setting ``name`` as it compares (module docstring): blank reads as the
    default it ran (``former_defaults``, else the default); a changed default's setting where it does
    not apply reads as its default."""
    if name not in FORMER_DEFAULTS:
        return DEFAULTS[name] if blank(value) else value
    if not applies(name, get):
        return DEFAULTS[name]
    return FORMER_DEFAULTS[name] if blank(value) else value
