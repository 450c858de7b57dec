"""Distribution-free intervals for a median from order statistics, with the confidence they truly
reach at n.

For n independent values of a continuous distribution, the interval between the j-th smallest and
the j-th largest value, [x_(j), x_(n+1−j)], holds the distribution's median with probability
1 − 2·P(B ≤ j − 1), B ~ Binomial(n, ½), whatever the distribution (the sign test inverted). That
probability moves in steps: no j reaches 95 % below n = 6, and the widest interval, [min, max],
reaches 1 − 2^(1−n): 50 % at n = 2, 75 % at 3, 87.5 % at 4, 93.75 % at 5. So an interval states
the confidence it reaches at its n, never a nominal one (docs/measuring.md, "Intervals and
verdicts")."""

from __future__ import annotations

import math

import numpy as np

# Fewest values for a verdict: at n = 5 the interval [min, max] holds the median with 93.75 %
# probability, the first n at which an interval comes within two points of 95 %; at n = 4 it is
# 87.5 %, and at n = 2 it is a coin toss.
MIN_REPEATS = 5


def coverage(n: int, j: int) -> float:
    """P(x_(j) ≤ median ≤ x_(n+1−j)) for n independent values of a continuous distribution (1 ≤ j ≤ n/2)."""
    if n < 2 or not 1 <= j <= n // 2:
        raise ValueError(f"need n >= 2 and 1 <= j <= n/2, got n={n}, j={j}")
    below = sum(math.comb(n, i) for i in range(j)) / 2 ** n  # exact integers: no overflow at large n
    return 1.0 - 2.0 * below


def median_ranks(n: int, confidence: float) -> tuple[int, int, float]:
    """(lo, hi, reached): 0-based ranks of the narrowest symmetric order-statistic interval whose
    coverage is at least ``confidence``, and that coverage; where none reaches it (small n), the
    widest one, [min, max], and the lower coverage it reaches."""
    if n < 2:
        raise ValueError(f"an interval needs two values or more, got {n}")
    best, below, term, total = 1, 0, 1, 2 ** n  # below: the sum of C(n, i) for i < j, term: C(n, j - 1)
    reached = 0.0
    for j in range(1, n // 2 + 1):
        below += term
        cover = 1.0 - 2.0 * (below / total)
        if j > 1 and cover < confidence:
            break
        best, reached = j, cover
        term = term * (n - j + 1) // j
    return best - 1, n - best, reached


def median_interval(values, confidence: float) -> tuple[float, float, float]:
    """(lo, hi, reached) for the median of ``values`` (NaN-free, two or more)."""
    v = np.sort(np.asarray(values, dtype=float))
    lo, hi, reached = median_ranks(len(v), confidence)
    return float(v[lo]), float(v[hi]), reached
