"""The sweep files behind the floor in the reports: configs/floor-profile.yaml profiles exactly the
floor study's floor rows and its fastest LoRA rows (their CUDA graphs too: such a profile runs the
steps one by one with the plans a capture chooses), each run one the report's matcher
(lora_bench.report.floor_kernels) takes for that row's profiled repeat; and
configs/all-vs-lora-study.yaml holds the floor at every size and mode beside the rows it already
had."""

from __future__ import annotations

import pandas as pd

from lora_bench.config import FROZEN, LORA_LAYERS
from lora_bench.report.floor_kernels import FLOOR_KEY, ROW_KEY
from lora_bench.report.study import same_settings
from lora_bench.report.labels import mode_name
from lora_bench.report.load import load_results
from lora_bench.report.study import profiled_runs
from lora_bench.results.runs_csv import text_value
from lora_bench.results.schema import SETTING_PREFIX
from lora_bench.sweep.spec import load_sweep
from paths import ROOT

CONFIGS = ROOT / "configs"
APART = ("profile",)  # what a profiled repeat changes


def _row(run) -> dict:
    """A planned run's settings as a runs.csv row holds them."""
    return {SETTING_PREFIX + k: text_value(v) for k, v in run.cfg.to_dict().items()}


def _settings(run, *, drop: tuple[str, ...] = ()) -> dict:
    return {k: v for k, v in run.cfg.to_dict().items() if k not in drop}


def test_the_floor_profile_is_the_floor_studys_rows_profiled():
    study = [r for r in load_sweep(CONFIGS / "floor-study.yaml").runs if r.repeat == 0]
    prof = load_sweep(CONFIGS / "floor-profile.yaml").runs
    assert prof and all(r.cfg.profile == "kernels" and r.cfg.cuda_graphs for r in prof)
    assert {(r.cfg.model_size, r.cfg.trainable_layers) for r in prof} == {
        (s, layers) for s in ("124M", "1558M") for layers in (FROZEN, "lora-kernel")}
    for p in prof:
        [twin] = [r for r in study if _settings(r, drop=APART) == _settings(p, drop=APART)]
        assert twin.cfg.cuda_graphs and twin.label == p.label
        # the report takes it for the profiled repeat of its twin's group
        row, profiled = _row(twin), _row(p)
        assert mode_name(profiled) == mode_name(row)
        assert same_settings(row, profiled, ROW_KEY if p.cfg.trainable_layers != FROZEN else FLOOR_KEY)


def test_the_floor_profile_holds_the_fastest_lora_rows_of_the_committed_floor_study():
    """At each size and precision, the LoRA settings with the lowest median step in
    results/answer/floor are among the profiled ones."""
    df = load_results([ROOT / "results" / "answer" / "floor"])
    timed = df[(df["status"] == "done") & ~df.index.isin(profiled_runs(df).index)]
    lora = timed[timed[SETTING_PREFIX + "trainable_layers"].isin(LORA_LAYERS)]
    keys = [SETTING_PREFIX + k for k in ("model_size", "precision", "trainable_layers", "adapter_grads")]
    medians = lora.groupby(keys)["step_ms_median"].median().reset_index()
    fastest = {tuple(r[keys].astype(str)) for _, r in
               medians.loc[medians.groupby(keys[:2])["step_ms_median"].idxmin()].iterrows()}
    profiled = {(r.cfg.model_size, r.cfg.precision, r.cfg.trainable_layers, r.cfg.adapter_grads)
                for r in load_sweep(CONFIGS / "floor-profile.yaml").runs}
    assert len(fastest) == 4 and fastest <= profiled


def test_the_all_vs_lora_study_holds_the_floor_at_every_size_and_mode():
    sw = load_sweep(CONFIGS / "all-vs-lora-study.yaml")
    runs = pd.DataFrame([{"label": r.label, "repeat": r.repeat, **_settings(r)} for r in sw.runs])
    assert sw.repeats == 5 and set(runs["trainable_layers"]) == {FROZEN, "all", "lora", "lora-kernel"}
    for (size, label), g in runs.groupby(["model_size", "label"]):
        assert dict(g["trainable_layers"].value_counts()) == {FROZEN: 5, "all": 5, "lora": 5, "lora-kernel": 5}, \
            (size, label)
        floor = g[g["trainable_layers"] == FROZEN].drop(columns=["trainable_layers"])
        full = g[g["trainable_layers"] == "all"].drop(columns=["trainable_layers"])
        # the floor differs from full fine-tuning in what trains, nothing else
        assert floor.reset_index(drop=True).equals(full.reset_index(drop=True)), (size, label)


def test_the_targets_profile_is_the_targets_rows_profiled():
    """configs/targets-profile.yaml: one profiled repeat of every configs/targets.yaml row, the same
    settings (CUDA graphs included) with profile: kernels, each one the matcher takes for its row's
    profiled repeat (the floor rows by the floor's key)."""
    targets = [r for r in load_sweep(CONFIGS / "targets.yaml").runs if r.repeat == 0]
    prof = load_sweep(CONFIGS / "targets-profile.yaml").runs
    assert len(prof) == len(targets) and all(r.cfg.profile == "kernels" for r in prof)
    for p in prof:
        [twin] = [r for r in targets if _settings(r, drop=APART) == _settings(p, drop=APART)]
        assert twin.label == p.label
        row, profiled = _row(twin), _row(p)
        assert mode_name(profiled) == mode_name(row)
        assert same_settings(row, profiled, ROW_KEY if p.cfg.trainable_layers != FROZEN else FLOOR_KEY)
