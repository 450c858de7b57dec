"""Data-parallel training, one process per GPU (torch DistributedDataParallel), set up from the
environment torchrun gives each process: each rank trains its slice of the same global batch, so
every update equals the one-process update up to reduction order; the all-reduce is timed per
bucket. The contract in full: docs/data-parallel.md."""

from __future__ import annotations

import contextlib
import datetime as dt
import inspect
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, NoReturn

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lora_bench.errors import UsageError
from lora_bench.fileio import atomic_write_text
from lora_bench.timing import PhaseTimer

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GRAPH_CAPTURE_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
GRAPH_WARMUP_ITERS = 11  # eager DDP iterations before a capture (torch's notes on CUDA graphs with DDP)
RANK_ERRORS_ENV = "LORA_BENCH_RANK_ERRORS"  # folder where a failing rank leaves rank<R>.json
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
QUIESCE_S = 0.5  # how long ``close`` lets gloo's worker threads finish before destroying the group
DEFAULT_TIMEOUT_S = 600.0  # a collective waiting longer than this fails (torch's NCCL default)


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the job, as torchrun describes it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_env(environ: Mapping[str, str] | None = None) -> RankEnv | None:
    """The torchrun environment, or None when this process was not started by torchrun."""
    environ = os.environ if environ is None else environ
    if "WORLD_SIZE" not in environ:
        return None
    missing = [k for k in TORCHRUN_VARS if not environ.get(k)]
    if missing:
        raise UsageError(f"WORLD_SIZE is set but {', '.join(missing)} is not: start data-parallel runs with "
                         "torchrun (or lora-bench train --nproc N)")
    ints = {}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        text = environ.get(key, environ["WORLD_SIZE"] if key == "LOCAL_WORLD_SIZE" else "")
        try:
            ints[key] = int(text)
        except ValueError:
            raise UsageError(f"{key}={text!r} is not a whole number") from None
    env = RankEnv(rank=ints["RANK"], world_size=ints["WORLD_SIZE"], local_rank=ints["LOCAL_RANK"],
                  local_world_size=ints["LOCAL_WORLD_SIZE"], master_addr=environ["MASTER_ADDR"],
                  master_port=ints["MASTER_PORT"])
    if env.world_size < 1 or not 0 <= env.rank < env.world_size or not 0 <= env.local_rank < env.local_world_size:
        raise UsageError(f"RANK={env.rank}, LOCAL_RANK={env.local_rank} do not fit WORLD_SIZE={env.world_size}, "
                         f"LOCAL_WORLD_SIZE={env.local_world_size}")
    return env


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def check_global_batch(batch_size: int, world_size: int) -> None:
    """Each rank takes an equal contiguous slice of the global batch."""
    if world_size < 1:
        raise UsageError(f"--nproc {world_size}: use at least 1 process")
    if batch_size % world_size:
        fits = [n for n in range(1, batch_size + 1) if batch_size % n == 0]
        raise UsageError(f"--batch-size {batch_size} does not split over {world_size} processes: the batch size is "
                         f"the global batch and each process takes an equal slice; use a batch size divisible by "
                         f"{world_size}, or --nproc one of {', '.join(map(str, fits))}")


def rank_slice(batch_size: int, env: RankEnv) -> slice:
    check_global_batch(batch_size, env.world_size)
    k = batch_size // env.world_size
    return slice(env.rank * k, (env.rank + 1) * k)


def rank_device(env: RankEnv, requested: str) -> torch.device:
    """The device of this rank: the GPU of its local rank, or the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if requested not in ("auto", "cuda"):
        raise UsageError(f"device={requested!r} with several processes: each process uses the GPU of its local "
                         "rank (cuda:LOCAL_RANK); pass --device cuda, auto or cpu")
    if not torch.cuda.is_available():
        raise UsageError("device='cuda' but CUDA is not available here; use --device cpu or auto")
    count = torch.cuda.device_count()
    pinned = count == 1 and len(os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")) == 1 \
        and env.local_world_size > 1  # a launcher that gives each process its own single GPU
    index = 0 if pinned else env.local_rank
    if index >= count:
        raise UsageError(f"{env.local_world_size} processes on this host but only {count} CUDA device(s); "
                         f"use --nproc {count} or fewer")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


@contextlib.contextmanager
def rank_errors(env: RankEnv | None):
    """Leave this rank's error (with the time it happened) where the launcher looks for it: the
    first rank to fail is the cause, the others' errors (closed connections, SIGTERM) follow."""
    try:
        yield
    except BaseException as e:
        folder = os.environ.get(RANK_ERRORS_ENV)
        if env is not None and folder and not (isinstance(e, SystemExit) and e.code in (0, None)):
            record = {"rank": env.rank, "local_rank": env.local_rank, "time": time.time(),
                      "interrupted": isinstance(e, KeyboardInterrupt),
                      "error": f"{type(e).__name__}: {e}"[:2000],
                      "traceback": traceback.format_exc()[-8000:]}
            with contextlib.suppress(OSError):
                atomic_write_text(Path(folder) / f"rank{env.rank}.json", json.dumps(record, indent=1))
        raise


