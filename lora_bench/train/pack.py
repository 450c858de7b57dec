"""A pack: up to N LoRA runs trained at once in one process on one frozen base model (see
docs/packing.md), executed as any run is (lora_bench.train.run, with one point per run). The runs'
settings agree on everything but their adapter's own (``config.ADAPTER_SETTINGS``); each run keeps
its own head, adapters, loss term and optimizer learning rate and weight decay
(``train.packed_adamw``), and is recorded as its own run with the pack's size and id beside it.

A packed point trains as its solo run does: the same batches in the same order (the loop iterates
the loaders as the solo loop does, from the same seed), the same initial head and adapters (drawn
as the solo run draws them, lora_bench.classifier.packed_classifier), the same losses up to the rounding
order of the batched products."""

from __future__ import annotations

import hashlib

from lora_bench.config import TrainConfig, pack_key, repeat_problem, solo_reason


def pack_problem(cfgs: list[TrainConfig]) -> str | None:
    """Why these runs cannot train as one pack (None: they can)."""
    if not cfgs:
        return "a pack needs at least one run"
    for i, cfg in enumerate(cfgs):
        why = solo_reason(cfg)
        if why:
            return f"run {i + 1} of the pack: {why}"
    key = pack_key(cfgs[0])
    for i, cfg in enumerate(cfgs[1:], start=2):
        if pack_key(cfg) != key:
            differ = sorted(k for (k, v), (_, w) in zip(key, pack_key(cfg)) if v != w)
            return (f"run {i} of the pack differs from run 1 in {', '.join(differ)}: only the adapter's settings "
                    "may differ within a pack")
    return repeat_problem(cfgs)


def pack_id_of(run_ids: list[str]) -> str:
    """The pack's id: a hash of its runs' ids, in order (a resumed sweep's new pack gets its own)."""
    return "pack-" + hashlib.sha256("\n".join(run_ids).encode()).hexdigest()[:12]


def pack_columns(run_ids: list[str]) -> dict:
    """The row columns of each run of a pack of these runs: its size and id (none for one run)."""
    return {"pack_size": len(run_ids), "pack_id": pack_id_of(run_ids)} if len(run_ids) > 1 else {}
