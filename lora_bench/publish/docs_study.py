"""The docs tables of the all-vs-LoRA study: the README's first screen and the study with repeats
(results/answer/study: medians, ratios and verdicts from lora_bench.report.groups, as the study's
report states them), the one-run study by tokens per step (results/answer/tokens-per-step), where
a 124M step goes, and one setting's spread over every committed folder."""

from __future__ import annotations

import statistics

import pandas as pd

from lora_bench.publish.source import LAYERS, RESULTS, ROOT, as_read, fmt_ms, md_table, runs
from lora_bench.report.groups import RunGroup, group_runs
from lora_bench.report.per_layer import UNIT as PER_LAYER, is_lora, per_layer_text
from lora_bench.report.stats import UNCLEAR, interval_text, shared_n_text
from lora_bench.results.store import read_runs

STUDY = "answer/tokens-per-step"
SIZES = ("124M", "355M", "774M", "1558M")
STEP = "step_ms_median"

ANSWER = "answer/study"  # the study with repeats: the README's headline
ANSWER_MODES = (("reference", "reference mode: eager fp32, book ops"),
                ("best", "CUDA graphs + bf16 autocast + SDPA + fused ops + fused AdamW"))


def _study_step(label: str) -> dict[tuple[str, str], float]:
    df = runs(STUDY)
    df = df[(df["status"] == "done") & (df["sweep_label"] == label)]
    return {(r.model_size, r.trainable_layers): r.step_ms_median for r in df.itertuples()}


def _repeats(label: str) -> dict[tuple[str, str], RunGroup]:
    """Each (size, layers) point of the study with repeats in one mode, set against all layers at
    its size as the study's report does (lora_bench.report.groups): its median step ms over the
    repeats, and its ratio to all's, the repeats paired by sweep and repeat."""
    df = runs(ANSWER)
    df = df[(df["status"] == "done") & (df["sweep_label"] == label)]
    found = group_runs(as_read(df, ANSWER), ["model_size", "trainable_layers"], metrics=[STEP],
                       baseline={"trainable_layers": "all"}, ratio_metric=STEP, lone_baseline=False, unknown=UNCLEAR,
                       sort=True)
    return {(g.values["model_size"], g.values["trainable_layers"]): g for g in found}


def table_answer() -> str:
    """The first screen of the README: median step ms over the study's repeats with their intervals,
    batch 8, 124M and 1558M, in each mode named in full, and LoRA ÷ all with its interval."""
    found = []
    for label, mode in ANSWER_MODES:
        reps = _repeats(label)
        found += [(f"GPT-2 {size}, {mode}", *(reps[(size, k)] for k in ("all", "lora"))) for size in ("124M", "1558M")]
    shared = shared_n_text(e for _, a, lo in found for e in (a.estimates[STEP], lo.estimates[STEP], lo.ratio))
    told = not shared
    rows = [[name, interval_text(a.estimates[STEP], digits=1, told=told),
             interval_text(lo.estimates[STEP], digits=1, told=told), f"**{interval_text(lo.ratio, told=told)}**"]
            for name, a, lo in found]
    return md_table([f"median step ms [interval{f' ({shared})' if shared else ''}], batch 8 × 120 tokens, one H200",
                     "all layers", "LoRA r16", "LoRA ÷ all"], rows)


def table_study_repeats() -> str:
    """The study with repeats: median step ms [interval] of all, and lora and lora-kernel ÷ all [interval]
    with their verdicts, at every size, in both modes."""
    rows, counts = [], set()
    for label, mode in ANSWER_MODES:
        reps = _repeats(label)
        for size in SIZES:
            cells = [f"{size}, {mode}", interval_text(reps[(size, "all")].estimates[STEP], digits=1)]
            for layers in ("lora", "lora-kernel"):
                g = reps[(size, layers)]
                counts.add(g.ratio.n)
                cells.append(f"{interval_text(g.ratio)} {g.verdict}")
            rows.append(cells)
    n = "–".join(str(c) for c in sorted(counts))
    return md_table([f"batch 8 × 120 tokens, one H200, {n} repeats", "all: step ms", "lora ÷ all",
                     "lora-kernel ÷ all"], rows)


