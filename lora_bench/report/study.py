"""The study a results folder holds, arranged to answer its question: for each variant (by default
each trainable-layer choice against ``all``), execution mode and condition (batch size, …), the
step time by model size as a ratio to the baseline, with the spread over repeats; per group the
device and host time of each phase, kernel launches and the GPU's busy fraction where a profile
exists, tokens/s, MFU and accuracy over seeds.

Rules (each stated where a reader sees its result):
- runs with a profiler attached (``profile`` not ``none``) are left out of the timings (a profiler
  perturbs them); their kernel counts join the timed group with the same step shape and mode
  (model size, trainable layers, LoRA rank, batch, context, execution mode);
- a seed that differs across repeats makes them repeats over seeds;
- every median comes with its interval and every ratio with its own, and a ratio's
  verdict is read off its interval (lora_bench.report.stats); a difference in accuracy is outside
  the seed noise where its interval leaves out 0."""

from __future__ import annotations

import math

import pandas as pd

from lora_bench.config import FROZEN
from lora_bench.config.declaration import BASE_DTYPE_DEFAULT
from lora_bench.config.setting_rules import KERNEL_LAYER_SETTINGS, VARIANT_DEFAULTS
from lora_bench.report.aggregate import (
    collapse_modes,
    numbers,
    order_key,
    parse_baseline,
    varying_settings,
)
from lora_bench.report.empty import why_empty
from lora_bench.report.groups import RunGroup, group_runs, same
from lora_bench.report.load import MODE, RUN_DIR, kernel_counts, shared_gpu_note, shared_ids_note
from lora_bench.report.labels import MODE_FIELDS, condition_text, is_blank, setting_name, value_text
from lora_bench.report.stats import THRESHOLD
from lora_bench.report.study_header import LAYERS, SIZE, header
from lora_bench.report.study_model import ACCURACIES, Group, Line, Phase, Profile, Study
from lora_bench.results.schema import SETTING_PREFIX
from lora_bench.timing import PHASES

KERNEL = "lora-kernel"
KERNEL_ONLY = tuple(SETTING_PREFIX + k for k in KERNEL_LAYER_SETTINGS)
KERNEL_DORA_ONLY = (SETTING_PREFIX + "dora_norm_launch",)  # of the fused layer's DoRA alone: not named on its LoRA rows
SHAPE_OVERRIDES = tuple(SETTING_PREFIX + k for k in ("emb_dim", "n_layers", "n_heads"))
# settings that decide the kernels a step launches: a profile describes a timed group that shares them
# The adapter's variant and the model's code change the kernels too; a row that predates a setting
# (a blank cell) holds its default, which left the step as it was.
STEP_DEFAULTS = {SETTING_PREFIX + k: v for k, v in {
    **VARIANT_DEFAULTS, "dora_norm": "exact", "implementation": "book", "base_dtype": BASE_DTYPE_DEFAULT}.items()}
ADAPTER_ONLY = tuple(SETTING_PREFIX + k for k in (*VARIANT_DEFAULTS, "dora_norm"))  # what a floor has no say in
STEP_SHAPE = (SIZE, *SHAPE_OVERRIDES, LAYERS, *(SETTING_PREFIX + k for k in (
    "lora_rank", "batch_size", "context_length", "no_padding", "accumulation_steps", "trainable_token_pos",
    "average_embeddings", "disable_causal_mask")), "pack_size", *STEP_DEFAULTS,
    *MODE_FIELDS)  # a pack's step is its points' at once
STEP = "step_ms_median"
METRICS = (STEP, "host_step_ms_median", *(f"{p}{ph}_ms_median" for ph in PHASES for p in ("", "host_")),
           "tokens_per_s", "mfu", *ACCURACIES)  # the estimates a group shows


def default_baseline(done: pd.DataFrame) -> str | None:
    """``trainable_layers=all`` when the runs compare it with other choices."""
    if LAYERS in done and done[LAYERS].eq("all").any() and done[LAYERS].nunique() > 1:
        return "trainable_layers=all"
    return None


