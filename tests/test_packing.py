"""Packing (lora_bench.lora.packed, lora_bench.classifier.packed, lora_bench.train.pack): a packed
point trains as its solo run does. Its initial head and adapters are its solo run's, bit for bit;
a packed layer computes each adapter's solo layer; and on the tiny model each point's per-step
losses, periodic losses and accuracies match its solo run's, as far as another rounding order of
the same function can move them from the float64 evaluation of the solo run
(numerics.same_function_tol), with mixed ranks, alphas, learning rates and weight decays."""

from __future__ import annotations

import copy
import json

import pandas as pd
import pytest
import torch
import torch.nn as nn
from numerics import assert_same_function, float64_runs
from rich.console import Console
from tiny import SAMPLE

from lora_bench.classifier.book import build_classifier
from lora_bench.classifier.packed import build_packed_classifier
from lora_bench.config import TrainConfig
from lora_bench.errors import UsageError
from lora_bench.lora import LinearWithLoRA
from lora_bench.lora.packed import PackedLoRALinear, point_parameters, point_state_dict
from lora_bench.train.pack import PackPoint, execute_pack, pack_problem
from lora_bench.train.run import execute_run

BASE = dict(model_size="tiny", weights="random", trainable_layers="lora", device="cpu", data_file=str(SAMPLE),
            num_epochs=2, eval_freq=4, eval_iter=2, warmup_steps=1)  # two epochs of the sample's batches
# mixed ranks (4, 8, 4: the rank-4 group is not every point), alphas, learning rates, weight decays
POINTS = [dict(lora_rank=4, lora_alpha=8.0, learning_rate=5e-4, weight_decay=0.1),
          dict(lora_rank=8, lora_alpha=16.0, learning_rate=1e-3, weight_decay=0.0),
          dict(lora_rank=4, lora_alpha=2.0, learning_rate=2e-4, weight_decay=0.5)]


def cfgs(points=POINTS, **kw) -> list[TrainConfig]:
    return [TrainConfig(**{**BASE, **kw, **p}) for p in points]


def test_packed_points_start_from_their_solo_weights(cache_dir):
    """Every tensor of each point, under its solo model's names, equals its solo model's bit for
    bit; the trainable ones are exactly the solo model's trainable ones."""
    points = cfgs()
    packed = build_packed_classifier(points, cache_dir=cache_dir, progress=False)
    for p, cfg in enumerate(points):
        solo = build_classifier(cfg, cache_dir=cache_dir, progress=False)
        mine = point_state_dict(packed, p)
        theirs = solo.state_dict(keep_vars=True)
        assert mine.keys() == theirs.keys()
        for name, t in theirs.items():
            assert torch.equal(mine[name], t), name
            assert mine[name].requires_grad == t.requires_grad, name
        trainable = {id(t) for t in point_parameters(packed, p)}
        assert trainable == {id(mine[n]) for n, t in theirs.items() if t.requires_grad}


@pytest.mark.parametrize("ranks, shared", [((3, 5, 3), True), ((4, 4), True), ((2, 6), False)])
def test_packed_layer_computes_each_solo_layer(ranks, shared):
    """Output and every gradient of a packed layer, per point, against that point's own
    LinearWithLoRA (float32), within another rounding order's distance from float64."""
    torch.manual_seed(0)
    k, n_out, rows, t = 12, 10, 3, 5
    base = nn.Linear(k, n_out)
    solos = []
    for p, r in enumerate(ranks):
        layer = LinearWithLoRA(copy.deepcopy(base) if shared else nn.Linear(k, n_out), r, 1.5 + p)
        layer.lora.B.data.normal_()
        layer.linear.requires_grad_(not shared)
        solos.append(layer)
    adapters = [copy.deepcopy(s.lora) for s in solos]
    packed = (PackedLoRALinear(adapters, linear=copy.deepcopy(base).requires_grad_(False)) if shared
              else PackedLoRALinear(adapters, heads=[copy.deepcopy(s.linear) for s in solos]))
    x = torch.randn(len(ranks) * rows, t, k, requires_grad=True)
    g = torch.randn(len(ranks) * rows, t, n_out)
    y = packed(x)
    y.backward(g)
    for p, solo in enumerate(solos):
        own = slice(p * rows, (p + 1) * rows)
        results = {}
        for name, layer, dtype in (("want", solo, torch.float32), ("ref", copy.deepcopy(solo).double(), torch.float64)):
            xp = x[own].detach().to(dtype).requires_grad_()
            yp = layer(xp)
            yp.backward(g[own].to(dtype))
            results[name] = {"y": yp, "x": xp.grad, "A": layer.lora.A.grad, "B": layer.lora.B.grad,
                             **({} if shared else {"W": layer.linear.weight.grad, "b": layer.linear.bias.grad})}
        got = {"y": y[own], "x": x.grad[own], "A": packed.adapters[p].A.grad, "B": packed.adapters[p].B.grad,
               **({} if shared else {"W": packed.heads[p].weight.grad, "b": packed.heads[p].bias.grad})}
        assert_same_function(got, results["want"], results["ref"], what=f"point {p} (rank {ranks[p]})")


