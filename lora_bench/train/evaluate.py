"""The reference's loss and accuracy helpers. Iterating a loader draws from the global torch RNG
(the loader's base seed, and the shuffle seed for the train loader), so these are called in the
reference's order and iterate the same way (enumerate, break after ``num_batches``)."""

from __future__ import annotations

import contextlib
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


def calc_loss_loader(loader, model, device, *, num_batches=None, amp: AmpContext = contextlib.nullcontext,
                     **kw) -> float:
    total = 0.0
    if len(loader) == 0:
        return float("nan")
    num_batches = len(loader) if num_batches is None else min(num_batches, len(loader))
    for i, (inputs, targets) in enumerate(loader):
        if i >= num_batches:
            break
        with amp():
            loss = calc_loss_batch(inputs.to(device), targets.to(device), model, **kw)
        total += loss.item()
    return total / num_batches


@torch.no_grad()
def calc_accuracy_loader(loader, model, device, *, num_batches=None, token_pos: str = "last",
                         average_embeddings: bool = False, amp: AmpContext = contextlib.nullcontext) -> float:
    """Accuracy over the first ``num_batches`` batches. Leaves the model in eval mode, like the
    reference (dropout is 0.0, so this changes no number)."""
    model.eval()
    correct, seen = 0, 0
    num_batches = len(loader) if num_batches is None else min(num_batches, len(loader))
    for i, (inputs, targets) in enumerate(loader):
        if i >= num_batches:
            break
        inputs, targets = inputs.to(device), targets.to(device)
        with amp():
            logits = select_logits(model(inputs), inputs, token_pos=token_pos,
                                   average_embeddings=average_embeddings)
        predicted = torch.argmax(logits, dim=-1)
        seen += predicted.shape[0]
        correct += (predicted == targets).sum().item()
    return correct / seen


def evaluate_model(model, train_loader, val_loader, device, *, eval_iter: int, **kw) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        train_loss = calc_loss_loader(train_loader, model, device, num_batches=eval_iter, **kw)
        val_loss = calc_loss_loader(val_loader, model, device, num_batches=eval_iter, **kw)
    model.train()
    return train_loss, val_loss
