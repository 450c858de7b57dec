"""DoRA's norms formed ahead: the ``dora_norm_launch="ahead"`` setting of ``lora-kernel`` DoRA layers.

A fused DoRA layer's norm n_j = ‖W_j + s·(A·B)_j‖ (and what its backward reads) does not depend on
the layer's input, only on W, A, B and m. With its norm inline a layer call runs, one after the
other on the step's stream, the norm's first launch (W·A), the LoRA op and the launch that finishes
the norm and scales z. Ahead, a hook at the start of the model's forward launches every layer's
norm (both of its launches, ``dora_triton.dora_norm``) on one side stream per device, each followed
by an event; a layer call then waits for its own norm's event and launches only its LoRA op, whose
GEMM scales its output in the epilogue (``lora_triton_scaled.lora_fwd_scaled``, ``EpilogueScale``) where the
op runs the fused plan, else the scale after it (``dora_triton.dora_scale``); so the norms run beside
the main stream's GEMMs instead of between them. A hook at the end of the forward makes the step's
stream wait for the side stream, so a captured forward joins every stream it forked. Under CUDA
graphs the fork, the events and the join are captured as edges of the forward's graph.

A norm is used only by the call it was formed for: the layer's (or group's) parameters must still
be at the versions they had when it was launched, else the layer forms its norm itself, as it does
where the norm was not formed ahead (the CPU, torch.compile, a call outside the model's forward).
Query, key and value grouped (``lora.kernel.group_layers``) form their three norms as one.
How and why: docs/variants.md#dora-norms-formed-ahead.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from lora_bench.kernels.dora import triton_norm, triton_refusal
from lora_bench.kernels.plan_names import DORA_NORM_AHEAD as AHEAD
from lora_bench.kernels.policy import note_dora
from lora_bench.kernels.segments import stacked

COUNTS = {"formed": 0, "used": 0}  # norms launched ahead and used by their call, since import (tests read them)
USED = "triton: the norm formed ahead"  # the plan log's note of a call that used one
_SIDE: dict[int, torch.cuda.Stream] = {}  # one side stream per CUDA device


@dataclasses.dataclass
class _Pending:
    params: tuple[torch.Tensor, ...]  # what the norm read (each layer's W, A, B, m): their versions must not move
    versions: tuple[int, ...]
    outputs: tuple[torch.Tensor, ...]  # n, g, cn, vᵀ
    event: object  # torch.cuda.Event on the side stream, or None on the interpreter's CPU


_PENDING: dict[int, _Pending] = {}  # by id of the layer or group the norm was formed for
_FORKED: set[torch.device] = set()  # devices whose side stream has norms the step's stream has not joined


@dataclasses.dataclass(frozen=True)
class _Unit:
    """One layer, or one group of layers side by side, whose norm forms in one ``dora_norm`` call."""

    owner: object  # the LinearWithDoRAKernel or the DoRASideBySide
    layers: tuple  # its LinearWithDoRAKernel layers

    def operands(self):
        """(W, A, B, m, scale) as ``dora_norm`` takes them, or None where this call cannot form its
        norm on the Triton path (it then forms it itself, or runs torch ops)."""
        first = self.layers[0]
        w, a = first.linear.weight, first.lora.A
        if triton_refusal(w, a) is not None:
            return None
        if len(self.layers) == 1:
            return w, a, first.lora.B, first.m, first.lora.alpha
        ws = stacked([m.linear.weight for m in self.layers])
        a3, b3 = stacked([m.lora.A for m in self.layers]), stacked([m.lora.B for m in self.layers])
        m3 = stacked([m.m for m in self.layers])
        if ws is None or a3 is None or b3 is None or m3 is None or not triton_norm().segments_fit(w.shape[0], w.device):
            return None
        return ws.reshape(-1, w.shape[1]), a3, b3, m3.reshape(-1), first.lora.alpha

    def watched(self) -> tuple[torch.Tensor, ...]:
        """The parameters the norm reads, each layer's own (a view's version counter is not its
        layer's: each parameter of a group counts its own writes)."""
        return tuple(t for m in self.layers for t in (m.linear.weight, m.lora.A, m.lora.B, m.m))


