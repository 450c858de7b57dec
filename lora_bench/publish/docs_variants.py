"""The docs tables of LoRA's variants (docs/variants.md), from the variants study's folder (the one
``lora-bench sweep configs/variants-study.yaml --results-dir results/answer/variants`` writes):
each variant's median step over its repeats, its ratio to its own implementation's LoRA (the
book's unmerged layer for the book's variants and DoRA merged, the fused layer for the fused ones,
PEFT's LoRA for PEFT's) and to the floor, with intervals and verdicts as the study's report gives
them (lora_bench.report.groups); and from the accuracy sweep's folder
(``configs/variants-accuracy.yaml``) each variant's accuracies over its seeds against LoRA's.
Where a folder holds no run of a row, its cells say "not run yet"."""

from __future__ import annotations

import pandas as pd

from lora_bench.config import TrainConfig
from lora_bench.config.recorded import as_recorded
from lora_bench.publish.source import RESULTS, as_read, md_table, runs
from lora_bench.report.groups import RunGroup, difference, estimate, group_runs, same
from lora_bench.report.samples import sample
from lora_bench.report.stats import UNCLEAR, interval_text
from lora_bench.results.runs_csv import text_value

VARIANTS = "answer/variants"
STEP = "step_ms_median"
SIZES = ("124M", "1558M")
# the settings that tell the study's rows apart, with the column each is read from
KEYS = {"implementation": "cfg_implementation", "trainable_layers": "trainable_layers",
        "lora_variant": "cfg_lora_variant", "dora_norm": "cfg_dora_norm", "lora_scaling": "cfg_lora_scaling",
        "loraplus_lr_ratio": "cfg_loraplus_lr_ratio", "lora_init": "cfg_lora_init",
        "dora_norm_launch": "cfg_dora_norm_launch"}
FLOOR = "the floor (`frozen`)"
# (row, family, what sets it apart from the defaults); a family's first row is its baseline
ROWS = (
    (FLOOR, "floor", {"trainable_layers": "frozen"}),
    ("LoRA (`lora`)", "book", {}),
    ("rsLoRA (α/√r)", "book", {"lora_scaling": "rslora"}),
    ("LoRA+ (B's rate 16×)", "book", {"loraplus_lr_ratio": 16}),
    ("DoRA, exact norm", "book", {"lora_variant": "dora"}),
    ("DoRA, detached norm", "book", {"lora_variant": "dora", "dora_norm": "detached"}),
    ("DoRA merged (`lora-merged`)", "book", {"trainable_layers": "lora-merged", "lora_variant": "dora"}),
    ("PiSSA", "book", {"lora_init": "pissa"}),
    ("fused LoRA (`lora-kernel`)", "kernel", {"trainable_layers": "lora-kernel"}),
    ("fused rsLoRA", "kernel", {"trainable_layers": "lora-kernel", "lora_scaling": "rslora"}),
    ("fused DoRA, exact norm", "kernel",
     {"trainable_layers": "lora-kernel", "lora_variant": "dora", "dora_norm_launch": "inline"}),
    ("fused DoRA, detached norm", "kernel",
     {"trainable_layers": "lora-kernel", "lora_variant": "dora", "dora_norm": "detached",
      "dora_norm_launch": "inline"}),
    ("fused DoRA, exact norm, norms ahead", "kernel",
     {"trainable_layers": "lora-kernel", "lora_variant": "dora", "dora_norm_launch": "ahead"}),
    ("fused DoRA, detached norm, norms ahead", "kernel",
     {"trainable_layers": "lora-kernel", "lora_variant": "dora", "dora_norm": "detached",
      "dora_norm_launch": "ahead"}),
    ("PEFT LoRA", "hf", {"implementation": "hf"}),
    ("PEFT DoRA (`use_dora`)", "hf", {"implementation": "hf", "lora_variant": "dora", "dora_norm": "detached"}),
    ("PEFT rsLoRA (`use_rslora`)", "hf", {"implementation": "hf", "lora_scaling": "rslora"}),
    ("PEFT PiSSA", "hf", {"implementation": "hf", "lora_init": "pissa"}),
)
NOT_RUN = "not run yet"
# rows the study runs in its best mode alone (the norms formed ahead need the Triton path: a GPU's graphs)
BEST_ONLY = ("fused DoRA, exact norm, norms ahead", "fused DoRA, detached norm, norms ahead")
INIT = "adapter_init_s"  # PiSSA's SVDs, timed apart from the steps
PISSA_ROWS = ("PiSSA", "PEFT PiSSA")


def _settings(changes: dict) -> dict[str, str]:
    """A row's settings as runs.csv writes them: the defaults, with ``changes``."""
    defaults = TrainConfig()
    out = {k: text_value(getattr(defaults, k)) for k in KEYS}
    out["trainable_layers"] = "lora"
    out.update({k: text_value(v) for k, v in changes.items()})
    return out


