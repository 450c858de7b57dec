"""kernel-bench runs tiny on CPU: CSV columns, every impl/dtype present, sane numbers."""

from __future__ import annotations

import csv

import pytest
import torch

from lora_bench.bench.kernel_bench import (
    COLUMNS,
    LORA_IMPLS,
    parse_shape,
    render_kernel_table,
    resolve_shapes,
    run_kernel_bench,
)


def test_tiny_cpu_bench_writes_csv(tmp_path):
    out = tmp_path / "sub" / "kb.csv"
    rows = run_kernel_bench(shapes=["2x8:48->40:r4"], impls=None, dtypes=["fp32", "bf16"], device="cpu",
                            repeats=3, warmup=1, out_csv=out, cpu=True, progress=False)
    with out.open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        got = list(reader)
    assert len(got) == len(rows) == len(LORA_IMPLS) * 2  # no --impls: the LoRA layers and the frozen one
    assert {(r["impl"], r["dtype"]) for r in got} == {(i, d) for i in LORA_IMPLS for d in ("fp32", "bf16")}
    for r in got:
        for phase in ("fwd", "bwd", "fwdbwd"):
            assert float(r[f"{phase}_p10_ms"]) <= float(r[f"{phase}_ms"]) <= float(r[f"{phase}_p90_ms"])
            assert float(r[f"{phase}_ms"]) > 0
        assert r["device"] == "cpu" and r["graph_fwdbwd_ms"] == ""
        assert r["backend"] == "torch"  # baselines: torch's CPU ops; lora-kernel: the plan its calls ran
        assert (r["cpu_fwdbwd_ms"] != "") == (r["dtype"] == "fp32")
    frozen = [r for r in got if r["impl"] == "frozen"]
    assert all(float(r["x_frozen"]) == 1.0 for r in frozen)
    assert not list(tmp_path.glob("sub/*.tmp"))  # the atomic write left no temp file
    assert render_kernel_table(rows).row_count == len(rows)


def test_shapes_and_groups():
    s = parse_shape("4x512:768->3072:r16")
    assert (s.batch, s.seq, s.tokens, s.d_in, s.d_out, s.rank) == (4, 512, 2048, 768, 3072, 16)
    assert parse_shape("960:1600->6400:r16").tokens == 960
    names = [s.name for s in resolve_shapes(["1558m"])]
    assert names == ["960:1600->1600:r16", "960:1600->6400:r16", "960:6400->1600:r16"]
    assert len(resolve_shapes(None)) == 9
    with pytest.raises(ValueError):
        parse_shape("960x1600")
    with pytest.raises(ValueError):
        run_kernel_bench(shapes=["2x8:48->40:r4"], impls=["nope"], dtypes=["fp32"], device="cpu",
                         repeats=1, warmup=0, out_csv=None, cpu=False, progress=False)


@pytest.mark.slow
def test_forced_cpp_impl_runs_the_cpp_op():
    """``lora-kernel:cpp`` forces the C++ op through the plan policy for that implementation only;
    the backend column says what the layer's calls ran."""
    from lora_bench.kernels import lora_cpp
    from lora_bench.kernels.policy import Plan, PlanPolicy, current_policy, use_policy

    if not lora_cpp.cpp_available():
        pytest.skip(f"the C++ op cannot be built here: {lora_cpp.build_error()}")
    before = current_policy()
    rows = run_kernel_bench(shapes=["2x8:48->40:r4"], impls=["lora-kernel:cpp", "lora-kernel"], dtypes=["fp32"],
                            device="cpu", repeats=3, warmup=1, out_csv=None, cpu=False, progress=False)
    assert [r["backend"] for r in rows] == ["cpp", "torch"]  # CPU default: the Python Function
    assert current_policy() is before  # the forced plan was for that impl only
    # plain lora-kernel runs the policy in force
    with use_policy(PlanPolicy(forced=Plan.CPP)):
        rows = run_kernel_bench(shapes=["2x8:48->40:r4"], impls=["lora-kernel", "lora-kernel:torch"], dtypes=["fp32"],
                                device="cpu", repeats=3, warmup=1, out_csv=None, cpu=False, progress=False)
    assert [r["backend"] for r in rows] == ["cpp", "torch"]


@pytest.mark.parametrize("impl,needle", [("lora-kernel:foo", "lora-kernel's plans are direct, cpp, fused, cublas, torch"),
                                         ("lora-kernel:fused:torch", "lora-kernel's plans are")])
def test_bad_plan_names_are_refused_before_anything_runs(impl, needle):
    with pytest.raises(ValueError, match=needle):
        run_kernel_bench(shapes=["2x8:48->40:r4"], impls=[impl], dtypes=["fp32"], device="cpu", repeats=1,
                         warmup=0, out_csv=None, cpu=False, progress=False)


