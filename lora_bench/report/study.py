"""The study a results folder holds, arranged to answer its question: for each variant (by default
each trainable-layer choice against ``all``), execution mode and condition (batch size, …), the
step time by model size as a ratio to the baseline, with the spread over repeats; per group the
device and host time of each phase, the host/device verdicts, kernel launches where a profile
exists, tokens/s, MFU and accuracy over seeds.

Rules (each stated where a reader sees its result):
- runs with a profiler attached (``profile`` not ``none``) are left out of the timings (a profiler
  perturbs them); their kernel counts join the timed group with the same step shape and mode
  (model size, trainable layers, LoRA rank, batch, context, execution mode);
- a seed that differs across repeats makes them repeats over seeds;
- every median comes with its 95 % interval and every ratio of medians with its own, and a ratio's
  verdict is read off its interval (lora_bench.report.stats); a difference in accuracy is outside
  the seed noise where its interval leaves out 0."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from lora_bench.report import stats
from lora_bench.report.aggregate import (
    NOT_GROUPED,
    collapse_modes,
    numbers,
    order_key,
    parse_baseline,
    text_summary,
    varying_settings,
)
from lora_bench.report.empty import why_empty
from lora_bench.report.load import MODE, RUN_DIR, kernel_counts, shared_ids_note
from lora_bench.report.groups import RunGroup, difference, group_runs, same
from lora_bench.report.samples import sample
from lora_bench.report.stats import Estimate
from lora_bench.report.names import MODE_FIELDS, condition_text, is_blank, setting_name, value_text
from lora_bench.results.schema import SETTING_PREFIX
from lora_bench.timing import PHASES

SIZE = SETTING_PREFIX + "model_size"
SHAPE_OVERRIDES = tuple(SETTING_PREFIX + k for k in ("emb_dim", "n_layers", "n_heads"))
LAYERS = SETTING_PREFIX + "trainable_layers"
# settings that decide the kernels a step launches: a profile describes a timed group that shares them
STEP_SHAPE = (SIZE, *SHAPE_OVERRIDES, LAYERS, *(SETTING_PREFIX + k for k in (
    "lora_rank", "batch_size", "context_length", "no_padding", "accumulation_steps", "trainable_token_pos",
    "average_embeddings", "disable_causal_mask")), "pack_size", *MODE_FIELDS)  # a pack's step is its points' at once
ACCURACIES = ("val_acc", "test_acc")
STEP = "step_ms_median"
METRICS = (STEP, "host_step_ms_median", *(f"{p}{ph}_ms_median" for ph in PHASES for p in ("", "host_")),
           "tokens_per_s", "mfu", *ACCURACIES)  # the estimates a group shows


# The cause of a phase's time, measured: the GPU's busy fraction, the kernel time a profiled repeat
# saw in the phase over the phase's device time in the timed repeats. A GPU that runs kernels for
# most of the phase is the bottleneck (the host then waits on a full launch queue, so host time ≈
# device time there too); one that runs kernels for less than half of it waits for Python.
GPU_BOUND = 0.9
STARVED = 0.5


@dataclass(frozen=True)
class Phase:
    device: Estimate  # median over repeats of each run's median, with its interval
    host: Estimate
    bound: str  # the runs' bound_* verdicts (host ≥ 0.9 × device): not a cause, kept for the tables
    launches: float | None = None  # kernels per step, from a profile
    kernel_ms: float | None = None  # summed kernel device time per step, from a profile

    @property
    def busy(self) -> float | None:
        """The GPU's busy fraction in this phase (see GPU_BOUND), None without a profiled repeat."""
        if self.kernel_ms is None or not self.device.known or not self.device.median:
            return None
        return min(float(self.kernel_ms) / self.device.median, 1.0)

    @property
    def cause(self) -> str:
        """'GPU-bound', 'GPU waits for the host', 'mixed', or '' (not measured)."""
        busy = self.busy
        if busy is None:
            return ""
        return "GPU-bound" if busy >= GPU_BOUND else "GPU waits for the host" if busy < STARVED else "mixed"

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
    ratio: float = math.nan  # median step / the baseline group's
    ratio_lo: float = math.nan  # its 95 % interval
    ratio_hi: float = math.nan
    ratio_over: str = ""  # what the interval resamples: repeats, steps (of a one-run group) or nothing
    verdict: str = ""  # lora_bench.report.stats.verdict of the ratio ('' for the baseline itself)
    profile: str = ""  # run id of the profiled run whose kernel counts are shown
    counts: dict[str, tuple[float, float]] = field(default_factory=dict)  # its (launches, kernel ms) by phase

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

    @property
    def device(self) -> str:
        return ", ".join(self.header.gpus) or ", ".join(self.header.devices) or "device not recorded"

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
        """(Δ median accuracy in points against the baseline group with its 95 % interval, whether
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


def default_baseline(done: pd.DataFrame) -> str | None:
    """``trainable_layers=all`` when the runs compare it with other choices."""
    if LAYERS in done and done[LAYERS].eq("all").any() and done[LAYERS].nunique() > 1:
        return "trainable_layers=all"
    return None


def build_study(df: pd.DataFrame, *, baseline: str | None = None, title: str = "",
                threshold: float = stats.THRESHOLD) -> Study:
    done = df[df["status"] == "done"]
    profiled, timed = _split(done)
    notes = [n for n in (shared_ids_note(df),) if n]
    if timed is done:  # nothing but profiled runs: their times are all there is
        notes.append("every run had a profiler attached: its step times are perturbed by it")
    elif len(profiled):
        notes.append(f"{len(profiled)} profiled run(s) left out of the timings (a profiler perturbs them); "
                     "their kernel counts are shown with the timed group of the same step shape and mode")
    text = baseline or default_baseline(timed)
    spec = parse_baseline(text, timed) if text else {}
    keys = _keys(timed, spec)
    size_keys = [k for k in (SIZE, *SHAPE_OVERRIDES) if k in keys]
    rest = [k for k in keys if k not in size_keys and k not in spec and k != MODE]
    rest = _informative(timed, [*size_keys, *spec, *([MODE] if MODE in keys else [])], rest)
    by = [*size_keys, *spec, *([MODE] if MODE in keys else []), *rest] or ["run_id"]
    groups = [_group(rg, size_keys=size_keys, spec=spec, mode=MODE in rg.runs and MODE not in spec, rest=rest)
              for rg in group_runs(timed, by, metrics=METRICS, baseline=spec, ratio_metric=STEP,
                                   threshold=threshold, lone_baseline=False)]
    sizes = sorted({g.size for g in groups}, key=lambda s: (order_key(s.split()[0]), s))
    groups.sort(key=lambda g: (_cond_order(g, rest), order_key(g.mode, col=MODE), sizes.index(g.size),
                               tuple(order_key(g.settings.get(k), col=k) for k in spec)))
    study = Study(header=_header(df, done, timed, title=title, spec=spec), baseline=spec,
                  baseline_text=", ".join(f"{setting_name(k)}={v}" for k, v in spec.items()),
                  variant_keys=list(spec), sizes=sizes, groups=groups, lines=[], profiles=[],
                  seeds_vary=_seeds_vary(groups), notes=notes, threshold=threshold)
    untimed = [g for g in groups if not g.step.known]
    if untimed:
        runs = pd.concat([g.runs for g in untimed])
        study.notes.append(f"{len(untimed)} group(s) without step times ({why_empty(runs, 'step_ms_median')}): "
                           "left out of the crossover and the phase tables")
    _base_params(study)
    study.lines = _lines(study)
    study.profiles = _attach_profiles(study, profiled)
    return study


def study_baseline(df: pd.DataFrame) -> str | None:
    """The baseline a study of ``df`` sets its groups against when none is given."""
    return default_baseline(_split(df[df["status"] == "done"])[1])


def _split(done: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(profiled runs, timed runs): every run is timed where all of them are profiled."""
    profiled = _profiled(done)
    timed = done.drop(index=profiled.index)
    return profiled, done if timed.empty else timed


