"""The settings of LoRA's variants (docs/variants.md): one flag, key and column each, their defaults
the reference's, and every refusal with its reason, named as each surface spells the settings."""

from __future__ import annotations

import pytest

from lora_bench.config import SETTINGS, TrainConfig, render, rule_problems
from lora_bench.config.declaration import flag_name
from lora_bench.results.schema import RUN_COLUMNS, SETTING_COLUMNS, SETTING_PREFIX

VARIANT_SETTINGS = ("lora_scaling", "lora_variant", "dora_norm", "lora_init", "loraplus_lr_ratio")
LORA = dict(trainable_layers="lora")


def _problems(**values) -> list[str]:
    return render(rule_problems(TrainConfig(**values).to_dict()))


def test_each_variant_is_a_setting_with_a_flag_and_a_column():
    columns = {c.name for c in (*RUN_COLUMNS, *SETTING_COLUMNS)}
    for name in VARIANT_SETTINGS:
        assert flag_name(name) in SETTINGS[name].flags
        assert SETTING_PREFIX + name in columns
    defaults = TrainConfig()
    assert (defaults.lora_scaling, defaults.lora_variant, defaults.dora_norm, defaults.lora_init,
            defaults.loraplus_lr_ratio) == ("alpha", "lora", "exact", "kaiming", 1.0)
    assert "adapter_init_s" in columns


@pytest.mark.parametrize("layers", ["lora", "lora-merged", "lora-kernel"])
def test_every_variant_composes_with_the_lora_choices(layers):
    ok = dict(trainable_layers=layers, lora_scaling="rslora", lora_init="pissa", loraplus_lr_ratio=16.0)
    assert _problems(**ok) == []
    assert _problems(**ok, lora_variant="dora", dora_norm="detached") == []
    assert _problems(**ok, lora_variant="dora") == []
    for precision in ("tf32", "bf16", "bf16-true"):
        assert _problems(**ok, precision=precision) == []


@pytest.mark.parametrize("name, value", [("lora_scaling", "rslora"), ("lora_variant", "dora"),
                                         ("lora_init", "pissa"), ("loraplus_lr_ratio", 4.0)])
def test_a_variant_without_lora_is_refused(name, value):
    assert _problems(trainable_layers="all", **{name: value}) == [
        f"{name}={value} is only used with trainable_layers one of: lora, lora-merged, lora-kernel"]


@pytest.mark.parametrize("values, needle", [
    (dict(LORA, dora_norm="detached"), "dora_norm=detached is only used with lora_variant=dora"),
    (dict(trainable_layers="lora-kernel", lora_variant="dora", base_dtype="int8"),
     "lora_variant=dora with base_dtype=int8 is refused: DoRA's norm reads the frozen weight itself"),
    (dict(LORA, lora_variant="dora", base_dtype="int8"),
     "lora_variant=dora with base_dtype=int8 is refused: DoRA's norm reads the frozen weight itself"),
    (dict(LORA, lora_init="pissa", lora_alpha=0.0), "lora_init=pissa with lora_alpha=0 is refused"),
    (dict(LORA, kernel_plan="fused"), "kernel_plan=fused is only used with trainable_layers=lora-kernel"),
])
def test_what_a_variant_rules_out_says_why(values, needle):
    problems = _problems(**values)
    assert len(problems) == 1 and needle in problems[0], problems


def test_a_stored_base_takes_pissa_and_rslora():
    assert _problems(**LORA, base_dtype="nf4", lora_init="pissa", lora_scaling="rslora") == []


def test_ratio_must_be_positive():
    with pytest.raises(Exception, match="loraplus_lr_ratio=0.0 must be positive"):
        TrainConfig.from_mapping({**LORA, "loraplus_lr_ratio": 0.0})


def test_refusals_on_the_command_line_name_the_flags(run_cli, tmp_path):
    code, out = run_cli("train", "--device", "cpu", "--weights", "random", "--trainable-layers", "lora-kernel",
                        "--lora-variant", "dora", "--base-dtype", "int8", "--results-dir", tmp_path)
    assert code == 2 and "Traceback" not in out, out
    assert "--lora-variant=dora with --base-dtype=int8 is refused" in " ".join(out.split())
    assert not (tmp_path / "runs.csv").exists()


def test_a_refused_trainable_layers_value_does_not_break_the_variant_rules():
    """Each refused value is reported on its own; the rules between settings skip it."""
    from lora_bench.config import DEFAULTS
    from lora_bench.config.setting_rules import settings_problems

    for extra in ({}, {"lora_variant": "dora"}, {"lora_scaling": "rslora"}, {"base_dtype": "int8"}):
        problems = settings_problems({**DEFAULTS, **extra, "trainable_layers": "nonsense"})
        assert [p.setting for p in problems][:1] == ["trainable_layers"]
