"""``--trainable-layers lora-kernel``: the minimal-work LoRA op, and where each call runs.

Same parameters, init and alpha semantics as ``lora`` (y = x·Wᵀ + b + alpha·(x·A)·B, alpha not
divided by the rank); only forward/backward differ. One autograd op does the minimal work
(docs performance.md, "LoRA layer, minimal work"):

    forward   h = x·A;  y = x·Wᵀ + b + s·h·B                 saves x and h (N×r), nothing N×n
    backward  u = g·Bᵀ; grad_x = g·W + s·u·Aᵀ; grad_A = s·xᵀ·u; grad_B = s·hᵀ·g
              grad_W = gᵀ·x and grad_b = Σg only if W/b require grad (a trainable head)

Each call runs one plan, chosen by :func:`lora_bench.kernels.policy.choose` under the policy in
force (``use_policy``; ``LORA_BENCH_KERNEL_MODE`` forces one for a run): "direct" and "cpp" run
the C++ autograd op (:mod:`lora_bench.kernels.lora_cpp`, launching the Triton kernels itself for
"direct", :mod:`lora_bench.kernels.direct`); "fused", "cublas" and "torch" run the Python
Function ``LoRAKernelFunction`` below. Under torch.compile the layer is traced as two custom ops
(``lora_bench::lora_linear_fwd`` / ``_bwd``, with fake implementations and an autograd formula)
that run those same three plans, chosen once when the call is traced: the compiled graph has no
break at the layer and the compiler fuses the work around it. Every call notes its plan
(``policy.note``): what a run reports as its ``backend``.
"""

from __future__ import annotations

from typing import Optional

import torch

from lora_bench.kernels import available, direct
from lora_bench.kernels.policy import TRITON_MAX_RANK, Plan, choose, current_policy, note


def _compute_dtype(x: torch.Tensor, dev: str) -> torch.dtype:
    """The dtype a call computes in: autocast's when it is on (floating inputs), else the input's."""
    if torch.is_autocast_enabled(dev) and x.is_floating_point():
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _exact_fp32(dtype: torch.dtype) -> bool:
    return dtype is torch.float32 and torch.get_float32_matmul_precision() == "highest"


def call_plan(x: torch.Tensor, weight: torch.Tensor, rank: int) -> Plan:
    """The plan an eager call with this input and weight gets here and now: under the policy in
    force, on the current stream (capturing a CUDA graph or not). Runs on every layer call."""
    return _plan(x, weight.numel(), rank)


def _plan(x: torch.Tensor, weight_numel: int, rank: int) -> Plan:
    """``call_plan`` for a weight of ``weight_numel`` elements (layers side by side: their sum)."""
    cuda = x.is_cuda
    dev = "cuda" if cuda else x.device.type
    dtype = _compute_dtype(x, dev)
    return choose(current_policy(), device=dev, dtype=dtype,
                  capturing=cuda and torch.cuda.is_current_stream_capturing(), compiling=False,
                  weight_numel=weight_numel, rank=rank,
                  exact_fp32=cuda and _exact_fp32(dtype),  # (the CPU's plans never depend on it)
                  have_triton=available.HAVE_TRITON if cuda else available.HAVE_TRITON_INTERPRETER,
                  have_cpp=available.HAVE_CPP)


# ------------------------------------------------------------------------- the streams plan
# The rank-r products are a few microseconds of work each, but on one stream every one of them is
# a kernel the big GEMMs wait for (and, replayed from a CUDA graph, a launch gap and a tail). The
# streams plan runs them on a second stream of high priority, beside the big cuBLAS GEMM that does
# not need them: x·A beside x·Wᵀ; g·Bᵀ, then grad_A and grad_B, beside g·W. The caller's stream
# waits for the side stream only where it needs its result (the rank-r updates of y and grad_x,
# and the adapter gradients before backward returns them), so nothing is left running after a
# call. Every tensor the side stream writes is allocated on the caller's stream, and the side
# stream first waits for the caller's, so the caching allocator (and a graph's memory pool) sees
# the usual one-stream lifetimes. Captured in a CUDA graph the fork and joins become graph edges.
_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's side stream (high priority; created on first use, so before any capture: graph
    warm-ups run the plan their capture records)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDE.get(idx)
    if side is None:
        side = _SIDE[idx] = torch.cuda.Stream(device=idx, priority=-1)
    return side


