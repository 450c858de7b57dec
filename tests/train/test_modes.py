"""Execution modes reproduce book mode: in float32, a mode's loss trajectory is as close to book
mode's float64 evaluation as book mode's own float32 one (tests/numerics.py); bf16 is close;
bf16-true is within the bound its counted roundings to bfloat16 give against float64.
CPU tests for what runs here; GPU-marked tests for CUDA graphs, torch.compile and bf16 on CUDA."""

from __future__ import annotations

import copy
import json
from unittest import mock

import pandas as pd
import pytest
import torch
from numerics import assert_same_function, float64_runs, without_key_bias
from rich.console import Console

from lora_bench.config import TrainConfig
from lora_bench.errors import ConfigError
from lora_bench.model.gpt2 import build_random_model, gpt_config
from lora_bench.train.run import execute_run


def _losses(cfg: TrainConfig, tmp_path, run_id: str) -> tuple[list[float], dict]:
    row = execute_run(cfg, results_dir=tmp_path, run_id=run_id, console=Console(quiet=True), progress=False,
                      cache_dir=tmp_path / "cache")
    return pd.read_csv(tmp_path / run_id / "steps.csv")["loss"].tolist(), row


def _losses64(cfg: TrainConfig, tmp_path, run_id: str) -> list[float]:
    """The run's losses evaluated in float64 (numerics.float64_runs), checked to have run so."""
    with float64_runs() as built:
        losses, _ = _losses(cfg, tmp_path, run_id)
    assert len(built) == 1 and {p.dtype for p in built[0].parameters()} == {torch.float64}
    return losses


def _assert_same_run(got: list[float], want: list[float], ref: list[float], what: str = "",
                     dtype: torch.dtype = torch.float32) -> None:
    """``got`` is another rounding order of the run whose ``dtype`` losses are ``want`` and float64
    losses ``ref`` (numerics.same_function_tol)."""
    assert 0 < len(got) == len(want) == len(ref)
    assert_same_function(*(torch.tensor(t, dtype=torch.float64) for t in (got, want, ref)), dtype=dtype, what=what)


def _grads(model) -> dict[str, torch.Tensor]:
    return without_key_bias({name: p.grad for name, p in model.named_parameters() if p.requires_grad})


def _rel(a: list[float], b: list[float]) -> float:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((ta - tb).norm() / tb.norm())


@pytest.mark.parametrize("layers", ["all", "lora"])
def test_sdpa_and_fused_ops_match_book_on_cpu(tiny_cfg, tmp_path, layers):
    """25 AdamW steps: each mode's loss trajectory is as close to book mode's float64 evaluation as
    book mode's own float32 one (numerics.same_function_tol; fused GELU's √(2/π) differs from book's
    float32-rounded constant by 1e-8 relative, well under the bound's λu)."""
    base = tiny_cfg.replace(trainable_layers=layers, max_steps=25, learning_rate=1e-3, lora_rank=4, lora_alpha=8.0)
    book, _ = _losses(base, tmp_path, f"{layers}-book")
    ref = _losses64(base, tmp_path, f"{layers}-book64")
    for attention, ops in (("sdpa", "book"), ("book", "fused"), ("sdpa", "fused")):
        got, _ = _losses(base.replace(attention=attention, ops=ops), tmp_path, f"{layers}-{attention}-{ops}")
        _assert_same_run(got, book, ref, what=f"{attention}, {ops}")


def test_bf16_autocast_close_to_book_on_cpu(tiny_cfg, tmp_path):
    base = tiny_cfg.replace(trainable_layers="lora", max_steps=20, learning_rate=1e-3, lora_rank=4, lora_alpha=8.0)
    book, _ = _losses(base, tmp_path, "fp32")
    got, row = _losses(base.replace(precision="bf16"), tmp_path, "bf16")
    assert 0 < _rel(got, book) < 3e-2  # bf16: close, not equal
    assert row["status"] == "done"


