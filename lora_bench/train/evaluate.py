"""The reference's loss and accuracy helpers, for the N >= 1 points a run trains at once on one
model (a solo run: N = 1; a pack, lora_bench.train.pack: the batch stacked once per point, each
point's loss on its own rows). Iterating a loader draws from the global torch RNG (the loader's
base seed, and the shuffle seed for the train loader), so these are called in the reference's order
and iterate the same way (enumerate, break after ``num_batches``); one point computes exactly the
reference's operations (``calc_loss_batch``, ``loss.backward()``), so book mode stays bit-exact."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from lora_bench.data.tokenizer import PAD_TOKEN_ID

AmpContext = Callable[[], contextlib.AbstractContextManager]


def select_logits(output: torch.Tensor, inputs: torch.Tensor, *, token_pos: str, average_embeddings: bool):
    """Logits used for classification: the chosen token, the last non-pad token, or the mean."""
    if average_embeddings:
        return output.mean(dim=1)  # (B, classes)
    if token_pos == "flexible":
        last = (inputs != PAD_TOKEN_ID).sum(dim=1) - 1  # (B,)
        return output[torch.arange(output.size(0), device=output.device), last]
    return output[:, -1 if token_pos == "last" else 0, :]


def calc_loss_batch(inputs, targets, model, *, token_pos: str = "last", ignore_index: int = -100,
                    average_embeddings: bool = False):
    """Cross-entropy at the chosen position; inputs already on the device."""
    logits = select_logits(model(inputs), inputs, token_pos=token_pos, average_embeddings=average_embeddings)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index)


def stack_batch(inputs: torch.Tensor, n: int) -> torch.Tensor:
    """The batch once per point, along the batch dimension: point p's rows are the p-th block."""
    return inputs if n == 1 else inputs.repeat(n, *([1] * (inputs.dim() - 1)))


def point_losses(inputs, targets, model, n: int, *, token_pos: str = "last", ignore_index: int = -100,
                 average_embeddings: bool = False) -> torch.Tensor:
    """Each of ``n`` points' cross-entropy on its own rows of the stacked batch (its solo run's
    ``calc_loss_batch``): (n,)."""
    stacked = stack_batch(inputs, n)
    logits = select_logits(model(stacked), stacked, token_pos=token_pos, average_embeddings=average_embeddings)
    per_point = logits.reshape(n, inputs.shape[0], -1)
    return torch.stack([F.cross_entropy(per_point[p], targets, ignore_index=ignore_index) for p in range(n)])


@dataclass(frozen=True)
class Objective:
    """What a step of ``n`` points computes and differentiates. One point: the reference's loss and
    its own backward. Several: their losses, (n,), and their sum, whose gradient is each adapter's
    gradient of its own loss (the points share no trainable parameter and no row)."""

    n: int = 1
    token_pos: str = "last"
    ignore_index: int = -100
    average_embeddings: bool = False

    def losses(self, inputs, targets, model) -> torch.Tensor:
        kw = dict(token_pos=self.token_pos, ignore_index=self.ignore_index, average_embeddings=self.average_embeddings)
        if self.n == 1:
            return calc_loss_batch(inputs, targets, model, **kw)
        return point_losses(inputs, targets, model, self.n, **kw)

    def objective(self, losses: torch.Tensor) -> torch.Tensor:
        return losses if self.n == 1 else losses.sum()

    def values(self, losses: torch.Tensor) -> list[float]:
        """Each point's loss, read from the device."""
        return [losses.item()] if self.n == 1 else losses.tolist()

    def shown(self, losses: torch.Tensor) -> torch.Tensor:
        """The step's loss for the phase timer and the progress line (a pack's: its points' mean)."""
        return losses if self.n == 1 else losses.detach().mean()

    def logits(self, model, inputs) -> torch.Tensor:
        """The classification logits of every point's rows, point after point: (n·B, classes)."""
        stacked = stack_batch(inputs, self.n)
        return select_logits(model(stacked), stacked, token_pos=self.token_pos,
                             average_embeddings=self.average_embeddings)


def calc_loss_loader(loader, model, device, *, objective: Objective, num_batches=None,
                     amp: AmpContext = contextlib.nullcontext) -> list[float]:
    """Each point's mean batch loss over the first ``num_batches`` batches."""
    if len(loader) == 0:
        return [float("nan")] * objective.n
    totals = [0.0] * objective.n
    num_batches = len(loader) if num_batches is None else min(num_batches, len(loader))
    for i, (inputs, targets) in enumerate(loader):
        if i >= num_batches:
            break
        with amp():
            losses = objective.losses(inputs.to(device), targets.to(device), model)
        for p, v in enumerate(objective.values(losses)):
            totals[p] += v
    return [t / num_batches for t in totals]


@torch.no_grad()
def calc_accuracy_loader(loader, model, device, *, objective: Objective, num_batches=None,
                         amp: AmpContext = contextlib.nullcontext) -> list[float]:
    """Each point's accuracy over the first ``num_batches`` batches. Leaves the model in eval mode,
    like the reference (dropout is 0.0, so this changes no number)."""
    model.eval()
    correct, seen = [0] * objective.n, 0
    num_batches = len(loader) if num_batches is None else min(num_batches, len(loader))
    for i, (inputs, targets) in enumerate(loader):
        if i >= num_batches:
            break
        inputs, targets = inputs.to(device), targets.to(device)
        with amp():
            logits = objective.logits(model, inputs)
        predicted = torch.argmax(logits, dim=-1).reshape(objective.n, -1)
        seen += inputs.shape[0]
        for p, c in enumerate((predicted == targets).sum(dim=1).tolist()):
            correct[p] += c
    return [c / seen for c in correct]


def evaluate_model(model, train_loader, val_loader, device, *, eval_iter: int,
                   **kw) -> tuple[list[float], list[float]]:
    model.eval()
    with torch.no_grad():
        train_loss = calc_loss_loader(train_loader, model, device, num_batches=eval_iter, **kw)
        val_loss = calc_loss_loader(val_loader, model, device, num_batches=eval_iter, **kw)
    model.train()
    return train_loss, val_loss