def _forward_streams(x, w, b, a, bm, s):
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    h = x.new_empty(x.shape[0], a.shape[1])
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.mm(x, a, out=h)
    y = torch.addmm(b, x, w.t()) if b is not None else x @ w.t()
    main.wait_stream(side)
    y.addmm_(h, bm, alpha=s)
    return y, h


def _grad_x_u_streams(g, w, a, bm, s):
    main = torch.cuda.current_stream(g.device)
    side = _side_stream(g.device)
    u = g.new_empty(g.shape[0], bm.shape[0])
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.mm(g, bm.t(), out=u)
    gx = g @ w
    main.wait_stream(side)  # (u only: the adapter gradients are queued on the side stream after this)
    gx.addmm_(u, a.t(), alpha=s)
    return gx, u


def _grad_ab_streams(x, u, h, g, s, *, do_a, do_b, dtype):
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    triton_ok = available.HAVE_TRITON and u.shape[1] <= TRITON_MAX_RANK
    k, r, n = x.shape[1], u.shape[1], g.shape[1]
    ga = x.new_empty(k, r, dtype=dtype if triton_ok else x.dtype) if do_a else None
    gb = x.new_empty(r, n, dtype=dtype if triton_ok else x.dtype) if do_b else None
    side.wait_stream(main)
    with torch.cuda.stream(side):
        if triton_ok:
            available.triton_kernels().lora_grad_ab(x, u, h, g, scale=s, ga_out=ga, gb_out=gb,
                                                    grad_dtype=dtype, do_a=do_a, do_b=do_b)
        else:
            if do_a:
                torch.mm(x.t(), u, out=ga).mul_(s)
            if do_b:
                torch.mm(h.t(), g, out=gb).mul_(s)
    main.wait_stream(side)
    return _cast(ga, dtype), _cast(gb, dtype)


# ------------------------------------------------------------------------------- the math
# Host time matters as much as device time here: at GPT-2 sizes a layer's forward+backward is
# host-bound on a fast GPU, so the code below avoids views, no-op casts and context managers it
# does not need (each costs microseconds of Python/dispatcher time per call).


