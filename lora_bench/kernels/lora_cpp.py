"""The lora-kernel layer as a C++ autograd op (``--trainable-layers lora-kernel``, plan "cpp").

Same math as ``lora_bench.lora.kernel.LoRAKernelFunction`` (y = x·Wᵀ + b + s·(x·A)·B, minimal
backward), written as a ``torch::autograd::Function`` whose forward and backward are ATen calls
(cuBLAS on CUDA, the CPU BLAS on CPU). One pybind call per forward, no Python at all in backward:
an eager layer on a fast GPU is host-bound, and the Python Function costs tens of microseconds of
apply/ctx work each way (lora_bench/kernels/NOTES.md).

    forward   h = x·A;  y = addmm(b, x, Wᵀ);  y += s·h·B (in place)          3 GEMMs, saves x, h
    backward  us = s·g·Bᵀ; grad_x = g·W + us·Aᵀ; grad_A = xᵀ·us; grad_B = s·hᵀ·g
              grad_W = gᵀ·x, grad_b = Σg only when W / b need a gradient        5 GEMMs (no head)

Built lazily on first use with ``torch.utils.cpp_extension.load_inline`` (host C++, no CUDA
source, so one build serves CPU and CUDA tensors) into torch's extension cache, or into
``$LORA_BENCH_EXT_DIR`` when set. A failed build (no C++ compiler, no ninja) warns once and
``module()`` returns None: callers fall back to the Python Function.
"""

from __future__ import annotations

import inspect
import os
import shutil
import time
import warnings

import torch

NAME = "lora_bench_lora_cpp"
GRAD_FN_NAME = "torch::autograd::CppNode<lora_bench::LoRALinearCpp>"  # y.grad_fn.name() of its outputs

# Autocast: the C++ API of torch >= 2.4 (at::autocast::is_autocast_enabled / get_autocast_dtype
# taking a DeviceType). The math runs with every autocast key excluded, so the GEMMs see exactly
# the dtypes chosen here; grads go back in each parameter's own dtype.
SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

namespace lora_bench {  // named: the grad_fn reads torch::autograd::CppNode<lora_bench::LoRALinearCpp>

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

inline Tensor cast_to(const Tensor& t, at::ScalarType dt) {
  return t.scalar_type() == dt ? t : t.to(dt);
}

struct LoRALinearCpp : public torch::autograd::Function<LoRALinearCpp> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const std::optional<Tensor>& bias, const Tensor& A, const Tensor& B,
                        double scale) {
    TORCH_CHECK_VALUE(weight.dim() == 2 && A.dim() == 2 && B.dim() == 2 && x.dim() >= 1,
                      "lora-kernel: expected x (..., k), weight (n, k), A (k, r), B (r, n)");
    const int64_t n = weight.size(0), k = weight.size(1);
    TORCH_CHECK_VALUE(x.size(-1) == k && A.size(0) == k && B.size(0) == A.size(1) && B.size(1) == n,
                      "lora-kernel: shapes do not fit: x ", x.sizes(), ", weight ", weight.sizes(),
                      ", A ", A.sizes(), ", B ", B.sizes());
    const bool has_bias = bias.has_value() && bias->defined();
    const auto dev = x.device().type();
    const bool autocast = x.is_floating_point() && at::autocast::is_autocast_enabled(dev);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);

    Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, k});  // (N, k); copies only if dims don't flatten
    Tensor w = weight, a = A, bm = B, b = has_bias ? *bias : Tensor();
    if (autocast) {  // every operand once to autocast's dtype, as F.linear does
      const auto cdt = at::autocast::get_autocast_dtype(dev);
      x2 = cast_to(x2, cdt);
      w = cast_to(w, cdt);
      a = cast_to(a, cdt);
      bm = cast_to(bm, cdt);
      if (has_bias) b = cast_to(b, cdt);
    } else {
      const auto dt = x.scalar_type();
      for (const Tensor* p : {&weight, &A, &B}) {
        TORCH_CHECK_TYPE(p->scalar_type() == dt, "lora-kernel: input is ", dt, " but a parameter is ",
                         p->scalar_type(), " (use autocast to mix)");
      }
      TORCH_CHECK_TYPE(!has_bias || b.scalar_type() == dt, "lora-kernel: input is ", dt,
                       " but the bias is ", b.scalar_type(), " (use autocast to mix)");
    }
    Tensor h = at::mm(x2, a);                                          // (N, r)
    Tensor y = has_bias ? at::addmm(b, x2, w.t()) : at::mm(x2, w.t());  // (N, n)
    y.addmm_(h, bm, 1, scale);                                         // in place: no N×n temporary

    ctx->save_for_backward({x2, h, w, a, bm});
    ctx->saved_data["s"] = scale;
    ctx->saved_data["bias"] = has_bias;
    ctx->saved_data["x_sizes"] = x.sizes();
    ctx->saved_data["dtypes"] = std::vector<int64_t>{
        static_cast<int64_t>(x.scalar_type()), static_cast<int64_t>(weight.scalar_type()),
        static_cast<int64_t>(has_bias ? bias->scalar_type() : x.scalar_type()),
        static_cast<int64_t>(A.scalar_type()), static_cast<int64_t>(B.scalar_type())};
    if (x.dim() == 2) return y;
    auto out_sizes = x.sizes().vec();
    out_sizes.back() = n;
    return at::_unsafe_view(y, out_sizes);  // not a view: callers may modify it in place
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // CPU backward runs on the caller's thread, where autocast may be on.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const Tensor &x2 = saved[0], &h = saved[1], &w = saved[2], &a = saved[3], &bm = saved[4];
    const double s = ctx->saved_data["s"].toDouble();
    const bool has_bias = ctx->saved_data["bias"].toBool();
    // needs_input_grad counts tensor inputs only: a missing bias has no slot.
    size_t e = 0;
    const bool need_x = ctx->needs_input_grad(e++);
    const bool need_w = ctx->needs_input_grad(e++);
    const bool need_b = has_bias && ctx->needs_input_grad(e++);
    const bool need_a = ctx->needs_input_grad(e++);
    const bool need_bl = ctx->needs_input_grad(e++);
    const auto dts = ctx->saved_data["dtypes"].toIntVector();
    auto dt = [&](int i) { return static_cast<at::ScalarType>(dts[i]); };

    Tensor g = grad_outputs[0];
    if (g.dim() != 2) g = g.reshape({-1, w.size(0)});  // (N, n)
    g = cast_to(g, x2.scalar_type());
    Tensor grad_x, grad_w, grad_b, grad_a, grad_bl;
    Tensor us;  // s·g·Bᵀ (N, r): s folded into the GEMM (beta 0 ignores the uninitialised output)
    if (need_x || need_a) {
      us = at::empty({g.size(0), bm.size(0)}, g.options());
      at::addmm_out(us, us, g, bm.t(), 0, s);
    }
    if (need_x) {  // the big GEMM only when x needs a gradient (not for the first layer's input)
      Tensor gx = at::mm(g, w);  // (N, k)
      gx.addmm_(us, a.t());
      const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
      if (x_sizes.size() != 2) gx = gx.view(x_sizes);
      grad_x = cast_to(gx, dt(0));
    }
    if (need_a) grad_a = cast_to(at::mm(x2.t(), us), dt(3));  // (k, r)
    if (need_bl) {
      Tensor gb = at::empty({h.size(1), g.size(1)}, g.options());  // (r, n)
      at::addmm_out(gb, gb, h.t(), g, 0, s);
      grad_bl = cast_to(gb, dt(4));
    }
    // Only a trainable base layer (the classification head) pays for these.
    if (need_w) grad_w = cast_to(at::mm(g.t(), x2), dt(1));  // (n, k)
    if (need_b) grad_b = at::sum(g, {0}, false, dt(2));
    return {grad_x, grad_w, grad_b, grad_a, grad_bl, Tensor()};
  }
};