def _row_name(run: pd.Series) -> str | None:
    """The run's row of ``ROWS``: its settings equal to the row's (``groups.same``; each side as it
    compares, ``config.recorded.as_recorded``: a missing or blank cell reads as the default the run
    ran), or None. The DoRA norm counts only for DoRA, the floor only by its layers."""
    def value(k):
        col = KEYS.get(k, "cfg_" + k)
        return None if col not in run else run[col]
    got = {k: text_value(as_recorded(k, value(k), value)) for k in KEYS}
    for name, _family, changes in ROWS:
        want = _settings(changes)
        want = {k: text_value(as_recorded(k, v, want.get)) for k, v in want.items()}
        keys = ["trainable_layers"] if name == FLOOR else [
            k for k in KEYS if k != "dora_norm" or want["lora_variant"] == "dora"]
        if all(same(got[k], want[k]) for k in keys):
            return name
    return None


def _named(label: str, folder: str = VARIANTS) -> pd.DataFrame | None:
    """The study's finished runs in one mode (its sweep label), as read, each with its row of ``ROWS``
    (``variant_row``; runs of no row left out); None where the folder holds no runs."""
    path = RESULTS / folder / "runs.csv"
    if not path.is_file():
        return None
    df = runs(folder)
    df = df[(df["status"] == "done") & (df["sweep_label"] == label)]
    rows = df.apply(_row_name, axis=1) if not df.empty else pd.Series(dtype=object)
    return as_read(df.assign(variant_row=rows).dropna(subset=["variant_row"]), folder)


def _groups(label: str, folder: str = VARIANTS) -> tuple[dict, dict]:
    """(row, size) -> the group against its family's LoRA, and -> the group against the floor, for
    the study's rows in one mode (its sweep label); empty where the folder holds none."""
    df = _named(label, folder)
    if df is None:
        return {}, {}
    family = {name: fam for name, fam, _ in ROWS}
    df = df.assign(variant_family=df["variant_row"].map(family))
    by_lora, by_floor = {}, {}
    for fam in ("book", "kernel", "hf"):
        base = next(name for name, f, _ in ROWS if f == fam)
        part = df[df["variant_family"] == fam]
        for g in _grouped(part, base):
            by_lora[(g.values["variant_row"], g.values["model_size"])] = g
        with_floor = df[(df["variant_family"] == fam) | (df["variant_row"] == FLOOR)]
        for g in _grouped(with_floor, FLOOR):
            by_floor[(g.values["variant_row"], g.values["model_size"])] = g
    return by_lora, by_floor


def _grouped(frame: pd.DataFrame, baseline: str) -> list[RunGroup]:
    if frame.empty:
        return []
    return group_runs(frame, ["model_size", "variant_row"], metrics=[STEP], baseline={"variant_row": baseline},
                      ratio_metric=STEP, lone_baseline=False, unknown=UNCLEAR, sort=True)


def _ratio(g: RunGroup | None) -> str:
    if g is None or g.is_baseline:
        return "1" if g is not None else "-"
    if not g.has_baseline:
        return "-"
    return f"{interval_text(g.ratio)} {g.verdict}".strip()


def table_variants(label: str, folder: str = VARIANTS) -> str:
    """One mode's table: for each row of ``ROWS`` and size, the median step ms [interval], ÷ its
    family's LoRA with the verdict, and ÷ the floor."""
    by_lora, by_floor = _groups(label, folder)
    rows = []
    for name, _family, _changes in ROWS:
        if name in BEST_ONLY and label != "best":
            continue
        row = [name]
        for size in SIZES:
            g = by_lora.get((name, size)) or by_floor.get((name, size))
            if g is None:
                row += [NOT_RUN, "-", "-"]
                continue
            f = by_floor.get((name, size))
            row += [interval_text(g.estimates[STEP], digits=2),
                    "-" if name == FLOOR else _ratio(by_lora.get((name, size))),
                    "1" if name == FLOOR else _ratio(f)]
        rows.append(row)
    return md_table(["variant, batch 8 × 120, r16", *(f"{size} {col}" for size in SIZES for col in (
        "step ms [interval]", "÷ its LoRA", "÷ floor"))], rows, align="---|" + "|".join(["---:"] * 6))


# the fused DoRA rows with their norms inline and formed ahead, paired by norm
AHEAD_PAIRS = (("detached", "fused DoRA, detached norm", "fused DoRA, detached norm, norms ahead"),
               ("exact", "fused DoRA, exact norm", "fused DoRA, exact norm, norms ahead"))
FORWARD = "forward_ms_median"
FORWARD_KERNELS = "graph_kernels_forward"


