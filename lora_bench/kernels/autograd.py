"""``--trainable-layers lora-kernel``: the minimal-work LoRA op, and where each call runs.

Same parameters, init and alpha semantics as ``lora`` (y = x·Wᵀ + b + alpha·(x·A)·B, alpha not
divided by the rank); only forward/backward differ: one autograd op saves x and h (N×r), nothing
N×n, and never forms the frozen weight's gradient (docs/kernel-design.md#the-minimal-work). Each
call runs one plan (:mod:`lora_bench.kernels.plans`) chosen by :func:`lora_bench.kernels.policy.choose`:
"direct" and "cpp" run the C++ op, the others the Python Function ``LoRAKernelFunction`` below, or
under torch.compile the custom ops ``lora_bench::lora_linear_fwd`` / ``_bwd``, the plan chosen once
when the call is traced. Every call notes its plan: what a run reports as its ``backend``
(docs/kernel-design.md#how-a-plan-is-chosen). Where the policy defers the adapter gradients
(``adapter_grads="deferred"``), the Python Function's backward hands grad_A and grad_B to
:mod:`lora_bench.kernels.deferred` (a side stream, joined once per backward pass); the C++ op and
the compiled custom ops run them inline.
"""

from __future__ import annotations

from typing import Optional

import torch

from lora_bench.kernels import available, deferred
from lora_bench.kernels.call import Plan
from lora_bench.kernels.plans import PYTHON, cpp, direct, fused
from lora_bench.kernels.policy import (carried, choose, current_policy, h_apart, h_by_cublas, in_force, note,
                                      note_adapter_grads)


def compute_dtype(x: torch.Tensor, dev: str) -> torch.dtype:
    """The dtype a call computes in: autocast's when it is on (floating inputs), else the input's."""
    if torch.is_autocast_enabled(dev) and x.is_floating_point():
        return torch.get_autocast_dtype(dev)
    return x.dtype


def exact_fp32(dtype: torch.dtype) -> bool:
    return dtype is torch.float32 and torch.get_float32_matmul_precision() == "highest"


def call_plan(x: torch.Tensor, weight: torch.Tensor, rank: int) -> Plan:
    """The plan an eager call with this input and weight gets here and now: under the policy in
    force, on the current stream (capturing a CUDA graph or not). Runs on every layer call."""
    return plan_for_size(x, weight.numel(), rank)


def plan_for_size(x: torch.Tensor, weight_numel: int, rank: int) -> Plan:
    """``call_plan`` for a weight of ``weight_numel`` elements (layers side by side: their sum)."""
    cuda = x.is_cuda
    dev = "cuda" if cuda else x.device.type
    dtype = compute_dtype(x, dev)
    return choose(current_policy(), device=dev, dtype=dtype,
                  capturing=cuda and torch.cuda.is_current_stream_capturing(), compiling=False,
                  weight_numel=weight_numel, rank=rank,
                  exact_fp32=cuda and exact_fp32(dtype),  # (the CPU's plans never depend on it)
                  have_triton=available.HAVE_TRITON if cuda else available.HAVE_TRITON_INTERPRETER,
                  have_cpp=available.HAVE_CPP)


# ------------------------------------------------------------------------------- the math
# The Python Function and the custom ops run the pieces of the plan they were given
# (lora_bench.kernels.plans: fused, cublas or torch).


def cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype is dtype else t.to(dtype)


def outside_autocast(backward, ctx, grad_out):
    """Run a Function's backward with autocast off where it is on (it casts explicitly)."""
    if torch.is_autocast_enabled(ctx.dev):
        with torch.autocast(ctx.dev, enabled=False):
            return backward(ctx, grad_out)
    return backward(ctx, grad_out)


