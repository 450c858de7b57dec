"""A pack: up to N LoRA runs trained at once in one process on one frozen base model (see
docs/packing.md). The runs' settings agree on everything but their adapter's own
(``config.ADAPTER_SETTINGS``); each run keeps its own head, adapters, loss term and optimizer
learning rate and weight decay (``train.packed_adamw``), and is recorded as its own run — its
row in runs.csv, its steps.csv with its own losses, its run.json with its own curves — with the pack's
size and id beside it. The step times are the pack's (one step trains every point); each point's
steps.csv also holds its share (the step time over the pack's size).

A packed point trains as its solo run does: the same batches in the same order (the loop iterates
the loaders as the solo loop does, from the same seed), the same initial head and adapters (drawn
as the solo run draws them, lora_bench.classifier.packed), the same losses up to the rounding
order of the batched products. Whatever ends the pack (an error, a signal) ends each of its runs,
and each is recorded with that status and reason."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from lora_bench.classifier.book import cast_frozen, model_config
from lora_bench.classifier.packed import build_packed_classifier
from lora_bench.config import TrainConfig, pack_key, solo_reason
from lora_bench.data.sms_spam import build_loaders, cached_splits, packaged_sms_spam
from lora_bench.data.tokenizer import gpt2_tokenizer
from lora_bench.errors import SaveError, UsageError
from lora_bench.fileio import check_writable_dir
from lora_bench.lora.packed import point_state_dict
from lora_bench.model.checkpoints import default_cache_dir
from lora_bench.progress import TrainProgress
from lora_bench.results.claims import RunClaim, claim_run
from lora_bench.results.manifest import read_manifest, record_invocation
from lora_bench.results.save import NO_ROOM, begin_record
from lora_bench.results.schema import cfg_columns
from lora_bench.results.store import RUNNING, check_results_dir
from lora_bench.signals import RaiseOnSignal, signals_deferred
from lora_bench.timing import PhaseTimer
from lora_bench.train.context import execution_models, optimizer_options
from lora_bench.train.identity import check_run_id, refuse_existing_run
from lora_bench.train.loop import LoopSettings
from lora_bench.train.memory import fit_problem
from lora_bench.train.packed_adamw import PackedAdamW
from lora_bench.train.pack_loop import GraphedPackStep, PackResult, pack_accuracy_loader, pack_losses, train_pack
from lora_bench.train.preflight import require_packages
from lora_bench.train.profiling import Profiler
from lora_bench.train.record import divergence, peer_versions, record_run, run_environment, summary
from lora_bench.train.run import ended_by
from lora_bench.train.setup import amp_context, resolve_device, set_precision


@dataclass(frozen=True)
class PackPoint:
    """One run of a pack: its settings, id and extra row columns (a sweep's provenance)."""

    cfg: TrainConfig
    run_id: str
    extra: dict = field(default_factory=dict)


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
    return None


def pack_id_of(run_ids: list[str]) -> str:
    """The pack's id: a hash of its runs' ids, in order (a resumed sweep's new pack gets its own)."""
    return "pack-" + hashlib.sha256("\n".join(run_ids).encode()).hexdigest()[:12]


class PackContext:
    """A pack's device, packed model, loaders and optimizer, built in the solo run's order (the data
    split, the model's random draws, the loaders, the seed, the optimizer, the execution mode):
    what ``summary``, the loop and ``GraphedPackStep`` read (``cfg``, ``device``, ``mcfg``, ``dp``,
    ``amp``, ``loaders``, ``optimizer``, ``forward_model``, ``eval_model``)."""

    def __init__(self, cfgs: list[TrainConfig], *, cache_dir: Path, progress: bool):
        cfg = self.cfg = cfgs[0]
        self.cfgs, self.n, self.dp = cfgs, len(cfgs), None
        self.device = resolve_device(cfg.device)
        set_precision(cfg)
        self.amp = amp_context(cfg, self.device)
        splits = cached_splits(Path(cfg.data_file) if cfg.data_file else packaged_sms_spam(), cache_dir)
        # the estimate of one run of the pack's whole batch at its largest rank
        whole = cfg.replace(batch_size=cfg.batch_size * self.n, lora_rank=max(c.lora_rank for c in cfgs))
        too_big = fit_problem(whole, self.device)
        if too_big:
            raise UsageError(f"a pack of {self.n} runs: {too_big} (or pack fewer runs)")
        self.mcfg = model_config(cfg)
        self.model = build_packed_classifier(cfgs, cache_dir=cache_dir, progress=progress)
        states = [point_state_dict(self.model, p) for p in range(self.n)]  # solo shapes: no padding counted
        self.trainable_params = [sum(t.numel() for t in st.values() if t.requires_grad) for st in states]
        self.total_params = [sum(t.numel() for t in st.values()) for st in states]
        if cfg.precision == "bf16":
            cast_frozen(self.model, torch.bfloat16)
        self.model.to(self.device)
        self.loaders = build_loaders(splits, gpt2_tokenizer(), context_length=cfg.context_length,
                                     model_context=self.mcfg.context_length, batch_size=cfg.batch_size,
                                     no_padding=cfg.no_padding)
        torch.manual_seed(cfg.seed)
        self.optimizer = PackedAdamW([t for t in self.model.parameters() if t.requires_grad],
                                     lrs=[c.learning_rate for c in cfgs],
                                     weight_decays=[c.weight_decay for c in cfgs], **optimizer_options(cfg))
        # torch.compile and CUDA-graph-replayed evaluations as a solo run sets them up
        self.forward_model, self.eval_model = execution_models(self.model, cfg, self.device)

    def loop_settings(self) -> LoopSettings:
        return LoopSettings.of(self.cfg)


def execute_pack(points: list[PackPoint], *, results_dir: Path, console: Console | None = None,
                 progress: bool = True, cache_dir: Path | None = None, overwrite: bool = False,
                 claims: list[RunClaim] | None = None, handle_signals: bool = True) -> list[dict]:
    """Train ``points`` as one pack and record each as its own run; returns their rows. As
    ``execute_run`` does for one run: the folder and ids are checked and each run's folder
    claimed (``claims``: the caller's, one per point) before any work; on failure or interruption
    every point's row is still written (failed / interrupted, with the reason) and the exception
    propagates."""
    cfgs = [p.cfg.validate() for p in points]
    why = pack_problem(cfgs)
    if why:
        raise UsageError(f"these runs cannot train as one pack: {why}")
    for cfg in cfgs:
        require_packages(cfg)
    ids = [p.run_id for p in points]
    if len(set(ids)) != len(ids):
        raise UsageError(f"a pack holds run ids more than once: {', '.join(ids)}")
    for run_id in ids:
        check_run_id(run_id)
    console = console or Console()
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    results_dir = Path(results_dir)
    bad = check_writable_dir(cache_dir)
    if bad:
        raise UsageError(f"cache folder {cache_dir}: {bad}; pass a writable --cache-dir")
    check_results_dir(results_dir)
    read_manifest(results_dir)
    held: list[RunClaim] = []
    try:
        if claims is None:
            for run_id in ids:
                if (results_dir / run_id).exists() and not (results_dir / run_id).is_dir():
                    raise UsageError(f"run id {run_id!r}: a file is in the way of the run's folder")
                held.append(claim_run(results_dir / run_id))
        if not overwrite:
            for run_id in ids:
                refuse_existing_run(results_dir, run_id)
        with RaiseOnSignal() if handle_signals else contextlib.nullcontext():
            pack = _Pack(points, cfgs, results_dir=results_dir, console=console, progress=progress,
                         cache_dir=cache_dir)
            return pack.execute()
    finally:
        for claim in held:
            claim.release()
            with contextlib.suppress(OSError):
                claim.run_dir.rmdir()


@dataclass
class _Pack:
    points: list[PackPoint]
    cfgs: list[TrainConfig]
    results_dir: Path
    console: Console
    progress: bool
    cache_dir: Path
    ctx: PackContext | None = None
    timer: PhaseTimer | None = None
    result: PackResult | None = None
    steps: list[list[dict]] | None = None
    profiler: Profiler | None = None
    begun: bool = False

    def __post_init__(self):
        self.n = len(self.points)
        self.logs: list[list[str]] = [[] for _ in self.points]
        self.curves: list[dict] = [{} for _ in self.points]

    def say(self, p: int, msg: str) -> None:
        self.logs[p].append(msg)
        self.console.print(f"[{self.points[p].run_id}] {msg}", highlight=False, markup=False)

    def say_all(self, msg: str) -> None:
        for log in self.logs:
            log.append(msg)
        self.console.print(msg, highlight=False, markup=False)

    def execute(self) -> list[dict]:
        ids = [p.run_id for p in self.points]
        begun_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        pack = {"pack_size": self.n, "pack_id": pack_id_of(ids)}
        rows = [{"run_id": p.run_id, "status": RUNNING, "started_at": begun_at, **cfg_columns(p.cfg),
                 **peer_versions(p.cfg), **p.extra, "world_size": 1, **pack} for p in self.points]
        try:
            self._begin(rows)
            self.say_all(f"pack {pack['pack_id']}: {self.n} runs ({', '.join(ids)}) on one model")
            self.ctx = ctx = PackContext(self.cfgs, cache_dir=self.cache_dir, progress=self.progress)
            env = run_environment(ctx.device)
            for p, row in enumerate(rows):
                row.update(trainable_params=ctx.trainable_params[p], total_params=ctx.total_params[p],
                           device=str(ctx.device), **env)
            cfg = ctx.cfg
            self.timer = PhaseTimer(cfg.timing, ctx.device, warmup_steps=cfg.warmup_steps)
            self._train(rows)
            if not cfg.skip_final_eval:
                self._final_accuracies(rows)
            self.profiler.finish(self.console, copies=[self.results_dir / p.run_id for p in self.points[1:]])
            self.steps = self._point_steps()
            for p, row in enumerate(rows):
                self._summarise(p, row)
                row["status"] = "done"
                bad = divergence(self.steps[p], self.curves[p], eval_freq=cfg.eval_freq)
                if bad is not None:
                    row.update(status="diverged", diverged_at_step=bad,
                               error=f"diverged: the loss is not finite from step {bad} on (NaN or inf; a lower "
                                     "learning_rate?); its accuracies and losses are not results")
                    self.say(p, f"warning: {row['error']}")
            return rows
        except BaseException as e:  # every point ends as the pack did
            for row in rows:
                row.update(ended_by(e))
                if not isinstance(e, KeyboardInterrupt) and self.n > 1:
                    row["error"] = f"its pack of {self.n} runs failed: {row['error']}"[:2000]
            raise
        finally:
            if self.begun:
                self._record(rows)

    def _begin(self, rows: list[dict]) -> None:
        with signals_deferred():
            try:
                record_invocation(self.results_dir, run_ids=[r["run_id"] for r in rows])
            except OSError as e:
                if e.errno not in NO_ROOM:
                    raise
                raise SaveError(f"cannot record the pack's runs in {self.results_dir}: {e.strerror or e}; nothing "
                                "was run. Free some space there (or choose another --results-dir)") from None
            for row in rows:
                begin_record(self.results_dir, row)
            self.begun = True

    def _train(self, rows: list[dict]) -> None:
        ctx, timer, cfg = self.ctx, self.timer, self.ctx.cfg
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        total = cfg.max_steps if cfg.max_steps else cfg.num_epochs * len(ctx.loaders.train)
        self.result = res = PackResult(self.n)
        step_fn = GraphedPackStep(ctx, timer=timer, n=self.n) if cfg.cuda_graphs else None
        # the profile is of the pack's step (every point at once); each point's folder gets its files
        self.profiler = Profiler(cfg.profile, run_dir=self.results_dir / self.points[0].run_id,
                                 warmup_steps=cfg.warmup_steps, device=ctx.device, pack_size=self.n,
                                 line_functions=(pack_losses,))
        with TrainProgress(self.console, total=total, enabled=self.progress, timer=timer) as bar:
            timer.label_phases = self.profiler.labels_phases
            self.profiler.run(train_pack, ctx.forward_model, self.n, ctx.loaders.train, ctx.loaders.val,
                              ctx.optimizer, ctx.device, settings=ctx.loop_settings(), timer=timer, amp=ctx.amp,
                              step_fn=step_fn, on_step=self.profiler.chain(bar.update), eval_model=ctx.eval_model,
                              say=self.say, result=res)
        graph_columns = step_fn.record() if step_fn is not None else {}
        for p, row in enumerate(rows):
            self.curves[p].update(train_losses=res.train_losses[p], val_losses=res.val_losses[p],
                                  train_accs=res.train_accs[p], val_accs=res.val_accs[p])
            row.update(backend="", steps=res.steps, training_time_s=res.training_time_s,
                       training_time_min=res.training_time_s / 60,
                       final_train_loss=res.train_losses[p][-1] if res.train_losses[p] else None,
                       final_val_loss=res.val_losses[p][-1] if res.val_losses[p] else None, **graph_columns)
        self.say_all(f"Training completed in {res.training_time_s / 60:.2f} minutes.")

    def _final_accuracies(self, rows: list[dict]) -> None:
        ctx = self.ctx
        kw = dict(token_pos=ctx.cfg.trainable_token_pos, average_embeddings=ctx.cfg.average_embeddings, amp=ctx.amp)
        for name, loader in (("train", ctx.loaders.train), ("val", ctx.loaders.val), ("test", ctx.loaders.test)):
            accs = pack_accuracy_loader(loader, ctx.eval_model, ctx.device, self.n, **kw)
            for p, row in enumerate(rows):
                row[f"{name}_acc"] = accs[p] * 100
                self.say(p, f"{dict(train='Training', val='Validation', test='Test')[name]} accuracy: "
                            f"{accs[p] * 100:.2f}%")

    def _point_steps(self) -> list[list[dict]]:
        """Each point's steps.csv rows: the pack's timings, its share of them, its own loss."""
        timer = self.timer
        if timer is None or not timer.enabled:
            return [[] for _ in self.points]
        losses = self.result.point_step_losses() if self.result is not None else [[] for _ in self.points]
        out = []
        for p, point in enumerate(self.points):
            rows = timer.step_rows(point.run_id)
            for row in rows:
                row["loss"] = losses[p][row["step"]] if row["step"] < len(losses[p]) else None
                row["share_step_ms"] = row["step_ms"] / self.n
                row["share_host_step_ms"] = row["host_step_ms"] / self.n
            out.append(rows)
        return out

    def _summarise(self, p: int, row: dict) -> None:
        row.update(summary(self.ctx, self.timer, self.cfgs[p], self.steps[p]))
        if isinstance(row.get("step_ms_median"), (int, float)):
            row["share_step_ms_median"] = row["step_ms_median"] / self.n

    def _record(self, rows: list[dict]) -> None:
        """Every point's record, whatever state the pack ended in; a signal meanwhile waits."""
        with signals_deferred():
            if self.steps is None and self.timer is not None:
                try:
                    self.steps = self._point_steps()
                    for p, row in enumerate(rows):
                        if row["status"] == "interrupted" and self.ctx is not None:
                            row.setdefault("steps", len(self.steps[p]))
                            self._summarise(p, row)  # what was measured so far
                except RuntimeError as err:  # a dead CUDA context cannot resolve events; keep the rows
                    self.steps = None
                    for row in rows:
                        row["error"] = (row.get("error") or "") + f" (steps not saved: {err})"
            not_saved: SaveError | None = None
            for p, (point, row) in enumerate(zip(self.points, rows)):
                try:  # every point's record is tried: one that does not fit leaves the others theirs
                    record_run(row, ctx=self.ctx, timer=self.timer, steps=self.steps[p] if self.steps else None,
                               cfg=point.cfg, run_id=point.run_id, run_dir=self.results_dir / point.run_id,
                               results_dir=self.results_dir, log=self.logs[p], curves=self.curves[p],
                               console=self.console)
                except SaveError as e:
                    not_saved = not_saved or e
            if not_saved is not None:
                raise not_saved
