"""LoRA's variants in whole runs on the tiny model (lora_bench.train.build, lora_bench.classifier): each
variant trains and records its settings (and PiSSA its one-time cost); DoRA's unmerged and merged
runs are one function; PiSSA's initial model computes the base model's output; LoRA+'s optimizer
moves B by its ratio; rsLoRA's packed points train as their solo runs, and the variants that do
not pack say why; the defaults build the plain path."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from numerics import assert_same_function, dot_tol, float64_runs, rel_err
from rich.console import Console
from tiny import SAMPLE

from lora_bench.classifier.book import build_classifier
from lora_bench.config import TrainConfig, solo_reason
from lora_bench.lora import LinearWithDoRA, LinearWithDoRAMerged, LinearWithLoRA, LoRALinearBase, pissa_init
from lora_bench.lora.packed_layer import packed_layers
from lora_bench.model.gpt2 import count_params
from lora_bench.train.build import build_model, build_optimizer
from lora_bench.train.points import Point
from lora_bench.train.run import execute, execute_run

BASE = dict(model_size="tiny", weights="random", trainable_layers="lora", device="cpu", data_file=str(SAMPLE),
            num_epochs=1, max_steps=4, warmup_steps=1, eval_freq=2, eval_iter=1, skip_final_eval=True,
            learning_rate=1e-3)
VARIANTS = {
    "rslora": dict(lora_scaling="rslora", lora_rank=16),
    "loraplus": dict(loraplus_lr_ratio=16.0),
    "dora": dict(lora_variant="dora"),
    "dora-merged-detached": dict(trainable_layers="lora-merged", lora_variant="dora", dora_norm="detached"),
    "pissa": dict(lora_init="pissa"),
    "all-four-kernel": dict(trainable_layers="lora-kernel", lora_scaling="rslora", loraplus_lr_ratio=4.0,
                            lora_init="pissa"),
}


def _run(cfg: TrainConfig, results, run_id: str, context=None):
    def go():
        execute_run(cfg, results_dir=results, run_id=run_id, console=Console(quiet=True), progress=False,
                    cache_dir=results / "cache")
    if context is None:
        go()
    else:
        with context:
            go()
    record = json.loads((results / run_id / "run.json").read_text())
    steps = pd.read_csv(results / run_id / "steps.csv")
    return record, steps


def _losses(record, steps) -> torch.Tensor:
    return torch.tensor(list(steps["loss"]) + record["train_losses"] + record["val_losses"], dtype=torch.float64)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_trains_and_records_its_settings(name, tmp_path):
    cfg = TrainConfig(**{**BASE, **VARIANTS[name]})
    record, steps = _run(cfg, tmp_path, "v")
    row = pd.read_csv(tmp_path / "runs.csv").iloc[0]
    assert row["status"] == "done" and len(steps) == 4
    assert steps["loss"].map(math.isfinite).all() and steps["loss"].nunique() > 1
    for key, value in VARIANTS[name].items():
        assert row[f"cfg_{key}"] == value, key
    if cfg.lora_init == "pissa":
        assert row["adapter_init_s"] > 0
    else:
        assert pd.isna(row["adapter_init_s"])


def test_dora_adds_one_magnitude_per_output():
    lora = build_classifier(TrainConfig(**BASE), cache_dir=None)
    dora = build_classifier(TrainConfig(**BASE, lora_variant="dora"), cache_dir=None)
    outputs = sum(m.out_features for m in lora.modules() if isinstance(m, LoRALinearBase))
    assert count_params(dora, trainable_only=True) == count_params(lora, trainable_only=True) + outputs
    assert {type(m) for m in dora.modules() if isinstance(m, LoRALinearBase)} == {LinearWithDoRA}
    merged = build_classifier(TrainConfig(**{**BASE, "trainable_layers": "lora-merged"}, lora_variant="dora"),
                              cache_dir=None)
    assert {type(m) for m in merged.modules() if isinstance(m, LoRALinearBase)} == {LinearWithDoRAMerged}


@pytest.mark.parametrize("norm", ["exact", "detached"])
def test_dora_unmerged_and_merged_runs_are_one_function(norm, tmp_path):
    """The two DoRA layers train the tiny model to the same losses: as close to the float64 run as
    another rounding order of the unmerged run can be."""
    cfg = TrainConfig(**BASE, lora_variant="dora", dora_norm=norm)
    want = _losses(*_run(cfg, tmp_path, "unmerged"))
    got = _losses(*_run(cfg.replace(trainable_layers="lora-merged"), tmp_path, "merged"))
    with float64_runs() as built:
        ref = _losses(*_run(cfg, tmp_path, "float64"))
    assert built and all(p.dtype == torch.float64 for p in built[0].parameters())
    assert_same_function(got, want, ref, what=f"DoRA merged vs unmerged, norm {norm}")


def test_pissa_model_starts_as_the_base_model():
    """In float64 the PiSSA model's logits are the plain LoRA model's (whose B is zero: the base
    model's); in float32, through the run's build (SVDs in float32), to float32 rounding."""
    cfg = TrainConfig(**BASE, lora_rank=8)
    idx = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(4))
    plain = build_classifier(cfg, cache_dir=None).double()
    pissa = build_classifier(cfg, cache_dir=None).double()
    assert pissa_init(pissa) == 6 * pissa.cfg.n_layers  # every block's six frozen layers, not the head
    with torch.no_grad():
        want, got = plain(idx), pissa(idx)
    e, layers = plain.cfg.emb_dim, plain.cfg.n_layers
    # each of a block's layers computes W_res·x + s·(x·A)·B for W·x (in + r + 2 terms): five of
    # width e, the MLP's second of width 4e
    chain = layers * (5 * (e + cfg.lora_rank + 2) + 4 * e + cfg.lora_rank + 2)
    assert rel_err(got, want) <= dot_tol(torch.float64, chain)
    built = build_model([cfg.replace(lora_init="pissa")], torch.device("cpu"), cache_dir=None, progress=False)
    assert built.adapter_init_s > 0
    with torch.no_grad():
        got32 = built.model(idx)
    assert rel_err(got32, want) <= dot_tol(torch.float32, chain)


@pytest.mark.parametrize("precision", ["fp32", "bf16-true"])
def test_loraplus_moves_b_by_its_ratio(precision):
    """AdamW's first step moves each parameter by its learning rate (m/√v = ±1 where the gradient is
    nonzero) and decays it: B (zero, so no decay) by learning_rate × ratio, the head's weight by
    learning_rate (plus its decay); A has no gradient yet (B is zero)."""
    cfg = TrainConfig(**BASE, loraplus_lr_ratio=16.0, precision=precision)
    model = build_model([cfg], torch.device("cpu"), cache_dir=None, progress=False).model
    opt = build_optimizer(model, [cfg])
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 16e-3]
    before = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    model(torch.randint(0, 1000, (2, 7))).float().logsumexp(-1).sum().backward()
    opt.step()
    step = {n: (p.detach().float() - before[n]).abs().max().item() for n, p in model.named_parameters()
            if p.requires_grad}
    u = 2.0 ** -8 if precision == "bf16-true" else 2.0 ** -24
    bs = [v for n, v in step.items() if n.endswith("lora.B")]
    assert bs and all(abs(v - 16e-3) <= 16e-3 * 4 * u + 1e-9 for v in bs)
    assert abs(step["out_head.linear.bias"] - 1e-3) <= 1e-3 * 4 * u + 1e-3 * 0.1 * 1.0
    assert opt_groups_cover(model, opt)


def opt_groups_cover(model, opt) -> bool:
    """Every trainable parameter (or its master) in exactly one group."""
    n = sum(len(g["params"]) for g in opt.param_groups)
    return n == sum(1 for p in model.parameters() if p.requires_grad)


def test_the_defaults_build_the_plain_path():
    cfg = TrainConfig(**BASE)
    model = build_model([cfg], torch.device("cpu"), cache_dir=None, progress=False)
    assert model.adapter_init_s is None
    assert {type(m) for m in model.model.modules() if isinstance(m, LoRALinearBase)} == {LinearWithLoRA}
    assert {m.lora.alpha for m in model.model.modules() if isinstance(m, LoRALinearBase)} == {cfg.lora_alpha}
    opt = build_optimizer(model.model, [cfg])
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["lr"] == cfg.learning_rate


def _assert_pack_trains_as_solo(points: list[TrainConfig], tmp_path, what: str) -> None:
    """Train ``points`` as one pack; each point's losses are its solo run's, as far as another
    rounding order moves them from the float64 run (of the float32 function under bf16-true)."""
    ids = [f"p{i}" for i in range(len(points))]
    rows = execute([Point(c, i) for c, i in zip(points, ids)], results_dir=tmp_path / "pack",
                   console=Console(quiet=True), progress=False, cache_dir=tmp_path / "cache")
    assert [r["status"] for r in rows] == ["done"] * len(points)
    for i, (cfg, run_id) in enumerate(zip(points, ids)):
        want = _losses(*_run(cfg, tmp_path / "solo", f"s{i}"))
        with float64_runs():
            ref = _losses(*_run(cfg.replace(precision="fp32"), tmp_path / "solo", f"d{i}"))
        got_record = json.loads((tmp_path / "pack" / run_id / "run.json").read_text())
        got = _losses(got_record, pd.read_csv(tmp_path / "pack" / run_id / "steps.csv"))
        dtype = torch.bfloat16 if cfg.precision == "bf16-true" else torch.float32
        assert_same_function(got, want, ref, dtype=dtype, what=f"{what} point {i}, {cfg.precision}")


@pytest.mark.slow
def test_rslora_packed_points_train_as_their_solo_runs(tmp_path):
    """Mixed ranks and alphas at rsLoRA's scale: each point's packed adapter holds alpha/√r, and its
    losses are its solo run's, as far as another rounding order moves them from the float64 run."""
    points = [TrainConfig(**BASE, lora_scaling="rslora", lora_rank=r, lora_alpha=a) for r, a in ((4, 8.0), (9, 3.0))]
    _assert_pack_trains_as_solo(points, tmp_path, "rsLoRA")


