"""Settings: one declaration feeds the `train` flags, the YAML keys and the cfg_* columns; every
rule is checked once and named as the caller's surface spells it; hostile values and files are
refused before anything formats or expands them."""

from __future__ import annotations

import math
import textwrap
import time
from pathlib import Path

import pytest
import typer

from lora_bench.config import (
    DEFAULTS,
    PANELS,
    SETTINGS,
    TrainConfig,
    flag_name,
    parse_overrides,
    render,
    settings_problems,
    value_problems,
)
from lora_bench.errors import ConfigError
from lora_bench.results.schema import SETTING_COLUMNS, run_column_names, settings_columns
from lora_bench.safe_yaml import MAX_NODES, load, short_repr
from paths import FIXTURES

SAMPLE = FIXTURES / "sms_spam_sample.tsv"


def _train_command():
    from lora_bench import cli

    return typer.main.get_command(cli.app).commands["train"]


# -- one declaration ---------------------------------------------------------------------------
def test_every_setting_is_one_train_option_one_yaml_key_and_one_column():
    options = {p.name: p for p in _train_command().params}
    assert set(SETTINGS) <= set(options)
    for name, s in SETTINGS.items():
        opt = options[name]
        assert opt.opts[0] == flag_name(name) and set(s.spec.aliases) <= set(opt.opts + opt.secondary_opts)
        assert opt.rich_help_panel == s.spec.panel
        for choice in s.spec.choices:  # allowed values listed in the help: as the option's values, or in its text
            assert choice in (opt.metavar or "").strip("[]").split("|") or choice in opt.help, (name, choice)
    assert [c.name for c in SETTING_COLUMNS] == ["cfg_" + n for n in SETTINGS]
    assert run_column_names()[-len(SETTINGS):] == ["cfg_" + n for n in SETTINGS]
    assert set(settings_columns(TrainConfig())) == {"cfg_" + n for n in SETTINGS}
    assert {s.spec.panel for s in SETTINGS.values()} == set(PANELS) - {"Output"}


def test_one_problem_is_named_as_each_surface_spells_it():
    values = {**DEFAULTS, "no_padding": True, "lora_rank": 0}
    problems = settings_problems(values)
    assert render(problems) == ["lora_rank=0 must be at least 1",
                                "no_padding needs batch_size=1 (got batch_size=8): unpadded texts of different "
                                "lengths cannot be stacked"]
    assert render(problems, flag_name)[1].startswith("--no-padding needs --batch-size=1 (got --batch-size=8)")
    assert render(problems, lambda n: f"<{n}>")[0] == "<lora_rank>=0 must be at least 1"


def test_aliases_and_flags_reach_the_run(run_cli, monkeypatch, tmp_path):
    got = []
    monkeypatch.setattr("lora_bench.train.run.execute_run",
                        lambda cfg, **kw: got.append(cfg) or {"run_id": "x", "timing_clock": "off"})
    code, out = run_cli("train", "--rank", "3", "--alpha", "2", "--lr", "1e-4", "--epochs", "2",
                        "--token-position", "first", "--device", "cpu", "--compile",
                        "--results-dir", tmp_path)
    assert code == 0, out
    c = got[0]
    assert (c.lora_rank, c.lora_alpha, c.learning_rate, c.num_epochs, c.trainable_token_pos, c.compile) == (
        3, 2.0, 1e-4, 2, "first", True)
    assert {k: v for k, v in c.to_dict().items() if v != DEFAULTS[k]} == {
        "lora_rank": 3, "lora_alpha": 2.0, "learning_rate": 1e-4, "num_epochs": 2, "trainable_token_pos": "first",
        "compile": True, "device": "cpu"}


# -- train --config and key=value overrides ----------------------------------------------------
def test_config_file_flags_and_overrides_by_precedence(run_cli, monkeypatch, tmp_path):
    got = []
    monkeypatch.setattr("lora_bench.train.run.execute_run",
                        lambda cfg, **kw: got.append(cfg) or {"run_id": "x", "timing_clock": "off"})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sms.tsv").write_text(SAMPLE.read_text())
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("model_size: tiny\nweights: random\nlora_rank: 4\nlora_alpha: 16\nbatch_size: 4\n"
                        "learning_rate: 1e-05\ndata_file: data/sms.tsv\ndevice: cpu\n")
    code, out = run_cli("train", "--config", cfg_file, "--batch-size", "2", "lora_rank=6", "precision=bf16",
                        "--results-dir", tmp_path / "r")
    assert code == 0, out
    c = got[0]
    assert (c.model_size, c.lora_rank, c.lora_alpha, c.batch_size, c.precision, c.learning_rate) == (
        "tiny", 6, 16.0, 2, "bf16", 1e-05)  # file < flags and overrides; 1e-05 is a number
    assert c.data_file == str((tmp_path / "data" / "sms.tsv").resolve())  # relative to the file
    code, out = run_cli("train", "-c", cfg_file, "-h")
    assert code == 0 and "precedence" in out and "--config" in out


