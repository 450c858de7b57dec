"""trainable_layers=frozen, the floor of a parameter-efficient step: no weight of the transformer
blocks trains, and none gets a gradient, but the gradient goes back through every block to the
position embedding, which trains with the classification head. CPU tests with the tiny model; a
GPU-marked test for CUDA graphs."""

from __future__ import annotations

import copy
from unittest import mock

import pandas as pd
import pytest
import torch
from numerics import assert_same_function, rel_err
from rich.console import Console

from lora_bench.classifier.book import make_trainable
from lora_bench.config import TrainConfig, solo_reason
from lora_bench.errors import ConfigError
from lora_bench.model.gpt2 import build_random_model, gpt_config
from lora_bench.train import build
from lora_bench.train.memory import estimate
from lora_bench.train.run import execute_run


def _run(cfg: TrainConfig, tmp_path, run_id: str):
    """The run's row, its losses, and its model before and after training (the model the run
    built, as ``train.build`` built it, and a copy of its values then)."""
    built, real = [], build.build_classifier

    def build_and_keep(cfg, **kw):
        built.append(real(cfg, **kw))
        built.append(copy.deepcopy(built[0]))
        return built[0]

    with mock.patch.object(build, "build_classifier", build_and_keep):
        row = execute_run(cfg, results_dir=tmp_path, run_id=run_id, console=Console(quiet=True), progress=False,
                          cache_dir=tmp_path / "cache")
    losses = pd.read_csv(tmp_path / run_id / "steps.csv")["loss"].tolist()
    return row, losses, built[1], built[0]


def _changed(before: torch.nn.Module, after: torch.nn.Module) -> set[str]:
    """The parameters whose values changed, each compared in the dtype the run holds it in (a
    precision's cast is no change); a stored base's weights are no parameters and cannot change."""
    now = {name: p.detach().cpu() for name, p in after.named_parameters()}
    return {name for name, p in before.named_parameters()
            if name in now and not torch.equal(p.detach().to(now[name].dtype), now[name])}


def _floor_params(model_size: str = "tiny") -> int:
    """The position embedding (context length × width) and the 2-class head (weights and biases)."""
    m = gpt_config(model_size)
    return m.context_length * m.emb_dim + 2 * m.emb_dim + 2


@pytest.mark.parametrize("mode", [{}, {"precision": "bf16"}, {"precision": "bf16-true"}, {"base_dtype": "int8"},
                                  {"attention": "sdpa", "ops": "fused", "optimizer": "fused"}])
def test_frozen_trains_only_the_position_embedding_and_the_head(tiny_cfg, tmp_path, mode):
    """After the steps every weight of the blocks (and the token embedding, the final norm) is what
    it was, the position embedding and the head are not; the row counts exactly those two."""
    cfg = tiny_cfg.replace(trainable_layers="frozen", learning_rate=1e-3, **mode)
    row, losses, before, after = _run(cfg, tmp_path, "frozen")
    assert row["status"] == "done" and len(losses) == cfg.max_steps
    assert _changed(before, after) == {"pos_emb.weight", "out_head.weight", "out_head.bias"}
    assert not any(p.requires_grad for p in after.trf_blocks.parameters())
    assert row["trainable_params"] == _floor_params() == estimate(cfg).trainable
    assert row["cfg_trainable_layers"] == "frozen"