def _forward(mode: Plan, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
             a: torch.Tensor, bm: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y (N×n), h (N×r) for x (N×k), w (n×k), a (k×r), bm (r×n)."""
    if mode is Plan.FUSED:
        return available.triton_kernels().lora_fwd(x, w, a, bm, b, s)
    if mode is Plan.STREAMS:
        return _forward_streams(x, w, b, a, bm, s)
    h = x @ a  # (N, r)
    y = torch.addmm(b, x, w.t()) if b is not None else x @ w.t()  # (N, n)
    y.addmm_(h, bm, alpha=s)  # in place: no N×n temporary
    return y, h


def _grad_x_u(mode: Plan, g: torch.Tensor, w: torch.Tensor, a: torch.Tensor, bm: torch.Tensor,
              s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_x = g·W + s·u·Aᵀ (N×k) and u = g·Bᵀ (N×r)."""
    if mode is Plan.FUSED:
        return available.triton_kernels().lora_bwd_x(g, w, a, bm, s)
    if mode is Plan.STREAMS:
        return _grad_x_u_streams(g, w, a, bm, s)
    u = g @ bm.t()  # (N, r)
    gx = g @ w  # (N, k)
    gx.addmm_(u, a.t(), alpha=s)
    return gx, u


def _grad_ab(mode: Plan, x: torch.Tensor, u: torch.Tensor, h: torch.Tensor, g: torch.Tensor, s: float,
             *, do_a: bool, do_b: bool, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """grad_A = s·xᵀ·u (k×r), grad_B = s·hᵀ·g (r×n), in the parameters' dtype."""
    if mode is Plan.STREAMS:
        return _grad_ab_streams(x, u, h, g, s, do_a=do_a, do_b=do_b, dtype=dtype)
    if mode is not Plan.TORCH:  # fused and cublas: one Triton launch for both
        return available.triton_kernels().lora_grad_ab(x, u, h, g, scale=s, grad_dtype=dtype, do_a=do_a, do_b=do_b)
    ga = torch.mm(x.t(), u).mul_(s).to(dtype) if do_a else None
    gb = torch.mm(h.t(), g).mul_(s).to(dtype) if do_b else None
    return ga, gb


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype is dtype else t.to(dtype)


def _outside_autocast(backward, ctx, grad_out):
    """Run a Function's backward with autocast off where it is on (it casts explicitly)."""
    if torch.is_autocast_enabled(ctx.dev):
        with torch.autocast(ctx.dev, enabled=False):
            return backward(ctx, grad_out)
    return backward(ctx, grad_out)


class LoRAKernelFunction(torch.autograd.Function):
    """y = x·Wᵀ + b + s·(x·A)·B with the minimal backward. Inputs: x (..., k), weight (n, k),
    bias (n) or None, A (k, r), B (r, n), scale (a float), plan (fused, cublas or torch: forward
    and backward run it).

    Autocast: ``custom_fwd`` records CUDA autocast state; on any device, with autocast on, every
    operand is cast once to autocast's dtype (what F.linear does) and the math runs with autocast
    off, so the Triton and torch paths see the same dtypes. Backward needs no autocast state (it
    casts explicitly), so instead of ``custom_bwd``'s context manager on every call it switches
    autocast off only where it is on (CPU backward runs on the caller's thread)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, A, B, scale, plan):
        n, k = weight.shape
        dev = "cuda" if x.is_cuda else x.device.type
        x2 = x if x.dim() == 2 else x.reshape(-1, k)  # (N, k); a copy only if the batch dims don't flatten
        s = float(scale)
        if torch.is_autocast_enabled(dev) and x.is_floating_point():
            cdt = torch.get_autocast_dtype(dev)
            with torch.autocast(dev, enabled=False):
                x2, w, b = _cast(x2, cdt), _cast(weight, cdt), _cast(bias, cdt)
                # A and B are cast here too (two small launches). The fused kernels can read fp32 A/B
                # and round in registers (same values), but that made a 124M graph step 6 % slower
                # on an H200 (4.52 vs 4.26 ms): the fp32 tiles cost more inside the K loop than the
                # two launches they save (docs/kernel-design.md).
                a, bm = _cast(A, cdt), _cast(B, cdt)
                y, h = _forward(plan, x2, w, b, a, bm, s)
        else:
            for p in (weight, A, B, bias):
                if p is not None and p.dtype is not x.dtype:
                    raise TypeError(f"lora-kernel: input is {x.dtype} but a parameter is {p.dtype} (use autocast to mix)")
            w, a, bm, b = weight, A, B, bias
            y, h = _forward(plan, x2, w, b, a, bm, s)
        ctx.save_for_backward(x2, h, w, a, bm)
        ctx.scale, ctx.plan, ctx.dev = s, plan, dev
        ctx.x_meta = (x.shape, x.dtype)
        ctx.param_dtypes = (weight.dtype, bias.dtype if bias is not None else None, A.dtype, B.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, grad_out):
        return _outside_autocast(LoRAKernelFunction._backward, ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x2, h, w, a, bm = ctx.saved_tensors
        s, mode = ctx.scale, ctx.plan
        need_x, need_w, need_b, need_a, need_bl, _, _ = ctx.needs_input_grad
        w_dt, b_dt, a_dt, bl_dt = ctx.param_dtypes
        grad_x = grad_w = grad_b = grad_a = grad_bl = None
        g = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, w.shape[0])  # (N, n)
        g = _cast(g, x2.dtype)
        u = None
        if need_x:
            gx, u = _grad_x_u(mode, g, w, a, bm, s)
            x_shape, x_dt = ctx.x_meta
            grad_x = _cast(gx if len(x_shape) == 2 else gx.view(x_shape), x_dt)
        elif need_a:
            u = g @ _cast(bm, g.dtype).t()  # the input needs no gradient (first layer): skip the big GEMM
        if need_a or need_bl:
            grad_a, grad_bl = _grad_ab(mode, x2, u if u is not None else h, h, g, s,
                                       do_a=need_a, do_b=need_bl, dtype=a_dt)
            grad_bl = _cast(grad_bl, bl_dt)
        # Only a trainable base layer (the classification head) pays for these.
        if need_w:
            grad_w = _cast(g.t() @ x2, w_dt)  # (n, k)
        if need_b:
            grad_b = _cast(g.sum(0), b_dt)
        return grad_x, grad_w, grad_b, grad_a, grad_bl, None, None


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
                  weight_numel=weight_numel, rank=rank, exact_fp32=_exact_fp32(dtype),
                  have_triton=available.HAVE_TRITON if device == "cuda" else available.HAVE_TRITON_INTERPRETER,
                  have_cpp=False)
    note(plan)
    return plan.value


@torch.library.custom_op("lora_bench::lora_linear_fwd", mutates_args=())
def _op_fwd(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], a: torch.Tensor, bm: torch.Tensor,
            s: float, plan: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) for 2-D x of one dtype with the parameters (casts happen before, in traced code)."""
    return _forward(Plan(plan), x, w, b, a, bm, s)


@_op_fwd.register_fake
def _(x, w, b, a, bm, s, plan):
    return x.new_empty(x.shape[0], w.shape[0]), x.new_empty(x.shape[0], a.shape[1])


@torch.library.custom_op("lora_bench::lora_linear_bwd", mutates_args=())
def _op_bwd(g: torch.Tensor, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor, a: torch.Tensor,
            bm: torch.Tensor, s: float, need_x: bool, plan: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x or an empty tensor, grad_A, grad_B) in the compute dtype."""
    mode = Plan(plan)
    if need_x:
        gx, u = _grad_x_u(mode, g, w, a, bm, s)
    else:  # the input needs no gradient (first layer): skip the big GEMM
        gx, u = g.new_empty(0), g @ bm.t()
    ga, gb = _grad_ab(mode, x, u, h, g, s, do_a=True, do_b=True, dtype=a.dtype)
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


def lora_linear(x, weight, bias, A, B, scale):
    """The lora-kernel layer as a function: y = x·Wᵀ + b + scale·(x·A)·B, through the plan that
    ``call_plan`` (or, under torch.compile, the trace) chooses."""
    if torch.compiler.is_compiling():
        return _compiled_forward(x, weight, bias, A, B, scale)
    plan = call_plan(x, weight, A.shape[1])
    if plan is Plan.DIRECT:
        pid = direct.plan_for(x, weight, bias, A, B)
        if pid >= 0:
            note(plan)
            return available.cpp_op().lora_linear(x, weight, bias, A, B, float(scale), pid,
                                                  torch._C._cuda_getCurrentRawStream(x.get_device()))
        plan = Plan.CPP  # this shape could not be registered: the C++ op's ATen GEMMs
    note(plan)
    if plan is Plan.CPP:
        return available.cpp_op().lora_linear(x, weight, bias, A, B, float(scale))
    return LoRAKernelFunction.apply(x, weight, bias, A, B, scale, plan)


# ------------------------------------------------------------- layers side by side
# A block's query, key and value layers share their input. Stored side by side (each parameter a
# view of one buffer, ``lora_bench.lora.kernel.group_layers``) they run as one fused launch
# forward and two backward where the Triton kernels run: one input cast and one cast of each
# adapter instead of three, one grad_x instead of three summed. Elsewhere (eager CUDA, the CPU,
# torch.compile, a plan other than fused) each layer runs on its own, as ungrouped.


def stacked(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one (S, *shape) view when they lie back to back in one buffer (same shape,
    dtype, contiguous, each starting where the previous ends), else None."""
    first = tensors[0]
    if not first.is_contiguous():
        return None
    span = first.numel() * first.element_size()
    ptr = first.data_ptr()
    for i, t in enumerate(tensors):
        if (t.shape != first.shape or t.dtype is not first.dtype or not t.is_contiguous()
                or t.data_ptr() != ptr + i * span or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
    return first.detach().as_strided((len(tensors), *first.shape), (first.numel(), *first.stride()))


class LoRASegmentsFunction(torch.autograd.Function):
    """S LoRA layers with one input x (..., k), run by the fused segment kernels: returns
    y (..., S·n), layer i's output in columns [i·n, (i+1)·n). Inputs after x and the scale: the S
    weights, the S biases (``has_bias``), the S A's and the S B's — passed one by one so that
    autograd hands each its own gradient; the kernels read them through their stacked views
    (``stacked``: the caller checked that they lie back to back). The weights and biases are frozen.

    Autocast as in ``LoRAKernelFunction``: operands cast once to autocast's dtype (one cast per
    stacked buffer, not per layer), the math with autocast off."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, scale, segments, has_bias, *params):
        S = segments
        ws, bs = params[:S], (params[S:2 * S] if has_bias else None)
        As, Bs = params[S + S * has_bias:2 * S + S * has_bias], params[2 * S + S * has_bias:]
        n, k = ws[0].shape
        w3, a3, b3 = stacked(list(ws)).view(S * n, k), stacked(list(As)), stacked(list(Bs))
        bias3 = stacked(list(bs)).view(S * n) if has_bias else None
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        s = float(scale)
        dev = "cuda" if x.is_cuda else x.device.type
        kern = available.triton_kernels()
        if torch.is_autocast_enabled(dev) and x.is_floating_point():
            cdt = torch.get_autocast_dtype(dev)
            with torch.autocast(dev, enabled=False):
                x2, w3, bias3, a3, b3 = (_cast(t, cdt) for t in (x2, w3, bias3, a3, b3))
                y, h = kern.lora_fwd_segments(x2, w3, a3, b3, bias3, s)
        else:
            for p in params:
                if p.dtype is not x.dtype:
                    raise TypeError(f"lora-kernel: input is {x.dtype} but a parameter is {p.dtype} (use autocast to mix)")
            y, h = kern.lora_fwd_segments(x2, w3, a3, b3, bias3, s)
        ctx.save_for_backward(x2, h, w3, a3, b3)
        ctx.scale, ctx.segments, ctx.has_bias, ctx.dev = s, S, has_bias, dev
        ctx.x_meta = (x.shape, x.dtype)
        ctx.ab_dtypes = (As[0].dtype, Bs[0].dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], S * n)

    @staticmethod
    def backward(ctx, grad_out):
        return _outside_autocast(LoRASegmentsFunction._backward, ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x2, h, w3, a3, b3 = ctx.saved_tensors
        s, S = ctx.scale, ctx.segments
        kern = available.triton_kernels()
        a_dt, b_dt = ctx.ab_dtypes
        g = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, w3.shape[0])
        g = _cast(g.contiguous(), x2.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gx, u = kern.lora_bwd_x_segments(g, w3, a3, b3, s)
            x_shape, x_dt = ctx.x_meta
            grad_x = _cast(gx if len(x_shape) == 2 else gx.view(x_shape), x_dt)
        else:  # the input needs no gradient: u alone, each layer's g·Bᵀ
            n = b3.shape[2]
            u = torch.cat([g[:, i * n:(i + 1) * n] @ b3[i].t() for i in range(S)], 1)
        ga, gb = kern.lora_grad_ab(x2, u, h, g, scale=s, grad_dtype=a_dt, segments=S)
        gb = _cast(gb, b_dt)
        frozen = (None,) * (S * (2 if ctx.has_bias else 1))
        return (grad_x, None, None, None, *frozen, *ga.unbind(0), *gb.unbind(0))


def lora_linear_segments(x, layers) -> tuple[torch.Tensor, ...]:
    """Outputs of the lora-kernel layers ``layers`` (each with ``.linear`` and ``.lora``) on one
    input x: one fused call where the fused plan runs and the layers lie side by side (same
    shapes, alpha, frozen bases, parameters back to back: ``group_layers``), else one call each."""
    first = layers[0]
    S = len(layers)
    if not torch.compiler.is_compiling() and S > 1:
        w, a = first.linear.weight, first.lora.A
        rank = a.shape[1]
        if S * rank <= TRITON_MAX_RANK and _plan(x, S * w.numel(), S * rank) is Plan.FUSED:
            params = _segment_params(layers)
            if params is not None:
                note(Plan.FUSED)
                y = LoRASegmentsFunction.apply(x, first.lora.alpha, S, first.linear.bias is not None, *params)
                return y.split(w.shape[0], dim=-1)
    return tuple(lora_linear(x, m.linear.weight, m.linear.bias, m.lora.A, m.lora.B, m.lora.alpha) for m in layers)


def parameter_kinds(layers) -> list[list[torch.Tensor]] | None:
    """[weights, biases (left out when none has one), A's, B's] of lora-kernel layers that could
    run as one: frozen bases, one alpha, biases on all or none; else None."""
    kinds = [[m.linear.weight for m in layers], [m.linear.bias for m in layers],
             [m.lora.A for m in layers], [m.lora.B for m in layers]]
    if any(b is None for b in kinds[1]):
        if not all(b is None for b in kinds[1]):
            return None
        kinds.pop(1)
    bases = (*kinds[0], *(kinds[1] if len(kinds) == 4 else ()))
    if any(t.requires_grad for t in bases) or len({m.lora.alpha for m in layers}) != 1:
        return None  # a trainable base: its gradient is not computed by the segment kernels
    return kinds


def _segment_params(layers) -> list[torch.Tensor] | None:
    """The parameters of layers that can run fused now (``parameter_kinds``, each kind back to
    back in one buffer), flat in LoRASegmentsFunction's order; else None."""
    kinds = parameter_kinds(layers)
    if kinds is None or any(stacked(k) is None for k in kinds):
        return None
    return [t for k in kinds for t in k]


__all__ = ["LoRAKernelFunction", "LoRASegmentsFunction", "call_plan", "lora_linear", "lora_linear_segments",
           "parameter_kinds", "stacked"]
