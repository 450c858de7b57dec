"""Every number the prose of README.md and docs/ quotes beside the generated tables is tied here to
the committed rows it comes from (the tables themselves are generated: docs/generate.py --check).
Each claim is the sentence as written, with its numbers computed from results/ the way the study
computes them: a phase's GPU busy fraction is the profiled repeat's kernel ms per step over the
median of the timed repeats' device ms (lora_bench.report.study_model)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
STUDY = RESULTS / "answer" / "study"
FWD_BWD = ("forward", "backward")
ALL_PHASES = ("forward", "backward", "optimizer")


@cache
def _study() -> pd.DataFrame:
    df = pd.read_csv(STUDY / "runs.csv", low_memory=False)
    return df[df["status"] == "done"]


@cache
def _kernels(size: str, layers: str) -> pd.DataFrame:
    df = _study()
    prof = df[(df["cfg_profile"] == "kernels") & (df["model_size"] == size) & (df["trainable_layers"] == layers)]
    assert len(prof) == 1, (size, layers)
    return pd.read_csv(STUDY / prof["run_id"].iloc[0] / "kernels_by_phase.csv").set_index("phase")


def busy(size: str, layers: str, phase: str) -> int:
    """The GPU's busy fraction in a reference-mode phase, in whole percent."""
    df = _study()
    timed = df[(df["sweep_label"] == "reference") & (df["model_size"] == size) & (df["trainable_layers"] == layers)]
    kernel_ms = float(_kernels(size, layers).loc[phase, "kernel_ms_per_step"])
    return round(100 * min(kernel_ms / float(timed[f"{phase}_ms_median"].median()), 1.0))


def span(points) -> str:
    """'29–56' over (size, layers, phase) points; one number where they agree."""
    values = [busy(*p) for p in points]
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


def pts(sizes, layers, phases) -> list[tuple[str, str, str]]:
    return [(s, lay, ph) for s in sizes for lay in layers for ph in phases]


def per_step(size: str, layers: str) -> tuple[int, float]:
    """Kernel launches and kernel ms per step of the profiled repeat, every phase counted."""
    k = _kernels(size, layers)
    return round(float(k["launches_per_step"].sum())), float(k["kernel_ms_per_step"].sum())


def more_launches() -> int:
    return round(100 * (per_step("124M", "lora")[0] / per_step("124M", "all")[0] - 1))


def step_of(folder: str, run_id: str) -> float:
    df = pd.read_csv(RESULTS / folder / "runs.csv", low_memory=False)
    return float(df.loc[df["run_id"] == run_id, "step_ms_median"].iloc[0])


def study_best_median(size: str, layers: str) -> float:
    df = _study()
    best = df[(df["sweep_label"] == "best") & (df["model_size"] == size) & (df["trainable_layers"] == layers)]
    assert len(best) == 5
    return float(best["step_ms_median"].median())


def best_mode_124m_within() -> int:
    """How far from 1 the 124M best-mode lora ÷ all interval reaches, in percent (as the README's table)."""
    from lora_bench.publish.docs_study import _repeats

    r = _repeats("best")[("124M", "lora")].ratio
    return round(100 * max(1 - r.lo, r.hi - 1))


