"""The names of lora-kernel's plans (:class:`lora_bench.kernels.call.Plan`), without importing torch:
the ``kernel_plan`` setting's choices are declared from them."""

PLAN_NAMES = ("direct", "cpp", "fused", "cublas", "torch")
AUTO = "auto"  # the kernel_plan setting's default: the rules choose per call
