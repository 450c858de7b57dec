"""The ``direct`` plan: the C++ op launches the project's Triton kernels itself, one
``cuLaunchKernel`` call forward (the fused GEMM: y and h) and two backward (grad_x with u, then
grad_A with grad_B), where the ``cpp`` plan makes three dispatcher calls forward and five backward.
The first call for a layer shape records its compiled kernels and registers them with the C++ op;
a shape whose kernels do not fit, or a call whose operands no longer do, runs the ATen path. Only
16-bit compute dtypes take it. How and why: docs/kernel-design.md#the-implementations."""

from __future__ import annotations

import re
import warnings

import torch

from lora_bench.kernels import available
from lora_bench.kernels.call import DTYPES_16, TRITON_MAX_RANK, Call, Plan

FALLBACK = Plan.CPP  # a shape or dtype it cannot launch runs the C++ op's ATen GEMMs

# Canonical runtime arguments of each kernel, in the @triton.jit signature's order: "p" pointer,
# "i" 32-bit integer, "f" fp32 (the C++ op fills them in this order: lora_op.cpp, struct Args).
MM_ARGS = "p" * 7 + "i" * 16 + "f"  # _lora_mm_kernel: x w p q bias out h, M N K R, 12 strides, scale
AB_ARGS = "p" * 6 + "i" * 17 + "f"  # _lora_grad_ab_kernel: x u h g ga gb, M K N R NUM_A, 12 strides, scale
_SIZE = {"p": 8, "i": 4, "f": 4}
_PTX_SIZE = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4}
_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)")
_SCALAR_TYPE = {torch.float32: 6, torch.float16: 5, torch.bfloat16: 15}  # c10::ScalarType values

_plans: dict[tuple, int] = {}  # plan key -> registered id, or -1 (this shape stays on the ATen plan)
_warned: set[str] = set()


class Unsupported(RuntimeError):
    """The compiled kernel is not one the C++ op knows how to launch."""


def ptx_param_sizes(ptx: str, name: str | None = None) -> list[int]:
    """Byte size of each parameter of the (first, or named) ``.entry`` in a PTX text."""
    m = re.search(r"\.entry\s+" + (re.escape(name) if name else r"\w+") + r"\s*\(", ptx)
    if m is None:
        raise Unsupported("no .entry in the kernel's PTX")
    body = ptx[m.end():ptx.index(")", m.end())]
    sizes = []
    for decl in filter(None, (d.strip() for d in body.split(","))):
        t = _PTX_PARAM.match(decl)
        if t is None or t.group(1) not in _PTX_SIZE:
            raise Unsupported(f"PTX parameter {decl!r}")
        sizes.append(_PTX_SIZE[t.group(1)])
    return sizes


def param_sources(signature: dict, canonical: str, ptx_sizes: list[int]) -> list[int]:
    """Canonical index of each kernel parameter (-1: a trailing null pointer, Triton's scratch).

    ``signature``: the compiled kernel's {argument name: type} in declaration order (runtime
    arguments first, as this project's kernels declare them; "constexpr" for those compiled in)."""
    types = list(signature.values())
    if len(types) < len(canonical):
        raise Unsupported(f"signature has {len(types)} arguments, expected at least {len(canonical)}")
    kept = [i for i, t in enumerate(types[:len(canonical)]) if t != "constexpr"]
    for i in kept:
        t, kind = str(types[i]), canonical[i]
        ok = t.startswith("*") if kind == "p" else (t == "i32" if kind == "i" else t == "fp32")
        if not ok:
            raise Unsupported(f"argument {i} compiled as {t!r}, expected {kind!r}")
    if any(t != "constexpr" for t in types[len(canonical):]):
        raise Unsupported("runtime arguments after the canonical ones")
    extra = len(ptx_sizes) - len(kept)
    if not 0 <= extra <= 2:
        raise Unsupported(f"PTX declares {len(ptx_sizes)} parameters for {len(kept)} kept arguments")
    srcs = kept + [-1] * extra
    for j, (src, size) in enumerate(zip(srcs, ptx_sizes)):
        if size != (_SIZE[canonical[src]] if src >= 0 else 8):
            raise Unsupported(f"PTX parameter {j} is {size} bytes, expected {canonical[src] if src >= 0 else 'a pointer'}")
    return srcs


def launch_spec(kernel, grid: tuple, canonical: str) -> list[int]:
    """[function, grid x, y, z, threads, shared bytes, n, n canonical indices] for the C++ op."""
    md = kernel.metadata
    for attr in ("global_scratch_size", "profile_scratch_size"):
        if getattr(md, attr, 0):
            raise Unsupported(f"the kernel needs {attr}")
    if getattr(md, "num_ctas", 1) != 1 or any(c != 1 for c in getattr(md, "cluster_dims", (1, 1, 1)) or (1,)):
        raise Unsupported("clusters")
    if getattr(md, "launch_pdl", False) or getattr(md, "launch_cooperative_grid", False):
        raise Unsupported("PDL or cooperative launch")
    fn = getattr(kernel, "function", None)
    src = getattr(kernel, "src", None)
    sig = getattr(src, "signature", None)
    if not fn or not isinstance(sig, dict):
        raise Unsupported("no function handle or signature on the compiled kernel")
    ptx = kernel.asm.get("ptx") if isinstance(kernel.asm, dict) else None
    if not isinstance(ptx, str):
        raise Unsupported("no PTX")
    srcs = param_sources(sig, canonical, ptx_param_sizes(ptx, getattr(md, "name", None)))
    return [int(fn), *(int(g) for g in grid), 32 * int(md.num_warps), int(md.shared), len(srcs), *srcs]