def table_norms_ahead(folder: str = VARIANTS) -> str:
    """The fused DoRA rows of the best mode with their norms formed ahead against inline, per norm and
    size: each step's median [interval], ahead ÷ inline paired by repeat with the verdict, the
    forward phase's median ms and the kernels the captured forward launches (median), inline → ahead."""
    df = _named("best", folder)
    rows = []
    for norm, inline, ahead in AHEAD_PAIRS:
        part = pd.DataFrame() if df is None else df[df["variant_row"].isin([inline, ahead])]
        groups = {(g.values["variant_row"], g.values["model_size"]): g for g in _grouped(part, inline)}
        for size in SIZES:
            gi, ga = groups.get((inline, size)), groups.get((ahead, size))
            if gi is None or ga is None:
                rows.append([norm, size, NOT_RUN, NOT_RUN, "-", "-", "-"])
                continue
            fwd = [estimate(g.runs, FORWARD) for g in (gi, ga)]
            kernels = [g.runs[FORWARD_KERNELS].median() if FORWARD_KERNELS in g.runs else float("nan")
                       for g in (gi, ga)]
            rows.append([norm, size, interval_text(gi.estimates[STEP], digits=2),
                         interval_text(ga.estimates[STEP], digits=2),
                         f"{interval_text(ga.ratio, digits=3)} {ga.verdict}".strip() if ga.has_baseline else "-",
                         " → ".join(f"{e.value:.2f}" if e is not None and e.known else "-" for e in fwd),
                         " → ".join("-" if pd.isna(k) else f"{k:,.0f}" for k in kernels)])
    return md_table(["fused DoRA, best mode, batch 8 × 120, r16", "size", "inline step ms [interval]",
                     "ahead step ms [interval]", "ahead ÷ inline", "forward ms, inline → ahead",
                     "forward graph kernels, inline → ahead"], rows, align="---|---|" + "|".join(["---:"] * 5))


def table_pissa_init(label: str = "best", folder: str = VARIANTS) -> str:
    """PiSSA's one-time cost in one mode: for the book's PiSSA and PEFT's, at each size, the median
    ``adapter_init_s`` over the repeats [interval], and how many of the row's own median steps it
    comes to."""
    by_lora, _ = _groups(label, folder)
    rows = []
    for name in PISSA_ROWS:
        row = [name]
        for size in SIZES:
            g = by_lora.get((name, size))
            init = estimate(g.runs, INIT) if g is not None and INIT in g.runs else None
            if init is None or not init.known:
                row += [NOT_RUN, "-"]
                continue
            step = g.estimates[STEP]
            row += [interval_text(init, digits=1), f"{1e3 * init.value / step.value:,.0f}" if step.known else "-"]
        rows.append(row)
    return md_table(["PiSSA, r16", *(f"{size} {col}" for size in SIZES for col in (
        "SVDs s [interval]", "÷ its step"))], rows, align="---|" + "|".join(["---:"] * 4))


def table_pissa_init_best() -> str:
    return table_pissa_init("best")


def table_variants_best() -> str:
    return table_variants("best")


def table_variants_reference() -> str:
    return table_variants("reference")


VARIANTS_ACCURACY = "answer/variants-accuracy"
ACCURACY = ("val_acc", "test_acc")
# (row, the accuracy sweep's label for it); the first row is the baseline
ACCURACY_ROWS = (("LoRA", "lora"), ("rsLoRA (α/√r)", "rslora"), ("LoRA+ (B's rate 16×)", "loraplus"),
                 ("DoRA, exact norm", "dora-exact"), ("DoRA, detached norm", "dora-detached"), ("PiSSA", "pissa"))


def table_variants_accuracy(folder: str = VARIANTS_ACCURACY) -> str:
    """configs/variants-accuracy.yaml as far as it ran: each variant's validation and test accuracy
    over its seeds (median and the seeds' range) and its difference from LoRA's in points with its
    interval, seeds paired (seed r of every variant starts from the same model)."""
    path = RESULTS / folder / "runs.csv"
    df = runs(folder) if path.is_file() else pd.DataFrame(columns=["status", "sweep_label", "run_id"])
    done = as_read(df[df["status"] == "done"], folder)
    found = {label: done[done["sweep_label"] == label] for _, label in ACCURACY_ROWS}
    base = found[ACCURACY_ROWS[0][1]]
    rows = []
    for name, label in ACCURACY_ROWS:
        part = found[label]
        n_all = int((df["sweep_label"] == label).sum())
        if part.empty:
            rows.append([name, f"0 of {n_all}", NOT_RUN, NOT_RUN, "-", "-"])
            continue
        cells = [name, f"{len(part)} of {n_all}"]
        samples = [sample(part, m) for m in ACCURACY]
        cells += [f"{s.point:.1f} ({s.values.min():.1f}–{s.values.max():.1f})" for s in samples]
        for metric, s in zip(ACCURACY, samples):
            if label == ACCURACY_ROWS[0][1]:
                cells.append("(baseline)")
            elif base.empty:
                cells.append("-")
            else:
                d, _ = difference(s, sample(base, metric))
                cells.append(interval_text(d, digits=1, unit=" pt"))
        rows.append(cells)
    return md_table(["124M, r16, 5 epochs, random weights, best mode", "seeds done", "val % median (seeds' range)",
                     "test % median (seeds' range)", "val − LoRA [interval]", "test − LoRA [interval]"], rows,
                    align="---|---|---:|---:|---:|---:")
