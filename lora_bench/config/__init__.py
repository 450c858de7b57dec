"""Run settings, each declared once (``declaration``): a field of ``TrainConfig`` gives its type and
default, and its ``Spec`` the allowed values, bounds, help text, extra command-line spellings and
help panel; the ``train`` flags, the keys of settings and sweep files and the ``cfg_*`` columns of
the results tables come from it. Every rule about settings lives in ``rules``; ``files`` reads
settings from ``key=value`` overrides and YAML files. Importers take everything from here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lora_bench.config.declaration import (  # noqa: F401  re-exported
    ATTENTION,
    BASE_DTYPE_DEFAULT,
    BASE_DTYPE_LAYERS,
    BASE_DTYPES,
    BF16_TRUE,
    BY_FLAG,
    COMPILE_SCOPES,
    CONTEXT_LENGTHS,
    DATA,
    DEFAULTS,
    DEVICES,
    FROZEN,
    HF_TRAINABLE_LAYERS,
    IMPLEMENTATIONS,
    LORA,
    LORA_LAYERS,
    MAX_INT,
    MEASUREMENT,
    MODEL,
    MODEL_SIZE_NAMES,
    MODES,
    OPS,
    OPTIMIZERS,
    OUTPUT,
    PANELS,
    PATH_SETTINGS,
    PRECISIONS,
    PROFILES,
    QUANTIZED_BASES,
    SETTINGS,
    TIMING,
    TOKEN_POSITIONS,
    TRAINABLE_LAYERS,
    TRAINING,
    WEIGHTS,
    WEIGHTS_SOURCES,
    Setting,
    SettingFields,
    Spec,
    coerce,
    flag_name,
    key_name,
)
from lora_bench.config.files import parse_overrides, read_settings_file, resolve_paths  # noqa: F401  re-exported
from lora_bench.config.packing import (  # noqa: F401  re-exported
    ADAPTER_SETTINGS, REPEATS_APART, pack_key, repeat_problem, setting_key, solo_reason)
from lora_bench.config.setting_rules import (  # noqa: F401  re-exported
    NAME,
    SCALARS,
    Problem,
    hf_problems,
    problem,
    raw,
    render,
    rule_problems,
    settings_problems,
    unknown_key_problems,
    value_problems,
)
from lora_bench.errors import ConfigError


@dataclass(frozen=True)
class TrainConfig(SettingFields):
    """Every setting of one training run (declared in ``SettingFields``), built from a mapping or checked
    whole: every problem at once."""

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

    def problems(self) -> list[Problem]:
        """Every problem with these settings (empty when valid)."""
        return settings_problems(self.to_dict())

    def validate(self, *, source: str | None = None, name_of: Callable[[str], str] | None = None) -> TrainConfig:
        problems = self.problems()
        if problems:
            raise ConfigError(render(problems, name_of), source=source)
        return self
