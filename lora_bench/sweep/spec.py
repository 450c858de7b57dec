"""Sweep files: parse a YAML sweep, report every problem of every run it expands to at once,
expand it into planned runs with deterministic ids, pick a shard, and list the plan
(``--dry-run``). Running the plan (resume, isolation, interrupts, progress) is
``lora_bench.sweep.runner``'s. The file's keys, repeats and seeds, the precedence of settings and
how run ids are made: docs/sweeps.md."""

from __future__ import annotations

import difflib
import hashlib
import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_bench.config import (
    DEFAULTS,
    NAME as KEY_NAME,
    PATH_SETTINGS,
    SETTINGS,
    TrainConfig,
    coerce,
    render,
    resolve_paths,
    rule_problems,
    unknown_key_problems,
    value_problems,
)
from lora_bench.errors import ConfigError, UsageError
from lora_bench.escaping import markup, terminal
from lora_bench.fileio import not_a_file
from lora_bench.results.runs_csv import same_number, text_value
from lora_bench.safe_yaml import load as load_yaml
from lora_bench.safe_yaml import read_file
from lora_bench.safe_yaml import parse_scalar, short_repr
from lora_bench.sweep.machine import machine_problems
from lora_bench.sweep.plan_time import plan_estimate
from lora_bench.train.identity import make_run_id, settings_hash

SWEEP_KEYS = ("name", "base", "grid", "runs", "repeats", "vary_seed", "pack")
ID_AS_DECLARED = (*PATH_SETTINGS, "device")  # hashed as the file writes them (docs/sweeps.md#run-ids)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_RUNS = 100_000


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: its id, repeat index, label, what sets it apart, and its settings."""

    index: int
    run_id: str
    repeat: int
    label: str
    point: dict  # the grid / runs values of this run (what differs from base)
    cfg: TrainConfig  # effective settings: paths resolved, overrides applied, the repeat's seed

    def describe(self) -> str:
        """The run's label and what sets it apart (``best: model_size=124M, lora_scaling=rslora``):
        runs of one label differ in their settings, which a plan and a progress line must show."""
        if self.label and self.point:
            return f"{self.label}: {_describe(self.point)}"
        return self.label or _describe(self.point)


@dataclass(frozen=True)
class Sweep:
    name: str
    path: Path
    sha256: str
    repeats: int
    runs: tuple[PlannedRun, ...]
    vary_seed: bool = False
    pack: int = 1  # runs trained at once on one model, at most (lora_bench.sweep.packs)

    def provenance(self, run: PlannedRun) -> dict:
        """Extra result columns that tie a run to the file it came from."""
        return {"sweep_name": self.name, "sweep_file": self.path.as_posix(), "sweep_sha256": self.sha256,
                "sweep_label": run.label or None, "repeat": run.repeat}


@dataclass(frozen=True)
class _Layout:
    """A sweep file's structure, every value checked on its own."""

    name: str
    base: dict
    grid: dict[str, list]
    runs: list[tuple[str, dict]]
    repeats: int
    vary_seed: bool
    pack: int = 1


