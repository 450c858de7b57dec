// lora-kernel's C++ autograd op: y = x·Wᵀ + b + s·(x·A)·B with the minimal backward.
//
//   forward   h = x·A;  y = addmm(b, x, Wᵀ);  y += s·h·B (in place)          3 GEMMs, saves x, h
//   backward  us = s·g·Bᵀ; grad_x = g·W + us·Aᵀ; grad_A = xᵀ·us; grad_B = s·hᵀ·g
//             grad_W = gᵀ·x, grad_b = Σg only when W / b need a gradient        5 GEMMs (no head)
//
// Plan "cpp": those ATen calls (cuBLAS on CUDA, the CPU BLAS on CPU), one pybind call per forward
// and no Python at all in backward. Plan "direct" (bf16/fp16 on CUDA): given the id of a plan
// registered by lora_bench/kernels/direct.py, the op launches the project's compiled Triton kernels
// itself with cuLaunchKernel: forward the fused GEMM (y, h), backward the fused GEMM on
// (g, W, Bᵀ, Aᵀ) (grad_x, u) and the adapter-gradient kernel. Each call checks that its operands
// fit the plan (shapes, dtypes, contiguity, alignment) and otherwise runs the ATen path.
//
// Autocast (the C++ API of torch >= 2.4): every operand is cast once to autocast's dtype, as
// F.linear does, and the math runs with every autocast key excluded, so the GEMMs see exactly the
// dtypes chosen here; gradients go back in each parameter's own dtype.
//
// Host C++ only, no CUDA headers: the driver's entry points are resolved from the loaded libcuda,
// so one build serves CPU and CUDA tensors. Built by lora_bench/kernels/lora_cpp.py.

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
#include <dlfcn.h>
#include <memory>
#include <mutex>

namespace lora_bench {  // named: the grad_fn reads torch::autograd::CppNode<lora_bench::LoRALinearCpp>

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ------------------------------------------------------------------ direct launches ("direct" plan)
// The CUDA driver's entry points, from the libcuda that torch and Triton have loaded: no CUDA
// headers or toolkit at build time, so the same build serves CPU-only machines (never called there).
namespace drv {
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);
using CtxGetFn = int (*)(void**);
using CtxSetFn = int (*)(void*);
using ErrFn = int (*)(int, const char**);
struct Api {
  LaunchFn launch = nullptr;
  CtxGetFn ctx_get = nullptr;
  CtxSetFn ctx_set = nullptr;
  ErrFn err = nullptr;
};
inline const Api& api() {
  static const Api a = [] {
    Api r;
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) h = dlopen("libcuda.so.1", RTLD_NOW);
    if (h == nullptr) return r;
    r.launch = reinterpret_cast<LaunchFn>(dlsym(h, "cuLaunchKernel"));
    r.ctx_get = reinterpret_cast<CtxGetFn>(dlsym(h, "cuCtxGetCurrent"));
    r.ctx_set = reinterpret_cast<CtxSetFn>(dlsym(h, "cuCtxSetCurrent"));
    r.err = reinterpret_cast<ErrFn>(dlsym(h, "cuGetErrorString"));
    if (!r.ctx_get || !r.ctx_set) r.launch = nullptr;
    return r;
  }();
  return a;
}
inline void check(int rc, const char* what) {
  if (rc == 0) return;
  const char* msg = nullptr;
  if (api().err) api().err(rc, &msg);
  TORCH_CHECK(false, "lora-kernel direct launch: ", what, " failed with CUresult ", rc, " (",
              msg ? msg : "unknown", ")");
}
}  // namespace drv

// One compiled Triton kernel, launched with cuLaunchKernel. Its parameters are picked from a
// canonical argument list (every runtime argument of the @triton.jit function, in order): src[i]
// is the canonical index of parameter i, or -1 for a null pointer (Triton's scratch arguments).
// Which arguments the compiled kernel kept, and their sizes, were read on the Python side from
// the kernel's signature and checked against its PTX (lora_bench/kernels/direct.py).
struct Launch {
  uint64_t fn = 0;
  unsigned grid[3] = {1, 1, 1};
  unsigned threads = 128, shared = 0;
  std::vector<int> src;
};

