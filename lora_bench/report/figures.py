"""Report figures with matplotlib's Agg backend (files only: works on headless GPU hosts):

- the crossover: step time relative to the baseline against model size (log axis labelled with
  the sizes), one line per variant and execution mode, error bars the ratio's interval, the
  1.0 line labelled, one panel per condition (e.g. batch size) when each panel has two sizes or more;
- the phases: per execution mode, at the smallest and largest size, device and host time of each
  phase for every variant, side by side (host ≈ device time holds for a GPU-bound phase too, so the
  figure names no cause: the tables give each phase's GPU busy fraction from a profiled repeat);
  each bar ends at the group's median step (the number beside it, with its interval, the
  same statistic as the tables' step ms), its segments the phases' medians.

Titles and axis labels name the statistic drawn and the device; legends sit outside the data; a
note under a figure says where an interval is over the steps of one run (†)."""

from __future__ import annotations

import base64
import hashlib
import io
import math
from pathlib import Path

from lora_bench.fileio import atomic_write_bytes
from lora_bench.report.stats import STEPS_MARK, STEPS_NOTE, span_text
from lora_bench.report.study_model import Group, Study

PHASE_COLOURS = {"data": "#9e9e9e", "forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868"}
MODE_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
VARIANT_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))
MAX_MODES = 3  # rows of the phase figure
# data last: a host's data phase holds its wait for the GPU (the next batch's copy queues behind the
# previous step), so the phases the GPU runs line up on the device and host bars
BAR_ORDER = ("forward", "backward", "optimizer", "data")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def why_no_crossover(study: Study) -> str:
    """Why crossover_figure draws nothing, in a clause ('' when it draws)."""
    if not study.baseline:
        return "no baseline to divide by (the runs hold one trainable-layer choice; pick one with --baseline)"
    if len(study.sizes) < 2:
        return f"the crossover needs two model sizes or more, and these runs have one ({', '.join(study.sizes)})"
    if not any(not math.isnan(g.ratio) for ln in study.lines for g in ln.groups):
        return "no group has a baseline group of the same size, mode and condition"
    if not _placed(study.lines):
        return "the runs record no parameter count (total_params) to place the model sizes on the axis"
    return ""


def _placed(lines) -> list:
    """The lines with a ratio at a size whose parameter count is known (the figure's x axis)."""
    return [ln for ln in lines if any(not math.isnan(g.ratio) and not math.isnan(g.params) for g in ln.groups)]