@pytest.mark.parametrize("args, needles", [
    (["lr=1e-3"], ["unknown setting 'lr'; did you mean 'learning_rate'?"]),
    (["lora_rnak=4"], ["unknown setting 'lora_rnak'; did you mean 'lora_rank'?"]),
    (["bf16"], ["'bf16': write overrides as key=value"]),
    (["--lora-rank", "4", "lora_rank=5"], ["lora_rank is given twice: as --lora-rank and as lora_rank="]),
    (["lora_rank=[1, 2]"], ["lora_rank takes one value, not a list"]),
    (["no_padding=true"], ["no_padding needs --batch-size=1"]),  # each setting named as it was given
    (["learning_rate=.nan"], ["learning_rate=nan must be a finite number"]),
])
def test_bad_overrides_are_usage_errors(run_cli, tmp_path, args, needles):
    code, out = run_cli("train", "--device", "cpu", "--weights", "random", *args, "--results-dir", tmp_path)
    assert code == 2 and "Traceback" not in out, out
    for n in needles:
        assert n in out, out
    assert not (tmp_path / "runs.csv").exists()


def test_config_file_problems_name_the_file_and_its_keys(run_cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora_rnak: 4\nbatch_size: 0\nprecision: fp8\n")
    code, out = run_cli("train", "--config", bad, "--results-dir", tmp_path)
    assert code == 2 and str(bad) in out and "3 problems" in out
    assert "did you mean 'lora_rank'" in out and "batch_size=0 must be at least 1" in out and "'fp8'" in out
    for text, needle in (("- 1\n- 2\n", "one mapping of settings"), ("a: [\n", "not valid YAML"),
                         ("lora_rank: 4\nlora_rank: 8\n", "duplicate key 'lora_rank'"),
                         ("name: s\nbase: {lora_rank: 4}\n", "this is a sweep file")):
        bad.write_text(text)
        code, out = run_cli("train", "--config", bad, "--results-dir", tmp_path)
        assert code == 2 and needle in out and "Traceback" not in out, out
    code, out = run_cli("train", "--config", tmp_path / "none.yaml", "--results-dir", tmp_path)
    assert code == 2 and "no such file" in out


def test_sweep_overrides_apply_to_every_run_and_change_ids(run_cli, tmp_path):
    from lora_bench.sweep.spec import load_sweep

    path = tmp_path / "s.yaml"
    path.write_text(f"name: o\nbase: {{model_size: tiny, weights: random, data_file: {SAMPLE}}}\n"
                    "grid: {trainable_layers: [all, lora]}\n")
    plain = load_sweep(path)
    over = load_sweep(path, overrides={"max_steps": 8, "device": "cpu"})
    assert [r.cfg.max_steps for r in over.runs] == [8, 8] and {r.cfg.device for r in over.runs} == {"cpu"}
    assert {r.run_id for r in over.runs}.isdisjoint({r.run_id for r in plain.runs})  # other settings: other ids
    only_device = load_sweep(path, overrides={"device": "cpu"})
    assert [r.run_id for r in only_device.runs] == [r.run_id for r in plain.runs]  # environment: same ids
    code, out = run_cli("sweep", path, "max_steps=9", "--dry-run", "--results-dir", tmp_path / "r")
    ids = [r.run_id for r in load_sweep(path, overrides={"max_steps": 9}).runs]
    assert code == 0 and all(i in out for i in ids), out
    code, out = run_cli("sweep", path, "max_stesp=3", "--dry-run")
    assert code == 2 and "did you mean 'max_steps'" in out
    code, out = run_cli("sweep", path, "--device", "gpu", "device=cpu", "--dry-run")
    assert code == 2 and "device is given twice" in out


# -- conventions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", [[], ["train"], ["show"], ["validate"], ["sweep"], ["report"], ["compare"],
                                 ["kernel-bench"], ["data"], ["data", "prepare"]])
