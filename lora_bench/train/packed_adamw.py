"""AdamW for a pack (``train.pack``): every trainable tensor of a packed model holds its N points
along its first axis (``lora.packed_layer.PackedLoRALinear``), and point p trains with its own learning
rate and weight decay — its solo run's AdamW, applied slice by slice.

Why not ``torch.optim.AdamW`` with one parameter group per point: the groups need a parameter per
point and layer, N times as many tensors, each small (a rank-16 A at 124M: 12k values). Its
multi-tensor kernels give each small tensor one thread block and take a few dozen tensors per
launch, so the GPU stays mostly idle: at 124M, 16 points, that update took 4.9 ms a step for about
2.4 GB of traffic (docs/packing.md). Here one launch updates a whole stacked tensor, all its points
at once, every block busy (``kernels.adamw_triton``).

On a CUDA device with float32 tensors and Triton, the Triton kernel; elsewhere (the CPU, or no
Triton) plain torch ops on each point's slice, in the order of ``torch.optim.AdamW``'s
single-tensor update. The step count is one tensor shared by every parameter's state (each state
dict holds it under ``step``, so code that saves and restores the state sees it); it lives on the
parameters' device, so a CUDA graph can replay the step."""

from __future__ import annotations

import math

import torch

_KERNELS = None  # the module of the Triton updates (kernels.adamw_triton), or False where it cannot run
_KERNELS_PROBLEM = ""  # why it cannot: the import's error


def adamw_kernels():
    """``lora_bench.kernels.adamw_triton`` (imported on first use), or None where Triton is missing
    or fails to initialise: then the torch ops serve."""
    global _KERNELS, _KERNELS_PROBLEM
    if _KERNELS is None:
        try:
            from lora_bench.kernels import adamw_triton

            _KERNELS = adamw_triton
        except Exception as e:  # noqa: BLE001 - any failure to load means the torch update, with its reason
            _KERNELS, _KERNELS_PROBLEM = False, f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return _KERNELS or None


TRITON = "triton"  # an update path: the Triton kernel (``update_paths``)
FOREIGN = "torch: a tensor the kernel does not take (not float32 and contiguous, or on another device)"


def torch_path(device: torch.device) -> str:
    """Why an update on ``device`` takes the torch ops rather than the Triton kernel, as
    ``update_paths`` notes it: not a CUDA device, or Triton did not load (its error)."""
    if device.type != "cuda":
        return f"torch: the {device.type.upper()}"
    return f"torch: no Triton ({_KERNELS_PROBLEM or 'not loaded'})"


def update_path(optimizer) -> str:
    """Where an optimizer's updates ran ('; '-joined, each once: ``triton``, ``torch: why``), for the
    optimizers that note it (the one-launch and packed AdamW, inside master copies too); '' for others."""
    paths = getattr(getattr(optimizer, "inner", optimizer), "update_paths", None)
    return "; ".join(sorted(paths)) if paths else ""


def _kernel():
    kernels = adamw_kernels()
    return kernels.packed_adamw_ if kernels is not None else None


