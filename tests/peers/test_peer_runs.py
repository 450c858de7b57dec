"""The Hugging Face peer in the harness: the ``implementation`` and ``weights_source`` settings (choices,
refusals, unchanged run ids for configurations that do not use them), a whole ``lora-bench train
--implementation hf`` run writing its row, the safetensors weights loaded into the book model, the
run-id slug, PEFT's FLOP count, the optional packages checked before any row is written, and the
report's ratio to the PEFT row."""

from __future__ import annotations

import io
import subprocess
import sys

import pandas as pd
import pytest
import torch

from lora_bench.classifier.book import load_base_model
from lora_bench.config import HF_TRAINABLE_LAYERS, TRAINABLE_LAYERS, TrainConfig, render
from lora_bench.errors import ConfigError
from lora_bench.model.gpt2 import MODEL_SIZES, GPTConfig, build_random_model, gpt_config
from lora_bench.report.load import load_results
from lora_bench.report.study import build_study
from lora_bench.results.metrics import flops_per_step
from lora_bench.results.schema import run_column_names
from lora_bench.results.store import read_runs, write_csv
from lora_bench.train.identity import make_run_id, settings_hash
from paths import FIXTURES

SAMPLE = FIXTURES / "sms_spam_sample.tsv"
TINY_RUN = ("--model-size", "tiny", "--weights", "random", "--device", "cpu", "--max-steps", "3", "--warmup-steps", "1",
            "--eval-freq", "0", "--skip-final-eval", "--lora-rank", "4", "--data-file", str(SAMPLE), "--no-progress")


# -- settings ---------------------------------------------------------------------------------------------

def test_defaults_are_the_book_model_with_the_openai_weights():
    cfg = TrainConfig()
    assert (cfg.implementation, cfg.weights_source) == ("book", "openai")
    bad = TrainConfig(implementation="peft", weights_source="tf")
    assert sorted(render(bad.problems())) == [
        "implementation='peft' is not allowed; choose one of: book, hf",
        "weights_source='tf' is not allowed; choose one of: openai, hf"]


def test_run_ids_of_existing_configurations_are_unchanged():
    """Hashes computed before the two settings existed: a sweep resumes its old runs."""
    lora = TrainConfig(trainable_layers="lora", lora_rank=16, lora_alpha=16.0, weights="random", model_size="1558M",
                       precision="bf16")
    assert settings_hash(TrainConfig()) == "44136fa355"
    assert make_run_id(lora, repeat=0) == "1558M-lora-b8d8b1b970-r0"
    assert make_run_id(lora.replace(implementation="book", weights_source="openai"), repeat=0) == \
        "1558M-lora-b8d8b1b970-r0"
    hf = make_run_id(lora.replace(implementation="hf"), repeat=0)
    assert hf.startswith("1558M-lora-hf-") and hf != "1558M-lora-hf-b8d8b1b970-r0"
    assert make_run_id(TrainConfig(weights_source="hf"), repeat=1).startswith("124M-last_block-")


def test_what_has_no_hugging_face_peer_is_refused_with_every_reason():
    cfg = dict(implementation="hf", trainable_layers="lora-kernel", disable_causal_mask=True, cuda_graphs=True,
               device="cuda")
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_mapping(cfg)
    assert err.value.exit_code == 2
    problems = err.value.problems
    assert len(problems) == 3, problems
    assert problems[0].startswith("trainable_layers='lora-kernel' has no Hugging Face peer")
    assert problems[0].endswith("choose one of: " + ", ".join(HF_TRAINABLE_LAYERS))
    assert problems[1].startswith("disable_causal_mask has no Hugging Face peer")
    assert "does not compute what it computes eagerly" in problems[2] and "compile" in problems[2]
    assert TrainConfig.from_mapping({**cfg, "implementation": "book"}).cuda_graphs  # the book runs it all
    refused = [t for t in TRAINABLE_LAYERS if TrainConfig(implementation="hf", trainable_layers=t).problems()]
    assert refused == ["frozen", "lora-merged", "lora-kernel"]  # the floor is the book model's


def test_refusals_on_the_command_line_name_the_flags(run_cli, tmp_path):
    code, out = run_cli("train", "--implementation", "hf", "--cuda-graphs", "--trainable-layers", "lora-merged",
                        "--results-dir", tmp_path / "r")
    assert code == 2 and "Traceback" not in out
    assert "--trainable-layers='lora-merged' has no Hugging Face peer" in out
    assert "--cuda-graphs with --implementation=hf is refused" in out
    assert not (tmp_path / "r").exists()


