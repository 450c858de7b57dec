"""One training run from a ``TrainConfig`` to its result rows: device and precision set-up, model,
data, optimizer, the instrumented loop, final evaluation, and the files it leaves behind
(``runs.csv`` row, ``<run_id>/steps.csv``, ``<run_id>/run.json``, profiles)."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import re
import resource
import signal
import threading
from pathlib import Path

import torch
from rich.console import Console

from lora_bench.classifier.book import build_classifier, cast_frozen, model_config
from lora_bench.config import TrainConfig
from lora_bench.data.sms_spam import build_loaders, cached_splits, ensure_sms_spam
from lora_bench.data.tokenizer import gpt2_tokenizer
from lora_bench.errors import Interrupted, UsageError
from lora_bench.fileio import atomic_write_text, check_writable_dir
from lora_bench.kernels.policy import PlanLog, current_policy, policy_from_env, record_plans, use_policy
from lora_bench.lora.kernel import group_qkv
from lora_bench.model.checkpoints import default_cache_dir
from lora_bench.model.gpt2 import count_params
from lora_bench.peers.hf import build_hf_classifier, cast_frozen_hf, package_versions
from lora_bench.progress import TrainProgress
from lora_bench.results.claims import RunClaim, claim_run
from lora_bench.results.environment import environment
from lora_bench.results.manifest import record_invocation
from lora_bench.results.metrics import flops_per_step, peak_tflops, summarise_steps
from lora_bench.results.schema import STEP_COLUMNS, cfg_columns
from lora_bench.results.store import (
    RUN_RECORD,
    STEPS_CSV,
    check_results_dir,
    read_run_table,
    run_record,
    upsert_run,
    write_csv,
)
from lora_bench.timing import PhaseTimer
from lora_bench.train.distributed import DataParallel, RankEnv, rank_env
from lora_bench.train.evaluate import calc_accuracy_loader
from lora_bench.train.graphs import GraphedEval, GraphedStep
from lora_bench.train.loop import LoopSettings, TrainResult, train_classifier
from lora_bench.train.preflight import require_packages
from lora_bench.train.profiling import Profiler

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
TERMINATING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"device={name!r} but CUDA is not available here; use --device cpu or auto")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"device={name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def settings_hash(cfg: TrainConfig) -> str:
    """Hash of the settings that differ from their defaults: a setting added to lora-bench later
    (with a default that keeps the behaviour) leaves existing run ids, and so a sweep's resume,
    intact; a hash over every field would rerun whole sweeps for each new option."""
    defaults = TrainConfig().to_dict()
    changed = {k: v for k, v in cfg.to_dict().items() if v != defaults[k]}
    return hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:10]


def make_run_id(cfg: TrainConfig, *, repeat: int | None = None) -> str:
    """Deterministic for sweeps (settings hash + repeat); time-stamped for one-off runs."""
    slug = f"{cfg.model_size}-{cfg.trainable_layers}".replace(" ", "").replace("(", "").replace(")", "")
    if cfg.implementation != "book":
        slug += f"-{cfg.implementation}"
    base = f"{slug}-{settings_hash(cfg)}"
    if repeat is not None:
        return f"{base}-r{repeat}"
    return f"{base}-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%S%f')}"


def set_precision(cfg: TrainConfig) -> None:
    # fp32 is the reference: no TF32 anywhere in matmuls (torch's default); tf32 opts in.
    torch.set_float32_matmul_precision("high" if cfg.precision == "tf32" else "highest")
    torch.backends.cuda.matmul.allow_tf32 = cfg.precision == "tf32"
    torch.backends.cudnn.allow_tf32 = cfg.precision == "tf32"


def amp_context(cfg: TrainConfig, device: torch.device):
    if cfg.precision != "bf16":
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def compile_model(model: torch.nn.Module, scope: str, **compile_kw) -> torch.nn.Module:
    """torch.compile the whole model (returns the compiled wrapper), or each transformer block in
    place (returns the model itself). Blocks share their code, so with scope "blocks" a 48-block
    model compiles about as fast as a 12-block one: one graph for the first block (its input needs
    no gradient), one reused by all the others."""
    if scope == "model":
        return torch.compile(model, **compile_kw)
    if scope == "blocks":
        for block in model.trf_blocks:
            block.compile(**compile_kw)
        return model
    raise ValueError(f"compile scope {scope!r}: expected model or blocks")


class RunContext:
    """What a run builds before its loop; kept for the profilers and CUDA graphs."""

    def __init__(self, cfg: TrainConfig, *, cache_dir: Path, progress: bool, dp: DataParallel | None = None):
        self.cfg = cfg
        self.dp = dp  # data-parallel runs: this rank's part (its device, the DDP wrapper)
        # lora-kernel: the plan policy of this run (LORA_BENCH_KERNEL_MODE may force a plan), and
        # the plans its layers run, noted while the loop runs
        self.kernel_policy = policy_from_env(current_policy())
        self.kernel_plans = PlanLog()
        self.device = dp.device if dp is not None else resolve_device(cfg.device)
        set_precision(cfg)
        mcfg = model_config(cfg)
        raw = Path(cfg.data_file) if cfg.data_file else ensure_sms_spam(cache_dir, progress=progress)
        splits = cached_splits(raw, cache_dir)
        if cfg.implementation == "hf":  # transformers' GPT-2 (and PEFT): its Conv1D layers are not nn.Linear
            self.model = build_hf_classifier(cfg, cache_dir=cache_dir, progress=progress)
            cast = cast_frozen_hf
        else:
            self.model = build_classifier(cfg, cache_dir=cache_dir, progress=progress)
            cast = cast_frozen
        self.trainable_params = count_params(self.model, trainable_only=True)
        self.total_params = count_params(self.model)
        if cfg.precision == "bf16":
            cast(self.model, torch.bfloat16)
        self.model.to(self.device)
        if cfg.trainable_layers == "lora-kernel" and cfg.group_qkv and self.device.type == "cuda":
            group_qkv(self.model)  # after .to(), which gives every parameter its own storage
        self.loaders = build_loaders(splits, gpt2_tokenizer(), context_length=cfg.context_length,
                                     model_context=mcfg.context_length, batch_size=cfg.batch_size,
                                     no_padding=cfg.no_padding)
        self.mcfg = mcfg
        torch.manual_seed(cfg.seed)
        opt_kw: dict = {"fused": True} if cfg.optimizer == "fused" else {}
        if cfg.cuda_graphs:
            opt_kw["capturable"] = True
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.learning_rate,
                                           weight_decay=cfg.weight_decay, **opt_kw)
        self.amp = amp_context(cfg, self.device)
        if cfg.compile:
            # Runs in one process (inline sweeps) share dynamo's caches; compiled code of earlier
            # models would pile up to the recompile limit, after which dynamo silently runs eager.
            torch._dynamo.reset()
        if dp is not None:  # blocks compile inside DDP; a whole-model compile wraps DDP
            if cfg.compile and cfg.compile_scope == "blocks":
                compile_model(self.model, "blocks")
            wrapped = dp.wrap(self.model, timed=cfg.timing != "off", bucket_mb=cfg.ddp_bucket_mb,
                              cuda_graphs=cfg.cuda_graphs)
            self.forward_model = (compile_model(wrapped, "model") if cfg.compile and cfg.compile_scope == "model"
                                  else wrapped)
        else:
            self.forward_model = compile_model(self.model, cfg.compile_scope) if cfg.compile else self.model
        self.eval_model = self.forward_model
        if cfg.cuda_graphs and self.device.type == "cuda":
            self.eval_model = GraphedEval(self.forward_model)

    def loop_settings(self) -> LoopSettings:
        c = self.cfg
        return LoopSettings(num_epochs=c.num_epochs, eval_freq=c.eval_freq, eval_iter=c.eval_iter,
                            accumulation_steps=c.accumulation_steps, token_pos=c.trainable_token_pos,
                            ignore_index=c.ignore_index, average_embeddings=c.average_embeddings,
                            max_steps=c.max_steps)

    def backend(self) -> str:
        """The lora-kernel plans the training step's layers ran, as recorded while the loop ran
        (``kernel_plans``), e.g. 'cpp', 'cpp-direct', 'triton', 'cublas', 'torch', or 'cpp+triton'
        when layers differ (1558M's MLP under CUDA graphs; the head left out of a block-scoped
        compile). '' for other trainable-layer settings, or before any training step ran."""
        if self.cfg.trainable_layers != "lora-kernel":
            return ""
        return self.kernel_plans.backend()


def final_accuracies(ctx: RunContext) -> dict[str, float]:
    kw = dict(token_pos=ctx.cfg.trainable_token_pos, average_embeddings=ctx.cfg.average_embeddings, amp=ctx.amp)
    out = {}
    with use_policy(ctx.kernel_policy):
        for name, loader in (("train", ctx.loaders.train), ("val", ctx.loaders.val), ("test", ctx.loaders.test)):
            out[f"{name}_acc"] = calc_accuracy_loader(loader, ctx.eval_model, ctx.device, **kw) * 100
    return out


class RaiseOnSignal:
    """While a run executes: the first SIGINT, SIGTERM or SIGHUP raises Interrupted (a
    KeyboardInterrupt) in the main thread, so the run is recorded as interrupted whichever signal
    ended it; later signals are ignored until the record is written, so a second Ctrl-C cannot
    tear it. SIGHUP stays ignored when the process was started so (``nohup``)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self) -> "RaiseOnSignal":
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for s in TERMINATING_SIGNALS:
                if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN:
                    self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            raise Interrupted(signum)

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _existing_run(results_dir: Path, run_id: str) -> dict | None:
    """The recorded row of ``run_id`` in this results folder (run.json, else runs.csv), if any."""
    row = run_record(results_dir / run_id)
    if row is not None:
        return row
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
    old = _existing_run(results_dir, run_id)
    if old is not None:
        raise UsageError(f"run id {run_id!r} already exists in {results_dir} (status {old.get('status')}, "
                         f"started {old.get('started_at') or '?'}); choose another --run-id, or pass "
                         "--overwrite to replace it")