def _profiled(done: pd.DataFrame) -> pd.DataFrame:
    """Runs with a profiler attached (their step times are perturbed)."""
    if "cfg_profile" not in done:
        return done.iloc[:0]
    return done[done["cfg_profile"].fillna("none").replace("", "none").ne("none")]


def _keys(timed: pd.DataFrame, spec: dict) -> list[str]:
    varying = varying_settings(timed)
    if any(k in MODE_FIELDS for k in spec):  # a mode setting is compared: keep the mode settings apart
        keys = varying
    else:
        keys = collapse_modes(varying)
    for k in (SIZE, *spec):
        if k not in keys and k in timed:
            keys.append(k)
    return keys


def _informative(df: pd.DataFrame, fixed: list[str], rest: list[str]) -> list[str]:
    """The condition settings that split groups: one whose value follows from the others (e.g.
    num_epochs chosen with batch_size) is left out of the names."""
    out = list(rest)
    for k in reversed(rest):
        others = [c for c in [*fixed, *out] if c != k]
        n_with = df.groupby([*others, k], dropna=False).ngroups
        n_without = df.groupby(others, dropna=False).ngroups if others else 1
        if n_with == n_without:
            out.remove(k)
    return out


def _cond_order(g: Group, rest: list[str]) -> tuple:
    return tuple(order_key(g.settings.get(k), col=k) for k in rest)


