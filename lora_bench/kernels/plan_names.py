"""The names of lora-kernel's plans (:class:`lora_bench.kernels.call.Plan`) and of where its adapter
gradients run, without importing torch: the settings' choices are declared from them."""

PLAN_NAMES = ("direct", "cpp", "fused", "cublas", "torch")
AUTO = "auto"  # the kernel_plan setting's default: the rules choose per call
# where a layer's adapter gradients (grad_A, grad_B) run: inline, on the caller's stream in the
# layer's backward; deferred, on a side stream joined once per backward pass (kernels.deferred)
ADAPTER_GRADS_INLINE = "inline"
ADAPTER_GRADS_DEFERRED = "deferred"
ADAPTER_GRADS = (ADAPTER_GRADS_INLINE, ADAPTER_GRADS_DEFERRED)
# where a DoRA lora-kernel layer's norm and scale run: split, in launches of their own beside the LoRA
# op's (kernels.dora_triton, dora_triton_bwd); fused, inside the LoRA op's kernels (kernels.dora_triton_fused)
DORA_FUSION_SPLIT = "split"
DORA_FUSION_FUSED = "fused"
DORA_FUSIONS = (DORA_FUSION_SPLIT, DORA_FUSION_FUSED)
