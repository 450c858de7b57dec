"""The one grouping engine (lora_bench.report.groups): a group's ratio is its median over the
median of the baseline runs that share its other keys, paired by repeat, with the verdict in the
words of the metric's sense; the rules the views read differently are parameters; and the report's
table of groups and the study view state the same ratio and verdict for the same runs."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from lora_bench.report import stats
from lora_bench.report.aggregate import build_report
from lora_bench.report.groups import exact, group_runs, same
from lora_bench.report.load import RESULTS_DIR
from lora_bench.report.study import build_study

SIZE, LAYERS, STEP = "cfg_model_size", "cfg_trainable_layers", "step_ms_median"


def _frame(steps: dict[tuple[str, str], list[float]]) -> pd.DataFrame:
    """Finished runs, one per value, the i-th value of every point from repeat i of one sweep."""
    rows = []
    for (size, layers), values in steps.items():
        for i, v in enumerate(values):
            rows.append({"run_id": f"{size}-{layers}-r{i}", "status": "done", SIZE: size, LAYERS: layers,
                         "cfg_seed": 123, STEP: v, "val_acc": 90.0 + i, RESULTS_DIR: "r", "sweep_name": "s",
                         "repeat": i, "started_at": f"2026-01-01T00:0{i}:00"})
    return pd.DataFrame(rows)


STEPS = {("124M", "all"): [40.0, 40.4, 39.8, 40.2, 40.1], ("124M", "lora"): [60.0, 60.5, 59.9, 60.3, 60.2],
         ("1558M", "all"): [250.0, 252.0, 249.0, 251.0, 250.5], ("1558M", "lora"): [200.0, 201.0, 199.0, 200.5, 200.2]}


def _by(groups) -> dict:
    return {(g.values[SIZE], g.values[LAYERS]): g for g in groups}


def test_each_group_is_set_against_the_baseline_of_its_other_keys():
    found = _by(group_runs(_frame(STEPS), [SIZE, LAYERS], metrics=[STEP], baseline={LAYERS: "all"},
                           ratio_metric=STEP))
    small, large = found[("124M", "lora")], found[("1558M", "lora")]
    # paired repeats: the median of the per-repeat ratios
    per_repeat = [c / b for c, b in zip(STEPS[("124M", "lora")], STEPS[("124M", "all")])]
    assert small.ratio.value == float(np.median(per_repeat)) and small.verdict == stats.SLOWER
    per_repeat = [c / b for c, b in zip(STEPS[("1558M", "lora")], STEPS[("1558M", "all")])]
    assert large.ratio.value == float(np.median(per_repeat)) and large.verdict == stats.FASTER
    assert small.ratio.paired and small.ratio.over == stats.REPEATS and small.ratio.lo <= small.ratio.value
    base = found[("124M", "all")]
    assert base.is_baseline and base.verdict == "" and base.ratio.value == 1.0
    assert small.estimates[STEP].value == 60.2 and small.estimates[STEP].has_interval


def test_a_metric_that_is_not_a_speed_reads_higher_or_lower():
    frame = _frame(STEPS)
    frame.loc[frame[LAYERS] == "lora", "val_acc"] += 20
    found = _by(group_runs(frame, [SIZE, LAYERS], baseline={LAYERS: "all"}, ratio_metric="val_acc"))
    assert found[("124M", "lora")].verdict == stats.HIGHER


def test_the_rules_the_views_read_differently_are_parameters():
    steps = {k: v for k, v in STEPS.items() if k != ("1558M", "all")}  # no baseline at 1558M
    frame = _frame(steps)
    lone = _by(group_runs(frame, [SIZE, LAYERS], metrics=[STEP], baseline={LAYERS: "all"}, ratio_metric=STEP))
    assert lone[("1558M", "lora")].ratio.value == 200.2 / 40.1  # the only baseline group there is
    own = _by(group_runs(frame, [SIZE, LAYERS], metrics=[STEP], baseline={LAYERS: "all"}, ratio_metric=STEP,
                         lone_baseline=False, unknown=stats.UNCLEAR))
    assert math.isnan(own[("1558M", "lora")].ratio.value) and own[("1558M", "lora")].verdict == stats.UNCLEAR
    assert not own[("1558M", "lora")].has_baseline and own[("124M", "lora")].has_baseline
    assert same("16", "16.0") and not exact("16", "16.0")


def test_the_report_and_the_study_state_one_ratio_and_verdict():
    frame = _frame(STEPS)
    rep = build_report(frame, baseline="trainable_layers=all")
    study = build_study(frame, baseline="trainable_layers=all")
    table = {(r[SIZE], r[LAYERS]): (r["ratio"], r["ratio_lo"], r["ratio_hi"], r["verdict"])
             for r in rep.groups.to_dict("records")}
    view = {(g.size, g.variant): (g.ratio, g.ratio_lo, g.ratio_hi, g.verdict) for g in study.groups}
    assert table == view and table[("1558M", "lora")][3] == stats.FASTER


def test_a_study_report_groups_its_runs_once(tmp_path, monkeypatch):
    """``lora-bench report`` on a study: one call of the engine gives the crossover, the answer and
    the table of every group, so a group's ratio reads the same in all of them."""
    import lora_bench.report.aggregate as aggregate
    import lora_bench.report.study as study_mod
    from lora_bench.report.report_command import report_command

    frame = _frame(STEPS)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1])
        return group_runs(*args, **kwargs)

    for module in (aggregate, study_mod):
        monkeypatch.setattr(module, "group_runs", counted)
    monkeypatch.setattr("lora_bench.report.report_command.load_results", lambda paths: frame)
    out = tmp_path / "report.md"
    with open(tmp_path / "log", "w") as log:
        report_command([tmp_path], group_by=None, baseline=None, metrics=None, fmt="markdown", output=out,
                       plot=None, console=Console(file=log))
    assert len(calls) == 1
    text = out.read_text()
    every = text[text.index("## Every group"):]
    # the 1558M lora row of the table of every group carries the crossover's ratio
    ratio = _by(build_study(frame, baseline="trainable_layers=all").run_groups)[("1558M", "lora")].ratio
    assert f"{ratio.value:.2f}" in every