def crossover_figure(study: Study):
    """The Figure, or None when there is nothing to draw (no baseline, or a single model size)."""
    lines = _placed(study.lines)
    if not lines or len(study.sizes) < 2:
        return None
    conditions = list(dict.fromkeys(ln.condition for ln in lines))
    panels = conditions if all(_n_sizes(study, c) >= 2 for c in conditions) else [None]
    plt = _pyplot()
    cols = min(len(panels), 2)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.6 * rows + 1.4), sharey=True, squeeze=False)
    modes = list(dict.fromkeys(ln.mode for ln in study.lines))
    variants = list(dict.fromkeys(ln.variant for ln in study.lines))
    handles = {}
    base = study.baseline_name
    for ax, cond in zip(axes.flat, panels):
        mine = [ln for ln in lines if cond is None or ln.condition == cond]
        for ln in mine:
            gs = [g for g in ln.groups if not math.isnan(g.ratio) and not math.isnan(g.params)]
            colour = MODE_COLOURS[modes.index(ln.mode) % len(MODE_COLOURS)]
            style, marker = VARIANT_STYLES[variants.index(ln.variant) % len(VARIANT_STYLES)]
            label = ln.label + (f" · {ln.condition}" if cond is None and ln.condition else "")
            known = [g.ratio_estimate.has_interval for g in gs]
            yerr = [[g.ratio - g.ratio_lo if k else 0 for g, k in zip(gs, known)],
                    [g.ratio_hi - g.ratio if k else 0 for g, k in zip(gs, known)]]
            hollow = cond is None and conditions.index(ln.condition) % 2 == 1  # one panel: conditions by fill
            h = ax.errorbar([g.params for g in gs], [g.ratio for g in gs], yerr=yerr, color=colour, ls=style,
                            marker=marker, capsize=3, lw=1.2 if hollow else 1.6, ms=7 if hollow else 6,
                            mfc="white" if hollow else colour, label=label)
            handles[label] = h
            for g in gs:
                if g.ratio_estimate.per_step:
                    ax.annotate(STEPS_MARK, xy=(g.params, g.ratio_hi), xytext=(3, 0), textcoords="offset points",
                                fontsize=9, color=colour)
        _size_axis(ax, study)
        ax.axhline(1.0, color="black", lw=0.9, ls="--", zorder=0)
        ax.annotate(f"1.0 = as fast as {base}", xy=(1.0, 1.0), xycoords=("axes fraction", "data"),
                    xytext=(-4, 4), textcoords="offset points", ha="right", va="bottom", fontsize=8)
        tokens = _tokens(study, cond)
        ax.set_title(" · ".join(p for p in (cond, tokens) if p) or "conditions as in the legend", fontsize=10)
        ax.set_xlabel("model size (parameters, log scale)")
        ax.grid(True, axis="y", alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel(f"median step / {base}'s\n(medians of repeats' median step; bars: order-statistic interval)")
    fig.suptitle(f"{_on(study)}step time relative to {study.baseline_text} by model size\n"
                 f"below 1.0: faster than {base}", fontsize=11)
    ncol = cols if max(len(k) for k in handles) > 45 else cols + 1  # long labels: one column per panel
    ncol = min(ncol, len(handles))
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    legend_in = 0.19 * math.ceil(len(handles) / ncol) + 0.25
    drawn = [g for ln in lines for g in ln.groups if not math.isnan(g.ratio)]
    if any(g.ratio_estimate.per_step for g in drawn):
        legend_in += 0.2
        fig.text(0.01, 0.005, f"{STEPS_MARK} {STEPS_NOTE}", fontsize=7, ha="left", va="bottom")
    fig.set_figheight(fig.get_figheight() + legend_in - 1.4 if legend_in > 1.4 else fig.get_figheight())
    fig.tight_layout(rect=(0, legend_in / fig.get_figheight(), 1, 1))
    return fig


def _on(study: Study) -> str:
    """'NVIDIA H200: ' to open a title; nothing where the runs did not record their device."""
    return f"{study.device}: " if study.header.gpus or study.header.devices else ""


def _n_sizes(study: Study, cond: str) -> int:
    return len({g.size for ln in study.lines if ln.condition == cond for g in ln.groups if not math.isnan(g.ratio)})


def _tokens(study: Study, cond: str | None) -> str:
    if cond is None:
        return ""
    t = {g.tokens_per_step for g in study.groups if g.condition == cond and not math.isnan(g.tokens_per_step)}
    return f"{int(next(iter(t))):,} tokens per step" if len(t) == 1 else ""


def _size_axis(ax, study: Study) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator

    ticks = {}
    for g in study.groups:
        if not math.isnan(g.params):
            ticks[g.size] = g.params
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(list(ticks.values())))
    ax.set_xticklabels(list(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    lo, hi = min(ticks.values()), max(ticks.values())
    ax.set_xlim(lo / 1.35, hi * 1.35)


def phase_figure(study: Study):
    """Device and host ms per phase for every variant, at the smallest and largest size of up to
    MAX_MODES execution modes (the first condition); None when no phase was timed."""
    if not study.groups:
        return None
    cond = study.conditions()[0]
    modes = [m for m in study.modes() if any(g.phases["forward"].device.known for g in study.groups
                                              if g.mode == m and g.condition == cond)][:MAX_MODES]
    if not modes:
        return None
    sizes = list(dict.fromkeys([study.sizes[0], study.sizes[-1]]))
    plt = _pyplot()
    n_var = len({g.variant for g in study.groups})
    fig, axes = plt.subplots(len(modes), len(sizes), figsize=(6.6 * len(sizes), (0.62 * n_var + 1.5) * len(modes) + 1.2),
                             squeeze=False)
    for r, mode in enumerate(modes):
        for c, size in enumerate(sizes):
            gs = [g for g in study.groups if g.mode == mode and g.condition == cond and g.size == size]
            _phase_panel(axes[r][c], gs, title=" · ".join(p for p in (mode, size) if p))
    two = any(g.two_clocks for g in study.groups if g.mode in modes and g.condition == cond)
    handles = [plt.Rectangle((0, 0), 1, 1, color=PHASE_COLOURS[p]) for p in BAR_ORDER]
    names = list(BAR_ORDER)
    if two:
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch="//"))
        names = [*BAR_ORDER[:-1], "data (on the host: incl. waiting for the GPU)", "hatched: host time"]
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8, frameon=False)
    title = (f"{_on(study)}where a step's time goes{', device vs host' if two else ''}"
             f"{' (' + cond + ')' if cond else ''}: medians over repeats of each run's median ms")
    if two:
        title += ("\nhost time includes waiting for the GPU: host ≈ device does not say which side waits "
                  "(the tables give the GPU's busy fraction, measured in a profiled repeat)")
    fig.suptitle(title, fontsize=11)
    drawn = [g for g in study.groups if g.mode in modes and g.condition == cond and g.size in sizes]
    if any(g.step.per_step for g in drawn):
        fig.text(0.01, 0.005, f"{STEPS_MARK} {STEPS_NOTE}", fontsize=7, ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def _phase_panel(ax, groups: list[Group], *, title: str) -> None:
    """Per group and clock a bar of the phases' medians, and the group's median step (which the
    phase medians need not add up to: phase_sum_pct) as a black mark with its interval and
    its number beside it: the same statistic as the tables' step ms."""
    names, y = [], 0.0
    ticks = []
    for g in groups:
        for clock in ("device", "host") if g.two_clocks else ("device",):
            step = g.step if clock == "device" else g.host_step
            left = 0.0
            for ph in BAR_ORDER:
                s = getattr(g.phases[ph], clock)
                v = 0.0 if not s.known else s.median
                ax.barh(y, v, left=left, height=0.8, color=PHASE_COLOURS[ph], alpha=1.0 if clock == "device" else 0.55,
                        hatch="//" if clock == "host" else None, edgecolor="white" if clock == "device" else "black",
                        linewidth=0.4)
                left += v
            end = left
            if step.known:
                err = [[step.median - step.lo], [step.hi - step.median]] if step.has_interval else None
                ax.errorbar([step.median], [y], xerr=err, fmt="|", color="black", ms=12, elinewidth=0.9, capsize=2)
                end = max(left, step.hi if step.has_interval else step.median)
                label = f"{step.median:.1f} {span_text(step, digits=1)}"
            else:
                label = f"Σ {left:.1f}"
            ax.text(end, y, f" {label}", va="center", fontsize=7)
            ticks.append(y)
            names.append(f"{g.variant} · {clock}" if g.two_clocks else g.variant)
            y += 1
        y += 0.5
    ax.set_yticks(ticks, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step: segments = phase medians; black mark = median step [order-statistic interval]")
    ax.set_title(title, fontsize=9)
    ax.margins(x=0.25)


# PNG text chunk naming what a figure draws (see content_digest); a figure file holds nothing else
# that depends on the machine: no matplotlib version, no creation date.
CONTENT_KEY = "lora-bench figure content"
DPI = 110


def content_digest(fig) -> str:
    """A digest of what ``fig`` draws, independent of how it is rasterised: every text string, and
    every line's, bar's and error bar's data coordinates (6 significant digits). Two renderings of
    the same runs by other matplotlib or FreeType versions share it; a figure of other numbers or
    labels does not."""
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle
    from matplotlib.text import Text

    def num(v) -> str:
        return f"{float(v):.6g}"

    parts = []
    for obj in fig.findobj():
        if isinstance(obj, Text) and obj.get_visible() and obj.get_text():
            parts.append("t:" + obj.get_text())
        elif isinstance(obj, Line2D) and obj.axes is not None:
            parts.append("l:" + ",".join(num(v) for v in obj.get_xydata().ravel()))
        elif isinstance(obj, Rectangle) and obj.axes is not None and obj is not obj.axes.patch:
            parts.append("r:" + ",".join(num(v) for v in (obj.get_x(), obj.get_y(), obj.get_width(), obj.get_height())))
        elif isinstance(obj, LineCollection) and obj.axes is not None:
            parts.append("c:" + ";".join(",".join(num(v) for v in seg.ravel()) for seg in obj.get_segments()))
    return "sha256:" + hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()


def _metadata(fig, fmt: str) -> dict:
    """Metadata that keeps the file the same on every machine: no software version or date, and
    for PNG the content digest."""
    if fmt == "png":
        return {"Software": None, CONTENT_KEY: content_digest(fig)}
    if fmt == "pdf":
        return {"Creator": None, "Producer": None, "CreationDate": None}
    if fmt == "svg":
        return {"Creator": None, "Date": None}
    return {}


def _savefig(fig, target, fmt: str) -> None:
    import matplotlib

    with matplotlib.rc_context({"svg.hashsalt": "lora-bench"}):  # SVG ids from a fixed salt, not a random one
        fig.savefig(target, format=fmt, dpi=DPI, metadata=_metadata(fig, fmt))


def save(fig, path: Path) -> Path:
    """Write ``fig`` (format by the file's suffix); the figure stays open for another format."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    _savefig(fig, buf, path.suffix.lower().lstrip("."))
    atomic_write_bytes(path, buf.getvalue())  # a reader never sees half a figure
    return path


def png_base64(fig) -> str:
    buf = io.BytesIO()
    _savefig(fig, buf, "png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def close(fig) -> None:
    _pyplot().close(fig)