# bf16-true: roundings to bfloat16 on the longest path from a token to a logit, per op (each op's
# output is rounded once; a linear layer's bfloat16 weight is a rounding of its own beside its
# output's; the float32 accumulation inside the products and norms is far below a bfloat16 unit)
BF16_TRUE_ROUNDINGS = {
    "embeddings": 2,  # the token embedding's stored value, the sum with the position embedding
    "linear": 2,  # the weight, the output (the bias added in float32 inside the product)
    "residual": 1,
    "fused norm": 1, "fused gelu": 1, "sdpa": 1,  # one kernel each, float32 inside
    # book LayerNorm: var, + eps, sqrt, divide, · scale, + shift, and the scale's stored value
    "book norm": 7,
    "book gelu": 7,  # x³, · 0.044715, + x, · √(2/π), tanh, 1 +, · 0.5x
    "book attention": 4,  # q·kᵀ, / √d, softmax, · v
}


def bf16_true_roundings(cfg: TrainConfig) -> int:
    """The roundings on the tiny model's longest path under bf16-true (BF16_TRUE_ROUNDINGS): the
    embeddings, per block a norm, the query projection, attention, the output projection, the
    residual add, a norm, the MLP's two layers around GELU, the residual add; the final norm and
    the head."""
    r, kind = BF16_TRUE_ROUNDINGS, cfg.ops
    attention = r["sdpa"] if cfg.attention == "sdpa" else r["book attention"]
    block = (2 * r[f"{kind} norm"] + 4 * r["linear"] + attention + 2 * r["residual"] + r[f"{kind} gelu"])
    return r["embeddings"] + gpt_config(cfg.model_size).n_layers * block + r[f"{kind} norm"] + r["linear"]


@pytest.mark.parametrize("layers,ops", [("all", "fused"), ("lora", "fused"), ("lora", "book")])
def test_bf16_true_against_float64_on_cpu(tiny_cfg, tmp_path, layers, ops):
    """15 AdamW steps in bf16-true against the same run in float64. Each step's loss comes from a
    forward whose values are rounded to bfloat16 along a chain of n roundings (bf16_true_roundings;
    the loss itself is computed in float32 from float32 logits): each rounding moves what it rounds
    by at most u = 2^-8 relative, so the losses may be (n + 1)·u off (numerics.rounded_input_tol).
    The weights each step starts from differ too, by the earlier updates' differences: AdamW's
    update is invariant to the gradient's scale, so a gradient off by ε relative moves an update
    by at most about ε·lr, and 15 steps at lr 1e-3 leave a weight off by at most 0.015·ε, small
    beside the forward's own error on the tiny model's weights (0.1 to 1; an adapter's B starts
    at zero and grows by those updates, so its error stays ε relative to what it adds). The run is
    not float32 in disguise: its losses are not fp32's."""
    from numerics import rounded_input_tol

    base = tiny_cfg.replace(trainable_layers=layers, max_steps=15, eval_freq=0, learning_rate=1e-3, lora_rank=4,
                            lora_alpha=8.0, attention="sdpa" if ops == "fused" else "book", ops=ops)
    ref = _losses64(base, tmp_path, "float64")
    fp32, _ = _losses(base, tmp_path, "fp32")
    got, row = _losses(base.replace(precision="bf16-true"), tmp_path, "bf16-true")
    assert row["status"] == "done" and row["cfg_precision"] == "bf16-true"
    bound = rounded_input_tol(torch.bfloat16, bf16_true_roundings(base))
    assert 0 < _rel(got, ref) <= bound, (_rel(got, ref), bound)
    assert _rel(got, fp32) > 0


def test_bf16_true_holds_the_model_in_bf16_and_the_masters_in_fp32(tiny_cfg, tmp_path):
    """Every parameter and buffer of the model in bfloat16, its logits float32 (the loss is
    computed from them), the optimizer's masters float32 and only the trainable parameters'; a
    run with a stored base keeps its stored weights as they are."""
    from lora_bench.lora.quantized import stored_bytes
    from lora_bench.train.context import RunContext
    from lora_bench.train.master_weights import MasterWeights

    ctx = RunContext(tiny_cfg.replace(trainable_layers="lora", precision="bf16-true"), cache_dir=tmp_path,
                     progress=False)
    model = ctx.model
    assert {t.dtype for t in (*model.parameters(), *model.buffers())} == {torch.bfloat16}
    assert model(torch.randint(0, 50257, (2, 5))).dtype is torch.float32
    opt = ctx.optimizer
    assert isinstance(opt, MasterWeights) and opt.params == [p for p in model.parameters() if p.requires_grad]
    assert {m.dtype for m in opt.masters} == {torch.float32}
    stored = RunContext(tiny_cfg.replace(trainable_layers="lora", precision="bf16-true", base_dtype="int8"),
                        cache_dir=tmp_path, progress=False).model
    layer = stored.trf_blocks[0].att.W_query.linear
    assert stored_bytes(layer.weight_stored) < 2 * layer.in_features * layer.out_features  # int8, not bf16
    assert stored(torch.randint(0, 50257, (2, 5))).dtype is torch.float32