def test_interleaved_rounds_cancel_host_drift(monkeypatch):
    """A host that slows down steadily (×3 over the bench) must not bias the ratios: each round
    times every implementation, so the per-round ratio recovers the true cost ratio."""
    import lora_bench.bench.kernel_bench as kb

    true_cost = {"frozen": 1.0, "lora": 4.0, "lora-kernel": 2.0}
    clock = {"calls": 0}
    impl_of = {}
    real_make_sets = kb._make_sets

    def make_sets(impl, *a, **kw):
        sets = real_make_sets(impl, *a, **kw)
        impl_of[id(sets[0][0])] = impl
        return sets

    def fake_time_phase(sets, phase, *, repeats, warmup, device):
        impl = impl_of[id(sets[0][0])]
        out = []
        for _ in range(repeats):
            clock["calls"] += 1
            drift = 1.0 + clock["calls"] / 600  # 1 → ~3 over the run
            out.append(true_cost[impl] * drift)
        return out

    monkeypatch.setattr(kb, "_make_sets", make_sets)
    monkeypatch.setattr(kb, "_time_phase", fake_time_phase)
    rows = kb.run_kernel_bench(shapes=["2x8:48->40:r4"], impls=list(true_cost), dtypes=["fp32"], device="cpu",
                               repeats=200, warmup=0, out_csv=None, cpu=False, progress=False)
    by = {r["impl"]: r for r in rows}
    assert by["lora-kernel"]["x_frozen"] == pytest.approx(2.0, rel=0.05)
    assert by["lora-kernel"]["x_lora"] == pytest.approx(0.5, rel=0.05)
    assert by["lora"]["x_frozen"] == pytest.approx(4.0, rel=0.05)
    assert clock["calls"] == 3 * 3 * 200  # 3 phases × 3 implementations × all repeats, no more


def test_kernels_profile_each_implementation_phase_by_phase(tmp_path):
    """--kernels: after the timings, each implementation's eager forward and backward profiled,
    kernel by kernel (on the CPU: top-level aten ops), written beside the bench table. DoRA's layer
    launches what LoRA's does and more; each phase's shares add up to the whole phase."""
    from lora_bench.bench.kernel_profile import KERNEL_COLUMNS, PROFILED_CALLS, kernels_path, render_kernels

    out = tmp_path / "kb.csv"
    found: list[dict] = []
    run_kernel_bench(shapes=["2x8:48->40:r4"], impls=["frozen", "lora-kernel", "dora-kernel"], dtypes=["fp32"],
                     device="cpu", repeats=2, warmup=1, out_csv=out, kernels=found)
    with kernels_path(out).open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == KERNEL_COLUMNS
        rows = list(reader)
    assert len(rows) == len(found) > 0
    by = {}
    for r in rows:
        by.setdefault((r["impl"], r["phase"]), []).append(r)
    assert set(by) == {(i, p) for i in ("frozen", "lora-kernel", "dora-kernel") for p in ("fwd", "bwd")}
    for (impl, phase), ks in by.items():
        assert sum(float(k["share_of_phase"]) for k in ks) == pytest.approx(1.0)
        us = [float(k["us_per_call"]) for k in ks]
        assert us == sorted(us, reverse=True) and min(us) > 0
        assert all(int(k["calls"]) == PROFILED_CALLS and k["unit"] == "top-level aten ops (CPU)" for k in ks)

    def launches(impl):
        return sum(float(k["launches_per_call"]) for k in by[(impl, "fwd")] + by[(impl, "bwd")])

    assert launches("frozen") < launches("lora-kernel") < launches("dora-kernel")
    assert {r["backend"] for r in rows if r["impl"] == "frozen"} == {"torch"}
    assert all("dora-norm-torch" in r["backend"] for r in rows if r["impl"] == "dora-kernel")
    table = render_kernels(found, top=2)
    assert table.row_count == sum(min(2, len(v)) for v in by.values())


def test_kernels_from_the_command_line(tmp_path, run_cli):
    code, out = run_cli("kernel-bench", "--shapes", "2x8:48->40:r4", "--dtypes", "fp32", "--impls", "frozen,lora",
                        "--device", "cpu", "--repeats", "2", "--warmup", "1", "--kernels",
                        "--results-dir", str(tmp_path), "--no-progress")
    assert code == 0, out
    assert (tmp_path / "kernel_bench_kernels.csv").is_file() and "kernel_bench_kernels.csv" in out
    assert "Kernels per forward / backward call" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_on_a_gpu_name_the_device_kernels_dora_launches():
    """On a GPU the profile holds device kernels: the fused DoRA layer's own Triton kernels among
    them, in the phase that launches them, with device time; and the LoRA op's forward GEMM, which
    the eager ``direct`` plan launches from C++ through the driver API, in the forward of both fused
    layers, once a call."""
    found: list[dict] = []
    run_kernel_bench(shapes=["960:768->768:r16"], impls=["frozen", "lora-kernel", "dora-kernel-detached"],
                     dtypes=["bf16-autocast"], device="cuda", repeats=5, warmup=2, out_csv=None, kernels=found)
    assert {k["unit"] for k in found} == {"cuda kernels+memcpy"}
    for impl in ("lora-kernel", "dora-kernel-detached"):
        fwd = {k["kernel"]: k["launches_per_call"] for k in found if k["impl"] == impl and k["phase"] == "fwd"}
        assert fwd.get("_lora_mm_kernel") == 1, (impl, fwd)
    fwd = {k["kernel"]: k["launches_per_call"] for k in found if k["impl"] == "dora-kernel-detached"
           and k["phase"] == "fwd"}
    assert fwd.get("_dora_norm_part_kernel") == 1 and fwd.get("_dora_norm_scale_kernel") == 1, fwd  # each once
    bwd = {k["kernel"]: k["launches_per_call"] for k in found if k["impl"] == "lora-kernel" and k["phase"] == "bwd"}
    assert bwd == {"_lora_mm_kernel": 1, "_lora_grad_ab_kernel": 1}, bwd  # the direct plan's two, once each
    assert not any(k["kernel"].startswith("phase:") for k in found)  # a range is not a kernel
    assert all(k["us_per_call"] > 0 for k in found)
