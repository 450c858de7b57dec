"""The statistics every report and comparison states: a median with its 95 % interval, the ratio of
two medians with its 95 % interval, and the verdict read off that interval.

- Interval of a median: percentile bootstrap. The sample (a group's repeats, or the measured steps
  of its one run) is resampled with replacement N_BOOT times, the median taken each time, and the
  2.5th and 97.5th percentiles of those medians are the interval. The generator is seeded (SEED),
  so the same numbers give the same interval on every machine and every call.
- Interval of a ratio of medians (candidate ÷ baseline): the ratio of the two resampled medians
  taken N_BOOT times, its 2.5th and 97.5th percentiles. Paired where both sides hold the same
  repeats of one sweep (each value keyed by folder, sweep and repeat: the repeat's runs ran side by
  side, interleaved, on one host): a resample draws repeats, and takes both sides' values of each
  drawn repeat, so that what a repeat's process shares (the host's speed in that call) moves both
  medians alike instead of widening the interval. Otherwise each side is resampled on its own.
  Differences (accuracy points) likewise.
- Over what: ``repeats`` (process-to-process spread) when a group has two runs or more; ``steps``
  when it has one run, resampling that run's measured steps (the spread between processes is then
  unknown, and every renderer says so); none when there is one value and no steps.
- Verdict with threshold t (THRESHOLD, 2 %): ``slower`` when the ratio's interval lies above 1 + t,
  ``faster`` when it lies below 1 / (1 + t), ``no difference`` when it lies inside
  [1 / (1 + t), 1 + t], ``unclear`` otherwise (or without an interval)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lora_bench.report.threshold import THRESHOLD

CONFIDENCE = 0.95
N_BOOT = 2000
SEED = 20260101
REPEATS, STEPS = "repeats", "steps"
FASTER, SLOWER, SAME, UNCLEAR = "faster", "slower", "no difference", "unclear"
HIGHER, LOWER = "higher", "lower"  # the words for a metric that is not a speed (accuracy, memory)
VERDICTS = (FASTER, SLOWER, HIGHER, LOWER, SAME, UNCLEAR)
_CHUNK = 4_000_000  # resampled values held at once (a long run's steps are drawn in blocks)

RESAMPLING = ("repeats of one sweep paired: a resample draws repeats and takes both sides' runs of each, so that "
              "what a repeat's runs share, the host's speed in that call, cancels; otherwise each side's repeats "
              "resampled on their own")
STATISTIC = "median with 95 % percentile-bootstrap interval"
STEPS_NOTE = "interval over the steps of one run: process-to-process spread unknown"
STEPS_MARK = "†"  # marks an interval over the steps of one run


@dataclass(frozen=True)
class Sample:
    """The values an interval resamples: a group's repeats, or the measured steps of its one run
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
        if over == REPEATS and len(v) < 2:
            over = ""
        if over == STEPS and len(v) < 2:
            over = ""
        return cls(values=v, over=over, value=value, keys=keys)

    @property
    def point(self) -> float:
        """The median the sample stands for (a one-run group: that run's recorded value)."""
        if not math.isnan(self.value):
            return self.value
        return float(np.median(self.values)) if len(self.values) else math.nan


@dataclass(frozen=True)
class Estimate:
    """A median, or a ratio of medians, with its 95 % interval (NaN where there is none)."""

    value: float
    lo: float = math.nan
    hi: float = math.nan
    n: int = 0  # values the point estimate stands on (repeats, or 1 for one run)
    over: str = ""  # REPEATS, STEPS or "" (no interval)
    paired: bool = False  # the interval resampled the two sides' repeats in pairs (module)

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

    def as_dict(self) -> dict:
        return {"value": _json_float(self.value), "lo": _json_float(self.lo), "hi": _json_float(self.hi),
                "n": self.n, "interval_over": self.over or None, "paired": self.paired}


NONE = Estimate(math.nan)


def _json_float(v: float) -> float | None:
    return None if math.isnan(v) else float(v)


