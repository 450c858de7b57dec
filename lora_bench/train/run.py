"""A run of N >= 1 points trained at once on one model (a solo run: one point; a pack, see
lora_bench.train.pack and docs/packing.md), from their settings to one recorded row each, as a
straight line: check the points' settings and ids (``points``), claim their folders
(``recording``), build what the loop needs (``context.RunContext``), train with every phase timed
(``loop``), evaluate, and record every point whatever state the run ended in (``recording``).

A packed point is recorded as its own run — its row, its steps.csv with its own losses and its
share of the pack's step time, its run.json with its own curves — with the pack's size and id
beside it; whatever ends the pack (an error, a signal) ends each of its points."""

from __future__ import annotations

import contextlib
import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from lora_bench.config import TrainConfig
from lora_bench.kernels.policy import graph_plan, record_plans, use_policy
from lora_bench.progress import CountProgress, TrainProgress
from lora_bench.signals import RaiseOnSignal, signals_deferred
from lora_bench.timing import PhaseTimer
import lora_bench.train.recording as recording
from lora_bench.train.context import RunContext
from lora_bench.train.distributed import DataParallel, RankEnv, rank_env
from lora_bench.train.estimate import announce
from lora_bench.train.evaluate import calc_accuracy_loader
from lora_bench.train.graphs import GraphedStep
from lora_bench.train.loop import TrainResult, train_classifier
from lora_bench.train.points import Point, checked_cache_dir, checked_points, points_pack_columns
from lora_bench.train.profiling import Profiler, profiles_graphs
from lora_bench.train.record import divergence, peer_versions, run_environment, summary


def execute_run(cfg: TrainConfig, *, results_dir: Path, run_id: str | None = None, extra: dict | None = None,
                claim=None, **kw) -> dict:
    """One solo run (``execute`` of one point); its recorded row. ``claim``: the run's folder's
    claim, when the caller holds it."""
    return execute([Point(cfg, run_id, extra or {})], results_dir=results_dir,
                   claims=[claim] if claim is not None else None, **kw)[0]


def execute(points: list[Point], *, results_dir: Path, console: Console | None = None, progress: bool = True,
            cache_dir: Path | None = None, overwrite: bool = False, claims: list | None = None,
            handle_signals: bool = True, estimate: bool = False) -> list[dict]:
    """Train ``points`` at once and record each as its own run; returns their rows. On failure or
    interruption every row is still written (status failed / interrupted, with the error and, when
    interrupted, the summary of the steps measured so far) and the exception propagates.

    Before any work: several points must be able to pack (``pack.pack_problem``), the results
    folder must take files and its runs.csv parse, the run ids must be new (``overwrite``
    replaces an earlier run of that id) and each point's folder is claimed, so no other process
    executes it at the same time (``claims``: the caller's, one per point). ``handle_signals``:
    SIGTERM and SIGHUP end the run as Ctrl-C does (see RaiseOnSignal); a caller with its own
    signal handling passes False. ``estimate``: say how long the run will take before its first step
    (``lora_bench.train.estimate``; not on a data-parallel run).

    Under torchrun (a data-parallel solo run, see lora_bench.train.distributed) every rank executes
    the run and rank 0 alone checks, claims and writes; the others run quietly. torchrun stops the
    ranks with SIGTERM when one fails, which records rank 0's run as interrupted until the
    launcher names the rank that failed first."""
    env = rank_env()
    points = checked_points(points, env)
    main = env is None or env.is_main
    console = console or Console()
    if not main:
        console, progress = Console(quiet=True), False
    cache_dir = checked_cache_dir(cache_dir)
    results_dir = Path(results_dir)
    ids = [p.run_id for p in points]
    with (recording.claimed(results_dir, ids, overwrite=overwrite, claims=claims) if main
          else contextlib.nullcontext()):
        with RaiseOnSignal() if handle_signals else contextlib.nullcontext():
            run = _Run(points, results_dir=results_dir, console=console, progress=progress, cache_dir=cache_dir,
                       env=env, estimate=estimate)
            return run.execute()


