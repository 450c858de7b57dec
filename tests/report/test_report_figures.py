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
from paths import FIXTURES

pytest.importorskip("matplotlib")

STUDY = FIXTURES / "study"
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


def _one_size(tmp_path: Path, **columns) -> Path:
    folder = tmp_path / "one-size"
    folder.mkdir()
    rows = pd.read_csv(STUDY / "runs.csv", dtype=str, keep_default_na=False)
    rows[rows["cfg_model_size"] == "124M"].assign(**columns).to_csv(folder / "runs.csv", index=False)
    return folder


def test_plot_of_a_single_size_writes_the_figure_that_applies(tmp_path, run_cli):
    png = tmp_path / "fig.png"
    code, out = run_cli("report", _one_size(tmp_path), "--plot", png)
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the phase figure, at the file asked for
    assert not (tmp_path / "fig-phases.png").exists()
    assert "no crossover figure" in out and "two model sizes" in out and f"wrote {png}" in out


def test_plot_where_no_figure_applies_is_a_usage_error(tmp_path, run_cli):
    untimed = {c: "" for c in pd.read_csv(STUDY / "runs.csv", nrows=0).columns if c.endswith("_ms_median")}
    code, out = run_cli("report", _one_size(tmp_path, **untimed), "--plot", tmp_path / "fig.png")
    assert code == 2 and "no figure applies" in out and "Traceback" not in out
    assert not (tmp_path / "fig.png").exists()


def test_figures_never_share_a_file_with_each_other_or_the_report(tmp_path, run_cli):
    png = tmp_path / "a.png"
    code, out = run_cli("report", STUDY, "--plot", png)
    assert code == 0 and png.is_file() and (tmp_path / "a-phases.png").is_file()
    assert png.read_bytes() != (tmp_path / "a-phases.png").read_bytes()
    code, out = run_cli("report", STUDY, "--plot", tmp_path / "b.png", "--output", tmp_path / "b.png")
    assert code == 2 and "would overwrite the report" in out and not (tmp_path / "b.png").exists()


def test_figures_state_the_statistic_they_draw():
    study = build_study(load_results([STUDY]))
    (ax,) = crossover_figure(study).axes
    assert "order-statistic interval" in ax.get_ylabel() and "median" in ax.get_ylabel()
    phases = phase_figure(study)
    first = next(a for a in phases.axes if a.get_visible())
    assert "median step [order-statistic interval]" in first.get_xlabel()
    # each bar's number is the group's median step with its interval: the tables' step ms, not a sum of phases
    g = next(g for g in study.groups if g.size == "124M" and g.variant == "all" and g.mode == "eager fp32")
    assert any(t.get_text().strip().startswith(f"{g.step.median:.1f} [") for t in first.texts)


def test_plot_of_one_run_without_a_baseline_writes_the_phase_figure(tmp_path, run_cli):
    folder = tmp_path / "one-run"
    folder.mkdir()
    rows = pd.read_csv(STUDY / "runs.csv", dtype=str, keep_default_na=False)
    rows[rows["cfg_model_size"] == "124M"].head(1).to_csv(folder / "runs.csv", index=False)
    png = tmp_path / "fig.png"
    code, out = run_cli("report", folder, "--plot", png)
    assert code == 0, out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "no baseline to divide by" in out


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf"])
def test_a_figure_file_is_the_same_from_one_drawing_to_the_next(tmp_path, suffix):
    """No date, software version or random id inside: the same runs give the same bytes."""
    study = build_study(load_results([STUDY]))
    a, b = save(crossover_figure(study), tmp_path / f"a{suffix}"), save(crossover_figure(study), tmp_path / f"b{suffix}")
    assert a.read_bytes() == b.read_bytes()
    assert b"Matplotlib" not in a.read_bytes() and b"matplotlib.org" not in a.read_bytes()


def test_the_content_digest_follows_what_is_drawn():
    from lora_bench.report.figures import content_digest

    study = build_study(load_results([STUDY]))
    fig = crossover_figure(study)
    digest = content_digest(fig)
    assert digest == content_digest(crossover_figure(study))
    fig.axes[0].set_title("another title")
    assert content_digest(fig) != digest
    other = crossover_figure(study)
    line = other.axes[0].containers[0].lines[0]
    line.set_ydata([y * 1.01 for y in line.get_ydata()])
    assert content_digest(other) != digest