def rank_settings(cfg: TrainConfig, env: RankEnv | None) -> TrainConfig:
    """The settings a rank of a data-parallel job runs: ``nproc`` is the job's world size (a job
    started by torchrun itself, leaving ``nproc`` at 1, records it too); any other value is refused."""
    if env is None:
        if cfg.nproc > 1:
            raise UsageError(f"nproc={cfg.nproc}: a data-parallel run starts under torchrun; run it with "
                             f"lora-bench train --nproc {cfg.nproc} (a sweep runs each run in one process)")
        return cfg
    if cfg.nproc == 1:
        return cfg.replace(nproc=env.world_size)
    if cfg.nproc != env.world_size:
        raise UsageError(f"nproc={cfg.nproc} but torchrun started {env.world_size} processes (WORLD_SIZE); "
                         "leave nproc unset under torchrun, or set it to the world size")
    return cfg


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
    require_packages(cfg)  # before any row: a missing optional package is a usage error, not a failed run
    main = env is None or env.is_main
    console = console or Console()
    if not main:
        console, progress = Console(quiet=True), False
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    results_dir = Path(results_dir)
    run_id = run_id or make_run_id(cfg)
    if not RUN_ID_RE.match(run_id):
        raise UsageError(f"run id {run_id!r}: use letters, digits, '.', '_' and '-', starting with a letter or "
                         "digit (it names a folder inside the results folder)")
    why = check_writable_dir(cache_dir)
    if why:
        raise UsageError(f"cache folder {cache_dir}: {why}; pass a writable --cache-dir")
    run_dir = results_dir / run_id
    held = None
    if main:
        check_results_dir(results_dir)
        held = claim if claim is not None else claim_run(run_dir)
    try:
        if main:
            if not overwrite:
                refuse_existing_run(results_dir, run_id)
            # a stale record of an earlier attempt must not be mistaken for this attempt's
            (run_dir / RUN_RECORD).unlink(missing_ok=True)
        with RaiseOnSignal() if handle_signals else contextlib.nullcontext():
            return _execute(cfg, results_dir=results_dir, run_id=run_id, console=console, progress=progress,
                            cache_dir=cache_dir, extra=extra, env=env)
    finally:
        if held is not None and claim is None:
            held.release()


