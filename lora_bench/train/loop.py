"""The training step and loop: the reference's ``train_classifier_simple`` step for step (same
order of loader iterations, evaluations and optimizer calls), instrumented at phase boundaries."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from lora_bench.timing import PhaseTimer
from lora_bench.train.evaluate import AmpContext, calc_accuracy_loader, calc_loss_batch, evaluate_model


@dataclass
class TrainResult:
    train_losses: list[float] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    train_accs: list[float] = field(default_factory=list)
    val_accs: list[float] = field(default_factory=list)
    examples_seen: int = 0
    steps: int = 0
    training_time_s: float = 0.0
    log: list[str] = field(default_factory=list)


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


def train_classifier(model, train_loader, val_loader, optimizer, device, *, settings: LoopSettings,
                     timer: PhaseTimer, amp: AmpContext = contextlib.nullcontext,
                     step_fn: Callable | None = None, on_step: Callable | None = None,
                     eval_model: Callable | None = None, shard: Callable | None = None,
                     say: Callable[[str], None] = print) -> TrainResult:
    """Run the loop. ``step_fn(inputs, targets, update) -> loss`` replaces the eager forward /
    backward / optimizer phases when given (CUDA-graph replay); ``eval_model`` replaces the model
    in evaluations (graph-replayed forwards); ``on_step(step, epoch, loss)`` is called after every
    step (progress display, profiler window); ``shard(inputs, targets)`` picks this process's part
    of the global batch (data-parallel runs; tokens and examples still count the global batch)."""
    s = settings
    res = TrainResult()
    ev = model if eval_model is None else eval_model
    loss_kw = dict(token_pos=s.token_pos, ignore_index=s.ignore_index, average_embeddings=s.average_embeddings)
    acc_kw = dict(token_pos=s.token_pos, average_embeddings=s.average_embeddings, amp=amp)
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
                    loss = calc_loss_batch(inputs, targets, model, **loss_kw)
                loss /= s.accumulation_steps
                timer.mark("forward")
                loss.backward()
                timer.mark("backward")
                if update:
                    optimizer.step()
                    optimizer.zero_grad()
                timer.mark("optimizer")
            timer.end(loss, tokens=tokens)
            res.examples_seen += examples
            global_step += 1
            if on_step is not None:
                on_step(global_step, epoch + 1, loss)
            if s.eval_freq and global_step % s.eval_freq == 0:
                timer.sync_point()
                tok = timer.eval_begin()
                train_loss, val_loss = evaluate_model(ev, train_loader, val_loader, device,
                                                      eval_iter=s.eval_iter, amp=amp, **loss_kw)
                timer.eval_end(tok)
                res.train_losses.append(train_loss)
                res.val_losses.append(val_loss)
                say(f"Ep {epoch + 1} (Step {global_step:06d}): Train loss {train_loss:.3f}, Val loss {val_loss:.3f}")
            if s.max_steps is not None and global_step + 1 >= s.max_steps:
                done = True
                break
        tok = timer.eval_begin()
        train_acc = calc_accuracy_loader(train_loader, ev, device, num_batches=s.eval_iter, **acc_kw)
        val_acc = calc_accuracy_loader(val_loader, ev, device, num_batches=s.eval_iter, **acc_kw)
        timer.eval_end(tok)
        say(f"Training accuracy: {train_acc * 100:.2f}% | Validation accuracy: {val_acc * 100:.2f}%")
        res.train_accs.append(train_acc)
        res.val_accs.append(val_acc)
        if done:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    res.training_time_s = time.perf_counter() - t_start
    timer.sync_point()
    res.steps = global_step + 1
    return res
