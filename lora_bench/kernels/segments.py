"""A block's query, key and value layers side by side: one fused launch forward and two backward.

The three layers share their input. Stored side by side (each parameter a view of one buffer,
``lora_bench.lora.kernel.group_layers``) they run as one where the fused plan runs: one input cast
and one cast of each adapter instead of three, one grad_x instead of three summed. Elsewhere
(eager CUDA, the CPU, torch.compile, a plan other than fused) each layer runs on its own, as
ungrouped (:func:`lora_bench.kernels.autograd.lora_linear`). Deferred adapter gradients
(``adapter_grads="deferred"``) are deferred for the three layers at once.
"""

from __future__ import annotations

import torch

from lora_bench.kernels import available, deferred
from lora_bench.kernels.autograd import cast, lora_linear, outside_autocast, plan_for_size
from lora_bench.kernels.call import TRITON_MAX_RANK, Plan
from lora_bench.kernels.plans import fused
from lora_bench.kernels.policy import carried, h_apart, h_by_cublas, in_force, note


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
    y (..., S·n), layer i's output in columns [i·n, (i+1)·n). Inputs after x, the scale, S, whether
    the layers have biases and whether their adapter gradients are deferred: the S weights, the S
    biases (``has_bias``), the S A's and the S B's — passed one by one so that autograd hands each
    its own gradient; the kernels read them through their stacked views
    (``stacked``: the caller checked that they lie back to back). The weights and biases are frozen.
    ``dora``: a ``dora_ahead.EpilogueScale`` for the S layers (or None), as in ``LoRAKernelFunction``.

    Autocast as in ``LoRAKernelFunction``: operands cast once to autocast's dtype (one cast per
    stacked buffer, not per layer), the math with autocast off."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, scale, segments, has_bias, defer, dora, apart, *params):
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
                x2, w3, bias3, a3, b3 = (cast(t, cdt) for t in (x2, w3, bias3, a3, b3))
                y, h = _forward(kern, x2, w3, a3, b3, bias3, s, dora, apart)
        else:
            for p in params:
                if p.dtype is not x.dtype:
                    raise TypeError(f"lora-kernel: input is {x.dtype} but a parameter is {p.dtype} (use autocast to mix)")
            y, h = _forward(kern, x2, w3, a3, b3, bias3, s, dora, apart)
        ctx.save_for_backward(x2, h, w3, a3, b3)
        ctx.scale, ctx.segments, ctx.has_bias, ctx.dev = s, S, has_bias, dev
        ctx.x_meta = (x.shape, x.dtype)
        ctx.ab_dtypes = (As[0].dtype, Bs[0].dtype)
        ctx.defer, ctx.apart = defer, apart
        ctx.in_force = in_force()  # the backward may run on autograd's thread, outside the caller's policy
        return y if x.dim() == 2 else y.view(*x.shape[:-1], S * n)

    @staticmethod
    def backward(ctx, grad_out):
        with carried(ctx.in_force):  # the forward's policy and plan log, on whichever thread runs this
            return outside_autocast(LoRASegmentsFunction._backward, ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x2, h, w3, a3, b3 = ctx.saved_tensors
        s, S = ctx.scale, ctx.segments
        kern = available.triton_kernels()
        a_dt, b_dt = ctx.ab_dtypes
        g = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, w3.shape[0])
        g = cast(g.contiguous(), x2.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gx, u = (torch_bwd_x_segments(g, w3, a3, b3, s) if ctx.apart == CUBLAS else
                     kern.lora_bwd_x_segments(g, w3, a3, b3, s, apart=bool(ctx.apart)))
            x_shape, x_dt = ctx.x_meta
            grad_x = cast(gx if len(x_shape) == 2 else gx.view(x_shape), x_dt)
        else:  # the input needs no gradient: u alone, each layer's g·Bᵀ
            n = b3.shape[2]
            u = torch.cat([g[:, i * n:(i + 1) * n] @ b3[i].t() for i in range(S)], 1)

        def adapter_grads():
            ga, gb = kern.lora_grad_ab(x2, u, h, g, scale=s, grad_dtype=a_dt, segments=S)
            return (*ga.unbind(0), *cast(gb, b_dt).unbind(0))

        frozen = (None,) * (S * (2 if ctx.has_bias else 1))
        ab = range(1 + len(frozen), 1 + len(frozen) + 2 * S)  # A_1..A_S, B_1..B_S among the tensor inputs
        if ctx.defer and deferred.accumulating(ctx, ab):
            deferred.defer(ctx, ab, adapter_grads, reads=(x2, u, h, g), device=g.device)
            return (grad_x, None, None, None, None, None, None, *frozen, *(None,) * (2 * S))
        return (grad_x, None, None, None, None, None, None, *frozen, *adapter_grads())


CUBLAS = "cublas"  # LoRASegmentsFunction's ``apart`` when the calls run on torch's GEMMs (``h_by_cublas``)


def _forward(kern, x2, w3, a3, b3, bias3, s, dora, apart):
    """(y, h) of the segments' forward: the fused launch (H in its K loop, or formed before it where
    ``apart``), DoRA's scaled one, or torch's GEMMs where ``apart`` is ``CUBLAS``."""
    if dora is not None:
        return fused.forward_scaled_segments(x2, w3, a3, b3, s, dora, apart=bool(apart))
    if apart == CUBLAS:
        return torch_fwd_segments(x2, w3, a3, b3, bias3, s)
    return kern.lora_fwd_segments(x2, w3, a3, b3, bias3, s, apart=bool(apart))


def torch_fwd_segments(x, w, a, b, bias, s):
    """``lora_fwd_segments`` on torch's GEMMs (cuBLAS on a GPU): y = x·Wᵀ + bias for the S layers in one
    GEMM, h = [x·A_1 | … | x·A_S] in one GEMM on the adapters laid side by side, then s·h_i·B_i added
    to each layer's columns by one batched GEMM writing in place. Shapes as ``lora_fwd_segments``; y is
    rounded once more than the fused launch rounds it (after the frozen product)."""
    S, k, r = a.shape
    n, M = b.shape[2], x.shape[0]
    y = torch.addmm(bias, x, w.t()) if bias is not None else torch.mm(x, w.t())
    h = torch.mm(x, a.transpose(0, 1).reshape(k, S * r))
    y.view(M, S, n).transpose(0, 1).baddbmm_(h.view(M, S, r).transpose(0, 1), b, alpha=s)
    return y, h


def torch_bwd_x_segments(g, w, a, b, s):
    """``lora_bwd_x_segments`` on torch's GEMMs: grad_x = g·W + s·Σ_i u_i·A_iᵀ and u = [g_1·B_1ᵀ | … |
    g_S·B_Sᵀ] (g_i: layer i's columns of g), in three GEMMs: g·W, one batched GEMM for u, and u·Aᵀ
    added in place with the adapters laid side by side."""
    S, k, r = a.shape
    n, M = b.shape[2], g.shape[0]
    gx = torch.mm(g, w)
    u = torch.bmm(g.view(M, S, n).transpose(0, 1), b.transpose(1, 2)).transpose(0, 1).reshape(M, S * r)
    gx.addmm_(u, a.transpose(1, 2).reshape(S * r, k).to(g.dtype), alpha=s)
    return gx, u


def fused_segments(x, layers, *, bias: bool = True, defer: bool | None = None, dora=None) -> torch.Tensor | None:
    """The lora-kernel op of ``layers`` (each with ``.linear`` and ``.lora``) on one input x as one
    fused call, y (..., S·n) with layer i's output in columns [i·n, (i+1)·n), where the fused plan
    runs and the layers lie side by side (same shapes, alpha, frozen bases, parameters back to back:
    ``group_layers``); else None (nothing run). ``bias``: add the layers' biases (their layer adds
    them itself where not); ``defer``: the adapter gradients deferred or not (None: as chosen);
    ``dora``: a ``dora_ahead.EpilogueScale`` of DoRA layers (their scale in the GEMM's epilogue; given
    the reason where the fused plan does not run)."""
    first = layers[0]
    S = len(layers)
    if torch.compiler.is_compiling() or S < 2:
        return None
    w, a = first.linear.weight, first.lora.A
    rank = a.shape[1]
    if S * rank > TRITON_MAX_RANK or (plan := plan_for_size(x, S * w.numel(), S * rank)) is not Plan.FUSED:
        if dora is not None:
            dora.why = (f"rank {S * rank} of the layers side by side is above the kernels' {TRITON_MAX_RANK}"
                        if S * rank > TRITON_MAX_RANK else f"the layers' plan is {plan.value}")
        return None
    params = segment_params(layers)
    if params is None:
        if dora is not None:
            dora.why = "the layers' parameters do not lie side by side"
        return None
    has_bias = first.linear.bias is not None
    if has_bias and not bias:
        params = params[:S] + params[2 * S:]
    apart = CUBLAS if dora is None and h_by_cublas(S * rank) else h_apart(S * rank)
    note(Plan.CUBLAS if apart == CUBLAS else Plan.FUSED)
    if defer is None:
        defer = deferred.chosen(params[-2 * S:])
    return LoRASegmentsFunction.apply(x, first.lora.alpha, S, has_bias and bias, defer, dora, apart, *params)


def lora_linear_segments(x, layers) -> tuple[torch.Tensor, ...]:
    """Outputs of the lora-kernel layers ``layers`` (each with ``.linear`` and ``.lora``) on one
    input x: one fused call where it can run (``fused_segments``), else one call each."""
    y = fused_segments(x, layers)
    if y is not None:
        return y.split(layers[0].linear.weight.shape[0], dim=-1)
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


def segment_params(layers) -> list[torch.Tensor] | None:
    """The parameters of layers that can run fused now (``parameter_kinds``, each kind back to
    back in one buffer), flat in LoRASegmentsFunction's order; else None."""
    kinds = parameter_kinds(layers)
    if kinds is None or any(stacked(k) is None for k in kinds):
        return None
    return [t for k in kinds for t in k]


__all__ = ["LoRASegmentsFunction", "fused_segments", "lora_linear_segments", "parameter_kinds", "segment_params",
           "stacked"]