def build_study(df: pd.DataFrame, *, baseline: str | None = None, title: str = "",
                threshold: float = THRESHOLD, metrics: tuple[str, ...] | list[str] = ()) -> Study:
    """The study of ``df``'s finished runs, grouped once: each group gets an estimate of METRICS and
    of ``metrics`` (what the report's table of every group shows beside them)."""
    done = df[df["status"] == "done"]
    profiled, timed = _split(done)
    notes = [n for n in (shared_ids_note(df), shared_gpu_note(df)) if n]
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
    own = _own(rest, spec)
    rest = [k for k in rest if k not in own]
    by = [*size_keys, *spec, *([MODE] if MODE in keys else []), *rest, *own] or ["run_id"]
    run_groups = group_runs(timed, by, metrics=list(dict.fromkeys([*METRICS, *metrics])), baseline=spec,
                            ratio_metric=STEP, threshold=threshold, lone_baseline=False, unmatched=own)
    groups = [_group(rg, size_keys=size_keys, spec=spec, mode=MODE in rg.runs and MODE not in spec, rest=rest,
                     own=own) for rg in run_groups]
    sizes = sorted({g.size for g in groups}, key=lambda s: (order_key(s.split()[0]), s))
    groups.sort(key=lambda g: (_cond_order(g, rest), order_key(g.mode, col=MODE), sizes.index(g.size),
                               tuple(order_key(g.settings.get(k), col=k) for k in spec)))
    study = Study(header=header(df, done, timed, title=title, spec=spec), baseline=spec,
                  baseline_text=", ".join(f"{setting_name(k)}={v}" for k, v in spec.items()),
                  variant_keys=list(spec), sizes=sizes, groups=groups, lines=[], profiles=[],
                  seeds_vary=_seeds_vary(groups), notes=notes, threshold=threshold, keys=by, run_groups=run_groups)
    untimed = [g for g in groups if not g.step.known]
    if untimed:
        runs = pd.concat([g.runs for g in untimed])
        study.notes.append(f"{len(untimed)} group(s) without step times ({why_empty(runs, 'step_ms_median')}): "
                           "left out of the crossover and the phase tables")
    _base_params(study)
    study.lines = _lines(study)
    study.profiles = _attach_profiles(study, profiled)
    study.profiled = profiled
    return study


def study_baseline(df: pd.DataFrame) -> str | None:
    """The baseline a study of ``df`` sets its groups against when none is given."""
    return default_baseline(_split(df[df["status"] == "done"])[1])


