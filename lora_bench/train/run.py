"""One training run from a ``TrainConfig`` to its recorded row, as a straight line: check the run's
identity and claim its folder (``identity``), set up device, precision and the rank's settings
(``setup``), build what the loop needs (``context.RunContext``), train with every phase timed,
evaluate, and record (``record``) whatever state the run ended in."""

from __future__ import annotations

import contextlib
import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from lora_bench.config import TrainConfig
from lora_bench.errors import Interrupted, SaveError, UsageError
from lora_bench.fileio import check_writable_dir
from lora_bench.kernels.policy import record_plans, use_policy
from lora_bench.model.checkpoints import default_cache_dir
from lora_bench.progress import TrainProgress
from lora_bench.results.claims import RunClaim, claim_run
from lora_bench.results.manifest import read_manifest, record_invocation
from lora_bench.results.records import RUNNING
from lora_bench.results.save import NO_ROOM, begin_record
from lora_bench.results.schema import cfg_columns
from lora_bench.results.store import check_results_dir
from lora_bench.signals import RaiseOnSignal, signals_deferred
from lora_bench.timing import PhaseTimer
from lora_bench.train.context import RunContext
from lora_bench.train.distributed import DataParallel, RankEnv, rank_env
from lora_bench.train.evaluate import calc_accuracy_loader
from lora_bench.train.graphs import GraphedStep
from lora_bench.train.identity import check_run_id, make_run_id, refuse_existing_run
from lora_bench.train.loop import TrainResult, train_classifier
from lora_bench.train.profiling import Profiler
from lora_bench.train.record import divergence, peer_versions, record_run, run_environment, summary
from lora_bench.train.setup import rank_settings


def execute_run(cfg: TrainConfig, *, results_dir: Path, run_id: str | None = None, console: Console | None = None,
                progress: bool = True, cache_dir: Path | None = None, extra: dict | None = None,
                overwrite: bool = False, claim: RunClaim | None = None, handle_signals: bool = True) -> dict:
    """Run one configuration and record it. On failure or interruption the row is still written
    (status failed / interrupted, with the error and, when interrupted, the summary of the steps
    measured so far) and the exception propagates.

    Before any work: the results folder must take files and its runs.csv parse, the run id must be
    new (``overwrite`` replaces an earlier run of that id) and the run's folder is claimed, so no
    other process executes the same run at the same time (``claim``: one the caller already
    holds). ``handle_signals``: SIGTERM and SIGHUP end the run as Ctrl-C does (see RaiseOnSignal);
    a caller with its own signal handling passes False.

    Under torchrun (a data-parallel run, see lora_bench.train.distributed) every rank executes the
    run and rank 0 alone checks, claims and writes; the others run quietly. torchrun stops the
    ranks with SIGTERM when one fails, which records rank 0's run as interrupted until the
    launcher names the rank that failed first."""
    env = rank_env()
    cfg = rank_settings(cfg, env).validate()
    main = env is None or env.is_main
    console = console or Console()
    if not main:
        console, progress = Console(quiet=True), False
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    results_dir = Path(results_dir)
    run_id = run_id or make_run_id(cfg)
    check_run_id(run_id)
    why = check_writable_dir(cache_dir)
    if why:
        raise UsageError(f"cache folder {cache_dir}: {why}; pass a writable --cache-dir")
    run_dir = results_dir / run_id
    held = None
    if main:
        check_results_dir(results_dir)
        read_manifest(results_dir)  # a manifest it cannot add to is refused before any work
        if run_dir.exists() and not run_dir.is_dir():
            raise UsageError(f"run id {run_id!r}: a file is in the way of the run's folder {run_dir}; move it "
                             "aside or choose another --run-id")
        held = claim if claim is not None else claim_run(run_dir)
    try:
        if main:
            if not overwrite:
                refuse_existing_run(results_dir, run_id)
        with RaiseOnSignal() if handle_signals else contextlib.nullcontext():
            run = _Run(cfg, results_dir=results_dir, run_id=run_id, console=console, progress=progress,
                       cache_dir=cache_dir, env=env)
            return run.execute(extra=extra)
    finally:
        if held is not None and claim is None:
            held.release()
            with contextlib.suppress(OSError):  # the folder of a run refused before it began: empty
                run_dir.rmdir()


