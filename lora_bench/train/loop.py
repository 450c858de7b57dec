"""The training step and loop of N >= 1 points on one model: the reference's
``train_classifier_simple`` step for step (same order of loader iterations, evaluations and
optimizer calls), instrumented at phase boundaries. One point runs the reference's own operations;
N points (a pack) see the batch stacked once per point and backpropagate the sum of their losses
(``evaluate.Objective``), so every point sees its solo run's batches."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from lora_bench.timing import PhaseTimer
from lora_bench.train.evaluate import AmpContext, Objective, calc_accuracy_loader, evaluate_model


@dataclass
class TrainResult:
    """What the loop measured: per point, its periodic losses and its accuracies after each epoch."""

    n: int = 1
    train_losses: list[list[float]] = field(default_factory=list)
    val_losses: list[list[float]] = field(default_factory=list)
    train_accs: list[list[float]] = field(default_factory=list)
    val_accs: list[list[float]] = field(default_factory=list)
    step_losses: list[torch.Tensor] = field(default_factory=list)  # N > 1: per step, the (n,) losses, detached
    examples_seen: int = 0
    steps: int = 0
    training_time_s: float = 0.0

    def __post_init__(self):
        for name in ("train_losses", "val_losses", "train_accs", "val_accs"):
            setattr(self, name, [[] for _ in range(self.n)])

    def point_step_losses(self) -> list[list[float]]:
        """Per point, its training loss of every step (one transfer for all; N > 1)."""
        if not self.step_losses:
            return [[] for _ in range(self.n)]
        per_step = torch.stack([t.float() for t in self.step_losses]).tolist()
        return [[row[p] for row in per_step] for p in range(self.n)]


@dataclass
class LoopSettings:
    num_epochs: int
    eval_freq: int
    eval_iter: int
    accumulation_steps: int = 1
    token_pos: str = "last"
    ignore_index: int = -100
    average_embeddings: bool = False
    max_steps: int | None = None

    @classmethod
    def of(cls, cfg) -> "LoopSettings":
        """The loop's settings of a run's TrainConfig."""
        return cls(num_epochs=cfg.num_epochs, eval_freq=cfg.eval_freq, eval_iter=cfg.eval_iter,
                   accumulation_steps=cfg.accumulation_steps, token_pos=cfg.trainable_token_pos,
                   ignore_index=cfg.ignore_index, average_embeddings=cfg.average_embeddings, max_steps=cfg.max_steps)

    def objective(self, n: int = 1) -> Objective:
        """The loss of ``n`` points trained at once under these settings."""
        return Objective(n, token_pos=self.token_pos, ignore_index=self.ignore_index,
                         average_embeddings=self.average_embeddings)


def train_classifier(model, train_loader, val_loader, optimizer, device, *, settings: LoopSettings,
                     timer: PhaseTimer, points: int = 1, amp: AmpContext = contextlib.nullcontext,
                     step_fn: Callable | None = None, on_step: Callable | None = None,
                     eval_model: Callable | None = None, shard: Callable | None = None,
                     say: Callable[[int, str], None] = lambda point, line: None,
                     result: TrainResult | None = None) -> TrainResult:
    """Run the loop for ``points`` points. ``step_fn(inputs, targets, update, timer) -> losses``
    replaces the eager forward / backward / optimizer phases when given (CUDA-graph replay);
    ``eval_model`` replaces the model in evaluations (graph-replayed forwards); ``on_step(step,
    epoch, loss)`` is called after every step (progress display, profiler window); ``shard(inputs,
    targets)`` picks this process's part of the global batch (data-parallel runs; tokens and
    examples still count the global batch); ``say(point, line)`` gets each point's evaluation
    lines; ``result``: filled as the loop goes (what a caller keeps when the loop is interrupted)."""
    s = settings
    obj = s.objective(points)
    res = result if result is not None else TrainResult(points)
    ev = model if eval_model is None else eval_model
    n_batches = len(train_loader)
    global_step = -1
    done = False
    t_start = time.perf_counter()
    for epoch in range(s.num_epochs):
        model.train()
        batches = iter(train_loader)  # what the reference's enumerate() does: same RNG draws
        for batch_idx in range(n_batches):
            timer.begin(step=global_step + 1, epoch=epoch + 1)
            inputs, targets = next(batches)
            # one point's batch: each point's row counts its own tokens and examples
            tokens, examples = inputs.numel(), inputs.shape[0]
            if shard is not None:
                inputs, targets = shard(inputs, targets)
            inputs, targets = inputs.to(device), targets.to(device)
            timer.mark("data")
            update = (batch_idx + 1) % s.accumulation_steps == 0 or (batch_idx + 1) == n_batches
            if step_fn is not None:
                loss = step_fn(inputs, targets, update, timer)
            else:
                with amp():
                    loss = obj.losses(inputs, targets, model)
                loss /= s.accumulation_steps
                timer.mark("forward")
                obj.objective(loss).backward()
                timer.mark("backward")
                if update:
                    optimizer.step()
                    optimizer.zero_grad()
                timer.mark("optimizer")
            if points > 1:
                res.step_losses.append(loss.detach())
            shown = obj.shown(loss)  # a pack's progress line shows its points' mean
            timer.end(shown, tokens=tokens)
            res.examples_seen += examples
            global_step += 1
            if on_step is not None:
                on_step(global_step, epoch + 1, shown)
            if s.eval_freq and global_step % s.eval_freq == 0:
                timer.sync_point()
                tok = timer.eval_begin()
                train_loss, val_loss = evaluate_model(ev, train_loader, val_loader, device, eval_iter=s.eval_iter,
                                                      amp=amp, objective=obj)
                timer.eval_end(tok)
                for p in range(points):
                    res.train_losses[p].append(train_loss[p])
                    res.val_losses[p].append(val_loss[p])
                    say(p, f"Ep {epoch + 1} (Step {global_step:06d}): Train loss {train_loss[p]:.3f}, "
                           f"Val loss {val_loss[p]:.3f}")
            if s.max_steps is not None and global_step + 1 >= s.max_steps:
                done = True
                break
        tok = timer.eval_begin()
        train_acc = calc_accuracy_loader(train_loader, ev, device, objective=obj, num_batches=s.eval_iter, amp=amp)
        val_acc = calc_accuracy_loader(val_loader, ev, device, objective=obj, num_batches=s.eval_iter, amp=amp)
        timer.eval_end(tok)
        for p in range(points):
            say(p, f"Training accuracy: {train_acc[p] * 100:.2f}% | Validation accuracy: {val_acc[p] * 100:.2f}%")
            res.train_accs[p].append(train_acc[p])
            res.val_accs[p].append(val_acc[p])
        if done:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    res.training_time_s = time.perf_counter() - t_start
    timer.sync_point()
    res.steps = global_step + 1
    return res
