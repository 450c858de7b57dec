"""Sweep files: parse a YAML sweep (``name``, ``base``, ``grid``, ``runs``, ``repeats``), report
every problem of every run it expands to at once, expand it into planned runs with
deterministic ids, pick a shard, and list the plan (``--dry-run``). Running the plan (resume,
isolation, interrupts, progress) lives in ``worker``.

Precedence of settings: defaults < ``base`` < the ``grid`` point < the explicit ``runs`` entry <
CLI overrides (``--device``, ``--data-file``). Relative ``data_file`` / ``weights_dir`` values are
resolved against the YAML file's folder, so a sweep file can point at data shipped beside it.
Run ids hash the settings *as the file declares them* (before CLI overrides and path resolution):
the same sweep run on two machines with different data paths or devices yields the same ids, so
their results merge by run id."""

from __future__ import annotations

import difflib
import hashlib
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lora_bench.config import TrainConfig, model_shape_problems, type_problems, unknown_key_problems
from lora_bench.errors import ConfigError, UsageError
from lora_bench.train.run import make_run_id, settings_hash

SWEEP_KEYS = ("name", "base", "grid", "runs", "repeats")
PATH_SETTINGS = ("data_file", "weights_dir")  # resolved against the YAML file's folder
OVERRIDABLE = ("device", "data_file")  # CLI overrides: environment-specific, may differ per machine
ID_AS_DECLARED = (*PATH_SETTINGS, "device")  # hashed as the file writes them (see module docstring)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: its id, repeat index, label, what sets it apart, and its settings."""

    index: int
    run_id: str
    repeat: int
    label: str
    point: dict  # the grid / runs values of this run (what differs from base)
    cfg: TrainConfig  # effective settings: paths resolved, CLI overrides applied

    def describe(self) -> str:
        return self.label or _describe(self.point)


@dataclass(frozen=True)
class Sweep:
    name: str
    path: Path
    sha256: str
    repeats: int
    runs: tuple[PlannedRun, ...]

    def provenance(self, run: PlannedRun) -> dict:
        """Extra result columns that tie a run to the file it came from."""
        return {"sweep_name": self.name, "sweep_file": self.path.as_posix(), "sweep_sha256": self.sha256,
                "sweep_label": run.label or None, "repeat": run.repeat}


