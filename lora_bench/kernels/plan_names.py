"""The names of lora-kernel's plans (:class:`lora_bench.kernels.call.Plan`), of where its adapter
gradients run and of when its DoRA norms are launched, without importing torch: the settings'
choices are declared from them."""

PLAN_NAMES = ("direct", "cpp", "fused", "cublas", "torch")
AUTO = "auto"  # the kernel_plan setting's default: the rules choose per call
# where a layer's adapter gradients (grad_A, grad_B) run: inline, on the caller's stream in the
# layer's backward; deferred, on a side stream joined once per backward pass (kernels.deferred)
ADAPTER_GRADS_INLINE = "inline"
ADAPTER_GRADS_DEFERRED = "deferred"
ADAPTER_GRADS = (ADAPTER_GRADS_INLINE, ADAPTER_GRADS_DEFERRED)
# when a fused DoRA layer's norm is launched: inline, in the layer's call; ahead, every layer's at the
# start of the model's forward on a side stream (kernels.dora_ahead); auto, ahead where the step is
# replayed from CUDA graphs on one GPU (one process, uncompiled), inline elsewhere
DORA_NORM_INLINE = "inline"
DORA_NORM_AHEAD = "ahead"
DORA_NORM_LAUNCHES = (AUTO, DORA_NORM_INLINE, DORA_NORM_AHEAD)
# where the fused forward GEMMs form H = x·A (and the backward's u = g·Bᵀ): gemm, in the GEMM's K loop;
# apart, by torch's GEMM before the launch, for launches of H_APART_MIN_R adapter columns or more
# cublas: as apart, and the frozen product by torch's GEMM too, s·H·B added by one batched GEMM
ADAPTER_H_GEMM = "gemm"
ADAPTER_H_APART = "apart"
ADAPTER_H_CUBLAS = "cublas"
ADAPTER_H = (ADAPTER_H_GEMM, ADAPTER_H_APART, ADAPTER_H_CUBLAS)
# how the fused GEMMs' tiles are chosen: picked, by the launch shape's waves on this GPU; timed, the
# fastest of a few candidates timed on each launch shape's first eager launch
GEMM_TILES_PICKED = "picked"
GEMM_TILES_TIMED = "timed"
GEMM_TILES = (GEMM_TILES_PICKED, GEMM_TILES_TIMED)
