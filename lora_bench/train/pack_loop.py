"""The training loop of a pack (lora_bench.train.pack): ``loop.train_classifier`` step for step —
the same loader iterations, evaluations and optimizer calls in the same order, so every point sees
its solo run's batches — on the batch stacked once per point. Each point has its own loss term
(the solo run's cross-entropy on its own rows); the step backpropagates their sum, which gives
each adapter the gradient of its own loss, as the points share no trainable parameter and no
row."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from lora_bench.timing import PhaseTimer
from lora_bench.train.evaluate import AmpContext, select_logits
from lora_bench.train.graphs import GraphedStep
from lora_bench.train.loop import LoopSettings


@dataclass
class PackResult:
    """What ``train_pack`` measured: per point, the lists a solo run's TrainResult holds."""

    n: int
    train_losses: list[list[float]] = field(default_factory=list)
    val_losses: list[list[float]] = field(default_factory=list)
    train_accs: list[list[float]] = field(default_factory=list)
    val_accs: list[list[float]] = field(default_factory=list)
    step_losses: list[torch.Tensor] = field(default_factory=list)  # per step, the (n,) losses, detached
    steps: int = 0
    training_time_s: float = 0.0

    def __post_init__(self):
        for name in ("train_losses", "val_losses", "train_accs", "val_accs"):
            setattr(self, name, [[] for _ in range(self.n)])

    def point_step_losses(self) -> list[list[float]]:
        """Per point, its training loss of every step (one transfer for all)."""
        if not self.step_losses:
            return [[] for _ in range(self.n)]
        per_step = torch.stack([t.float() for t in self.step_losses]).tolist()
        return [[row[p] for row in per_step] for p in range(self.n)]


def stack_batch(inputs: torch.Tensor, n: int) -> torch.Tensor:
    """The batch once per point, along the batch dimension: point p's rows are the p-th block."""
    return inputs.repeat(n, *([1] * (inputs.dim() - 1)))


def pack_losses(inputs, targets, model, n: int, *, token_pos: str = "last", ignore_index: int = -100,
                average_embeddings: bool = False) -> torch.Tensor:
    """Each point's cross-entropy on its own rows (the solo run's ``calc_loss_batch``): (n,)."""
    stacked = stack_batch(inputs, n)
    logits = select_logits(model(stacked), stacked, token_pos=token_pos, average_embeddings=average_embeddings)
    per_point = logits.reshape(n, inputs.shape[0], -1)
    return torch.stack([F.cross_entropy(per_point[p], targets, ignore_index=ignore_index) for p in range(n)])


