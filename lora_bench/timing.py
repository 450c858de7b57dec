"""Phase timing of training steps: device time from CUDA events recorded at phase boundaries
(resolved later, no synchronisation between phases), host time from ``perf_counter``.

Modes: ``events`` (default), ``sync`` (synchronise at every boundary: perturbing, for diagnosis),
``off`` (nothing recorded). On a CPU device the host clock is the only clock."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

PHASES = ("data", "forward", "backward", "optimizer")
HOST_PROBE_OPS = 200  # per block: far below CUDA's launch queue (about a thousand), so no launch waits
HOST_PROBE_BLOCKS = 5


def host_op_us(device: torch.device, *, ops: int = HOST_PROBE_OPS, blocks: int = HOST_PROBE_BLOCKS) -> float:
    """The host's time for one small tensor op on ``device``, in µs: the median over ``blocks``
    blocks of ``ops`` in-place adds to a one-element tensor, after one block of warm-up. On a GPU
    the adds are launched asynchronously and the device is synchronised between blocks, outside
    the clock, so this is the host's cost of one kernel launch through torch's dispatcher: what a
    host-bound step pays per kernel. Two machines that report the same CPU model can differ in it
    (clock, neighbours, power state), and so in every host-bound step time."""
    x = torch.ones(1, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    per_op = []
    for block in range(blocks + 1):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(ops):
            x.add_(1.0)
        t = time.perf_counter() - t0
        if block:
            per_op.append(t / ops * 1e6)
    sync(device)
    return statistics.median(per_op)


@dataclass
class StepRecord:
    step: int
    epoch: int
    tokens: int
    warmup: bool
    host_ms: list[float]  # per phase
    events: list | None = None  # len(PHASES)+1 CUDA events (boundaries)
    device_ms: list[float] | None = None
    loss: object = None  # a detached 0-dim tensor until resolved, then a float


@dataclass
class PhaseTimer:
    """Call ``begin(step, ...)``, then ``mark(phase)`` after each phase in PHASES order."""

    mode: str
    device: torch.device
    warmup_steps: int = 0
    records: list[StepRecord] = field(default_factory=list)
    eval_ms: float = 0.0
    _pending: list[StepRecord] = field(default_factory=list)
    _cur: StepRecord | None = None
    _t: float = 0.0
    _i: int = 0
    label_phases: bool = False  # open a profiler range per phase (``phase:<name>``)
    _range: object = None

    def __post_init__(self):
        self.cuda = self.device.type == "cuda"
        self.enabled = self.mode != "off"

    @property
    def clock(self) -> str:
        if not self.enabled:
            return "off"
        if not self.cuda:
            return "host"
        return "cuda_sync" if self.mode == "sync" else "cuda_events"

    def _event(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def begin(self, *, step: int, epoch: int) -> None:
        if not self.enabled:
            return
        if self.mode == "sync" and self.cuda:
            torch.cuda.synchronize(self.device)
        rec = StepRecord(step=step, epoch=epoch, tokens=0, warmup=step < self.warmup_steps,
                         host_ms=[0.0] * len(PHASES))
        if self.cuda:
            rec.events = [self._event()]
        self._cur, self._i, self._t = rec, 0, time.perf_counter()
        if self.label_phases:
            self._open(PHASES[0])

    def _open(self, name: str) -> None:
        self._range = torch.autograd.profiler.record_function(f"phase:{name}")
        self._range.__enter__()

    def _close(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def mark(self, phase: str) -> None:
        rec = self._cur
        if rec is None:
            return
        if self.mode == "sync" and self.cuda:
            torch.cuda.synchronize(self.device)
        if rec.events is not None:
            rec.events.append(self._event())
        now = time.perf_counter()
        rec.host_ms[self._i] = (now - self._t) * 1e3
        self._t = now
        self._i += 1
        if self.label_phases:
            self._close()
            if self._i < len(PHASES):
                self._open(PHASES[self._i])

    def end(self, loss: torch.Tensor | None, *, tokens: int) -> None:
        rec = self._cur
        if rec is None:
            return
        rec.tokens = tokens
        if loss is None:
            rec.loss = None
        else:  # on the CPU reading is free; on CUDA it waits for a sync point
            rec.loss = loss.detach() if self.cuda else float(loss.detach())
        self._pending.append(rec)
        self._cur = None
        self._resolve_ready()

    def _resolve_ready(self, *, wait: bool = False) -> None:
        """Resolve finished steps in order; ``query`` never blocks, so the hot loop stays sync-free."""
        while self._pending:
            rec = self._pending[0]
            if rec.events is not None:
                if not wait and not rec.events[-1].query():
                    return
                if wait:
                    rec.events[-1].synchronize()
                rec.device_ms = [a.elapsed_time(b) for a, b in zip(rec.events, rec.events[1:])]
                rec.events = None
            else:
                rec.device_ms = list(rec.host_ms)
            self.records.append(self._pending.pop(0))

    def sync_point(self) -> None:
        """At places that synchronise anyway (evaluation, end of training): resolve everything and
        read the losses with one transfer."""
        if not self.enabled:
            return
        self._resolve_ready(wait=True)
        todo = [r for r in self.records if isinstance(r.loss, torch.Tensor)]
        if todo:
            values = torch.stack([r.loss.float() for r in todo]).tolist()
            for r, v in zip(todo, values):
                r.loss = v

    # -- evaluation is timed apart from steps --------------------------------------------------
    def eval_begin(self):
        if not self.enabled:
            return None
        return (self._event() if self.cuda else None, time.perf_counter())

    def eval_end(self, token) -> None:
        if token is None:
            return
        ev0, t0 = token
        if self.cuda and self.mode != "sync":
            ev1 = self._event()
            ev1.synchronize()
            self.eval_ms += ev0.elapsed_time(ev1)
        else:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.eval_ms += (time.perf_counter() - t0) * 1e3

    # -- output ----------------------------------------------------------------------------------
    def step_rows(self, run_id: str) -> list[dict]:
        self.sync_point()
        rows = []
        for r in self.records:
            row = {"run_id": run_id, "step": r.step, "epoch": r.epoch, "warmup": r.warmup}
            for name, v in zip(PHASES, r.device_ms):
                row[f"{name}_ms"] = v
            row["step_ms"] = sum(r.device_ms)
            for name, v in zip(PHASES, r.host_ms):
                row[f"host_{name}_ms"] = v
            row["host_step_ms"] = sum(r.host_ms)
            row["tokens"] = r.tokens
            row["loss"] = r.loss
            rows.append(row)
        return rows