def test_packed_classifier_holds_each_points_rslora_scale():
    from lora_bench.classifier.packed_classifier import build_packed_classifier

    points = [TrainConfig(**BASE, lora_scaling="rslora", lora_rank=r, lora_alpha=a) for r, a in ((4, 8.0), (9, 3.0))]
    model = build_packed_classifier(points, cache_dir=None, progress=False)
    assert {tuple(layer.alpha_values) for layer in packed_layers(model).values()} == {(4.0, 1.0)}


@pytest.mark.parametrize("changes, needle", [
    (dict(lora_init="pissa"), "lora_init=pissa: each point would replace the frozen weight"),
    (dict(trainable_layers="lora-merged", lora_variant="dora"), "lora-merged materialises one merged weight"),
])
def test_variants_that_do_not_pack_say_why(changes, needle):
    cfg = TrainConfig(**BASE)
    assert solo_reason(cfg) is None and solo_reason(cfg.replace(lora_scaling="rslora")) is None
    assert solo_reason(cfg.replace(loraplus_lr_ratio=16.0)) is None
    assert solo_reason(cfg.replace(lora_variant="dora")) is None
    assert needle in solo_reason(cfg.replace(**changes))


@pytest.mark.slow
@pytest.mark.parametrize("norm, precision", [("exact", "fp32"), ("detached", "fp32"), ("exact", "bf16-true")])
def test_dora_packed_points_train_as_their_solo_runs(tmp_path, norm, precision):
    """DoRA in a pack (PackedDoRALinear): each point starts from its solo model's weights, its
    magnitudes among them, bit for bit, and its losses are its solo run's, as far as another
    rounding order moves them from the float64 run (of the float32 function under bf16-true);
    mixed ranks, alphas and rates."""
    from lora_bench.classifier.packed_classifier import build_packed_classifier
    from lora_bench.lora.packed_layer import point_state_dict

    dora = dict(lora_variant="dora", dora_norm=norm, precision=precision)
    points = [TrainConfig(**{**BASE, **dora, "lora_rank": r, "lora_alpha": a, "learning_rate": lr})
              for r, a, lr in ((4, 8.0, 5e-4), (9, 3.0, 1e-3))]
    packed = build_packed_classifier(points, cache_dir=tmp_path / "cache", progress=False)
    for p, cfg in enumerate(points):
        mine = point_state_dict(packed, p)
        theirs = build_classifier(cfg, cache_dir=tmp_path / "cache", progress=False).state_dict(keep_vars=True)
        assert mine.keys() == theirs.keys() and any(k.endswith(".m") for k in mine)
        for key in theirs:
            assert torch.equal(mine[key], theirs[key]), key
            assert mine[key].requires_grad == theirs[key].requires_grad, key
    _assert_pack_trains_as_solo(points, tmp_path, f"DoRA ({norm} norm)")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16-true"])
def test_loraplus_packed_points_train_as_their_solo_runs(tmp_path, precision):
    """LoRA+ in a pack: each point's stacked B at its own rate times its own ratio (1 for a point
    without LoRA+), everything else at its rate, in the pack's optimizer (under bf16-true over
    float32 master copies); each point's losses are its solo run's, as far as another rounding order
    moves them from the float64 run."""
    points = [TrainConfig(**{**BASE, "precision": precision, "loraplus_lr_ratio": q, "learning_rate": lr})
              for q, lr in ((16.0, 5e-4), (1.0, 1e-3), (4.0, 2e-4))]
    built = build_model(points, torch.device("cpu"), cache_dir=tmp_path / "cache", progress=False)
    opt = build_optimizer(built.model, points)
    assert opt_groups_cover(built.model, opt) and [g["lrs"] for g in opt.param_groups] == [
        [5e-4, 1e-3, 2e-4], [16 * 5e-4, 1e-3, 4 * 2e-4]]
    _assert_pack_trains_as_solo(points, tmp_path, "LoRA+")
