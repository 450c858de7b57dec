"""AdamW whose CUDA update is one launch over every trainable tensor (``optimizer: one-launch``).

``torch.optim.AdamW(fused=True)`` passes its tensors' addresses to each launch as kernel arguments,
a few dozen tensors per launch, one thread block per small tensor: a LoRA model's hundreds of
adapter tensors (580 at GPT-2 1558M, most of 25,600 values) take some twenty launches that each
leave most of the GPU idle. Here one Triton launch (``kernels.adamw_triton.adamw_tensors_``) reads
the addresses from a table in device memory and gives every block of 1,024 values of every tensor
a program of its own. Under ``precision=bf16-true`` (``train.master_weights``) the same launch reads
the bfloat16 gradients, updates the float32 masters and writes the rounded bfloat16 parameters,
where the float32 update needs copies before and after.

The update is ``torch.optim.AdamW``'s: on the CPU (or without Triton) its single-tensor update,
the same operations in the same order (so the same bits as ``AdamW(foreach=False)``); on CUDA the
fused kernel's order of operations in float32. One step count serves every tensor; it is kept on
the parameters' device, so a CUDA graph replays the update with each step's own count, and each
tensor's state holds it under ``step`` as AdamW's does.

The table holds the gradients' addresses, which change when new gradients are allocated. A step
whose tensors are not in a table yet builds one (a copy from the host); ``before_capture`` builds
it for the gradients in place now, so that a CUDA graph capture of ``step`` copies nothing from
the host (``train.graphs`` calls it before capturing the optimizer's graph)."""

from __future__ import annotations

import torch

from lora_bench.train.packed_adamw import FOREIGN, TRITON, adamw_kernels, adamw_update_, bias_corrections, torch_path


class OneLaunchAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW``'s update (its ``lr``, ``betas``, ``eps``, ``weight_decay``; every group
    with the same betas and eps), on CUDA in one launch per kind of tensor: float32 parameters
    with float32 gradients; float32 masters with bfloat16 gradients and bfloat16 parameters to
    write (``step_masters``). ``fused`` and ``capturable`` are accepted for AdamW's options and
    change nothing: the step count is on the parameters' device either way."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, fused: bool = False, capturable: bool = False):
        del fused, capturable
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": float(eps),
                                  "weight_decay": float(weight_decay)})
        hyper = {(tuple(g["betas"]), g["eps"]) for g in self.param_groups}
        if len(hyper) > 1:
            raise ValueError(f"OneLaunchAdamW takes one betas and eps for all groups, got {sorted(hyper)}")
        self._steps: dict[torch.device, torch.Tensor] = {}  # the shared step count, per device
        self._tables: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._captured: set[tuple] = set()  # keys of the tables a graph capture may read: never dropped
        self.update_paths: set[str] = set()  # where the updates ran: TRITON, or "torch: why"

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update(self._grad_items())
        return loss

    @torch.no_grad()
    def step_masters(self, masters: list[torch.Tensor], grads: list[torch.Tensor | None],
                     outs: list[torch.Tensor]) -> None:
        """One step of ``masters`` (float32, this optimizer's parameters, in any order) from ``grads``
        (the bfloat16 model parameters' gradients, in the same order; None: no step for that
        master), each result also rounded into ``outs`` (the bfloat16 parameters)."""
        self._update(self._master_items(masters, grads, outs))

    def before_capture(self, masters: list[torch.Tensor] | None = None, grads: list[torch.Tensor | None] | None = None,
                       outs: list[torch.Tensor] | None = None) -> None:
        """Build the tables of the gradients in place now (``masters``, ``grads`` and ``outs`` as for
        ``step_masters``), so that a capture of the next step copies nothing from the host."""
        items = self._master_items(masters, grads, outs) if masters is not None else self._grad_items()
        kernels = adamw_kernels()
        if kernels is not None and items and items[0][0].is_cuda:
            for p, _, _, _ in items:
                if not self.state[p]:
                    return  # the first step makes the moments, and then the tables, eagerly
            for kind, members in self._by_kind(items).items():
                self._captured.add(self._table(kernels, kind, members, key_only=True))

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's, then one step count again for all tensors (the loaded one), and no table that
        points at the replaced moments."""
        super().load_state_dict(state_dict)
        self._tables.clear()
        self._captured.clear()
        self._steps.clear()
        for p, state in self.state.items():
            step = state.get("step")
            if torch.is_tensor(step):
                state["step"] = self._steps.setdefault(
                    p.device, step.detach().to(device=p.device, dtype=torch.float32).reshape(()).clone())

    def _grad_items(self) -> list[tuple]:
        """(parameter, its gradient, no parameter to write, its group) for each parameter with a gradient."""
        return [(p, p.grad, None, group) for group in self.param_groups for p in group["params"] if p.grad is not None]

    def _master_items(self, masters, grads, outs) -> list[tuple]:
        group_of = {id(p): group for group in self.param_groups for p in group["params"]}
        if not len(masters) == len(grads) == len(outs):
            raise ValueError(f"{len(masters)} masters, {len(grads)} gradients and {len(outs)} parameters")
        return [(p, g, out, group_of[id(p)]) for p, g, out in zip(masters, grads, outs) if g is not None]

    # -- the update ---------------------------------------------------------------------------------
    def _update(self, items: list[tuple]) -> None:
        if not items:
            return
        device = items[0][0].device
        step = self._steps.get(device)
        if step is None:
            step = self._steps[device] = torch.zeros((), dtype=torch.float32, device=device)
        step += 1
        for p, _, _, _ in items:
            state = self.state[p]
            if not state:
                state["step"] = step
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        beta1, beta2 = items[0][3]["betas"]
        eps = items[0][3]["eps"]
        kernels = adamw_kernels() if step.is_cuda else None
        rest = items
        if kernels is None:
            self.update_paths.add(torch_path(step.device))
        else:
            by_kind = self._by_kind(items)
            for kind, members in by_kind.items():
                table, tiles, hyper = self._table(kernels, kind, members)
                kernels.adamw_tensors_(table, tiles, hyper, step, grad_bf16=kind[0], write_bf16=kind[1],
                                       beta1=beta1, beta2=beta2, eps=eps)
                self.update_paths.add(TRITON)
            taken = {id(m[0]) for members in by_kind.values() for m in members}
            rest = [item for item in items if id(item[0]) not in taken]
            if rest:
                self.update_paths.add(FOREIGN)
        if rest:
            corrections = bias_corrections(step, beta1, beta2, host_step=not step.is_cuda)
            for p, g, out, group in rest:
                state = self.state[p]
                adamw_update_(p, g.to(p.dtype), state["exp_avg"], state["exp_avg_sq"], lr=group["lr"],
                              weight_decay=group["weight_decay"], corrections=corrections, beta1=beta1,
                              beta2=beta2, eps=eps)
                if out is not None:
                    out.copy_(p)

    @staticmethod
    def _by_kind(items: list[tuple]) -> dict[tuple[bool, bool], list[tuple]]:
        """The items the kernel takes, by (bfloat16 gradient, bfloat16 parameter to write): float32,
        contiguous, on the first item's device (the caller's to check: a CUDA one); the rest take the
        torch update."""
        device = items[0][0].device if items else None
        out: dict[tuple[bool, bool], list[tuple]] = {}
        for item in items:
            p, g, dst, _ = item
            if not (p.device == device and p.dtype == torch.float32 and p.is_contiguous()
                    and g.device == device and g.dtype in (torch.float32, torch.bfloat16) and g.is_contiguous()
                    and g.shape == p.shape and not g.is_sparse):
                continue
            if dst is not None and not (dst.device == device and dst.dtype == torch.bfloat16 and dst.is_contiguous()
                                        and dst.shape == p.shape):
                continue
            out.setdefault((g.dtype == torch.bfloat16, dst is not None), []).append(item)
        return out

    def _table(self, kernels, kind: tuple[bool, bool], members: list[tuple], *, key_only: bool = False):
        """The (addresses, tiles, learning rates and weight decays) of these tensors on their device,
        built once for each set of addresses (``key_only``: build it, return its key)."""
        key = (kind, tuple((p.data_ptr(), g.data_ptr(), 0 if out is None else out.data_ptr(), group["lr"],
                            group["weight_decay"]) for p, g, out, group in members))
        entry = self._tables.get(key)
        if entry is not None:
            return key if key_only else entry
        if members[0][0].is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("OneLaunchAdamW: a step captured as a CUDA graph needs its tables built "
                               "before the capture (call before_capture())")
        rows, numels, hyper = [], [], []
        for p, g, out, group in members:
            state = self.state[p]
            rows.append([p.data_ptr(), g.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
                         0 if out is None else out.data_ptr(), p.numel()])
            numels.append(p.numel())
            hyper.append([group["lr"], group["weight_decay"]])
        device = members[0][0].device
        entry = (torch.tensor(rows, dtype=torch.int64, device=device),
                 torch.tensor(kernels.tiles_of(numels), dtype=torch.int64, device=device),
                 torch.tensor(hyper, dtype=torch.float32, device=device))
        dropped = [k for k in self._tables if k not in self._captured]
        if len(dropped) >= 64:  # gradients that keep moving: keep the newest tables (and the captured)
            del self._tables[dropped[0]]
        self._tables[key] = entry
        return key if key_only else entry
