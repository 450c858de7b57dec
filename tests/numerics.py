"""Helpers shared by the kernel tests: relative error against a reference, fresh inputs, a pair of
tiny LoRA models with the same weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lora_bench.lora import LinearWithLoRA, inject_lora
from lora_bench.lora.kernel import LinearWithLoRAKernel
from lora_bench.model.gpt2 import build_random_model, gpt_config


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖; an exactly-zero reference must be matched exactly (NaN never passes)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if out.isnan().any():
        return float("inf")
    if ref.norm() == 0:
        return 0.0 if out.norm() == 0 else float("inf")
    return float((out - ref).norm() / ref.norm())


def fresh(*shape, device, dtype, scale=1.0) -> torch.Tensor:
    """Random normal values drawn anew on every call (no fixed seed), cast to ``dtype``."""
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def float64_operands():
    """x (2, 5, 7), W (6, 7), b (6), A (7, 3), B (3, 6) in float64, all requiring grad (W and b
    too: a trainable head's gradients are checked as well): inputs for gradcheck."""
    shapes = ((2, 5, 7), (6, 7), (6,), (7, 3), (3, 6))
    return tuple(torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes)


def layer_operands(*, batch: tuple[int, ...], k: int, n: int, r: int, device, dtype, bias: bool = True,
                   noncontig: bool = False):
    """Fresh x (..., k), W (n, k), b (n) or None, A (k, r), B (r, n) for a LoRA layer, scaled so
    outputs stay O(1); ``noncontig``: the same kind of x with transposed storage."""
    if noncontig:
        x = fresh(k, *batch, device=device, dtype=dtype).movedim(0, -1)
        assert not x.is_contiguous()
    else:
        x = fresh(*batch, k, device=device, dtype=dtype)
    w = fresh(n, k, device=device, dtype=dtype, scale=k ** -0.5)
    b = fresh(n, device=device, dtype=dtype) if bias else None
    a = fresh(k, r, device=device, dtype=dtype, scale=k ** -0.5)
    bm = fresh(r, n, device=device, dtype=dtype)
    return x, w, b, a, bm


def model_pair(device: str, dtype: torch.dtype, classes=(LinearWithLoRA, LinearWithLoRAKernel)):
    """Tiny GPT with a trainable 2-class head, LoRA everywhere, one model per class, same weights."""
    models = []
    for cls in classes:
        torch.manual_seed(7)
        m = build_random_model(gpt_config("tiny", context_length=64))
        m.requires_grad_(False)
        m.out_head = nn.Linear(m.cfg.emb_dim, 2)
        torch.manual_seed(8)
        inject_lora(m, cls=cls, rank=4, alpha=2.0)
        models.append(m)
    gen = torch.Generator().manual_seed(9)
    for name, p in models[0].named_parameters():
        if name.endswith("lora.B"):  # moderate, so the model is not chaotic in bf16
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return [m.to(device, dtype) for m in models]


def run_model(m, idx):
    logits = m(idx)[:, -1, :]
    logits.float().logsumexp(-1).sum().backward()
    return logits, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}


ROOT = Path(__file__).resolve().parents[1]
INTERP_SKIP = "this Triton's interpreter does not work with this NumPy (needs Triton >= 3.7 or NumPy < 2.4)"


def run_interpreted(args: list[str]) -> subprocess.CompletedProcess:
    """``python ARGS`` from the checkout's root under Triton's CPU interpreter (TRITON_INTERPRET=1,
    this checkout's lora_bench first on the path); skips the test where that interpreter cannot run."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if "only 0-dimensional arrays can be converted" in proc.stderr:
        pytest.skip(INTERP_SKIP)
    return proc