def test_a_setting_of_the_fused_layer_alone_names_a_variant_and_finds_the_baseline():
    """adapter_grads applies to lora-kernel only (the config refuses it elsewhere): a frozen or
    full baseline ran it at its default, so a deferred lora-kernel group is set against that
    baseline, and reads as its own variant rather than a condition without a baseline."""
    rows = []
    for i in range(5):
        for layers, grads, step in (("frozen", "inline", 2.0 + 0.01 * i), ("lora-kernel", "inline", 3.0 + 0.01 * i),
                                    ("lora-kernel", "deferred", 2.6 + 0.01 * i)):
            rows.append({"run_id": f"{layers}-{grads}-r{i}", "status": "done", SIZE: "124M", LAYERS: layers,
                         "cfg_adapter_grads": grads, "cfg_seed": 123, STEP: step, RESULTS_DIR: "r",
                         "sweep_name": "s", "repeat": i, "started_at": f"2026-01-01T00:0{i}:00"})
    study = build_study(pd.DataFrame(rows), baseline="trainable_layers=frozen")
    ratios = {g.variant: g.ratio for g in study.groups if not g.is_baseline}
    assert set(ratios) == {"lora-kernel (adapter_grads=inline)", "lora-kernel (adapter_grads=deferred)"}
    assert ratios["lora-kernel (adapter_grads=deferred)"] == pytest.approx(2.62 / 2.02)
    assert ratios["lora-kernel (adapter_grads=inline)"] == pytest.approx(3.02 / 2.02)
    assert {g.condition for g in study.groups} == {""}