@dataclass
class _Run:
    """One run's execution: what it has built so far is kept, so that whatever state the run ends
    in, every point's record holds what there is."""

    points: list[Point]
    results_dir: Path
    console: Console
    progress: bool
    cache_dir: Path
    env: RankEnv | None
    estimate: bool = False  # say how long the run will take, before its first step
    context: RunContext | None = None
    timer: PhaseTimer | None = None
    profiler: Profiler | None = None
    result: TrainResult | None = None
    steps: list[list[dict]] | None = None  # per point, the per-step rows, built once
    begun: bool = False  # the records say running (results.save.begin_record): they are to be finished

    def __post_init__(self):
        self.n = len(self.points)
        self.logs: list[list[str]] = [[] for _ in self.points]
        self.curves: list[dict] = [{} for _ in self.points]

    @property
    def main(self) -> bool:
        return self.env is None or self.env.is_main

    def say(self, p: int, msg: str) -> None:
        self.logs[p].append(msg)
        prefix = f"[{self.points[p].run_id}] " if self.n > 1 else ""
        self.console.print(prefix + msg, highlight=False, markup=False)

    def say_all(self, msg: str) -> None:
        for log in self.logs:
            log.append(msg)
        self.console.print(msg, highlight=False, markup=False)

    def execute(self) -> list[dict]:
        env, cfg = self.env, self.points[0].cfg
        begun_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        pack = points_pack_columns(self.points)
        rows = [{"run_id": p.run_id, "status": recording.RUNNING, "started_at": begun_at, **recording.cfg_columns(p.cfg),
                 **peer_versions(p.cfg), **p.extra, "world_size": env.world_size if env is not None else 1, **pack}
                for p in self.points]
        try:
            if self.main:
                with signals_deferred():
                    recording.begin(self.results_dir, rows)
                    self.begun = True
            if pack:
                self.say_all(f"pack {pack['pack_id']}: {self.n} runs ({', '.join(r['run_id'] for r in rows)}) "
                             "on one model")
            dp = (DataParallel.start(env, device=cfg.device, batch_size=cfg.batch_size, cuda_graphs=cfg.cuda_graphs)
                  if env is not None else None)
            self.context = context = RunContext([p.cfg for p in self.points], cache_dir=self.cache_dir,
                                        progress=self.progress, dp=dp)
            for note in context.notes:
                self.say_all(note)
            environment = run_environment(context.device)
            for p, row in enumerate(rows):
                row.update(trainable_params=context.trainable_params[p], total_params=context.total_params[p],
                           device=str(context.device), base_weight_mib=context.base_weight_mib,
                           adapter_init_s=context.adapter_init_s, **environment)
            self.timer = (dp.phase_timer(cfg.timing, warmup_steps=cfg.warmup_steps) if dp is not None
                          else PhaseTimer(cfg.timing, context.device, warmup_steps=cfg.warmup_steps))
            self._train(rows)
            if not cfg.skip_final_eval:
                self._final_accuracies(rows)
            self.profiler.finish(self.console, copies=[self.results_dir / p.run_id for p in self.points[1:]])
            self.steps = self._point_steps()
            for p, row in enumerate(rows):
                self._summarise(p, row)
                row["status"] = "done"
                # Judged after the loop, from losses read where it synchronises anyway: training goes on
                # past a non-finite loss, as the reference's does, since looking at every step's loss as
                # it is computed would add a device synchronisation per step to what is measured.
                bad = divergence(self.steps[p], self.curves[p], eval_freq=cfg.eval_freq)
                if bad is not None:  # measured as it ran; its losses and accuracies mean nothing
                    row.update(status="diverged", diverged_at_step=bad,
                               error=f"diverged: the loss is not finite from step {bad} on (NaN or inf; a lower "
                                     "learning_rate?); its accuracies and losses are not results")
                    self.say(p, f"warning: {row['error']}")
            return rows
        except BaseException as e:  # record, then re-raise: nothing is lost, nothing is swallowed
            for row in rows:  # every point ends as the run did
                row.update(recording.ended_by(e))
                if not isinstance(e, KeyboardInterrupt) and self.n > 1:
                    row["error"] = f"its pack of {self.n} runs failed: {row['error']}"[:2000]
            raise
        finally:
            if self.begun:
                self._record(rows)
            # a data-parallel run keeps its process group: the rank's process ends without tearing it
            # down (distributed.exit_rank), and a later run in this process joins the same group

    def _train(self, rows: list[dict]) -> None:
        """The instrumented loop (profiled when asked, CUDA graphs when asked); its row columns."""
        context, timer, cfg = self.context, self.timer, self.context.cfg
        if self.estimate and context.dp is None:
            announce(context, lambda line: self.console.print(line, highlight=False, markup=False))
        if context.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(context.device)
        # a pack's profile is of its step (every point at once); each point's folder gets its files
        self.profiler = profiler = Profiler(cfg.profile if self.main else "none",
                                            run_dir=self.results_dir / self.points[0].run_id,
                                            warmup_steps=cfg.warmup_steps, device=context.device,
                                            pack_size=self.n if self.n > 1 else None)
        # a kernel profile of a graphed step: its steps one by one, each call's plan a capture's
        stand_in = profiles_graphs(cfg)
        step_fn = GraphedStep(context, timer=timer) if cfg.cuda_graphs and not stand_in else None
        if stand_in:
            self.say_all(f"profile={cfg.profile} with cuda_graphs: no graph is captured; each step runs its "
                         "kernels one by one, every layer with the plan a capture gives it, so the profile holds "
                         "the kernels the graphs would replay (its step times are not the replay's)")
        total = cfg.max_steps if cfg.max_steps else cfg.num_epochs * len(context.loaders.train)
        self.result = res = TrainResult(self.n)
        with (TrainProgress(self.console, total=total, enabled=self.progress, timer=timer) as bar,
              use_policy(context.kernel_policy), graph_plan() if stand_in else contextlib.nullcontext(),
              record_plans(context.kernel_plans)):
            timer.label_phases = profiler.labels_phases
            profiler.run(train_classifier, context.forward_model, context.loaders.train, context.loaders.val, context.optimizer,
                         context.device, settings=context.loop_settings(), timer=timer, points=self.n, amp=context.amp,
                         step_fn=step_fn, on_step=profiler.chain(bar.update), eval_model=context.eval_model,
                         shard=context.dp.shard if context.dp is not None else None, say=self.say, result=res)
        out: dict = {}
        if context.dp is not None:  # collective: every rank, right after the loop
            out.update(context.dp.gather(timer))
        out["backend"] = context.backend()  # what the layers ran (recorded while the loop ran)
        out["dora_norms"] = context.dora_norms()
        out["gemm_tiles"] = context.gemm_tiles()
        out["optimizer_update"] = context.optimizer_update()
        if step_fn is not None:
            out.update(step_fn.record())
        for p, row in enumerate(rows):
            self.curves[p].update(train_losses=res.train_losses[p], val_losses=res.val_losses[p],
                                  train_accs=res.train_accs[p], val_accs=res.val_accs[p])
            row.update(out, steps=res.steps, training_time_s=res.training_time_s,
                       training_time_min=res.training_time_s / 60,
                       final_train_loss=res.train_losses[p][-1] if res.train_losses[p] else None,
                       final_val_loss=res.val_losses[p][-1] if res.val_losses[p] else None)
        self.say_all(f"Training completed in {res.training_time_s / 60:.2f} minutes.")

    def _final_accuracies(self, rows: list[dict]) -> None:
        loaders = self.context.loaders
        total = len(loaders.train) + len(loaders.val) + len(loaders.test)
        with CountProgress(self.console, total=total, label="final evaluation", enabled=self.progress) as bar:
            accs = final_accuracies(self.context, counted=bar.counted)
        for p, row in enumerate(rows):
            for name, title in (("train", "Training"), ("val", "Validation"), ("test", "Test")):
                row[f"{name}_acc"] = accs[f"{name}_acc"][p]
                self.say(p, f"{title} accuracy: {row[f'{name}_acc']:.2f}%")

    def _point_steps(self) -> list[list[dict]]:
        """Each point's steps.csv rows: the run's timings; a pack's point also its own loss and its
        share of the pack's step."""
        timer = self.timer
        if not timer.enabled:
            return [[] for _ in self.points]
        if self.n == 1:
            return [timer.step_rows(self.points[0].run_id)]
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
        row.update(summary(self.context, self.timer, self.points[p].cfg, self.steps[p]))
        if self.n > 1 and isinstance(row.get("step_ms_median"), (int, float)):
            row["share_step_ms_median"] = row["step_ms_median"] / self.n

    def _record(self, rows: list[dict]) -> None:
        """Every point's record, whatever state the run ended in; a signal meanwhile waits."""
        with signals_deferred() as pending:
            timed = self.timer is not None and self.timer.enabled
            if self.steps is None and timed:  # the run stopped before its summary
                try:
                    self.steps = self._point_steps()
                    for p, row in enumerate(rows):
                        if row["status"] == "interrupted" and self.context is not None:
                            row.setdefault("steps", len(self.steps[p]))
                            self._summarise(p, row)  # what was measured so far
                except RuntimeError as err:  # a dead CUDA context cannot resolve events; keep the rows
                    self.steps = None
                    for row in rows:
                        row["error"] = (row.get("error") or "") + f" (steps not saved: {err})"
            steps = self.steps if timed and self.steps is not None else [None] * self.n
            recording.save_runs(rows, steps=steps, results_dir=self.results_dir, logs=self.logs,
                                curves=self.curves, console=self.console, pending=pending)


def final_accuracies(context: RunContext, *, counted=lambda loader: loader) -> dict[str, list[float]]:
    """Each point's accuracy (in percent) on the whole train, validation and test sets; each
    loader read through ``counted`` (a progress display's)."""
    obj = context.loop_settings().objective(context.n)
    out = {}
    with use_policy(context.kernel_policy):
        for name, loader in (("train", context.loaders.train), ("val", context.loaders.val), ("test", context.loaders.test)):
            accs = calc_accuracy_loader(counted(loader), context.eval_model, context.device, objective=obj,
                                        amp=context.amp)
            out[f"{name}_acc"] = [a * 100 for a in accs]
    return out
