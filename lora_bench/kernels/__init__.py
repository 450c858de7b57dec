"""The project's own GPU kernels (Triton).

Nothing here imports Triton at package import time: ``lora_bench.kernels.lora_triton`` does, and
only the CUDA path of ``lora_bench.kernels.autograd`` imports it, on first use. Machines without Triton
(CI, CPU-only installs) therefore import the whole package fine.
"""

from __future__ import annotations

import importlib.util


def triton_installed() -> bool:
    """True when the ``triton`` package can be found (it may still fail to import)."""
    return importlib.util.find_spec("triton") is not None


__all__ = ["triton_installed"]
