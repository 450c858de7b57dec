"""Settings read from text: ``key=value`` overrides on the command line, and files of settings
(path settings resolved against the file's folder)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lora_bench.config.declaration import PATH_SETTINGS, SETTINGS
from lora_bench.config.setting_rules import Problem, problem, raw, render, unknown_key_problems, value_problems
from lora_bench.errors import ConfigError
from lora_bench.fileio import not_a_file
from lora_bench.safe_yaml import load_file
from lora_bench.safe_yaml import describe, parse_scalar


def parse_overrides(items: Iterable[str]) -> tuple[dict[str, Any], list[Problem]]:
    """``key=value`` command-line overrides: the values read as YAML reads a value (``4``, ``1e-5``,
    ``true``, ``null``); every malformed item or unknown key is a problem."""
    out: dict[str, Any] = {}
    problems: list[Problem] = []
    for item in items:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            problems.append(problem(None, "{item}: write overrides as key=value, e.g. lora_rank=16", item=item))
            continue
        if key not in SETTINGS:
            problems += unknown_key_problems([key])
            continue
        if key in out:
            problems.append(problem(key, "{setting} is overridden twice"))
            continue
        try:
            out[key] = parse_scalar(text)
        except ConfigError as e:
            why = e.problems[0].splitlines()[0].removesuffix(":")
            problems.append(problem(key, "{setting}={v}: {why}", v=text, why=raw(why)))
    return out, problems


def resolve_paths(settings: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """Path settings of a file, relative to the file's folder (``~`` expanded)."""
    out = dict(settings)
    for key in PATH_SETTINGS:
        value = out.get(key)
        if isinstance(value, str) and value:
            path = Path(value).expanduser()
            out[key] = str(path if path.is_absolute() else (folder / path).resolve())
    return out


def read_settings_file(path: Path) -> dict[str, Any]:
    """The settings of a YAML file holding one mapping of settings (the keys of a sweep file's
    ``base``), path settings resolved against the file's folder; ConfigError (naming the file)
    lists every unknown key and bad value."""
    path = Path(path)
    why = not_a_file(path)
    if why:
        raise ConfigError([why], source=str(path))
    data = load_file(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"a settings file is one mapping of settings (such as lora_rank: 16); this one holds "
                           f"{describe(data)}"], source=str(path))
    if isinstance(data.get("base"), dict) and not set(data) & set(SETTINGS):
        raise ConfigError(["this is a sweep file (it has base:); run it with `lora-bench sweep`, or give a file "
                           "of settings such as the contents of its base"], source=str(path))
    problems = unknown_key_problems(data)
    problems += [p for k, v in data.items() if k in SETTINGS for p in value_problems(k, v)]
    if problems:
        raise ConfigError(render(problems), source=str(path))
    return resolve_paths(data, path.parent)
