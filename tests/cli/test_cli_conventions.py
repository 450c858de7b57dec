"""The conventions a command line is expected to keep: shell completion (typer's), a setting's
choices shown as choices, ``--print-config`` on ``train`` and ``sweep`` (the resolved settings as
YAML, exit 0, nothing run), and a run named in ``show`` by the start of its id."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from lora_bench.config import SETTINGS, TrainConfig
from paths import FIXTURES, ROOT

SMOKE = ROOT / "configs" / "smoke.yaml"


def _complete(words: str) -> list[str]:
    """What bash completion offers after ``words`` (the word being typed last), through the same
    environment protocol the script from --show-completion uses."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "_LORA_BENCH_COMPLETE": "complete_bash",
           "COMP_WORDS": words, "COMP_CWORD": str(len(words.split(" ")) - 1)}
    done = subprocess.run([sys.executable, "-m", "lora_bench"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_completion_is_offered_and_installs_for_the_command_a_user_types(run_cli):
    code, out = run_cli("--help")
    assert code == 0 and "--install-completion" in out and "--show-completion" in out
    env = {k: v for k, v in os.environ.items() if not k.endswith("_COMPLETE")} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "lora_bench", "--show-completion", "bash"], env=env,
                          capture_output=True, text=True, timeout=120)
    out = done.stdout
    assert done.returncode == 0, done.stderr
    assert "_LORA_BENCH_COMPLETE=complete_bash" in out and "complete -o default -F" in out and "lora-bench" in out


def test_completion_completes_commands_and_a_settings_choices():
    assert _complete("lora-bench tr") == ["train"]
    assert "report" in _complete("lora-bench ") and "compare" in _complete("lora-bench ")
    assert _complete("lora-bench train --precision bf") == ["bf16", "bf16-true"]
    assert _complete("lora-bench train --trainable-layers lora") == ["lora", "lora-merged", "lora-kernel"]


def test_choices_show_as_choices_in_help(run_cli):
    import typer.main

    from lora_bench.cli import app

    train = typer.main.get_command(app).commands["train"]
    metavars = {p.name: p.metavar for p in train.params}
    for name in ("precision", "trainable_layers", "optimizer", "timing"):
        assert metavars[name] == "[" + "|".join(SETTINGS[name].spec.choices) + "]", name
    code, out = run_cli("train", "-h")
    assert code == 0
    assert "[fp32|tf32|bf16|bf16-true]" in out
    assert "[auto|cpu|cuda|cuda:N]" in out  # a pattern's values as the pattern reads
    assert "Allowed: fp32" not in out  # listed once, as the option's values
    switches = [n for n, s in SETTINGS.items() if s.type is bool]
    assert switches and all(metavars[n] == "" for n in switches)  # a switch shows no value type


def test_a_bad_choice_is_still_refused_with_the_settings_message(run_cli, tmp_path):
    code, out = run_cli("train", "--precision", "fp8", "--results-dir", tmp_path)
    assert code == 2 and "--precision='fp8' is not allowed" in out and "Traceback" not in out


def test_train_print_config_prints_the_resolved_settings_and_runs_nothing(run_cli, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("lora_rank: 16\nprecision: bf16\n")
    code, out = run_cli("train", "--config", cfg, "--lora-alpha", "32", "batch_size=4", "--print-config",
                        "--results-dir", tmp_path / "r")
    assert code == 0, out
    printed = yaml.safe_load(out)
    expected = TrainConfig(lora_rank=16, precision="bf16", lora_alpha=32.0, batch_size=4).to_dict()
    assert printed == expected and list(printed) == list(expected)
    assert not (tmp_path / "r").exists()
    # what it prints is a --config file that resolves to the same settings
    (tmp_path / "printed.yaml").write_text(out)
    again = run_cli("train", "--config", tmp_path / "printed.yaml", "--print-config")
    assert again == (0, out)


def test_train_print_config_refuses_what_a_run_refuses(run_cli):
    code, out = run_cli("train", "--print-config", "--precision", "fp8")
    assert code == 2 and "--precision='fp8'" in out and "model_size" not in out


def test_sweep_print_config_prints_every_runs_settings(run_cli, tmp_path):
    code, out = run_cli("sweep", SMOKE, "lora_rank=2", "--print-config", "--results-dir", tmp_path / "r")
    assert code == 0, out
    printed = yaml.safe_load(out)
    from lora_bench.sweep.spec import load_sweep

    planned = load_sweep(SMOKE, overrides={"lora_rank": 2})
    assert printed["name"] == planned.name
    assert [r["run_id"] for r in printed["runs"]] == [r.run_id for r in planned.runs]
    assert [r["settings"] for r in printed["runs"]] == [r.cfg.to_dict() for r in planned.runs]
    assert {r["settings"]["lora_rank"] for r in printed["runs"]} == {2}
    assert not (tmp_path / "r").exists()


@pytest.fixture
def runs(tmp_path):
    folder = tmp_path / "runs"
    shutil.copytree(FIXTURES / "report", folder)
    return folder


def test_show_takes_a_unique_prefix_of_a_run_id(run_cli, runs):
    from lora_bench.results.store import result_rows

    ids = sorted(r["run_id"] for r in result_rows(runs) if r.get("status") == "done")
    unique = next(i for i in ids if sum(j.startswith(i[:-1]) for j in ids) == 1)
    code, whole = run_cli("show", runs, unique)
    assert code == 0 and unique in whole
    assert run_cli("show", runs, unique[:-1]) == (0, whole)


def test_show_refuses_an_ambiguous_prefix_naming_the_candidates(run_cli, runs):
    from lora_bench.results.store import result_rows

    ids = sorted(r["run_id"] for r in result_rows(runs))
    prefix = ids[0].split("-")[0] + "-"
    candidates = [i for i in ids if i.startswith(prefix)]
    assert len(candidates) > 1
    code, out = run_cli("show", runs, prefix)
    assert code == 2 and "Traceback" not in out
    line = " ".join(out.split())  # one message, however the terminal wraps it
    assert f"run_id {prefix!r} begins {len(candidates)} run ids" in line
    assert all(c in line for c in candidates[:8])
    code, out = run_cli("show", runs, "no-such-run")
    assert code == 2 and "not found" in out