class LoRAKernelFunction(torch.autograd.Function):
    """y = x·Wᵀ + b + s·(x·A)·B with the minimal backward. Inputs: x (..., k), weight (n, k),
    bias (n) or None, A (k, r), B (r, n), scale (a float), plan (fused, cublas or torch: forward
    and backward run it), defer (the adapter gradients go to ``deferred``: ``deferred.chosen``),
    dora (a ``dora_ahead.EpilogueScale``, the fused plan only: the GEMM's epilogue also writes a DoRA
    layer's scaled output g ⊙ z + b, left in it; y is then the unscaled z, and the backward is
    unchanged).

    Autocast: ``custom_fwd`` records CUDA autocast state; on any device, with autocast on, every
    operand is cast once to autocast's dtype (what F.linear does) and the math runs with autocast
    off, so the Triton and torch paths see the same dtypes. Backward needs no autocast state (it
    casts explicitly), so instead of ``custom_bwd``'s context manager on every call it switches
    autocast off only where it is on (CPU backward runs on the caller's thread)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, A, B, scale, plan, defer, dora=None, apart=False):
        n, k = weight.shape
        dev = "cuda" if x.is_cuda else x.device.type
        x2 = x if x.dim() == 2 else x.reshape(-1, k)  # (N, k); a copy only if the batch dims don't flatten
        s = float(scale)
        if torch.is_autocast_enabled(dev) and x.is_floating_point():
            cdt = torch.get_autocast_dtype(dev)
            with torch.autocast(dev, enabled=False):
                x2, w, b = cast(x2, cdt), cast(weight, cdt), cast(bias, cdt)
                # A and B are cast here too (two small launches). The fused kernels can read fp32 A/B
                # and round in registers (same values), but that made a 124M graph step 6 % slower
                # on an H200 (4.52 vs 4.26 ms): the fp32 tiles cost more inside the K loop than the
                # two launches they save (docs/kernel-design.md).
                a, bm = cast(A, cdt), cast(B, cdt)
                y, h = _forward(plan, x2, w, b, a, bm, s, dora, apart)
        else:
            for p in (weight, A, B, bias):
                if p is not None and p.dtype is not x.dtype:
                    raise TypeError(f"lora-kernel: input is {x.dtype} but a parameter is {p.dtype} (use autocast to mix)")
            w, a, bm, b = weight, A, B, bias
            y, h = _forward(plan, x2, w, b, a, bm, s, dora, apart)
        ctx.save_for_backward(x2, h, w, a, bm)
        ctx.scale, ctx.plan, ctx.dev = s, plan, dev
        ctx.defer, ctx.apart = defer, apart
        ctx.in_force = in_force()  # the backward may run on autograd's thread, outside the caller's policy
        ctx.ab_edges = (3, 4) if bias is not None else (2, 3)  # A's and B's among the tensor inputs
        ctx.x_meta = (x.shape, x.dtype)
        ctx.param_dtypes = (weight.dtype, bias.dtype if bias is not None else None, A.dtype, B.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, grad_out):
        with carried(ctx.in_force):  # the forward's policy and plan log, on whichever thread runs this
            return outside_autocast(LoRAKernelFunction._backward, ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x2, h, w, a, bm = ctx.saved_tensors
        s, mode = ctx.scale, ctx.plan
        need_x, need_w, need_b, need_a, need_bl = ctx.needs_input_grad[:5]
        w_dt, b_dt, a_dt, bl_dt = ctx.param_dtypes
        grad_x = grad_w = grad_b = grad_a = grad_bl = None
        g = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, w.shape[0])  # (N, n)
        g = cast(g, x2.dtype)
        u = None
        if need_x:
            gx, u = fused.grad_x_u(g, w, a, bm, s, apart=True) if ctx.apart else PYTHON[mode].grad_x_u(g, w, a, bm, s)
            x_shape, x_dt = ctx.x_meta
            grad_x = cast(gx if len(x_shape) == 2 else gx.view(x_shape), x_dt)
        elif need_a:
            u = g @ cast(bm, g.dtype).t()  # the input needs no gradient (first layer): skip the big GEMM
        if need_a or need_bl:
            u = u if u is not None else h

            def adapter_grads():
                ga, gb = PYTHON[mode].grad_ab(x2, u, h, g, s, do_a=need_a, do_b=need_bl, dtype=a_dt)
                return ga, cast(gb, bl_dt)

            if ctx.defer and deferred.accumulating(ctx, ctx.ab_edges):
                deferred.defer(ctx, ctx.ab_edges, adapter_grads, reads=(x2, u, h, g), device=g.device)
            else:
                grad_a, grad_bl = adapter_grads()
        # Only a trainable base layer (the classification head) pays for these.
        if need_w:
            grad_w = cast(g.t() @ x2, w_dt)  # (n, k)
        if need_b:
            grad_b = cast(g.sum(0), b_dt)
        return grad_x, grad_w, grad_b, grad_a, grad_bl, None, None, None, None, None


def _forward(plan, x2, w, b, a, bm, s, dora, apart):
    """(y, h) of the Function's forward through ``plan`` (a DoRA layer's scaled forward: the fused plan);
    ``apart``: the fused plan with H formed before its GEMM (``policy.h_apart``)."""
    if dora is not None:
        return fused.forward_scaled(x2, w, a, bm, s, dora, apart=apart)
    if apart:
        return fused.forward(x2, w, b, a, bm, s, apart=True)
    return PYTHON[plan].forward(x2, w, b, a, bm, s)


# ------------------------------------------------------------------ under torch.compile
# Dynamo cannot trace into the Triton launch path (raw-pointer launcher) or the C++ op. Registered
# as custom ops with a fake (shape) implementation and an autograd formula, the layer's two
# halves are opaque calls in the compiled graph: no graph break, and inductor fuses what lies
# around them (autocast casts, LayerNorm, residual adds) while the ops run the same plans and
# helpers as the autograd Function. The plan is an argument of both ops, fixed when the call is
# traced: the compiled code (and its backward, which runs on autograd's own thread) runs it.


@torch.compiler.assume_constant_result
def _traced_plan(device: str, dtype: torch.dtype, weight_numel: int, rank: int) -> str:
    """The plan of a layer call torch.compile is tracing (run once, at trace time, with the policy
    then in force; noted then); the compiled graph holds the result as a constant."""
    plan = choose(current_policy(), device=device, dtype=dtype, capturing=False, compiling=True,
                  weight_numel=weight_numel, rank=rank, exact_fp32=exact_fp32(dtype),
                  have_triton=available.HAVE_TRITON if device == "cuda" else available.HAVE_TRITON_INTERPRETER,
                  have_cpp=False)
    note(plan)
    return plan.value


@torch.library.custom_op("lora_bench::lora_linear_fwd", mutates_args=())
def _op_fwd(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], a: torch.Tensor, bm: torch.Tensor,
            s: float, plan: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) for 2-D x of one dtype with the parameters (casts happen before, in traced code)."""
    return PYTHON[Plan(plan)].forward(x, w, b, a, bm, s)


