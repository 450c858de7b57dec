"""lora_bench.report.kernel_classes and floor_kernels: kernels sorted into classes by name, and each
profiled LoRA group's kernel time per phase and class set against the profiled floor's, from run
folders holding kernels_by_phase.csv and top_kernels.csv as the profiler writes them; a group
without a profile (or whose floor has none) reads "not measured"; kernel names reach Markdown and
HTML as text."""

from __future__ import annotations

import io
import re

import pandas as pd
import pytest
from rich.console import Console

from lora_bench.report.document import build_document
from lora_bench.report.floor_kernels import floor_rows, floor_tables
from lora_bench.report.kernel_classes import OTHER, UNNAMED, class_times, kernel_class
from lora_bench.report.load import load_results
from lora_bench.report.render_html import to_html
from lora_bench.report.render_markdown import to_markdown
from lora_bench.report.render_terminal import print_document
from lora_bench.report.study import build_study
from lora_bench.results.runs_csv import write_csv
from lora_bench.timing import PHASES

GRAPHS = "CUDA graphs + bf16 + SDPA + fused ops + fused AdamW"
EAGER = "eager bf16 + SDPA + fused ops + fused AdamW"
HOSTILE = "void cutlass::gemm<float, 1 | 2>(<script>alert(1)</script>)"
# the columns lora_bench.train.profiling.kernel_summary writes, in its order
PHASE_COLUMNS = ["phase", "launches_per_step", "kernel_ms_per_step", "unit"]
TOP_COLUMNS = ["phase", "kernel", "calls_per_step", "ms_per_step"]