// Canonical arguments: pointers, then 32-bit integers, then one fp32 (the scale).
struct Args {
  static constexpr int kMax = 32;
  union Slot { uint64_t p; int32_t i; float f; };
  Slot v[kMax];
  int n = 0;
  void ptr(const void* p) { v[n++].p = reinterpret_cast<uint64_t>(p); }
  void i32(int64_t i) {
    TORCH_CHECK(i >= INT32_MIN && i <= INT32_MAX, "lora-kernel direct launch: argument out of int32 range");
    v[n++].i = static_cast<int32_t>(i);
  }
  void f32(double f) { v[n++].f = static_cast<float>(f); }
};

struct Plan {
  Launch fwd, bwd, ab;  // forward (y, h), backward (grad_x, u), grad_A and grad_B (one split)
  int64_t M, N, K, R, num_a;
  at::ScalarType dt, adt;  // compute dtype; A and B's dtype (fp32 masters are read as they are)
  bool has_bias;
  void* ctx = nullptr;  // the CUDA context the kernels were loaded in
};

std::mutex plans_mutex;
std::vector<std::unique_ptr<Plan>> plans;  // append-only: a Plan* stays valid

inline void run(const Plan& p, const Launch& l, const Args& a, void* stream) {
  const auto& d = drv::api();
  void* cur = nullptr;
  drv::check(d.ctx_get(&cur), "cuCtxGetCurrent");
  if (cur != p.ctx) drv::check(d.ctx_set(p.ctx), "cuCtxSetCurrent");  // e.g. the autograd engine's thread
  uint64_t null_ptr = 0;
  void* params[Args::kMax];
  const size_t np = l.src.size();
  TORCH_CHECK(np <= static_cast<size_t>(Args::kMax), "lora-kernel direct launch: too many parameters");
  for (size_t i = 0; i < np; ++i) {
    params[i] = l.src[i] < 0 ? static_cast<void*>(&null_ptr) : const_cast<Args::Slot*>(&a.v[l.src[i]]);
  }
  drv::check(d.launch(reinterpret_cast<void*>(l.fn), l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.shared,
                      stream, params, nullptr), "cuLaunchKernel");
}

inline Launch read_launch(const std::vector<int64_t>& s, size_t& i) {
  Launch l;
  l.fn = static_cast<uint64_t>(s.at(i++));
  for (int j = 0; j < 3; ++j) l.grid[j] = static_cast<unsigned>(s.at(i++));
  l.threads = static_cast<unsigned>(s.at(i++));
  l.shared = static_cast<unsigned>(s.at(i++));
  const int64_t np = s.at(i++);
  for (int64_t j = 0; j < np; ++j) l.src.push_back(static_cast<int>(s.at(i++)));
  return l;
}

// spec: M, N, K, R, num_a, dtype, A dtype, has_bias, then the three launches (fn, grid x/y/z,
// threads, shared bytes, parameter count, canonical index per parameter). Called right after the
// kernels ran on this thread: the current CUDA context is the one they were loaded in.
int64_t register_plan(const std::vector<int64_t>& spec) {
  TORCH_CHECK(drv::api().launch != nullptr, "lora-kernel direct launch: libcuda's entry points not found");
  auto p = std::make_unique<Plan>();
  drv::check(drv::api().ctx_get(&p->ctx), "cuCtxGetCurrent");
  TORCH_CHECK(p->ctx != nullptr, "lora-kernel direct launch: no current CUDA context");
  size_t i = 0;
  p->M = spec.at(i++); p->N = spec.at(i++); p->K = spec.at(i++); p->R = spec.at(i++); p->num_a = spec.at(i++);
  p->dt = static_cast<at::ScalarType>(spec.at(i++));
  p->adt = static_cast<at::ScalarType>(spec.at(i++));
  p->has_bias = spec.at(i++) != 0;
  p->fwd = read_launch(spec, i);
  p->bwd = read_launch(spec, i);
  p->ab = read_launch(spec, i);
  TORCH_CHECK(i == spec.size(), "lora-kernel direct launch: malformed plan");
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans.push_back(std::move(p));
  return static_cast<int64_t>(plans.size()) - 1;
}

