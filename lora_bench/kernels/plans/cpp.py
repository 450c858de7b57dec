"""The ``cpp`` plan: the C++ autograd op (``lora_op.cpp``, built on first use by
:mod:`lora_bench.kernels.lora_cpp`) with ATen GEMMs: one pybind call forward, no Python in
backward. It runs on CUDA and CPU tensors alike; torch.compile cannot trace it."""

from __future__ import annotations

from lora_bench.kernels import available
from lora_bench.kernels.call import Call

FALLBACK = None


def runs(call: Call) -> bool:
    return not call.compiling and bool(call.have_cpp)


def layer(x, weight, bias, A, B, scale: float):
    return available.cpp_op().lora_linear(x, weight, bias, A, B, float(scale))