def test_bf16_true_is_refused_where_it_cannot_run():
    """The transformers peer casts its own model; a pack takes bf16-true (its optimizer over float32
    master copies, tests/train/test_packing.py)."""
    from lora_bench.config import solo_reason

    cfg = TrainConfig(weights="random", precision="bf16-true", trainable_layers="lora")
    with pytest.raises(ConfigError) as err:
        cfg.replace(implementation="hf").validate()
    assert "precision=bf16-true with implementation=hf is refused: the peer's model is built" in str(err.value)
    assert solo_reason(cfg) is None and solo_reason(cfg.replace(precision="bf16")) is None
    cfg.replace(cuda_graphs=True, compile=True, compile_scope="blocks", base_dtype="nf4").validate()


def test_compiled_bf16_true_matches_eager_on_cpu(tiny_cfg, tmp_path, monkeypatch):
    """torch.compile (aot_eager, fast on the CPU) of a bf16-true run, whole model and per block: as
    close to the float64 run as another rounding order of the eager bf16-true run
    (numerics.assert_same_function at bfloat16's unit)."""
    import functools

    base = tiny_cfg.replace(trainable_layers="lora", max_steps=8, eval_freq=0, learning_rate=1e-3, lora_rank=4,
                            lora_alpha=8.0, attention="sdpa", ops="fused")
    ref = _losses64(base, tmp_path, "float64")
    eager, _ = _losses(base.replace(precision="bf16-true"), tmp_path, "eager")
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    for scope in ("model", "blocks"):
        got, row = _losses(base.replace(precision="bf16-true", compile=True, compile_scope=scope), tmp_path, scope)
        assert row["status"] == "done"
        _assert_same_run(got, eager, ref, what=scope, dtype=torch.bfloat16)
    torch._dynamo.reset()


def test_fused_ops_are_numerically_the_book_ops():
    a = build_random_model(gpt_config("tiny"), seed=1).double()
    b = build_random_model(gpt_config("tiny", ops="fused", attention="sdpa"), seed=1).double()
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 50257, (2, 17))
    # the book GELU builds sqrt(2/pi) from a float32 tensor: 1e-8-level difference even in float64
    assert torch.allclose(a(x), b(x), rtol=1e-7, atol=1e-7)
    assert not torch.equal(a(x), b(x))
    c = build_random_model(gpt_config("tiny", disable_causal_mask=True, attention="sdpa"), seed=1).double()
    d = build_random_model(gpt_config("tiny", disable_causal_mask=True), seed=1).double()
    d.load_state_dict(c.state_dict())
    assert torch.allclose(c(x), d(x), rtol=1e-10, atol=1e-10)


def test_impossible_combinations_are_refused():
    cfg = TrainConfig(weights="random", cuda_graphs=True, device="cpu", no_padding=True, batch_size=1,
                      optimizer="adam")
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    msg = str(e.value)
    assert "cuda_graphs needs a CUDA device" in msg and "static shapes" in msg
    assert "optimizer='adam' is not allowed; choose one of: book, fused" in msg
    assert "compile_scope='blocks' needs compile" in str(
        pytest.raises(ConfigError, TrainConfig(weights="random", compile_scope="blocks").validate).value)
    # compile inside captured graphs is a valid combination (the graphs replay compiled kernels)
    TrainConfig(weights="random", cuda_graphs=True, compile=True).validate()
    # line_profiler finds no Python lines inside a replayed graph: refused; a kernel profile of a
    # graphed step runs its steps one by one with the plans a capture chooses (one process)
    msg = str(pytest.raises(ConfigError, TrainConfig(weights="random", cuda_graphs=True, profile="line").validate).value)
    assert "profile=line cannot see inside a replayed CUDA graph" in msg and "without cuda_graphs" in msg
    for prof in ("torch", "kernels"):
        TrainConfig(weights="random", cuda_graphs=True, profile=prof).validate()
        msg = str(pytest.raises(ConfigError, TrainConfig(weights="random", cuda_graphs=True, profile=prof, nproc=2,
                                                         batch_size=8).validate).value)
        assert f"profile={prof} with cuda_graphs profiles one process's graphed step" in msg, msg
    TrainConfig(weights="random", profile="kernels", nproc=2, batch_size=8).validate()  # without graphs: as before