def test_weights_source_is_only_used_with_pretrained_weights():
    assert render(TrainConfig(weights="random", weights_source="hf").problems()) == [
        "weights_source is only used with weights=pretrained"]
    assert TrainConfig(weights="pretrained", weights_source="hf").problems() == []


# -- FLOPs --------------------------------------------------------------------------------------------------

def test_flops_count_peft_adapters_and_the_trained_head():
    """Per unit of rank the adapters cost 6·(adapter parameters per rank)·T: the book's 18·e per block
    and (e + 2) for the head, PEFT's 16·e per block; PEFT trains the head itself (its weight gradient,
    2·e·2·T more)."""
    mcfg, tokens, rank = gpt_config("124M"), 960.0, 16
    e, n_layers = mcfg.emb_dim, mcfg.n_layers

    def f(impl, r):
        return flops_per_step(mcfg, trainable_layers="lora", tokens=tokens, rank=r, implementation=impl)

    assert (f("book", rank) - f("book", 0)) / (6 * tokens * rank) == n_layers * 18 * e + (e + 2)
    assert (f("hf", rank) - f("hf", 0)) / (6 * tokens * rank) == n_layers * 16 * e
    assert f("hf", 0) - f("book", 0) == 2 * (e * 2) * tokens
    full = dict(trainable_layers="all", tokens=tokens)
    assert flops_per_step(mcfg, **full, implementation="hf") == flops_per_step(mcfg, **full)


# -- weights from safetensors into the book model ---------------------------------------------------------