@pytest.mark.parametrize("name, cls", [
    ("_lora_mm_kernel", "LoRA Triton kernels"),
    ("_lora_grad_ab_kernel", "LoRA Triton kernels"),
    ("nvjet_sm90_tst_8x64_64x16_2x4_h_bz_TNN", "GEMMs (cuBLAS, CUTLASS)"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "GEMMs (cuBLAS, CUTLASS)"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention (SDPA)"),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*)", "attention (SDPA)"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(at::Tensor"
     "IteratorBase&)::{lambda(float)#1}>", "casts, copies"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(int)",
     "norms, softmax, reductions, loss"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other elementwise"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<3>, "
     "PointwiseOpScalarFunctor<float, 3, 3, 0>>", "optimizer"),
    ("_packed_adamw_kernel", "optimizer"),
    ("Memcpy HtoD (Pageable -> Device)", "memcpy, memset"),
    ("Memset (Device)", "memcpy, memset"),
    ("triton_poi_fused_add_0", "Triton kernels of torch.compile"),
    ("my_custom_kernel", OTHER),
])
def test_kernels_are_classed_by_the_first_pattern_their_name_matches(name, cls):
    assert kernel_class(name) == cls


def _run(run_id: str, *, layers: str, step: float, graphs: bool, profile: str = "none", grads: str = "inline",
         started: str = "2026-01-01T00:00:00+00:00") -> dict:
    """One finished 124M run in the fastest mode; phases 0/45/45/10 % of the step."""
    row = {"run_id": run_id, "status": "done", "started_at": started, "cfg_model_size": "124M",
           "cfg_trainable_layers": layers, "cfg_batch_size": "8", "cfg_lora_rank": "16", "cfg_profile": profile,
           "cfg_precision": "bf16", "cfg_attention": "sdpa", "cfg_ops": "fused", "cfg_optimizer": "fused",
           "cfg_cuda_graphs": str(graphs), "cfg_adapter_grads": grads, "cfg_skip_final_eval": "True",
           "step_ms_median": step, "tokens_per_step": 960.0, "gpu_name": "NVIDIA H200"}
    for ph, share in zip(PHASES, (0.0, 0.45, 0.45, 0.1)):
        row[f"{ph}_ms_median"] = share * step
        row[f"host_{ph}_ms_median"] = 0.1 * share * step
    return row


def _profile(folder, run_id: str, top: list[tuple[str, str, float, float]],
             totals: dict[str, tuple[float, float]]) -> None:
    """A profiled run's two summaries, written by the project's CSV writer as the profiler writes them."""
    d = folder / run_id
    d.mkdir()
    write_csv(d / "kernels_by_phase.csv", [{"phase": ph, "launches_per_step": n, "kernel_ms_per_step": ms,
                                            "unit": "cuda kernels+memcpy"} for ph, (n, ms) in totals.items()],
              PHASE_COLUMNS)
    write_csv(d / "top_kernels.csv", [{"phase": ph, "kernel": k, "calls_per_step": n, "ms_per_step": ms}
                                      for ph, k, n, ms in top], TOP_COLUMNS)


FLOOR_TOP = [("forward", "nvjet_sm90_tst_fwd", 48.0, 0.6), ("forward", "vectorized_layer_norm_kernel", 25.0, 0.1),
             ("backward", "nvjet_sm90_tst_bwd", 48.0, 0.8), ("optimizer", "multi_tensor_apply_kernel", 4.0, 0.05)]
FLOOR_TOTALS = {"forward": (80.0, 0.75), "backward": (60.0, 0.9), "optimizer": (4.0, 0.05)}
ROW_TOP = [("forward", "_lora_mm_kernel", 48.0, 0.9), ("forward", "vectorized_layer_norm_kernel", 25.0, 0.1),
           ("forward", "bfloat16_copy_kernel_cuda", 72.0, 0.2), ("backward", "_lora_mm_kernel", 48.0, 1.0),
           ("backward", "_lora_grad_ab_kernel", 48.0, 0.3), ("backward", HOSTILE, 2.0, 0.01),
           ("optimizer", "multi_tensor_apply_kernel", 8.0, 0.1)]
ROW_TOTALS = {"forward": (150.0, 1.25), "backward": (100.0, 1.31), "optimizer": (8.0, 0.1)}


def _folder(tmp_path, *, floor_profile: bool = True, row_profile: bool = True) -> pd.DataFrame:
    rows = [_run("floor", layers="frozen", step=2.0, graphs=True),
            _run("kernel", layers="lora-kernel", step=3.0, graphs=True, grads="deferred"),
            _run("lora", layers="lora", step=6.0, graphs=True)]
    # a graphed group's profile has its settings, cuda_graphs too: its steps ran one by one with the
    # plans a capture chooses (lora_bench.train.profiling)
    if floor_profile:
        rows.append(_run("floor-prof", layers="frozen", step=4.0, graphs=True, profile="kernels"))
        _profile(tmp_path, "floor-prof", FLOOR_TOP, FLOOR_TOTALS)
    if row_profile:
        rows.append(_run("kernel-prof", layers="lora-kernel", step=5.0, graphs=True, profile="kernels",
                         grads="deferred"))
        _profile(tmp_path, "kernel-prof", ROW_TOP, ROW_TOTALS)
        # the same variant with its adapter gradients inline: another step, never this group's profile
        rows.append(_run("inline-prof", layers="lora-kernel", step=5.0, graphs=True, profile="kernels",
                         started="2026-01-02T00:00:00+00:00"))
        _profile(tmp_path, "inline-prof", [("forward", "_lora_mm_kernel", 1.0, 99.0)], {"forward": (1.0, 99.0)})
        # an eager step's profile (its layers choose the eager plans): never a graphed group's, however new
        rows.append(_run("eager-prof", layers="lora-kernel", step=5.0, graphs=False, profile="kernels",
                         grads="deferred", started="2026-01-03T00:00:00+00:00"))
        _profile(tmp_path, "eager-prof", [("forward", "direct_gemm", 1.0, 99.0)], {"forward": (1.0, 99.0)})
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    return load_results([tmp_path])


def _study(tmp_path, **kw):
    return build_study(_folder(tmp_path, **kw), baseline="trainable_layers=frozen")


def test_class_times_hold_a_phases_kernels_beyond_the_named_ones_as_unnamed(tmp_path):
    _folder(tmp_path)
    kp = class_times("floor-prof", tmp_path / "floor-prof")
    assert kp.totals == {"forward": (80.0, 0.75), "backward": (60.0, 0.9), "optimizer": (4.0, 0.05)}
    fwd = kp.classes["forward"]
    assert list(fwd) == ["GEMMs (cuBLAS, CUTLASS)", "norms, softmax, reductions, loss", UNNAMED]
    assert fwd[UNNAMED].launches == pytest.approx(7.0) and fwd[UNNAMED].ms == pytest.approx(0.05)
    assert UNNAMED not in kp.classes["optimizer"]  # every kernel of the phase is named
    assert class_times("floor", tmp_path / "floor") is None  # a timed run wrote no profile


def test_each_profiled_group_is_set_against_the_profiled_floor_class_by_class(tmp_path):
    study = _study(tmp_path)
    rows = {r.group.variant: r for r in floor_rows(study, study.profiled)}
    assert set(rows) == {"lora-kernel", "lora"}
    kr = rows["lora-kernel"]
    assert kr.measured and kr.row_profile.run_id == "kernel-prof" and kr.floor_profile.run_id == "floor-prof"
    assert not rows["lora"].measured and rows["lora"].why_not == "not measured: no profiled repeat of this group"

    summary, details = floor_tables(study)
    by_variant = {r[1]: r for r in summary.rows}
    k = by_variant["lora-kernel"]
    assert k[:4] == ["124M", "lora-kernel", GRAPHS, "kernel-prof · floor-prof"]
    # kernel ms above the floor: (1.25 + 1.31 + 0.1) - (0.75 + 0.9 + 0.05); launches (150+100+8) - (80+60+4)
    # µs per adapted layer: (3.0 - 2.0) ms over 124M's 73 adapted layers, one run a side: no interval
    # gaps: (3.0 - 2.66) - (2.0 - 1.70)
    assert k[5:] == ["+1.00", "13.7 (no interval, n = 1)", "+0.96", "+0.04", "+114"]
    # the largest class differences: LoRA Triton +2.20, GEMMs -1.39 (the hostile name is a GEMM's), casts +0.20
    assert k[4] == "LoRA Triton kernels +2.20; GEMMs (cuBLAS, CUTLASS) -1.39; casts, copies +0.20"
    lora = by_variant["lora"]
    assert lora[3] == "not measured: no profiled repeat of this group" and lora[5] == "+4.00"  # timed: still shown
    assert lora[6] == "54.8 (no interval, n = 1)"  # 4.0 ms over 73 layers: timed, still shown
    assert lora[4] == lora[7] == lora[8] == lora[9] == "not measured"

    [table] = details
    cells = {(r[0], r[1]): r for r in table.rows}
    assert cells[("backward", "LoRA Triton kernels")][3:] == ["0.000", "1.300", "+1.300", "0", "96", "+96"]
    assert cells[("backward", "LoRA Triton kernels")][2] == "_lora_mm_kernel"  # the longest of the class
    assert cells[("backward", "GEMMs (cuBLAS, CUTLASS)")][3:6] == ["0.800", "0.010", "-0.790"]
    assert cells[("forward", "all kernels")][3:6] == ["0.750", "1.250", "+0.500"]
    # forward device time: 45 % of each timed step; the gap is it less the phase's kernels
    assert cells[("forward", "device time (timed)")][3:6] == ["0.900", "1.350", "+0.450"]
    assert cells[("forward", "gap (device time less kernels)")][3:6] == ["0.150", "0.100", "-0.050"]
    assert [table.rows[i][0] for i in table.groups] == ["forward", "backward", "optimizer"]


def test_a_group_whose_floor_has_no_profile_is_not_measured(tmp_path):
    study = _study(tmp_path, floor_profile=False)
    summary, details = floor_tables(study)
    assert details == []
    assert {r[3] for r in summary.rows} == {"not measured: no profiled repeat of its floor",
                                            "not measured: no profiled repeat of this group"}


def test_no_section_without_a_profile_and_the_report_is_unchanged(tmp_path):
    study = _study(tmp_path, floor_profile=False, row_profile=False)
    assert floor_tables(study) is None
    titles = [s.title for s in build_document(study, None, figures=set()).sections]
    assert not any("above the floor" in t for t in titles)


def test_kernel_names_reach_markdown_and_html_as_text(tmp_path):
    doc = build_document(_study(tmp_path), None, figures=set())
    titles = [s.title for s in doc.sections]
    assert "Device time above the floor" in titles and "Kernel classes above the floor, by phase" in titles
    md = to_markdown(doc)
    [line] = [ln for ln in md.splitlines() if "cutlass::gemm" in ln]
    assert "<script>" not in line and "&lt;script&gt;" in line
    assert len(re.findall(r"(?<!\\)\|", line)) == 10  # 9 cells: the name's | is escaped, not a cell's end
    assert "not measured" in md and "by name alone" in md
    html = to_html(doc)
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_a_folder_of_profiled_runs_alone_sets_them_against_each_other(tmp_path):
    """Without timed repeats the profiled runs are the groups (their times perturbed by the profiler):
    each LoRA run is its own profiled repeat, the floor's run the floor's."""
    rows = [_run("floor-prof", layers="frozen", step=4.0, graphs=False, profile="kernels"),
            _run("kernel-prof", layers="lora-kernel", step=5.0, graphs=False, profile="kernels", grads="deferred")]
    _profile(tmp_path, "floor-prof", FLOOR_TOP, FLOOR_TOTALS)
    _profile(tmp_path, "kernel-prof", ROW_TOP, ROW_TOTALS)
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    summary, [table] = floor_tables(build_study(load_results([tmp_path])))
    [row] = summary.rows
    assert row[2] == EAGER and row[3] == "kernel-prof · floor-prof"
    assert row[5:8] == ["+1.00", "13.7 (no interval, n = 1)", "+0.96"]
    assert table.rows[0][:2] == ["forward", "LoRA Triton kernels"]


def test_the_terminal_shows_the_summary(tmp_path):
    console = Console(file=io.StringIO(), width=400, color_system=None)
    print_document(build_document(_study(tmp_path), None, figures=set()), console)
    out = console.file.getvalue()
    assert "Device time above the floor" in out and "kernel-prof · floor-prof" in out
    assert "cutlass::gemm" not in out  # the tables by phase are for files