def test_short_help_everywhere(run_cli, cmd):
    code, out = run_cli(*cmd, "-h")
    assert code == 0 and "Usage" in out, out
    assert run_cli(*cmd, "--help")[1] == out


def test_train_help_is_grouped_into_panels_and_states_the_precedence(run_cli):
    code, out = run_cli("train", "-h")
    assert code == 0
    positions = [out.index(f"─ {panel} ─") for panel in PANELS]
    assert positions == sorted(positions)
    assert "lowest to highest precedence" in out and "KEY=VALUE" in out
    assert "[fp32|tf32|bf16|bf16-true]" in out and "--lora-rank" in out and "--rank" in out  # choices as choices


def test_output_paths_have_one_name_per_kind(run_cli):
    """--results-dir for a results folder, --output for the one other thing a command writes."""
    import re

    for cmd in (["train"], ["sweep"], ["kernel-bench"]):
        assert "--results-dir" in run_cli(*cmd, "-h")[1], cmd
    for cmd in (["report"], ["data", "prepare"]):
        text = run_cli(*cmd, "-h")[1]
        assert "--output" in text and not re.search(r"--out\b(?!put)", text), cmd


def test_help_examples_are_safe_to_paste(run_cli):
    """A '>' outside quotes in a shell command redirects into a file."""
    import re

    for cmd in (["train"], ["sweep"], ["kernel-bench"], ["report"], ["compare"], ["validate"], ["data", "prepare"]):
        out = run_cli(*cmd, "-h")[1]
        unquoted = re.sub(r"'[^']*'", "", out)
        assert "->" not in unquoted, (cmd, out)
    assert "'4x512:768->768:r16'" in run_cli("kernel-bench", "-h")[1]


def test_kernel_bench_device_defaults_to_auto(run_cli, tmp_path):
    import pandas as pd
    import torch

    code, out = run_cli("kernel-bench", "--shapes", "2x8:16->24:r2", "--impls", "frozen,lora", "--dtypes", "fp32",
                        "--repeats", "2", "--warmup", "1", "--results-dir", tmp_path, "--no-progress")
    assert code == 0, out
    rows = pd.read_csv(tmp_path / "kernel_bench.csv")
    assert set(rows["device"].str.split(":").str[0]) == {"cuda" if torch.cuda.is_available() else "cpu"}


def test_data_prepare_takes_output_and_the_old_spelling(run_cli, tmp_path):
    code, out = run_cli("data", "prepare", "--data-file", SAMPLE, "--output", tmp_path / "a", "--no-progress")
    assert code == 0 and (tmp_path / "a" / "train.csv").is_file(), out
    code, out = run_cli("data", "prepare", "--data-file", SAMPLE, "--out", tmp_path / "b", "--no-progress")
    assert code == 0 and (tmp_path / "b" / "test.csv").is_file(), out
    code, out = run_cli("data", "prepare", "--data-file", SAMPLE)
    assert code == 2 and "--output DIR is needed" in out


# -- hostile values ------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value, name", [("--lr", "nan", "--learning-rate"), ("--lr", "inf", "--learning-rate"),
                                               ("--alpha", "nan", "--lora-alpha"), ("--weight-decay", "-inf",
                                                                                    "--weight-decay")])
def test_non_finite_numbers_are_refused(run_cli, tmp_path, flag, value, name):
    code, out = run_cli("train", "--device", "cpu", "--weights", "random", flag, value, "--results-dir", tmp_path)
    assert code == 2 and "Traceback" not in out
    assert f"{name}={value} must be a finite number" in out, out
    assert not (tmp_path / "runs.csv").exists()


def test_values_are_checked_before_they_are_shown():
    huge = "x" * 1_000_000
    for name, value, needle in [
        ("model_size", huge, "is not allowed"), ("lora_rank", [1] * 1_000_000, "takes one value, not a list"),
        ("seed", {"a": 1}, "not a mapping"), ("batch_size", 10**5000, "is too large"),
        ("learning_rate", math.inf, "must be a finite number"), ("batch_size", True, "should be a whole number"),
        ("context_length", "9" * 500, "is not allowed"), ("device", "cuda:" + "1" * 100, "is not allowed"),
    ]:
        (p,) = value_problems(name, value)
        text = p.render()
        assert needle in text and len(text) < 300, (name, text[:300])
    assert short_repr("y" * 10_000).endswith("…") and len(short_repr("y" * 10_000)) == 80
    assert TrainConfig.from_mapping({"learning_rate": 1, "lora_alpha": 16}).lora_alpha == 16.0
    assert TrainConfig.from_mapping({"context_length": 512}).context_length == "512"