inline const Plan* get_plan(int64_t id) {
  if (id < 0) return nullptr;
  std::lock_guard<std::mutex> lock(plans_mutex);
  return id < static_cast<int64_t>(plans.size()) ? plans[id].get() : nullptr;
}

inline bool aligned(const Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0; }

// The operands a plan was compiled for: exact shapes and dtypes, contiguous, 16-byte aligned.
inline bool plan_fits(const Plan& p, const Tensor& x2, const Tensor& w, const Tensor& b, const Tensor& a,
                      const Tensor& bm) {
  return x2.is_cuda() && x2.size(0) == p.M && x2.size(1) == p.K && w.size(0) == p.N && a.size(1) == p.R &&
         x2.scalar_type() == p.dt && w.scalar_type() == p.dt && a.scalar_type() == p.adt &&
         bm.scalar_type() == p.adt && b.defined() == p.has_bias && (!b.defined() || (b.scalar_type() == p.dt &&
         b.is_contiguous() && aligned(b))) && x2.is_contiguous() && w.is_contiguous() && a.is_contiguous() &&
         bm.is_contiguous() && aligned(x2) && aligned(w) && aligned(a) && aligned(bm);
}

// y = x·Wᵀ + b + s·(x·A)·B and h = x·A: the fused Triton GEMM, one launch.
inline void direct_forward(const Plan& p, const Tensor& x2, const Tensor& w, const Tensor& b, const Tensor& a,
                           const Tensor& bm, const Tensor& y, const Tensor& h, double s, void* stream) {
  const int64_t M = p.M, N = p.N, K = p.K, R = p.R;
  Args g;
  for (const Tensor& t : {x2, w, a, bm}) g.ptr(t.data_ptr());
  g.ptr(p.has_bias ? b.data_ptr() : y.data_ptr());
  g.ptr(y.data_ptr());
  g.ptr(h.data_ptr());
  // M N K R, x (M×K), Wᵀ read from W (N×K), A (K×R), B (R×N), y (M×N), h (M×R): as lora_triton.lora_fwd
  for (int64_t v : {M, N, K, R, K, int64_t(1), int64_t(1), K, R, int64_t(1), N, int64_t(1), N, int64_t(1), R,
                    int64_t(1)}) g.i32(v);
  g.f32(s);
  run(p, p.fwd, g, stream);
}

inline Tensor cast_to(const Tensor& t, at::ScalarType dt) {
  return t.scalar_type() == dt ? t : t.to(dt);
}

// grad_x = g·W + s·u·Aᵀ and u = g·Bᵀ (the fused GEMM on (g, W, Bᵀ, Aᵀ), one launch; without
// grad_x, u alone by one ATen GEMM), then grad_A = s·xᵀ·u and grad_B = s·hᵀ·g in one launch
// (one split: a direct store, no zero-fill), written in A and B's own dtype.
inline std::tuple<Tensor, Tensor, Tensor> direct_backward(const Plan& p, const Tensor& x2, const Tensor& h,
                                                          const Tensor& w, const Tensor& a, const Tensor& bm,
                                                          const Tensor& g, double s, bool need_x, void* stream) {
  const int64_t M = p.M, N = p.N, K = p.K, R = p.R;
  Tensor gx, u;
  if (need_x) {
    gx = at::empty({M, K}, g.options());
    u = at::empty({M, R}, g.options());
    Args c;
    for (const Tensor& t : {g, w, bm, a, gx, gx, u}) c.ptr(t.data_ptr());
    // as lora_triton.lora_bwd_x: M, K, N, R; g (M×N), W (N×K), Bᵀ read from B, Aᵀ read from A, gx, u
    for (int64_t v : {M, K, N, R, N, int64_t(1), K, int64_t(1), int64_t(1), N, int64_t(1), R, K, int64_t(1), R,
                      int64_t(1)}) c.i32(v);
    c.f32(s);
    run(p, p.bwd, c, stream);
  } else {
    u = at::mm(g, cast_to(bm, g.scalar_type()).t());  // the input needs no gradient: skip the big GEMM
  }
  Tensor ga = at::empty({K, R}, a.options()), gb = at::empty({R, N}, bm.options());
  Args c;
  for (const Tensor& t : {x2, u, h, g, ga, gb}) c.ptr(t.data_ptr());
  for (int64_t v : {M, K, N, R, p.num_a, K, int64_t(1), R, int64_t(1), R, int64_t(1), N, int64_t(1), R,
                    int64_t(1), N, int64_t(1)}) c.i32(v);
  c.f32(s);
  run(p, p.ab, c, stream);
  return {gx, ga, gb};
}

