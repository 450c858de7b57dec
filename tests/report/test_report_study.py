"""lora_bench.report.labels / study / answer: human names for execution modes, the study built from
synthetic runs (groups, ratios and their intervals, profiles joined by step shape, seeds), and each
rule of the generated answer on hand-made groups; then the answer for real rows (the study
fixture: 124M and 1558M, eager fp32 and CUDA graphs, two repeats, torch.profiler counts at 124M)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from lora_bench.report import answer as rules
from lora_bench.report import stats
from lora_bench.report.load import load_results
from lora_bench.report.labels import mode_name
from lora_bench.report.stats import Estimate
from lora_bench.report.study import Group, Line, Phase, build_study
from lora_bench.report.tables import accuracy_table
from lora_bench.timing import PHASES
from paths import FIXTURES

STUDY = FIXTURES / "study"
GRAPHS = "CUDA graphs + bf16 + SDPA + fused ops + fused AdamW"


# -- names ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, name", [
    ({}, "eager fp32"),
    ({"cfg_precision": "fp32", "cfg_attention": "book", "cfg_ops": "book", "cfg_cuda_graphs": "False",
      "cfg_optimizer": "book", "cfg_compile": "False"}, "eager fp32"),
    ({"cfg_precision": "bf16", "cfg_attention": "sdpa", "cfg_ops": "fused", "cfg_cuda_graphs": "True",
      "cfg_optimizer": "fused"}, GRAPHS),
    ({"cfg_precision": "bf16-true", "cfg_attention": "sdpa", "cfg_ops": "fused", "cfg_cuda_graphs": "True",
      "cfg_optimizer": "one-launch"}, "CUDA graphs + bf16-true + SDPA + fused ops + one-launch AdamW"),
    ({"cfg_precision": "bf16", "cfg_attention": "sdpa", "cfg_ops": "fused"}, "eager bf16 + SDPA + fused ops"),
    ({"cfg_compile": "True", "cfg_compile_scope": "blocks", "cfg_cuda_graphs": "True", "cfg_precision": "bf16"},
     "block-compiled + CUDA graphs + bf16"),
    ({"cfg_compile": "True", "cfg_precision": "tf32", "cfg_optimizer": ""}, "torch.compile + TF32"),
])
def test_mode_names_come_from_the_settings(settings, name):
    assert mode_name(settings) == name


# -- synthetic runs ------------------------------------------------------------------------------
PARAMS = {"124M": 124_441_346, "1558M": 1_557_611_200}


def _run(i: int, *, size: str, layers: str, step: float, graphs: bool = False, batch: int = 8, seed: int = 123,
         acc: float | None = None, host_ratio: float = 1.0, profile: str = "none", epochs: int = 1) -> dict:
    """One finished run: phases split 10/40/40/10 % of the step; host = host_ratio × device."""
    parts = dict(zip(PHASES, (0.1, 0.4, 0.4, 0.1)))
    row = {"run_id": f"{size}-{layers}-{i}", "status": "done", "started_at": f"2026-01-01T00:{i:02d}:00+00:00",
           "cfg_model_size": size, "cfg_trainable_layers": layers, "cfg_batch_size": str(batch),
           "cfg_num_epochs": str(epochs), "cfg_seed": str(seed), "cfg_profile": profile,
           "cfg_precision": "bf16" if graphs else "fp32", "cfg_cuda_graphs": str(graphs),
           "cfg_skip_final_eval": str(acc is None), "step_ms_median": step, "tokens_per_step": 120.0 * batch,
           "total_params": PARAMS[size] + (2_000_000 if layers != "all" else 0), "gpu_name": "NVIDIA H200",
           "flops_per_step": (6 if layers == "all" else 4) * PARAMS[size] * 120.0 * batch, "mfu": step / 1000,
           "test_acc": acc if acc is not None else ""}
    for ph, share in parts.items():
        row[f"{ph}_ms_median"] = share * step
        row[f"host_{ph}_ms_median"] = host_ratio * share * step
        row[f"bound_{ph}"] = "host" if host_ratio >= 0.9 else "device"
    return row


def _study(tmp_path, rows: list[dict], **kw):
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    return build_study(load_results([tmp_path]), **kw)


def test_groups_ratios_ranges_and_lines(tmp_path):
    rows = []
    for r, (a, b) in enumerate(((50, 76), (52, 80), (51, 78), (50.5, 77), (51.5, 79))):
        rows += [_run(10 * r, size="124M", layers="all", step=a), _run(10 * r + 1, size="124M", layers="lora", step=b),
                 _run(10 * r + 2, size="1558M", layers="all", step=300 + r), _run(10 * r + 3, size="1558M", layers="lora", step=240 + r)]
    two = _study(tmp_path, rows[:8])  # two repeats: an interval, no verdict
    assert {g.verdict for ln in two.lines for g in ln.groups} == {stats.TOO_FEW}
    assert two.lines[0].groups[0].ratio_estimate.n == 2
    s = _study(tmp_path, rows)
    assert s.baseline == {"cfg_trainable_layers": "all"} and s.sizes == ["124M", "1558M"]
    assert [ln.label for ln in s.lines] == ["lora · eager fp32"] and [g.size for g in s.lines[0].groups] == ["124M", "1558M"]
    small = s.lines[0].groups[0]
    assert small.ratio == pytest.approx(78 / 51)
    # unpaired (no sweep to pair the repeats by): from the two medians' intervals, [min, max] at n = 5
    assert (small.ratio_lo, small.ratio_hi) == (pytest.approx(76 / 52), pytest.approx(80 / 50))
    assert small.ratio_over == stats.REPEATS and small.ratio_estimate.at_least
    assert small.verdict == "slower" and small.params == PARAMS["124M"]  # the base model's size, not with adapters
    big = s.lines[0].groups[1]
    assert big.verdict == "faster" and big.ratio < 1
    assert "Why is lora faster or slower than all" in s.header.question


def test_a_baseline_of_several_settings_names_each_group_by_what_differs_from_it(tmp_path):
    """--baseline with several settings (as the variants study's): a group is named by the settings
    in which it differs from the baseline, each named; the baseline's own group, and the question,
    by all of them."""
    rows = []
    for r in range(2):
        for z in ("124M", "1558M"):
            for layers, variant, ms in (("lora", "lora", 6.0), ("lora", "dora", 13.0), ("lora-kernel", "dora", 8.0)):
                row = _run(100 * r + len(rows), size=z, layers=layers, step=ms + r, graphs=True)
                row["cfg_lora_variant"] = variant
                rows.append(row)
    s = _study(tmp_path, rows, baseline="trainable_layers=lora,lora_variant=lora")
    names = {g.variant for g in s.groups}
    assert names == {"trainable_layers=lora, lora_variant=lora", "lora_variant=dora",
                     "trainable_layers=lora-kernel, lora_variant=dora"}, names
    assert "compare with trainable_layers=lora, lora_variant=lora" in s.header.question


def test_conditions_name_lines_and_redundant_settings_are_dropped(tmp_path):
    rows = [_run(i, size=z, layers=l, step=10, batch=b, epochs=1 if b == 8 else 2)
            for i, (z, l, b) in enumerate((z, l, b) for z in ("124M", "1558M") for l in ("all", "lora") for b in (8, 32))]
    s = _study(tmp_path, rows)
    assert s.conditions() == ["batch 8", "batch 32"]  # num_epochs follows batch_size: not in the names
    assert "num_epochs" in s.header.varying


def test_profiles_join_the_group_with_their_step_shape(tmp_path):
    rows = [_run(0, size="124M", layers="all", step=50), _run(1, size="124M", layers="lora", step=70),
            _run(2, size="124M", layers="all", step=80, profile="torch", epochs=5),  # other epochs: still matches
            _run(3, size="124M", layers="lora", step=90, profile="torch", batch=32)]  # other batch: no group
    for r, counts in ((rows[2], "forward,500,7.5\nbackward,1200,14.0\noptimizer,56,2.8\n"),
                      (rows[3], "forward,900,9.0\n")):
        (tmp_path / r["run_id"]).mkdir()
        (tmp_path / r["run_id"] / "kernels_by_phase.csv").write_text("phase,launches_per_step,kernel_ms_per_step,unit\n"
                                                                    + counts)
    s = _study(tmp_path, rows)
    assert [g.n for g in s.groups] == [1, 1]  # profiled runs are left out of the timings
    base = s.groups[0]
    assert base.profile == "124M-all-2" and base.kernels() == (1756.0, pytest.approx(24.3))
    assert s.groups[1].kernels() is None
    assert [p.group is not None for p in s.profiles] == [True, False]
    assert any("profiled run(s) left out of the timings" in n for n in s.notes)


def test_a_packs_profile_joins_no_solo_group_of_the_same_shape(tmp_path):
    """A pack's profile measures all its points' step at once: it describes no group of solo runs
    with the settings of one of its points."""
    rows = [_run(0, size="124M", layers="all", step=50), _run(1, size="124M", layers="lora", step=70),
            {**_run(2, size="124M", layers="lora", step=900, profile="kernels"), "pack_size": 16, "pack_id": "pack-1"}]
    (tmp_path / rows[2]["run_id"]).mkdir()
    (tmp_path / rows[2]["run_id"] / "kernels_by_phase.csv").write_text(
        "phase,launches_per_step,kernel_ms_per_step,unit,pack_size\nforward,3242,30.0,cuda,16\n")
    s = _study(tmp_path, rows)
    assert all(g.kernels() is None for g in s.groups) and [p.group for p in s.profiles] == [None]
    solo = {**rows[2], "pack_size": None, "pack_id": None}
    assert _study(tmp_path, [*rows[:2], solo]).groups[1].kernels() is not None  # alone, the same profile joins


def test_accuracy_over_seeds(tmp_path):
    rows = []
    for r, seed in enumerate((1, 2, 3, 4, 5)):
        rows += [_run(10 * r, size="124M", layers="all", step=50, seed=seed, acc=(95.0, 96.0, 97.0, 95.5, 96.5)[r]),
                 _run(10 * r + 1, size="124M", layers="lora", step=70, seed=seed, acc=(95.5, 96.5, 96.0, 95.0, 97.0)[r]),
                 _run(10 * r + 2, size="1558M", layers="all", step=300, seed=seed,
                      acc=(97.0, 97.2, 97.1, 97.05, 97.15)[r]),
                 _run(10 * r + 3, size="1558M", layers="lora", step=240, seed=seed,
                      acc=(93.0, 93.2, 93.1, 93.05, 93.15)[r])]
    few = _study(tmp_path, rows[:12])  # three seeds: a difference with an interval, not judged
    assert few.accuracy_vs_base(next(g for g in few.groups if g.size == "1558M" and g.variant == "lora"))[1] is None
    s = _study(tmp_path, rows)
    assert s.seeds_vary and s.accuracy_metric == "test_acc" and len(s.groups) == 4  # seeds are repeats
    small = next(g for g in s.groups if g.size == "124M" and g.variant == "lora")
    assert small.seeds == ["1", "2", "3", "4", "5"] and small.accuracy["test_acc"].median == 96.0
    d, outside = s.accuracy_vs_base(small)
    assert d.value == 0.0 and d.lo < 0 < d.hi and outside is False  # within the spread over seeds
    big = next(g for g in s.groups if g.size == "1558M" and g.variant == "lora")
    d, outside = s.accuracy_vs_base(big)
    assert d.value == pytest.approx(-4.0) and d.hi < 0 and outside is True
    text = rules.accuracy_sentence(s)
    assert "median over 5 seeds" in text and "1 other difference" in text
    assert f"lora -4.00 points {stats.span_text(d)} at 1558M" in text


# -- rules on hand-made groups -------------------------------------------------------------------
def _e(v: float, half: float = 0.0) -> Estimate:
    """A median of two repeats with the interval v ± half."""
    return Estimate(v, v - half, v + half, n=2, over=stats.REPEATS) if not math.isnan(v) else stats.NONE


def _g(size: str, ratio: float = math.nan, *, verdict: str = "", variant: str = "lora", step: float = 100.0,
       phases: dict | None = None, busy: float | None = None, kernels: dict | None = None, flops: float = math.nan,
       mfu: float = math.nan) -> Group:
    """A group; ``busy``: a profiled repeat's kernel time in every phase as that share of its device
    time (None: not profiled)."""
    phases = phases or {"data": 1.0, "forward": 30.0, "backward": 55.0, "optimizer": 14.0}
    ph = {}
    for name, ms in phases.items():
        launches, kms = (kernels or {}).get(name, (None, None))
        if busy is not None and kms is None:
            kms = busy * ms
        ph[name] = Phase(device=_e(ms, 0.1), host=_e(ms, 0.1), launches=launches, kernel_ms=kms)
    return Group(size=size, variant=variant, mode="eager fp32", condition="batch 8", settings={}, runs=pd.DataFrame(),
                 step=_e(step, 1.0), phases=ph, seeds=["123"], ratio=ratio, ratio_lo=ratio - 0.01,
                 ratio_hi=ratio + 0.01, ratio_over=stats.REPEATS if not math.isnan(ratio) else "", verdict=verdict,
                 flops_per_step=flops, mfu=_e(mfu, 0.005), counts=dict(kernels or {}))


def _by_ratio(r: float) -> str:
    return "slower" if r > 1.03 else "faster" if r < 0.97 else "no difference"


def test_verdict_and_crossover():
    assert rules.verdict(_g("124M", 1.5, verdict="slower")) == "slower"
    assert rules.verdict(_g("124M", 0.99, verdict="no difference")) == "no difference"
    assert rules.verdict(_g("124M", 0.9)) == "unclear"  # no verdict given: not read off the ratio alone
    assert rules.verdict(_g("124M")) == "unknown"
    sizes = ["124M", "355M", "774M", "1558M"]
    line = [_g(z, r, verdict=_by_ratio(r)) for z, r in zip(sizes, (1.5, 1.3, 1.2, 0.8))]
    assert rules.crossover(line) == "between 774M and 1558M"
    faster = [_g(z, r, verdict="faster") for z, r in zip(sizes, (0.9, 0.8, 0.7, 0.6))]
    slower = [_g(z, r, verdict="slower") for z, r in zip(sizes, (1.2, 1.1, 1.1, 1.05))]
    assert rules.crossover(faster) == "faster at every size" and rules.crossover(slower) == "slower at every size"
    # faster, then no difference, then faster: the crossover is where it stays faster
    assert rules.crossover([_g("124M", 1.3, verdict="slower"), _g("355M", 0.8, verdict="faster"),
                            _g("774M", 0.99, verdict="no difference"), _g("1558M", 0.8, verdict="faster")]) == \
        "between 774M and 1558M"
    # an unclear verdict at the largest size: no crossover is claimed
    assert rules.crossover([_g("124M", 1.3, verdict="slower"), _g("1558M", 0.95, verdict="unclear")]) == ""
    ln = Line(condition="batch 8", mode="eager fp32", variant="lora", groups=line)
    assert rules.crossover_sentence(ln, base="all") == (
        "lora takes 1.50× [1.49–1.51] all's step time at 124M and 0.80× [0.79–0.81] at 1558M: the crossover lies "
        "between 774M and 1558M")


def test_host_bound_phases_are_measured_and_leave_out_tiny_phases():
    """Host-bound: a profiled repeat saw the GPU run kernels for under half of the phase's device
    time; a busy GPU, one in between, or a phase no profile covers is not host-bound."""
    g = _g("124M", busy=0.3, phases={"data": 0.5, "forward": 30.0, "backward": 60.0, "optimizer": 9.5})
    assert rules.host_bound_phases(g) == ["forward", "backward", "optimizer"]  # data: 0.5 % of the step
    assert g.phases["forward"].cause == "GPU waits for the host" and g.phases["forward"].busy == pytest.approx(0.3)
    assert rules.host_bound_phases(_g("124M", busy=0.95)) == [] and _g("124M", busy=0.95).phases["forward"].cause == "GPU-bound"
    assert rules.host_bound_phases(_g("124M", busy=0.7)) == [] and _g("124M", busy=0.7).phases["forward"].cause == "mixed"
    assert rules.host_bound_phases(_g("124M")) == [] and _g("124M").phases["forward"].cause == ""  # not measured


def test_launches_and_work_from_a_profile_or_from_flops():
    b = _g("124M", variant="all", kernels={"forward": (524, 7.7), "backward": (1225, 14.7), "other": (1, 0.0)})
    assert b.kernels() == (1750, pytest.approx(22.4))  # launches outside any phase count too
    b = _g("124M", variant="all", kernels={"forward": (524, 7.7), "backward": (1225, 14.7), "optimizer": (56, 2.8)})
    g = _g("124M", kernels={"forward": (890, 9.3), "backward": (1564, 10.7), "optimizer": (22, 0.2)})
    text = rules.launches_and_work(g, b)
    assert text == ("lora launches 37 % more kernels per step (2,476 vs 1,805, torch.profiler) while its kernels "
                    "run 20 % less device time (20.2 vs 25.2 ms)")
    text = rules.launches_and_work(_g("124M", flops=3.3e11), _g("124M", variant="all", flops=4.9e11))
    assert "33 % fewer FLOPs (0.33 vs 0.49 TFLOP, analytic" in text


def test_why_slower_and_why_faster():
    b = _g("124M", variant="all", step=50.0, busy=0.4, phases={"data": 0.3, "forward": 14.0, "backward": 31.7, "optimizer": 4.0})
    g = _g("124M", 1.54, verdict="slower", step=77.0, busy=0.3,
           phases={"data": 0.6, "forward": 28.8, "backward": 44.5, "optimizer": 3.1})
    text = rules.why_slower(g, b)
    # all's optimizer (8 % of its step) is host-bound, lora's (4 %) too small to name: both means forward and backward
    assert text.startswith("At 124M the forward and backward phases are host-bound for both all and lora (in a "
                           "profiled repeat the GPU ran kernels for forward 40 / 30 %, backward 40 / 30 % of the phase's "
                           "device time")
    assert text.endswith("its step is 54 % longer (77.0 ms [76.0–78.0] (n = 2) vs 50.0 ms [49.0–51.0] (n = 2)).")
    b = _g("1558M", variant="all", step=295.0, phases={"data": 0.4, "forward": 89.4, "backward": 170.9, "optimizer": 34.1},
           mfu=0.43)
    g = _g("1558M", 0.84, verdict="faster", step=247.0, phases={"data": 0.9, "forward": 100.4, "backward": 133.1, "optimizer": 9.0})
    text = rules.why_faster(g, b, smallest=_g("124M", variant="all", mfu=0.14))
    assert text.startswith("At 1558M lora saves 37.8 ms in backward and 25.1 ms in optimizer and spends 11.0 ms "
                           "more in forward: its step is 16 % shorter (247.0 ms [246.0–248.0] (n = 2) vs 295.0 ms [294.0–296.0] "
                           "(n = 2)).")
    assert "The optimizer alone takes 12 % of all's step" in text
    assert "MFU 0.43 [0.42–0.43] (n = 2) at 1558M against 0.14 [0.14–0.15] (n = 2) at 124M" in text


def test_host_bound_summary():
    assert rules.host_bound_summary([_g("124M"), _g("1558M")]) == (
        "the cause of each phase's time is not measured (no profiled repeat of these settings)")
    assert rules.host_bound_summary([_g("124M", busy=0.95), _g("1558M", busy=0.6)]) == (
        "no phase is host-bound at 124M and 1558M (in a profiled repeat the GPU ran kernels for at least 50 % of "
        "every phase)")
    groups = [_g("124M", variant="all", busy=0.3), _g("124M", busy=0.3), _g("355M"), _g("1558M", variant="all", busy=0.95),
              _g("1558M", busy=0.3)]
    assert rules.host_bound_summary(groups) == (
        "at 124M forward, backward and optimizer are host-bound for every variant (GPU busy 30 %); at 1558M no phase "
        "is host-bound for every variant (forward for lora at 30 % busy, backward for lora at 30 % busy, optimizer for "
        "lora at 30 % busy), measured as the GPU running kernels for under 50 % of the phase (the cause is not "
        "measured at 355M: no profiled repeat)")


# -- the answer for real rows --------------------------------------------------------------------
def test_answer_for_the_study_fixture():
    s = build_study(load_results([STUDY]))
    points = rules.answer(s)
    assert [p.heading for p in points] == ["eager fp32 · 960 tokens per step", f"{GRAPHS} · 960 tokens per step"]
    eager = " ".join(points[0].sentences)
    small, big = next(ln for ln in s.lines if ln.label == "lora · eager fp32").groups
    # two repeats: each ratio with its interval and n, no verdict, so no crossover and no why-sentence
    assert (f"lora takes 1.54× {stats.span_text(small.ratio_estimate)} all's step time at 124M and 0.84× "
            f"{stats.span_text(big.ratio_estimate)} at 1558M (too few repeats at 124M, too few repeats at 1558M)") in eager
    assert small.verdict == big.verdict == stats.TOO_FEW and small.n == 2 and "(n = 2, " in eager
    assert "crossover" not in eager and "its step is" not in eager
    # measured: the profiled repeats at 124M (kernel ms over the timed repeats' device ms); none at 1558M
    assert ("At 124M no phase is host-bound for every variant (backward for all and lora at 24–46 % busy, forward for "
            "lora at 32 % busy, optimizer for lora at 6 % busy), measured as the GPU running kernels for under 50 % of "
            "the phase (the cause is not measured at 1558M: no profiled repeat)") in eager
    # the rules that explain a verdict, applied to the real groups as they would be with one
    base_small, base_big = s.base_of(small), s.base_of(big)
    slower = rules.why_slower(small, base_small)
    assert "At 124M the backward phase is host-bound for both all and lora (in a profiled repeat the GPU ran " in slower
    # the profiles' counts: forward, backward, optimizer, data and the few launches outside any phase
    assert "lora launches 37 % more kernels per step (2,480 vs 1,808, torch.profiler)" in slower
    assert "its kernels run 20 % less device time (20.2 vs 25.3 ms): its step is 54 % longer (78.4 ms [" in slower
    assert "At 1558M lora saves 37.8 ms in backward and 25.1 ms in optimizer" in rules.why_faster(
        big, base_big, smallest=base_small)
    graphs = " ".join(points[1].sentences)
    assert "too few repeats at 124M" in graphs and "The cause of each phase's time is not measured" in graphs


def test_accuracy_table_sits_next_to_speed(tmp_path):
    rows = []
    for r, seed in enumerate((1, 2, 3, 4, 5)):
        rows += [_run(10 * r, size="124M", layers="all", step=50, seed=seed, acc=(95.0, 96.0, 97.0, 95.5, 96.5)[r]),
                 _run(10 * r + 1, size="124M", layers="lora", step=70, seed=seed, acc=(91.0, 91.5, 92.0, 91.25, 91.75)[r])]
    s = _study(tmp_path, rows)
    t = accuracy_table(s)
    assert t.head[3:] == ["seeds", "step ms [interval]", "step ratio [interval]", "test acc % median [interval]",
                          "min–max", "Δ vs baseline [interval]", "outside seed noise"]
    base, lora = t.rows
    assert base[3] == "5 (1, 2, 3, 4, 5)" and base[-1] == "baseline"
    d, outside = s.accuracy_vs_base(s.groups[1])
    assert d.value == pytest.approx(-4.5) and outside is True
    assert lora[4] == "70.0\n[70.0–70.0] (n = 5, 93.8 %)" and lora[5].startswith("1.40× slower")
    assert lora[6:] == [f"91.50 {stats.span_text(s.groups[1].accuracy['test_acc'])}", "91.00–92.00",
                        f"-4.50 {stats.span_text(d)}", "yes"]
    assert "seeds vary across repeats" in t.notes[0]


def test_the_fastest_lora_step_per_size_is_named_with_its_configuration(tmp_path):
    """Per size, the LoRA group (any trainable-layer choice of LoRA, any mode) with the lowest
    median step: at 124M the graphed lora-kernel, at 1558M the eager lora one (its graphed run is
    slower there); `all` is never chosen, however fast."""
    from lora_bench.report.tables import fastest_lora_table

    rows = [_run(0, size="124M", layers="all", step=1.0, graphs=True),
            _run(1, size="124M", layers="lora", step=70), _run(2, size="124M", layers="lora", step=72),
            _run(3, size="124M", layers="lora-kernel", step=6.0, graphs=True),
            _run(4, size="124M", layers="lora-kernel", step=6.4, graphs=True),
            _run(5, size="124M", layers="all", step=50),
            _run(6, size="1558M", layers="all", step=300), _run(7, size="1558M", layers="lora", step=240),
            _run(8, size="1558M", layers="lora-kernel", step=260, graphs=True)]
    table = fastest_lora_table(_study(tmp_path, rows))
    assert [r[:3] for r in table.rows] == [["124M", "lora-kernel", "CUDA graphs + bf16"],
                                           ["1558M", "lora", "eager fp32"]]
    assert table.rows[0][-1].startswith("6.20 [") and table.rows[1][-1].startswith("240.00")
    only_all = [_run(0, size="124M", layers="all", step=50), _run(1, size="124M", layers="last_block", step=40)]
    assert fastest_lora_table(_study(tmp_path, only_all, baseline="trainable_layers=all")) is None


def test_the_fastest_lora_step_names_its_trainable_layers_when_the_report_compares_another_setting(tmp_path):
    """Against optimizer=fused the groups' variant is the optimizer: the table names the trainable
    layers from the runs and the variant beside them, never the variant as the layers."""
    from lora_bench.report.tables import fastest_lora_table

    rows = []
    for i, (layers, optimizer, step) in enumerate((("frozen", "fused", 2.5), ("frozen", "one-launch", 2.4),
                                                    ("lora-kernel", "fused", 3.6), ("lora-kernel", "one-launch", 3.5))):
        rows.append({**_run(i, size="124M", layers=layers, step=step, graphs=True), "cfg_optimizer": optimizer})
    table = fastest_lora_table(_study(tmp_path, rows, baseline="optimizer=fused"))
    assert table.head[:3] == ["size", "trainable layers", "variant"], table.head
    assert table.rows[0][:3] == ["124M", "lora-kernel", "one-launch"], table.rows
    assert any("optimizer=fused" in n for n in table.notes)


def test_a_glance_of_many_variants_names_those_farthest_from_the_baseline_and_counts_the_rest(tmp_path):
    """Eight variants against `all`: the glance names the five whose step lies farthest from the
    baseline's (either way), in the line's order, and says how many more the answer holds; with five
    or fewer it names them all."""
    from lora_bench.report.glance import VARIANTS, glance

    steps = {"all": 50.0, "last_block": 51.0, "last_layer": 52.0, "lora": 100.0, "lora-kernel": 25.0,
             "lora-merged": 80.0, "frozen": 20.0, "last_two_blocks": 50.5, "peft": 70.0}
    rows = []
    for r in range(5):
        for j, (layers, step) in enumerate(steps.items()):
            rows.append(_run(20 * r + j, size="124M", layers=layers, step=step * (1 + 0.001 * r)))
    s = _study(tmp_path, rows)
    (line,) = glance(s)
    named = {v for v in steps if f" {v} " in f" {line}" or f"; {v} " in line or f": {v} " in line}
    assert named == {"lora", "lora-kernel", "lora-merged", "frozen", "peft"} and VARIANTS == 5, line
    assert line.rstrip(".").endswith("; 3 more in the answer below"), line
    few = _study(tmp_path, [row for row in rows if row["cfg_trainable_layers"] in ("all", "lora", "frozen")])
    (line,) = glance(few)
    assert "more in the answer below" not in line and "lora" in line and "frozen" in line


def test_a_glance_against_a_baseline_that_names_its_mode_has_no_empty_heading(tmp_path):
    """A baseline that names the execution mode (e.g. a peer's block-compiled rows against the fused
    layer's CUDA-graph rows) compares across modes, so no mode or condition heads the glance's line:
    it starts with the sentence, never with an empty bold heading."""
    from lora_bench.report.glance import glance

    rows = []
    for r in range(5):
        rows.append(_run(10 * r, size="124M", layers="lora-kernel", step=3.6 + 0.01 * r, graphs=True))
        peer = _run(10 * r + 1, size="124M", layers="lora", step=21.0 + r)
        peer.update(cfg_precision="bf16", cfg_compile="True", cfg_compile_scope="blocks")
        rows.append(peer)
    s = _study(tmp_path, rows, baseline="trainable_layers=lora-kernel,mode=CUDA graphs + bf16")
    (line,) = glance(s)
    assert line.startswith("Step time against ") and "****" not in line, line
    assert "block-compiled + bf16" in line and "slower" in line, line
