"""precision=bf16-true's optimizer (train.master_weights): AdamW on float32 master copies of bfloat16
parameters is float32 AdamW on the gradients' float32 values, rounded into the parameters; updates
below a bfloat16 step accumulate; its state restores the masters (what CUDA-graph capture does)."""

from __future__ import annotations

import torch

from lora_bench.train.master_weights import MASTER, MasterWeights


def _pair(n: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(5, 4, generator=gen) for _ in range(n)]
    params = [torch.nn.Parameter(v.to(torch.bfloat16)) for v in values]
    frozen = torch.nn.Parameter(torch.randn(3, generator=gen).to(torch.bfloat16), requires_grad=False)
    opt = MasterWeights([*params, frozen], lambda ms: torch.optim.AdamW(ms, lr=1e-2, weight_decay=0.1))
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    return params, frozen, opt, ref, ref_opt


def test_a_step_is_float32_adamw_rounded_into_the_parameters():
    """Same operations on the same float32 values: the masters equal float32 AdamW's parameters
    exactly, and the bfloat16 parameters are them rounded to nearest; a frozen parameter and one
    without a gradient this step are left alone."""
    params, frozen, opt, ref, ref_opt = _pair()
    frozen_before = frozen.detach().clone()
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        for i, (p, r) in enumerate(zip(params, ref)):
            g = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            used = not (step == 2 and i == 1)
            p.grad = g if used else None
            r.grad = g.float() if used else None
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        for p, m, r in zip(params, opt.masters, ref):
            assert m.dtype is torch.float32 and torch.equal(m, r.detach())
            assert p.dtype is torch.bfloat16 and torch.equal(p.detach(), r.detach().to(torch.bfloat16))
            assert p.grad is None
    assert torch.equal(frozen, frozen_before) and len(opt.masters) == len(params)


def test_updates_below_a_bfloat16_step_accumulate():
    """lr 1e-4 on values near 1 (a bfloat16 step below 1 is 2^-8): each update rounds away in
    bfloat16, but the master keeps them and the parameter moves once they add up."""
    p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = MasterWeights([p], lambda ms: torch.optim.AdamW(ms, lr=1e-4, weight_decay=0.0))
    plain = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    plain_opt = torch.optim.AdamW([plain], lr=1e-4, weight_decay=0.0)
    for _ in range(100):
        p.grad = torch.ones_like(p)
        plain.grad = torch.ones_like(plain)
        opt.step()
        plain_opt.step()
    assert torch.equal(plain.detach(), torch.ones(8, dtype=torch.bfloat16))  # every update rounded away
    # Adam's update with a constant gradient is lr (less eps's 1e-8 relative); 100 float32 steps
    # near 1 round at most 2^-24 each
    assert torch.allclose(opt.masters[0], torch.full((8,), 1 - 100 * 1e-4), rtol=0, atol=100 * 2.0 ** -24)
    assert torch.equal(p.detach(), opt.masters[0].to(torch.bfloat16)) and (p < 1).all()


def test_state_holds_the_masters_for_a_snapshot_to_restore():
    """Each parameter's master is in ``state`` under the parameter: copying a snapshot of the state
    back (as CUDA-graph capture does after its warm-up steps) restores the masters, and the next
    step starts from them."""
    params, _, opt, _, _ = _pair(seed=2)
    state = opt.state
    assert all(state[p][MASTER] is m for p, m in zip(params, opt.masters))
    snap = {id(p): {k: v.clone() for k, v in s.items()} for p, s in state.items()}
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert not torch.equal(opt.masters[0], snap[id(params[0])][MASTER])
    with torch.no_grad():
        for p, s in opt.state.items():
            for k, v in s.items():
                v.copy_(snap[id(p)][k]) if id(p) in snap else v.zero_()
    assert all(torch.equal(m, snap[id(p)][MASTER]) for p, m in zip(params, opt.masters))