Tensor lora_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                   const Tensor& A, const Tensor& B, double scale) {
  return LoRALinearCpp::apply(x, weight, bias, A, B, scale);
}

}  // namespace lora_bench

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_linear", torch::wrap_pybind_function_no_gil(lora_bench::lora_linear),
        "y = x W^T + b + scale (x A) B with the minimal backward (C++ autograd op)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("A"),
        pybind11::arg("B"), pybind11::arg("scale"));
}
"""

_state: dict[str, object] = {}  # "module" -> the built module, or "error" -> reason; "build_s"


def _build_dir() -> str | None:
    path = os.environ.get("LORA_BENCH_EXT_DIR")
    if not path:
        return None  # torch's cache: $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/...
    os.makedirs(path, exist_ok=True)
    return path


def _build():
    from torch.utils import cpp_extension

    kwargs = {}
    if "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters:
        kwargs["no_implicit_headers"] = True  # skip torch/extension.h (all of libtorch's C++ API): faster build
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:  # the pip package's binary is not on PATH in an unactivated venv
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
        except ImportError:
            pass
    try:
        return cpp_extension.load_inline(
            NAME, cpp_sources=[SOURCE], extra_cflags=["-O3"], build_directory=_build_dir(),
            verbose=False, **kwargs)
    finally:
        os.environ["PATH"] = path


def module():
    """The built extension module (``.lora_linear``), or None (one RuntimeWarning) if it cannot be built."""
    mod = _state.get("module")
    if mod is not None or "error" in _state:
        return mod
    t0 = time.perf_counter()
    try:
        mod = _build()
    except Exception as exc:  # no compiler, no ninja, a compile error, an unwritable cache
        reason = f"{type(exc).__name__}: {exc}".strip()
        if len(reason) > 2000:
            reason = reason[:1000] + " ... " + reason[-1000:]
        _state["error"] = reason
        warnings.warn(
            "lora-kernel: the C++ op could not be built (" + reason + "); lora-kernel layers use the "
            "Python autograd Function instead (correct, slower when host-bound). It needs a C++ "
            "compiler and ninja (pip install ninja).", RuntimeWarning, stacklevel=2)
        return None
    _state["module"] = mod
    _state["build_s"] = time.perf_counter() - t0
    return mod


def cpp_available() -> bool:
    """True when the C++ op is built (builds it on first call)."""
    return module() is not None


def lora_linear_cpp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor,
                    B: torch.Tensor, scale: float) -> torch.Tensor:
    """y = x·Wᵀ + b + scale·(x·A)·B through the C++ autograd op (RuntimeError if it cannot be built)."""
    mod = module()
    if mod is None:
        raise RuntimeError("lora-kernel: the C++ op is unavailable: " + str(_state.get("error")))
    return mod.lora_linear(x, weight, bias, A, B, float(scale))


__all__ = ["GRAD_FN_NAME", "NAME", "SOURCE", "cpp_available", "lora_linear_cpp", "module"]