# -- loading and validation ----------------------------------------------------------------------
def load_sweep(path: Path, *, overrides: dict[str, Any] | None = None) -> Sweep:
    """Parse, validate and expand a sweep file; ConfigError lists every problem found.
    ``overrides`` (settings, already resolved paths) apply to every run."""
    path = Path(path)
    why = not_a_file(path)
    if why:
        raise UsageError(f"sweep file not found: {path}" if why == "no such file" else f"sweep file {path}: {why}")
    raw = read_file(path)
    data = load_yaml(raw, source=str(path))

    problems: list[str] = []
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    problems += [f"override: {p.render()}" for p in unknown_key_problems(overrides)]
    overrides = _checked(overrides, "override", problems)
    layout = _structure(data, problems)
    size = _count(layout)
    if size > MAX_RUNS:
        problems.append(f"the sweep expands to {size:,} runs ({_count_text(layout)}); at most {MAX_RUNS:,} are "
                        "allowed: split it into several files or lower repeats")
        raise ConfigError(problems, source=str(path))
    checked_alone = not problems  # with bad values dropped above, runs may look alike: no duplicate check
    points = _points(layout.grid, layout.runs, problems)
    planned: list[tuple[str, dict, TrainConfig, TrainConfig, str]] = []
    by_message: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    # Every value of base, grid, runs and the overrides is checked on its own above; each run asks
    # only the rules between its settings, with the values coerced once.
    base = {**DEFAULTS, **_coerced(resolve_paths(layout.base, path.parent))}
    forced = _coerced(overrides)
    for label, point, desc in points:
        values = {**base, **_coerced(resolve_paths(point, path.parent)), **forced}
        errs = render(rule_problems(values))
        for msg in errs:
            by_message.setdefault(msg, []).append(desc)
        if errs:
            continue
        cfg = TrainConfig(**values)
        # the id is the file's own settings: a --data-file or --device override leaves it alone
        declared = {k: coerce(k, point.get(k, layout.base.get(k, DEFAULTS[k]))) for k in ID_AS_DECLARED}
        id_cfg = cfg if all(values[k] == v for k, v in declared.items()) else TrainConfig(**{**values, **declared})
        key = settings_hash(id_cfg)
        if checked_alone and key in seen:
            problems.append(f"{desc} has the same settings as {seen[key]} (they would share run ids); "
                            "remove one or give it a setting that differs")
            continue
        seen[key] = desc
        planned.append((label, point, cfg, id_cfg, key))
    problems += [_group_message(msg, descs, len(points)) for msg, descs in by_message.items()]
    runs_out = [] if problems else _expand(planned, layout, problems)
    if problems:
        raise ConfigError(problems, source=str(path))
    return Sweep(name=layout.name, path=path, sha256=hashlib.sha256(raw).hexdigest(), repeats=layout.repeats,
                 runs=tuple(runs_out), vary_seed=layout.vary_seed, pack=layout.pack)


def _coerced(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: coerce(k, v) for k, v in settings.items()}


def _expand(planned: list[tuple[str, dict, TrainConfig, TrainConfig, str]], layout: _Layout,
            problems: list[str]) -> list[PlannedRun]:
    """Every repeat of every planned run (repeat-major), with the repeat's seed when it varies."""
    out: list[PlannedRun] = []
    ids: dict[str, str] = {}
    for repeat in range(layout.repeats):
        for label, point, cfg, id_cfg, key in planned:
            if layout.vary_seed and repeat:
                seed = cfg.seed + repeat
                bad = value_problems("seed", seed)
                if bad:
                    problems.append(f"vary_seed: repeat {repeat} of {label or _describe(point)}: {bad[0].render()}")
                    return []
                cfg, id_cfg = cfg.replace(seed=seed), id_cfg.replace(seed=seed)
                key = settings_hash(id_cfg)
            run_id = make_run_id(id_cfg, repeat=repeat, settings_key=key)
            if layout.vary_seed:  # seed + r of one run can be another run's seed
                where = f"{label or _describe(point)} (repeat {repeat}, seed {cfg.seed})"
                if key in ids:
                    problems.append(f"vary_seed: {where} has the same settings as {ids[key]}; "
                                    "space the runs' seeds at least `repeats` apart")
                    return []
                ids[key] = where
            out.append(PlannedRun(index=len(out), run_id=run_id, repeat=repeat, label=label, point=point, cfg=cfg))
    return out


