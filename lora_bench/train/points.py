"""The points of a run, checked before any work: each point's settings as this process runs them
(a data-parallel rank's, ``setup.rank_settings``) and validated, several points able to train as
one pack (``pack.pack_problem``), the optional packages they need installed, their run ids
distinct and able to name a folder (a time-stamped id where none is given), and a writable cache
folder. Every problem is a UsageError, raised before anything is recorded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lora_bench.config import TrainConfig
from lora_bench.errors import UsageError
from lora_bench.fileio import check_writable_dir
from lora_bench.model.checkpoints import default_cache_dir
from lora_bench.train.distributed import RankEnv
from lora_bench.train.identity import check_run_id, make_run_id
from lora_bench.train.pack import pack_columns, pack_problem
from lora_bench.train.setup import rank_settings


@dataclass(frozen=True)
class Point:
    """One point of a run: its settings, id (None: a time-stamped one) and extra row columns (a
    sweep's provenance)."""

    cfg: TrainConfig
    run_id: str | None = None
    extra: dict = field(default_factory=dict)


def checked_points(points: list[Point], env: RankEnv | None) -> list[Point]:
    """The points as this process runs them, each with its settings validated and its run id."""
    cfgs = [rank_settings(p.cfg, env).validate() for p in points]
    if len(cfgs) > 1:
        why = pack_problem(cfgs)
        if why:
            raise UsageError(f"these runs cannot train as one pack: {why}")
    points = [Point(cfg, p.run_id or make_run_id(cfg), p.extra) for p, cfg in zip(points, cfgs)]
    ids = [p.run_id for p in points]
    if len(set(ids)) != len(ids):
        raise UsageError(f"a pack holds run ids more than once: {', '.join(ids)}")
    for run_id in ids:
        check_run_id(run_id)
    return points


def checked_cache_dir(cache_dir: Path | None) -> Path:
    """The cache folder (``None``: the default one), which must take files."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    why = check_writable_dir(cache_dir)
    if why:
        raise UsageError(f"cache folder {cache_dir}: {why}; pass a writable --cache-dir")
    return cache_dir


def points_pack_columns(points: list[Point]) -> dict:
    """The pack columns every row of these points carries: the pack's size and id (none for one point)."""
    return pack_columns([p.run_id for p in points])