def _solo(cfg, tmp_path, cache_dir, run_id, context=None):
    results = tmp_path / "solo"
    if context is None:
        execute_run(cfg, results_dir=results, run_id=run_id, console=Console(quiet=True), progress=False,
                    cache_dir=cache_dir)
    else:
        with context:
            execute_run(cfg, results_dir=results, run_id=run_id, console=Console(quiet=True), progress=False,
                        cache_dir=cache_dir)
    record = json.loads((results / run_id / "run.json").read_text())
    steps = pd.read_csv(results / run_id / "steps.csv")
    return record, steps


def _trajectory(record, steps) -> torch.Tensor:
    """Every loss a run measured, in float64: its per-step training losses, then its periodic ones."""
    return torch.tensor(list(steps["loss"]) + record["train_losses"] + record["val_losses"], dtype=torch.float64)


def test_packed_points_train_as_their_solo_runs(tmp_path, cache_dir):
    points = cfgs()
    ids = [f"p{i}" for i in range(len(points))]
    rows = execute_pack([PackPoint(c, i) for c, i in zip(points, ids)], results_dir=tmp_path / "pack",
                        console=Console(quiet=True), progress=False, cache_dir=cache_dir)
    assert [r["status"] for r in rows] == ["done"] * len(points)
    table = pd.read_csv(tmp_path / "pack" / "runs.csv").set_index("run_id")
    assert set(table["pack_size"]) == {len(points)} and table["pack_id"].nunique() == 1
    for i, (cfg, run_id) in enumerate(zip(points, ids)):
        want, want_steps = _solo(cfg, tmp_path, cache_dir, f"s{i}")
        ref, ref_steps = _solo(cfg, tmp_path, cache_dir, f"d{i}", float64_runs())
        got = json.loads((tmp_path / "pack" / run_id / "run.json").read_text())
        got_steps = pd.read_csv(tmp_path / "pack" / run_id / "steps.csv")
        assert list(got_steps["step"]) == list(want_steps["step"])
        assert list(got_steps["epoch"]) == list(want_steps["epoch"]) and set(want_steps["epoch"]) == {1, 2}
        assert_same_function(_trajectory(got, got_steps), _trajectory(want, want_steps), _trajectory(ref, ref_steps),
                             what=f"point {i} ({cfg.lora_rank=}, {cfg.learning_rate=}, {cfg.weight_decay=}) losses")
        assert got["train_accs"] == want["train_accs"] and got["val_accs"] == want["val_accs"]
        row = table.loc[run_id]
        for col in ("train_acc", "val_acc", "test_acc", "steps", "trainable_params", "total_params", "lora_rank"):
            assert row[col] == want["row"][col], col
        assert (got_steps["share_step_ms"] * len(points) - got_steps["step_ms"]).abs().max() < 1e-9
        assert row["share_step_ms_median"] == pytest.approx(row["step_ms_median"] / len(points), rel=1e-12)


def test_the_points_losses_differ_from_each_other(tmp_path, cache_dir):
    """The comparison above is not vacuous: the points' settings move their losses apart."""
    points = cfgs(max_steps=6, eval_freq=0, skip_final_eval=True)
    execute_pack([PackPoint(c, f"p{i}") for i, c in enumerate(points)], results_dir=tmp_path,
                 console=Console(quiet=True), progress=False, cache_dir=cache_dir)
    losses = [tuple(pd.read_csv(tmp_path / f"p{i}" / "steps.csv")["loss"]) for i in range(len(points))]
    assert len(set(losses)) == len(points)


def test_incompatible_runs_do_not_pack(tmp_path, cache_dir):
    a, b = cfgs(POINTS[:2])
    assert pack_problem([a, b]) is None
    assert "batch_size" in pack_problem([a, b.replace(batch_size=4)])
    assert "lora-kernel" in pack_problem([a, b.replace(trainable_layers="lora-kernel")])
    with pytest.raises(UsageError, match="cannot train as one pack.*seed"):
        execute_pack([PackPoint(a, "x"), PackPoint(b.replace(seed=7), "y")], results_dir=tmp_path,
                     console=Console(quiet=True), progress=False, cache_dir=cache_dir)
    assert not (tmp_path / "runs.csv").exists()


def test_a_failing_pack_marks_every_point_failed(tmp_path, cache_dir, monkeypatch):
    import lora_bench.train.pack as pack_mod

    def broken(*args, **kwargs):
        raise RuntimeError("the step broke")

    monkeypatch.setattr(pack_mod, "train_pack", broken)
    with pytest.raises(RuntimeError, match="the step broke"):
        execute_pack([PackPoint(c, f"p{i}") for i, c in enumerate(cfgs())], results_dir=tmp_path,
                     console=Console(quiet=True), progress=False, cache_dir=cache_dir)
    table = pd.read_csv(tmp_path / "runs.csv")
    assert sorted(table["run_id"]) == ["p0", "p1", "p2"] and set(table["status"]) == {"failed"}
    assert all("its pack of 3 runs failed: RuntimeError: the step broke" in e for e in table["error"])