def validate_files(paths: list[Path], *, console, machine: bool = False) -> list[Sweep]:
    """Check every file and print what each expands to; with ``machine``, also its runs on this
    machine as the sweep does (``sweep.machine``) and how long they would take here
    (``sweep.plan_time``). UsageError at the end if any had problems."""
    sweeps, bad = [], 0
    for path in paths:
        try:
            sw = load_sweep(path)
        except UsageError as e:  # ConfigError (every problem) or a missing file
            bad += 1
            console.print(f"[red]✗[/red] {markup(e, newlines=True)}", highlight=False)
            continue
        problems = machine_problems(list(sw.runs)) if machine else []
        if problems:
            bad += 1
            console.print(f"[red]✗[/red] {markup(path)}: on this machine, "
                          + markup("\n".join(["the sweep would refuse:", *(f"  - {p}" for p in problems)]),
                                   newlines=True), highlight=False)
            continue
        sweeps.append(sw)
        seeds = ", seed + repeat" if sw.vary_seed and sw.repeats > 1 else ""
        console.print(f"[green]✓[/green] {markup(path)}: sweep {sw.name!r}, {len(sw.runs)} runs "
                      f"({len(sw.runs) // sw.repeats} settings × {sw.repeats} repeats{seeds})", highlight=False)
        for line in plan_estimate(list(sw.runs), process_each=True) if machine else []:
            console.print(f"  {markup(line)}", highlight=False)
    if bad:
        raise UsageError(f"{bad} of {len(paths)} sweep file(s) have problems (listed above)")
    return sweeps


