"""``--trainable-layers lora-kernel``: the LoRA layer with a hand-written backward.

Same parameters, init and alpha semantics as ``lora`` (y = x·Wᵀ + b + alpha·(x·A)·B, alpha not
divided by the rank); only forward/backward differ. One autograd op does the minimal work
(docs performance.md, "LoRA layer, minimal work"):

    forward   h = x·A;  y = x·Wᵀ + b + s·h·B                 saves x and h (N×r), nothing N×n
    backward  u = g·Bᵀ; grad_x = g·W + s·u·Aᵀ; grad_A = s·xᵀ·u; grad_B = s·hᵀ·g
              grad_W = gᵀ·x and grad_b = Σg only if W/b require grad (a trainable head)

Where it runs (``LORA_BENCH_KERNEL_MODE=fwd[:bwd]`` or ``set_kernel_mode`` overrides, for measurements):
  direct  the C++ autograd op launching the Triton kernels below itself, through the CUDA driver
          (lora_bench/kernels/direct.py): one launch forward, two backward, no dispatcher call per
          GEMM. bf16/fp16 compute dtypes on CUDA (also under autocast); others run as "cpp".
  cpp     the C++ autograd op (lora_bench/kernels/lora_cpp.py): ATen calls, cuBLAS for every GEMM;
          one pybind call per forward, no Python in backward. Whole-layer modes (never "cpp:x");
          forced, "cpp" and "direct" also run on CPU (tests), as "cpp".
  fused   Triton: one launch forward (big GEMM with the rank-r path folded in), two backward
  cublas  cuBLAS for the GEMMs (torch ops), one Triton launch for grad_A and grad_B together
  torch   torch ops only: the CPU path, and the fallback on CUDA without Triton
The last three run in the Python autograd Function ``LoRAKernelFunction`` (plan chosen by ``_plan``).

Under torch.compile the layer is traced as two custom ops (``lora_bench::lora_linear_fwd`` /
``_bwd``, with fake implementations and an autograd formula) that run these same plans: the
compiled graph has no break at the layer and the compiler fuses the work around it.

Default on CUDA: the C++ op, when it builds, in eager mode, i.e. unless the current stream is
capturing a CUDA graph or torch.compile is tracing (``_route``, checked on every call, cheaply):
"direct" for bf16/fp16 (H200, GPT-2 1558M shapes, bf16: 1.01-1.07× the frozen layer's eager
forward+backward against 1.97-1.99× with its cuBLAS calls; kernels/NOTES.md, v7), "cpp" for fp32.
Rationale: at GPT-2 sizes an eager layer is host-bound (lora_bench/kernels/NOTES.md): the frozen
layer is one C++ op each way, while the Python Function costs tens of microseconds of
apply/ctx work each way on top of its launches, so the fewest Python calls win. Under graph
capture only device time matters: there the previous plans apply as before (except at the largest
weights, ``CPP_GRAPH_MIN_WEIGHT``), fused for bf16/fp16 (and fp32 when
torch allows tf32), cublas for exact fp32 (H200: eager bf16 fwd+bwd fused 666-770 us vs 896-1038
for cublas; replayed from a CUDA graph cublas is 4-15 % faster at the 4×-MLP shapes, so graph
users may set LORA_BENCH_KERNEL_MODE=cublas). Without the C++ op (no compiler or ninja: one
warning) the CUDA default is those plans in eager mode too. CPU default: torch (cpp when forced).
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from lora_bench.errors import UsageError
from lora_bench.kernels import direct as _direct  # (imports no Triton)

_MODES = ("fused", "cublas", "torch", "cpp", "direct")
_TORCH = ("torch", "torch")
_CPP = ("cpp", "cpp")
_DIRECT = ("direct", "direct")
_WHOLE = {"cpp": _CPP, "direct": _DIRECT}  # whole-layer modes: the C++ op
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_triton_state: dict[str, object] = {}  # "module" -> lora_triton, or "error" -> reason


def _parse_mode(text: str | None) -> tuple[str, str] | None:
    if not text:
        return None
    parts = text.split(":")
    fwd, bwd = parts[0], parts[-1]
    if fwd not in _MODES or bwd not in _MODES or len(parts) > 2:
        raise KernelModeError(f"lora-kernel mode {text!r}: expected MODE or FWD:BWD with modes {', '.join(_MODES)}")
    for whole in _WHOLE:
        if whole in (fwd, bwd):
            if fwd != bwd:
                raise KernelModeError(f"lora-kernel mode {text!r}: '{whole}' is a whole-layer mode (forward "
                                      "and backward are one C++ op); it cannot be mixed with another mode")
            return _WHOLE[whole]
    return fwd, bwd


class KernelModeError(UsageError, ValueError):
    """A bad forced plan (``set_kernel_mode`` or the LORA_BENCH_KERNEL_MODE variable)."""


try:  # a bad variable must not break importing the package: reported when lora-kernel is used
    _mode_override, _ENV_ERROR = _parse_mode(os.environ.get("LORA_BENCH_KERNEL_MODE")), None
except KernelModeError as _exc:
    _mode_override, _ENV_ERROR = None, f"LORA_BENCH_KERNEL_MODE: {_exc}"


def set_kernel_mode(mode: str | None) -> None:
    """Force a plan ("cpp", "fused", "cublas", "torch" or "fwd:bwd" of the last three); None
    restores the default."""
    global _mode_override
    _mode_override = _parse_mode(mode)


def _triton():
    """The Triton kernels module, or None (with one clear warning) if Triton cannot be used."""
    if "module" in _triton_state:
        return _triton_state["module"]
    if "error" in _triton_state:
        return None
    try:
        from lora_bench.kernels import lora_triton

        _triton_state["module"] = lora_triton
        return lora_triton
    except Exception as exc:  # ImportError, or a Triton that fails to initialise
        _triton_state["error"] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            "lora-kernel: Triton is unavailable (" + str(_triton_state["error"]) + "); the CUDA "
            "path falls back to plain torch ops (correct, but slower). Install the 'triton' extra.",
            RuntimeWarning, stacklevel=3,
        )
        return None


_cpp_state: dict[str, object] = {}  # "fn" -> the C++ op's lora_linear, or None if it cannot be built


def _cpp():
    """The C++ op (``lora_linear(x, weight, bias, A, B, scale)``), or None: lora_cpp warns once."""
    if "fn" not in _cpp_state:
        from lora_bench.kernels import lora_cpp

        mod = lora_cpp.module()
        _cpp_state["fn"] = mod.lora_linear if mod is not None else None
    return _cpp_state["fn"]


_graph_plan_depth = 0  # > 0 inside graph_plan(): the plan a capture will use, also in its warm-up


class graph_plan:
    """Context manager: inside it, calls choose the plan they get under CUDA-graph capture (the
    device-optimal one: the Triton path, or the C++ op for weights of ``CPP_GRAPH_MIN_WEIGHT`` or
    more). Graph warm-ups run in it, so the kernels a graph captures were compiled and launched
    once before the capture."""

    def __enter__(self):
        global _graph_plan_depth
        _graph_plan_depth += 1
        return self

    def __exit__(self, *exc):
        global _graph_plan_depth
        _graph_plan_depth -= 1
        return False


# Under CUDA-graph capture only device time counts. Replayed (H200, bf16, 960 tokens, kernel-bench
# graph column, device call 4: results/kernel-bench-h200/kernel_bench_1558m_call4.csv, rows
# lora-kernel and lora-kernel:cpp): the Triton fused kernel wins at 1600→1600 (42.4 vs 51.8 us fwd+bwd for the C++
# op's cuBLAS calls) but cuBLAS wins at the 1600↔6400 MLP shapes (102.7 / 99.2 vs 111.8 / 118.2 us),
# where the Triton GEMM reaches ~60 % of cuBLAS's rate. So captured layers at least this large run
# the C++ op; smaller ones (every GPT-2 size below 1558M) the fused kernel. Under torch.compile the
# custom ops below follow the same rule with the cublas plan (the same cuBLAS GEMMs, ``_compiled_plan``).
CPP_GRAPH_MIN_WEIGHT = 1600 * 6400


def _route(x: torch.Tensor, weight: torch.Tensor | None = None):
    """(the C++ op or None, whether it may launch the Triton kernels directly) for this call (see
    the module docstring). Runs on every layer call: the common cases return after a few cheap checks."""
    direct = x.is_cuda
    if _mode_override is None:
        if not direct or torch.compiler.is_compiling():
            return None, False
        if _graph_plan_depth or torch.cuda.is_current_stream_capturing():
            if weight is None or weight.numel() < CPP_GRAPH_MIN_WEIGHT:
                return None, False
            direct = False  # captured: the cuBLAS GEMMs (device time), not the fused kernel
    elif _mode_override == _CPP:
        direct = False
    elif _mode_override != _DIRECT:
        return None, False
    fn = _cpp_state.get("fn", False)  # False: not resolved yet
    if fn is False:
        fn = _cpp()
    return fn, direct and fn is not None


def _direct_plan(x, weight, bias, A, B) -> int:
    """The C++ op's direct-launch plan id for this call, or -1 (its ATen GEMMs): 16-bit compute
    dtypes on CUDA with Triton (lora_bench/kernels/direct.py; ``_triton`` warns once without it)."""
    return _direct.plan_for(x, weight, bias, A, B) if _triton() is not None else -1


def lora_kernel_backend(device: torch.device | str, *, graphs: bool = False,
                        dtype: torch.dtype | None = None) -> str:
    """What lora-kernel layers on ``device`` run — in eager mode, or captured in CUDA graphs / traced
    by torch.compile when ``graphs``: 'cpp' (the C++ op with ATen GEMMs), 'cpp-direct' (the C++ op
    launching the Triton kernels itself: eager CUDA with a 16-bit compute ``dtype``), 'triton'
    (the project's Triton kernels; captured layers with weights of ``CPP_GRAPH_MIN_WEIGHT`` or more
    run the C++ op) or 'torch'. Recorded as the ``backend`` column of results."""
    if _ENV_ERROR:
        raise KernelModeError(_ENV_ERROR)
    device = torch.device(device)
    whole = _mode_override in (_CPP, _DIRECT)
    if whole or (_mode_override is None and device.type == "cuda" and not graphs):
        if _cpp() is not None:
            direct = (_mode_override != _CPP and device.type == "cuda" and dtype in _direct.DTYPES_16
                      and _triton() is not None)
            return "cpp-direct" if direct else "cpp"
    if device.type != "cuda" or _mode_override == _TORCH:
        return "torch"
    return "triton" if _triton() is not None else "torch"


def _layer_plan(x: torch.Tensor, rank: int, weight: torch.Tensor | None = None) -> tuple[str, str]:
    """(forward mode, backward mode) a layer call with this input runs: ("direct", "direct") or
    ("cpp", "cpp") (the C++ op, launching the Triton kernels itself or running ATen GEMMs), or ``_plan``."""
    fn, direct = _route(x, weight)
    if fn is None:
        return _plan(x, rank)
    return _DIRECT if direct and _direct.compute_dtype(x) in _direct.DTYPES_16 and _triton() is not None else _CPP


def _plan(x: torch.Tensor, rank: int) -> tuple[str, str]:
    """(forward mode, backward mode) of the Python Function for this input; see the module docstring."""
    forced = _mode_override if _mode_override not in (_CPP, _DIRECT) else None  # C++ op forced but unavailable
    if not x.is_cuda and not (forced and _INTERPRET):
        return _TORCH  # (a forced mode under Triton's CPU interpreter is for tests)
    tk = _triton_state.get("module") or _triton()
    if tk is None or rank > tk.MAX_RANK:
        return _TORCH
    if forced is not None:
        return forced
    if x.dtype is torch.float32 and torch.get_float32_matmul_precision() == "highest":
        # exact fp32 GEMMs: cuBLAS's fp32 path; Triton's ieee dots would be far slower
        return "cublas", "cublas"
    return "fused", "fused"


# ------------------------------------------------------------------------------- the math
# Host time matters as much as device time here: at GPT-2 sizes a layer's forward+backward is
# host-bound on a fast GPU, so the code below avoids views, no-op casts and context managers it
# does not need (each costs microseconds of Python/dispatcher time per call).


def _forward(mode: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
             a: torch.Tensor, bm: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y (N×n), h (N×r) for x (N×k), w (n×k), a (k×r), bm (r×n)."""
    if mode == "fused":
        return _triton().lora_fwd(x, w, a, bm, b, s)
    h = x @ a  # (N, r)
    y = torch.addmm(b, x, w.t()) if b is not None else x @ w.t()  # (N, n)
    y.addmm_(h, bm, alpha=s)  # in place: no N×n temporary
    return y, h


