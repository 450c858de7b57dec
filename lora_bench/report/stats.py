"""The statistics every report and comparison states: a median with its order-statistic interval, a
ratio or difference of two sides with its interval (paired per repeat where both sides hold the
same repeats of one sweep, else between the two medians' intervals, Bonferroni), and the verdict
read off that interval with the threshold and the minimum of repeats. Every interval states the
confidence it truly reaches at its n: docs/measuring.md, "Intervals and verdicts"."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lora_bench.report.order_stats import MIN_REPEATS, median_interval as order_interval
from lora_bench.report.threshold import THRESHOLD

CONFIDENCE = 0.95
REPEATS, STEPS = "repeats", "steps"
FASTER, SLOWER, SAME, UNCLEAR = "faster", "slower", "no difference", "unclear"
TOO_FEW = "too few repeats"
HIGHER, LOWER = "higher", "lower"  # the words for a metric that is not a speed (accuracy, memory)
VERDICTS = (FASTER, SLOWER, HIGHER, LOWER, SAME, UNCLEAR, TOO_FEW)

RESAMPLING = ("repeats of one sweep paired: the median of the per-repeat ratios with their order-statistic "
              "(sign-test) interval, so what a repeat's runs share, the host's speed in that call, cancels; "
              "otherwise the ratio of the medians, between the two medians' order-statistic intervals, with "
              "the joint confidence's lower bound (≥)")
STATISTIC = "order-statistic interval, stating the confidence it reaches at n"
STEPS_NOTE = "interval over the steps of one run: process-to-process spread unknown, no verdict"
STEPS_MARK = "†"  # marks an interval over the steps of one run


@dataclass(frozen=True)
class Sample:
    """The values an interval rests on: a group's repeats, or the measured steps of its one run
    (``value``, the run's own recorded median, is then the point estimate)."""

    values: np.ndarray
    over: str  # REPEATS or STEPS; "" for one value without steps (no interval)
    value: float = math.nan
    keys: tuple | None = None  # per repeat, what pairs it with the other side's (module); None: unpaired

    @classmethod
    def of(cls, values, *, over: str = REPEATS, value: float = math.nan, keys=None) -> Sample:
        v = np.asarray(values, dtype=float).ravel()
        keep = ~np.isnan(v)
        if keys is not None:
            keys = tuple(k for k, kept in zip(keys, keep) if kept)
            if over != REPEATS or len(keys) != int(keep.sum()) or len(set(keys)) != len(keys):
                keys = None  # pairing needs one value per repeat
        v = v[keep]
        if len(v) < 2:
            over = ""
        return cls(values=v, over=over, value=value, keys=keys)

    @property
    def point(self) -> float:
        """The median the sample stands for (a one-run group: that run's recorded value)."""
        if not math.isnan(self.value):
            return self.value
        return float(np.median(self.values)) if len(self.values) else math.nan

    @property
    def n(self) -> int:
        """Independent values: the repeats, or 1 for one run (its steps are not independent runs)."""
        return 1 if self.over == STEPS else len(self.values)


@dataclass(frozen=True)
class Estimate:
    """A median, a ratio or a difference, with its interval and the confidence that interval
    reaches (NaN where there is none)."""

    value: float
    lo: float = math.nan
    hi: float = math.nan
    n: int = 0  # values the estimate stands on: repeats (pairs; the fewer side's where unpaired), 1 for one run
    over: str = ""  # REPEATS, STEPS or "" (no interval)
    paired: bool = False  # a ratio or difference of per-repeat pairs (module)
    confidence: float = math.nan  # the probability the interval holds the true value
    at_least: bool = False  # ``confidence`` is a lower bound (two sides' intervals combined)

    @property
    def median(self) -> float:
        """The value, read as what it is for an estimate of a median."""
        return self.value

    @property
    def known(self) -> bool:
        return not math.isnan(self.value)

    @property
    def has_interval(self) -> bool:
        return bool(self.over) and not (math.isnan(self.lo) or math.isnan(self.hi))

    @property
    def per_step(self) -> bool:
        return self.over == STEPS

    @property
    def enough(self) -> bool:
        """Enough repeats for a verdict: MIN_REPEATS or more, an interval over repeats."""
        return self.has_interval and self.over == REPEATS and self.n >= MIN_REPEATS

    def as_dict(self) -> dict:
        return {"value": _json_float(self.value), "lo": _json_float(self.lo), "hi": _json_float(self.hi),
                "n": self.n, "interval_over": self.over or None, "paired": self.paired,
                "confidence": _json_float(self.confidence) if self.has_interval else None,
                "confidence_at_least": self.at_least}


NONE = Estimate(math.nan)


def _json_float(v: float) -> float | None:
    return None if math.isnan(v) else float(v)


def _interval(values: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    return order_interval(values, confidence)


def _paired(candidate: Sample, baseline: Sample) -> tuple[np.ndarray, np.ndarray] | None:
    """Both sides' values in the order of their common repeats, when they hold the same ones."""
    if candidate.keys is None or baseline.keys is None or set(candidate.keys) != set(baseline.keys):
        return None
    if candidate.over != REPEATS or baseline.over != REPEATS:
        return None
    where = {k: i for i, k in enumerate(baseline.keys)}
    order = [where[k] for k in candidate.keys]
    return candidate.values, baseline.values[order]


def median_interval(sample: Sample) -> Estimate:
    """The sample's median (or its run's recorded value) with its order-statistic interval."""
    point = sample.point
    if not sample.over:
        return Estimate(point, n=sample.n)
    lo, hi, reached = _interval(sample.values)
    return Estimate(point, min(lo, point), max(hi, point), n=sample.n, over=sample.over, confidence=reached)


def _of_pairs(values: np.ndarray, n: int) -> Estimate:
    """The median of per-repeat ratios or differences with their order-statistic interval."""
    lo, hi, reached = _interval(values)
    return Estimate(float(np.median(values)), lo, hi, n=n, over=REPEATS, paired=True, confidence=reached)


def _sides(candidate: Sample, baseline: Sample) -> tuple[tuple[float, float], tuple[float, float], float, str]:
    """Each side's interval at 1 − (1 − CONFIDENCE) / 2, the joint confidence's lower bound, and what
    the intervals are over (STEPS when either side's is)."""
    half = 1 - (1 - CONFIDENCE) / 2
    lc, hc, gc = _interval(candidate.values, half)
    lb, hb, gb = _interval(baseline.values, half)
    over = STEPS if STEPS in (candidate.over, baseline.over) else REPEATS
    return (lc, hc), (lb, hb), max(0.0, gc + gb - 1), over


def ratio_interval(candidate: Sample, baseline: Sample) -> Estimate:
    """candidate ÷ baseline: paired, the median of per-repeat ratios; unpaired, the ratio of the
    medians between the combined intervals (module)."""
    num, den = candidate.point, baseline.point
    if math.isnan(num) or math.isnan(den) or den == 0:
        return NONE
    n = min(candidate.n, baseline.n)
    pairs = _paired(candidate, baseline)
    if pairs is not None and (pairs[1] > 0).all():
        return _of_pairs(pairs[0] / pairs[1], n)
    ratio = num / den
    if not (candidate.over and baseline.over):
        return Estimate(ratio, n=n)
    (lc, hc), (lb, hb), joint, over = _sides(candidate, baseline)
    if lb <= 0:
        return Estimate(ratio, n=n)
    return Estimate(ratio, min(lc / hb, ratio), max(hc / lb, ratio), n=n, over=over, confidence=joint, at_least=True)


def difference_interval(candidate: Sample, baseline: Sample) -> Estimate:
    """candidate − baseline (e.g. accuracy points), paired or combined as ``ratio_interval``."""
    a, b = candidate.point, baseline.point
    if math.isnan(a) or math.isnan(b):
        return NONE
    n = min(candidate.n, baseline.n)
    pairs = _paired(candidate, baseline)
    if pairs is not None:
        return _of_pairs(pairs[0] - pairs[1], n)
    d = a - b
    if not (candidate.over and baseline.over):
        return Estimate(d, n=n)
    (lc, hc), (lb, hb), joint, over = _sides(candidate, baseline)
    return Estimate(d, min(lc - hb, d), max(hc - lb, d), n=n, over=over, confidence=joint, at_least=True)


def verdict(ratio: Estimate, *, threshold: float = THRESHOLD, higher_is_better: bool = False,
            speed: bool = True) -> str:
    """The module's verdict for a ratio candidate ÷ baseline: too few repeats below MIN_REPEATS or
    over one run's steps; for a time (``speed``, lower is better) slower above the band, faster
    below it; for a throughput (``higher_is_better``) the other way round; for a metric that is not
    a speed, higher or lower. No difference inside the band; unclear otherwise or without an interval."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    if ratio.known and (ratio.per_step or ratio.n < MIN_REPEATS):
        return TOO_FEW
    if not ratio.has_interval:
        return UNCLEAR
    up, down = 1 + threshold, 1 / (1 + threshold)
    above, below = ratio.lo > up, ratio.hi < down
    if above or below:
        if not speed:
            return HIGHER if above else LOWER
        return SLOWER if above != higher_is_better else FASTER
    if ratio.lo >= down and ratio.hi <= up:
        return SAME
    return UNCLEAR


def worse(*, higher_is_better: bool, speed: bool) -> str:
    """The verdict that means worse for such a metric (what a gate fails on)."""
    if speed:
        return SLOWER
    return LOWER if higher_is_better else HIGHER


def excludes_zero(diff: Estimate) -> bool | None:
    """Whether a difference's interval leaves out 0 (None: no interval, or too few repeats to say)."""
    if not diff.enough:
        return None
    return diff.lo > 0 or diff.hi < 0


def confidence_text(e: Estimate) -> str:
    """'93.8 %', '≥ 87.5 %': the confidence an interval reaches."""
    return f"{'≥ ' if e.at_least else ''}{100 * e.confidence:.1f} %"


def n_text(e: Estimate) -> str:
    """'n = 5, 93.8 %' beside an interval; 'n = 1' beside none ('' where neither is known)."""
    parts = [f"n = {e.n}"] if e.n else []
    if e.has_interval and not math.isnan(e.confidence):
        parts.append(confidence_text(e))
    return ", ".join(parts)


def span_text(e: Estimate, *, digits: int = 2, told: bool = True) -> str:
    """'[1.47–1.53] (n = 5, 93.8 %)', '[-4.20 to -3.80] (n = 5, ≥ 87.5 %)', '[204.1–206.2]† (n = 1,
    95.1 %)' (over one run's steps); '(no interval, n = 1)'. ``told=False`` leaves out n and the
    confidence, for a table whose header states them once for every cell (``shared_n_text``)."""
    told = n_text(e) if told else ""
    if not e.has_interval:
        return f"(no interval, {told})" if told else "(no interval)"
    lo, hi = f"{e.lo:,.{digits}f}", f"{e.hi:,.{digits}f}"
    sep = " to " if e.lo < 0 or e.hi < 0 else "–"
    return f"[{lo}{sep}{hi}]{STEPS_MARK if e.per_step else ''}" + (f" ({told})" if told else "")


def interval_text(e: Estimate, *, digits: int = 2, unit: str = "", told: bool = True) -> str:
    """'1.50× [1.47–1.53] (n = 5, 93.8 %)', '205.0 [204.1–206.2]† (n = 1, 95.1 %)'; '-' without a value."""
    if not e.known:
        return "-"
    return f"{e.value:,.{digits}f}{unit} {span_text(e, digits=digits, told=told)}"


def shared_n_text(estimates) -> str:
    """'n = 5, 93.8 %' where every one of ``estimates`` has an interval with that n and confidence
    (a header can then state it once for the column); '' otherwise."""
    texts = {n_text(e) if e.has_interval else "" for e in estimates}
    return texts.pop() if len(texts) == 1 else ""


def threshold_text(threshold: float) -> str:
    return f"{100 * threshold:g} %"


def rule_text(threshold: float = THRESHOLD, *, higher_is_better: bool = False, speed: bool = True) -> str:
    """The verdict rule as one sentence, for the notes under a table, in the words ``verdict``
    gives a metric of that sense: slower / faster for a time, faster / slower for a throughput,
    higher / lower for a metric that is not a speed (accuracy, memory)."""
    t = threshold_text(threshold)
    above, below = (HIGHER, LOWER) if not speed else (FASTER, SLOWER) if higher_is_better else (SLOWER, FASTER)
    return (f"verdict: {TOO_FEW} below {MIN_REPEATS} repeats a side or over one run's steps; else {above} / "
            f"{below} where the ratio's interval lies wholly above 1 + {t} / below 1 ÷ (1 + {t}); no difference "
            f"where it lies inside that band; unclear otherwise (intervals: order statistics of the median, "
            f"exact and distribution-free, with n and the confidence they reach at n; {STEPS_MARK}: {STEPS_NOTE})")
