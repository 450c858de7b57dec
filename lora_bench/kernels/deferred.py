"""Adapter gradients off the critical path: the ``adapter_grads="deferred"`` policy.

In a deferring layer's backward only grad_x (and the u it needs) runs on the caller's stream; the
adapter gradients (the plan's ``grad_ab``) run on one side stream per device, and the backward
pass joins them once, in a callback autograd runs when the whole pass has run (``_join``): it
accumulates each parameter's gradient as autograd does, makes the caller's streams wait, and drops
what the side stream read. On the CPU the adapter gradients run at the join. Calls refuse to defer
where that would be wrong, the reason noted in the plan log (``refusal``); a backward defers only
where autograd accumulates into A and B in this pass (``accumulating``), else it runs inline.
How and why: docs/kernel-design.md#adapter-gradients-off-the-critical-path."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from lora_bench.kernels.plan_names import ADAPTER_GRADS_DEFERRED, ADAPTER_GRADS_INLINE
from lora_bench.kernels.policy import current_policy, note_adapter_grads

DEFERRED = ADAPTER_GRADS_DEFERRED
COUNTS = {"deferred": 0, "joins": 0}  # layer backwards deferred and passes joined, since import
_PASSES: dict[tuple[int, torch.device], _Pass] = {}  # by autograd graph task and device
_SIDE: dict[int, torch.cuda.Stream] = {}  # one side stream per CUDA device
_LOCK = threading.Lock()
CPP_OP = f"{ADAPTER_GRADS_INLINE}: the C++ op (plans direct, cpp) runs them in its own backward"


def chosen(params: Sequence[torch.Tensor]) -> bool:
    """Whether a Python-plan layer call with these adapter parameters defers their gradients: the
    policy in force asks for it and nothing refuses it. Notes where they run (``PlanLog``)."""
    if current_policy().adapter_grads != DEFERRED:
        note_adapter_grads(ADAPTER_GRADS_INLINE)
        return False
    why = refusal(params)
    note_adapter_grads(DEFERRED if why is None else f"{ADAPTER_GRADS_INLINE}: {why}")
    return why is None


def refusal(params: Sequence[torch.Tensor]) -> str | None:
    """Why a layer call with these parameters cannot defer its adapter gradients (None: it can)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "a process group is initialized (data-parallel training hooks each parameter's gradient accumulator)"
    for p in params:
        if p.requires_grad and (p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)):
            return "a parameter has gradient hooks"
    return None


def accumulating(ctx, edges: Sequence[int]) -> bool:
    """Whether autograd accumulates, in the backward pass now running, into the leaves at ``edges``
    of ``ctx`` (positions among its forward's tensor inputs: ``ctx.next_functions``; an input that
    needs no gradient does not count)."""
    if torch.is_grad_enabled():  # create_graph: the gradients must be differentiable
        return False
    for i in edges:
        node = ctx.next_functions[i][0]
        if node is None:
            continue
        if not hasattr(node, "variable"):  # not a leaf: its gradient flows on through autograd
            return False
        try:
            if not torch._C._will_engine_execute_node(node):
                return False
        except RuntimeError:  # torch.autograd.grad asked for this leaf's gradient
            return False
    return True


def defer(ctx, edges: Sequence[int], compute: Callable[[], Sequence[torch.Tensor | None]], *,
          reads: Sequence[torch.Tensor], device: torch.device) -> None:
    """Run ``compute`` (the gradients of the leaves at ``edges``, in that order) off the caller's
    stream and accumulate them into the leaves when the backward pass joins; ``reads``: the tensors
    it reads, kept alive until then. Call only where ``accumulating``."""
    params = [None if ctx.next_functions[i][0] is None else ctx.next_functions[i][0].variable for i in edges]
    key = (torch._C._current_graph_task_id(), device)
    with _LOCK:
        p = _PASSES.get(key)
        if p is None:
            p = _PASSES[key] = _Pass(device)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _join(key))
        COUNTS["deferred"] += 1
    p.keep.append(tuple(reads))
    if p.side is None:
        p.work.append((params, compute))
        return
    main = torch.cuda.current_stream(device)
    if main not in p.mains:
        p.mains.append(main)
    p.side.wait_stream(main)
    with torch.cuda.stream(p.side):
        p.collect(params, compute())


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of a CUDA device (made on first use: graph warm-ups make it before a capture)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE.get(index)
    if stream is None:
        stream = _SIDE[index] = torch.cuda.Stream(index)
    return stream


class _Pass:
    """One backward pass's deferred work: the side stream and the streams it forked from (CUDA) or
    the work itself (CPU), each leaf's gradient summed over the pass, the tensors kept until the join."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = side_stream(device) if device.type == "cuda" else None
        self.mains: list[torch.cuda.Stream] = []
        self.work: list[tuple[list, Callable]] = []
        self.keep: list[tuple[torch.Tensor, ...]] = []
        self.sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(leaf) -> (leaf, its gradient this pass)

    def collect(self, params, grads) -> None:
        """Add each gradient to its leaf's sum over this pass (on the current stream), as autograd
        sums a leaf's incoming gradients before it accumulates them."""
        for param, grad in zip(params, grads):
            if param is None or grad is None:
                continue
            if grad.dtype is not param.dtype:
                grad = grad.to(param.dtype)
            held = self.sums.get(id(param))
            if held is None:
                self.sums[id(param)] = (param, grad)
            else:
                self.sums[id(param)] = (param, held[1] + grad)

    def hand_over(self) -> None:
        """Autograd's accumulation of each leaf's sum (on the current stream): ``.grad`` set to it
        where it is None (in the layout of the leaf), added to where it is not."""
        for param, grad in self.sums.values():
            if param.grad is not None:
                param.grad.add_(grad)
            elif grad.stride() == param.stride():
                param.grad = grad
            else:
                param.grad = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype,
                                                 device=param.device).copy_(grad)


def _join(key: tuple[int, torch.device]) -> None:
    """autograd's final callback of a pass that deferred: the leaves get their gradients (on the
    side stream; on the CPU the work runs now), the caller's streams wait for the side stream, the
    kept tensors go."""
    with _LOCK:
        p = _PASSES.pop(key)
        COUNTS["joins"] += 1
    with torch.no_grad(), torch.autocast(p.device.type, enabled=False):
        if p.side is None:
            for params, compute in p.work:
                p.collect(params, compute())
            p.hand_over()
        else:
            with torch.cuda.stream(p.side):
                p.hand_over()
            for stream in (*p.mains, torch.cuda.current_stream(p.device)):
                stream.wait_stream(p.side)
    p.keep.clear()
    p.sums.clear()


__all__ = ["COUNTS", "CPP_OP", "DEFERRED", "accumulating", "chosen", "defer", "refusal", "side_stream"]