CLAIMS: list[tuple[str, object]] = [
    ("README.md", lambda: f"too close to call (*unclear*, within {best_mode_124m_within()} %)"),
    ("README.md", lambda: f"the GPU runs kernels for only {span(pts(['124M'], ['all', 'lora'], FWD_BWD))} % of "
                          "forward and backward"),
    ("README.md", lambda: f"({more_launches()} % more launches)"),
    ("README.md", lambda: f"At 1558M the GPU is busy ({span(pts(['1558M'], ['all', 'lora', 'lora-kernel'], FWD_BWD))} %)"),
    ("docs/all-vs-lora.md", lambda: f"the GPU is busy for only {span(pts(['124M'], ['all'], FWD_BWD))} % of forward and "
                                    f"backward with `all` and {span(pts(['124M'], ['lora'], FWD_BWD))} % with `lora`"),
    ("docs/all-vs-lora.md", lambda: f"({per_step('124M', 'lora')[1]:.1f} ms of kernels per step instead of "
                                    f"{per_step('124M', 'all')[1]:.1f} ms"),
    ("docs/all-vs-lora.md", lambda: f"{more_launches()} % more kernels ({per_step('124M', 'lora')[0]:,} against "
                                    f"{per_step('124M', 'all')[0]:,} per step)"),
    ("docs/all-vs-lora.md", lambda: f"From 774M on `all` keeps it busy for "
                                    f"{span(pts(['774M', '1558M'], ['all'], ALL_PHASES))} % of every phase"),
    ("docs/all-vs-lora.md", lambda: f"keep the GPU busy too ({span(pts(['1558M'], ['lora', 'lora-kernel'], FWD_BWD))} %)"),
    ("docs/all-vs-lora.md", lambda: f"`lora`'s optimizer keeps the GPU busy for "
                                    f"{span(pts(['124M', '355M', '774M', '1558M'], ['lora'], ['optimizer']))} % of its time"),
    ("docs/all-vs-lora.md", lambda: f"finds the GPU busy for {span(pts(['1558M'], ['all'], ALL_PHASES))} % of every phase "
                                    f"with `all` and for {span(pts(['1558M'], ['lora'], FWD_BWD))} % of `lora`'s forward "
                                    "and backward"),
    ("docs/all-vs-lora.md", lambda: f"(its GPU busy for {busy('1558M', 'lora', 'backward')} % of it on one GPU"),
    ("docs/all-vs-lora.md", lambda: (
        f"step at batch 8 reads {step_of('answer/tokens-per-step', '124M-lora-kernel-33ca0d6337-r0'):.2f} ms here, "
        f"{step_of('method/modes/fused-adamw-compile', '124M-graphs-bf16-fused-fopt-lora-kernel'):.2f} ms in "
        f"`results/method/modes/fused-adamw-compile/` (section 5), "
        f"{step_of('answer/peers', '124M-lora-kernel-67ba76d761-r0'):.2f} ms in the peer rows "
        f"(`results/answer/peers/`, section 9) and {study_best_median('124M', 'lora-kernel'):.2f} ms, the median of "
        "five repeats")),
]



@cache
def _ddp() -> pd.DataFrame:
    from benchmarks.ddp_table import table

    return table(RESULTS / "scaling" / "ddp-2gpu")


def ddp(size: str, layers: str, graphed: bool, col: str) -> float:
    t = _ddp()
    m = t[(t["size"] == size) & (t["layers"] == layers) & (t["graphs"].astype(str) == str(graphed))]
    assert len(m) == 1, (size, layers, graphed)
    return float(m[col].iloc[0])


def x(size: str, layers: str, graphed: bool, col: str = "b16_x") -> str:
    return f"{ddp(size, layers, graphed, col):.2f}×"


def lora_over_all(size: str, graphed: bool, col: str) -> str:
    return f"{ddp(size, 'lora', graphed, col) / ddp(size, 'all', graphed, col):.2f}×"


