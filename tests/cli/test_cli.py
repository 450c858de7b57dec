"""The command line: help, bad input (one clear message, exit code 2, no traceback)."""

from __future__ import annotations


import pytest
from conftest import refused_url

from lora_bench.results.store import read_runs
from paths import FIXTURES

TINY = ["--model-size", "tiny", "--weights", "random", "--device", "cpu", "--no-progress"]
SAMPLE = FIXTURES / "sms_spam_sample.tsv"


def _assert_clean_usage_error(code: int, out: str, *needles: str) -> None:
    assert code == 2, out
    assert "Traceback" not in out
    for n in needles:
        assert n in out, out


def test_help_and_version(run_cli):
    code, out = run_cli("train", "--help")
    assert code == 0 and "--trainable-layers" in out and "--max-steps" in out and "--lora-rank" in out
    code, out = run_cli("--version")
    assert code == 0 and "lora-bench" in out


def test_invalid_option_value_names_value_and_choices(run_cli, tmp_path):
    code, out = run_cli("train", *TINY, "--trainable-layers", "everything", "--results-dir", str(tmp_path))
    _assert_clean_usage_error(code, out, "--trainable-layers='everything'", "last_block", "lora-merged")
    assert not (tmp_path / "runs.csv").exists()


def test_several_problems_reported_at_once(run_cli, tmp_path):
    code, out = run_cli("train", *TINY, "--precision", "fp8", "--batch-size", "0", "--timing", "maybe",
                        "--results-dir", str(tmp_path))
    _assert_clean_usage_error(code, out, "3 problems", "--precision='fp8'", "--batch-size=0", "--timing='maybe'")


def test_no_padding_needs_batch_size_one(run_cli, tmp_path):
    code, out = run_cli("train", *TINY, "--no-padding", "--results-dir", str(tmp_path))
    _assert_clean_usage_error(code, out, "--no-padding needs --batch-size=1", "got --batch-size=8")


def test_context_length_above_model(run_cli, tmp_path, sms_file):
    code, out = run_cli("train", *TINY, "--context-length", "2048", "--data-file", str(sms_file),
                        "--results-dir", str(tmp_path))
    _assert_clean_usage_error(code, out, "--context-length=2048 exceeds the model's context length 1024")
    assert not (tmp_path / "runs.csv").exists()  # refused before anything ran


def test_run_time_failure_is_recorded(run_cli, tmp_path):
    """A failure that only shows once the run has started still leaves its row (status failed)."""
    bad = tmp_path / "bad.tsv"
    bad.write_text("x\ty\n" * 20)
    code, out = run_cli("train", *TINY, "--data-file", str(bad), "--results-dir", str(tmp_path))
    _assert_clean_usage_error(code, out, "does not look like the SMS Spam Collection")
    runs = read_runs(tmp_path / "runs.csv")
    assert runs["status"].tolist() == ["failed"] and "does not look like" in runs["error"].iloc[0]


def test_missing_data_file(run_cli, tmp_path):
    code, out = run_cli("train", *TINY, "--data-file", str(tmp_path / "nope.tsv"), "--results-dir", str(tmp_path))
    _assert_clean_usage_error(code, out, "no such file", "nope.tsv", "--data-file")


def test_train_needs_no_network_for_the_corpus(run_cli, tmp_path, monkeypatch):
    """The corpus shipped with the package is the corpus: train uses it without trying a download."""
    urls = [refused_url("/a.zip"), refused_url("/b.zip")]
    monkeypatch.setattr("lora_bench.data.sms_spam.SMS_URLS", urls)
    monkeypatch.setattr("lora_bench.data.sms_spam.download_file", lambda *a, **k: pytest.fail("a download was tried"))
    code, out = run_cli("train", *TINY, "--max-steps", "2", "--warmup-steps", "1", "--skip-final-eval",
                        "--cache-dir", str(tmp_path / "cache"), "--results-dir", str(tmp_path))
    assert code == 0, out
    assert "download" not in out, out