def _boot_medians(values: np.ndarray, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """The medians of ``n_boot`` resamples (with replacement) of ``values``."""
    n = len(values)
    rows = max(1, _CHUNK // n)
    out = np.empty(n_boot)
    for start in range(0, n_boot, rows):
        stop = min(n_boot, start + rows)
        idx = rng.integers(0, n, size=(stop - start, n))
        out[start:stop] = np.median(values[idx], axis=1)
    return out


def _paired(candidate: Sample, baseline: Sample) -> tuple[np.ndarray, np.ndarray] | None:
    """Both sides' values in the order of their common repeats, when they hold the same ones."""
    if candidate.keys is None or baseline.keys is None or set(candidate.keys) != set(baseline.keys):
        return None
    where = {k: i for i, k in enumerate(baseline.keys)}
    order = [where[k] for k in candidate.keys]
    return candidate.values, baseline.values[order]


def _boot_median_pairs(a: np.ndarray, b: np.ndarray, rng: np.random.Generator,
                       n_boot: int) -> tuple[np.ndarray, np.ndarray]:
    """The medians of ``n_boot`` resamples of the pairs (a[i], b[i]), each side's median apart."""
    n = len(a)
    idx = rng.integers(0, n, size=(n_boot, n))
    return np.median(a[idx], axis=1), np.median(b[idx], axis=1)


def _two_sides(candidate: Sample, baseline: Sample, rng: np.random.Generator,
               n_boot: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Resampled medians of both sides: paired where ``_paired`` finds pairs, else each on its own."""
    pairs = _paired(candidate, baseline)
    if pairs is not None:
        return (*_boot_median_pairs(*pairs, rng, n_boot), True)
    return _boot_medians(candidate.values, rng, n_boot), _boot_medians(baseline.values, rng, n_boot), False


def _bounds(boots: np.ndarray) -> tuple[float, float]:
    tail = (1 - CONFIDENCE) / 2
    lo, hi = np.quantile(boots, (tail, 1 - tail))
    return float(lo), float(hi)


def _n(sample: Sample) -> int:
    return 1 if sample.over == STEPS else len(sample.values)


def median_interval(sample: Sample, *, seed: int = SEED, n_boot: int = N_BOOT) -> Estimate:
    """The sample's median (or its run's recorded value) with the percentile-bootstrap interval."""
    point = sample.point
    if not sample.over:
        return Estimate(point, n=_n(sample))
    lo, hi = _bounds(_boot_medians(sample.values, np.random.default_rng(seed), n_boot))
    return Estimate(point, min(lo, point), max(hi, point), n=_n(sample), over=sample.over)


def ratio_interval(candidate: Sample, baseline: Sample, *, seed: int = SEED, n_boot: int = N_BOOT) -> Estimate:
    """median(candidate) / median(baseline), paired by repeat where both sides hold the same repeats,
    else each side resampled on its own (module); the interval is over steps when either side's is."""
    num, den = candidate.point, baseline.point
    if math.isnan(num) or math.isnan(den) or den == 0:
        return NONE
    ratio = num / den
    n = min(_n(candidate), _n(baseline))
    if not (candidate.over and baseline.over):
        return Estimate(ratio, n=n)
    top, bottom, paired = _two_sides(candidate, baseline, np.random.default_rng(seed), n_boot)
    if (bottom <= 0).any():
        return Estimate(ratio, n=n)
    lo, hi = _bounds(top / bottom)
    over = STEPS if STEPS in (candidate.over, baseline.over) else REPEATS
    return Estimate(ratio, min(lo, ratio), max(hi, ratio), n=n, over=over, paired=paired)


def difference_interval(candidate: Sample, baseline: Sample, *, seed: int = SEED,
                        n_boot: int = N_BOOT) -> Estimate:
    """median(candidate) − median(baseline) (e.g. accuracy points), paired as ``ratio_interval``."""
    a, b = candidate.point, baseline.point
    if math.isnan(a) or math.isnan(b):
        return NONE
    d = a - b
    n = min(_n(candidate), _n(baseline))
    if not (candidate.over and baseline.over):
        return Estimate(d, n=n)
    top, bottom, paired = _two_sides(candidate, baseline, np.random.default_rng(seed), n_boot)
    lo, hi = _bounds(top - bottom)
    over = STEPS if STEPS in (candidate.over, baseline.over) else REPEATS
    return Estimate(d, min(lo, d), max(hi, d), n=n, over=over, paired=paired)


def verdict(ratio: Estimate, *, threshold: float = THRESHOLD, higher_is_better: bool = False,
            speed: bool = True) -> str:
    """The module's verdict for a ratio candidate ÷ baseline: for a time (``speed``, lower is
    better) slower above the band, faster below it; for a throughput (``higher_is_better``) the
    other way round; for a metric that is not a speed, higher or lower. No difference inside the
    band; unclear otherwise or without an interval."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
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
    """Whether a difference's interval leaves out 0 (None: no interval)."""
    if not diff.has_interval:
        return None
    return diff.lo > 0 or diff.hi < 0


def span_text(e: Estimate, *, digits: int = 2) -> str:
    """'[1.47–1.53]', '[-4.20 to -3.80]', '[204.1–206.2]†' (over one run's steps); '(no interval)'."""
    if not e.has_interval:
        return "(no interval)"
    lo, hi = f"{e.lo:,.{digits}f}", f"{e.hi:,.{digits}f}"
    sep = " to " if e.lo < 0 or e.hi < 0 else "–"
    return f"[{lo}{sep}{hi}]{STEPS_MARK if e.per_step else ''}"


def interval_text(e: Estimate, *, digits: int = 2, unit: str = "") -> str:
    """'1.50× [1.47–1.53]', '33.4 [33.0–33.9]', '205.0 [204.1–206.2]†'; '-' without a value."""
    if not e.known:
        return "-"
    return f"{e.value:,.{digits}f}{unit} {span_text(e, digits=digits)}"


def threshold_text(threshold: float) -> str:
    return f"{100 * threshold:g} %"


def rule_text(threshold: float = THRESHOLD, *, higher_is_better: bool = False, speed: bool = True) -> str:
    """The verdict rule as one sentence, for the notes under a table, in the words ``verdict``
    gives a metric of that sense: slower / faster for a time, faster / slower for a throughput,
    higher / lower for a metric that is not a speed (accuracy, memory)."""
    t = threshold_text(threshold)
    above, below = (HIGHER, LOWER) if not speed else (FASTER, SLOWER) if higher_is_better else (SLOWER, FASTER)
    return (f"verdict: {above} / {below} where the ratio's 95 % interval lies wholly above 1 + {t} / below "
            f"1 ÷ (1 + {t}); no difference where it lies inside that band; unclear otherwise "
            f"(intervals: percentile bootstrap over repeats, seeded; {STEPS_MARK}: {STEPS_NOTE})")
