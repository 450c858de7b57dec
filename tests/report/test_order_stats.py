"""The order-statistic interval of a median states the confidence it reaches: checked by simulation
at n = 3, 5 and 10 on skewed, heavy-tailed and discrete-free data, and by its exact formula; so does
the paired ratio interval (the per-repeat ratios' median) on simulated interleaved repeats with a
shared host speed, and the unpaired one holds at least the lower bound it states
(docs/measuring.md, "Intervals and verdicts")."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lora_bench.report.order_stats import MIN_REPEATS, coverage, median_interval, median_ranks


def test_coverage_is_the_sign_tests_binomial_sum():
    assert coverage(2, 1) == 0.5
    assert coverage(5, 1) == 1 - 2 / 32
    assert coverage(10, 2) == 1 - 2 * (1 + 10) / 1024
    with pytest.raises(ValueError):
        coverage(5, 3)


@pytest.mark.parametrize("n, ranks, reached", [
    (3, (0, 2), 0.75),           # nothing reaches 95 %: the widest interval, and what it reaches
    (5, (0, 4), 0.9375),
    (6, (0, 5), 1 - 2 / 64),
    (10, (1, 8), 1 - 2 * 11 / 1024),
])
def test_ranks_are_the_narrowest_that_reach_the_confidence(n, ranks, reached):
    lo, hi, got = median_ranks(n, 0.95)
    assert (lo, hi) == ranks and got == pytest.approx(reached, abs=1e-15)


def test_a_verdict_needs_the_first_n_within_two_points_of_95_percent():
    assert median_ranks(MIN_REPEATS, 0.95)[2] >= 0.93
    assert median_ranks(MIN_REPEATS - 1, 0.95)[2] < 0.93


@pytest.mark.parametrize("n", [3, 5, 10])
@pytest.mark.parametrize("draw", ["lognormal", "pareto", "normal"])
def test_simulated_coverage_matches_the_stated_confidence(n, draw):
    """20,000 intervals on fresh draws: the share that holds the true median is the stated
    coverage within 4.5 binomial standard errors (a false alarm about once in 150,000 runs)."""
    rng = np.random.default_rng(12345 + n)
    sims = 20_000
    if draw == "lognormal":
        data, median = rng.lognormal(0.0, 1.0, size=(sims, n)), 1.0
    elif draw == "pareto":
        data, median = rng.pareto(1.5, size=(sims, n)), 2 ** (1 / 1.5) - 1
    else:
        data, median = rng.normal(3.0, 0.2, size=(sims, n)), 3.0
    stated = median_ranks(n, 0.95)[2]
    held = 0
    for row in data:
        lo, hi, _ = median_interval(row, 0.95)
        held += lo <= median <= hi
    se = math.sqrt(stated * (1 - stated) / sims)
    assert abs(held / sims - stated) <= 4.5 * se, (held / sims, stated)


@pytest.mark.parametrize("n", [3, 5, 10])
@pytest.mark.parametrize("noise", ["lognormal", "pareto"])
def test_the_paired_ratio_interval_reaches_its_stated_confidence(n, noise):
    """The paired ratio of lora_bench.report.stats on simulated interleaved repeats: each repeat's
    two runs share a host speed that moves by half from call to call, and each run has its own
    noise, the same distribution on both sides, so the per-repeat ratio's true median is the true
    slowdown (1.3). 20,000 intervals: the share holding 1.3 is the stated confidence within 4.5
    binomial standard errors."""
    from lora_bench.report.stats import Sample, ratio_interval

    rng = np.random.default_rng(777 + n)
    sims, slowdown = 20_000, 1.3
    host = rng.lognormal(0.0, 0.5, size=(sims, n))
    if noise == "lognormal":
        own = rng.lognormal(0.0, 0.05, size=(2, sims, n))
    else:
        own = 1 + rng.pareto(1.5, size=(2, sims, n))
    cand, base = slowdown * host * own[0], host * own[1]
    keys = [("folder", "sweep", str(r)) for r in range(n)]
    held, stated = 0, None
    for c, b in zip(cand, base):
        r = ratio_interval(Sample.of(c, keys=keys), Sample.of(b, keys=keys))
        assert r.paired and r.n == n and not r.at_least
        stated = r.confidence
        held += r.lo <= slowdown <= r.hi
    assert stated == median_ranks(n, 0.95)[2]
    se = math.sqrt(stated * (1 - stated) / sims)
    assert abs(held / sims - stated) <= 4.5 * se, (held / sims, stated)


@pytest.mark.parametrize("n", [3, 5, 10])
def test_the_unpaired_ratio_interval_holds_at_least_its_stated_bound(n):
    """Two independent sides (two folders): [lo_c / hi_b, hi_c / lo_b] holds the ratio of the true
    medians at least as often as the Bonferroni bound it states."""
    from lora_bench.report.stats import Sample, ratio_interval

    rng = np.random.default_rng(4242 + n)
    sims = 5_000
    cand, base = 1.3 * rng.lognormal(0.0, 0.2, size=(sims, n)), rng.lognormal(0.0, 0.2, size=(sims, n))
    held, stated = 0, None
    for c, b in zip(cand, base):
        r = ratio_interval(Sample.of(c), Sample.of(b))
        assert not r.paired and r.at_least
        stated = r.confidence
        held += r.lo <= 1.3 <= r.hi
    se = math.sqrt(max(stated * (1 - stated), 0.01) / sims)
    assert held / sims >= stated - 4.5 * se, (held / sims, stated)