def test_weights_source_hf_loads_the_safetensors_into_the_book_model(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from lora_bench.model.hf_checkpoint import WEIGHTS_FILE, hf_state_from_gpt
    from lora_bench.peers.hf import base_state

    mcfg = GPTConfig(vocab_size=64, context_length=16, emb_dim=16, n_layers=2, n_heads=2)
    source = build_random_model(mcfg, seed=7)
    state = {k: v.contiguous() for k, v in hf_state_from_gpt(source).items()}
    safetensors_torch.save_file(state, str(tmp_path / WEIGHTS_FILE), metadata={"format": "pt"})
    cfg = TrainConfig(model_size="124M", weights="pretrained", weights_source="hf", weights_dir=str(tmp_path))
    model = load_base_model(cfg, mcfg, cache_dir=tmp_path / "unused")
    assert not model.training
    expected = source.state_dict()
    for name, value in model.state_dict().items():
        if name != "out_head.weight":  # GPT-2 ties its output head to the token embedding
            assert torch.equal(value, expected[name]), name
    assert torch.equal(model.out_head.weight, expected["tok_emb.weight"])
    peer = base_state(cfg, mcfg, cache_dir=None)  # the hf implementation reads the same file as it is
    assert set(peer) == set(state) and all(torch.equal(peer[k], state[k]) for k in state)
    assert not (tmp_path / "unused").exists()  # the Hugging Face weights never go to lora-bench's cache


# -- a whole run ----------------------------------------------------------------------------------------------

def test_train_implementation_hf_lora_writes_its_row(run_cli, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    results = tmp_path / "results"
    code, out = run_cli("train", "--implementation", "hf", "--trainable-layers", "lora", *TINY_RUN,
                        "--results-dir", results, "--cache-dir", tmp_path / "cache")
    assert code == 0, out
    row = read_runs(results / "runs.csv").iloc[0]
    assert row["status"] == "done" and row["run_id"].startswith("tiny-lora-hf-")
    assert (row["cfg_implementation"], row["cfg_trainable_layers"], row["cfg_weights_source"]) == ("hf", "lora", "openai")
    e, n_layers, _ = MODEL_SIZES["tiny"]
    assert row["trainable_params"] == n_layers * 16 * e * 4 + (e * 2 + 2)  # PEFT's adapters and the head
    assert (row["transformers_version"], row["peft_version"]) == (transformers.__version__, peft.__version__)
    assert row["steps"] == 3 and row["measured_steps"] == 2
    flops = flops_per_step(gpt_config("tiny"), trainable_layers="lora", tokens=row["tokens_per_step"], rank=4,
                           implementation="hf")
    assert row["flops_per_step"] == pytest.approx(flops)
    assert row["backend"] is pd.NA or row["backend"] == ""


def test_a_book_run_imports_no_peer_package(tmp_path):
    code = (
        "import sys\n"
        "from rich.console import Console\n"
        "from lora_bench.config import TrainConfig\n"
        "from lora_bench.train.run import execute_run\n"
        f"cfg = TrainConfig(model_size='tiny', weights='random', trainable_layers='lora', device='cpu', max_steps=2,"
        f" warmup_steps=1, eval_freq=0, skip_final_eval=True, data_file={str(SAMPLE)!r})\n"
        f"row = execute_run(cfg, results_dir={str(tmp_path / 'r')!r}, cache_dir={str(tmp_path / 'c')!r},"
        " console=Console(quiet=True), progress=False)\n"
        "print(row['status'], 'transformers_version' in row)\n"
        "print(sorted(m for m in ('transformers', 'peft', 'safetensors', 'huggingface_hub') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["done False", "[]"], out.stdout


@pytest.mark.parametrize("missing, layers", [("transformers", "all"), ("peft", "lora")])
def test_a_missing_peer_package_stops_train_before_any_row(run_cli, monkeypatch, tmp_path, missing, layers):
    if missing == "peft":  # transformers is asked for first: it has to be there for peft to be named
        pytest.importorskip("transformers")
    monkeypatch.setitem(sys.modules, missing, None)  # any `import <missing>` now fails
    code, out = run_cli("train", "--implementation", "hf", "--trainable-layers", layers, *TINY_RUN,
                        "--results-dir", tmp_path / "r")
    assert code == 2 and "Traceback" not in out
    assert f"needs the Python package {missing!r}" in out
    assert " ".join(out.split()).endswith('pip install "lora-bench[peers]"')
    assert not (tmp_path / "r" / "runs.csv").exists()


def test_a_missing_peer_package_stops_a_sweep_before_any_row(run_cli, monkeypatch, tmp_path):
    sweep = tmp_path / "peers.yaml"
    sweep.write_text(f"name: p\nbase: {{model_size: tiny, weights: random, device: cpu, max_steps: 2, warmup_steps: 1,"
                     f" data_file: {SAMPLE}}}\ngrid: {{implementation: [book, hf]}}\n")
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, out = run_cli("sweep", sweep, "--results-dir", tmp_path / "r", "--isolation", "inline")
    assert code == 2 and 'pip install "lora-bench[peers]"' in out
    assert not (tmp_path / "r" / "runs.csv").exists()


# -- the report's ratio to the PEFT row ------------------------------------------------------------------------

def test_report_divides_each_row_by_the_peft_row_of_its_size_and_mode(run_cli, tmp_path):
    """--group-by the label (the mode; each implementation's "best" mode has its own settings) and the
    baseline implementation=hf,trainable_layers=lora: the ratio is to the PEFT row of the same label
    and size."""
    step = {("eager", "124M", "book", "all"): 40.0, ("eager", "124M", "book", "lora"): 50.0,
            ("eager", "124M", "hf", "all"): 30.0, ("eager", "124M", "hf", "lora"): 36.0,
            ("best", "124M", "book", "lora-kernel"): 4.0, ("best", "124M", "hf", "lora"): 19.0,
            ("eager", "1558M", "book", "lora"): 220.0, ("eager", "1558M", "hf", "lora"): 200.0}
    rows = []
    for i, ((label, size, impl, layers), ms) in enumerate(step.items()):
        graphs = label == "best" and impl == "book"
        rows.append({"run_id": f"r{i}", "status": "done", "sweep_label": label, "step_ms_median": ms,
                     "cfg_model_size": size, "cfg_implementation": impl, "cfg_trainable_layers": layers,
                     "cfg_cuda_graphs": graphs, "cfg_compile": label == "best" and impl == "hf",
                     "cfg_precision": "bf16" if label == "best" else "fp32",
                     "transformers_version": "5.17.0" if impl == "hf" else ""})
    write_csv(tmp_path / "runs.csv", rows, run_column_names())
    code, out = run_cli("report", tmp_path, "--group-by", "sweep_label,model_size,implementation,trainable_layers",
                        "--baseline", "implementation=hf,trainable_layers=lora", "--metrics", "step_ms_median",
                        "--format", "csv")
    assert code == 0, out
    df = pd.read_csv(io.StringIO(out))
    ratio = {(r.label, r.model_size, r.implementation, r.trainable_layers): r.ratio for r in df.itertuples()}
    assert ratio[("eager", "124M", "book", "lora")] == pytest.approx(50 / 36, rel=1e-5)
    assert ratio[("eager", "124M", "hf", "all")] == pytest.approx(30 / 36, rel=1e-5)
    assert ratio[("eager", "124M", "hf", "lora")] == pytest.approx(1.0)
    assert ratio[("best", "124M", "book", "lora-kernel")] == pytest.approx(4 / 19, rel=1e-5)
    assert ratio[("eager", "1558M", "book", "lora")] == pytest.approx(220 / 200, rel=1e-5)
    assert build_study(load_results([tmp_path])).header.versions["transformers"] == "5.17.0"
