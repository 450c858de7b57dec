"""``lora-bench compare BASELINE CANDIDATE``: two results folders set side by side, setting by
setting. Runs are matched by their settings (the ``cfg_*`` columns, paths left out, and the seed
where seeds vary across repeats), never by run id, so two sweeps of one file on two machines, or
before and after a change, line up. Per setting: the median of the metric on each side with its
interval, the ratio candidate ÷ baseline with its interval, and the verdict read off that
interval (lora_bench.report.stats). Differences between the folders' environments (GPU, driver,
torch, CPU, Python) are stated.

A comparison that cannot pass vacuously: ``problems`` names why it is not complete, and the command
exits non-zero on any: no setting on both sides; settings on one side only (unless ``allow_missing``);
with a gate, no matched setting with enough repeats for a verdict. A gate (``fail_above``) fails
where a setting is worse by more than that fraction with its whole interval: no difference, unclear
or too few repeats never fails it alone. ``ignore`` leaves settings out of the matching, so that
folders that differ in them on purpose (``max_steps``) line up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from lora_bench.config import SETTINGS
from lora_bench.errors import UsageError
from lora_bench.report import stats
from lora_bench.report.aggregate import (
    NOT_GROUPED,
    REPEAT_SETTINGS,
    collapse_modes,
    is_text,
    order_key,
    resolve_column,
)
from lora_bench.report.empty import is_empty, why_empty
from lora_bench.report.groups import exact, fails_gate, group_runs, metric_sense
from lora_bench.report.filters import filter_runs
from lora_bench.report.load import MODE, RUN_DIR, load_results, result_dirs
from lora_bench.report.samples import refused_steps
from lora_bench.report.labels import MODE_FIELDS, mode_name, setting_name, value_text
from lora_bench.report.order_stats import MIN_REPEATS
from lora_bench.report.stats import Estimate
from lora_bench.results.schema import SETTING_PREFIX

ENVIRONMENT = ("gpu_name", "gpu_driver", "torch_version", "cpu", "python_version")
HOST_SPEED = "host_op_us"  # measured per run (timing.host_op_us): differs between hosts of one CPU model
HOST_SPEED_TOLERANCE = 0.10  # runs of one host differ by less (the study's repeats: a few percent)
DEFAULT_METRIC = "step_ms_median"
SIDES = ("baseline", "candidate")
SIDE = "compared side"  # the column that tells the two folders' runs apart once they are read as one
SORTS = ("name", "ratio")
CHANGED = (stats.FASTER, stats.SLOWER, stats.HIGHER, stats.LOWER)  # the verdicts of a difference


@dataclass
class Row:
    """One setting found on both sides."""

    settings: dict[str, str]  # shown setting (or 'execution mode') -> value
    baseline: Estimate
    candidate: Estimate
    ratio: Estimate
    verdict: str
    fails: bool = False  # worse by more than the gate's fraction with its whole interval


@dataclass
class Comparison:
    baseline_dir: str
    candidate_dir: str
    metric: str
    threshold: float
    fail_above: float | None
    keys: list[str]  # the settings shown (those that tell the compared settings apart)
    rows: list[Row]
    only: dict[str, list[dict[str, str]]]  # side -> settings found on that side alone
    environment: list[str]  # one line per environment column that differs between the folders
    notes: list[str] = field(default_factory=list)
    allow_missing: bool = False
    ignored: list[str] = field(default_factory=list)  # settings left out of the matching

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.fails]

    @property
    def judged(self) -> list[Row]:
        """The rows with enough repeats for a verdict."""
        return [r for r in self.rows if r.verdict != stats.TOO_FEW]

    @property
    def problems(self) -> list[str]:
        """Why the comparison is incomplete (the command then exits 1), one reason a line."""
        out = []
        if not self.rows:
            out.append("no setting is on both sides: nothing was compared (settings that differ on purpose: "
                       "--ignore KEY)")
        missing = {side: len(self.only[side]) for side in SIDES if self.only[side]}
        if missing and self.rows and not self.allow_missing:
            where = ", ".join(f"{n} only in the {side}" for side, n in missing.items())
            out.append(f"settings missing on one side ({where}): --allow-missing accepts that")
        if self.fail_above is not None and self.rows and not self.judged:
            out.append(f"no setting on both sides has {MIN_REPEATS} repeats a side: the gate judged nothing")
        return out

    def shown(self, *, only_changed: bool = False, sort: str = "name") -> list[Row]:
        """The rows to show: all, or only those with a verdict of a difference (``only_changed``),
        in the settings' order (``name``) or worst ratio first (``ratio``)."""
        rows = [r for r in self.rows if r.verdict in CHANGED] if only_changed else list(self.rows)
        if sort == "ratio":
            higher, _ = metric_sense(self.metric)
            rows.sort(key=lambda r: (not r.ratio.known, (r.ratio.value if higher else -r.ratio.value)
                                     if r.ratio.known else 0.0))
        elif sort != "name":
            raise UsageError(f"--sort {sort!r} is not allowed; choose one of: {', '.join(SORTS)}")
        return rows