def table_cause() -> str:
    """The GPU's busy fraction per phase in the reference mode: the profiled repeat's kernel ms per
    step over the timed repeats' median device ms (lora_bench.report.study.Phase.busy)."""
    df = runs(ANSWER)
    done = df[df["status"] == "done"]
    timed = done[done["sweep_label"] == "reference"]
    prof = done[done["cfg_profile"] == "kernels"]
    rows = []
    for r in prof.sort_values(["cfg_n_layers", "trainable_layers"]).itertuples():
        kernels = pd.read_csv(RESULTS / ANSWER / r.run_id / "kernels_by_phase.csv").set_index("phase")
        t = timed[(timed.model_size == r.model_size) & (timed.trainable_layers == r.trainable_layers)]
        cells = [f"{r.model_size} {r.trainable_layers}"]
        for ph in ("forward", "backward", "optimizer"):
            dev = float(t[f"{ph}_ms_median"].median())
            cells.append(f"{100 * min(kernels.loc[ph, 'kernel_ms_per_step'] / dev, 1):.0f} %")
        rows.append(cells)
    return md_table(["eager fp32, GPU busy (kernel time ÷ device time)", "forward", "backward", "optimizer"], rows)


FLOOR = "answer/floor"  # the floor study: each LoRA variant against the frozen model's step
FLOOR_MODES = {"bf16": "CUDA graphs + bf16 autocast + SDPA + fused ops + fused AdamW",
               "bf16-true": "CUDA graphs + bf16-true + SDPA + fused ops + fused AdamW"}


def _floor_groups() -> list[RunGroup]:
    """The floor study's groups by size, precision, trainable layers and where lora-kernel's adapter
    gradients run, each LoRA group set against the floor (frozen) of its size and precision, the
    repeats paired (the floor ran adapter_grads at its default, so that key is not matched)."""
    df = runs(FLOOR)
    df = as_read(df[df["status"] == "done"], FLOOR)
    return group_runs(df, ["model_size", "cfg_precision", "trainable_layers", "cfg_adapter_grads"],
                      metrics=[STEP, "backward_ms_median"],
                      baseline={"trainable_layers": "frozen"}, ratio_metric=STEP, lone_baseline=False,
                      unknown=UNCLEAR, sort=True, unmatched=("cfg_adapter_grads",))


def table_floor() -> str:
    """The floor study per variant: median step and backward ms at 124M and 1558M, each LoRA
    variant's step ÷ the floor of its precision and its adapters' µs per adapted layer above that
    floor (lora_bench.report.per_layer), with intervals (docs/kernel-design.md)."""
    cells = {}
    for g in _floor_groups():
        v = g.values
        cells[(v["cfg_precision"], v["trainable_layers"], v["cfg_adapter_grads"], v["model_size"])] = g
    order = [("bf16", "lora-kernel", "inline"), ("bf16", "lora-kernel", "deferred"),
             ("bf16-true", "lora-kernel", "deferred"), ("bf16", "lora", "inline"), ("bf16-true", "lora", "inline"),
             ("bf16", "all", "inline"), ("bf16", "frozen", "inline"), ("bf16-true", "frozen", "inline")]
    precision = {"bf16": "bf16 autocast", "bf16-true": "bf16-true"}
    rows = []
    for key in order:
        prec, layers, grads = key
        name = (f"the floor (`frozen`), {precision[prec]}" if layers == "frozen" else
                f"`{layers}`, {precision[prec]}" + (f", {grads}" if layers == "lora-kernel" else ""))
        row = [name]
        for size in ("124M", "1558M"):
            g = cells.get((*key, size))
            if g is None:
                row += ["-", "-", "-", "-"]
                continue
            row += [interval_text(g.estimates[STEP], digits=2, told=False),
                    "1" if layers == "frozen" else interval_text(g.ratio, told=False),
                    per_layer_text(g.runs, g.baseline_runs, told=False) if is_lora(g.runs) else "-",
                    f"{g.estimates['backward_ms_median'].value:.2f}"]
        rows.append(row)
    return md_table(["best mode, batch 8 × 120, r16",
                     *(f"{size} {col}" for size in ("124M", "1558M") for col in (
                         "step ms [interval]", "÷ floor [interval]", f"{PER_LAYER} [interval]", "backward ms"))],
                    rows, align="---|" + "|".join(["---:"] * 8))


BOOK_WHOLE = "answer/book-whole-runs"
# the published table's training times, minutes, one A100, pretrained weights, 5 epochs with evaluation
BOOK_MINUTES = {("124M", "all"): 0.69, ("124M", "lora"): 0.75, ("1558M", "all"): 8.12, ("1558M", "lora"): 5.79}