def _structure(data: Any, problems: list[str]) -> _Layout:
    if not isinstance(data, dict):
        problems.append("a sweep file is a mapping with keys: " + ", ".join(SWEEP_KEYS))
        return _Layout("", {}, {}, [], 1, False)
    not_names = 0
    for key in data:
        if key in SWEEP_KEYS:
            continue
        if key in SETTINGS:
            problems.append(f"{key!r} is a run setting: put it under base: (or grid: / runs:)")
        elif not (isinstance(key, str) and KEY_NAME.fullmatch(key)):
            not_names += 1  # a line of a file given here by mistake: counted, not quoted
        else:
            close = difflib.get_close_matches(key, SWEEP_KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"unknown top-level key {short_repr(key)}; {hint}allowed: {', '.join(SWEEP_KEYS)}")
    if not_names:
        problems.append(f"{not_names} top-level key(s) that are not names (not shown): is this a sweep file? "
                        f"Its keys are {', '.join(SWEEP_KEYS)}")
    name = data.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name) or len(name) > 100:
        problems.append(f"name={short_repr(name)}: give the sweep a name of letters, digits, '.', '_' or '-' "
                        "(it names the results folder)")
    base = _settings(data.get("base"), "base", problems)
    grid = _grid(data.get("grid"), problems)
    runs = _runs(data.get("runs"), problems)
    repeats = data.get("repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        problems.append(f"repeats={short_repr(repeats)} must be a whole number of at least 1")
        repeats = 1
    vary_seed = data.get("vary_seed", False)
    if not isinstance(vary_seed, bool):
        problems.append(f"vary_seed={short_repr(vary_seed)} must be true or false")
        vary_seed = False
    pack = data.get("pack", 1)
    bad_pack = pack_size_problem(pack)
    if bad_pack:
        problems.append(f"pack={short_repr(pack)}: {bad_pack}")
        pack = 1
    return _Layout(str(name), base, grid, runs, repeats, vary_seed, pack)


MAX_PACK = 1024


def pack_size_problem(pack: object) -> str | None:
    """What is wrong with a pack size (the sweep key or --pack), or None."""
    if isinstance(pack, bool) or not isinstance(pack, int) or not 1 <= pack <= MAX_PACK:
        return (f"the most runs to train at once on one model must be a whole number from 1 (no packing) "
                f"to {MAX_PACK}")
    return None


def _checked(mapping: dict, where: str, problems: list[str]) -> dict:
    """The settings of ``mapping`` whose values are valid on their own; the others' problems are
    added to ``problems``, prefixed with ``where``."""
    out = {}
    for key, value in mapping.items():
        if key not in SETTINGS:
            continue
        bad = value_problems(key, value)
        problems += [f"{where}: {p.render()}" for p in bad]
        if not bad:
            out[key] = value
    return out


def _settings(mapping: Any, where: str, problems: list[str]) -> dict:
    """The valid settings of one mapping; every bad key or value is added to ``problems``."""
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        problems.append(f"{where} must be a mapping of settings, got {short_repr(mapping)}")
        return {}
    problems += [f"{where}: {p.render()}" for p in unknown_key_problems(mapping)]
    return _checked(mapping, where, problems)


def _grid(grid: Any, problems: list[str]) -> dict[str, list]:
    if grid is None:
        return {}
    if not isinstance(grid, dict):
        problems.append(f"grid must map settings to lists of values, got {short_repr(grid)}")
        return {}
    problems += [f"grid: {p.render()}" for p in unknown_key_problems(grid)]
    out = {}
    for key, values in grid.items():
        if key not in SETTINGS:
            continue
        if not isinstance(values, list) or not values:
            problems.append(f"grid.{key} must be a non-empty list of values, got {short_repr(values)} "
                            "(a single value belongs in base)")
            continue
        good: list = []
        listed: set = set()  # (type, value): 1 and 1.0 and True are different values here
        for v in values:
            bad = value_problems(key, v)
            problems += [f"grid: {p.render()}" for p in bad]
            if bad:
                continue
            if (type(v), v) in listed:  # a scalar (checked above), so hashable
                problems.append(f"grid.{key} lists {short_repr(v)} twice")
                continue
            listed.add((type(v), v))
            good.append(v)
        if good:
            out[key] = good
    return out


def _runs(runs: Any, problems: list[str]) -> list[tuple[str, dict]]:
    if runs is None:
        return []
    if not isinstance(runs, list) or not runs:
        problems.append(f"runs must be a non-empty list of setting mappings, got {short_repr(runs)}")
        return []
    out = []
    for i, entry in enumerate(runs):
        entry = dict(entry) if isinstance(entry, dict) else entry
        label = entry.pop("label", "") if isinstance(entry, dict) else ""
        if not isinstance(label, str) or len(label) > 200:
            problems.append(f"runs[{i}].label must be text of up to 200 characters, got {short_repr(label)}")
            label = ""
        elif terminal(label) != label:  # a label names a run on screens and in tables: printable text only
            problems.append(f"runs[{i}].label {short_repr(label)} holds a control character; a label is "
                            "printable text")
            label = ""
        out.append((label, _settings(entry, f"runs[{i}]" + (f" ({label})" if label else ""), problems)))
    return out


def _count(layout: _Layout) -> int:
    """How many runs the sweep expands to, without expanding it."""
    return math.prod(len(v) for v in layout.grid.values()) * max(1, len(layout.runs)) * layout.repeats


def _count_text(layout: _Layout) -> str:
    parts = [f"grid {' × '.join(str(len(v)) for v in layout.grid.values())}"] if layout.grid else []
    parts += [f"{len(layout.runs)} runs entries"] if layout.runs else []
    return " × ".join(parts + [f"{layout.repeats:,} repeats"])


def _points(grid: dict[str, list], runs: list[tuple[str, dict]],
            problems: list[str]) -> list[tuple[str, dict, str]]:
    """(label, settings, description) of each point: explicit runs (outer) × the grid's cartesian
    product (inner, last key fastest)."""
    grid_points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    if not runs:
        return [("", g, _describe(g)) for g in grid_points]
    out = []
    for i, (label, run) in enumerate(runs):
        clash = sorted(set(run) & set(grid))
        if clash:
            problems.append(f"runs[{i}] sets {', '.join(clash)}, which grid also varies; keep it in one place")
        name = label or f"runs[{i}]"
        out += [(label, {**g, **run}, f"{name} ({_describe(g)})" if g else name) for g in grid_points]
    return out


def _describe(point: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items()) or "base settings"


def _group_message(msg: str, descs: list[str], total: int) -> str:
    """One line per distinct problem, naming the runs it affects (not one line per run)."""
    if total > 1 and len(descs) == total:
        return f"all {total} runs: {msg}"
    if len(descs) == 1:
        return f"run ({descs[0]}): {msg}"
    shown = "; ".join(descs[:3]) + (f"; and {len(descs) - 3} more" if len(descs) > 3 else "")
    return f"{len(descs)} runs ({shown}): {msg}"


# -- filters -------------------------------------------------------------------------------------
def parse_only(items: list[str] | tuple[str, ...] | None) -> dict[str, list[str]]:
    """``--only KEY=VALUE`` items: KEY a setting (as in a sweep file) or ``label``, VALUE read as
    YAML reads a value and kept as runs.csv writes it. Repeating a key allows more values (any of
    them); different keys must all hold."""
    out: dict[str, list[str]] = {}
    for item in items or ():
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise UsageError(f"--only {item!r}: write it as KEY=VALUE, e.g. --only model_size=124M")
        if key != "label" and key not in SETTINGS:
            close = difflib.get_close_matches(key, [*SETTINGS, "label"], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UsageError(f"--only {item!r}: {key!r} is not a setting{hint}; use a setting's name "
                             "(lora-bench train --help lists them) or label")
        value = text.strip()
        if key != "label":
            try:
                value = text_value(parse_scalar(value))
            except ConfigError as e:
                raise UsageError(f"--only {item!r}: {e.problems[0].splitlines()[0]}") from None
        out.setdefault(key, []).append(value)
    return out


def _holds(run: PlannedRun, key: str, values: list[str]) -> bool:
    got = run.label if key == "label" else text_value(getattr(run.cfg, key))
    return any(got == v or same_number(got, v) for v in values)


def select_only(runs: list[PlannedRun], only: dict[str, list[str]]) -> list[PlannedRun]:
    """The runs that hold every ``--only`` key at one of its values, in the plan's order. A filter
    that keeps no run is a usage error naming the values the runs hold, so a typo is not a sweep
    that silently does nothing."""
    if not only:
        return list(runs)
    kept = [r for r in runs if all(_holds(r, k, v) for k, v in only.items())]
    if not kept:
        held = {k: sorted({r.label if k == "label" else text_value(getattr(r.cfg, k)) for r in runs}) for k in only}
        shown = "; ".join(f"{k}: {', '.join(v) or '(none)'}" for k, v in held.items())
        wanted = " ".join(f"--only {k}={v}" for k, vs in only.items() for v in vs)
        raise UsageError(f"{wanted} keeps none of the {len(runs)} runs selected; they hold {shown}")
    return kept


# -- shards --------------------------------------------------------------------------------------
def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``I/N`` with 1 <= I <= N (1-based, as a person counts shards)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not (1 <= int(m.group(1)) <= int(m.group(2))):
        raise UsageError(f"--shard {text!r} is not allowed; use I/N with 1 <= I <= N, e.g. 1/4 … 4/4")
    return int(m.group(1)), int(m.group(2))


def select_shard(runs: tuple[PlannedRun, ...] | list[PlannedRun], shard: tuple[int, int] | None) -> list[PlannedRun]:
    """Shard I of N is the I-th contiguous block of the expanded order (sizes differ by at most one
    run): disjoint and covering for any N. Contiguous, not round-robin, because the grid's last key
    varies fastest: runs that differ only in it (put the compared axis last, as in
    all-vs-lora.yaml) stay on one shard and so are compared on one device; round-robin would send
    every 'all' run to one GPU and every 'lora' run to another."""
    if shard is None:
        return list(runs)
    i, n = shard
    lo, hi = (i - 1) * len(runs) // n, i * len(runs) // n
    return [r for r in runs if lo <= r.index < hi]