def _done(path: Path, side: str, filters=()) -> pd.DataFrame:
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{side} {path}: no such results folder")
    if not result_dirs(path):
        raise UsageError(f"{side} {path}: not a results folder (no runs.csv and no <run>/run.json under it)")
    df = filter_runs(load_results([path]), list(filters))
    done = df[df["status"] == "done"]
    if done.empty:
        raise UsageError(f"{side} {path}: none of its {len(df)} run(s) finished; nothing to compare")
    return done


def _default_text(col: str) -> str:
    s = SETTINGS.get(setting_name(col))
    return _text(s.default) if s is not None else "-"


def _text(v) -> str:
    """A setting's value as compared: '16' for 16.0, 'true' / 'false' for booleans in any spelling."""
    t = value_text(v)
    return t.lower() if t.lower() in ("true", "false") else t


def _seed_varies(frames: list[pd.DataFrame], keys: list[str]) -> bool:
    seed = next(iter(REPEAT_SETTINGS))
    return any(seed in f and f.groupby(keys or (lambda _: 0), dropna=False)[seed].nunique().gt(1).any()
               for f in frames)


def _ignored(keys, base: pd.DataFrame, cand: pd.DataFrame) -> set[str]:
    """The setting columns ``--ignore`` names ('max_steps' or 'cfg_max_steps'); a name that is no
    setting of either folder is a usage error."""
    out = set()
    for key in keys:
        col = key if key.startswith(SETTING_PREFIX) else SETTING_PREFIX + key
        if setting_name(col) not in SETTINGS and not any(col in f for f in (base, cand)):
            raise UsageError(f"--ignore {key}: not a setting (see lora-bench train --help for their names)")
        out.add(col)
    return out


def _setting_columns(base: pd.DataFrame, cand: pd.DataFrame, ignore: set[str] = frozenset()) -> list[str]:
    cols = sorted({c for f in (base, cand) for c in f.columns if c.startswith(SETTING_PREFIX)} - NOT_GROUPED - ignore)
    rest = [c for c in cols if c not in REPEAT_SETTINGS]
    filled = [_filled(f, cols) for f in (base, cand)]
    return rest if _seed_varies(filled, rest) else cols


def _filled(df: pd.DataFrame, cols: list[str]) -> pd.DataFrame:
    """``cols`` as compared text; a setting a folder's table lacks counts as its default."""
    return pd.DataFrame({c: df[c].map(_text) if c in df else _default_text(c) for c in cols}, index=df.index)


def compare(baseline: Path, candidate: Path, *, metric: str = DEFAULT_METRIC, threshold: float = stats.THRESHOLD,
            fail_above: float | None = None, ignore=(), allow_missing: bool = False, filters=()) -> Comparison:
    """Compare ``candidate`` with ``baseline`` setting by setting (see the module)."""
    base, cand = _done(baseline, "baseline", filters), _done(candidate, "candidate", filters)
    col = _metric(metric, base, cand)
    higher, speed = metric_sense(col)
    if fail_above is not None and higher is None:
        raise UsageError(f"--fail-above needs a metric where lower or higher is better; {col} has no direction")
    ignored = _ignored(ignore, base, cand)
    cols = _setting_columns(base, cand, ignored)
    both = pd.concat([f.assign(**_filled(f, cols), **{SIDE: side}) for side, f in zip(SIDES, (base, cand))],
                     ignore_index=True)
    found = group_runs(both, [*cols, SIDE], metrics=[col], baseline={SIDE: SIDES[0]}, ratio_metric=col,
                       threshold=threshold, lone_baseline=False, unknown=stats.UNCLEAR, equal=exact, sort=True)
    groups = {side: {tuple(g.values[c] for c in cols): g for g in found if g.values[SIDE] == side} for side in SIDES}
    all_keys = list(dict.fromkeys([*groups["baseline"], *groups["candidate"]]))
    shown = _shown_keys(cols, all_keys)
    rows = []
    for key in all_keys:
        if key not in groups["baseline"] or key not in groups["candidate"]:
            continue
        c = groups["candidate"][key]
        rows.append(Row(settings=_display(cols, key, shown), baseline=groups["baseline"][key].estimates[col],
                        candidate=c.estimates[col], ratio=c.ratio, verdict=c.verdict,
                        fails=fails_gate(c.ratio, metric=col, fail_above=fail_above)))
    rows.sort(key=lambda r: tuple(order_key(r.settings[k], col=_column(k)) for k in shown))
    only = {side: [_display(cols, k, shown) for k in all_keys if k in groups[side] and k not in groups[other]]
            for side, other in (SIDES, SIDES[::-1])}
    notes = refused_steps(both[RUN_DIR]) if RUN_DIR in both else []
    if ignored:
        notes.append("settings left out of the matching (--ignore): " + ", ".join(sorted(map(setting_name, ignored))))
    return Comparison(baseline_dir=str(baseline), candidate_dir=str(candidate), metric=col, threshold=threshold,
                      fail_above=fail_above, keys=shown, rows=rows, only=only,
                      environment=environment_differences(base, cand), notes=notes, allow_missing=allow_missing,
                      ignored=sorted(map(setting_name, ignored)))