@pytest.mark.parametrize("layers", ["all", "lora-kernel"])
def test_block_scoped_compile_compiles_once_for_any_depth(layers):
    """compile_scope=blocks: every transformer block compiled in place; a deeper model costs no
    more compiles (one graph for the first block, whose input needs no gradient, one reused by
    all the others), and the outputs and gradients are the eager ones."""
    from lora_bench.classifier.book import make_trainable
    from lora_bench.train.setup import compile_model

    counts = {}
    for n_layers in (3, 6):
        torch._dynamo.reset()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch.manual_seed(0)
        model = build_random_model(gpt_config("tiny", n_layers=n_layers, context_length=32), seed=1)
        ref = build_random_model(gpt_config("tiny", n_layers=n_layers, context_length=32), seed=1)
        for m in (model, ref):
            torch.manual_seed(2)
            make_trainable(m, TrainConfig(model_size="tiny", weights="random", trainable_layers=layers,
                                          lora_rank=4, lora_alpha=2.0, device="cpu"))
        ref.load_state_dict(model.state_dict())
        ref64 = copy.deepcopy(ref).double()
        assert compile_model(model, "blocks", backend=backend) is model
        x = torch.randint(0, 50257, (2, 10))
        outs = [m(x) for m in (model, ref, ref64)]
        assert_same_function(*outs, what="outputs")
        for out in outs:
            out[:, -1].sum().backward()
        assert_same_function(*map(_grads, (model, ref, ref64)), what="gradients")
        counts[n_layers] = len(graphs)
    assert counts[3] == counts[6] <= 2
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_compiles_lora_kernel_blocks_on_cpu():
    """The real compiler (inductor, the default backend) lowers the lora-kernel custom ops with
    their fake implementations and autograd formula: forward and LoRA gradients equal eager's."""
    from lora_bench.lora import inject_lora
    from lora_bench.lora.kernel import LinearWithLoRAKernel
    from lora_bench.train.setup import compile_model

    torch._dynamo.reset()
    models = []
    for _ in range(2):
        m = build_random_model(gpt_config("tiny", context_length=32, n_layers=2), seed=1)
        m.requires_grad_(False)
        torch.manual_seed(2)
        inject_lora(m, cls=LinearWithLoRAKernel, rank=4, alpha=2.0)
        models.append(m)
    model, ref = models
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(std=0.1)  # B starts at zero: give every gradient something to carry
    ref.load_state_dict(model.state_dict())
    ref64 = copy.deepcopy(ref).double()
    x = torch.randint(0, 50257, (2, 12))
    outs = [compile_model(model, "blocks")(x), ref(x), ref64(x)]
    assert_same_function(*outs, what="outputs")  # inductor's fused kernels: another rounding order
    for out in outs:
        out[:, -1].sum().backward()
    grads = [_grads(m) for m in (model, ref, ref64)]
    assert_same_function(*grads, what="gradients")
    assert len(grads[0]) == 2 * (2 * 6 + 1)  # A and B of every wrapped linear (6 per block, and the head)
    torch._dynamo.reset()


@pytest.mark.parametrize("layers", ["all", "lora"])
def test_fused_optimizer_matches_book_on_cpu(tiny_cfg, tmp_path, layers):
    base = tiny_cfg.replace(trainable_layers=layers, max_steps=20, learning_rate=1e-3, lora_rank=4, lora_alpha=8.0)
    book, _ = _losses(base, tmp_path, f"{layers}-book")
    ref = _losses64(base, tmp_path, f"{layers}-book64")
    fused, row = _losses(base.replace(optimizer="fused"), tmp_path, f"{layers}-fused")
    assert row["cfg_optimizer"] == "fused"
    _assert_same_run(fused, book, ref, what="fused AdamW")