def _first(g: pd.DataFrame, col: str):
    return g[col].iloc[0] if col in g else None


def _group(rg: RunGroup, *, size_keys: list[str], spec: dict, mode: bool, rest: list[str]) -> Group:
    g, est = rg.runs, rg.estimates
    settings = {k: _first(g, k) for k in (*size_keys, *spec, *([MODE] if MODE in g else []), *rest)}
    size = " ".join([value_text(settings.get(SIZE))] + [f"{setting_name(k)}={value_text(settings[k])}"
                                                        for k in size_keys[1:] if not is_blank(settings[k])])
    variant = ", ".join(value_text(settings[k]) for k in spec) if spec else value_text(_first(g, LAYERS))
    phases = {}
    for ph in PHASES:
        bound = text_summary(g[f"bound_{ph}"]) if f"bound_{ph}" in g else ""
        phases[ph] = Phase(device=est[f"{ph}_ms_median"], host=est[f"host_{ph}_ms_median"],
                           bound=bound)
    seeds = sorted({value_text(v) for v in g.get(SETTING_PREFIX + "seed", pd.Series(dtype=str)) if not is_blank(v)})

    def med(col: str) -> float:
        return float(numbers(g[col]).median()) if col in g and len(numbers(g[col])) else math.nan

    return Group(size=size, variant=variant, mode=value_text(_first(g, MODE)) if mode else "",
                 condition=condition_text({k: settings[k] for k in rest}), settings=settings, runs=g,
                 step=est[STEP], host_step=est["host_step_ms_median"], phases=phases,
                 seeds=seeds,
                 tokens_per_step=med("tokens_per_step"), tokens_per_s=est["tokens_per_s"],
                 mfu=est["mfu"],
                 flops_per_step=med("flops_per_step"),
                 params=float(numbers(g["total_params"]).min()) if "total_params" in g and len(numbers(g["total_params"])) else math.nan,
                 accuracy={a: est[a] for a in ACCURACIES if a in g and est[a].known}, is_baseline=rg.is_baseline,
                 ratio=rg.ratio.value, ratio_lo=rg.ratio.lo, ratio_hi=rg.ratio.hi, ratio_over=rg.ratio.over,
                 verdict=rg.verdict)


def _base_params(study: Study) -> None:
    # the base model's size: LoRA adds adapter parameters, so the smallest count at a size is the model's
    smallest: dict[str, float] = {}
    for g in study.groups:
        if not math.isnan(g.params):
            smallest[g.size] = min(smallest.get(g.size, math.inf), g.params)
    for g in study.groups:
        g.params = smallest.get(g.size, math.nan)


def _lines(study: Study) -> list[Line]:
    lines: dict[tuple, Line] = {}
    for g in study.groups:
        if g.is_baseline or not study.baseline:
            continue
        key = g.line
        if key not in lines:
            lines[key] = Line(condition=g.condition, mode=g.mode, variant=g.variant, groups=[])
        lines[key].groups.append(g)
    return list(lines.values())


def _seeds_vary(groups: list[Group]) -> bool:
    return any(len(g.seeds) > 1 for g in groups)