def _execute(cfg: TrainConfig, *, results_dir: Path, run_id: str, console: Console, progress: bool,
             cache_dir: Path, extra: dict | None, env: RankEnv | None = None) -> dict:
    main = env is None or env.is_main
    if main:
        record_invocation(results_dir, run_ids=[run_id])
    run_dir = results_dir / run_id
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    row: dict = {"run_id": run_id, "status": "running", "started_at": started, **cfg_columns(cfg),
                 **_peer_versions(cfg), **(extra or {}), "world_size": env.world_size if env is not None else 1}
    dp = None
    ctx = None
    timer = None
    steps: list[dict] | None = None  # the per-step rows, built once
    log: list[str] = []
    curves: dict = {}

    def say(msg: str) -> None:
        log.append(msg)
        console.print(msg, highlight=False)

    try:
        if env is not None:
            dp = DataParallel.start(env, device=cfg.device, batch_size=cfg.batch_size, cuda_graphs=cfg.cuda_graphs)
        ctx = RunContext(cfg, cache_dir=cache_dir, progress=progress, dp=dp)
        row.update(trainable_params=ctx.trainable_params, total_params=ctx.total_params, device=str(ctx.device),
                   **environment(ctx.device))
        timer = (dp.phase_timer(cfg.timing, warmup_steps=cfg.warmup_steps) if dp is not None
                 else PhaseTimer(cfg.timing, ctx.device, warmup_steps=cfg.warmup_steps))
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        profiler = Profiler(cfg.profile if main else "none", run_dir=run_dir, warmup_steps=cfg.warmup_steps,
                            device=ctx.device)
        step_fn = None
        if cfg.cuda_graphs:
            step_fn = GraphedStep(ctx, timer=timer)
        total = (cfg.max_steps if cfg.max_steps else cfg.num_epochs * len(ctx.loaders.train))
        with (TrainProgress(console, total=total, enabled=progress, timer=timer) as bar,
              use_policy(ctx.kernel_policy), record_plans(ctx.kernel_plans)):
            on_step = profiler.chain(bar.update)
            timer.label_phases = profiler.labels_phases
            result: TrainResult = profiler.run(
                train_classifier, ctx.forward_model, ctx.loaders.train, ctx.loaders.val, ctx.optimizer, ctx.device,
                settings=ctx.loop_settings(), timer=timer, amp=ctx.amp, step_fn=step_fn, on_step=on_step,
                eval_model=ctx.eval_model, shard=dp.shard if dp is not None else None, say=say)
        if dp is not None:  # collective: every rank, right after the loop
            row.update(dp.gather(timer))
        row["backend"] = ctx.backend()  # what the layers ran (recorded while the loop ran)
        if step_fn is not None:
            row.update(step_fn.record())
        curves.update(train_losses=result.train_losses, val_losses=result.val_losses,
                      train_accs=result.train_accs, val_accs=result.val_accs)
        row.update(steps=result.steps, training_time_s=result.training_time_s,
                   training_time_min=result.training_time_s / 60,
                   final_train_loss=result.train_losses[-1] if result.train_losses else None,
                   final_val_loss=result.val_losses[-1] if result.val_losses else None)
        say(f"Training completed in {result.training_time_s / 60:.2f} minutes.")
        if not cfg.skip_final_eval:
            accs = final_accuracies(ctx)
            row.update(accs)
            say(f"Training accuracy: {accs['train_acc']:.2f}%")
            say(f"Validation accuracy: {accs['val_acc']:.2f}%")
            say(f"Test accuracy: {accs['test_acc']:.2f}%")
        profiler.finish(console)
        steps = timer.step_rows(run_id) if timer.enabled else []
        row.update(_summary(ctx, timer, cfg, steps))
        row["status"] = "done"
        return row
    except BaseException as e:  # record, then re-raise: nothing is lost, nothing is swallowed
        interrupted = isinstance(e, KeyboardInterrupt)
        row["status"] = "interrupted" if interrupted else "failed"
        if isinstance(e, Interrupted):
            row["error"] = str(e)[:2000]
        elif interrupted:
            row["error"] = "interrupted by SIGINT"
        else:
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        raise
    finally:
        if main:
            _record(row, ctx=ctx, timer=timer, steps=steps, cfg=cfg, run_id=run_id, run_dir=run_dir,
                    results_dir=results_dir, log=log, curves=curves, console=console)
        # a data-parallel run keeps its process group: the rank's process ends without tearing it
        # down (distributed.exit_rank), and a later run in this process joins the same group


