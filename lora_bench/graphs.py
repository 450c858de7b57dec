"""The training step captured as CUDA graphs and replayed: three graphs sharing one memory pool
(forward+loss, backward, optimizer), so the phase timer still records a boundary between phases
while the host launches three graphs instead of hundreds of kernels.

Capture needs warm-up iterations that really update the model; the parameters and optimizer state
are snapshotted before and restored after, so the run's step sequence is the same as eager mode
(the capturable AdamW differs from the default one only in rounding)."""

from __future__ import annotations

import contextlib

import torch

from .errors import UsageError
from .evaluate import calc_loss_batch

WARMUP_ITERS = 3


class GraphedStep:
    def __init__(self, ctx, *, timer):
        cfg = ctx.cfg
        if ctx.device.type != "cuda":
            raise UsageError("cuda_graphs needs a CUDA device")
        if cfg.accumulation_steps != 1:
            raise UsageError("cuda_graphs needs accumulation_steps=1: a replayed backward overwrites the "
                             "gradients instead of accumulating them")
        self.ctx = ctx
        self.model = ctx.forward_model
        self.optimizer = ctx.optimizer
        self.loss_kw = dict(token_pos=cfg.trainable_token_pos, ignore_index=cfg.ignore_index,
                            average_embeddings=cfg.average_embeddings)
        # autocast's weight-cast cache must be off inside a capture
        self.amp = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False))
                    if cfg.precision == "bf16" else contextlib.nullcontext)
        self.graphs: tuple[torch.cuda.CUDAGraph, ...] | None = None

    # -- capture ----------------------------------------------------------------------------------
    def _forward(self):
        with self.amp():
            loss = calc_loss_batch(self.static_in, self.static_tgt, self.model, **self.loss_kw)
        loss /= 1  # accumulation_steps == 1: kept so the op sequence is the eager step's
        return loss

    def _snapshot(self):
        params = [p.detach().clone() for p in self.model.parameters()]
        state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                 for p, s in self.optimizer.state.items()}
        return params, state

    def _restore(self, snap) -> None:
        params, state = snap
        with torch.no_grad():
            for p, saved in zip(self.model.parameters(), params):
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
        self.static_in = inputs.clone()
        self.static_tgt = targets.clone()
        snap = self._snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: allocator, cuBLAS workspaces, optimizer state
            for _ in range(WARMUP_ITERS):
                self.optimizer.zero_grad(set_to_none=True)
                self._forward().backward()
                self.optimizer.step()
        torch.cuda.current_stream().wait_stream(side)
        self._restore(snap)
        self.optimizer.zero_grad(set_to_none=True)
        g_fwd, g_bwd, g_opt = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_fwd):
            self.static_loss = self._forward()
        pool = g_fwd.pool()
        with torch.cuda.graph(g_bwd, pool=pool):
            self.static_loss.backward()
        with torch.cuda.graph(g_opt, pool=pool):
            self.optimizer.step()
        self.graphs = (g_fwd, g_bwd, g_opt)

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