def build(M: int, N: int, K: int, R: int, dtype: torch.dtype, adtype: torch.dtype, has_bias: bool,
          device: torch.device) -> int:
    """Compile (or load) and run the three kernels once for this shape, register them with the C++
    op (which takes the CUDA context they were loaded in: the current one); the plan id."""
    from lora_bench.kernels import triton_launch as _launch
    from lora_bench.kernels import lora_cpp
    from lora_bench.kernels import lora_triton as tk

    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt, generator=gen)

    x, w, a, b, g = rnd(M, K), rnd(N, K), rnd(K, R, dt=adtype), rnd(R, N, dt=adtype), rnd(M, N)
    bias = rnd(N) if has_bias else None
    cfg = tk.pick_ab_config(M, K, N, device)._replace(split_m=1)  # one split: a direct store, no zero-fill
    with _launch.recording() as rec:
        # the C++ op launches these kernels alone: H formed in the GEMM, whatever the rank
        _, h = tk.lora_fwd(x, w, a, b, bias, 1.0, apart=False)
        _, u = tk.lora_bwd_x(g, w, a, b, 1.0, apart=False)
        tk.lora_grad_ab(x, u, h, g, scale=1.0, grad_dtype=adtype, config=cfg)
    if len(rec) != 3 or [t for t, _, _ in rec] != ["mm", "mm", "ab"] or any(k is None for _, _, k in rec):
        raise Unsupported(f"recorded launches {[t for t, _, _ in rec]} (Triton's fast launch off?)")
    (_, g_fwd, k_fwd), (_, g_bwd, k_bwd), (_, g_ab, k_ab) = rec
    num_a = -(-K // cfg.block_d)
    spec = [M, N, K, R, num_a, _SCALAR_TYPE[dtype], _SCALAR_TYPE[adtype], int(has_bias),
            *launch_spec(k_fwd, g_fwd, MM_ARGS), *launch_spec(k_bwd, g_bwd, MM_ARGS),
            *launch_spec(k_ab, g_ab, AB_ARGS)]
    torch.cuda.synchronize(device)  # a failed launch shows up here, inside the caller's fallback
    return int(lora_cpp.module().register_plan(spec))


def runs(call: Call) -> bool:
    return (call.cuda and not call.compiling and (call.dtype is torch.bfloat16 or call.dtype is torch.float16)
            and call.rank <= TRITON_MAX_RANK and bool(call.have_cpp) and bool(call.have_triton))


def layer(x, weight, bias, A, B, scale: float):
    """The layer through the C++ op's direct launches, or None when this shape could not be
    registered (the caller then runs the ``cpp`` plan)."""
    pid = plan_for(x, weight, bias, A, B)
    if pid < 0:
        return None
    return available.cpp_op().lora_linear(x, weight, bias, A, B, float(scale), pid,
                                          torch._C._cuda_getCurrentRawStream(x.get_device()))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a CUDA layer call computes in: autocast's when it is on, else the input's."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype


def plan_key(x: torch.Tensor, weight: torch.Tensor, bias, A: torch.Tensor, B: torch.Tensor) -> tuple | None:
    """(tokens, n, k, r, compute dtype, A/B dtype, bias, device index) of an eager CUDA call, or
    None when the call does not take this plan (exact fp32, A and B of different dtypes)."""
    dt = compute_dtype(x)
    if dt not in DTYPES_16 or A.dtype is not B.dtype or A.dtype not in (dt, torch.float32):
        return None
    n, k = weight.shape
    return x.numel() // k if k else 0, n, k, A.shape[1], dt, A.dtype, bias is not None, x.get_device()


def plan_for(x: torch.Tensor, weight: torch.Tensor, bias, A: torch.Tensor, B: torch.Tensor) -> int:
    """The registered plan id for this eager CUDA call, or -1 (the C++ op's ATen plan)."""
    key = plan_key(x, weight, bias, A, B)
    if key is None:
        return -1
    pid = _plans.get(key)
    if pid is None:
        pid = _plans[key] = _build_or_warn(key)
    return pid


def registered(key: tuple) -> int | None:
    """The plan id registered for a plan key (-1: that shape stays on the ATen plan), or None if
    no call with that key ran yet."""
    return _plans.get(key)


def _build_or_warn(key) -> int:
    M, N, K, R, dt, adt, has_bias, device = key
    if M < 1 or R > TRITON_MAX_RANK:
        return -1
    try:
        return build(M, N, K, R, dt, adt, has_bias, torch.device("cuda", device))
    except Exception as exc:  # Unsupported, a compile error, a Triton without the attributes read here
        reason = f"{type(exc).__name__}: {exc}"
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"lora-kernel: direct launches unavailable for shape {key[:4]} ({reason}); that shape "
                          "runs the C++ op's ATen GEMMs instead", RuntimeWarning, stacklevel=4)
        return -1


__all__ = ["AB_ARGS", "FALLBACK", "MM_ARGS", "Unsupported", "build", "compute_dtype", "launch_spec", "layer",
           "param_sources", "plan_for", "plan_key", "ptx_param_sizes", "registered", "runs"]