def table_book_whole_runs() -> str:
    """The book's whole-run comparison: each size and mode's median training minutes (evaluation
    included) over the repeats, for all and LoRA, LoRA ÷ all paired per repeat, beside the book's."""
    df = runs(BOOK_WHOLE)
    df = as_read(df[df["status"] == "done"], BOOK_WHOLE)
    found = {(g.values["model_size"], g.values["sweep_label"], g.values["trainable_layers"]): g
             for g in group_runs(df, ["model_size", "sweep_label", "trainable_layers"], metrics=["training_time_min"],
                                 baseline={"trainable_layers": "all"}, ratio_metric="training_time_min",
                                 lone_baseline=False, unknown=UNCLEAR, sort=True)}
    rows = []
    for size in ("124M", "1558M"):
        book = [f"{BOOK_MINUTES[(size, k)]:.2f}" for k in ("all", "lora")]
        book.append(f"{BOOK_MINUTES[(size, 'lora')] / BOOK_MINUTES[(size, 'all')]:.2f}")
        for label, mode in ANSWER_MODES:
            a, lo = found.get((size, label, "all")), found.get((size, label, "lora"))
            if a is None or lo is None:
                rows.append([f"GPT-2 {size}", mode, "not run yet", "not run yet", "-", *book])
                continue
            rows.append([f"GPT-2 {size}", mode, interval_text(a.estimates["training_time_min"], digits=2),
                         interval_text(lo.estimates["training_time_min"], digits=2),
                         f"{interval_text(lo.ratio)} {lo.verdict}".strip(), *book])
    return md_table(["5 epochs with evaluation, r16 α16, one H200", "mode", "all: min [interval]", "LoRA: min [interval]",
                     "LoRA ÷ all", "book, A100: all min", "LoRA min", "LoRA ÷ all"], rows,
                    align="---|---|---:|---:|---:|---:|---:|---:")


def table_fastest() -> str:
    """The fastest measured LoRA configuration per size, in the study with repeats and the floor
    study, with its step ÷ the floor's (the frozen model's step in the same precision) where the
    floor was measured at that size."""
    found = {}
    for label, mode in ANSWER_MODES:
        for (size, layers), g in _repeats(label).items():
            if layers != "all":
                found.setdefault(size, []).append((g.estimates[STEP], f"`{layers}`, {mode}", None))
    for g in _floor_groups():
        v = g.values
        if v["trainable_layers"] in ("frozen", "all"):
            continue
        deferred = ", adapter gradients deferred" if v["cfg_adapter_grads"] == "deferred" else ""
        found.setdefault(v["model_size"], []).append(
            (g.estimates[STEP], f"`{v['trainable_layers']}`{deferred}, {FLOOR_MODES[v['cfg_precision']]}", g.ratio))
    rows = [[f"GPT-2 {size}", *min(found[size], key=lambda f: f[0].value)[1:]] for size in SIZES]
    best = [min(found[size], key=lambda f: f[0].value)[0] for size in SIZES]
    shared = shared_n_text([*best, *(r[2] for r in rows if r[2] is not None)])
    rows = [[name, config, interval_text(e, digits=2, told=not shared),
             interval_text(r, told=not shared) if r is not None else "not measured"]
            for (name, config, r), e in zip(rows, best)]
    return md_table(["fastest measured LoRA step, batch 8 × 120 tokens, one H200", "configuration",
                     f"median step ms [interval{f' ({shared})' if shared else ''}]", "÷ the floor"], rows,
                    align="---|---|---:|---:")


def _study_sizes(label: str, *, title: str) -> list[list]:
    step = _study_step(label)
    rows = [[f"{layers}, {title}", *(fmt_ms(step[(s, layers)]) for s in SIZES)] for layers in LAYERS]
    rows.append([f"lora ÷ all, {title}", *(f"{step[(s, 'lora')] / step[(s, 'all')]:.2f}" for s in SIZES)])
    rows.append([f"lora-kernel ÷ all, {title}",
                 *(f"{step[(s, 'lora-kernel')] / step[(s, 'all')]:.2f}" for s in SIZES)])
    return rows


def table_study_eager() -> str:
    rows = _study_sizes("eager-fp32", title="batch 8") + _study_sizes("eager-fp32-b32", title="batch 32")
    return md_table(["eager fp32 (reference mode), median step ms", *SIZES], rows)


def table_study_graphs() -> str:
    rows = (_study_sizes("graphs-bf16-fused-fopt", title="batch 8")
            + _study_sizes("graphs-bf16-fused-fopt-b32", title="batch 32"))
    return md_table(["CUDA graphs + bf16 + fused ops + fused AdamW, median step ms", *SIZES], rows)


def table_study_phases() -> str:
    """Device time per phase at the two ends of the size range, eager fp32, batch 8."""
    df = runs(STUDY)
    df = df[(df["status"] == "done") & (df["sweep_label"] == "eager-fp32")].set_index(["model_size", "trainable_layers"])
    rows = []
    for size in ("124M", "1558M"):
        for layers in LAYERS:
            r = df.loc[(size, layers)]
            rows.append([f"{size} {layers}", *(fmt_ms(r[f"{p}_ms_median"]) for p in ("forward", "backward", "optimizer")),
                         fmt_ms(r["step_ms_median"])])
    return md_table(["eager fp32, batch 8, device ms", "forward", "backward", "optimizer", "step"], rows)