def _record(row: dict, *, ctx: RunContext | None, timer: PhaseTimer | None, steps: list[dict] | None,
            cfg: TrainConfig, run_id: str, run_dir: Path, results_dir: Path, log: list[str], curves: dict,
            console: Console) -> None:
    """Write the run's steps.csv, run.json and runs.csv row, whatever state the run ended in."""
    if timer is not None and timer.enabled:
        try:
            if steps is None:  # the run stopped before its summary
                steps = timer.step_rows(run_id)
                if row["status"] == "interrupted" and ctx is not None:
                    row.setdefault("steps", len(steps))
                    row.update(_summary(ctx, timer, cfg, steps))  # what was measured so far
            write_csv(run_dir / STEPS_CSV, steps, [c.name for c in STEP_COLUMNS])
        except RuntimeError as err:  # a dead CUDA context cannot resolve events; keep the row
            row["error"] = (row.get("error") or "") + f" (steps not saved: {err})"
    row["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    atomic_write_text(run_dir / RUN_RECORD, json.dumps({"row": row, "log": log, **curves}, indent=1, default=str))
    upsert_run(results_dir / "runs.csv", row)
    if row["status"] == "interrupted":
        console.print(f"{row['error']} after {row.get('steps') or 0} step(s): recorded as interrupted "
                      f"(run_id {run_id}); results: {results_dir / 'runs.csv'}, files: {run_dir}",
                      highlight=False)


def _peer_versions(cfg: TrainConfig) -> dict:
    """The versions of transformers, PEFT, safetensors and huggingface_hub, for a run that uses them."""
    if cfg.implementation == "book" and cfg.weights_source == "openai":
        return {}
    return {f"{name}_version": version for name, version in package_versions().items()}


def _summary(ctx: RunContext, timer: PhaseTimer, cfg: TrainConfig, steps: list[dict]) -> dict:
    out: dict = {"timing_clock": timer.clock, "eval_s": timer.eval_ms / 1e3 if timer.enabled else None}
    if ctx.device.type == "cuda":
        out["peak_mem_allocated_mib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
        out["peak_mem_reserved_mib"] = torch.cuda.max_memory_reserved(ctx.device) / 2**20
    if not timer.enabled:
        return out
    s = summarise_steps(steps, clock=timer.clock)
    out.update(s)
    if "step_ms_median" in s:
        tokens = s["tokens_per_step"]
        step_s = s["step_ms_median"] / 1e3
        flops = flops_per_step(ctx.mcfg, trainable_layers=cfg.trainable_layers, tokens=tokens, rank=cfg.lora_rank,
                               implementation=cfg.implementation)
        out.update(tokens_per_s=tokens / step_s, flops_per_step=flops, achieved_tflops=flops / step_s / 1e12)
        if ctx.device.type == "cuda":
            peak = peak_tflops(torch.cuda.get_device_name(ctx.device), cfg.precision)
            gpus = ctx.dp.env.world_size if ctx.dp is not None else 1  # the global step ran on every rank's GPU
            if peak:
                out.update(peak_tflops=peak, mfu=out["achieved_tflops"] / (peak * gpus))
    return out

