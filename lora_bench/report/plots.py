"""Report figures, drawn from results only with matplotlib's Agg backend (no display needed): the
phase breakdown as stacked bars per configuration, and scaling — median step time and the ratio
against the baseline (default: trainable_layers=all) — against model size and tokens per step."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from lora_bench.report.aggregate import PHASE_METRICS, Report, label, matches, order_key
from lora_bench.results.schema import SETTING_PREFIX

SIZE_KEYS = tuple(SETTING_PREFIX + k for k in ("model_size", "emb_dim", "n_layers", "n_heads"))
SERIES = SETTING_PREFIX + "trainable_layers"


def plot_report(rep: Report, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: works on headless GPU hosts
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(16, max(8.0, 0.35 * len(rep.groups) + 3)))
    grid = fig.add_gridspec(2, 3)
    _phases(fig.add_subplot(grid[:, 0]), rep)
    pts = _points(rep)
    base = _baseline_spec(rep)
    # one colour per series in every panel (the baseline keeps its colour though absent from ratios)
    palette = plt.get_cmap("tab10").colors
    colors = {s: palette[i % len(palette)] for i, s in enumerate(sorted(pts["series"].unique(), key=order_key))}
    _scaling(fig.add_subplot(grid[0, 1]), pts, x="size_x", y="step", line_by="tokens",
             title="median step time vs model size", xlabel="parameters of the base model", colors=colors)
    _scaling(fig.add_subplot(grid[0, 2]), pts[~pts["is_base"]], x="size_x", y="ratio", line_by="tokens",
             title=f"ratio to {_spec_text(base)} vs model size", xlabel="parameters of the base model", colors=colors)
    _scaling(fig.add_subplot(grid[1, 1]), pts, x="tokens", y="step", line_by="size",
             title="median step time vs tokens per step", xlabel="tokens per step", colors=colors)
    _scaling(fig.add_subplot(grid[1, 2]), pts[~pts["is_base"]], x="tokens", y="ratio", line_by="size",
             title=f"ratio to {_spec_text(base)} vs tokens per step", xlabel="tokens per step", colors=colors)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _phases(ax, rep: Report) -> None:
    """One horizontal stacked bar per configuration, in the report's order."""
    names, parts = [], {m: [] for m in PHASE_METRICS}
    for rec in rep.groups.to_dict("records"):
        rows = rep.done[matches(rep.done, {k: rec[k] for k in rep.keys})]
        names.append(", ".join(str(rec[k]) for k in rep.keys))
        for m in PHASE_METRICS:
            v = pd.to_numeric(rows[m], errors="coerce").median() if m in rows else math.nan
            parts[m].append(0.0 if pd.isna(v) else float(v))
    if not names or not any(any(v) for v in parts.values()):
        _empty(ax, "phase breakdown: no phase timings in these results")
        return
    left = [0.0] * len(names)
    for m in PHASE_METRICS:
        ax.barh(range(len(names)), parts[m], left=left, label=label(m).removesuffix(" ms"))
        left = [a + b for a, b in zip(left, parts[m])]
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median ms per step (over repeats)")
    ax.set_title("phase breakdown")
    ax.legend(fontsize=8)


def _baseline_spec(rep: Report) -> dict:
    if rep.baseline:
        return rep.baseline
    if SERIES in rep.done and rep.done[SERIES].eq("all").any():
        return {SERIES: "all"}
    return {}


def _points(rep: Report) -> pd.DataFrame:
    """Median step time per (series, model size, tokens per step), with its ratio to the baseline
    runs of the same model size and tokens per step."""
    d = rep.done.copy()
    cols = ["series", "size", "size_x", "tokens", "step", "ratio", "is_base"]
    if "step_ms_median" not in d or d["step_ms_median"].isna().all():
        return pd.DataFrame(columns=cols)
    d["series"] = d[SERIES] if SERIES in d else "runs"
    # runs labelled with different execution modes (a sweep's ``runs`` labels) are separate lines,
    # and each is compared with the baseline of its own mode
    d["mode"] = d["sweep_label"].fillna("") if "sweep_label" in d and d["sweep_label"].nunique() > 1 else ""
    if (d["mode"] != "").any():
        d["series"] = d["series"].astype(str) + " [" + d["mode"] + "]"
    keys = [k for k in SIZE_KEYS if k in d]
    d["size"] = [_size_name(r, keys) for r in d[keys].fillna("").astype(str).to_dict("records")] if keys else "model"
    # LoRA adds adapter parameters: the smallest count at a size is the base model's
    d["size_x"] = _numbers(d, "total_params").groupby(d["size"]).transform("min")
    d["tokens"] = _numbers(d, "tokens_per_step").round()
    spec = _baseline_spec(rep)
    d["is_base"] = matches(d, spec) if spec else False
    by = ["series", "mode", "size", "tokens"]
    agg = d.groupby(by, dropna=False).agg(step=("step_ms_median", "median"), size_x=("size_x", "first"),
                                          is_base=("is_base", "all")).reset_index()
    base = d[d["is_base"]].groupby(["mode", "size", "tokens"], dropna=False)["step_ms_median"].median()
    agg["ratio"] = [s / base.get((m, z, t), math.nan) if (m, z, t) in base.index else math.nan
                    for s, m, z, t in zip(agg["step"], agg["mode"], agg["size"], agg["tokens"])]
    return agg[cols]


def _numbers(d: pd.DataFrame, col: str) -> pd.Series:
    return pd.to_numeric(d[col], errors="coerce") if col in d else pd.Series(math.nan, index=d.index)


def _size_name(settings: dict, keys: list[str]) -> str:
    """'124M', or 'tiny emb_dim=16' when the shape is overridden."""
    head, *rest = keys
    return " ".join([settings[head]] + [f"{label(k)}={settings[k]}" for k in rest if settings[k]])


def _scaling(ax, pts: pd.DataFrame, *, x: str, y: str, line_by: str, title: str, xlabel: str,
             colors: dict) -> None:
    pts = pts.dropna(subset=[x, y])
    if pts.empty:
        _empty(ax, f"{title}: no data" + (" (no baseline runs)" if y == "ratio" else ""))
        return
    several = pts[line_by].nunique() > 1
    styles, markers = ("-", "--", ":", "-."), ("o", "s", "^", "D")
    others = sorted(pts[line_by].dropna().unique(), key=order_key)
    for (series, other), g in sorted(pts.groupby(["series", line_by], dropna=False),
                                     key=lambda kv: (order_key(kv[0][0]), order_key(kv[0][1]))):
        g = g.sort_values(x)
        name = str(series) + (f" ({other}{' tok/step' if line_by == 'tokens' else ''})" if several else "")
        k = others.index(other) if other in others else 0
        ax.plot(g[x], g[y], marker=markers[k % len(markers)], ls=styles[k % len(styles)], color=colors.get(series),
                label=name)
    if pts[x].max() > 10 * max(pts[x].min(), 1e-9):
        from matplotlib.ticker import NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on a short decade range
    if y == "ratio":
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ratio" if y == "ratio" else "ms per step (median)")
    ax.legend(fontsize=7)


def _spec_text(spec: dict) -> str:
    return ",".join(f"{label(k)}={v}" for k, v in spec.items()) or "baseline"


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=9)
    ax.set_axis_off()
