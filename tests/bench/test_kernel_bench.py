"""kernel-bench runs tiny on CPU: CSV columns, every impl/dtype present, sane numbers."""

from __future__ import annotations

import csv

import pytest

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