def _metric(metric: str, base: pd.DataFrame, cand: pd.DataFrame) -> str:
    both = pd.concat([base, cand], ignore_index=True)
    col = resolve_column(both, metric, metric=True)
    if is_text(both, col):
        raise UsageError(f"--metric {metric}: a column of words, not numbers; compare a numeric metric "
                         f"such as {DEFAULT_METRIC}")
    for side, df in zip(SIDES, (base, cand)):
        if is_empty(df, col):
            raise UsageError(f"--metric {metric}: the {side}'s {why_empty(df, col)}")
    return col


def _shown_keys(cols: list[str], keys: list[tuple]) -> list[str]:
    """The settings whose values differ between the compared settings (execution modes by their
    name); the size and trainable layers where nothing differs."""
    varying = [c for i, c in enumerate(cols) if len({k[i] for k in keys}) > 1]
    shown = collapse_modes(varying)
    if not shown:
        shown = [c for c in (SETTING_PREFIX + "model_size", SETTING_PREFIX + "trainable_layers") if c in cols]
    return [MODE if c == MODE else setting_name(c) for c in shown]


def _column(shown: str) -> str:
    return MODE if shown == MODE else SETTING_PREFIX + shown


def _display(cols: list[str], key: tuple, shown: list[str]) -> dict[str, str]:
    values = dict(zip(cols, key))
    return {k: mode_name({c: v for c, v in values.items() if c in MODE_FIELDS}) if k == MODE
            else values.get(SETTING_PREFIX + k, "-") for k in shown}


def environment_differences(base: pd.DataFrame, cand: pd.DataFrame) -> list[str]:
    """'gpu_name: NVIDIA H200 (baseline) vs NVIDIA A100 (candidate)' for each environment column
    whose values differ between the two folders."""
    out = []
    for col in ENVIRONMENT:
        seen = [sorted({str(v) for v in df[col].dropna() if str(v) not in ("", "<NA>", "nan")}) if col in df else []
                for df in (base, cand)]
        if seen[0] != seen[1]:
            b, c = (", ".join(s) or "not recorded" for s in seen)
            out.append(f"{col}: {b} (baseline) vs {c} (candidate)")
    probes = [pd.to_numeric(df[HOST_SPEED], errors="coerce") if HOST_SPEED in df else pd.Series(dtype=float)
              for df in (base, cand)]
    probes = [p[(p > 0) & (p < float("inf"))] for p in probes]  # a blank, broken or infinite cell says nothing
    if all(len(p) for p in probes):
        b, c = (float(p.median()) for p in probes)
        if b > 0 and abs(c / b - 1) > HOST_SPEED_TOLERANCE:
            ratio = c / b
            change = f"{ratio - 1:+.0%}" if ratio < 100 else f"{ratio:.3g}×"
            out.append(f"{HOST_SPEED}: {_us(b)} µs (baseline) vs {_us(c)} µs (candidate), {change}: the hosts "
                       "run torch ops at different speeds, and a host-bound step follows them")
    return out


def _us(v: float) -> str:
    """A probe's median: two decimals, or three significant digits where those would run long."""
    return f"{v:.2f}" if 0.01 <= v < 1e6 else f"{v:.3g}"


def gate_text(c: Comparison) -> str:
    """What the gate says: which settings fail it, that the comparison is incomplete, or that it passed
    (and how many settings it judged)."""
    if c.fail_above is None:
        return ""
    higher, speed = metric_sense(c.metric)
    worse = stats.worse(higher_is_better=bool(higher), speed=speed)
    t = stats.threshold_text(c.fail_above)
    bound = f"upper end below 1 ÷ (1 + {t})" if higher else f"lower end above 1 + {t}"
    if not c.failed and c.problems:
        return "gate failed: " + "; ".join(c.problems)
    if not c.failed:
        unjudged = len(c.rows) - len(c.judged)
        rest = f"; {unjudged} with {stats.TOO_FEW} not judged" if unjudged else ""
        return (f"gate passed: no setting is {worse} by more than {t} with its interval's {bound} "
                f"({len(c.judged)} setting(s) judged{rest})")
    names = "; ".join(" · ".join(f"{k}={v}" for k, v in r.settings.items()) + f" ({r.ratio.value:.3f}×)"
                      for r in c.failed)
    return f"gate failed: {len(c.failed)} setting(s) {worse} by more than {t} with the interval's {bound}: {names}"