def _split(done: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(profiled runs, timed runs): every run is timed where all of them are profiled."""
    profiled = profiled_runs(done)
    timed = done.drop(index=profiled.index)
    return profiled, done if timed.empty else timed


def step_setting(row, column: str):
    """``row``'s value of a step-shape setting: a blank cell of a setting with a default reads as it."""
    value = row[column]
    return STEP_DEFAULTS[column] if column in STEP_DEFAULTS and is_blank(value) else value


def same_settings(a, b, cols) -> bool:
    """Two runs (rows) hold the same value of each of ``cols`` both have (``step_setting``: a blank
    cell as the setting's default), or both none."""
    return all(same(step_setting(a, c), step_setting(b, c)) or (is_blank(a[c]) and is_blank(b[c]))
               for c in cols if c in a and c in b)


def same_step(a, b) -> bool:
    """Two runs (rows) launch the same kernels per step: the same step shape and execution mode."""
    return same(a.get(MODE, ""), b.get(MODE, "")) and same_settings(a, b, (c for c in STEP_SHAPE if c not in MODE_FIELDS))


def profiled_runs(done: pd.DataFrame) -> pd.DataFrame:
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


def _own(rest: list[str], spec: dict) -> list[str]:
    """The settings of ``rest`` that name a variant rather than a condition, because the baseline's
    layer choice has no say in them: it ran them at their default (the config refuses others) and
    is matched without them. A setting of the fused layer alone, against a baseline of another
    choice; against the floor (``frozen``, no adapter), the adapter's variant settings too, so every
    variant of LoRA finds the one floor of its size and mode."""
    if LAYERS not in spec or same(spec[LAYERS], KERNEL):
        return []
    theirs = (*KERNEL_ONLY, *ADAPTER_ONLY) if same(spec[LAYERS], FROZEN) else KERNEL_ONLY
    return [k for k in rest if k in theirs]


def _own_text(settings: dict, own: list[str], layers) -> str:
    """What of ``own`` a group's name shows: the fused layer's own settings on its rows (those of its
    DoRA alone on its DoRA rows), the adapter's variant settings where they are not the default, on
    any adapter's rows."""
    if same(layers, FROZEN):
        return ""
    dora = same(settings.get(SETTING_PREFIX + "lora_variant"), "dora")
    shown = [k for k in own if (k in KERNEL_ONLY and same(layers, KERNEL) and (dora or k not in KERNEL_DORA_ONLY))
             or (k in ADAPTER_ONLY and not is_blank(settings[k]) and not same(settings[k], STEP_DEFAULTS[k]))]
    return " (" + ", ".join(f"{setting_name(k)}={value_text(settings[k])}" for k in shown) + ")" if shown else ""


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


def _variant_name(settings: dict, spec: dict) -> str:
    """A group's name by the baseline's settings: their values where the baseline names one setting
    (``all``, ``lora``); where it names several, the settings in which the group differs from it,
    named (``trainable_layers=lora-kernel, lora_variant=dora``), and the baseline's own group by
    all of them, named."""
    if len(spec) == 1:
        return ", ".join(value_text(settings[k]) for k in spec)
    differ = [k for k in spec if not same(settings[k], spec[k])] or list(spec)
    return ", ".join(f"{setting_name(k)}={value_text(settings[k])}" for k in differ)


def _group(rg: RunGroup, *, size_keys: list[str], spec: dict, mode: bool, rest: list[str],
           own: list[str] = ()) -> Group:
    g, est = rg.runs, rg.estimates
    settings = {k: _first(g, k) for k in (*size_keys, *spec, *([MODE] if MODE in g else []), *rest, *own)}
    size = " ".join([value_text(settings.get(SIZE))] + [f"{setting_name(k)}={value_text(settings[k])}"
                                                        for k in size_keys[1:] if not is_blank(settings[k])])
    variant = _variant_name(settings, spec) if spec else value_text(_first(g, LAYERS))
    variant += _own_text(settings, list(own), _first(g, LAYERS))
    phases = {}
    for ph in PHASES:  # a phase's cause is measured by a profiled repeat (_attach_profiles), never inferred
        phases[ph] = Phase(device=est[f"{ph}_ms_median"], host=est[f"host_{ph}_ms_median"])
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
                 params=float(numbers(g["total_params"]).min()) if "total_params" in g and len(numbers(g["total_params"]))
                 else math.nan,
                 accuracy={a: est[a] for a in ACCURACIES if a in g and est[a].known}, is_baseline=rg.is_baseline,
                 ratio=rg.ratio.value, ratio_lo=rg.ratio.lo, ratio_hi=rg.ratio.hi, ratio_over=rg.ratio.over,
                 verdict=rg.verdict, ratio_stats=rg.ratio)


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
        match = next((g for g in study.groups if same_step(g.runs.iloc[0], row)), None)
        if match is not None:
            for ph, p in match.phases.items():
                launches, ms = counts.get(ph, (None, None))
                match.phases[ph] = Phase(device=p.device, host=p.host, launches=launches, kernel_ms=ms)
            match.profile, match.counts = str(row["run_id"]), counts
        out.append(Profile(run_id=str(row["run_id"]), size=value_text(row.get(SIZE)),
                           variant=value_text(row.get(LAYERS)), mode=str(row.get(MODE, "")),
                           condition=f"batch {value_text(row.get(SETTING_PREFIX + 'batch_size'))}",
                           counts=counts, group=match))
    return out
