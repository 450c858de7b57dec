"""What the study view holds (built by lora_bench.report.study): per group its step time and
phases with their intervals and its ratio to the baseline with the verdict (all from
lora_bench.report.groups), the lines of one variant across sizes, the kernel profiles, the header
facts; and the measured cause of a phase's time (the GPU's busy fraction, GPU_BOUND and STARVED)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from lora_bench.config import DEFAULTS
from lora_bench.report import stats
from lora_bench.report.groups import difference, same
from lora_bench.report.labels import setting_name
from lora_bench.report.samples import sample
from lora_bench.report.stats import Estimate
from lora_bench.results.runs_csv import text_value

ACCURACIES = ("val_acc", "test_acc")

# The cause of a phase's time, measured: the GPU's busy fraction, the kernel time a profiled repeat
# saw in the phase over the phase's device time in the timed repeats. A GPU that runs kernels for
# most of the phase is the bottleneck (the host then waits on a full launch queue, so host time ≈
# device time there too); one that runs kernels for less than half of it waits for Python. Host
# time about as long as device time says neither: it holds for a GPU-bound phase as well.
GPU_BOUND = 0.9
STARVED = 0.5
NOT_MEASURED = "not measured"  # what a phase's cause reads without a profiled repeat of its settings


def cause_of(busy: float | None) -> str:
    """'GPU-bound', 'GPU waits for the host', 'mixed', or '' (no busy fraction: not measured)."""
    if busy is None:
        return ""
    return "GPU-bound" if busy >= GPU_BOUND else "GPU waits for the host" if busy < STARVED else "mixed"


def busy_fraction(kernel_ms: float | None, device_ms: float | None) -> float | None:
    """Kernel ms over device ms (at most 1), None where either is missing or the device time is 0."""
    if kernel_ms is None or device_ms is None or math.isnan(float(kernel_ms)) or not device_ms \
            or math.isnan(float(device_ms)):
        return None
    return min(float(kernel_ms) / float(device_ms), 1.0)


@dataclass(frozen=True)
class Phase:
    device: Estimate  # median over repeats of each run's median, with its interval
    host: Estimate
    launches: float | None = None  # kernels per step, from a profile
    kernel_ms: float | None = None  # summed kernel device time per step, from a profile

    @property
    def busy(self) -> float | None:
        """The GPU's busy fraction in this phase (see GPU_BOUND), None without a profiled repeat."""
        return busy_fraction(self.kernel_ms, self.device.median) if self.device.known else None

    @property
    def cause(self) -> str:
        """'GPU-bound', 'GPU waits for the host', 'mixed', or '' (not measured)."""
        return cause_of(self.busy)

    @property
    def host_bound(self) -> bool:
        """Measured: the GPU ran kernels for less than STARVED of the phase."""
        return self.cause == "GPU waits for the host"


@dataclass
class Group:
    size: str
    variant: str  # the compared setting's value(s), e.g. 'lora'
    mode: str  # execution mode's human name ('' when the mode is what is compared)
    condition: str  # the other settings that differ between lines, e.g. 'batch 8'
    settings: dict  # the group's key columns and values
    runs: pd.DataFrame
    step: Estimate  # median over repeats of each run's median step, with its interval
    phases: dict[str, Phase]
    seeds: list[str]
    host_step: Estimate = stats.NONE  # the same of each run's median host step
    tokens_per_step: float = math.nan
    tokens_per_s: Estimate = stats.NONE
    mfu: Estimate = stats.NONE
    flops_per_step: float = math.nan
    params: float = math.nan  # parameters of the base model (the smallest count at this size)
    accuracy: dict[str, Estimate] = field(default_factory=dict)
    is_baseline: bool = False
    ratio: float = math.nan  # step / the baseline group's (lora_bench.report.stats.ratio_interval)
    ratio_lo: float = math.nan  # its interval
    ratio_hi: float = math.nan
    ratio_over: str = ""  # what the interval is over: repeats, steps (of a one-run group) or nothing
    verdict: str = ""  # lora_bench.report.stats.verdict of the ratio ('' for the baseline itself)
    profile: str = ""  # run id of the profiled run whose kernel counts are shown
    counts: dict[str, tuple[float, float]] = field(default_factory=dict)  # its (launches, kernel ms) by phase
    ratio_stats: Estimate = stats.NONE  # the ratio as the engine gave it (its n, pairing and confidence)

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def two_clocks(self) -> bool:
        """Device and host times are both measured (CUDA events); on a CPU the host clock is the only one."""
        clocks = {str(v) for v in self.runs.get("timing_clock", [])}
        host_known = any(p.host.known for p in self.phases.values())
        return host_known and (not clocks or any(c.startswith("cuda") for c in clocks))

    @property
    def ratio_estimate(self) -> Estimate:
        if self.ratio_stats.known:
            return self.ratio_stats
        return Estimate(self.ratio, self.ratio_lo, self.ratio_hi, n=self.n, over=self.ratio_over)

    @property
    def line(self) -> tuple[str, str, str]:
        return (self.condition, self.mode, self.variant)

    def host_bound_phases(self, *, min_share: float) -> list[str]:
        """Phases where a profiled repeat measured the GPU waiting for the host (Phase.cause), among
        those taking at least ``min_share`` of the step (a phase of a few microseconds says nothing)."""
        return [ph for ph, p in self.phases.items() if p.host_bound and p.device.known
                and p.device.median >= min_share * self.step.median]

    def kernels(self) -> tuple[float, float] | None:
        """(launches, kernel ms) per step, when a profile exists: every row of its counts, those the
        profiler could not place in a phase ('other') included."""
        if not self.counts:
            return None
        return sum(a for a, _ in self.counts.values()), sum(b for _, b in self.counts.values())


