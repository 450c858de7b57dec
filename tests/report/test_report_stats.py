"""lora_bench.report.stats and samples: the median's and the ratio's order-statistic intervals on
synthetic samples with known answers (a 5 % slowdown in 1 % noise is found slower; equal
distributions are 'no difference' in at least 95 % of seeded trials and falsely slower or faster
in at most 5 %), no verdict below MIN_REPEATS, the verdict's band, n and the confidence beside
every interval, and intervals over the steps of a one-run group read from its steps.csv."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd
import pytest

from lora_bench.report import stats
from lora_bench.report.order_stats import MIN_REPEATS, coverage
from lora_bench.report.samples import sample
from lora_bench.report.stats import Estimate, Sample, median_interval, ratio_interval, verdict
from lora_bench.results.schema import STEP_COLUMNS
from lora_bench.results.store import write_csv

TRIALS = 200


def _verdicts(*, n: int, noise: float, slowdown: float, trials: int = TRIALS) -> Counter:
    """Verdicts of ``trials`` seeded unpaired comparisons: n repeats a side, Gaussian relative noise."""
    out = Counter()
    for t in range(trials):
        rng = np.random.default_rng(10_000 + t)
        base = 50.0 * (1 + noise * rng.standard_normal(n))
        cand = 50.0 * slowdown * (1 + noise * rng.standard_normal(n))
        out[verdict(ratio_interval(Sample.of(cand), Sample.of(base)))] += 1
    return out


def test_a_five_percent_slowdown_in_one_percent_noise_is_found_slower():
    v = _verdicts(n=10, noise=0.01, slowdown=1.05)
    assert v[stats.SLOWER] >= 0.9 * TRIALS, v
    assert v[stats.FASTER] == 0 and v[stats.SAME] == 0, v  # never the wrong way, never 'no difference'


def test_equal_distributions_are_no_difference_in_95_percent_of_trials():
    v = _verdicts(n=10, noise=0.002, slowdown=1.0)  # noise a tenth of the 2 % threshold
    assert v[stats.SAME] >= 0.95 * TRIALS, v
    # with noise near the threshold the intervals widen: unclear, but still almost never a false difference
    v = _verdicts(n=5, noise=0.01, slowdown=1.0)
    assert v[stats.SLOWER] + v[stats.FASTER] <= 0.05 * TRIALS, v


@pytest.mark.parametrize("n", [2, 3, MIN_REPEATS - 1])
def test_below_the_minimum_repeats_there_is_no_verdict(n):
    """However far apart, a ratio of fewer than MIN_REPEATS repeats a side has an interval (with
    the low confidence it reaches) but no verdict; paired or not."""
    base, cand = [50.0 + 0.01 * i for i in range(n)], [80.0 + 0.01 * i for i in range(n)]
    keys = [("f", "s", str(i)) for i in range(n)]
    for r in (ratio_interval(Sample.of(cand), Sample.of(base)),
              ratio_interval(Sample.of(cand, keys=keys), Sample.of(base, keys=keys))):
        assert r.has_interval and r.lo > 1.5 and r.n == n and verdict(r) == stats.TOO_FEW
        assert f"n = {n}" in stats.span_text(r)
    five = [("f", "s", str(i)) for i in range(MIN_REPEATS)]
    r = ratio_interval(Sample.of([80.0 + i for i in range(MIN_REPEATS)], keys=five),
                       Sample.of([50.0 + i for i in range(MIN_REPEATS)], keys=five))
    assert verdict(r) == stats.SLOWER


def test_a_median_states_the_confidence_its_interval_reaches_at_n():
    for n, text in ((5, "93.8 %"), (6, "96.9 %")):
        e = median_interval(Sample.of(np.arange(n, dtype=float)))
        assert (e.lo, e.hi) == (0.0, n - 1.0) and e.confidence == coverage(n, 1)
        assert stats.span_text(e, digits=0) == f"[0–{n - 1}] (n = {n}, {text})"
    e = median_interval(Sample.of(np.arange(25, dtype=float)))
    assert e.confidence >= stats.CONFIDENCE and 0 < e.lo < 12 < e.hi < 24  # narrower than min–max at n = 25


def test_an_unpaired_ratio_states_a_lower_bound_on_its_confidence():
    """Each side's median interval at 97.5 % (or the most it reaches); the ratio's interval holds
    the true ratio whenever both hold their medians: at least γ_c + γ_b − 1 (Bonferroni)."""
    a, b = Sample.of(np.arange(10.0, 20.0)), Sample.of(np.arange(20.0, 30.0))
    r = ratio_interval(a, b)
    g = median_interval(a)  # at 95 %: the same ranks as at 97.5 % for n = 10 ([x_2, x_9], 97.9 %)
    assert r.at_least and not r.paired and r.confidence == pytest.approx(2 * g.confidence - 1)
    assert r.lo == pytest.approx(11.0 / 28.0) and r.hi == pytest.approx(18.0 / 21.0)
    assert r.value == pytest.approx(14.5 / 24.5) and "≥ 95.7 %" in stats.span_text(r)


def test_intervals_are_reproducible_and_contain_the_estimate():
    a, b = Sample.of([10.0, 10.4, 9.8, 10.1]), Sample.of([12.0, 12.5, 11.9])
    assert ratio_interval(a, b) == ratio_interval(a, b)
    e = median_interval(a)
    assert e.value == pytest.approx(10.05) and e.lo <= e.value <= e.hi and e.over == stats.REPEATS
    assert (e.lo, e.hi) == (9.8, 10.4)  # n = 4: [min, max], 87.5 %
    r = ratio_interval(a, b)
    assert r.value == pytest.approx(10.05 / 12.0) and r.lo < r.value < r.hi
    assert r.lo == pytest.approx(9.8 / 12.5) and r.hi == pytest.approx(10.4 / 11.9)


def test_one_value_has_no_interval_and_no_verdict():
    one = Sample.of([10.0])
    assert not median_interval(one).has_interval and median_interval(one).value == 10.0
    r = ratio_interval(one, Sample.of([5.0, 5.1, 4.9]))
    assert r.value == pytest.approx(2.0) and not r.has_interval and verdict(r) == stats.TOO_FEW
    assert stats.span_text(r) == "(no interval, n = 1)"


@pytest.mark.parametrize("lo, hi, expected", [
    (1.03, 1.08, stats.SLOWER), (0.90, 0.97, stats.FASTER), (0.985, 1.015, stats.SAME),
    (1.01, 1.05, stats.UNCLEAR), (0.95, 1.05, stats.UNCLEAR), (1.005, 1.019, stats.SAME)])
def test_the_verdict_band(lo, hi, expected):
    assert verdict(Estimate((lo + hi) / 2, lo, hi, n=MIN_REPEATS, over=stats.REPEATS)) == expected
    assert verdict(Estimate((lo + hi) / 2, lo, hi, n=MIN_REPEATS - 1, over=stats.REPEATS)) == stats.TOO_FEW
    assert verdict(Estimate((lo + hi) / 2, lo, hi, n=1, over=stats.STEPS)) == stats.TOO_FEW


def test_the_threshold_and_the_direction_change_the_verdict():
    e = Estimate(1.04, 1.03, 1.05, n=MIN_REPEATS, over=stats.REPEATS)
    assert verdict(e, threshold=0.02) == stats.SLOWER
    assert verdict(e, threshold=0.10) == stats.SAME
    assert verdict(e, higher_is_better=True) == stats.FASTER  # a throughput that rose
    assert verdict(e, speed=False) == stats.HIGHER
    with pytest.raises(ValueError):
        verdict(e, threshold=-0.1)


def _one_run(tmp_path, step_ms: list[float], *, warmup: int = 2) -> pd.DataFrame:
    run_dir = tmp_path / "r0"
    run_dir.mkdir()
    rows = [{"run_id": "r0", "step": i, "warmup": i < warmup, "step_ms": v, "forward_ms": v / 2, "tokens": 960}
            for i, v in enumerate(step_ms)]
    write_csv(run_dir / "steps.csv", rows, [c.name for c in STEP_COLUMNS])
    measured = step_ms[warmup:]
    return pd.DataFrame([{"run_id": "r0", "run_dir": str(run_dir), "step_ms_median": float(np.median(measured)),
                          "tokens_per_s": 960 / np.median(measured) * 1e3, "test_acc": 95.0}])


def test_a_one_run_group_is_resampled_over_its_measured_steps(tmp_path):
    steps = [500.0, 400.0, *np.linspace(40.0, 44.0, 21)]  # two slow warm-up steps, then 40..44 ms
    runs = _one_run(tmp_path, steps)
    s = sample(runs, "step_ms_median")
    assert s.over == stats.STEPS and len(s.values) == 21 and s.values.max() <= 44.0  # warm-up left out
    e = median_interval(s)
    assert e.value == pytest.approx(42.0) and e.per_step and 40.0 < e.lo < 42.0 < e.hi < 44.0
    assert stats.STEPS_MARK in stats.interval_text(e)
    fwd = median_interval(sample(runs.assign(forward_ms_median=21.0), "forward_ms_median"))
    assert fwd.per_step and fwd.value == 21.0
    tps = median_interval(sample(runs, "tokens_per_s"))  # a throughput: the step's work over its time
    assert tps.per_step and tps.lo < tps.value < tps.hi and tps.value == pytest.approx(960 / 42.0 * 1e3)
    acc = median_interval(sample(runs, "test_acc"))  # not a per-step quantity: no interval
    assert acc.value == 95.0 and not acc.has_interval
    r = ratio_interval(s, Sample.of([40.0, 40.2, 39.9]))
    assert r.per_step  # either side over steps makes the ratio's interval over steps


def test_a_one_run_group_without_steps_has_no_interval(tmp_path):
    runs = pd.DataFrame([{"run_id": "r0", "run_dir": str(tmp_path / "missing"), "step_ms_median": 42.0}])
    e = median_interval(sample(runs, "step_ms_median"))
    assert e.value == 42.0 and not e.has_interval and stats.interval_text(e) == "42.00 (no interval, n = 1)"


def _host_bound_pairs(rng, *, n: int, slowdown: float, host: float, noise: float):
    """n repeats of two variants, each repeat in its own call on a host whose speed varies from call
    to call by ``host`` (relative, shared by both variants of the call) and each run by ``noise``."""
    speed = 1 + host * rng.standard_normal(n)
    base = 50.0 * speed * (1 + noise * rng.standard_normal(n))
    cand = 50.0 * slowdown * speed * (1 + noise * rng.standard_normal(n))
    return cand, base


def test_repeats_of_one_sweep_are_paired_so_a_shared_host_speed_cancels():
    """A 10 % slowdown under a call-to-call host spread of 20 %: paired by repeat, the interval finds
    it almost every time; resampled side by side the spread hides it."""
    keys = [("folder", "sweep", str(r)) for r in range(5)]
    paired, apart = Counter(), Counter()
    for t in range(TRIALS):
        cand, base = _host_bound_pairs(np.random.default_rng(t), n=5, slowdown=1.10, host=0.20, noise=0.005)
        e = ratio_interval(Sample.of(cand, keys=keys), Sample.of(base, keys=keys))
        assert e.paired and e.lo <= e.value <= e.hi
        paired[verdict(e)] += 1
        apart[verdict(ratio_interval(Sample.of(cand), Sample.of(base)))] += 1
    assert paired[stats.SLOWER] >= 0.9 * TRIALS and paired[stats.FASTER] == 0, paired
    assert apart[stats.SLOWER] <= 0.5 * TRIALS, apart  # the pairing is what finds it


def test_paired_equal_variants_are_rarely_a_difference():
    keys = [("folder", "sweep", str(r)) for r in range(5)]
    v = Counter()
    for t in range(TRIALS):
        cand, base = _host_bound_pairs(np.random.default_rng(500 + t), n=5, slowdown=1.0, host=0.20, noise=0.005)
        v[verdict(ratio_interval(Sample.of(cand, keys=keys), Sample.of(base, keys=keys)))] += 1
    assert v[stats.SLOWER] + v[stats.FASTER] <= 0.05 * TRIALS, v


def test_pairing_needs_the_same_repeats_on_both_sides_once_each():
    a, b = [10.0, 10.4, 9.8], [12.0, 12.5, 11.9]
    k = [("f", "s", "0"), ("f", "s", "1"), ("f", "s", "2")]
    assert ratio_interval(Sample.of(a, keys=k), Sample.of(b, keys=k)).paired
    # the pairs follow the keys, not the order the values come in
    shuffled = ratio_interval(Sample.of(a[::-1], keys=k[::-1]), Sample.of(b, keys=k))
    assert shuffled == ratio_interval(Sample.of(a, keys=k), Sample.of(b, keys=k))
    other = [("g", "s", "0"), ("g", "s", "1"), ("g", "s", "2")]  # another folder: another call
    assert not ratio_interval(Sample.of(a, keys=k), Sample.of(b, keys=other)).paired
    assert not ratio_interval(Sample.of(a, keys=k), Sample.of(b[:2], keys=k[:2])).paired
    twice = [k[0], k[0], k[1]]
    assert Sample.of(a, keys=twice).keys is None
    assert not ratio_interval(Sample.of(a, keys=twice), Sample.of(b, keys=twice)).paired
    assert not ratio_interval(Sample.of(a), Sample.of(b)).paired  # no keys: each side on its own


def test_groups_of_one_sweeps_repeats_are_keyed_by_folder_sweep_and_repeat():
    rows = pd.DataFrame({"results_dir": ["r", "r", "r"], "sweep_name": ["s", "s", "s"], "repeat": [0, 1, 2],
                         "step_ms_median": [1.0, 2.0, float("nan")]})
    assert sample(rows, "step_ms_median").keys == (("r", "s", "0"), ("r", "s", "1"))
    assert sample(rows.assign(sweep_name=["s", "", "s"]), "step_ms_median").keys is None  # a run outside a sweep
    assert sample(rows.drop(columns="repeat"), "step_ms_median").keys is None


def test_the_runs_of_one_pack_count_once_for_the_packs_measurements():
    """Three repeats of a pack of four points: the step time is the pack's (the same in its four
    rows), so it is resampled over three values, not twelve; each point's own accuracy counts per
    run; outside packs every run counts."""
    rng = np.random.default_rng(3)
    step = {0: 79.1, 1: 78.9, 2: 79.6}
    rows = pd.DataFrame([{"results_dir": "r", "sweep_name": "s", "repeat": r, "pack_id": f"pack-{r}",
                          "step_ms_median": step[r], "val_acc": float(rng.uniform(80, 95))}
                         for r in range(3) for _ in range(4)])
    s = sample(rows, "step_ms_median")
    assert sorted(s.values) == sorted(step.values()) and s.over == stats.REPEATS
    relabelled = rows.set_axis([0] * len(rows))  # folders concatenated without a fresh index
    assert sorted(sample(relabelled, "step_ms_median").values) == sorted(step.values())
    assert s.keys == (("r", "s", "0"), ("r", "s", "1"), ("r", "s", "2"))  # pairs with another group's repeats
    assert len(sample(rows, "val_acc").values) == 12
    differing = rows.assign(step_ms_median=rows["step_ms_median"] + np.arange(12) * 0.01)  # not the pack's
    assert len(sample(differing, "step_ms_median").values) == 12
    assert len(sample(rows.assign(pack_id=""), "step_ms_median").values) == 12  # trained alone


def test_a_report_says_how_many_packs_its_groups_trained_in(tmp_path):
    from lora_bench.report.aggregate import PACKS_NOTE, build_report
    from lora_bench.report.group_table import groups_table

    rows = [{"run_id": f"p{r}-{i}", "status": "done", "trainable_layers": "lora", "model_size": "124M",
             "results_dir": "r", "sweep_name": "s", "repeat": r, "pack_id": f"pack-{r}", "pack_size": 2,
             "step_ms_median": 79.0 + r} for r in range(3) for i in range(2)]
    rows.append({"run_id": "solo", "status": "done", "trainable_layers": "all", "model_size": "124M",
                 "step_ms_median": 6.0, "pack_id": "", "results_dir": "r", "sweep_name": "s", "repeat": 0})
    rep = build_report(pd.DataFrame(rows), group_by=["trainable_layers"], metrics=["step_ms_median"])
    cells = {row[0]: row[1] for row in groups_table(rep).rows}
    assert cells == {"lora": "6 (3 packs)", "all": "1"}
    assert PACKS_NOTE in rep.notes
    assert rep.groups.set_index("trainable_layers").loc["lora", "step_ms_median"] == pytest.approx(80.0)


@pytest.mark.parametrize("metric, above, below", [
    ("step_ms_median", stats.SLOWER, stats.FASTER),  # a time: above the band is slower
    ("tokens_per_s", stats.FASTER, stats.SLOWER),  # a throughput: above the band is faster
    ("val_acc", stats.HIGHER, stats.LOWER)])  # not a speed
def test_a_reports_verdict_rule_names_the_words_its_verdicts_use(metric, above, below):
    """The note under a report's table states the rule in the words its ratio cells use: a clear
    rise of the metric gets the note's first word, a clear fall its second."""
    from lora_bench.report.aggregate import build_report
    from lora_bench.report.render_json import statistic
    from lora_bench.report.group_table import groups_table

    rows = [{"run_id": f"{v}-{r}", "status": "done", "variant": v, "results_dir": "r", "sweep_name": "s", "repeat": r,
             metric: value * (1 + 0.001 * r)}
            for r in range(5) for v, value in (("base", 50.0), ("up", 60.0), ("down", 40.0))]
    rep = build_report(pd.DataFrame(rows), group_by=["variant"], baseline="variant=base", metrics=[metric])
    words = rep.groups.set_index("variant")["verdict"]
    assert (words["up"], words["down"]) == (above, below)
    rule = f"verdict: {stats.TOO_FEW} below 5 repeats a side or over one run's steps; else {above} / {below} where"
    assert any(rule in note for note in groups_table(rep).notes)
    assert statistic(rep.threshold, rep.primary)["verdict_rule"].startswith(rule)