# ---- GPU (marked; run on the device) ---------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16-true"])
@pytest.mark.parametrize("layers", ["all", "lora", "frozen"])
def test_cuda_graphs_match_eager(tiny_cfg, tmp_path, layers, precision):
    """The replayed graphs run the eager step's kernels on the same values: their losses equal, bit
    for bit, those of the eager run with the same AdamW, the capturable one (its step count on the
    device). That AdamW is another rounding order of the default update, and over 30 steps its
    trajectory may land much further from float64 than the default's (on an H200 the tiny LoRA
    run's losses: 4.5e-6 against 2.9e-7 relative, past SPREAD times the default's), so the check
    that the capture changes nothing is the exact one, against the eager run it replays."""
    from lora_bench.train import build

    base = tiny_cfg.replace(device="cuda", trainable_layers=layers, max_steps=30, eval_freq=10,
                            learning_rate=1e-3, lora_rank=4, lora_alpha=8.0, precision=precision)
    _, eager_row = _losses(base, tmp_path, f"{layers}-eager")
    real, asked = build.optimizer_options, []

    def capturable(cfg):
        asked.append(cfg)
        return {**real(cfg), "capturable": True}

    with mock.patch.object(build, "optimizer_options", capturable):
        eager_capturable, _ = _losses(base, tmp_path, f"{layers}-eager-capturable")
    assert asked  # the eager run built the capturable AdamW
    graphed, row = _losses(base.replace(cuda_graphs=True), tmp_path, f"{layers}-graphs")
    assert len(graphed) == 30 and graphed == eager_capturable
    assert row["status"] == "done" and row["step_ms_median"] > 0
    # the captured graphs' kernels, counted from their node lists, and the capture's one-time cost
    fwd, bwd, opt = (row[f"graph_kernels_{p}"] for p in ("forward", "backward", "optimizer"))
    assert fwd >= 2 * 4 and bwd > fwd and opt >= 1, (fwd, bwd, opt)  # >= a few kernels per block (2 blocks)
    assert 0 < row["graph_capture_s"] < row["training_time_s"]
    assert all(eager_row.get(f"graph_kernels_{p}") is None for p in ("forward", "backward", "optimizer"))


@pytest.mark.gpu
@pytest.mark.parametrize("layers", ["all", "lora", "lora-kernel"])
def test_graph_replayed_evaluation_matches_eager(tiny_cfg, tmp_path, layers):
    """Periodic eval losses and final accuracies: replayed eval graphs give the eager numbers."""
    base = tiny_cfg.replace(device="cuda", trainable_layers=layers, max_steps=12, eval_freq=4, eval_iter=3,
                            skip_final_eval=False, lora_rank=4, lora_alpha=8.0, precision="bf16",
                            attention="sdpa", ops="fused")
    _, eager = _losses(base, tmp_path, f"{layers}-eager")
    _, graphed = _losses(base.replace(cuda_graphs=True, optimizer="fused"), tmp_path, f"{layers}-graphs")
    ev = json.loads((tmp_path / f"{layers}-eager" / "run.json").read_text())
    gr = json.loads((tmp_path / f"{layers}-graphs" / "run.json").read_text())
    assert len(gr["val_losses"]) == len(ev["val_losses"]) == 3
    assert _rel(gr["val_losses"], ev["val_losses"]) < 3e-2  # bf16: capturable fused AdamW rounds differently
    for k in ("train_acc", "val_acc", "test_acc"):
        assert abs(graphed[k] - eager[k]) <= 5.0, k