def _attach_profiles(study: Study, profiled: pd.DataFrame) -> list[Profile]:
    """Kernel counts of each profiled run, joined to the timed group with its step shape and mode
    (the latest profile wins where several match)."""
    out = []
    for row in profiled.sort_values("started_at").to_dict("records"):
        counts = kernel_counts(row[RUN_DIR]) if RUN_DIR in row else {}
        if not counts:
            continue
        match = None
        for g in study.groups:
            rep = g.runs.iloc[0]
            if same(rep.get(MODE, ""), row.get(MODE, "")) and all(
                    same(rep[c], row[c]) or (is_blank(rep[c]) and is_blank(row[c]))
                    for c in STEP_SHAPE if c in rep and c in row and c not in MODE_FIELDS):
                match = g
                break
        if match is not None:
            for ph, p in match.phases.items():
                launches, ms = counts.get(ph, (None, None))
                match.phases[ph] = Phase(device=p.device, host=p.host, bound=p.bound, launches=launches, kernel_ms=ms)
            match.profile, match.counts = str(row["run_id"]), counts
        out.append(Profile(run_id=str(row["run_id"]), size=value_text(row.get(SIZE)),
                           variant=value_text(row.get(LAYERS)), mode=str(row.get(MODE, "")),
                           condition=f"batch {value_text(row.get(SETTING_PREFIX + 'batch_size'))}",
                           counts=counts, group=match))
    return out


# -- header --------------------------------------------------------------------------------------
ENV = (("torch", "torch_version"), ("CUDA", "cuda_version"), ("driver", "gpu_driver"), ("cuDNN", "cudnn_version"),
       ("Triton", "triton_version"), ("Python", "python_version"), ("TF32 matmul", "tf32_matmul"),
       ("transformers", "transformers_version"), ("PEFT", "peft_version"))


def _values(df: pd.DataFrame, col: str) -> list[str]:
    if col not in df:
        return []
    return sorted({str(v) for v in df[col] if not is_blank(v)}, key=lambda v: order_key(v))


def _header(df: pd.DataFrame, done: pd.DataFrame, timed: pd.DataFrame, *, title: str, spec: dict) -> Header:
    commits = done["git_commit"].fillna("").astype(str).value_counts() if "git_commit" in done else pd.Series(dtype=int)
    started = sorted(str(v) for v in done.get("started_at", pd.Series(dtype=str)) if not is_blank(v))
    fixed = {}
    for c in sorted(c for c in timed.columns if c.startswith(SETTING_PREFIX) and c not in NOT_GROUPED):
        vals = _values(timed, c)
        if len(vals) == 1:
            fixed[setting_name(c)] = value_text(vals[0])
    varying = [setting_name(k) if k != MODE else "execution mode" for k in collapse_modes(varying_settings(timed))]
    seeds = _values(timed, SETTING_PREFIX + "seed")
    if len(seeds) > 1:
        varying.append(f"seed ({len(seeds)} seeds over repeats)")
    names = _values(done, "sweep_name")
    sizes = sorted(_values(timed, SIZE), key=order_key)
    layers = sorted(_values(timed, LAYERS), key=order_key)
    return Header(title=title or (names[0] if len(names) == 1 else "results"),
                  question=_question(spec, sizes, layers, modes=len(_values(timed, MODE))),
                  gpus=_values(done, "gpu_name"), devices=[d.upper() for d in _values(done, "device")], versions={k: ", ".join(_values(done, c)) for k, c in ENV if _values(done, c)},
                  commits=[(str(c) or "unknown", int(n)) for c, n in commits.items()],
                  first=started[0] if started else "", last=started[-1] if started else "", fixed=fixed,
                  varying=varying, n_runs=len(done),
                  excluded={str(k): int(v) for k, v in df.loc[df["status"] != "done", "status"].value_counts().items()},
                  hosts=len(_values(done, "hostname")))


def _question(spec: dict, sizes: list[str], layers: list[str], *, modes: int) -> str:
    """The question the runs can answer, from what varies in them."""
    span = f"{sizes[0]} to {sizes[-1]}" if len(sizes) > 1 else (sizes[0] if sizes else "")
    how = " and how does the execution mode change that" if modes > 1 else ""
    if spec:
        base = ", ".join(value_text(v) for v in spec.values())
        if list(spec) == [LAYERS]:
            others = [v for v in layers if v != spec[LAYERS]]
            who = " and ".join(others) or "the other runs"
            verb = "is" if len(others) == 1 else "are"
            where = f"at model sizes from {span}" if len(sizes) > 1 else f"at {span}"
            return f"Why {verb} {who} faster or slower than {base} (full fine-tuning) {where}{how}?"
        return f"How do the runs compare with {base}{' from ' + span if len(sizes) > 1 else ''}, and why{how}?"
    return f"Where does the step time go{' from ' + span if span else ''}{how}?"