def test_the_gradient_reaches_the_position_embedding_through_every_block():
    """The floor's backward: no weight of the blocks gets a gradient, and the position embedding's
    is the one full fine-tuning computes at the same point (the same backward through every
    block, as close to float64 as another rounding order; numerics.assert_same_function). Nonzero
    where the input has positions, zero beyond."""
    models = {}
    for layers in ("frozen", "all"):
        m = build_random_model(gpt_config("tiny", context_length=32), seed=1)
        make_trainable(m, TrainConfig(model_size="tiny", weights="random", trainable_layers=layers, device="cpu"))
        models[layers] = m
    models["all"].load_state_dict(models["frozen"].state_dict())
    models["all64"] = copy.deepcopy(models["all"]).double()
    x = torch.randint(0, 50257, (3, 10))
    for m in models.values():
        torch.nn.functional.cross_entropy(m(x)[:, -1, :], torch.tensor([0, 1, 1])).backward()
    floor = models["frozen"]
    assert all(p.grad is None for p in floor.trf_blocks.parameters())
    assert floor.tok_emb.weight.grad is None and floor.final_norm.scale.grad is None
    grad = floor.pos_emb.weight.grad
    assert grad[:10].abs().amax(dim=1).min() > 0 and grad[10:].abs().max() == 0
    assert_same_function(grad, models["all"].pos_emb.weight.grad, models["all64"].pos_emb.weight.grad,
                         what="position embedding's gradient")
    # the blocks' own part: without them (the head on the embeddings) the gradient is another one
    blockless = copy.deepcopy(floor)
    blockless.trf_blocks = torch.nn.Sequential()
    blockless.pos_emb.weight.grad = None
    torch.nn.functional.cross_entropy(blockless(x)[:, -1, :], torch.tensor([0, 1, 1])).backward()
    assert rel_err(blockless.pos_emb.weight.grad, grad) > 1e-2


def test_frozen_is_refused_where_it_has_no_meaning():
    """A pack trains adapters (frozen has none); the transformers peer has no floor of its own; a
    stored base takes it (nothing in the blocks trains)."""
    cfg = TrainConfig(weights="random", trainable_layers="frozen")
    assert "trains no adapter" in solo_reason(cfg)
    with pytest.raises(ConfigError) as err:
        cfg.replace(implementation="hf").validate()
    assert "trainable_layers='frozen' has no Hugging Face peer (the floor is measured on lora-bench's" in str(err.value)
    cfg.replace(base_dtype="nf4").validate()


def test_compiled_frozen_run_matches_eager_on_cpu(tiny_cfg, tmp_path, monkeypatch):
    """torch.compile (aot_eager, fast on the CPU) of the floor: the same losses as the eager run, as
    close to the float64 run as another rounding order of it (numerics.assert_same_function)."""
    import functools

    from numerics import float64_runs

    base = tiny_cfg.replace(trainable_layers="frozen", learning_rate=1e-3, max_steps=8)
    _, eager, _, _ = _run(base, tmp_path, "eager")
    with float64_runs():
        _, ref, _, _ = _run(base, tmp_path, "eager64")
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    for scope in ("model", "blocks"):
        row, got, before, after = _run(base.replace(compile=True, compile_scope=scope), tmp_path, f"compiled-{scope}")
        assert row["status"] == "done" and _changed(before, after) == {"pos_emb.weight", "out_head.weight",
                                                                      "out_head.bias"}
        assert_same_function(*(torch.tensor(t, dtype=torch.float64) for t in (got, eager, ref)), what=scope)
    torch._dynamo.reset()


# ---- GPU (marked; run on the device) ---------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "bf16-true"])
def test_frozen_in_cuda_graphs_trains_only_the_floor(tiny_cfg, tmp_path, precision):
    """The study's mode (CUDA graphs, SDPA, fused ops and AdamW, compiled blocks): the floor trains
    the position embedding and the head only, and its graphs launch fewer backward kernels than
    full fine-tuning's (no weight gradient is computed)."""
    base = tiny_cfg.replace(device="cuda", max_steps=12, learning_rate=1e-3, precision=precision, attention="sdpa",
                            ops="fused", optimizer="fused", cuda_graphs=True, compile=True, compile_scope="blocks")
    row, _, before, after = _run(base.replace(trainable_layers="frozen"), tmp_path, "frozen")
    assert row["status"] == "done" and row["trainable_params"] == _floor_params()
    assert _changed(before, after) == {"pos_emb.weight", "out_head.weight", "out_head.bias"}
    full, _, _, _ = _run(base.replace(trainable_layers="all"), tmp_path, "all")
    assert row["graph_kernels_backward"] < full["graph_kernels_backward"]