def install(model: torch.nn.Module, owners: list[tuple[object, tuple]]) -> int:
    """Form the norms of ``model``'s fused DoRA layers ahead at each forward (module docstring):
    hooks on ``model`` itself. ``owners``: (the layer or group whose call takes the norm, its
    layers), one per norm (``lora.kernel.install_norms_ahead`` finds them). Returns how many norms
    form per forward (0: nothing installed)."""
    found = [_Unit(owner, tuple(layers)) for owner, layers in owners]
    if not found:
        return 0
    model.register_forward_pre_hook(lambda mod, args: _launch(found))
    model.register_forward_hook(lambda mod, args, out: _join(found))
    return len(found)


def _side(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE:
        _SIDE[idx] = torch.cuda.Stream(device=idx)
    return _SIDE[idx]


def _launch(found: list[_Unit]) -> None:
    """The forward's start: every unit's norm launched (on the side stream on CUDA), after what the
    step's stream has queued so far (the optimizer's update of A, B and m)."""
    _join(found)  # a forward that raised left its norms behind
    if torch.compiler.is_compiling():
        return
    dora_triton = triton_norm()
    work = [(u, ops) for u in found if (ops := u.operands()) is not None]
    if not work:
        return
    cuda = work[0][1][0].is_cuda
    main = torch.cuda.current_stream(work[0][1][0].device) if cuda else None
    side = _side(work[0][1][0].device) if cuda else None
    # room for the outputs on the step's stream: freed there, after the layer has waited for them
    outputs = [dora_triton.norm_outputs(ops[0], ops[1].shape[-1]) for _, ops in work]
    if cuda:
        side.wait_stream(main)
        _FORKED.add(work[0][1][0].device)
    for (unit, (w, a, b, m, scale)), out in zip(work, outputs):
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            dora_triton.dora_norm(w, a, b, m, float(scale), out)
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record(side)
        params = unit.watched()
        _PENDING[id(unit.owner)] = _Pending(params, tuple(p._version for p in params), out, event)
        COUNTS["formed"] += 1


def take(owner) -> tuple[torch.Tensor, ...] | None:
    """The norm formed ahead for this layer or group's call (n, g, cn, vᵀ), the step's stream made
    to wait for it; None where none was formed or its parameters changed since (the call forms its
    own)."""
    pending = _PENDING.pop(id(owner), None)
    if pending is None or torch.compiler.is_compiling():
        return None
    if tuple(p._version for p in pending.params) != pending.versions:
        return None
    if pending.event is not None:
        torch.cuda.current_stream(pending.outputs[0].device).wait_event(pending.event)
    COUNTS["used"] += 1
    note_dora(USED)
    return pending.outputs


SCALED = "triton: the norm formed ahead, the scale in the LoRA GEMM"  # the plan log's note of such a call


@dataclasses.dataclass
class EpilogueScale:
    """A call's request that its LoRA op, where it runs the fused plan, scale its output in the GEMM's
    epilogue by the g formed ahead (y = g ⊙ z + b, ``lora_triton_scaled.lora_fwd_scaled``): g and the bias it
    reads, then y once written; else ``why`` it was not."""

    g: torch.Tensor
    bias: torch.Tensor | None
    y: torch.Tensor | None = None
    why: str | None = None


def epilogue(norm: tuple | None, bias: torch.Tensor | None) -> EpilogueScale | None:
    """The ``EpilogueScale`` of a call that took a norm formed ahead (``take``), else None."""
    return None if norm is None else EpilogueScale(norm[1], bias)


def with_scaled(norm: tuple | None, request: EpilogueScale | None) -> tuple | None:
    """The norm for ``dora.DoRAFunction`` (or ``DoRASegmentsFunction``): with y where the GEMM's
    epilogue scaled it (noted ``SCALED``), as taken where it did not (the scale then one launch)."""
    if request is None or request.y is None:
        return norm
    note_dora(SCALED)
    return (*norm, request.y)


def _join(found: list[_Unit]) -> None:
    """The forward's end: the step's stream waits for the side stream (a captured forward joins
    what it forked), and norms no call took are dropped."""
    for unit in found:
        _PENDING.pop(id(unit.owner), None)
    while _FORKED:
        dev = _FORKED.pop()
        torch.cuda.current_stream(dev).wait_stream(_side(dev))


__all__ = ["AHEAD", "COUNTS", "SCALED", "EpilogueScale", "epilogue", "install", "take", "with_scaled"]