class GraphedPackStep(GraphedStep):
    """A pack's training step captured as CUDA graphs and replayed: the solo run's ``GraphedStep``
    (its warm-up, snapshot and restore, its three graphs in one pool), whose forward computes the
    points' losses on the batch stacked inside the captured forward (the N·B rows live in the
    graphs' pool, written again by every replay from the static batch), and whose backward
    differentiates their sum. A replay returns the (n,) losses."""

    def __init__(self, ctx, *, timer, n: int):
        super().__init__(ctx, timer=timer)
        self.n = n

    def _loss(self) -> torch.Tensor:
        return pack_losses(self.static_in, self.static_tgt, self.model, self.n, **self.loss_kw)

    def _objective(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.sum()


def pack_loss_loader(loader, model, device, n: int, *, num_batches=None, amp: AmpContext = contextlib.nullcontext,
                     **kw) -> list[float]:
    """Each point's ``calc_loss_loader``: the mean of its batch losses, summed as the solo run sums."""
    if len(loader) == 0:
        return [float("nan")] * n
    totals = [0.0] * n
    num_batches = len(loader) if num_batches is None else min(num_batches, len(loader))
    for i, (inputs, targets) in enumerate(loader):
        if i >= num_batches:
            break
        with amp():
            losses = pack_losses(inputs.to(device), targets.to(device), model, n, **kw)
        for p, v in enumerate(losses.tolist()):
            totals[p] += v
    return [t / num_batches for t in totals]


@torch.no_grad()
def pack_accuracy_loader(loader, model, device, n: int, *, num_batches=None, token_pos: str = "last",
                         average_embeddings: bool = False, amp: AmpContext = contextlib.nullcontext) -> list[float]:
    """Each point's ``calc_accuracy_loader`` (leaves the model in eval mode, as it does)."""
    model.eval()
    correct, seen = [0] * n, 0
    num_batches = len(loader) if num_batches is None else min(num_batches, len(loader))
    for i, (inputs, targets) in enumerate(loader):
        if i >= num_batches:
            break
        inputs, targets = inputs.to(device), targets.to(device)
        with amp():
            stacked = stack_batch(inputs, n)
            logits = select_logits(model(stacked), stacked, token_pos=token_pos, average_embeddings=average_embeddings)
        predicted = torch.argmax(logits, dim=-1).reshape(n, -1)
        seen += inputs.shape[0]
        for p, c in enumerate((predicted == targets).sum(dim=1).tolist()):
            correct[p] += c
    return [c / seen for c in correct]


def evaluate_pack(model, train_loader, val_loader, device, n: int, *, eval_iter: int,
                  **kw) -> tuple[list[float], list[float]]:
    model.eval()
    with torch.no_grad():
        train = pack_loss_loader(train_loader, model, device, n, num_batches=eval_iter, **kw)
        val = pack_loss_loader(val_loader, model, device, n, num_batches=eval_iter, **kw)
    model.train()
    return train, val


def train_pack(model, n: int, train_loader, val_loader, optimizer, device, *, settings: LoopSettings,
               timer: PhaseTimer, amp: AmpContext = contextlib.nullcontext, step_fn: Callable | None = None,
               on_step: Callable | None = None, eval_model: Callable | None = None,
               say: Callable[[int, str], None] = lambda p, msg: None,
               result: PackResult | None = None) -> PackResult:
    """``loop.train_classifier`` for ``n`` packed points (its arguments, less the shard hook of
    data parallelism): ``step_fn(inputs, targets, update, timer) -> (n,) losses`` replaces the
    eager step (``GraphedPackStep``), ``eval_model`` the model in evaluations (graph-replayed
    forwards); ``say(point, line)`` gets each point's evaluation lines; ``result``: filled as the
    loop goes (what a caller keeps when the loop is interrupted)."""
    s = settings
    res = result if result is not None else PackResult(n)
    ev = model if eval_model is None else eval_model
    loss_kw = dict(token_pos=s.token_pos, ignore_index=s.ignore_index, average_embeddings=s.average_embeddings)
    acc_kw = dict(token_pos=s.token_pos, average_embeddings=s.average_embeddings, amp=amp)
    n_batches = len(train_loader)
    global_step = -1
    done = False
    t_start = time.perf_counter()
    for epoch in range(s.num_epochs):
        model.train()
        batches = iter(train_loader)  # as the solo loop iterates: the same RNG draws
        for batch_idx in range(n_batches):
            timer.begin(step=global_step + 1, epoch=epoch + 1)
            inputs, targets = next(batches)
            tokens = inputs.numel()  # one point's batch: each point's row counts its own tokens
            inputs, targets = inputs.to(device), targets.to(device)
            timer.mark("data")
            update = (batch_idx + 1) % s.accumulation_steps == 0 or (batch_idx + 1) == n_batches
            if step_fn is not None:
                losses = step_fn(inputs, targets, update, timer)
            else:
                with amp():
                    losses = pack_losses(inputs, targets, model, n, **loss_kw)
                losses = losses / s.accumulation_steps
                timer.mark("forward")
                losses.sum().backward()
                timer.mark("backward")
                if update:
                    optimizer.step()
                    optimizer.zero_grad()
                timer.mark("optimizer")
                losses = losses.detach()
            res.step_losses.append(losses)
            timer.end(losses.mean(), tokens=tokens)  # the progress line shows the points' mean
            global_step += 1
            if on_step is not None:
                on_step(global_step, epoch + 1, losses.mean())
            if s.eval_freq and global_step % s.eval_freq == 0:
                timer.sync_point()
                tok = timer.eval_begin()
                train_loss, val_loss = evaluate_pack(ev, train_loader, val_loader, device, n, eval_iter=s.eval_iter,
                                                     amp=amp, **loss_kw)
                timer.eval_end(tok)
                for p in range(n):
                    res.train_losses[p].append(train_loss[p])
                    res.val_losses[p].append(val_loss[p])
                    say(p, f"Ep {epoch + 1} (Step {global_step:06d}): Train loss {train_loss[p]:.3f}, "
                           f"Val loss {val_loss[p]:.3f}")
            if s.max_steps is not None and global_step + 1 >= s.max_steps:
                done = True
                break
        tok = timer.eval_begin()
        train_acc = pack_accuracy_loader(train_loader, ev, device, n, num_batches=s.eval_iter, **acc_kw)
        val_acc = pack_accuracy_loader(val_loader, ev, device, n, num_batches=s.eval_iter, **acc_kw)
        timer.eval_end(tok)
        for p in range(n):
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
