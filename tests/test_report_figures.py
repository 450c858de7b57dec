"""lora_bench.report.figures: the crossover figure (one line per variant and mode, a point per size,
log size axis labelled 124M…, error bars, the labelled 1.0 line, the device in the title, the
legend outside the panels, no panel with a single point) and the phase figure (device and host
bars per variant); --baseline changes the figure."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from lora_bench.report.figures import crossover_figure, phase_figure, save
from lora_bench.report.load import load_results
from lora_bench.report.study import build_study

pytest.importorskip("matplotlib")

STUDY = Path(__file__).parent / "fixtures" / "study"
GRAPHS = "CUDA graphs + bf16 + SDPA + fused ops + fused AdamW"


def _lines(fig) -> dict[str, list]:
    """label -> the errorbar container of each line drawn."""
    return {c.get_label(): c for ax in fig.axes for c in ax.containers}


def test_crossover_lines_points_axis_and_labels():
    fig = crossover_figure(build_study(load_results([STUDY])))
    (ax,) = fig.axes  # one condition: one panel
    lines = _lines(fig)
    assert set(lines) == {"lora · eager fp32", "lora-kernel · eager fp32", f"lora · {GRAPHS}", f"lora-kernel · {GRAPHS}"}
    for c in lines.values():
        x, _ = c.lines[0].get_data()
        assert len(x) == 2  # 124M and 1558M
    eager = lines["lora · eager fp32"].lines[0].get_ydata()
    assert eager[0] == pytest.approx(1.545, abs=0.01) and eager[1] == pytest.approx(0.838, abs=0.01)
    assert len(lines["lora · eager fp32"].lines[2]) == 1  # error bars: two repeats per group
    assert ax.get_xscale() == "log" and [t.get_text() for t in ax.get_xticklabels()] == ["124M", "1558M"]
    assert any(list(ln.get_ydata()) == [1.0, 1.0] for ln in ax.get_lines())
    assert any(t.get_text() == "1.0 = as fast as all" for t in ax.texts)
    assert "NVIDIA H200" in fig._suptitle.get_text()
    fig.canvas.draw()
    (legend,) = fig.legends
    box = legend.get_window_extent()
    assert not box.overlaps(ax.get_window_extent())  # the legend sits outside the data


def test_baseline_changes_the_figure():
    df = load_results([STUDY])
    default = _lines(crossover_figure(build_study(df)))
    against_lora = crossover_figure(build_study(df, baseline="trainable_layers=lora"))
    other = _lines(against_lora)
    assert set(other) == {"all · eager fp32", "lora-kernel · eager fp32", f"all · {GRAPHS}", f"lora-kernel · {GRAPHS}"}
    assert other["all · eager fp32"].lines[0].get_ydata()[0] == pytest.approx(1 / default["lora · eager fp32"].lines[0].get_ydata()[0], rel=1e-6)
    assert "trainable_layers=lora" in against_lora._suptitle.get_text()


def test_baseline_changes_the_png(tmp_path, run_cli):
    save(crossover_figure(build_study(load_results([STUDY]))), tmp_path / "default.png")
    code, _ = run_cli("report", STUDY, "--plot", tmp_path / "lora.png", "--baseline", "trainable_layers=lora")
    assert code == 0
    assert (tmp_path / "default.png").read_bytes()[:8] == (tmp_path / "lora.png").read_bytes()[:8]  # both PNG
    assert (tmp_path / "default.png").read_bytes() != (tmp_path / "lora.png").read_bytes()


def test_no_panel_with_a_single_point(tmp_path):
    df = load_results([STUDY])
    one_size = df[df["cfg_model_size"] == "124M"]
    assert crossover_figure(build_study(one_size)) is None  # a single size: no crossover to draw
    # a second condition measured at one size only: one panel, the condition in the line labels
    extra = df[(df["cfg_model_size"] == "124M") & (df["cfg_profile"] == "none")].assign(
        cfg_batch_size="32", run_id=lambda d: d["run_id"] + "-b32")
    fig = crossover_figure(build_study(pd.concat([df, extra], ignore_index=True)))
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 1
    assert "lora · eager fp32 · batch 32" in _lines(fig)


def test_phase_figure_has_device_and_host_bars_per_variant():
    fig = phase_figure(build_study(load_results([STUDY])))
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 4  # 2 modes × (smallest, largest size)
    titles = [ax.get_title() for ax in axes]
    assert titles[0] == "eager fp32 · 124M" and titles[-1] == f"{GRAPHS} · 1558M"
    labels = [t.get_text() for t in axes[0].get_yticklabels()]
    assert labels == ["all · device", "all · host", "lora · device", "lora · host", "lora-kernel · device",
                      "lora-kernel · host"]
    assert len(axes[0].patches) == 6 * 4  # a segment per phase on every bar
    assert "NVIDIA H200" in fig._suptitle.get_text()