@dataclass
class Line:
    """One variant in one mode and condition across model sizes, against its baseline."""
    condition: str
    mode: str
    variant: str
    groups: list[Group]  # ordered by size

    @property
    def label(self) -> str:
        return " · ".join(p for p in (self.variant, self.mode) if p)


@dataclass
class Profile:
    run_id: str
    size: str
    variant: str
    mode: str
    condition: str
    counts: dict[str, tuple[float, float]]
    group: Group | None


@dataclass
class Header:
    title: str
    question: str
    gpus: list[str]
    devices: list[str]  # torch devices ('cpu', 'cuda') where no GPU name is recorded
    versions: dict[str, str]
    commits: list[tuple[str, int]]
    first: str
    last: str
    fixed: dict[str, str]
    varying: list[str]
    n_runs: int
    excluded: dict[str, int]
    hosts: int


@dataclass
class Study:
    header: Header
    baseline: dict[str, str]
    baseline_text: str
    variant_keys: list[str]
    sizes: list[str]
    groups: list[Group]
    lines: list[Line]
    profiles: list[Profile]
    seeds_vary: bool
    notes: list[str] = field(default_factory=list)
    threshold: float = stats.THRESHOLD
    keys: list[str] = field(default_factory=list)  # the columns the runs are grouped by
    run_groups: list = field(default_factory=list)  # the engine's groups (lora_bench.report.groups.RunGroup)
    profiled: pd.DataFrame = field(default_factory=pd.DataFrame)  # the runs with a profiler attached

    @property
    def device(self) -> str:
        return ", ".join(self.header.gpus) or ", ".join(self.header.devices) or "device not recorded"

    @property
    def baseline_name(self) -> str:
        """What the sentences call the baseline: its one value ('all' for trainable_layers=all); of
        several settings, those off their defaults ('lora' for the book's LoRA with every variant
        setting at its default), else all of them (``baseline_text``)."""
        if len(self.baseline) == 1:
            return next(iter(self.baseline.values()))
        off = {k: v for k, v in self.baseline.items() if not _at_default(k, v)}
        if len(off) == 1:
            return next(iter(off.values()))
        return ", ".join(f"{setting_name(k)}={v}" for k, v in off.items()) if off else self.baseline_text

    def base_of(self, g: Group) -> Group | None:
        for b in self.groups:
            if b.is_baseline and b.size == g.size and b.mode == g.mode and b.condition == g.condition:
                return b
        return None

    @property
    def accuracy_metric(self) -> str:
        """test_acc where measured, else val_acc, else ''."""
        return next((a for a in reversed(ACCURACIES) if any(a in g.accuracy for g in self.groups)), "")

    def accuracy_vs_base(self, g: Group) -> tuple[Estimate, bool | None]:
        """(Δ median accuracy in points against the baseline group with its interval, whether
        that interval leaves out 0: outside the spread over seeds; None without an interval)."""
        metric, b = self.accuracy_metric, self.base_of(g)
        if not metric or b is None or metric not in g.accuracy or metric not in b.accuracy:
            return stats.NONE, None
        return difference(sample(g.runs, metric), sample(b.runs, metric))

    @property
    def per_step(self) -> bool:
        """Some group has one run, so some interval is over the steps of that run."""
        return any(g.step.per_step for g in self.groups)

    def conditions(self) -> list[str]:
        return list(dict.fromkeys(g.condition for g in self.groups))

    def modes(self) -> list[str]:
        return list(dict.fromkeys(g.mode for g in self.groups))


def _at_default(column: str, value: str) -> bool:
    """Is a baseline's setting at the setting's default (a column that names no setting is not)?"""
    name = setting_name(column)
    return name in DEFAULTS and same(value, text_value(DEFAULTS[name]))
