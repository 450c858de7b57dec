"""Asking for more memory than the machine has is a usage error naming what was asked for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _overcommit_always() -> bool:
    try:  # with overcommit mode 1 a huge allocation "succeeds" and the OOM killer acts later
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(_overcommit_always(), reason="the kernel grants any allocation (overcommit_memory=1)")
def test_kernel_bench_shape_too_large_for_memory(run_cli, tmp_path):
    shape = "1x1:1000000->1000000:r1"  # a 4 TB weight
    code, out = run_cli("kernel-bench", "--device", "cpu", "--shapes", shape, "--dtypes", "fp32", "--impls", "frozen",
                        "--repeats", "1", "--warmup", "0", "--out", tmp_path / "kb.csv", "--no-progress")
    assert code == 2 and "Traceback" not in out, out
    said = " ".join(out.split())
    assert f"shape {shape} (fp32) needs about 7,450.6 GiB" in said and "but cpu has" in said, out
    assert "choose a smaller shape" in said
    assert not (tmp_path / "kb.csv").exists()


# -- runs whose model cannot fit: refused from their settings, before anything is built -------------
def _limited(args: list[str], tmp_path: Path, *, gib: int | None = 8):
    """``lora-bench ARGS`` in a child process whose address space is capped at ``gib`` GiB (None: not
    capped): a run that starts allocating its model fails there at once instead of taking the
    machine's memory."""
    import resource
    import subprocess
    import sys

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (gib * 2**30, gib * 2**30))

    return subprocess.run([sys.executable, "-m", "lora_bench", *args], capture_output=True, text=True, timeout=300,
                          preexec_fn=cap if gib else None, cwd=tmp_path, env={**os.environ, "COLUMNS": "300"})


TINY_CPU = ["train", "--model-size", "tiny", "--weights", "random", "--device", "cpu", "--no-progress",
            "--max-steps", "2", "--warmup-steps", "0", "--eval-freq", "0", "--skip-final-eval"]


@pytest.mark.parametrize("args, needle", [
    (["--n-layers", "100000000"], "--n-layers=100,000,000 is too large: at most 2,048"),
    (["--trainable-layers", "lora", "--lora-rank", "2000000000"], "--lora-rank=2,000,000,000 is too large: at most"),
    (["--emb-dim", "1000000"], "--emb-dim=1,000,000 is too large: at most 65,536"),
    (["--emb-dim", "65536"], "estimated from its settings, but cpu has"),
    (["--n-layers", "2048", "--batch-size", "200000"], "estimated from its settings, but cpu has"),
])
def test_a_model_too_large_is_refused_before_it_is_built(args, needle, tmp_path):
    out = _limited([*TINY_CPU, *args, "--results-dir", str(tmp_path / "r")], tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in text, text[-3000:]
    assert needle in " ".join(text.split()), text
    if "estimated" in needle:
        assert "the run needs about" in text and "GiB available" in text
    assert not (tmp_path / "r").exists()  # no run folder, no failed row


def test_a_sweep_with_a_run_too_large_stops_before_its_first_run(tmp_path):
    from tiny import SAMPLE

    sweep = tmp_path / "s.yaml"
    sweep.write_text(f"name: big\nbase: {{model_size: tiny, weights: random, device: cpu, data_file: {SAMPLE}, "
                     "max_steps: 2, warmup_steps: 0, eval_freq: 0, skip_final_eval: true}\n"
                     "grid:\n  emb_dim: [32, 65536]\n")
    out = _limited(["sweep", str(sweep), "--results-dir", str(tmp_path / "r"), "--no-progress", "--cache-dir",
                    str(tmp_path / "c")], tmp_path)
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2 and "Traceback" not in text, text[-3000:]
    assert "emb_dim=65536" in text and "estimated from its settings" in text
    assert not (tmp_path / "r" / "runs.csv").exists()


@pytest.mark.parametrize("kw", [
    {"trainable_layers": "all"}, {"trainable_layers": "last_layer"}, {"trainable_layers": "last_block"},
    {"trainable_layers": "last_two_blocks"}, {"trainable_layers": "lora", "lora_rank": 4},
    {"trainable_layers": "lora-merged", "lora_rank": 3, "emb_dim": 48, "n_heads": 4, "n_layers": 3},
])
def test_the_estimate_counts_exactly_the_parameters_a_model_has(kw):
    """The parameter counts behind the estimate are those of the model lora-bench builds."""
    from lora_bench.classifier.book import build_classifier, model_config
    from lora_bench.config import TrainConfig
    from lora_bench.model.gpt2 import GPTModel, count_params
    from lora_bench.train.memory import estimate

    cfg = TrainConfig(model_size="tiny", weights="random", device="cpu", **kw)
    model = build_classifier(cfg, cache_dir=Path("/nonexistent"), progress=False)
    est = estimate(cfg)
    assert est.params == count_params(GPTModel(model_config(cfg)))
    assert est.trainable == count_params(model, trainable_only=True)
    buffers = sum(b.numel() for b in model.buffers())
    assert est.weights == 4 * (count_params(model) + buffers)


@pytest.mark.gpu
def test_a_model_too_large_for_the_gpu_is_refused_before_it_is_built(tmp_path):
    # 65,536 wide: about 1.4 TB of weights and AdamW state, more than any GPU has; no address-space
    # cap here (CUDA reserves more address space than that)
    out = _limited(["train", "--model-size", "tiny", "--weights", "random", "--device", "cuda", "--no-progress",
                    "--emb-dim", "65536", "--trainable-layers", "all", "--results-dir", str(tmp_path / "r")],
                   tmp_path, gib=None)
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2 and "Traceback" not in text, text[-3000:]
    assert "estimated from its settings, but cuda:0 has" in text and "GiB available" in text
    assert not (tmp_path / "r").exists()