BOMB = textwrap.dedent("""\
    a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
    h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
    i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
    """)


@pytest.mark.parametrize("where", ["value", "grid"])
def test_alias_bombs_are_refused_fast(run_cli, tmp_path, where):
    body = BOMB.replace("\n", "\n  ").rstrip()
    use = "base:\n  model_size: *i\n" if where == "value" else "grid:\n  lora_rank: *i\n"
    path = tmp_path / "bomb.yaml"
    path.write_text(f"name: bomb\nx-anchors:\n  {body}\n{use}")
    t0 = time.monotonic()
    code, out = run_cli("validate", path)
    assert time.monotonic() - t0 < 10
    assert code == 2 and "alias bomb" in out and "lol" not in out and len(out) < 2000, out[:2000]
    code, out = run_cli("sweep", path, "--dry-run")
    assert code == 2 and "alias bomb" in out and len(out) < 2000


def _sparse(path: Path, size: int, head: bytes = b"name: big\n") -> Path:
    """A file of ``size`` bytes that takes no disk space: ``head``, then holes."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def test_settings_and_sweep_files_are_refused_by_their_size_before_reading(run_cli, tmp_path):
    """A file past the limit is refused by its size, in bytes, not read first: a 6 GB file as fast as
    one just past the limit."""
    for size in (8_000_000, 6 * 10**9):
        path = _sparse(tmp_path / f"big-{size}.yaml", size)
        t0 = time.monotonic()
        for args in (("train", "--config", path), ("validate", path), ("sweep", path, "--dry-run")):
            code, out = run_cli(*args)
            assert code == 2 and f"refused: {size:,} bytes; a settings file holds at most 1,000,000" in out, out
        assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("text", [
    "".join(f"user{i}:$6$secretsalt$hashhash{i}:19000:0:99999:7:::\n" for i in range(20)),  # a password file
    "-----BEGIN PRIVATE KEY-----\nMIIsecretsecret\n-----END PRIVATE KEY-----\n",
    "token: [secret-value\n",  # not valid YAML: PyYAML would quote the line
    "a: b: secret-value\n",
])
def test_a_file_not_meant_as_settings_is_not_quoted(run_cli, tmp_path, text):
    path = tmp_path / "not-settings"
    path.write_text(text)
    for args in (("train", "--config", path), ("validate", path), ("sweep", path, "--dry-run")):
        code, out = run_cli(*args)
        assert code == 2 and "Traceback" not in out, out
        assert "secret" not in out, out
    code, out = run_cli("train", "--config", path)  # says what is wrong, and where, all the same
    assert any(k in out for k in ("(line ", "this one holds text", "not setting names")), out


def test_a_pipe_or_device_given_as_a_settings_file_is_named_as_such(run_cli, tmp_path):
    """Neither opened (a pipe would block) nor reported as missing."""
    import os

    os.mkfifo(tmp_path / "fifo.yaml")
    for path in (tmp_path / "fifo.yaml", "/dev/zero"):
        for args in (("train", "--config", path), ("validate", path), ("sweep", path, "--dry-run")):
            code, out = run_cli(*args)
            assert code == 2 and "not a regular file (a pipe, device or socket)" in out, out


def test_yaml_loader_rules():
    assert load("a: &x {k: 1}\nb:\n  <<: *x\n  j: 2\n") == {"a": {"k": 1}, "b": {"k": 1, "j": 2}}  # merges work
    assert load("lr: 1e-05\nx: 3E4\ny: 1.5e3\nz: 12\ns: 1e5x\n") == {"lr": 1e-05, "x": 30000.0, "y": 1500.0, "z": 12,
                                                                     "s": "1e5x"}
    for text, needle in [("a: 1\nb: 2\na: 3\n", "duplicate key 'a' (first given on line 1)"),
                         ("x: &a [1, *a]\n", "anchor contains itself"),
                         ("[" * 100 + "]" * 100, "nests more than"),
                         ("a: " + "1" * 5000, "not valid YAML"),
                         (f"a: &a [{', '.join(['1'] * 400)}]\nb: [{', '.join(['*a'] * 300)}]\n", f"{MAX_NODES:,}")]:
        with pytest.raises(ConfigError) as e:
            load(text, source="f.yaml")
        assert needle in str(e.value) and str(e.value).startswith("f.yaml: "), str(e.value)[:300]


# -- sweeps: counted before expansion, seeds per repeat -------------------------------------------
def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nbase: {{model_size: tiny, weights: random, data_file: {SAMPLE}}}\n" + body)
    return path


@pytest.mark.parametrize("body, needle", [
    ("repeats: 1000000000\n", "expands to 1,000,000,000 runs (1,000,000,000 repeats); at most 100,000"),
    ("grid:\n  seed: [" + ", ".join(map(str, range(400))) + "]\n  lora_rank: [" + ", ".join(map(str, range(1, 400)))
     + "]\nrepeats: 2\n", "expands to 319,200 runs (grid 400 × 399 × 2 repeats)"),
])
def test_sweep_size_is_counted_before_expansion(run_cli, tmp_path, body, needle):
    path = _write(tmp_path, body)
    t0 = time.monotonic()
    code, out = run_cli("validate", path)
    assert time.monotonic() - t0 < 10
    assert code == 2 and needle in out, out


def _grid_of_seeds(tmp_path: Path, n: int, *, ranks: int = 1) -> Path:
    """A sweep of ``n`` × ``ranks`` distinct runs: ``n`` seeds (one grid key of many values, where a
    per-value check against every earlier value grows with n squared) × ``ranks`` LoRA ranks."""
    path = tmp_path / f"seeds-{n}x{ranks}.yaml"
    path.write_text(f"name: s\nbase: {{model_size: tiny, weights: random, data_file: {SAMPLE}}}\n"
                    f"grid:\n  seed: [{', '.join(map(str, range(n)))}]\n"
                    f"  lora_rank: [{', '.join(map(str, range(1, ranks + 1)))}]\n")
    return path


def _expand_and_list(path: Path) -> tuple[float, int]:
    import io

    from rich.console import Console

    from lora_bench.sweep.sweep_command import print_plan
    from lora_bench.sweep.spec import load_sweep

    t0 = time.perf_counter()
    sw = load_sweep(path)
    print_plan(sw, list(sw.runs), results_dir=path.parent / "results", console=Console(file=io.StringIO()))
    return time.perf_counter() - t0, len(sw.runs)


def test_sweep_expansion_grows_linearly_with_its_runs(tmp_path):
    """Ten times the runs take about ten times as long to expand and list, not a hundred: 20 allows
    for timer noise on the smaller sweep, and a cost per value that grows with the values fails it."""
    _expand_and_list(_grid_of_seeds(tmp_path, 100))  # imports and first-call costs out of the timing
    small, n_small = _expand_and_list(_grid_of_seeds(tmp_path, 2_000))
    large, n_large = _expand_and_list(_grid_of_seeds(tmp_path, 20_000))
    assert (n_small, n_large) == (2_000, 20_000)
    assert large < 20 * small, (small, large)


@pytest.mark.slow
def test_a_sweep_at_the_run_cap_expands_and_lists_in_seconds(tmp_path):
    """``validate`` and ``--dry-run`` of the largest sweep allowed (MAX_RUNS distinct runs) stay
    under the 30 s a person waits for a check: this machine (2 shared cores) takes about 8 s, so
    30 s leaves room for a slower one, while a per-run cost of a few hundred microseconds more (every
    value checked again, settings deep-copied for each hash: 50 s and more) fails."""
    from lora_bench.sweep.spec import MAX_RUNS

    seconds, n = _expand_and_list(_grid_of_seeds(tmp_path, MAX_RUNS // 10, ranks=10))
    assert n == MAX_RUNS
    assert seconds < 30, seconds


@pytest.mark.parametrize("text, needle", [
    ("grid:\n  learning_rate: [1e-05, .nan]\n", "grid: learning_rate=nan must be a finite number"),
    ("grid:\n  learning_rate: [.inf]\n", "learning_rate=inf must be a finite number"),
    ("runs:\n  - {lora_rank: [4, 8]}\n", "runs[0]: lora_rank takes one value, not a list"),
    ("lora_rank: 4\n", "'lora_rank' is a run setting: put it under base:"),
    ("grid:\n  lora_rank: [4, 4]\n", "grid.lora_rank lists 4 twice"),
    ("vary_seed: yes please\n", "vary_seed='yes please' must be true or false"),
])
def test_sweep_value_problems(tmp_path, text, needle):
    from lora_bench.sweep.spec import load_sweep

    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_sweep(path)
    assert needle in str(e.value), str(e.value)


def test_learning_rate_written_as_1e_05_is_a_number(tmp_path):
    from lora_bench.sweep.spec import load_sweep

    sw = load_sweep(_write(tmp_path, "grid:\n  learning_rate: [1e-05, 5e-5]\n"))
    assert [r.cfg.learning_rate for r in sw.runs] == [1e-05, 5e-05]
    assert parse_overrides(["learning_rate=1e-5"]) == ({"learning_rate": 1e-05}, [])


def test_isolation_is_checked_on_a_dry_run(run_cli, tmp_path):
    path = _write(tmp_path, "")
    code, out = run_cli("sweep", path, "--isolation", "bogus", "--dry-run")
    assert code == 2 and "--isolation 'bogus' is not allowed; choose one of: process, inline" in out


def test_repeats_vary_the_seed_when_asked(tmp_path):
    from lora_bench.sweep.spec import load_sweep

    same = load_sweep(_write(tmp_path, "grid: {trainable_layers: [all, lora]}\nrepeats: 3\n"))
    assert {r.cfg.seed for r in same.runs} == {123} and not same.vary_seed  # default: timing repeats
    varied = load_sweep(_write(tmp_path, "grid: {trainable_layers: [all, lora]}\nrepeats: 3\nvary_seed: true\n"))
    got = [(r.repeat, r.cfg.trainable_layers, r.cfg.seed) for r in varied.runs]
    assert got == [(0, "all", 123), (0, "lora", 123), (1, "all", 124), (1, "lora", 124), (2, "all", 125),
                   (2, "lora", 125)]
    assert [settings_columns(r.cfg)["cfg_seed"] for r in varied.runs] == [123, 123, 124, 124, 125, 125]
    ids = [r.run_id for r in varied.runs]
    assert len(set(ids)) == 6 and ids == [r.run_id for r in load_sweep(tmp_path / "s.yaml").runs]  # deterministic
    assert ids[0] == same.runs[0].run_id  # repeat 0 keeps the declared seed and so its id
    assert ids[2] != same.runs[2].run_id and ids[2].endswith("-r1")  # another seed: another id
    clash = _write(tmp_path, "grid: {seed: [1, 2]}\nrepeats: 2\nvary_seed: true\n")
    with pytest.raises(ConfigError, match="seed=1, repeat 1 .* has the same settings as seed=2|same settings"):
        load_sweep(clash)


def test_repeats_with_seeds_record_cfg_seed(run_cli, tmp_path):
    """A real (tiny) sweep: each repeat's row holds its seed."""
    import pandas as pd

    path = _write(tmp_path, "  \nrepeats: 2\nvary_seed: true\n".lstrip())
    path.write_text(path.read_text().replace("data_file", "device: cpu, num_epochs: 1, max_steps: 2, "
                                             "warmup_steps: 1, eval_freq: 0, skip_final_eval: true, data_file"))
    code, out = run_cli("sweep", path, "--isolation", "inline", "--results-dir", tmp_path / "r", "--no-progress",
                        "--cache-dir", tmp_path / "cache")
    assert code == 0, out
    df = pd.read_csv(tmp_path / "r" / "runs.csv", dtype=str)
    assert sorted(zip(df["repeat"], df["cfg_seed"])) == [("0", "123"), ("1", "124")]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_machine_checks_name_the_flag_before_anything_runs(run_cli, tmp_path):
    code, out = run_cli("train", "--weights", "random", "--cuda-graphs", "--results-dir", tmp_path)
    assert code == 2 and "--cuda-graphs needs a CUDA device, and none is available here" in out, out
    code, out = run_cli("train", "--weights", "random", "device=cuda:1", "--results-dir", tmp_path)
    assert code == 2 and "device='cuda:1' but this machine has 0 CUDA device(s); use device=cpu or auto" in out, out
    assert not (tmp_path / "runs.csv").exists()


def test_a_large_document_without_aliases_is_not_called_an_alias_bomb(run_cli, tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("name: big\nbase: {model_size: tiny, weights: random}\ngrid:\n  seed: ["
                    + ", ".join(str(i) for i in range(MAX_NODES + 10)) + "]\n")
    code, out = run_cli("validate", path)
    assert code == 2 and "Traceback" not in out, out[:2000]
    assert "alias" not in out and f"more than {MAX_NODES:,} values" in out, out[:2000]