def test_a_setting_of_the_fused_layers_dora_alone_is_named_on_its_dora_rows_only():
    """dora_norm_launch applies to the fused layer's DoRA only: its LoRA rows ran it at its default
    and are named without it, its DoRA rows with it, inline and ahead apart."""
    rows = []
    for i in range(5):
        for layers, variant, launch, step in (("frozen", "lora", "inline", 2.0), ("lora-kernel", "lora", "inline", 3.0),
                                              ("lora-kernel", "dora", "inline", 4.0),
                                              ("lora-kernel", "dora", "ahead", 3.8)):
            rows.append({"run_id": f"{layers}-{variant}-{launch}-r{i}", "status": "done", SIZE: "124M",
                         LAYERS: layers, "cfg_lora_variant": variant, "cfg_dora_norm_launch": launch, "cfg_seed": 123,
                         STEP: step + 0.01 * i, RESULTS_DIR: "r", "sweep_name": "s", "repeat": i,
                         "started_at": f"2026-01-01T00:0{i}:00"})
    study = build_study(pd.DataFrame(rows), baseline="trainable_layers=frozen")
    names = {g.variant for g in study.groups if not g.is_baseline}
    assert names == {"lora-kernel", "lora-kernel (lora_variant=dora, dora_norm_launch=inline)",
                     "lora-kernel (lora_variant=dora, dora_norm_launch=ahead)"}, names


def test_against_the_floor_each_variant_of_lora_names_itself_and_finds_the_one_floor():
    """The floor (frozen) trains no adapter, so the adapter's variant settings are not conditions
    against it: it ran them at their default, and every variant is set against it, named by the
    settings in which it leaves the default (nothing added to the default LoRA's or the floor's name)."""
    rows = []
    points = (("frozen", {}, 2.0), ("lora", {}, 6.0), ("lora", {"cfg_lora_variant": "dora", "cfg_dora_norm": "detached"}, 9.0),
              ("lora", {"cfg_lora_variant": "dora"}, 12.0), ("lora", {"cfg_lora_scaling": "rslora"}, 6.0),
              ("lora-kernel", {"cfg_lora_scaling": "rslora"}, 4.0))
    for i in range(5):
        for layers, settings, step in points:
            rows.append({"run_id": f"{layers}-{len(settings)}-{step}-r{i}", "status": "done", SIZE: "124M",
                         LAYERS: layers, "cfg_lora_variant": "lora", "cfg_dora_norm": "exact",
                         "cfg_lora_scaling": "alpha", "cfg_seed": 123, **settings, STEP: step * (1 + 0.01 * i),
                         RESULTS_DIR: "r", "sweep_name": "s", "repeat": i, "started_at": f"2026-01-01T00:0{i}:00"})
    study = build_study(pd.DataFrame(rows), baseline="trainable_layers=frozen")
    ratios = {g.variant: g.ratio for g in study.groups if not g.is_baseline}
    assert set(ratios) == {"lora", "lora (lora_variant=dora, dora_norm=detached)", "lora (lora_variant=dora)",
                           "lora (lora_scaling=rslora)", "lora-kernel (lora_scaling=rslora)"}
    assert ratios["lora (lora_variant=dora)"] == pytest.approx(6.0)
    assert ratios["lora (lora_variant=dora, dora_norm=detached)"] == pytest.approx(4.5)
    assert ratios["lora-kernel (lora_scaling=rslora)"] == pytest.approx(2.0)
    assert ratios["lora (lora_scaling=rslora)"] == ratios["lora"] == pytest.approx(3.0)
    assert {g.condition for g in study.groups} == {""}
    assert [g.variant for g in study.groups if g.is_baseline] == ["frozen"]
    # against LoRA the same settings stay the variants' own names, as before
    against_lora = build_study(pd.DataFrame(rows), baseline="trainable_layers=lora,lora_variant=lora,dora_norm=exact")
    assert any("lora_variant=dora" in g.variant for g in against_lora.groups)
    # and the sentences call that baseline by the one setting it holds off its default
    assert against_lora.baseline_name == "lora" and study.baseline_name == "frozen"
    assert build_study(pd.DataFrame(rows), baseline="trainable_layers=lora,lora_scaling=rslora").baseline_name == (
        "trainable_layers=lora, lora_scaling=rslora")
    assert build_study(pd.DataFrame(rows), baseline="lora_variant=lora,dora_norm=exact").baseline_name == (
        "lora_variant=lora, dora_norm=exact")  # every setting at its default: all of them