@pytest.mark.gpu
def test_graphed_eval_replays_the_eager_forward(tiny_cfg):
    """Same weights, same inputs: the replayed eval forward equals the eager one exactly, for each
    captured shape, and follows in-place weight updates."""
    from lora_bench.train.graphs import GraphedEval

    torch.manual_seed(0)
    model = build_random_model(gpt_config("tiny", attention="sdpa", ops="fused"), seed=1).cuda()
    ev = GraphedEval(model).eval()
    with torch.no_grad():
        for shape in ((8, 20), (3, 20), (8, 20)):
            x = torch.randint(0, 50257, shape, device="cuda")
            assert torch.equal(ev(x), model(x))
        next(model.parameters()).add_(0.5)  # an in-place update, as the optimizer does
        x = torch.randint(0, 50257, (8, 20), device="cuda")
        assert torch.equal(ev(x), model(x))
    assert len(ev.graphs) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("layers,scope", [("all", "model"), ("lora", "model"), ("lora-kernel", "model"),
                                          ("lora-kernel", "blocks")])
def test_compile_inside_cuda_graphs_matches_eager(tiny_cfg, tmp_path, layers, scope):
    base = tiny_cfg.replace(device="cuda", trainable_layers=layers, max_steps=15, eval_freq=5, lora_rank=4,
                            lora_alpha=8.0, learning_rate=1e-3)
    eager, _ = _losses(base, tmp_path, f"{layers}-eager")
    ref = _losses64(base, tmp_path, f"{layers}-eager64")
    got, row = _losses(base.replace(compile=True, compile_scope=scope, cuda_graphs=True, optimizer="fused"),
                       tmp_path, f"{layers}-{scope}-cg")
    assert row["status"] == "done"
    _assert_same_run(got, eager, ref, what="compiled, in graphs")


@pytest.mark.gpu
def test_grouped_qkv_trains_like_ungrouped_inside_cuda_graphs_with_fewer_kernels(tiny_cfg, tmp_path):
    """bf16 inside CUDA graphs: lora-kernel with each block's query, key and value side by side
    (the default) trains like the same run with the layers one by one, and its captured graphs
    launch fewer kernels each way (per block: one fused call instead of three, one input cast)."""
    base = tiny_cfg.replace(device="cuda", trainable_layers="lora-kernel", max_steps=15, eval_freq=5, lora_rank=4,
                            lora_alpha=8.0, learning_rate=1e-3, precision="bf16", attention="sdpa", ops="fused",
                            cuda_graphs=True, optimizer="fused")
    grouped, row_g = _losses(base, tmp_path, "grouped")
    plain, row_p = _losses(base.replace(group_qkv=False), tmp_path, "plain")
    assert row_g["backend"] == row_p["backend"] == "fused"
    assert _rel(grouped, plain) < 3e-2
    blocks = 2  # the tiny model
    for phase in ("forward", "backward"):
        assert row_g[f"graph_kernels_{phase}"] <= row_p[f"graph_kernels_{phase}"] - 2 * blocks, phase


@pytest.mark.gpu
def test_compiled_cublas_plan_for_large_weights_matches_fused(tiny_cfg, tmp_path):
    """bf16, block-compiled inside CUDA graphs: with the threshold lowered so the MLP layers count
    as large, the custom ops run the cuBLAS plan there (backend says so) and train like the run
    that keeps the fused kernels everywhere."""
    from lora_bench.kernels.policy import PlanPolicy, use_policy
    from lora_bench.model.gpt2 import gpt_config as cfg_of

    base = tiny_cfg.replace(device="cuda", trainable_layers="lora-kernel", max_steps=15, eval_freq=5, lora_rank=4,
                            lora_alpha=8.0, learning_rate=1e-3, precision="bf16", attention="sdpa", ops="fused",
                            compile=True, compile_scope="blocks", cuda_graphs=True, optimizer="fused")
    fused, row_f = _losses(base, tmp_path, "fused")
    emb = cfg_of(base.model_size).emb_dim
    with use_policy(PlanPolicy(cpp_graph_min_weight=4 * emb * emb)):  # the MLP's two projections count as large
        got, row_c = _losses(base, tmp_path, "cublas")
    assert row_f["backend"] == "fused" and row_c["backend"] == "cublas+fused"
    assert _rel(got, fused) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("layers", ["all", "lora", "lora-kernel", "frozen"])
