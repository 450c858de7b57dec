"""A run's identity: its id (deterministic for sweeps, time-stamped for one-off runs) and the check
that it can name a folder inside a results folder (lora_bench.train.recording refuses an id
already recorded there)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re

from lora_bench.config import TrainConfig
from lora_bench.config.recorded import former_defaults
from lora_bench.errors import UsageError
from lora_bench.train.recording import LOCK_SUFFIX, RESERVED_IDS, RESULTS_FILES

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
NAME_MAX = 255  # bytes in one file name on Linux's and macOS's file systems (ext4, XFS, Btrfs, APFS, tmpfs)


def settings_hash(cfg: TrainConfig) -> str:
    """Hash of the settings that differ from their defaults: a setting added to lora-bench later
    (with a default that keeps the behaviour) leaves existing run ids, and so a sweep's resume,
    intact; a hash over every field would rerun whole sweeps for each new option. A setting whose
    default changed is hashed against its former default where it applies
    (:mod:`lora_bench.config.recorded`)."""
    values = cfg.to_dict()
    defaults = {**TrainConfig().to_dict(), **former_defaults(values.get)}
    changed = {k: v for k, v in values.items() if v != defaults[k]}
    return hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:10]


def make_run_id(cfg: TrainConfig, *, repeat: int | None = None, settings_key: str | None = None) -> str:
    """Deterministic for sweeps (settings hash + repeat); time-stamped for one-off runs.
    ``settings_key``: ``settings_hash(cfg)``, where the caller has it already."""
    slug = f"{cfg.model_size}-{cfg.trainable_layers}".replace(" ", "").replace("(", "").replace(")", "")
    if cfg.implementation != "book":
        slug += f"-{cfg.implementation}"
    base = f"{slug}-{settings_key or settings_hash(cfg)}"
    if repeat is not None:
        return f"{base}-r{repeat}"
    return f"{base}-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%S%f')}"


def check_run_id(run_id: str) -> None:
    """UsageError unless ``run_id`` can name the run's folder inside a results folder."""
    if not RUN_ID_RE.match(run_id):
        raise UsageError(f"run id {run_id!r}: use letters, digits, '.', '_' and '-', starting with a letter or "
                         "digit (it names a folder inside the results folder)")
    if len(run_id.encode()) > NAME_MAX:
        raise UsageError(f"run id {run_id[:40]}…: {len(run_id.encode())} characters, more than the {NAME_MAX} a "
                         "file name may have (it names a folder inside the results folder); choose a shorter one")
    if run_id.lower() in RESERVED_IDS:  # in any case: macOS's and Windows' file systems ignore it
        raise UsageError(f"run id {run_id!r} is reserved: a results folder keeps its own files under the names "
                         f"{', '.join(RESULTS_FILES)} and each with {LOCK_SUFFIX} (in any case); choose another "
                         "--run-id")
