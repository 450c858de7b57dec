"""A setting whose default changed after runs were recorded (``lora_bench.config.recorded``):
dora_norm_launch, once inline, now auto. Run ids, a sweep's resume, superseded rows and the reports
read the recorded runs as they ran."""

from __future__ import annotations

import hashlib
import json

import pandas as pd
import pytest
import torch

from lora_bench.config import DEFAULTS, TrainConfig
from lora_bench.config.recorded import FORMER_DEFAULTS, as_recorded
from lora_bench.results.prune import settings_key
from lora_bench.results.schema import settings_columns
from lora_bench.train.build import norms_ahead
from lora_bench.train.identity import settings_hash

KERNEL_DORA = {"trainable_layers": "lora-kernel", "lora_variant": "dora"}


def _former_hash(cfg: TrainConfig) -> str:
    """The hash the run got while the former defaults were the defaults (a setting at today's default
    held the former one then)."""
    former = {**DEFAULTS, **FORMER_DEFAULTS}
    then = {k: former[k] if v == DEFAULTS[k] else v for k, v in cfg.to_dict().items()}
    changed = {k: v for k, v in then.items() if v != former[k]}
    return hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:10]


KEPT = [  # settings a run could have before the change: each keeps its id
    {}, {"trainable_layers": "lora-kernel"}, {"trainable_layers": "lora", "lora_variant": "dora"},
    {**KERNEL_DORA, "dora_norm_launch": "inline"}, {**KERNEL_DORA, "dora_norm_launch": "ahead"},
    {**KERNEL_DORA, "dora_norm": "detached", "dora_norm_launch": "inline", "cuda_graphs": True, "precision": "bf16"},
]


@pytest.mark.parametrize("changes", KEPT)
def test_runs_recorded_before_the_default_changed_keep_their_ids(changes):
    cfg = TrainConfig(**changes).validate()
    assert settings_hash(cfg) == _former_hash(cfg)


def test_a_run_on_the_new_default_gets_an_id_of_its_own():
    """auto forms the norms ahead where inline did not: a sweep's resume must not take one for the other."""
    ids = {launch: settings_hash(TrainConfig(**KERNEL_DORA, dora_norm_launch=launch)) for launch in
           ("auto", "inline", "ahead")}
    assert len(set(ids.values())) == 3, ids
    assert TrainConfig(**KERNEL_DORA).dora_norm_launch == "auto"


def _row(cfg: TrainConfig, **cells) -> dict:
    row = {k: ("" if v is None else str(v)) for k, v in settings_columns(cfg).items()}
    row.update(cells)
    return row


def test_a_recorded_row_reads_as_the_run_it_was():
    """A fused DoRA row that predates the setting (a blank cell) ran inline; where the setting does
    not apply (the fused layer's LoRA) every recorded value reads as the default."""
    dora = _row(TrainConfig(**KERNEL_DORA), cfg_dora_norm_launch="")
    assert as_recorded("dora_norm_launch", "", lambda k: dora.get(f"cfg_{k}")) == "inline"
    lora = _row(TrainConfig(trainable_layers="lora-kernel"), cfg_dora_norm_launch="inline")
    assert as_recorded("dora_norm_launch", "inline", lambda k: lora.get(f"cfg_{k}")) == "auto"
    assert as_recorded("lora_rank", None, lambda k: None) == DEFAULTS["lora_rank"]
    assert as_recorded("lora_rank", 4, lambda k: None) == 4


def test_superseded_rows_compare_as_the_runs_they_were():
    lora_old = _row(TrainConfig(trainable_layers="lora-kernel"), cfg_dora_norm_launch="inline")
    lora_new = _row(TrainConfig(trainable_layers="lora-kernel"))
    assert settings_key(lora_old) == settings_key(lora_new)
    dora_old = _row(TrainConfig(**KERNEL_DORA), cfg_dora_norm_launch="")
    assert settings_key(dora_old) == settings_key(_row(TrainConfig(**KERNEL_DORA, dora_norm_launch="inline")))
    assert settings_key(dora_old) != settings_key(_row(TrainConfig(**KERNEL_DORA)))


def test_resume_takes_a_recorded_row_only_for_the_launch_it_ran(tmp_path):
    """Under another id scheme, a fused DoRA row recorded without the setting is done for an inline
    run and not for an auto one; a fused LoRA row recorded with inline is done for the default run."""
    from lora_bench.results.store import upsert_run
    from lora_bench.sweep.resume import resume_statuses
    from lora_bench.sweep.spec import load_sweep

    spec = tmp_path / "s.yaml"
    spec.write_text("name: g\nbase: {model_size: tiny, weights: random, max_steps: 2, warmup_steps: 1}\nruns:\n"
                    "  - {trainable_layers: lora-kernel}\n"
                    "  - {trainable_layers: lora-kernel, lora_variant: dora}\n"
                    "  - {trainable_layers: lora-kernel, lora_variant: dora, dora_norm_launch: inline}\n")
    runs = list(load_sweep(spec).runs)
    res = tmp_path / "res"
    res.mkdir()
    for i, (run, launch) in enumerate(zip(runs, ("inline", "", ""))):
        upsert_run(res / "runs.csv", {"run_id": f"old-{i}", "status": "done", "sweep_name": "g", "repeat": "0",
                                      **_row(run.cfg, cfg_dora_norm_launch=launch)})
    st = resume_statuses(res, runs, "g")
    done = {run.cfg.dora_norm_launch if run.cfg.lora_variant == "dora" else "lora": st.get(run.run_id, ("",))
            for run in runs}
    assert done["lora"] == ("done", "old-0")
    assert done["inline"][0] == "done" and done["inline"][1] in ("old-1", "old-2")
    assert done["auto"] == ("",) or done["auto"][0] != "done", done


def test_reports_group_the_fused_layers_lora_rows_across_the_change():
    from lora_bench.report.load import with_setting_defaults

    rows = pd.DataFrame([_row(TrainConfig(trainable_layers="lora-kernel"), cfg_dora_norm_launch="inline"),
                         _row(TrainConfig(trainable_layers="lora-kernel")),
                         _row(TrainConfig(**KERNEL_DORA), cfg_dora_norm_launch=""),
                         _row(TrainConfig(**KERNEL_DORA))])
    got = list(with_setting_defaults(rows)["cfg_dora_norm_launch"])
    assert got == ["auto", "auto", "inline", "auto"]


@pytest.mark.parametrize("changes, device, ahead", [
    ({"cuda_graphs": True}, "cuda", True),  # auto: the replayed step on a GPU
    ({}, "cuda", False),  # auto, eager
    ({"cuda_graphs": True, "compile": True}, "cuda", False),  # auto, compiled
    ({"cuda_graphs": True}, "cpu", False),
    ({"cuda_graphs": True, "nproc": 2}, "cuda", False),  # auto: measured in one process only
    ({"dora_norm_launch": "ahead"}, "cuda", True),  # asked for
    ({"dora_norm_launch": "inline", "cuda_graphs": True}, "cuda", False),
])
def test_where_the_norms_form_ahead(changes, device, ahead):
    cfg = TrainConfig(**KERNEL_DORA, **changes)
    assert norms_ahead(cfg, torch.device(device)) is ahead
    assert norms_ahead(TrainConfig(trainable_layers="lora-kernel", **{k: v for k, v in changes.items()
                                                                       if k != "dora_norm_launch"}),
                       torch.device(device)) is False
