"""What a packed sweep plans before its first run: repeats of one setting (every setting equal, the
seed too) go to separate packs, never one, and the plan says why; a pack's memory estimate counts
every run's adapters, head and batch, and a pack that cannot fit is refused before anything runs.
kernel-bench estimates a group's memory as a run does, before it allocates."""

from __future__ import annotations

import textwrap

import torch
from tiny import TINY_BASE

from lora_bench.config import TrainConfig
from lora_bench.sweep.packs import describe_plan, plan_packs
from lora_bench.sweep.spec import load_sweep
from lora_bench.train.pack import pack_problem


def _sweep(tmp_path, body: str):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nbase:\n" + TINY_BASE + "  trainable_layers: lora\n" + textwrap.dedent(body))
    return load_sweep(path)


def _settings(run) -> tuple:
    return tuple(sorted(run.cfg.to_dict().items()))


def test_repeats_of_one_setting_never_share_a_pack(tmp_path):
    sw = _sweep(tmp_path, "repeats: 3\npack: 3\n")
    units, alone = plan_packs(list(sw.runs), 3)
    assert [len(u.runs) for u in units] == [1, 1, 1]
    lines = describe_plan(units, alone, 3)
    assert any("3 run(s) train alone" in line and "repeats of one setting never share a pack" in line
               for line in lines), lines


def test_repeats_are_spread_over_packs_of_different_settings(tmp_path):
    sw = _sweep(tmp_path, "repeats: 3\npack: 6\ngrid:\n  lora_rank: [4, 8]\n")
    units, alone = plan_packs(list(sw.runs), 6)
    assert sorted(len(u.runs) for u in units) == [2, 2, 2] and not alone
    for u in units:
        assert len({_settings(r) for r in u.runs}) == len(u.runs)
    assert sorted(r.run_id for u in units for r in u.runs) == sorted(r.run_id for r in sw.runs)  # none lost
    lines = describe_plan(units, alone, 6)
    assert any("6 packed run(s) are repeats of one setting" in line for line in lines), lines


def test_a_pack_of_one_setting_twice_is_refused():
    cfg = TrainConfig(model_size="tiny", trainable_layers="lora")
    why = pack_problem([cfg, cfg.replace(lora_rank=4), cfg])
    assert why is not None and "runs 1 and 3 of the pack have the same settings" in why
    assert pack_problem([cfg, cfg.replace(lora_rank=4)]) is None


def test_a_packs_estimate_counts_every_runs_adapters():
    from lora_bench.train.memory import estimate

    a = TrainConfig(model_size="tiny", trainable_layers="lora", lora_rank=64)
    b = a.replace(lora_rank=128)
    pack = estimate(a, pack=[a, b])
    assert pack.trainable == estimate(a).trainable + estimate(b).trainable
    assert pack.training_state > estimate(b).training_state


def test_a_pack_that_cannot_fit_is_refused_before_any_run(tmp_path, run_cli, monkeypatch):
    import lora_bench.train.memory as memory
    import lora_bench.train.run as run_mod

    sw = _sweep(tmp_path, "pack: 4\ngrid:\n  lora_rank: [4096, 4097, 4098, 4099]\n")
    one = memory.estimate(sw.runs[0].cfg).total("cpu")
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2 * one)  # a run fits, four do not

    def forbidden(*a, **k):
        raise AssertionError("a run was started")

    monkeypatch.setattr(run_mod, "execute", forbidden)
    code, out = run_cli("sweep", sw.path, "--results-dir", tmp_path / "res", "--cache-dir", tmp_path / "cache",
                        "--isolation", "inline", "--no-progress")
    assert code == 2 and "Traceback" not in out, out
    assert "the pack of" in out and "pack fewer runs" in out, out


def test_kernel_bench_refuses_a_group_that_cannot_fit_before_allocating(run_cli, monkeypatch, tmp_path):
    import lora_bench.bench.kernel_bench as kb

    monkeypatch.setattr(kb, "available_bytes", lambda device: 2**20)

    def forbidden(*a, **k):
        raise AssertionError("allocated")

    monkeypatch.setattr(kb, "_make_sets", forbidden)
    code, out = run_cli("kernel-bench", "--device", "cpu", "--shapes", "4096:4096->4096:r16", "--impls", "lora",
                        "--dtypes", "fp32", "--results-dir", tmp_path / "bench")
    assert code == 2 and "Traceback" not in out, out
    assert "needs about" in out and "GiB available" in out, out
    assert not (tmp_path / "bench").exists()  # refused: no folder left behind


def test_kernel_bench_lets_a_group_that_fits_through():
    import lora_bench.bench.kernel_bench as kb

    assert kb.memory_problem(["lora", "frozen"], kb.parse_shape("4:32->32:r4"), "fp32", torch.device("cpu")) is None