def test_train_asks_the_machine_once(run_cli, tmp_path, monkeypatch):
    """One preflight for a run: its check, and each of its parts, runs once before the run is done."""
    import collections

    from lora_bench.train import preflight

    calls = collections.Counter()

    def counted(name):
        real = getattr(preflight, name)

        def wrapper(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        return wrapper

    parts = ("preflight", "device_problems", "input_problems", "require_packages", "memory_problem")
    for name in parts:
        monkeypatch.setattr(preflight, name, counted(name))
    code, out = run_cli("train", *TINY, "--max-steps", "2", "--warmup-steps", "1", "--skip-final-eval",
                        "--eval-freq", "0", "--data-file", str(SAMPLE), "--results-dir", str(tmp_path))
    assert code == 0, out
    assert calls == dict.fromkeys(parts, 1), calls


def test_corrupt_checkpoint(run_cli, tmp_path, sms_file):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("checkpoint", "encoder.json", "hparams.json", "model.ckpt.data-00000-of-00001",
                 "model.ckpt.index", "model.ckpt.meta", "vocab.bpe"):
        (ckpt / name).write_bytes(b"not a checkpoint")
    code, out = run_cli("train", "--model-size", "124M", "--weights", "pretrained", "--weights-dir", str(ckpt),
                        "--device", "cpu", "--no-progress", "--data-file", str(sms_file),
                        "--results-dir", str(tmp_path / "r"))
    _assert_clean_usage_error(code, out, str(ckpt))


def test_pretrained_override_refused(run_cli, tmp_path):
    code, out = run_cli("train", "--weights", "pretrained", "--emb-dim", "64", "--results-dir", str(tmp_path))
    _assert_clean_usage_error(code, out, "--emb-dim", "--weights=random")


@pytest.mark.parametrize("device", ["cuda:7", "tpu"])
def test_bad_device(run_cli, tmp_path, sms_file, device):
    code, out = run_cli("train", *TINY[:-3], "--device", device, "--data-file", str(sms_file),
                        "--results-dir", str(tmp_path), "--no-progress")
    assert code == 2 and "Traceback" not in out and device in out


def test_show_missing_and_unknown(run_cli, tmp_path):
    code, out = run_cli("show", str(tmp_path))
    _assert_clean_usage_error(code, out, "no runs.csv")


def test_kernel_bench_times_dora_layers_by_name(run_cli, tmp_path):
    """DoRA's layers, asked for by name, beside the fused LoRA layer: a row each, timed; the fused
    ones name where their norm ran (torch ops on the CPU)."""
    import pandas as pd

    impls = "frozen,lora-kernel,dora,dora-merged,dora-kernel,dora-kernel-detached"
    code, text = run_cli("kernel-bench", "--device", "cpu", "--shapes", "2x8:16->24:r2", "--impls", impls,
                         "--dtypes", "fp32", "--repeats", "2", "--warmup", "1", "--results-dir", str(tmp_path),
                         "--no-progress")
    assert code == 0, text
    rows = pd.read_csv(tmp_path / "kernel_bench.csv").set_index("impl")
    assert list(rows.index) == impls.split(",")
    assert (rows["fwdbwd_ms"] > 0).all() and rows["x_frozen"].notna().all()
    for impl in ("dora-kernel", "dora-kernel-detached"):
        assert "dora-norm-torch" in rows.loc[impl, "backend"], rows.loc[impl, "backend"]
    assert "dora-norm" not in rows.loc["lora-kernel", "backend"]


def test_kernel_bench_times_layers_in_the_training_precision_bf16(run_cli, tmp_path):
    """--dtypes bf16-autocast: each layer as a bf16 training step holds and calls it (frozen weight
    and bias bfloat16, adapters and m float32, the call under autocast), timed, its output bfloat16."""
    import pandas as pd
    import torch

    from lora_bench.bench import kernel_bench as kb

    shape = kb.parse_shape("2x8:16->24:r2")
    layer, params = kb._make_layer("dora-kernel", shape, torch.bfloat16, torch.device("cpu"), autocast=True)
    assert layer.layer.linear.weight.dtype is torch.bfloat16 and layer.layer.linear.bias.dtype is torch.bfloat16
    assert [p.dtype for p in params] == [torch.float32] * 3
    assert layer(torch.randn(3, 16, dtype=torch.bfloat16)).dtype is torch.bfloat16
    code, text = run_cli("kernel-bench", "--device", "cpu", "--shapes", "2x8:16->24:r2", "--impls",
                         "frozen,lora-kernel,dora-kernel", "--dtypes", "bf16-autocast", "--repeats", "2", "--warmup",
                         "1", "--results-dir", str(tmp_path), "--no-progress")
    assert code == 0, text
    rows = pd.read_csv(tmp_path / "kernel_bench.csv")
    assert set(rows["dtype"]) == {"bf16-autocast"} and (rows["fwdbwd_ms"] > 0).all()


def test_kernel_bench_command_on_cpu(run_cli, tmp_path):
    code, text = run_cli("kernel-bench", "--device", "cpu", "--shapes", "2x8:16->24:r2", "--repeats", "2",
                         "--warmup", "1", "--results-dir", str(tmp_path), "--no-progress")
    assert code == 0, text
    import pandas as pd

    rows = pd.read_csv(tmp_path / "kernel_bench.csv")
    assert set(rows["impl"]) >= {"frozen", "lora", "lora-merged", "lora-kernel"}
    code, text = run_cli("kernel-bench", "--device", "cpu", "--impls", "bogus", "--results-dir", str(tmp_path))
    _assert_clean_usage_error(code, text, "bogus", "frozen")
    # the CSV file itself, as an earlier spelling named it, still works
    code, text = run_cli("kernel-bench", "--device", "cpu", "--shapes", "2x8:16->24:r2", "--impls", "frozen",
                         "--dtypes", "fp32", "--repeats", "2", "--warmup", "1", "--out", str(tmp_path / "kb.csv"),
                         "--no-progress")
    assert code == 0 and (tmp_path / "kb.csv").is_file(), text


@pytest.mark.parametrize("args, needle", [
    (["--model-size", "tiny"], "--model-size=tiny has no pretrained checkpoint; use --weights=random"),
    (["--model-size", "tiny", "--weights", "random", "--emb-dim", "30", "--n-heads", "4"],
     "--emb-dim=30 is not divisible by --n-heads=4"),
    (["--weights", "random", "--context-length", "4096"], "exceeds the model's context length 1024"),
])
def test_model_shape_problems_are_usage_errors(run_cli, tmp_path, args, needle):
    code, out = run_cli("train", *args, "--device", "cpu", "--results-dir", str(tmp_path), "--no-progress")
    _assert_clean_usage_error(code, out, needle)
    assert not (tmp_path / "runs.csv").exists()  # refused before anything ran


def test_output_paths_and_run_ids_are_checked_before_any_work(run_cli, tmp_path, sms_file):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, out = run_cli("train", *TINY, "--data-file", str(sms_file), "--results-dir", str(blocker))
    _assert_clean_usage_error(code, out, "--results-dir", "a file is in the way")
    code, out = run_cli("train", *TINY, "--data-file", str(sms_file), "--results-dir", str(tmp_path / "r"),
                        "--run-id", "../../escape")
    _assert_clean_usage_error(code, out, "run id '../../escape'")
    assert not (tmp_path / "escape").exists() and not (tmp_path / "r" / "runs.csv").exists()
    code, out = run_cli("report", str(tmp_path), "--plot", str(tmp_path / "plot.txt"))
    _assert_clean_usage_error(code, out, "--plot", ".png, .pdf, .svg")
    code, out = run_cli("kernel-bench", "--device", "cpu", "--shapes", "2x8:48->40:r4", "--results-dir", str(blocker))
    _assert_clean_usage_error(code, out, "--results-dir", "a file is in the way")


@pytest.mark.parametrize("args,needle", [
    (["--shapes", "2x8:48->40:r0"], "positive sizes"),
    (["--impls", "lora:cpp"], "only lora-kernel takes a :PLAN suffix"),
    (["--impls", "lora-kernel:foo"], "lora-kernel's plans are direct, cpp, fused, cublas, torch"),
    (["--repeats", "0"], "need repeats >= 1"),
    (["--device", "tpu"], "expected cuda, cuda:N or cpu"),
])
def test_kernel_bench_bad_inputs(run_cli, tmp_path, args, needle):
    code, out = run_cli("kernel-bench", "--device", "cpu", "--shapes", "2x8:48->40:r4", *args,
                        "--results-dir", str(tmp_path))
    _assert_clean_usage_error(code, out, needle)
    assert not (tmp_path / "kernel_bench.csv").exists()


def test_a_bad_or_misplaced_kernel_plan_is_a_usage_error(run_cli, tmp_path):
    """--kernel-plan takes the plans' names (or auto), and only with lora-kernel: one message naming
    the value and the allowed ones, exit code 2, before any row."""
    code, out = run_cli("train", *TINY, "--trainable-layers", "lora-kernel", "--kernel-plan", "fused:cpp",
                        "--max-steps", "8", "--results-dir", str(tmp_path))
    _assert_clean_usage_error(code, out, "'fused:cpp'", "auto, direct, cpp, fused, cublas, torch")
    code, out = run_cli("train", *TINY, "--trainable-layers", "lora", "--kernel-plan", "torch",
                        "--max-steps", "8", "--results-dir", str(tmp_path))
    _assert_clean_usage_error(code, out, "only used with", "lora-kernel")
    assert not (tmp_path / "runs.csv").exists()


def test_machine_inputs_checked_before_a_run_or_sweep_starts(run_cli, tmp_path):
    """A missing data file, a folder given as one, a GPU the machine lacks: one message, no failed row."""
    res = tmp_path / "r"
    for args, needle in ((["--data-file", str(tmp_path / "none.tsv")], "no such file"),
                         (["--data-file", str(tmp_path)], "is a folder")):
        code, out = run_cli("train", *TINY, *args, "--results-dir", str(res))
        _assert_clean_usage_error(code, out, needle)
    assert not (res / "runs.csv").exists()
    code, out = run_cli("sweep", "configs/smoke.yaml", "--data-file", str(tmp_path / "none.tsv"), "--dry-run")
    _assert_clean_usage_error(code, out, "--data-file", "no such file")


def test_an_offline_start_without_weights_has_its_own_exit_code_and_show_keeps_the_last_result(
        run_cli, tmp_path, monkeypatch):
    """No network and no checkpoint: exit 3 (not the usage code), one message pointing at
    --weights random and --weights-dir; show without a run id still shows the last finished run."""
    code, out = run_cli("train", *TINY, "--max-steps", "2", "--warmup-steps", "1", "--skip-final-eval",
                        "--results-dir", tmp_path / "r", "--run-id", "good")
    assert code == 0, out
    monkeypatch.setattr("lora_bench.model.checkpoints.BASE_URLS", (refused_url("/a"), refused_url("/b")))
    code, out = run_cli("train", "--model-size", "124M", "--device", "cpu", "--no-progress",
                        "--data-file", SAMPLE, "--cache-dir", tmp_path / "cache", "--results-dir", tmp_path / "r")
    assert code == 3 and "Traceback" not in out, out
    assert "could not download GPT-2 124M" in out and "--weights random" in out and "--weights-dir" in out, out
    code, out = run_cli("show", tmp_path / "r")
    assert code == 0 and "good" in out and "1 later run(s) did not finish" in out and "(failed)" in out, out


def test_runs_begun_within_one_second_keep_their_order(run_cli, tmp_path):
    """Start times are kept to the second: a run that failed in the same second as the finished
    one before it is still named by show as a later run, a finished run updated later keeps its
    place, and one begun after a failure in the same second is the one shown."""
    from lora_bench.results.lookup import find_run, unfinished_since
    from lora_bench.results.store import read_run_table, upsert_run

    res = tmp_path / "r"
    code, out = run_cli("train", *TINY, "--max-steps", "2", "--warmup-steps", "1", "--skip-final-eval",
                        "--results-dir", res, "--run-id", "good")
    assert code == 0, out
    good = read_run_table(res / "runs.csv").rows[0]
    upsert_run(res / "runs.csv", {**good, "run_id": "bad", "status": "failed", "error": "boom"})
    code, out = run_cli("show", res)
    assert code == 0 and "1 later run(s) did not finish: bad (failed)" in out, out
    upsert_run(res / "runs.csv", {**good, "tokens_per_s": "1"})  # an update keeps the row's place
    assert [r["run_id"] for r in read_run_table(res / "runs.csv").rows] == ["good", "bad"]
    assert [r["run_id"] for r in unfinished_since(res, find_run(res))] == ["bad"]
    upsert_run(res / "runs.csv", {**good, "run_id": "after"})
    assert find_run(res)["run_id"] == "after" and unfinished_since(res, find_run(res)) == []


def test_show_prints_a_hostile_row_as_text(run_cli, tmp_path):
    """Every cell of runs.csv that show prints (the run id, sizes, the device, the error) reaches the
    terminal as text: control sequences shown as escapes, rich markup as written."""
    from lora_bench.results.schema import run_column_names
    from lora_bench.results.store import write_csv

    row = {"run_id": "r1", "status": "failed", "error": "\x1b]0;owned\x07boom [bold]x[/bold]\x1b[2J",
           "model_size": "[red]m[/red]", "trainable_layers": "\x9b2J", "device": "cpu\x1b[5m",
           "timing_clock": "host", "step_ms_median": 1.5, "started_at": "2026-01-01T00:00:00+00:00"}
    write_csv(tmp_path / "runs.csv", [row], run_column_names())
    code, out = run_cli("show", tmp_path, "r1")
    assert code == 0, out
    assert not any(c in out for c in ("\x1b", "\x07", "\x9b")), repr(out)
    assert "[bold]x[/bold]" in out and "[red]m[/red]" in out and "\\x1b]0;owned" in out


def test_an_error_naming_a_hostile_path_sends_no_control_sequence(run_cli, tmp_path):
    code, out = run_cli("train", *TINY, "--config", tmp_path / "a\x1b[2J[bold]b[/bold].yaml")
    _assert_clean_usage_error(code, out, "no such file", "\\x1b[2J[bold]b[/bold].yaml")
    assert "\x1b" not in out


def test_the_summary_under_the_phase_table_breaks_between_items_only():
    """At 100 columns (and narrower) every item of the run's summary stays on one line."""
    import io

    from rich.console import Console

    from lora_bench.report.phase_table import phase_table

    row = {"run_id": "tiny-all-0123456789-r0", "model_size": "tiny", "trainable_layers": "all", "device": "cpu",
           "timing_clock": "host", "status": "done", "tokens_per_s": 1241.0, "achieved_tflops": 0.001,
           "eval_s": 0.22, "training_time_s": 0.58, "measured_steps": 2, "phase_sum_pct": 0.0,
           **{f"{p}_ms_{s}": 1.0 for p in ("data", "forward", "backward", "optimizer", "step")
              for s in ("median", "p10", "p90")}}
    items = ["tokens/s 1241", "TFLOP/s 0.00", "eval s 0.22", "train s 0.58", "steps measured 2",
             "Σ phase medians vs step % 0.0"]
    for width in (100, 72, 40):
        buf = io.StringIO()
        Console(file=buf, width=width, color_system=None).print(phase_table(row))
        lines = buf.getvalue().splitlines()
        for item in items:
            assert any(item in line for line in lines), (width, item, lines[-4:])


def test_piped_training_prints_plain_progress_lines(run_cli, tmp_path, sms_file):
    """Off a terminal the live progress line becomes plain lines (first step, each epoch, the last
    step); --no-progress prints none."""
    args = ("train", "--model-size", "tiny", "--weights", "random", "--device", "cpu", "--max-steps", "3",
            "--warmup-steps", "0", "--eval-freq", "0", "--skip-final-eval", "--data-file", sms_file,
            "--cache-dir", tmp_path / "c")
    code, out = run_cli(*args, "--results-dir", tmp_path / "a")
    assert code == 0, out
    assert "epoch 1  1/3  loss" in out and "epoch 1  3/3  loss" in out and "\x1b" not in out, out
    code, out = run_cli(*args, "--results-dir", tmp_path / "b", "--no-progress")
    assert code == 0 and "1/3  loss" not in out, out


def test_a_bad_setting_is_refused_before_torch_is_imported(tmp_path):
    """A value past a setting's bound, or a settings file past its size, answers at once: the
    training stack (torch, seconds to import) is not loaded for it."""
    import subprocess
    import sys

    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(2 * 10**9)
    for args in (["--n-layers", "100000000"], ["--config", str(big)]):
        probe = ("import sys; from lora_bench.cli import main\n"
                 f"sys.argv = ['lora-bench', 'train', *{args!r}]\n"
                 "try:\n    main()\nexcept SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        assert out.stdout.strip().endswith("exit 2 False"), out.stdout + out.stderr
