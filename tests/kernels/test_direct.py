"""lora-kernel's "direct" plan on the host side (lora_bench/kernels/plans/direct.py): which arguments a
compiled Triton kernel keeps and their sizes, read from its signature and checked against its PTX.

The real kernels are compiled for sm_90 with the installed Triton (its ptxas runs on any machine),
so the argument mapping the C++ op relies on is checked without a GPU; the launches themselves are
GPU tests in test_lora_cpp.py."""

from __future__ import annotations

import pytest
import torch
from sm90 import compile_sm90

from lora_bench.kernels import available
from lora_bench.kernels.plans import direct
from lora_bench.kernels.autograd import call_plan
from lora_bench.kernels.policy import Plan, PlanPolicy, parse_plan, use_policy

PTX = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u32 k_param_1,
	.param .f32 k_param_2,
	.param .u64 .ptr .global .align 1 k_param_3
)
{ ret; }
"""


def test_ptx_param_sizes():
    assert direct.ptx_param_sizes(PTX) == [8, 4, 4, 8]
    assert direct.ptx_param_sizes(PTX, "k") == [8, 4, 4, 8]
    with pytest.raises(direct.Unsupported, match="no .entry"):
        direct.ptx_param_sizes(PTX, "other")
    with pytest.raises(direct.Unsupported, match="PTX parameter"):
        direct.ptx_param_sizes(".entry k(\n .param .align 8 .b8 k_param_0[128]\n)")


def test_param_sources_maps_kept_arguments_and_scratch():
    sig = {"x_ptr": "*bf16", "n": "i32", "s": "fp32", "BLOCK": "constexpr"}
    assert direct.param_sources(sig, "pif", [8, 4, 4, 8, 8]) == [0, 1, 2, -1, -1]
    assert direct.param_sources(sig, "pif", [8, 4, 4]) == [0, 1, 2]
    # an integer compiled in as a constant (an older Triton's 'equal to 1'): skipped
    assert direct.param_sources({"x_ptr": "*fp16", "n": "constexpr", "s": "fp32"}, "pif", [8, 4, 8]) == [0, 2, -1]
    with pytest.raises(direct.Unsupported, match="expected 'i'"):
        direct.param_sources({"x_ptr": "*bf16", "n": "i64", "s": "fp32"}, "pif", [8, 8, 4])
    with pytest.raises(direct.Unsupported, match="PTX declares"):
        direct.param_sources(sig, "pif", [8, 4, 4, 8, 8, 8])
    with pytest.raises(direct.Unsupported, match="bytes"):
        direct.param_sources(sig, "pif", [8, 8, 4])
    with pytest.raises(direct.Unsupported, match="after the canonical"):
        direct.param_sources({**sig, "extra": "i32"}, "pif", [8, 4, 4, 4])


@pytest.mark.parametrize("which", ["mm", "ab"])
def test_real_kernels_compiled_for_sm90_keep_every_canonical_argument(which):
    """The canonical argument lists (MM_ARGS / AB_ARGS) match the kernels' signatures, and the
    compiled kernel takes each of them, in order, plus Triton's trailing scratch pointers."""
    pytest.importorskip("triton")
    from lora_bench.kernels import lora_triton as tk

    if which == "mm":
        fn, canonical = tk.KERNELS["mm"], direct.MM_ARGS
        consts = dict(HAS_BIAS=True, WRITE_H=True, EVEN_K=True, EVEN_R=True, PRECISION="tf32", BLOCK_M=64,
                      BLOCK_N=128, BLOCK_K=64, BLOCK_R=16, GROUP_M=8, RS=0, P_SS=0, Q_SS=0, P_SEG=0, Q_SEG=0,
                      H_IN=False)  # (H formed in the K loop: how the direct plan compiles it)
    else:
        fn, canonical = tk.KERNELS["ab"], direct.AB_ARGS
        consts = dict(PRECISION="tf32", BLOCK_M=64, BLOCK_D=32, BLOCK_R=16, ATOMIC=False, RS=0, GA_SS=0, GB_SS=0,
                      GB_SEG=0)  # (the segment constants as the direct plan compiles them: none)
    runtime = [n for n in fn.arg_names if n not in consts]
    assert len(runtime) == len(canonical) and runtime == list(fn.arg_names[:len(canonical)])
    kinds = {"p": "*bf16", "i": "i32", "f": "fp32"}
    types = {n: kinds[c] for n, c in zip(runtime, canonical)}
    assert [n.endswith("_ptr") for n in runtime] == [c == "p" for c in canonical]
    kernel = compile_sm90(fn, types, consts)
    sizes = direct.ptx_param_sizes(kernel.asm["ptx"], kernel.metadata.name)
    srcs = direct.param_sources(kernel.src.signature, canonical, sizes)
    assert srcs[:len(canonical)] == list(range(len(canonical)))
    assert all(s == -1 for s in srcs[len(canonical):])
    kernel.function = 12345  # a loaded kernel's CUfunction: only a GPU sets it
    spec = direct.launch_spec(kernel, (7, 2, 1), canonical)
    assert spec[:6] == [12345, 7, 2, 1, 32 * kernel.metadata.num_warps, kernel.metadata.shared]
    assert spec[6] == len(srcs) and spec[7:] == srcs


@pytest.mark.slow
def test_direct_mode_parsing_and_cpu_route():
    assert parse_plan("direct") is Plan.DIRECT
    for bad in ("direct:direct", "direct:fused"):  # one plan runs forward and backward
        with pytest.raises(ValueError, match="expected one of"):
            parse_plan(bad)
    with use_policy(PlanPolicy(forced=Plan.DIRECT)):
        # a CPU tensor: the C++ op's ATen plan (the Python Function only without a compiler)
        want = Plan.CPP if available.HAVE_CPP else Plan.TORCH
        assert call_plan(torch.empty(2, 3), torch.empty(4, 3), 4) is want
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert call_plan(torch.empty(2, 3), torch.empty(4, 3), 4) is want


def test_plan_for_declines_fp32_and_mixed_adapter_dtypes(monkeypatch):
    """Exact fp32 keeps the ATen plan; so do A and B of different dtypes (no kernel is built)."""
    def no_build(*args, **kwargs):
        raise AssertionError("a direct plan was built for a call that does not take it")

    monkeypatch.setattr(direct, "build", no_build)
    x, w = torch.empty(4, 8), torch.empty(6, 8)
    a, b = torch.empty(8, 2), torch.empty(2, 6)
    assert direct.plan_key(x, w, None, a, b) is None and direct.plan_for(x, w, None, a, b) == -1
    xb = x.bfloat16()
    assert direct.plan_key(xb, w.bfloat16(), None, a.bfloat16(), b) is None
    assert direct.plan_for(xb, w.bfloat16(), None, a.bfloat16(), b) == -1
