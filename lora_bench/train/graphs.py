"""The training step captured as CUDA graphs and replayed: three graphs sharing one memory pool
(forward+loss, backward, optimizer), so the phase timer still records a boundary between phases
while the host launches three graphs instead of hundreds of kernels. Evaluation forwards (no
gradient) are captured too, one graph per input shape (``GraphedEval``).

Capture needs warm-up iterations that really update the model; the parameters and optimizer state
are snapshotted before and restored after, so the run's step sequence is the same as eager mode
(the capturable AdamW differs from the default one only in rounding)."""

from __future__ import annotations

import contextlib
import time

import torch

from lora_bench.kernels.policy import graph_plan
from lora_bench.train.distributed import GRAPH_WARMUP_ITERS
from lora_bench.train.graph_nodes import instantiate, kernel_count, new_graph

WARMUP_ITERS = 3


def warm_up(fn, iters: int) -> None:
    """Run ``fn`` ``iters`` times on a side stream, as capture requires, under the kernel policy in
    capture mode (``graph_plan``: lora-kernel's kernels are compiled and launched once before they
    are captured)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), graph_plan():
        for _ in range(iters):
            fn()
    torch.cuda.current_stream().wait_stream(side)


class GraphedStep:
    """The step of a run's N points (``context.n``): its forward computes their losses (one point: the
    reference's loss; a pack: each point's on the batch stacked inside the captured forward, whose
    N·B rows live in the graphs' pool) and its backward differentiates their objective
    (``evaluate.Objective``). A replay returns the losses."""

    def __init__(self, context, *, timer):
        cfg = context.cfg  # validated: a CUDA device (train.preflight), accumulation_steps=1 (config)
        self.context = context
        self.model = context.forward_model
        self.optimizer = context.optimizer
        self.points = context.loop_settings().objective(context.n)
        # autocast's weight-cast cache must be off inside a capture
        self.amp = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False))
                    if cfg.precision == "bf16" else contextlib.nullcontext)
        self.graphs: tuple[torch.cuda.CUDAGraph, ...] | None = None
        # data-parallel: DDP's all-reduces are captured in the backward graph, after the eager
        # iterations DDP needs first (its buckets are rebuilt after the first, and it logs at the
        # tenth); every rank warms up, restores and captures the same way
        self.data_parallel = context.dp is not None
        self.capture_s: float | None = None  # warm-up, restore and capture, host wall time

    # -- capture ----------------------------------------------------------------------------------
    def _loss(self) -> torch.Tensor:
        """The step's loss on the static batch (a pack's step: one per point)."""
        return self.points.losses(self.static_in, self.static_tgt, self.model)

    def _forward(self):
        with self.amp():
            loss = self._loss()
        loss /= 1  # accumulation_steps == 1: kept so the op sequence is the eager step's
        return loss

    def _objective(self, loss: torch.Tensor) -> torch.Tensor:
        """What the backward differentiates: the loss itself (a pack sums its points' losses)."""
        return self.points.objective(loss)

    def _trainable(self) -> list[torch.Tensor]:
        # only these change in warm-up (frozen weights get no gradient, so AdamW skips them): at
        # 1558M with LoRA, cloning every weight would cost gigabytes for nothing
        return [p for p in self.model.parameters() if p.requires_grad]

    def _snapshot(self):
        params = [p.detach().clone() for p in self._trainable()]
        state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                 for p, s in self.optimizer.state.items()}
        return params, state

    def _restore(self, snap) -> None:
        params, state = snap
        with torch.no_grad():
            for p, saved in zip(self._trainable(), params):
                p.copy_(saved)
            for p, s in self.optimizer.state.items():
                saved = state.get(id(p))
                for k, v in s.items():
                    if torch.is_tensor(v):
                        if saved is None:
                            v.zero_()  # state created during warm-up: back to "no steps taken"
                        else:
                            v.copy_(saved[k])

    def capture(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.static_in = inputs.clone()
        self.static_tgt = targets.clone()
        snap = self._snapshot()

        def step():  # allocator, workspaces, optimizer state
            self.optimizer.zero_grad(set_to_none=True)
            self._objective(self._forward()).backward()
            self.optimizer.step()

        warm_up(step, GRAPH_WARMUP_ITERS if self.data_parallel else WARMUP_ITERS)
        self._restore(snap)
        self.optimizer.zero_grad(set_to_none=True)
        # graphs that keep their node list (host memory only), so that ``record`` can count kernels
        g_fwd, g_bwd, g_opt = new_graph(True), new_graph(True), new_graph(True)
        with torch.cuda.graph(g_fwd):
            self.static_loss = self._forward()
            self.static_objective = self._objective(self.static_loss)
        pool = g_fwd.pool()
        with torch.cuda.graph(g_bwd, pool=pool):
            self.static_objective.backward()
        before = getattr(self.optimizer, "before_capture", None)
        if before is not None:  # what the update copies from the host (the one-launch tables), outside the capture
            before()
        with torch.cuda.graph(g_opt, pool=pool):
            self.optimizer.step()
        self.graphs = (g_fwd, g_bwd, g_opt)
        for g in self.graphs:
            instantiate(g)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    def record(self) -> dict:
        """The run row's graph columns: kernels per captured phase (counted here, after training, so
        reading the graphs' dumps stays out of the timed run) and the capture's wall time."""
        graphs = self.graphs or (None, None, None)
        return {"graph_capture_s": self.capture_s,
                **{f"graph_kernels_{phase}": (kernel_count(g) if g is not None else None)
                   for phase, g in zip(("forward", "backward", "optimizer"), graphs)}}

    # -- one step ---------------------------------------------------------------------------------
    def __call__(self, inputs, targets, update: bool, timer):
        if self.graphs is None:
            self.capture(inputs, targets)
        g_fwd, g_bwd, g_opt = self.graphs
        self.static_in.copy_(inputs)
        self.static_tgt.copy_(targets)
        g_fwd.replay()
        loss = self.static_loss.detach().clone()  # the static buffer is overwritten next step
        timer.mark("forward")
        g_bwd.replay()
        timer.mark("backward")
        g_opt.replay()  # update is always True with accumulation_steps == 1
        timer.mark("optimizer")
        return loss


class GraphedEval:
    """The model's no-grad forward replayed from a CUDA graph per input shape: what the periodic
    evaluation and the accuracies call in cuda_graphs mode. Same kernels as the eager forward, so
    the same numbers; a call with gradients enabled, or a shape beyond ``MAX_SHAPES``, runs eagerly.
    ``eval()``/``train()`` pass through to the model (the reference toggles them)."""

    MAX_SHAPES = 4

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def eval(self):
        self.model.eval()
        return self

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    def _capture(self, inputs: torch.Tensor, amp_dtype):
        static_in = inputs.clone()
        # autocast's weight-cast cache must be off inside a capture (cached casts would be freed
        # when the context exits while the graph still reads them)
        amp = ((lambda: torch.autocast("cuda", dtype=amp_dtype, cache_enabled=False)) if amp_dtype is not None
               else contextlib.nullcontext)
        def forward():  # workspaces, compiled kernels
            with amp():
                self.model(static_in)

        warm_up(forward, 2)
        graph = torch.cuda.CUDAGraph()
        with amp(), torch.cuda.graph(graph):
            static_out = self.model(static_in)
        return graph, static_in, static_out

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or not inputs.is_cuda:
            return self.model(inputs)
        amp_dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        key = (tuple(inputs.shape), inputs.dtype, amp_dtype, self.model.training)
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= self.MAX_SHAPES:
                return self.model(inputs)
            entry = self.graphs[key] = self._capture(inputs, amp_dtype)
        graph, static_in, static_out = entry
        static_in.copy_(inputs)
        graph.replay()
        return static_out.clone()  # the static buffer is overwritten by the next replay