CLAIMS += [("docs/all-vs-lora.md", claim) for claim in (
    lambda: x("1558M", "lora", False) == x("1558M", "lora", True) and (
             f"{x('1558M', 'lora', True)} at 1558M in eager fp32 and graphed, {x('124M', 'lora', True)} at 124M "
             f"graphed. `all` scales {x('1558M', 'all', False)} at 1558M in eager fp32"),
    lambda: (f"({ddp('1558M', 'all', False, 'b16_allreduce_ms'):.1f} ms of all-reduce, "
             f"{ddp('1558M', 'all', False, 'b16_exposed_ms'):.1f} ms after backward's last gradient), and only "
             f"{x('1558M', 'all', True)[:-1]}–{x('124M', 'all', True)} graphed"),
    lambda: (f"{lora_over_all('1558M', False, 'one_gpu_tok_s')} `all`'s on one GPU and "
             f"{lora_over_all('1558M', False, 'b16_tok_s')} on two in eager fp32, "
             f"{lora_over_all('1558M', True, 'one_gpu_tok_s')} and {lora_over_all('1558M', True, 'b16_tok_s')} "
             "graphed"),
    lambda: (f"level with `all` ({lora_over_all('124M', True, 'one_gpu_tok_s')}) to "
             f"{lora_over_all('124M', True, 'b16_tok_s')} ahead"),
    lambda: (f"({lora_over_all('124M', False, 'one_gpu_tok_s')} → {lora_over_all('124M', False, 'b16_tok_s')})"),
    lambda: f"{x('1558M', 'lora-kernel', True)} at 1558M and {x('124M', 'lora-kernel', True)} at 124M graphed",
    lambda: "1558M `lora-kernel` trains {:.2f}× `all`'s tokens/s".format(
        ddp("1558M", "lora-kernel", True, "b16_tok_s") / ddp("1558M", "all", True, "b16_tok_s")),
    lambda: f"eager fp32 figures ({x('1558M', 'lora-kernel', False)} and {x('124M', 'lora-kernel', False)})",
    lambda: f"poorly there ({x('124M', 'all', False)} and {x('124M', 'lora', False)})",
    lambda: f"only the graphed 1558M LoRA step still gains ({x('1558M', 'lora', True, 'b8_x')})",
)]


@cache
def _variants() -> tuple[dict, dict]:
    from lora_bench.publish.docs_variants import _groups

    return _groups("best")


def v_step(row: str, size: str) -> str:
    """A variants-study row's best-mode median step and its interval, 'm ms [lo–hi]'."""
    e = _variants()[0][(row, size)].estimates["step_ms_median"]
    return f"{e.value:.2f} ms [{e.lo:.2f}–{e.hi:.2f}]"


def v_x(row: str, size: str) -> str:
    """The row's step ÷ its own implementation's LoRA step (paired by repeat), '1.36×'."""
    return f"{_variants()[0][(row, size)].ratio.value:.2f}×"


def v_med(row: str, size: str) -> float:
    return _variants()[0][(row, size)].estimates["step_ms_median"].value


def v_extra(size: str) -> float:
    """What the fused layer's detached DoRA adds to the fused LoRA step, ms."""
    return v_med(DET, size) - v_med("fused LoRA (`lora-kernel`)", size)


def per_block_us(size: str) -> float:
    """That extra per transformer block, µs."""
    from lora_bench.model.sizes import MODEL_SIZES

    return 1e3 * v_extra(size) / MODEL_SIZES[size][1]


def v_over(row: str, other: str, size: str) -> float:
    return v_med(other, size) / v_med(row, size)


DET, EXACT, PEFT_DORA = "fused DoRA, detached norm", "fused DoRA, exact norm", "PEFT DoRA (`use_dora`)"
CLAIMS += [("docs/variants.md", claim) for claim in (
    lambda: (f"at 124M the detached step is {v_step(DET, '124M')}, {v_x(DET, '124M')} the fused LoRA step, and "
             f"the exact one {v_step(EXACT, '124M')}, {v_x(EXACT, '124M')},"),
    lambda: (f"at 1558M {v_step(DET, '1558M')} ({v_x(DET, '1558M')}) and {v_step(EXACT, '1558M')} "
             f"({v_x(EXACT, '1558M')})"),
    lambda: (f"The detached norm adds {v_extra('1558M'):.1f} ms to the 1558M step over fused LoRA and "
             f"{v_extra('124M'):.2f} ms to the 124M one: {per_block_us('1558M'):.0f} µs a block against "
             f"{per_block_us('124M'):.0f} µs"),
    lambda: (f"fused DoRA is {v_over(EXACT, PEFT_DORA, '124M'):.1f} to {v_over(DET, PEFT_DORA, '124M'):.1f}× faster "
             f"than PEFT's DoRA at 124M and {v_over(EXACT, PEFT_DORA, '1558M'):.1f} to "
             f"{v_over(DET, PEFT_DORA, '1558M'):.1f}× at 1558M"),
)]