@dataclass
class _Run:
    """One run's execution: what it has built so far is kept, so that whatever state the run ends
    in, ``record_run`` writes what there is."""

    cfg: TrainConfig
    results_dir: Path
    run_id: str
    console: Console
    progress: bool
    cache_dir: Path
    env: RankEnv | None
    ctx: RunContext | None = None
    timer: PhaseTimer | None = None
    profiler: Profiler | None = None
    steps: list[dict] | None = None  # the per-step rows, built once
    begun: bool = False  # its record says running (results.save.begin_record): it is to be finished
    log: list[str] = field(default_factory=list)
    curves: dict = field(default_factory=dict)

    @property
    def main(self) -> bool:
        return self.env is None or self.env.is_main

    @property
    def run_dir(self) -> Path:
        return self.results_dir / self.run_id

    def say(self, msg: str) -> None:
        self.log.append(msg)
        self.console.print(msg, highlight=False)

    def execute(self, *, extra: dict | None) -> dict:
        cfg, env = self.cfg, self.env
        row: dict = {"run_id": self.run_id, "status": RUNNING,
                     "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     **cfg_columns(cfg), **peer_versions(cfg), **(extra or {}),
                     "world_size": env.world_size if env is not None else 1}
        try:
            if self.main:
                self._begin(row)
            dp = (DataParallel.start(env, device=cfg.device, batch_size=cfg.batch_size, cuda_graphs=cfg.cuda_graphs)
                  if env is not None else None)
            self.ctx = ctx = RunContext(cfg, cache_dir=self.cache_dir, progress=self.progress, dp=dp)
            for note in ctx.notes:
                self.say(note)
            row.update(trainable_params=ctx.trainable_params, total_params=ctx.total_params, device=str(ctx.device),
                       base_weight_mib=ctx.base_weight_mib,
                       **run_environment(ctx.device))
            self.timer = (dp.phase_timer(cfg.timing, warmup_steps=cfg.warmup_steps) if dp is not None
                          else PhaseTimer(cfg.timing, ctx.device, warmup_steps=cfg.warmup_steps))
            row.update(self._train())
            if not cfg.skip_final_eval:
                row.update(self._final_accuracies())
            self.profiler.finish(self.console)
            self.steps = self.timer.step_rows(self.run_id) if self.timer.enabled else []
            row.update(summary(ctx, self.timer, cfg, self.steps))
            row["status"] = "done"
            # Judged after the loop, from losses read where it synchronises anyway: training goes on
            # past a non-finite loss, as the reference's does, since looking at every step's loss as
            # it is computed would add a device synchronisation per step to what is measured.
            bad = divergence(self.steps, self.curves, eval_freq=cfg.eval_freq)
            if bad is not None:  # measured as it ran; its losses and accuracies mean nothing
                row.update(status="diverged", diverged_at_step=bad,
                           error=f"diverged: the loss is not finite from step {bad} on (NaN or inf; a lower "
                                 "learning_rate?); its accuracies and losses are not results")
                self.say(f"warning: {row['error']}")
            return row
        except BaseException as e:  # record, then re-raise: nothing is lost, nothing is swallowed
            row.update(ended_by(e))
            raise
        finally:
            if self.begun:
                record_run(row, ctx=self.ctx, timer=self.timer, steps=self.steps, cfg=cfg, run_id=self.run_id,
                           run_dir=self.run_dir, results_dir=self.results_dir, log=self.log, curves=self.curves,
                           console=self.console)
            # a data-parallel run keeps its process group: the rank's process ends without tearing it
            # down (distributed.exit_rank), and a later run in this process joins the same group

    def _begin(self, row: dict) -> None:
        """Say in the results folder that the run is executing: the invocation, then a record
        that says running, so that a process killed outright leaves a run marked interrupted."""
        with signals_deferred():  # a signal now comes once the run is begun, and is recorded
            try:
                record_invocation(self.results_dir, run_ids=[self.run_id])
            except OSError as e:
                if e.errno not in NO_ROOM:
                    raise
                raise SaveError(f"cannot record run {self.run_id} in {self.results_dir}: {e.strerror or e}; "
                                "nothing was run. Free some space there (or choose another --results-dir)") from None
            begin_record(self.results_dir, row)
            self.begun = True

    def _train(self) -> dict:
        """The instrumented loop (profiled when asked, CUDA graphs when asked); its row columns."""
        cfg, ctx, timer = self.cfg, self.ctx, self.timer
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        profiler = Profiler(cfg.profile if self.main else "none", run_dir=self.run_dir,
                            warmup_steps=cfg.warmup_steps, device=ctx.device)
        step_fn = GraphedStep(ctx, timer=timer) if cfg.cuda_graphs else None
        total = cfg.max_steps if cfg.max_steps else cfg.num_epochs * len(ctx.loaders.train)
        with (TrainProgress(self.console, total=total, enabled=self.progress, timer=timer) as bar,
              use_policy(ctx.kernel_policy), record_plans(ctx.kernel_plans)):
            timer.label_phases = profiler.labels_phases
            result: TrainResult = profiler.run(
                train_classifier, ctx.forward_model, ctx.loaders.train, ctx.loaders.val, ctx.optimizer, ctx.device,
                settings=ctx.loop_settings(), timer=timer, amp=ctx.amp, step_fn=step_fn,
                on_step=profiler.chain(bar.update), eval_model=ctx.eval_model,
                shard=ctx.dp.shard if ctx.dp is not None else None, say=self.say)
        out: dict = {}
        if ctx.dp is not None:  # collective: every rank, right after the loop
            out.update(ctx.dp.gather(timer))
        out["backend"] = ctx.backend()  # what the layers ran (recorded while the loop ran)
        if step_fn is not None:
            out.update(step_fn.record())
        self.curves.update(train_losses=result.train_losses, val_losses=result.val_losses,
                           train_accs=result.train_accs, val_accs=result.val_accs)
        out.update(steps=result.steps, training_time_s=result.training_time_s,
                   training_time_min=result.training_time_s / 60,
                   final_train_loss=result.train_losses[-1] if result.train_losses else None,
                   final_val_loss=result.val_losses[-1] if result.val_losses else None)
        self.say(f"Training completed in {result.training_time_s / 60:.2f} minutes.")
        self.profiler = profiler
        return out

    def _final_accuracies(self) -> dict[str, float]:
        ctx = self.ctx
        accs = final_accuracies(ctx)
        self.say(f"Training accuracy: {accs['train_acc']:.2f}%")
        self.say(f"Validation accuracy: {accs['val_acc']:.2f}%")
        self.say(f"Test accuracy: {accs['test_acc']:.2f}%")
        return accs


def final_accuracies(ctx: RunContext) -> dict[str, float]:
    kw = dict(token_pos=ctx.cfg.trainable_token_pos, average_embeddings=ctx.cfg.average_embeddings, amp=ctx.amp)
    out = {}
    with use_policy(ctx.kernel_policy):
        for name, loader in (("train", ctx.loaders.train), ("val", ctx.loaders.val), ("test", ctx.loaders.test)):
            out[f"{name}_acc"] = calc_accuracy_loader(loader, ctx.eval_model, ctx.device, **kw) * 100
    return out


def ended_by(exc: BaseException) -> dict:
    """The status and error columns of a run that ``exc`` ended."""
    interrupted = isinstance(exc, KeyboardInterrupt)
    if isinstance(exc, Interrupted):
        error = str(exc)[:2000]
    elif interrupted:
        error = "interrupted by SIGINT"
    else:
        error = f"{type(exc).__name__}: {exc}"[:2000]
    return {"status": "interrupted" if interrupted else "failed", "error": error}