def _grad_x_u(mode: str, g: torch.Tensor, w: torch.Tensor, a: torch.Tensor, bm: torch.Tensor,
              s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_x = g·W + s·u·Aᵀ (N×k) and u = g·Bᵀ (N×r)."""
    if mode == "fused":
        return _triton().lora_bwd_x(g, w, a, bm, s)
    u = g @ bm.t()  # (N, r)
    gx = g @ w  # (N, k)
    gx.addmm_(u, a.t(), alpha=s)
    return gx, u


def _grad_ab(mode: str, x: torch.Tensor, u: torch.Tensor, h: torch.Tensor, g: torch.Tensor, s: float,
             *, do_a: bool, do_b: bool, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """grad_A = s·xᵀ·u (k×r), grad_B = s·hᵀ·g (r×n), in the parameters' dtype."""
    if mode != "torch":
        return _triton().lora_grad_ab(x, u, h, g, scale=s, grad_dtype=dtype, do_a=do_a, do_b=do_b)
    ga = torch.mm(x.t(), u).mul_(s).to(dtype) if do_a else None
    gb = torch.mm(h.t(), g).mul_(s).to(dtype) if do_b else None
    return ga, gb


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype is dtype else t.to(dtype)


class LoRAKernelFunction(torch.autograd.Function):
    """y = x·Wᵀ + b + s·(x·A)·B with the minimal backward. Inputs: x (..., k), weight (n, k),
    bias (n) or None, A (k, r), B (r, n), scale (a float).

    Autocast: ``custom_fwd`` records CUDA autocast state; on any device, with autocast on, every
    operand is cast once to autocast's dtype (what F.linear does) and the math runs with autocast
    off, so the Triton and torch paths see the same dtypes. Backward needs no autocast state (it
    casts explicitly), so instead of ``custom_bwd``'s context manager on every call it switches
    autocast off only where it is on (CPU backward runs on the caller's thread)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, A, B, scale):
        n, k = weight.shape
        dev = "cuda" if x.is_cuda else x.device.type
        x2 = x if x.dim() == 2 else x.reshape(-1, k)  # (N, k); a copy only if the batch dims don't flatten
        s = float(scale)
        if torch.is_autocast_enabled(dev) and x.is_floating_point():
            cdt = torch.get_autocast_dtype(dev)
            with torch.autocast(dev, enabled=False):
                x2, w, b = _cast(x2, cdt), _cast(weight, cdt), _cast(bias, cdt)
                # A and B are cast here too (two small launches). The fused kernels can read fp32 A/B
                # and round in registers (same values), but on the H200 that made the 124M graph
                # step 6 % slower (4.52 vs 4.26 ms): the fp32 tiles cost more inside the K loop
                # than the two launches they save. kernels/NOTES.md, v5.
                a, bm = _cast(A, cdt), _cast(B, cdt)
                fwd_mode, bwd_mode = _plan(x2, A.shape[1])
                y, h = _forward(fwd_mode, x2, w, b, a, bm, s)
        else:
            for p in (weight, A, B, bias):
                if p is not None and p.dtype is not x.dtype:
                    raise TypeError(f"lora-kernel: input is {x.dtype} but a parameter is {p.dtype} (use autocast to mix)")
            w, a, bm, b = weight, A, B, bias
            fwd_mode, bwd_mode = _plan(x2, A.shape[1])
            y, h = _forward(fwd_mode, x2, w, b, a, bm, s)
        ctx.save_for_backward(x2, h, w, a, bm)
        ctx.scale, ctx.bwd_mode, ctx.dev = s, bwd_mode, dev
        ctx.x_meta = (x.shape, x.dtype)
        ctx.param_dtypes = (weight.dtype, bias.dtype if bias is not None else None, A.dtype, B.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_autocast_enabled(ctx.dev):
            with torch.autocast(ctx.dev, enabled=False):
                return LoRAKernelFunction._backward(ctx, grad_out)
        return LoRAKernelFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x2, h, w, a, bm = ctx.saved_tensors
        s, mode = ctx.scale, ctx.bwd_mode
        need_x, need_w, need_b, need_a, need_bl, _ = ctx.needs_input_grad
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
        return grad_x, grad_w, grad_b, grad_a, grad_bl, None


# ------------------------------------------------------------------ under torch.compile
# Dynamo cannot trace into the Triton launch path (raw-pointer launcher) or the C++ op. Registered
# as custom ops with a fake (shape) implementation and an autograd formula, the layer's two
# halves are opaque calls in the compiled graph: no graph break, and inductor fuses what lies
# around them (autocast casts, LayerNorm, residual adds) while the ops run the same plans and
# helpers as the autograd Function.


def compiled_takes_cublas(weight: torch.Tensor) -> bool:
    """Whether the custom ops (torch.compile) give a layer with this weight the cuBLAS plan where
    the fused one would run: weights of ``CPP_GRAPH_MIN_WEIGHT`` or more, as captured layers take
    the C++ op uncompiled (a compiled model runs on the device without the host in the way);
    never when a plan is forced."""
    return _mode_override is None and weight.numel() >= CPP_GRAPH_MIN_WEIGHT


def _compiled_plan(x: torch.Tensor, rank: int, w: torch.Tensor) -> tuple[str, str]:
    """The plan of the custom ops: ``_plan``, with ``compiled_takes_cublas``."""
    plan = _plan(x, rank)
    return ("cublas", "cublas") if plan == ("fused", "fused") and compiled_takes_cublas(w) else plan


@torch.library.custom_op("lora_bench::lora_linear_fwd", mutates_args=())
def _op_fwd(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], a: torch.Tensor, bm: torch.Tensor,
            s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) for 2-D x of one dtype with the parameters (casts happen before, in traced code)."""
    fwd_mode, _ = _compiled_plan(x, a.shape[1], w)
    return _forward(fwd_mode, x, w, b, a, bm, s)


@_op_fwd.register_fake
def _(x, w, b, a, bm, s):
    return x.new_empty(x.shape[0], w.shape[0]), x.new_empty(x.shape[0], a.shape[1])


@torch.library.custom_op("lora_bench::lora_linear_bwd", mutates_args=())
def _op_bwd(g: torch.Tensor, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor, a: torch.Tensor,
            bm: torch.Tensor, s: float, need_x: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x or an empty tensor, grad_A, grad_B) in the compute dtype."""
    _, mode = _compiled_plan(x, a.shape[1], w)
    if need_x:
        gx, u = _grad_x_u(mode, g, w, a, bm, s)
    else:  # the input needs no gradient (first layer): skip the big GEMM
        gx, u = g.new_empty(0), g @ bm.t()
    ga, gb = _grad_ab(mode, x, u, h, g, s, do_a=True, do_b=True, dtype=a.dtype)
    return gx, ga, gb


@_op_bwd.register_fake
def _(g, x, h, w, a, bm, s, need_x):
    gx = g.new_empty(g.shape[0], w.shape[1]) if need_x else g.new_empty(0)
    return gx, a.new_empty(a.shape), bm.new_empty(bm.shape)


def _op_setup(ctx, inputs, output):
    x, w, b, a, bm, s = inputs
    ctx.save_for_backward(x, output[1], w, a, bm)
    ctx.s, ctx.has_bias = s, b is not None


def _op_backward(ctx, grad_y, grad_h):
    x, h, w, a, bm = ctx.saved_tensors
    need_x, need_w, need_b, need_a, need_bl, _ = ctx.needs_input_grad
    g = grad_y.contiguous()
    gx, ga, gb = torch.ops.lora_bench.lora_linear_bwd(g, x, h, w, a, bm, ctx.s, need_x)
    grad_w = g.t() @ x if need_w else None  # a trainable base layer (the classification head)
    grad_b = g.sum(0) if need_b and ctx.has_bias else None
    return (gx if need_x else None), grad_w, grad_b, (ga if need_a else None), (gb if need_bl else None), None


_op_fwd.register_autograd(_op_backward, setup_context=_op_setup)


def _compiled_forward(x, weight, bias, A, B, scale):
    """The layer as torch.compile traces it: flatten, autocast casts, the forward op."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.is_floating_point():
        cdt = torch.get_autocast_dtype(dev)
        x2, weight, A, B = x2.to(cdt), weight.to(cdt), A.to(cdt), B.to(cdt)
        bias = bias.to(cdt) if bias is not None else None
    y, _ = torch.ops.lora_bench.lora_linear_fwd(x2, weight, bias, A, B, float(scale))
    return y.view(*x.shape[:-1], n)


def lora_linear(x, weight, bias, A, B, scale):
    """Functional form of the lora-kernel layer (same dispatch as the layer)."""
    if torch.compiler.is_compiling():
        return _compiled_forward(x, weight, bias, A, B, scale)
    op, direct = _route(x, weight)
    if op is not None:
        plan = _direct_plan(x, weight, bias, A, B) if direct else -1
        if plan >= 0:
            return op(x, weight, bias, A, B, float(scale), plan, torch._C._cuda_getCurrentRawStream(x.get_device()))
        return op(x, weight, bias, A, B, float(scale))
    return LoRAKernelFunction.apply(x, weight, bias, A, B, scale)


__all__ = ["LoRAKernelFunction", "compiled_takes_cublas", "lora_linear",
           "lora_kernel_backend", "set_kernel_mode"]
