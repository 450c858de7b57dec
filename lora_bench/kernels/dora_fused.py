"""DoRA's norm and scale inside the LoRA op's kernels (``dora_fusion: fused``): ``fused_output`` runs
``DoRAFusedFunction`` (:mod:`lora_bench.kernels.dora_triton_fused`'s kernels) where the call can take
them (``fused_why``), noted as the norm's path ``fused``; elsewhere the caller runs the split path of
:mod:`lora_bench.kernels.dora`, whose math this computes (docs/variants.md)."""

from __future__ import annotations

import torch

from lora_bench.kernels.autograd import cast, compute_dtype, outside_autocast, plan_for_size
from lora_bench.kernels.call import TRITON_MAX_RANK, Plan
from lora_bench.kernels.dora import _per_layer, _rows, _split_params, _triton_why, triton_bwd
from lora_bench.kernels.plan_names import DORA_FUSION_FUSED
from lora_bench.kernels.policy import current_policy, note, note_dora
from lora_bench.kernels.segments import stacked


def triton_fused():
    """The fused kernels (``lora_bench.kernels.dora_triton_fused``): asked for only where Triton's
    path is open (``fused_why``)."""
    from lora_bench.kernels import dora_triton_fused

    return dora_triton_fused


class DoRAFusedFunction(torch.autograd.Function):
    """S DoRA layers on one input x (S = 1: one layer), their norms and scales inside the LoRA op's
    kernels (:mod:`lora_bench.kernels.dora_triton_fused`): forward one launch, the norm and the scale in
    the LoRA kernel's loop and epilogue; y (..., S·n), layer i's output in columns [i·n, (i+1)·n).
    Inputs after x: the scale, S, whether the layers have biases, exact, W (S·n × in, frozen, in the
    dtype the call computes in), its ‖W_j‖² (S·n, float32) or None (summed in the kernel), the S m's,
    the S biases (``has_bias``), the S A's and the S B's one by one, read through their stacked views
    where S > 1 (the caller checked that they lie back to back).

    Autocast as in ``LoRAKernelFunction``: x, A and B cast once to autocast's dtype for the products;
    the norm reads A in W's dtype (the same values) and B, m and the bias as stored. Backward: the
    LoRA kernels' two launches with dz = dy ⊙ g formed where dy is read (dz is never written), the
    second also summing the scale's parts of dg = Σ dy ⊙ z and db = Σ dy; then dm and db from the
    parts in one launch (detached norm), or the exact norm's two launches, which add the parts where
    they read them and add the norm's dA and dB onto the LoRA kernels' (where autograd sums the two on
    the split path)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, scale, segments, has_bias, exact, weight, weight_sq, *params):
        S = segments
        ms, bs, As, Bs = _split_params(params, S, has_bias)
        if S == 1:
            m3, bias3, a3, b3 = ms[0], (bs[0] if has_bias else None), As[0], Bs[0]
        else:
            m3, a3, b3 = stacked(list(ms)).reshape(-1), stacked(list(As)), stacked(list(Bs))
            bias3 = stacked(list(bs)).reshape(-1) if has_bias else None
        k = weight.shape[1]
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        dev = "cuda" if x.is_cuda else x.device.type
        s = float(scale)
        if torch.is_autocast_enabled(dev) and x.is_floating_point():
            cdt = torch.get_autocast_dtype(dev)
            with torch.autocast(dev, enabled=False):
                x2, ac, bc = cast(x2, cdt), cast(a3, cdt), cast(b3, cdt)
                y, z, h, n, g, cn, vt = triton_fused().lora_dora_forward(x2, weight, ac, bc, b3, m3, bias3, s,
                                                                         weight_sq)
        else:
            ac, bc = a3, b3
            y, z, h, n, g, cn, vt = triton_fused().lora_dora_forward(x2, weight, ac, bc, b3, m3, bias3, s, weight_sq)
        if exact:
            ctx.save_for_backward(x2, h, weight, ac, bc, z, g, n, a3, b3, cn, vt)
        else:
            ctx.save_for_backward(x2, h, weight, ac, bc, z, g, n)
        ctx.scale, ctx.exact, ctx.segments, ctx.has_bias, ctx.dev = s, bool(exact), S, has_bias, dev
        ctx.x_meta = (x.shape, x.dtype)
        ctx.dtypes = (ms[0].dtype, bs[0].dtype if has_bias else None, As[0].dtype, Bs[0].dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        return outside_autocast(DoRAFusedFunction._backward, ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        S, s = ctx.segments, ctx.scale
        m_dt, bias_dt, a_dt, b_dt = ctx.dtypes
        x2, h, weight, ac, bc, z, g, n, *norm = ctx.saved_tensors
        need = ctx.needs_input_grad
        first = 7  # x, scale, segments, has_bias, exact, weight, weight_sq
        need_m = any(need[first:first + S])
        need_bias = ctx.has_bias and any(need[first + S:first + 2 * S])
        kern = triton_fused()
        rows = _rows(cast(dy, z.dtype))
        grad_x = None
        if need[0]:  # grad_x and u, dz = dy ⊙ g formed where dy is read
            gx, u = kern.lora_dora_bwd_x(rows, g, weight, ac, bc, s)
            x_shape, x_dt = ctx.x_meta
            grad_x = cast(gx if len(x_shape) == 2 else gx.view(x_shape), x_dt)
        else:  # the input needs no gradient (the first block): u alone, from dz formed here
            dz = (rows.float() * g).to(rows.dtype)
            n_out = z.shape[1] // S
            u = (dz @ bc.t() if S == 1
                 else torch.cat([dz[:, i * n_out:(i + 1) * n_out] @ bc[i].t() for i in range(S)], 1))
        # the adapters' gradients, and the scale's parts of dg and db, in one launch
        grad_a, grad_b, pg, pb = kern.lora_dora_grad_ab(x2, u, h, rows, z, g, scale=s, segments=S, grad_dtype=a_dt,
                                                        need_db=need_bias)
        grad_b = cast(grad_b, b_dt)
        if ctx.exact:  # dm, db and the norm's dA and dB added onto the LoRA kernels', from dg's and db's parts
            a3, b3, cn, vt = norm
            grad_m, grad_b, grad_a, _, db = triton_bwd().dora_exact_bwd(
                pg, n, cn, vt, weight, a3, b3, s, m_dtype=m_dt, need_m=need_m, need_b=True, need_cb=False,
                bias_parts=pb, add_to=(grad_a, grad_b))
        else:  # dg, db and dm = dg / n from the parts
            _, db, grad_m = triton_bwd().sum_parts(pg, pb, n=n if need_m else None, m_dtype=m_dt)
        return (grad_x, None, None, None, None, None, None, *_per_layer(grad_m, S, flat=True),
                *(_per_layer(cast(db, bias_dt), S, flat=True) if ctx.has_bias else ()),
                *_per_layer(grad_a, S), *_per_layer(grad_b, S))


FUSED = "fused"  # the norm's path noted where it runs inside the LoRA kernels (backend: dora-norm-fused)


def fused_why(x: torch.Tensor, weight: torch.Tensor, params: list[torch.Tensor], segments: int) -> str | None:
    """Why S DoRA layers on x (``fused_output``'s operands) cannot run fused into the LoRA kernels, or None:
    it needs the norm's Triton path (``_triton_why``), a frozen W in the dtype the call computes in,
    the adapters in it too without autocast, ranks within the LoRA kernel's limit, side by side layers
    of a multiple of ``FUSED_ALIGN`` outputs, and the fused plan for the LoRA op of the S layers, or
    the C++ op's cuBLAS GEMMs that the size rule gives a captured call: for a DoRA layer the Triton
    kernels run there too."""
    S = segments
    a, b = params[-2 * S], params[-1]
    dev = "cuda" if x.is_cuda else x.device.type
    cdt = compute_dtype(x, dev)
    why = _triton_why(weight, a)
    if why is not None:
        return why
    if weight.requires_grad:
        return "a trained W (its gradient is the split path's)"
    if weight.dtype is not cdt or not (torch.is_autocast_enabled(dev) or (a.dtype is cdt and b.dtype is cdt)):
        return f"W and the adapters in the dtype the call computes in ({cdt}), not {weight.dtype} and {a.dtype}"
    if S * a.shape[1] > TRITON_MAX_RANK:
        return f"{S} layers of rank {a.shape[1]}: above the LoRA kernel's {TRITON_MAX_RANK} columns"
    if S > 1 and b.shape[1] % FUSED_ALIGN:
        return f"layers of {b.shape[1]} outputs side by side (not a multiple of {FUSED_ALIGN})"
    plan = plan_for_size(x, weight.numel(), S * a.shape[1])
    # A captured call with a weight of the size rule's threshold (1558M's MLP) takes the C++ op's
    # cuBLAS GEMMs as a LoRA layer, which beat the Triton GEMM there by 9 to 19 µs a layer; a DoRA
    # layer takes the Triton kernels with its norm and scale inside instead, since its split path
    # costs more beside cuBLAS (the norm's two launches forward and the scale's two backward: about
    # 50 and 20 µs at 1558M's MLP shapes). docs/variants.md's prediction says what to measure.
    if plan is Plan.CPP and (current_policy().capture or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
        return None
    if plan is not Plan.FUSED:
        return "a LoRA plan other than fused"
    return None


def fused_output(x: torch.Tensor, weight: torch.Tensor, params: list[torch.Tensor], *, scale: float,
                 segments: int, has_bias: bool, exact: bool,
                 weight_sq: torch.Tensor | list[torch.Tensor] | None = None) -> torch.Tensor | None:
    """y of S DoRA layers on x (``DoRAFusedFunction``: W is S·n × in, ``params`` the m's, biases, A's
    and B's in its order, ``weight_sq`` W's ‖W_j‖² in float32, the S layers' one by one (read as one
    where they lie back to back), or None), where the policy in force asks for ``dora_fusion:
    fused``, torch.compile is not tracing, and the call can run it (``fused_why``); noted as the LoRA
    plan ``fused`` with the norm's path ``fused``. Else None, nothing run or noted: the caller runs
    the split path, which notes its own. Where no float32 ‖W_j‖² lies in one buffer (a float64 W's,
    layers' not back to back), the kernel sums it itself."""
    if torch.compiler.is_compiling() or current_policy().dora_fusion != DORA_FUSION_FUSED:
        return None
    if fused_why(x, weight, params, segments) is not None:
        return None
    note(Plan.FUSED)
    note_dora(FUSED)
    if isinstance(weight_sq, list):  # (read as one only here: the split path never pays for it)
        weight_sq = stacked(weight_sq)
        weight_sq = None if weight_sq is None else weight_sq.reshape(-1)
    if weight_sq is not None and weight_sq.dtype is not torch.float32:
        weight_sq = None
    return DoRAFusedFunction.apply(x, scale, segments, has_bias, exact, weight, weight_sq, *params)


FUSED_ALIGN = 16  # the narrowest block of outputs the fused forward takes (side by side: one layer's)


__all__ = ["FUSED", "FUSED_ALIGN", "DoRAFusedFunction", "fused_output", "fused_why", "triton_fused"]