# -- the all-reduce timer ----------------------------------------------------------------------
@dataclass
class _StepComm:
    step: int
    ref: object  # CUDA event or perf_counter seconds at the step's start
    buckets: list = field(default_factory=list)  # [ready, finished] per bucket (events or seconds)
    stats: tuple[float, float, int] | None = None


class AllReduceTimer:
    """DDP communication hook with the default's mathematics (divide by the world size, all-reduce
    the sum), timing each bucket from its gradients' readiness to its all-reduce's end."""

    def __init__(self, *, device: torch.device, world_size: int, process_group=None):
        self.cuda = device.type == "cuda"
        self.world_size = world_size
        self.group = process_group
        self.steps: list[_StepComm] = []
        self._cur: _StepComm | None = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def begin_step(self, step: int) -> None:
        self._cur = _StepComm(step=step, ref=self._now())
        self.steps.append(self._cur)

    def hook(self, state, bucket):  # unannotated: DDP checks annotations, and these are strings here
        entry = [self._now(), None]
        if self._cur is not None:
            self._cur.buckets.append(entry)
        tensor = bucket.buffer()
        tensor.div_(self.world_size)
        fut = dist.all_reduce(tensor, group=self.group, async_op=True).get_future()

        def finished(f):
            # on CUDA this runs on a stream that waits for the collective: the event marks its end
            entry[1] = self._now()
            return f.value()[0]

        return fut.then(finished)

    def _ms(self, ref, t) -> float:
        return ref.elapsed_time(t) if self.cuda else (t - ref) * 1e3

    def step_stats(self) -> dict[int, tuple[float, float, int]]:
        """step -> (allreduce_ms, allreduce_exposed_ms, buckets); call once the device is idle."""
        out = {}
        for s in self.steps:
            if s.stats is None:
                spans = sorted((self._ms(s.ref, a), self._ms(s.ref, b)) for a, b in s.buckets if b is not None)
                s.stats = (_union(spans), max(0.0, max(b for _, b in spans) - max(a for a, _ in spans))
                           if spans else 0.0, len(spans))
                s.ref, s.buckets = None, []  # events resolved: release them
            out[s.step] = s.stats
        return out


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in spans:  # sorted by start
        if b > end:
            total += b - max(a, end)
            end = b
    return total


@dataclass
class DdpPhaseTimer(PhaseTimer):
    """The phase timer of a data-parallel run: each step's all-reduce intervals beside its phases."""

    allreduce: AllReduceTimer | None = None

    def begin(self, *, step: int, epoch: int) -> None:
        super().begin(step=step, epoch=epoch)
        if self.enabled and self.allreduce is not None:
            self.allreduce.begin_step(step)

    def step_rows(self, run_id: str) -> list[dict]:
        rows = super().step_rows(run_id)
        if self.allreduce is not None:
            stats = self.allreduce.step_stats()
            for row in rows:
                ms, exposed, n = stats.get(row["step"], (None, None, None))
                row.update(allreduce_ms=ms, allreduce_exposed_ms=exposed, allreduce_buckets=n)
        return rows