# -- where a 124M step goes (results/method/phase-timing; kernels from the study's profiled repeat) --
PROFILED_124M = {"all": "124M-all-0522a0d805-r0", "lora": "124M-lora-ef77143c2f-r0"}
def table_phases_124m() -> str:
    df = runs("method/phase-timing").set_index("run_id")
    rows = []
    for layers in ("all", "lora"):
        reps = [df.loc[f"{layers}-events-r{i}"] for i in range(3)]

        def med(col: str) -> float:
            return statistics.median(float(r[col]) for r in reps)

        kernels = pd.read_csv(RESULTS / ANSWER / PROFILED_124M[layers] / "kernels_by_phase.csv")
        k = kernels.set_index("phase")
        launches = " / ".join(f"{k.loc[p, 'launches_per_step']:,.0f}" for p in ("forward", "backward", "optimizer"))
        rows.append([layers if layers == "all" else "lora r16",
                     *(f"{fmt_ms(med(f'{p}_ms_median'))} / {fmt_ms(med(f'host_{p}_ms_median'))}"
                       for p in ("forward", "backward", "optimizer")),
                     fmt_ms(med("step_ms_median")), launches, f"{k['kernel_ms_per_step'].sum():.1f}"])
    return md_table(["124M, eager fp32", "forward device / host ms", "backward device / host ms",
                   "optimizer device / host ms", "step ms", "kernels per step (fwd / bwd / opt)",
                   "kernel ms per step"], rows)


def table_profilers() -> str:
    """What each way of measuring does to the 124M step it measures."""
    df = runs("method/phase-timing").set_index("run_id")
    rows = []
    for run, what in (("events-r0", "CUDA events at phase boundaries (default)"),
                      ("sync", "synchronise at every boundary (`--timing sync`)"),
                      ("torchprof", "torch.profiler (`--profile torch`)"),
                      ("lineprof", "line_profiler (`--profile line`)")):
        rows.append([what, *(fmt_ms(df.loc[f"{layers}-{run}", "step_ms_median"]) for layers in ("all", "lora"))])
    return md_table(["124M, eager fp32, measured by", "all: step ms", "lora: step ms"], rows)




def _is_reference_124m_all(df: pd.DataFrame) -> pd.Series:
    """Rows of 124M, all layers, the reference's mode (eager fp32, book ops and optimizer), batch 8,
    on an H200, timed and not profiled."""
    def col(name, default):
        return df[name].astype("string").fillna(default) if name in df else pd.Series(default, index=df.index)
    return ((col("cfg_model_size", "") == "124M") & (col("cfg_trainable_layers", "") == "all")
            & (col("status", "") == "done") & (col("cfg_batch_size", "") == "8")
            & col("cfg_precision", "fp32").isin(["fp32"]) & (col("cfg_cuda_graphs", "False").str.lower() != "true")
            & col("cfg_compile", "none").isin(["none", "False", "false"]) & (col("cfg_ops", "book") == "book")
            & (col("cfg_attention", "book") == "book") & col("cfg_optimizer", "book").isin(["book", "adamw"])
            & col("cfg_profile", "off").isin(["off", "none"]) & col("gpu_name", "").str.contains("H200")
            & col("cfg_nproc", "1").isin(["1"])
            & df["step_ms_median"].notna())


def table_spread_124m() -> str:
    """One setting in every committed folder that holds it: 124M all layers in the reference's
    mode on an H200, one process. Median step ms of each folder's runs (range), the environment they recorded,
    and the measured host op cost where the runs recorded it."""
    rows = []
    for path in sorted(RESULTS.rglob("runs.csv")):
        df = read_runs(path)
        part = df[_is_reference_124m_all(df)]
        if part.empty:
            continue
        steps = sorted(float(v) for v in part["step_ms_median"])
        env = " · ".join(sorted({f"{r.cpu}, Python {r.python_version}, torch {r.torch_version}, driver {r.gpu_driver}"
                                 for r in part.itertuples()}))
        probe = part["host_op_us"].dropna() if "host_op_us" in part else pd.Series(dtype=float)
        rows.append([f"`{path.parent.relative_to(ROOT).as_posix()}`", len(steps), fmt_ms(statistics.median(steps)),
                     f"{fmt_ms(steps[0])}–{fmt_ms(steps[-1])}", env,
                     f"{statistics.median(probe):.1f}" if len(probe) else "not recorded"])
    return md_table(["folder", "runs", "step ms (median)", "range", "recorded environment", "host op µs"], rows,
                  align="---|---:|---:|---:|---|---:")