struct LoRALinearCpp : public torch::autograd::Function<LoRALinearCpp> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const std::optional<Tensor>& bias, const Tensor& A, const Tensor& B,
                        double scale, int64_t plan_id, int64_t stream) {
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
    const Plan* plan = get_plan(plan_id);
    if (autocast) {  // every operand once to autocast's dtype, as F.linear does
      const auto cdt = at::autocast::get_autocast_dtype(dev);
      x2 = cast_to(x2, cdt);
      w = cast_to(w, cdt);
      if (plan == nullptr || A.scalar_type() != plan->adt || B.scalar_type() != plan->adt) {
        a = cast_to(a, cdt);  // the direct kernels read fp32 A and B as they are (rounded in registers)
        bm = cast_to(bm, cdt);
      }
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
    if (plan != nullptr && !x2.is_contiguous()) x2 = x2.contiguous();
    const bool direct = plan != nullptr && plan_fits(*plan, x2, w, b, a, bm);
    Tensor h, y;
    if (direct) {  // one launch of the fused Triton GEMM, no dispatcher call per GEMM
      y = at::empty({x2.size(0), n}, x2.options());
      h = at::empty({x2.size(0), a.size(1)}, x2.options());
      direct_forward(*plan, x2, w, b, a, bm, y, h, scale, reinterpret_cast<void*>(stream));
    } else {
      a = cast_to(a, x2.scalar_type());
      bm = cast_to(bm, x2.scalar_type());
      h = at::mm(x2, a);                                          // (N, r)
      y = has_bias ? at::addmm(b, x2, w.t()) : at::mm(x2, w.t());  // (N, n)
      y.addmm_(h, bm, 1, scale);                                  // in place: no N×n temporary
    }

    ctx->save_for_backward({x2, h, w, a, bm});
    ctx->saved_data["s"] = scale;
    ctx->saved_data["bias"] = has_bias;
    ctx->saved_data["plan"] = direct ? plan_id : int64_t(-1);
    ctx->saved_data["stream"] = stream;  // the engine runs this node's backward on the same stream
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
    const Tensor &x2 = saved[0], &h = saved[1], &w = saved[2];
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
    const Plan* plan = get_plan(ctx->saved_data["plan"].toInt());
    if (plan != nullptr && need_a && need_bl && !need_w && !need_b) {
      if (!g.is_contiguous()) g = g.contiguous();
      if (aligned(g)) {
        const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
        auto [gx, ga, gb] = direct_backward(*plan, x2, h, w, saved[3], saved[4], g, s, need_x,
                                            reinterpret_cast<void*>(ctx->saved_data["stream"].toInt()));
        if (need_x && x_sizes.size() != 2) gx = gx.view(x_sizes);
        return {need_x ? cast_to(gx, dt(0)) : Tensor(), Tensor(), Tensor(), cast_to(ga, dt(3)),
                cast_to(gb, dt(4)), Tensor(), Tensor(), Tensor()};
      }
    }
    const Tensor a = cast_to(saved[3], x2.scalar_type()), bm = cast_to(saved[4], x2.scalar_type());
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
    return {grad_x, grad_w, grad_b, grad_a, grad_bl, Tensor(), Tensor(), Tensor()};
  }
};

Tensor lora_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                   const Tensor& A, const Tensor& B, double scale, int64_t plan, int64_t stream) {
  return LoRALinearCpp::apply(x, weight, bias, A, B, scale, plan, stream);
}

}  // namespace lora_bench

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_linear", torch::wrap_pybind_function_no_gil(lora_bench::lora_linear),
        "y = x W^T + b + scale (x A) B with the minimal backward (C++ autograd op)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("A"),
        pybind11::arg("B"), pybind11::arg("scale"), pybind11::arg("plan") = -1, pybind11::arg("stream") = 0);
  m.def("register_plan", &lora_bench::register_plan,
        "register the compiled Triton kernels of one layer shape for direct launches; returns its id");
}
