"""A run's time estimate: its work counted as the loop runs it, its probe leaving no trace in the
run, its words before the first step, and the warm-up a short run is given."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from rich.console import Console
from tiny import SAMPLE

from lora_bench.config import TrainConfig
from lora_bench.train.context import RunContext
from lora_bench.train.estimate import SHORT_STEPS, announce, StepTimes, Work, estimate_lines, probe, run_work
from lora_bench.train.evaluate import Objective
from lora_bench.train.run import execute_run


def tiny(**kw) -> TrainConfig:
    base = dict(model_size="tiny", weights="random", trainable_layers="lora", lora_rank=4, device="cpu",
                data_file=str(SAMPLE), num_epochs=2, eval_freq=3, eval_iter=2, warmup_steps=1)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("changes", [dict(), dict(max_steps=7), dict(max_steps=4, skip_final_eval=True),
                                     dict(eval_freq=0, num_epochs=1)])
def test_the_work_counted_is_the_work_the_run_does(tmp_path, cache_dir, monkeypatch, changes):
    """Every forward the run makes is counted: with gradients, a training step; without, an
    evaluation's batch (losses or accuracies)."""
    seen = {"steps": 0, "eval": 0}
    losses, logits = Objective.losses, Objective.logits

    def counted_losses(self, *a, **kw):
        seen["steps" if torch.is_grad_enabled() else "eval"] += 1
        return losses(self, *a, **kw)

    def counted_logits(self, *a, **kw):
        seen["eval"] += 1
        return logits(self, *a, **kw)

    monkeypatch.setattr(Objective, "losses", counted_losses)
    monkeypatch.setattr(Objective, "logits", counted_logits)
    cfg = tiny(**changes)
    execute_run(cfg, results_dir=tmp_path, run_id="r", console=Console(quiet=True), progress=False,
                cache_dir=cache_dir)
    context = RunContext(cfg, cache_dir=cache_dir, progress=False)
    sizes = dict(train_batches=len(context.loaders.train), val_batches=len(context.loaders.val),
                 test_batches=len(context.loaders.test))
    assert run_work(cfg, **sizes) == Work(seen["steps"], seen["eval"])


def test_the_probe_leaves_no_trace(cache_dir):
    """After the probe, the random number generator, the gradients, the optimizer's state and the
    model's mode are as they were; and it measured something."""
    context = RunContext(tiny(trainable_layers="all"), cache_dir=cache_dir, progress=False)
    context.model.eval()
    rng = torch.get_rng_state()
    weights = {k: v.clone() for k, v in context.model.state_dict().items()}
    times = probe(context)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in context.model.parameters())
    assert not context.model.training and not context.optimizer.state
    assert all(torch.equal(v, context.model.state_dict()[k]) for k, v in weights.items())
    assert 0 < times.forward_s <= times.step_s


@pytest.mark.parametrize("layers", ["all", "lora"])
def test_a_run_with_its_estimate_computes_what_it_computes_without(tmp_path, cache_dir, layers):
    cfg = tiny(trainable_layers=layers, max_steps=6)
    runs = {}
    for estimate in (False, True):
        row = execute_run(cfg, results_dir=tmp_path, run_id=f"e{estimate}", console=Console(quiet=True),
                          progress=False, cache_dir=cache_dir, estimate=estimate)
        curves = json.loads((tmp_path / f"e{estimate}" / "run.json").read_text())
        runs[estimate] = ([curves[k] for k in ("train_losses", "val_losses", "train_accs", "val_accs")],
                          [row[k] for k in ("train_acc", "val_acc", "test_acc")])
    assert runs[True] == runs[False]  # exact: the same bits


