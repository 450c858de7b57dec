"""lora-kernel's rule table (lora_bench.kernels.plan_rules) against the committed measurements it cites:
each rule's plan is the one those measurements favour where the rule applies. The numbers come
from one H200 (results/kernel/kernel-bench/plans: every plan of one layer, eager and replayed
from a CUDA graph, implementations interleaved round by round)."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from lora_bench.kernels.call import CPP_GRAPH_MIN_WEIGHT, Plan
from lora_bench.kernels.plan_rules import KERNEL_BENCH, RULES
from paths import ROOT


PLANS = ("direct", "cpp", "fused", "cublas")


@pytest.fixture(scope="module")
def bench() -> pd.DataFrame:
    df = pd.read_csv(ROOT / KERNEL_BENCH)
    df = df[df["impl"].str.startswith("lora-kernel:")].copy()
    df["plan"] = df["impl"].str.split(":").str[1]
    df["weight"] = [int(a) * int(b) for a, b in df["shape"].str.extract(r":(\d+)->(\d+):").itertuples(index=False)]
    return df


def _by_plan(df: pd.DataFrame, shape: str, dtype: str, col: str) -> dict[str, float]:
    part = df[(df["shape"] == shape) & (df["dtype"] == dtype)]
    return dict(zip(part["plan"], part[col]))


def test_every_rule_cites_a_committed_measurement():
    for rule in RULES:
        if rule.source:
            assert (ROOT / rule.source).exists(), (rule.name, rule.source)
        assert rule.evidence and not re.search(r"\d+\.\d+ ?(us|ms)", rule.evidence), rule.name  # numbers live in the data


def test_eager_16_bit_calls_run_direct(bench):
    """The eager bf16 rule: direct is the fastest eager plan at every shape (its median below every
    other plan's median)."""
    for shape in bench["shape"].unique():
        eager = _by_plan(bench, shape, "bf16", "fwdbwd_ms")
        assert eager["direct"] == min(eager[p] for p in PLANS), (shape, eager)


def test_eager_fp32_calls_run_cpp(bench):
    """The eager fp32 rule: cpp is within the report's no-difference threshold (2 %) of the
    fastest plan at every shape (cublas comes within 1-2 % at the 1558M MLP shapes, where both run
    the same cuBLAS GEMMs) and clearly faster than fused from the 1558M shapes on, where fused's FMA
    GEMM runs long."""
    from lora_bench.report.stats import THRESHOLD

    for shape, weight in bench[["shape", "weight"]].drop_duplicates().itertuples(index=False):
        med = _by_plan(bench, shape, "fp32", "fwdbwd_ms")  # (direct forced in fp32 runs cpp: not a rival)
        assert med["cpp"] <= (1 + THRESHOLD) * min(med[p] for p in ("cpp", "fused", "cublas")), (shape, med)
        if weight >= 1600 * 1600:
            assert med["cpp"] < _by_plan(bench, shape, "fp32", "fwdbwd_p10_ms")["fused"], (shape, med)


def test_captured_layers_take_cpp_from_the_size_threshold_and_fused_below_it(bench):
    for shape, weight in bench[["shape", "weight"]].drop_duplicates().itertuples(index=False):
        graph = _by_plan(bench, shape, "bf16", "graph_fwdbwd_ms")
        best = min(("cpp", "fused", "cublas"), key=graph.get)
        assert best == ("cpp" if weight >= CPP_GRAPH_MIN_WEIGHT else "fused"), (shape, graph)


def test_captured_exact_fp32_runs_cublas(bench):
    for shape in bench["shape"].unique():
        graph = _by_plan(bench, shape, "fp32", "graph_fwdbwd_ms")
        assert min(("cpp", "fused", "cublas"), key=graph.get) == "cublas", (shape, graph)


def test_compiled_large_weights_run_cublas():
    """The compiled size rule: both runs with cublas at the MLP shapes (the default) are faster than
    the run with fused everywhere, measured A-B-A."""
    rule, = (r for r in RULES if r.plan is Plan.CUBLAS and "compiled" in r.name and "threshold" in r.name)
    df = pd.read_csv(ROOT / rule.source / "runs.csv").set_index("run_id")
    default = df[df.index.str.contains("-default-")]["step_ms_median"]
    fused = df[df.index.str.contains("lora-kernel-fused-")]["step_ms_median"]
    assert len(default) == 2 and len(fused) == 1 and default.max() < fused.min()
