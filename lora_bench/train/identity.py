"""A run's identity: its id (deterministic for sweeps, time-stamped for one-off runs), the check
that it can name a folder, and the refusal of an id already recorded in a results folder."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from pathlib import Path

from lora_bench.config import TrainConfig
from lora_bench.errors import UsageError
from lora_bench.results.index import INDEX
from lora_bench.results.manifest import MANIFEST
from lora_bench.results.prune import SUPERSEDED
from lora_bench.results.records import copied_record, run_record
from lora_bench.results.store import LOCK_SUFFIX, RUNS_CSV, TORN_CSV, read_run_table

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
NAME_MAX = 255  # bytes in one file name on Linux's and macOS's file systems (ext4, XFS, Btrfs, APFS, tmpfs)
# What a results folder holds beside its run folders: a run id naming one would turn it into a folder
RESULTS_FILES = (RUNS_CSV, TORN_CSV, MANIFEST, SUPERSEDED, INDEX)
RESERVED_IDS = frozenset(n.lower() for name in RESULTS_FILES for n in (name, name + LOCK_SUFFIX))


def settings_hash(cfg: TrainConfig) -> str:
    """Hash of the settings that differ from their defaults: a setting added to lora-bench later
    (with a default that keeps the behaviour) leaves existing run ids, and so a sweep's resume,
    intact; a hash over every field would rerun whole sweeps for each new option."""
    defaults = TrainConfig().to_dict()
    changed = {k: v for k, v in cfg.to_dict().items() if v != defaults[k]}
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


def existing_run(results_dir: Path, run_id: str) -> dict | None:
    """The recorded row of ``run_id`` in this results folder (run.json, else runs.csv), if any."""
    row = run_record(results_dir / run_id)
    if row is not None:
        return row
    copy_of = copied_record(results_dir / run_id)
    if copy_of is not None:  # a copied folder (X.bak): replacing its record would lose the copy
        return {"run_id": run_id, "status": f"a copy of run {copy_of!r}'s record is in its folder"}
    csv = results_dir / "runs.csv"
    if csv.is_file():
        table = read_run_table(csv)
        for r in table.rows:
            if r.get("run_id") == run_id:
                return r
        if run_id in table.torn_ids():
            return {"run_id": run_id, "status": "unknown (its runs.csv row is cut mid-way)"}
    return None


def refuse_existing_run(results_dir: Path, run_id: str) -> None:
    """UsageError when ``run_id`` is already recorded in ``results_dir``: ids are never reused silently."""
    old = existing_run(results_dir, run_id)
    if old is not None:
        raise UsageError(f"run id {run_id!r} already exists in {results_dir} (status {old.get('status')}, "
                         f"started {old.get('started_at') or '?'}); choose another --run-id, or pass "
                         "--overwrite to replace it")