# -- one rank's part in a run -------------------------------------------------------------------
class DataParallel:
    """Set-up, model wrapping, batch slicing and the end-of-run gathering of one rank."""

    def __init__(self, env: RankEnv, device: torch.device, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.env = env
        self.device = device
        self.timeout_s = timeout_s
        self.ddp: DDP | None = None
        self.allreduce: AllReduceTimer | None = None

    @classmethod
    def start(cls, env: RankEnv, *, device: str, batch_size: int, timeout_s: float = DEFAULT_TIMEOUT_S,
              cuda_graphs: bool = False) -> "DataParallel":
        """Check the batch, pin the device, join the process group (gloo on CPU, NCCL on CUDA).
        A step captured as CUDA graphs holds its all-reduces in the graph: NCCL's asynchronous
        error handling (a watchdog that queries the collectives' events) is turned off for it, as
        torch's notes on CUDA graphs with DDP ask; a failing rank still ends the job, through the
        launcher."""
        check_global_batch(batch_size, env.world_size)
        os.environ.update(NO_MULTICAST_ENV)  # before NCCL reads them, whoever launched this process
        if cuda_graphs:
            os.environ.update(GRAPH_CAPTURE_ENV)
        dev = rank_device(env, device)
        if not dist.is_initialized():
            kw = {"device_id": dev} if dev.type == "cuda" else {}
            host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
            dist.init_process_group(backend=backend_for(dev), init_method=f"tcp://{host}:{env.master_port}", rank=env.rank,
                                    world_size=env.world_size, timeout=dt.timedelta(seconds=timeout_s), **kw)
        return cls(env, dev, timeout_s=timeout_s)

    @property
    def is_main(self) -> bool:
        return self.env.is_main

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's contiguous slice of the global batch."""
        sl = rank_slice(inputs.shape[0], self.env)
        return inputs[sl], targets[sl]

    def wrap(self, model: torch.nn.Module, *, timed: bool = True, bucket_mb: float = 25.0,
             cuda_graphs: bool = False) -> torch.nn.Module:
        """DDP around ``model`` (its parameters are broadcast from rank 0). Buffers are constants
        (the causal mask), so they are not re-broadcast at every forward. The gradients are views
        into DDP's buckets (no copy into the buckets and back, no second copy of the gradients in
        memory); ``bucket_mb`` is DDP's ``bucket_cap_mb``.

        For a step captured as CUDA graphs, DDP is built on a side stream (torch's notes on CUDA
        graphs with DDP) and the all-reduces are DDP's own, captured in the backward graph: the
        timing hook's per-bucket events cannot be recorded inside a capture, so such a run has no
        all-reduce columns; its backward phase holds the exchange."""
        ids = [self.device.index] if self.device.type == "cuda" else None
        # torch >= 2.13 names the option forward_sync_buffers (broadcast_buffers is deprecated)
        sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
                else "broadcast_buffers")
        kw = dict(device_ids=ids, output_device=ids[0] if ids else None, bucket_cap_mb=bucket_mb,
                  gradient_as_bucket_view=True, **{sync: False})
        captured = cuda_graphs and self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if captured else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            self.ddp = DDP(model, **kw)
        if side is not None:
            torch.cuda.current_stream(self.device).wait_stream(side)
        if timed and not captured:
            self.allreduce = AllReduceTimer(device=self.device, world_size=self.env.world_size)
            self.ddp.register_comm_hook(None, self.allreduce.hook)
        return self.ddp

    def phase_timer(self, mode: str, *, warmup_steps: int) -> PhaseTimer:
        return DdpPhaseTimer(mode, self.device, warmup_steps=warmup_steps,
                             allreduce=self.allreduce if mode != "off" else None)

    def gather(self, timer: PhaseTimer) -> dict:
        """Collective, on every rank after the loop: the recorded step losses become the global
        batch's (mean over ranks); returns rank 0's extra result columns."""
        out: dict = {"world_size": self.env.world_size}
        if not timer.enabled:
            return out
        timer.sync_point()
        recs = timer.records
        losses = torch.tensor([float("nan") if r.loss is None else float(r.loss) for r in recs],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(losses)
        for r, v in zip(recs, (losses / self.env.world_size).tolist()):
            r.loss = None if v != v else v
        measured = [sum(r.device_ms) for r in recs if not r.warmup] or [sum(r.device_ms) for r in recs]
        mine = torch.tensor([statistics.median(measured) if measured else float("nan")],
                            dtype=torch.float64, device=self.device)
        per_rank = [torch.zeros_like(mine) for _ in range(self.env.world_size)]
        dist.all_gather(per_rank, mine)
        medians = [float(t) for t in per_rank]
        lo, hi = min(medians), max(medians)
        out.update(rank_step_ms_min=lo, rank_step_ms_max=hi, rank_step_spread_pct=(hi - lo) / lo * 100 if lo else None)
        if self.allreduce is not None:
            stats = self.allreduce.step_stats()
            kept = [stats[r.step] for r in recs if not r.warmup and r.step in stats] or list(stats.values())
            if kept:
                out.update(allreduce_ms_median=statistics.median(s[0] for s in kept),
                           allreduce_exposed_ms_median=statistics.median(s[1] for s in kept),
                           allreduce_buckets=int(statistics.median(s[2] for s in kept)))
        return out

    def close(self) -> None:
        """Leave the process group (library use; a rank of ``lora-bench train`` ends with
        ``exit_rank`` instead). gloo's worker threads release a finished collective's tensors,
        which takes the GIL, and a process group's destructor joins those threads holding the
        GIL: a group torn down while a worker still releases one deadlocks. So the references
        go first and the GIL is let go for a moment before the group is destroyed."""
        self.ddp = None
        self.allreduce = None
        time.sleep(QUIESCE_S)
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a rank's process now, with ``code``, skipping the interpreter's teardown: the process
    group's destructor can deadlock there (see ``DataParallel.close``), and the process only
    has its output left to flush."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