@_op_fwd.register_fake
def _(x, w, b, a, bm, s, plan):
    return x.new_empty(x.shape[0], w.shape[0]), x.new_empty(x.shape[0], a.shape[1])


@torch.library.custom_op("lora_bench::lora_linear_bwd", mutates_args=())
def _op_bwd(g: torch.Tensor, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor, a: torch.Tensor,
            bm: torch.Tensor, s: float, need_x: bool, plan: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x or an empty tensor, grad_A, grad_B) in the compute dtype."""
    pieces = PYTHON[Plan(plan)]
    if need_x:
        gx, u = pieces.grad_x_u(g, w, a, bm, s)
    else:  # the input needs no gradient (first layer): skip the big GEMM
        gx, u = g.new_empty(0), g @ bm.t()
    ga, gb = pieces.grad_ab(x, u, h, g, s, do_a=True, do_b=True, dtype=a.dtype)
    return gx, ga, gb


@_op_bwd.register_fake
def _(g, x, h, w, a, bm, s, need_x, plan):
    gx = g.new_empty(g.shape[0], w.shape[1]) if need_x else g.new_empty(0)
    return gx, a.new_empty(a.shape), bm.new_empty(bm.shape)


def _op_setup(ctx, inputs, output):
    x, w, b, a, bm, s, plan = inputs
    ctx.save_for_backward(x, output[1], w, a, bm)
    ctx.s, ctx.has_bias, ctx.plan = s, b is not None, plan


def _op_backward(ctx, grad_y, grad_h):
    x, h, w, a, bm = ctx.saved_tensors
    need_x, need_w, need_b, need_a, need_bl, _, _ = ctx.needs_input_grad
    g = grad_y.contiguous()
    gx, ga, gb = torch.ops.lora_bench.lora_linear_bwd(g, x, h, w, a, bm, ctx.s, need_x, ctx.plan)
    grad_w = g.t() @ x if need_w else None  # a trainable base layer (the classification head)
    grad_b = g.sum(0) if need_b and ctx.has_bias else None
    return ((gx if need_x else None), grad_w, grad_b, (ga if need_a else None), (gb if need_bl else None),
            None, None)


_op_fwd.register_autograd(_op_backward, setup_context=_op_setup)


def _compiled_forward(x, weight, bias, A, B, scale):
    """The layer as torch.compile traces it: flatten, autocast casts, the forward op."""
    n, k = weight.shape
    rank = A.shape[1]
    x2 = x.reshape(-1, k)
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.is_floating_point():
        cdt = torch.get_autocast_dtype(dev)
        x2, weight, A, B = x2.to(cdt), weight.to(cdt), A.to(cdt), B.to(cdt)
        bias = bias.to(cdt) if bias is not None else None
    plan = _traced_plan(dev, x2.dtype, n * k, rank)
    y, _ = torch.ops.lora_bench.lora_linear_fwd(x2, weight, bias, A, B, float(scale), plan)
    return y.view(*x.shape[:-1], n)


def _note(plan: Plan) -> None:
    """Note an eager call's plan, and where the policy defers adapter gradients, that the C++ op's
    plans run them inline (the Python Function notes its own, ``deferred.chosen``)."""
    note(plan)
    if plan.cpp_op and current_policy().adapter_grads == deferred.DEFERRED:
        note_adapter_grads(deferred.CPP_OP)


def lora_linear(x, weight, bias, A, B, scale, dora=None):
    """The lora-kernel layer as a function: y = x·Wᵀ + b + scale·(x·A)·B, through the plan that
    ``call_plan`` (or, under torch.compile, the trace) chooses. ``dora``: a ``dora_ahead.EpilogueScale``,
    taken up where that plan is fused (``LoRAKernelFunction``), else given the reason."""
    if torch.compiler.is_compiling():
        return _compiled_forward(x, weight, bias, A, B, scale)
    plan = call_plan(x, weight, A.shape[1])
    if dora is not None and (dora.why is not None or plan is not Plan.FUSED):
        dora.why, dora = dora.why or f"the layer's plan is {plan.value}", None
    if plan is Plan.DIRECT:
        y = direct.layer(x, weight, bias, A, B, scale)
        if y is not None:
            _note(plan)
            return y
        plan = Plan.CPP  # this shape could not be registered: the C++ op's ATen GEMMs
    if plan is Plan.FUSED and dora is None and h_by_cublas(A.shape[1]):
        plan = Plan.CUBLAS  # adapter_h cublas: torch's GEMMs for a layer of 17 adapter columns or more
    _note(plan)
    if plan is Plan.CPP:
        return cpp.layer(x, weight, bias, A, B, scale)
    apart = plan is Plan.FUSED and h_apart(A.shape[1])
    return LoRAKernelFunction.apply(x, weight, bias, A, B, scale, plan, deferred.chosen((A, B)), dora, apart)


__all__ = ["LoRAKernelFunction", "call_plan", "cast", "compute_dtype", "exact_fp32", "lora_linear", "outside_autocast",
           "plan_for_size"]