# -- loading and validation ----------------------------------------------------------------------
def load_sweep(path: Path, *, overrides: dict[str, Any] | None = None) -> Sweep:
    """Parse, validate and expand a sweep file; ConfigError lists every problem found."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"sweep file not found: {path}")
    raw = path.read_bytes()
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError([f"not valid YAML: {e}"], source=str(path)) from None

    problems: list[str] = []
    name, base, grid, runs, repeats = _structure(data, problems)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if set(overrides) - set(OVERRIDABLE):
        raise UsageError(f"only {', '.join(OVERRIDABLE)} can be overridden, not {sorted(set(overrides))}")
    points = _points(grid, runs, problems)
    planned: list[tuple[str, dict, TrainConfig, TrainConfig]] = []
    by_message: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    for label, point, desc in points:
        declared = {**base, **point}
        effective = {**_resolve_paths(declared, path.parent), **overrides}
        cfg, errs = None, []
        try:
            cfg = TrainConfig.from_mapping(effective)
        except ConfigError as e:
            extra = _combination_problems({**TrainConfig().to_dict(), **effective})
            errs = e.problems + [m for m in extra if m not in e.problems]
        for msg in errs:
            by_message.setdefault(msg, []).append(desc)
        if cfg is None or errs:
            continue
        # the id is the file's own settings: a --data-file or --device override leaves it alone
        id_cfg = cfg.replace(**{k: declared.get(k, getattr(TrainConfig(), k)) for k in ID_AS_DECLARED})
        key = settings_hash(id_cfg)
        if key in seen:
            problems.append(f"{desc} has the same settings as {seen[key]} (they would share run ids); "
                            "remove one or give it a setting that differs")
            continue
        seen[key] = desc
        planned.append((label, point, cfg, id_cfg))
    problems += [_group_message(msg, descs, len(points)) for msg, descs in by_message.items()]
    if problems:
        raise ConfigError(problems, source=str(path))
    runs_out = []
    for repeat in range(repeats):  # repeat-major: drift over a long sweep spreads over every setting
        for label, point, cfg, id_cfg in planned:
            runs_out.append(PlannedRun(index=len(runs_out), run_id=make_run_id(id_cfg, repeat=repeat),
                                       repeat=repeat, label=label, point=point, cfg=cfg))
    return Sweep(name=name, path=path, sha256=hashlib.sha256(raw).hexdigest(), repeats=repeats,
                 runs=tuple(runs_out))


def validate_files(paths: list[Path], *, console) -> list[Sweep]:
    """Check every file and print what each expands to; UsageError at the end if any had problems."""
    sweeps, bad = [], 0
    for path in paths:
        try:
            sw = load_sweep(path)
        except UsageError as e:  # ConfigError (every problem) or a missing file
            bad += 1
            console.print(f"[red]✗[/red] {e}", highlight=False)
            continue
        sweeps.append(sw)
        console.print(f"[green]✓[/green] {path}: sweep {sw.name!r}, {len(sw.runs)} runs "
                      f"({len(sw.runs) // sw.repeats} settings × {sw.repeats} repeats)", highlight=False)
    if bad:
        raise UsageError(f"{bad} of {len(paths)} sweep file(s) have problems (listed above)")
    return sweeps


def _structure(data: Any, problems: list[str]) -> tuple[str, dict, dict, list, int]:
    if not isinstance(data, dict):
        problems.append("a sweep file is a mapping with keys: " + ", ".join(SWEEP_KEYS))
        return "", {}, {}, [], 1
    fields = TrainConfig.field_names()
    for key in data:
        if key in SWEEP_KEYS:
            continue
        if key in fields:
            problems.append(f"{key!r} is a run setting: put it under base: (or grid: / runs:)")
        else:
            close = difflib.get_close_matches(str(key), SWEEP_KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"unknown top-level key {key!r}; {hint}allowed: {', '.join(SWEEP_KEYS)}")
    name = data.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        problems.append(f"name={name!r}: give the sweep a name of letters, digits, '.', '_' or '-' "
                        "(it names the results folder)")
    base = _settings(data.get("base"), "base", problems)
    grid = _grid(data.get("grid"), problems)
    runs = _runs(data.get("runs"), problems)
    repeats = data.get("repeats", 1)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        problems.append(f"repeats={repeats!r} must be a whole number of at least 1")
        repeats = 1
    return str(name), base, grid, runs, repeats


def _settings(mapping: Any, where: str, problems: list[str]) -> dict:
    """The valid settings of one mapping; every bad key or value is added to ``problems``."""
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        problems.append(f"{where} must be a mapping of settings, got {mapping!r}")
        return {}
    known = {k: v for k, v in mapping.items() if k in TrainConfig.field_names()}
    problems += [f"{where}: {p}" for p in unknown_key_problems(mapping)]
    bad = type_problems(known)
    problems += [f"{where}: {p}" for p in bad]
    return {k: v for k, v in known.items() if not type_problems({k: v})}


def _grid(grid: Any, problems: list[str]) -> dict[str, list]:
    if grid is None:
        return {}
    if not isinstance(grid, dict):
        problems.append(f"grid must map settings to lists of values, got {grid!r}")
        return {}
    problems += [f"grid: {p}" for p in unknown_key_problems(grid)]
    out = {}
    for key, values in grid.items():
        if key not in TrainConfig.field_names():
            continue
        if not isinstance(values, list) or not values:
            problems.append(f"grid.{key} must be a non-empty list of values, got {values!r} "
                            "(a single value belongs in base)")
            continue
        if len({repr(v) for v in values}) != len(values):
            problems.append(f"grid.{key} lists a value twice: {values!r}")
        good = []
        for v in values:
            bad = type_problems({key: v})
            problems += [f"grid: {p}" for p in bad]
            if not bad and v not in good:
                good.append(v)
        if good:
            out[key] = good
    return out


def _runs(runs: Any, problems: list[str]) -> list[tuple[str, dict]]:
    if runs is None:
        return []
    if not isinstance(runs, list) or not runs:
        problems.append(f"runs must be a non-empty list of setting mappings, got {runs!r}")
        return []
    out = []
    for i, entry in enumerate(runs):
        entry = dict(entry) if isinstance(entry, dict) else entry
        label = entry.pop("label", "") if isinstance(entry, dict) else ""
        if not isinstance(label, str):
            problems.append(f"runs[{i}].label must be text, got {label!r}")
            label = ""
        out.append((label, _settings(entry, f"runs[{i}]" + (f" ({label})" if label else ""), problems)))
    return out


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


def _resolve_paths(settings: dict, folder: Path) -> dict:
    out = dict(settings)
    for key in PATH_SETTINGS:
        value = out.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            out[key] = str((folder / value).resolve())
        elif isinstance(value, str) and value:
            out[key] = str(Path(value).expanduser())
    return out


def _combination_problems(s: dict) -> list[str]:
    """The model-shape problems of a run whose settings did not all type-check (so no TrainConfig
    could be built to report them), found next to its other problems."""
    if any(s[k] is not None and (not isinstance(s[k], int) or s[k] < 1) for k in ("emb_dim", "n_layers", "n_heads")):
        return []  # reported by the type / range checks
    try:
        return model_shape_problems(s)
    except (TypeError, AttributeError):  # a mistyped model_size / weights: reported by the type checks
        return []


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
