"""The names of lora-kernel's plans (:class:`lora_bench.kernels.call.Plan`) and of where its adapter
gradients run, without importing torch: the settings' choices are declared from them."""

PLAN_NAMES = ("direct", "cpp", "fused", "cublas", "torch")
AUTO = "auto"  # the kernel_plan setting's default: the rules choose per call
# where a layer's adapter gradients (grad_A, grad_B) run: inline, on the caller's stream in the
# layer's backward; deferred, on a side stream joined once per backward pass (kernels.deferred)
ADAPTER_GRADS_INLINE = "inline"
ADAPTER_GRADS_DEFERRED = "deferred"
ADAPTER_GRADS = (ADAPTER_GRADS_INLINE, ADAPTER_GRADS_DEFERRED)