def test_bf16_true_on_cuda_against_float64(tiny_cfg, tmp_path, layers, graphs):
    """bf16-true on the GPU, eager and replayed from CUDA graphs: within the bound its counted
    roundings give against the float64 run (test_bf16_true_against_float64_on_cpu's derivation)."""
    from numerics import rounded_input_tol

    base = tiny_cfg.replace(device="cuda", trainable_layers=layers, max_steps=15, eval_freq=5, learning_rate=1e-3,
                            lora_rank=4, lora_alpha=8.0, attention="sdpa", ops="fused")
    ref = _losses64(base, tmp_path, f"{layers}-float64")
    got, row = _losses(base.replace(precision="bf16-true", cuda_graphs=graphs, optimizer="fused"), tmp_path,
                       f"{layers}-{graphs}")
    assert row["status"] == "done"
    assert 0 < _rel(got, ref) <= rounded_input_tol(torch.bfloat16, bf16_true_roundings(base))


@pytest.mark.gpu
@pytest.mark.parametrize("layers,scope", [("lora", "model"), ("lora-kernel", "blocks"), ("frozen", "blocks")])
def test_bf16_true_compiled_inside_cuda_graphs_matches_eager(tiny_cfg, tmp_path, layers, scope):
    """The study's best mode in bf16-true (compiled, in CUDA graphs, fused AdamW): as close to the
    float64 run as another rounding order of the eager bf16-true run."""
    base = tiny_cfg.replace(device="cuda", trainable_layers=layers, max_steps=15, eval_freq=5, lora_rank=4,
                            lora_alpha=8.0, learning_rate=1e-3, attention="sdpa", ops="fused")
    ref = _losses64(base, tmp_path, f"{layers}-float64")
    eager, _ = _losses(base.replace(precision="bf16-true"), tmp_path, f"{layers}-eager")
    got, row = _losses(base.replace(precision="bf16-true", compile=True, compile_scope=scope, cuda_graphs=True,
                                    optimizer="fused"), tmp_path, f"{layers}-{scope}-cg")
    assert row["status"] == "done"
    _assert_same_run(got, eager, ref, what="bf16-true, compiled, in graphs", dtype=torch.bfloat16)


@pytest.mark.gpu
def test_compile_matches_eager(tiny_cfg, tmp_path):
    base = tiny_cfg.replace(device="cuda", trainable_layers="lora", max_steps=15, lora_rank=4, lora_alpha=8.0)
    eager, _ = _losses(base, tmp_path, "eager")
    ref = _losses64(base, tmp_path, "eager64")
    compiled, _ = _losses(base.replace(compile=True), tmp_path, "compiled")
    _assert_same_run(compiled, eager, ref, what="compiled")


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_bf16_on_cuda_close_to_fp32(tiny_cfg, tmp_path, graphs):
    base = tiny_cfg.replace(device="cuda", trainable_layers="lora", max_steps=20, lora_rank=4, lora_alpha=8.0,
                            attention="sdpa", ops="fused")
    ref, _ = _losses(base, tmp_path, f"fp32-{graphs}")
    got, _ = _losses(base.replace(precision="bf16", cuda_graphs=graphs), tmp_path, f"bf16-{graphs}")
    assert _rel(got, ref) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("norm", ["exact", "detached"])
def test_fused_dora_in_bf16_mode_close_to_fp32(tiny_cfg, tmp_path, norm, graphs):
    """bf16 mode's fused DoRA layers (frozen bases stored in bfloat16 beside float32 adapters, under
    autocast), eager and replayed from CUDA graphs (there its norms formed ahead, the default): the
    norm runs in the Triton kernels, and the run stays as close to the float32 run as bf16 LoRA does
    (test_bf16_on_cuda_close_to_fp32)."""
    base = tiny_cfg.replace(device="cuda", trainable_layers="lora-kernel", lora_variant="dora", dora_norm=norm,
                            max_steps=20, lora_rank=4, lora_alpha=8.0, attention="sdpa", ops="fused")
    ref, _ = _losses(base, tmp_path, f"fp32-{norm}-{graphs}")
    got, row = _losses(base.replace(precision="bf16", cuda_graphs=graphs, optimizer="fused"), tmp_path,
                       f"bf16-{norm}-{graphs}")
    assert row["status"] == "done", row.get("error")
    assert "dora-norm-triton" in row["backend"] and "dora-norm-torch" not in row["backend"], row["backend"]
    # the default launch, auto: the norms formed ahead where the step replays CUDA graphs, else inline
    assert ("the norm formed ahead" in str(row["dora_norms"])) is graphs, row["dora_norms"]
    assert _rel(got, ref) < 3e-2


