"""lora-kernel's implementations and the policy that picks one per layer call.

``policy`` (the plans and how one is chosen), ``available`` (whether Triton and the C++ op can
run here), ``autograd`` (the op: the Python Function, the custom ops for torch.compile, and the
dispatch), ``lora_cpp`` + ``lora_op.cpp`` (the C++ autograd op), ``direct`` (its direct launches
of the Triton kernels), ``lora_triton`` + ``launch`` (the Triton kernels and their cached launch).
``adamw_triton`` holds the packed AdamW's Triton update (``train.packed_adamw``), launched the
same way. ``dora`` + ``dora_triton`` / ``dora_triton_bwd``: DoRA's norm and per-output scale in
the fused layer (its forward's and backward's Triton kernels, launched the same way).

Nothing here imports Triton or builds the C++ op at package import time: both happen on first
use, so machines without Triton or a compiler (CI, CPU-only installs) import the whole package fine.
"""