def test_a_long_cpu_run_is_told_of_a_short_one():
    times = StepTimes(step_s=30.0, forward_s=10.0)
    short = [(f"--max-steps {SHORT_STEPS}", Work(SHORT_STEPS, 20)), ("--max-steps 10 --skip-final-eval", Work(10, 10))]
    lines = estimate_lines(tiny(), times=times, work=Work(650, 300), short=short, device=torch.device("cpu"))
    assert lines[0].startswith("estimate: about 6 h 15 min on this CPU (650 steps at 30 s, evaluation 50 min")
    assert lines[1] == f"that is long for a CPU: --max-steps {SHORT_STEPS} takes about 8 min"
    # where the final evaluation would take most of the short run, the suggestion leaves it out
    short = [("--max-steps 10", Work(10, 300)), ("--max-steps 10 --skip-final-eval", Work(10, 10))]
    lines = estimate_lines(tiny(), times=times, work=Work(650, 300), short=short, device=torch.device("cpu"))
    assert lines[1] == "that is long for a CPU: --max-steps 10 --skip-final-eval takes about 7 min"
    quick = estimate_lines(tiny(), times=StepTimes(0.1, 0.03), work=Work(650, 300), short=short,
                           device=torch.device("cpu"))
    assert quick == ["estimate: about 74 s on this CPU (650 steps at 0.1 s, evaluation 9 s; timed on a probe step "
                     "of this model)"]


def test_train_prints_its_estimate_before_its_first_step(tmp_path, run_cli):
    """With the progress display (on by default; off a terminal its plain lines); --no-progress
    leaves the probe out, as a sweep's runs do."""
    args = ("train", "--model-size", "tiny", "--weights", "random", "--device", "cpu", "--data-file", SAMPLE,
            "--trainable-layers", "lora", "--max-steps", "4", "--eval-freq", "1", "--results-dir", tmp_path)
    code, out = run_cli(*args)
    assert code == 0, out
    assert out.index("estimate: about ") < out.index("epoch 1  1/4") < out.index("Ep 1 (Step 000000)")
    code, out = run_cli(*args, "--no-progress")
    assert code == 0 and "estimate: " not in out, out


def test_a_short_run_gets_a_shorter_warm_up_and_is_told(tmp_path, run_cli):
    args = ("train", "--model-size", "tiny", "--weights", "random", "--device", "cpu", "--data-file", SAMPLE,
            "--trainable-layers", "lora", "--results-dir", tmp_path, "--no-progress")
    code, out = run_cli(*args, "--max-steps", "3", "--run-id", "short")
    assert code == 0, out
    assert "warm-up: 1 of the 3 steps left out of the timing summaries (the default is 5" in out
    run = pd.read_csv(tmp_path / "runs.csv").iloc[-1]
    assert run["warmup_steps"] == 1 and run["steps"] == 3
    assert pd.read_csv(tmp_path / "short" / "steps.csv")["warmup"].tolist() == [True, False, False]
    # a warm-up given is kept, and refused as before where no step would be measured
    code, out = run_cli(*args, "--max-steps", "3", "--warmup-steps", "5")
    assert code == 2 and "no step would be measured" in out and "warm-up:" not in out
    # a run long enough keeps the default
    from lora_bench.cli.train import scaled_warmup

    values = {"max_steps": 10, "warmup_steps": 5, "timing": "events"}
    assert scaled_warmup(values, chosen=set()) is None and values["warmup_steps"] == 5
    values = {"max_steps": 9, "warmup_steps": 5, "timing": "events"}
    assert scaled_warmup(values, chosen=set()) and values["warmup_steps"] == 4
    values = {"max_steps": 3, "warmup_steps": 5, "timing": "off"}
    assert scaled_warmup(values, chosen=set()) is None and values["warmup_steps"] == 5


def test_a_compiled_run_is_not_probed():
    """The probe would compile the model: the line says where the estimate will be instead."""
    said = []
    announce(SimpleNamespace(cfg=tiny(compile=True)), said.append)  # no model, no loaders: nothing probed
    assert said == ["estimate: after the first steps, on the progress line (a probe step would compile the model)"]


def test_a_gpu_probe_never_stands_on_its_first_try():
    """On a GPU the first try compiles and tunes kernels (tens of seconds, once): a second try is
    taken whatever the first cost; on a CPU the budget alone decides; never past PROBE_TRIES."""
    from lora_bench.train.estimate import PROBE_BUDGET_S, PROBE_TRIES, probe_again

    assert probe_again(1, 36.0, "cuda") and not probe_again(2, 36.1, "cuda")
    assert not probe_again(1, 36.0, "cpu") and probe_again(1, PROBE_BUDGET_S / 2, "cpu")
    assert not probe_again(PROBE_TRIES, 0.0, "cuda") and not probe_again(PROBE_TRIES, 0.0, "cpu")
