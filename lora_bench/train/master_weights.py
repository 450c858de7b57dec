"""An optimizer over float32 master copies of bfloat16 parameters (``precision=bf16-true``).

The model holds its trainable parameters in bfloat16 and backward gives bfloat16 gradients. Each
``step`` copies the gradients into float32 buffers, lets the inner optimizer (AdamW) update the
float32 masters, and rounds the masters back into the parameters. An update smaller than half a
bfloat16 step of its parameter still accumulates in the master, where a bfloat16 update would round
it away; the parameters the model computes with are always the masters rounded to nearest.

Every tensor the step touches is allocated once (the masters at construction, the gradient buffers
at the first step), so the step can be captured as a CUDA graph. An inner optimizer with
``step_masters`` (``train.one_launch_adamw``) takes the bfloat16 gradients and parameters itself,
in the same launch as the update, and the float32 gradient buffers are not made. ``state`` shows the inner
optimizer's state and, under each model parameter, its master (``"master"``): whatever snapshots
and restores an optimizer's state (``train.graphs``' warm-up before capture) restores the masters
with it."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

MASTER = "master"  # the key of a parameter's float32 master in ``state``


class MasterWeights:
    """``make(masters)`` builds the inner optimizer over float32 copies of the trainable ones among
    ``params``; frozen parameters (``requires_grad`` False) are left out, as AdamW skips them."""

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        self.inner = make(self.masters)
        self._grads: list[torch.Tensor | None] = [None] * len(self.params)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        """The inner optimizer's state (keyed by the masters), and each parameter's master."""
        return {**{p: {MASTER: m} for p, m in zip(self.params, self.masters)}, **self.inner.state}

    @torch.no_grad()
    def step(self) -> None:
        if hasattr(self.inner, "step_masters"):  # one launch reads the gradients and writes the parameters
            self.inner.step_masters(self.masters, [p.grad for p in self.params], self.params)
            return
        used = [i for i, p in enumerate(self.params) if p.grad is not None]
        for m in self.masters:  # a parameter without a gradient this step: AdamW skips its master too
            m.grad = None
        for i in used:
            if self._grads[i] is None:
                self._grads[i] = torch.empty_like(self.masters[i])
            self.masters[i].grad = self._grads[i]
        if used:
            torch._foreach_copy_([self._grads[i] for i in used], [self.params[i].grad for i in used])
        self.inner.step()
        if used:
            torch._foreach_copy_([self.params[i] for i in used], [self.masters[i] for i in used])

    def before_capture(self) -> None:
        """An inner optimizer with ``step_masters`` builds its tables for the gradients in place now."""
        if hasattr(self.inner, "step_masters"):
            self.inner.before_capture(self.masters, [p.grad for p in self.params], self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The model's gradients, as ``Optimizer.zero_grad`` clears them (the float32 buffers are
        overwritten by the next step)."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()