DET_AHEAD, EXACT_AHEAD = "fused DoRA, detached norm, norms ahead", "fused DoRA, exact norm, norms ahead"


def v_fwd(row: str, size: str) -> float:
    """A row's median forward phase ms over its repeats."""
    from lora_bench.report.groups import estimate

    return estimate(_variants()[0][(row, size)].runs, "forward_ms_median").value


def hidden_pct(size: str) -> int:
    """What forming the norms ahead (the scale in the LoRA GEMM's epilogue) took off the detached
    forward, as a share of what the detached norm adds to fused LoRA's forward inline, in whole
    percent."""
    lora = v_fwd("fused LoRA (`lora-kernel`)", size)
    return round(100 * (v_fwd(DET, size) - v_fwd(DET_AHEAD, size)) / (v_fwd(DET, size) - lora))


CLAIMS += [("docs/variants.md", claim) for claim in (
    lambda: (f"took {hidden_pct('124M')} % of what the detached norm adds to fused LoRA's forward off it at 124M, "
             f"and {hidden_pct('1558M')} % at 1558M"),
    lambda: (f"with the norms ahead the detached step is {v_x(DET_AHEAD, '124M')} (124M) and "
             f"{v_x(DET_AHEAD, '1558M')} (1558M) the fused LoRA step, the exact one {v_x(EXACT_AHEAD, '124M')} and "
             f"{v_x(EXACT_AHEAD, '1558M')}"),
)]


@cache
def _dora_kernels() -> pd.DataFrame:
    """``kernel-bench --kernels``' profile of DoRA's narrow-tile kernels (results/kernel/kernel-bench/dora)."""
    return pd.read_csv(RESULTS / "kernel" / "kernel-bench" / "dora" / "kernel_bench_kernels.csv")


def k_us(shape: str, impl: str, kernel: str) -> float:
    """A kernel's device µs per call in that profile, bf16 autocast, 960 rows, r16."""
    df = _dora_kernels()
    row = df[(df["shape"] == f"960:{shape}:r16") & (df["impl"] == impl) & (df["kernel"] == kernel)]
    assert len(row) == 1, (shape, impl, kernel)
    return float(row["us_per_call"].iloc[0])


PART, EXACT_BWD = "_dora_norm_part_kernel", "_dora_exact_bwd_kernel"
CLAIMS += [("docs/variants.md", lambda: (
    f"the norm's first launch took {k_us('1600->6400', 'dora-kernel', PART):.0f} µs (1600→6400) and "
    f"{k_us('6400->1600', 'dora-kernel', PART):.0f} µs (6400→1600), reading 20 MB of W at about "
    f"{1600 * 6400 * 2 / k_us('1600->6400', 'dora-kernel', PART) / 1e6:.2f} TB/s")),
    ("docs/variants.md", lambda: (
        f"the exact backward's first launch took {k_us('1600->6400', 'dora-kernel', EXACT_BWD):.0f} and "
        f"{k_us('6400->1600', 'dora-kernel', EXACT_BWD):.0f} µs"))]


def _flat(path: str) -> str:
    return " ".join((ROOT / path).read_text(encoding="utf-8").split())


@pytest.mark.parametrize("path,claim", CLAIMS, ids=[f"{p}:{i}" for i, (p, _) in enumerate(CLAIMS)])
def test_a_quoted_number_is_what_the_committed_rows_give(path, claim):
    text = claim()
    assert text in _flat(path), f"{path} should say: {text!r}"


def test_the_claims_are_about_numbers():
    """Each claim quotes at least one number (a claim of words alone would tie nothing)."""
    assert all(re.search(r"\d", claim()) for _, claim in CLAIMS)