def test_tf32_mode_sets_and_records_the_matmul_precision(tiny_cfg, tmp_path):
    before = torch.get_float32_matmul_precision()
    try:
        _, row = _losses(tiny_cfg.replace(precision="tf32", max_steps=3), tmp_path, "tf32")
        assert row["float32_matmul_precision"] == "high" and row["tf32_matmul"] == "True"
        _, row = _losses(tiny_cfg.replace(max_steps=3), tmp_path, "fp32")
        assert row["float32_matmul_precision"] == "highest" and row["tf32_matmul"] == "False"
    finally:
        torch.set_float32_matmul_precision(before)


def test_each_compiled_run_starts_from_fresh_compiler_caches(tiny_cfg, tmp_path, monkeypatch):
    """Inline sweeps run many models in one process: every compiled run resets dynamo first, or
    the recompile limit would silently turn later runs eager."""
    from lora_bench.train.context import RunContext

    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    for scope in ("model", "blocks"):
        RunContext(tiny_cfg.replace(compile=True, compile_scope=scope), cache_dir=tmp_path, progress=False)
    RunContext(tiny_cfg, cache_dir=tmp_path, progress=False)
    assert len(resets) == 2


def test_backend_column_names_every_path_the_layers_take(tiny_cfg, tmp_path, monkeypatch):
    """The backend column is what the layers ran while the loop ran, as they noted it: eager CPU
    layers the Python Function's torch ops; kernel_plan=cpp the C++ op; a compiled
    model the custom ops (noted when traced: the C++ op cannot be traced, so torch ops here); a
    block-scoped compile leaves the head eager, so a run whose layers differ says both."""
    import functools

    from lora_bench.kernels import lora_cpp

    cfg = tiny_cfg.replace(trainable_layers="lora-kernel", lora_rank=4, lora_alpha=2.0, max_steps=3, eval_freq=0)
    _, row = _losses(cfg, tmp_path, "eager")
    assert row["backend"] == "torch"
    _, row = _losses(cfg.replace(trainable_layers="lora"), tmp_path, "lora")
    assert row["backend"] == ""
    if not lora_cpp.cpp_available():
        pytest.skip(f"the C++ op cannot be built here: {lora_cpp.build_error()}")
    cfg = cfg.replace(kernel_plan="cpp")
    _, row = _losses(cfg, tmp_path, "eager-cpp")
    assert row["backend"] == "cpp"
    stored = pd.read_csv(tmp_path / "runs.csv").set_index("run_id")["backend"]
    assert stored["eager-cpp"] == "cpp" and stored["eager"] == "torch"
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))  # fast on the CPU
    _, row = _losses(cfg.replace(compile=True), tmp_path, "compiled")
    assert row["backend"] == "torch"
    _, row = _losses(cfg.replace(compile=True, compile_scope="blocks"), tmp_path, "blocks")
    assert row["backend"] == "cpp+torch"  # the head runs eagerly: the C++ op
    torch._dynamo.reset()


def test_compiled_plan_gives_the_largest_weights_cublas():
    """The custom ops' plan: what the Python Function would run, except that weights of at least
    the policy's threshold take the cuBLAS plan (as captured layers take the C++ op), and a forced
    plan is kept as forced."""
    import dataclasses

    from lora_bench.kernels.policy import Plan, PlanPolicy, choose

    def traced(policy, *, device="cuda", numel):
        return choose(policy, device=device, dtype=torch.bfloat16, capturing=False, compiling=True,
                      weight_numel=numel, rank=4, exact_fp32=False, have_triton=True, have_cpp=True)

    small, big = 8 * 8, 16 * 8
    policy = PlanPolicy(cpp_graph_min_weight=big)
    assert traced(policy, device="cpu", numel=big) is Plan.TORCH  # the CPU: torch ops whatever the size
    assert traced(policy, numel=small) is Plan.FUSED  # what CUDA bf16 gets
    assert traced(policy, numel=big) is Plan.CUBLAS
    assert traced(dataclasses.replace(policy, forced=Plan.FUSED), numel=big) is Plan.FUSED