class PackedAdamW(torch.optim.Optimizer):
    """AdamW over stacked parameters, point p (index p of each tensor's first axis) with learning
    rate ``lrs[p]`` and weight decay ``weight_decays[p]``. ``params``: tensors, or parameter groups
    of which one may hold its own ``lrs`` (LoRA+: every B at each point's rate times its ratio).
    ``fused`` and ``capturable`` are accepted for the solo optimizer's options and change nothing:
    the CUDA update is one kernel per tensor, and the step count is on the parameters' device,
    either way."""

    def __init__(self, params, *, lrs: list[float], weight_decays: list[float], betas=(0.9, 0.999),
                 eps: float = 1e-8, fused: bool = False, capturable: bool = False):
        del fused, capturable
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        n = len(lrs)
        if len(weight_decays) != n:
            raise ValueError(f"{len(weight_decays)} weight decays for {n} learning rates")
        for group in groups:
            group["params"] = list(group["params"])
            if "lrs" in group:
                if len(group["lrs"]) != n:
                    raise ValueError(f"a group's {len(group['lrs'])} learning rates for {n} points")
                group["lrs"] = [float(x) for x in group["lrs"]]
            for p in group["params"]:
                if p.dim() == 0 or p.shape[0] != n:
                    raise ValueError(f"a packed parameter holds its {n} points along its first axis, "
                                     f"got shape {tuple(p.shape)}")
        super().__init__(groups, {"betas": tuple(betas), "eps": float(eps), "lrs": [float(x) for x in lrs]})
        self.weight_decays = [float(x) for x in weight_decays]
        self._step = None  # the shared step count, made on the first step
        self._hyper = {}  # (device, learning rates) -> (lrs, weight decays) as float32 tensors
        self.update_paths: set[str] = set()  # where the updates ran: TRITON, or "torch: why"

    def _step_count(self, device: torch.device) -> torch.Tensor:
        if self._step is None:
            self._step = torch.zeros((), dtype=torch.float32, device=device)
        return self._step

    def _device_hyper(self, device: torch.device, lrs: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, tuple(lrs))
        if key not in self._hyper:
            self._hyper[key] = (torch.tensor(lrs, dtype=torch.float32, device=device),
                                torch.tensor(self.weight_decays, dtype=torch.float32, device=device))
        return self._hyper[key]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not todo:
            return loss
        step = self._step_count(todo[0].device)
        step += 1
        kernel = _kernel() if step.is_cuda else None
        if kernel is None:
            self.update_paths.add(torch_path(step.device))
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            eps = group["eps"]
            corrections = None  # the torch update's bias corrections, made once a step if needed
            hyper = None  # the kernel's learning rates and weight decays on the device, once a group
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("PackedAdamW does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = step
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                if (kernel is not None and p.is_cuda and p.dtype == g.dtype == torch.float32 and p.is_contiguous()
                        and g.is_contiguous()):
                    if hyper is None:
                        hyper = self._device_hyper(p.device, group["lrs"])
                    kernel(p, g, m, v, *hyper, step, beta1=beta1, beta2=beta2, eps=eps)
                    self.update_paths.add(TRITON)
                else:
                    if kernel is not None:
                        self.update_paths.add(FOREIGN)
                    if corrections is None:
                        corrections = bias_corrections(step, beta1, beta2, host_step=not step.is_cuda)
                    self._torch_update(p, g, m, v, group["lrs"], corrections, beta1, beta2, eps)
        return loss

    def _torch_update(self, p, g, m, v, lrs, corrections, beta1, beta2, eps) -> None:
        """Each point's slice as ``torch.optim.AdamW``'s single-tensor update does it, with the
        group's learning rates and the step's ``bias_corrections``."""
        for i, (lr, wd) in enumerate(zip(lrs, self.weight_decays)):
            adamw_update_(p[i], g[i].to(p.dtype), m[i], v[i], lr=lr, weight_decay=wd, corrections=corrections,
                          beta1=beta1, beta2=beta2, eps=eps)


def adamw_update_(p, g, m, v, *, lr: float, weight_decay: float, corrections: tuple, beta1: float, beta2: float,
                  eps: float) -> None:
    """``torch.optim.AdamW``'s single-tensor update of one tensor, in place, with the step's
    ``bias_corrections``: the same operations in the same order, so the same bits."""
    bias_correction1, bias_correction2_sqrt = corrections
    p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    if torch.is_tensor(bias_correction1):
        p.sub_(m / denom * (lr / bias_correction1))
    else:
        p.addcdiv_(m, denom, value=-(lr / bias_correction1))


def bias_corrections(step: torch.Tensor, beta1: float, beta2: float, *, host_step: bool) -> tuple:
    """AdamW's ``1 - β1ᵗ`` and ``√(1 - β2ᵗ)``: Python numbers from a step count read on the host
    (``host_step``), as torch's single-tensor update computes them; float32 tensors from one left on
    a CUDA device (no synchronisation, and a graph capture allowed), formed as ``-expm1(t·ln β)``:
    ``1 - β2ᵗ`` formed in float32 would cancel (``1 - 0.999`` is 1.3e-5 off there), this is within a
    few float32 roundings."""
    if host_step:
        t = step.item()
        return 1 - beta1 ** t, (1 - beta2 ** t) ** 0.5
    ln1, ln2 = (math.log(b) if b > 0 else -math.inf for b in (beta1, beta2))  # β = 0: 1 - 0ᵗ is 1
    return -torch.expm1(step * ln1), (-torch.expm1(step * ln2)).sqrt()
