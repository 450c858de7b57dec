"""Regenerate the generated parts of the documentation from the repository's own files.

- ``docs/results-schema.md`` in full, from ``lora_bench/results/schema.py`` and ``TrainConfig``;
- every table between ``<!-- generated:NAME -->`` and ``<!-- /generated -->`` in ``README.md`` and
  ``docs/*.md``, computed from the committed results under ``results/``.

    python docs/generate.py          # rewrite what is out of date
    python docs/generate.py --check  # exit 1 and name the files that are out of date
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: this checkout's lora_bench
    sys.path.insert(0, str(ROOT))

from lora_bench.config import TrainConfig  # noqa: E402
from lora_bench.fileio import atomic_write_text  # noqa: E402
from lora_bench.results.schema import ENV_COLUMNS, RUN_COLUMNS, SETTING_PREFIX, STATUSES, STEP_COLUMNS  # noqa: E402
from lora_bench.report.load import RESULTS_DIR, RUN_DIR  # noqa: E402
from lora_bench.report.samples import sample  # noqa: E402
from lora_bench.report.stats import Sample  # noqa: E402
from lora_bench.results.store import read_runs  # noqa: E402
from lora_bench.timing import PHASES  # noqa: E402

RESULTS = ROOT / "results"
BLOCK = re.compile(r"(<!-- generated:([a-z0-9-]+) -->\n)(.*?)(<!-- /generated -->)", re.S)
LAYERS = ("all", "lora", "lora-kernel")


def runs(folder: str) -> pd.DataFrame:
    return read_runs(RESULTS / folder / "runs.csv")


def _ms(v: float) -> str:
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list], *, align: str | None = None) -> str:
    align = align or "|".join(["---"] + ["---:"] * (len(header) - 1))
    return "\n".join([_row(header), f"|{align}|", *(_row(r) for r in rows)]) + "\n"


# -- the all-vs-LoRA study (results/answer/tokens-per-step) --------------------------------------------------
STUDY = "answer/tokens-per-step"
SIZES = ("124M", "355M", "774M", "1558M")


ANSWER = "answer/study"  # the study with repeats: the README's headline
ANSWER_MODES = (("reference", "reference mode: eager fp32, book ops"),
                ("best", "CUDA graphs + bf16 autocast + SDPA + fused ops + fused AdamW"))


def _samples(df: pd.DataFrame, folder: str, by: list[str], column: str) -> dict[tuple, Sample]:
    """Each group's repeats of ``column`` in ``folder``'s runs, as the reports resample them
    (lora_bench.report.samples): keyed by folder, sweep and repeat, so that two groups' ratio or
    difference pairs them; a group of one run resamples its measured steps, as the reports do."""
    rows = df.assign(**{RESULTS_DIR: folder, RUN_DIR: [str(RESULTS / folder / r) for r in df["run_id"]]})
    return {key: sample(part, column) for key, part in rows.groupby(by)}


def _study_step(label: str) -> dict[tuple[str, str], float]:
    df = runs(STUDY)
    df = df[(df["status"] == "done") & (df["sweep_label"] == label)]
    return {(r.model_size, r.trainable_layers): r.step_ms_median for r in df.itertuples()}


def _repeats(label: str) -> dict[tuple[str, str], Sample]:
    """Each (size, layers) point's repeats (median step ms of each run) in the study with repeats,
    paired by sweep and repeat as the reports pair them (``_samples``)."""
    df = runs(ANSWER)
    df = df[(df["status"] == "done") & (df["sweep_label"] == label)]
    return _samples(df, ANSWER, ["model_size", "trainable_layers"], "step_ms_median")


def table_answer() -> str:
    """The first screen of the README: median step ms over the study's repeats with 95 % intervals,
    batch 8, 124M and 1558M, in each mode named in full, and LoRA ÷ all with its interval."""
    from lora_bench.report.stats import interval_text, median_interval, ratio_interval

    rows = []
    for label, mode in ANSWER_MODES:
        reps = _repeats(label)
        for size in ("124M", "1558M"):
            a, lo = (reps[(size, k)] for k in ("all", "lora"))
            n = min(len(a.values), len(lo.values))
            rows.append([f"GPT-2 {size}, {mode}", interval_text(median_interval(a), digits=1),
                         interval_text(median_interval(lo), digits=1), f"**{interval_text(ratio_interval(lo, a))}**",
                         str(n)])
    return _table(["median step ms [95 % interval], batch 8 × 120 tokens, one H200", "all layers", "LoRA r16",
                   "LoRA ÷ all", "repeats"], rows)


def table_study_repeats() -> str:
    """The study with repeats: median step ms [95 %] of all, and lora and lora-kernel ÷ all [95 %]
    with their verdicts, at every size, in both modes."""
    from lora_bench.report.stats import interval_text, median_interval, ratio_interval, verdict

    rows, counts = [], set()
    for label, mode in ANSWER_MODES:
        reps = _repeats(label)
        for size in SIZES:
            base = reps[(size, "all")]
            cells = [f"{size}, {mode}", interval_text(median_interval(base), digits=1)]
            for layers in ("lora", "lora-kernel"):
                r = ratio_interval(reps[(size, layers)], base)
                counts.add(r.n)
                cells.append(f"{interval_text(r)} {verdict(r)}")
            rows.append(cells)
    n = "–".join(str(c) for c in sorted(counts))
    return _table([f"batch 8 × 120 tokens, one H200, {n} repeats", "all: step ms", "lora ÷ all", "lora-kernel ÷ all"],
                  rows)


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
    return _table(["eager fp32, GPU busy (kernel time ÷ device time)", "forward", "backward", "optimizer"], rows)


def table_fastest() -> str:
    """The fastest measured LoRA configuration per size in the study with repeats (mode and layer)."""
    from lora_bench.report.stats import interval_text, median_interval

    rows = []
    for size in ("124M", "355M", "774M", "1558M"):
        best = None
        for label, mode in ANSWER_MODES:
            for layers, reps in _repeats(label).items():
                if layers[0] == size and layers[1] != "all":
                    est = median_interval(reps)
                    if best is None or est.value < best[0].value:
                        best = (est, mode, layers[1])
        rows.append([f"GPT-2 {size}", f"`{best[2]}`, {best[1]}", interval_text(best[0], digits=2)])
    return _table(["fastest measured LoRA step, batch 8 × 120 tokens, one H200", "configuration",
                   "median step ms [95 % interval]"], rows, align="---|---|---:")


def _study_sizes(label: str, *, title: str) -> list[list]:
    step = _study_step(label)
    rows = [[f"{layers}, {title}", *(_ms(step[(s, layers)]) for s in SIZES)] for layers in LAYERS]
    rows.append([f"lora ÷ all, {title}", *(f"{step[(s, 'lora')] / step[(s, 'all')]:.2f}" for s in SIZES)])
    rows.append([f"lora-kernel ÷ all, {title}",
                 *(f"{step[(s, 'lora-kernel')] / step[(s, 'all')]:.2f}" for s in SIZES)])
    return rows


def table_study_eager() -> str:
    rows = _study_sizes("eager-fp32", title="batch 8") + _study_sizes("eager-fp32-b32", title="batch 32")
    return _table(["eager fp32 (reference mode), median step ms", *SIZES], rows)


def table_study_graphs() -> str:
    rows = (_study_sizes("graphs-bf16-fused-fopt", title="batch 8")
            + _study_sizes("graphs-bf16-fused-fopt-b32", title="batch 32"))
    return _table(["CUDA graphs + bf16 + fused ops + fused AdamW, median step ms", *SIZES], rows)


def table_study_phases() -> str:
    """Device time per phase at the two ends of the size range, eager fp32, batch 8."""
    df = runs(STUDY)
    df = df[(df["status"] == "done") & (df["sweep_label"] == "eager-fp32")].set_index(["model_size", "trainable_layers"])
    rows = []
    for size in ("124M", "1558M"):
        for layers in LAYERS:
            r = df.loc[(size, layers)]
            rows.append([f"{size} {layers}", *(_ms(r[f"{p}_ms_median"]) for p in ("forward", "backward", "optimizer")),
                         _ms(r["step_ms_median"])])
    return _table(["eager fp32, batch 8, device ms", "forward", "backward", "optimizer", "step"], rows)


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
                     *(f"{_ms(med(f'{p}_ms_median'))} / {_ms(med(f'host_{p}_ms_median'))}"
                       for p in ("forward", "backward", "optimizer")),
                     _ms(med("step_ms_median")), launches, f"{k['kernel_ms_per_step'].sum():.1f}"])
    return _table(["124M, eager fp32", "forward device / host ms", "backward device / host ms",
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
        rows.append([what, *(_ms(df.loc[f"{layers}-{run}", "step_ms_median"]) for layers in ("all", "lora"))])
    return _table(["124M, eager fp32, measured by", "all: step ms", "lora: step ms"], rows)


# -- execution modes (results/method/modes/*, results/kernel/plans-eager-bf16) ------------------
MODES_124M = [
    ("method/modes/eager-vs-graphs", "124M-eager-fp32-{}", "eager fp32 (reference)"),
    ("method/modes/eager-vs-graphs", "124M-graphs-fp32-{}", "CUDA graphs, fp32"),
    ("method/modes/eager-vs-graphs", "124M-eager-bf16-fused-{}", "eager, bf16 + SDPA + fused ops"),
    ("kernel/plans-eager-bf16", "124M-eager-bf16-fused-{}", "the same, lora-kernel launching its kernels from C++"),
    ("method/modes/fused-adamw-compile", "124M-graphs-bf16-fused-{}", "CUDA graphs, bf16 + SDPA + fused ops"),
    ("method/modes/fused-adamw-compile", "124M-graphs-bf16-fused-fopt-{}", "… + fused AdamW"),
    ("method/modes/block-compile", "124M-bcompile-graphs-bf16-fused-fopt-{}", "… + each block compiled"),
]


def table_modes_124m() -> str:
    rows = []
    for folder, pattern, what in MODES_124M:
        df = runs(folder).set_index("run_id")
        step = {}
        for layers in LAYERS:
            rid = pattern.format(layers)
            if layers == "lora-kernel" and rid not in df.index:
                rid = pattern.format("lora-kernel-default-0")
            step[layers] = float(df.loc[rid, "step_ms_median"]) if rid in df.index else None
        rows.append([what, *(_ms(step[x]) if step[x] else "-" for x in LAYERS),
                     f"{step['lora'] / step['all']:.2f}", f"`{folder}`"])
    return _table(["124M, batch 8, median step ms", *LAYERS, "lora ÷ all", "results"], rows,
                  align="---|---:|---:|---:|---:|---")


def table_block_compile() -> str:
    df = runs("method/modes/block-compile").set_index("run_id")
    rows = []
    for size in ("124M", "1558M"):
        r = {x: df.loc[f"{size}-bcompile-graphs-bf16-fused-fopt-{x}"] for x in LAYERS}
        rows.append([size, *(f"{_ms(r[x]['step_ms_median'])} ({_ms(r[x]['step_ms_p10'])}–{_ms(r[x]['step_ms_p90'])})"
                             for x in LAYERS),
                     f"{r['lora']['step_ms_median'] / r['all']['step_ms_median']:.2f}",
                     f"{r['lora-kernel']['step_ms_median'] / r['all']['step_ms_median']:.2f}"])
    return _table(["block-compiled + graphs + bf16 + fused ops + fused AdamW, median step ms (p10–p90)", *LAYERS,
                   "lora ÷ all", "lora-kernel ÷ all"], rows)


# -- whole runs: wall time and accuracy -------------------------------------------------------------
WHOLE = [
    ("answer/whole-runs/row10", "row10-124M-all-random", "eager fp32 (book mode)"),
    ("answer/whole-runs/124m-5-epochs", "124M-lora-eager-fp32-5ep", "eager fp32 (book mode)"),
    ("answer/whole-runs/124m-5-epochs", "124M-lora-kernel-eager-fp32-5ep", "eager fp32 (book mode)"),
    ("answer/whole-runs/eager-bf16", "124M-lora-eager-bf16-5ep", "eager bf16 + SDPA + fused ops"),
    ("answer/whole-runs/eager-bf16", "124M-lora-kernel-eager-bf16-5ep", "eager bf16 + SDPA + fused ops"),
    ("answer/whole-runs/124m-5-epochs", "124M-all-graphs-bf16-fused-fopt-5ep", "graphs + bf16 + fused ops + fused AdamW"),
    ("answer/whole-runs/124m-5-epochs", "124M-lora-graphs-bf16-fused-fopt-5ep", "graphs + bf16 + fused ops + fused AdamW"),
    ("answer/whole-runs/124m-5-epochs", "124M-lora-kernel-graphs-bf16-fused-fopt-5ep",
     "graphs + bf16 + fused ops + fused AdamW"),
    ("answer/whole-runs/1558m", "1558M-lora-eager-fp32-2ep", "eager fp32 (book mode)"),
    ("answer/whole-runs/1558m", "1558M-lora-kernel-eager-fp32-2ep", "eager fp32 (book mode)"),
]


def table_whole_runs() -> str:
    rows = []
    for folder, run_id, mode in WHOLE:
        r = runs(folder).set_index("run_id").loc[run_id]
        rows.append([f"{r['model_size']} {r['trainable_layers']}", mode, int(r["cfg_num_epochs"]),
                     f"{r['training_time_s']:.1f}", f"{r['val_acc']:.2f}", f"{r['test_acc']:.2f}", f"`{folder}`"])
    return _table(["run (random weights)", "mode", "epochs", "training s (incl. evaluation)", "val %", "test %",
                   "results"], rows, align="---|---|---:|---:|---:|---:|---")


KERNEL_NAMES = [  # (pattern in the profiler's kernel name, what it is), first match wins
    ("_lora_mm_kernel", "LoRA GEMM, rank-r work folded in (Triton)"),
    ("_lora_grad_ab_kernel", "adapter gradients (Triton)"),
    ("bfloat16_copy", "cast to bf16"),
    ("direct_copy", "copy"),
    ("flash_bprop", "attention backward (cuDNN)"),
    ("flash_fprop", "attention forward (cuDNN)"),
    ("layer_norm_grad", "LayerNorm backward"),
    ("layer_norm", "LayerNorm"),
    ("GeluBackward", "GELU backward"),
    ("Gelu", "GELU"),
    ("CUDAFunctor_add", "add (residuals, gradients)"),
    ("multi_tensor_apply", "AdamW (multi-tensor)"),
]


def _kernel_name(raw: str, names: list[tuple[str, str]] = KERNEL_NAMES, other: str | None = None) -> str:
    """What a profiled kernel does: the first of ``names`` whose pattern its name holds; else
    ``other``, or the start of its own name."""
    fallback = other if other is not None else raw.split("(")[0].split("<")[0][:40]
    return next((name for pattern, name in names if pattern in raw), fallback)


def table_profile_1558m() -> str:
    """Kernel time per step of a 1558M lora-kernel step (eager bf16), grouped by what the kernels do."""
    folder = RESULTS / "method" / "profile-1558m" / "1558M-eager-bf16-fused-lora-kernel"
    top = pd.read_csv(folder / "top_kernels.csv")
    top["what"] = top["kernel"].map(_kernel_name)
    phases = pd.read_csv(folder / "kernels_by_phase.csv").set_index("phase")
    rows = []
    for phase in ("forward", "backward", "optimizer"):
        total = phases.loc[phase]
        rows.append([f"**{phase}**", "", f"**{total['launches_per_step']:,.0f}**", f"**{total['kernel_ms_per_step']:.1f}**"])
        part = top[top["phase"] == phase].groupby("what", sort=False)[["calls_per_step", "ms_per_step"]].sum()
        for what, r in part.sort_values("ms_per_step", ascending=False).head(5).iterrows():
            rows.append(["", what, f"{r['calls_per_step']:,.0f}", f"{r['ms_per_step']:.2f}"])
    return _table(["1558M lora-kernel, eager bf16", "kernels", "launches per step", "kernel ms per step"], rows,
                  align="---|---|---:|---:")


def table_timer_overhead() -> str:
    """The summary lines of the committed timer-overhead log, verbatim."""
    log = (RESULTS / "method" / "phase-timing" / "pinned-omp1" / "overhead.log").read_text().splitlines()
    lines = [line for line in log if line.startswith(("timer overhead", "timer cost"))]
    return "```\n" + "\n".join(lines) + "\n```\n"


# -- the peer rows (results/answer/peers) ------------------------------------------------------------------
PEER_MODES = (("eager-fp32", "eager fp32"), ("eager-bf16-fused", "eager bf16 + SDPA + fused ops"),
              ("best", "best mode"))


def table_peers() -> str:
    """Median step ms of book and hf rows per size and mode, and LoRA over all within each implementation."""
    df = runs("answer/peers")
    df = df[df["status"] == "done"]
    step = {(r.sweep_label, r.model_size, r.cfg_implementation, r.trainable_layers): r.step_ms_median
            for r in df.itertuples()}
    rows = []
    for size in ("124M", "1558M"):
        for label, mode in PEER_MODES:
            b = {k: step[(label, size, "book", k)] for k in LAYERS}
            h = {k: step[(label, size, "hf", k)] for k in ("all", "lora")}
            rows.append([f"{size}, {mode}", _ms(b["all"]), _ms(b["lora"]), _ms(b["lora-kernel"]), _ms(h["all"]),
                         _ms(h["lora"]), f"{b['lora'] / b['all']:.2f}", f"{h['lora'] / h['all']:.2f}",
                         f"{b['lora-kernel'] / h['lora']:.2f}"])
    return _table(["median step ms, batch 8, one H200", "book all", "book lora", "book lora-kernel", "PEFT all",
                   "PEFT lora", "lora ÷ all (book)", "lora ÷ all (PEFT)", "lora-kernel ÷ PEFT lora"], rows)


# -- data parallelism on two GPUs (results/scaling/ddp-2gpu) ----------------------------------------
def table_ddp() -> str:
    """Tokens/s on one GPU (the median of the one-worker sweep's repeats) and under DDP on two, with
    the all-reduce time (eager only: inside a captured step it is not timed apart)."""
    from benchmarks.ddp_table import table, walls

    t = table(RESULTS / "scaling" / "ddp-2gpu")
    rows = []
    for graphs, mode in (("False", "eager fp32"), ("True", "CUDA graphs + bf16 + fused")):
        for size in ("1558M", "124M"):
            for layers in ("all", "lora", "lora-kernel"):
                m = t[(t["size"] == size) & (t["layers"] == layers) & (t["graphs"].astype(str) == graphs)]
                if m.empty and layers == "lora-kernel":  # measured only where the study ran it
                    continue
                r = m.iloc[0]
                comm = (f"{float(r.b16_allreduce_ms):.1f} / {float(r.b16_exposed_ms):.1f}" if graphs == "False"
                        else "in the graph")
                rows.append([f"{size} {layers}, {mode}", f"{float(r.one_gpu_tok_s):,.0f}", f"{r.b16_tok_s:,.0f}",
                             f"**{r.b16_x:.2f}×**", comm, f"{r.b8_tok_s:,.0f}", f"{r.b8_x:.2f}×"])
    w = walls(RESULTS / "scaling" / "ddp-2gpu")
    one, two = w["sweep-1-worker"], w["sweep-2-workers"]
    return (_table(["tokens/s, one H200 vs two (DDP, NCCL)", "1 GPU, batch 8", "2 GPUs, 8 per GPU", "speed-up",
                    "all-reduce / not hidden, ms per step", "2 GPUs, global batch 8", "speed-up"], rows)
            + f"\nThe 16-run sweep (`configs/dask-2gpu.yaml`): {one:.1f} s on one Dask worker, {two:.1f} s on two "
              f"(one per GPU): {two / one:.3f}× the one-GPU wall time.\n")


# -- one layer's candidate plans under CUDA-graph replay (results/kernel/graph-candidates) ----------
CANDIDATE_SHAPES = ("960:768->768:r16", "960:768->3072:r16", "960:3072->768:r16",
                    "960:1600->1600:r16", "960:1600->6400:r16", "960:6400->1600:r16")


def _candidate_rows(df: pd.DataFrame, dtype: str, skip: set[str] = frozenset()) -> list[list]:
    """One row per candidate: kernels fwd + bwd, then × frozen under graph replay at each shape."""
    df = df[(df["dtype"] == dtype) & (df["check"] == "ok")]
    rows = []
    for cand in df["candidate"].drop_duplicates():
        if cand in skip:
            continue
        sub = df[df["candidate"] == cand].set_index("shape")
        k = sub.iloc[0]
        rows.append([f"`{cand}`", f"{int(k.kernels_fwd)} + {int(k.kernels_bwd)}",
                     *(f"{sub.loc[sh, 'graph_x_frozen']:.2f}" for sh in CANDIDATE_SHAPES)])
    return rows


def _frozen_us(df: pd.DataFrame, dtype: str, label: str) -> list:
    frozen = df[(df["candidate"] == "frozen") & (df["dtype"] == dtype)].set_index("shape")
    return [label, "", *(f"{frozen.loc[sh, 'graph_us']:.1f}" for sh in CANDIDATE_SHAPES)]


def table_graph_candidates() -> str:
    """bf16 device time of forward+backward replayed from a CUDA graph, × the frozen layer, and kernels."""
    df = pd.read_csv(RESULTS / "kernel" / "graph-candidates" / "graph_candidates.csv")
    rows = _candidate_rows(df, "bf16") + [_frozen_us(df, "bf16", "frozen µs")]
    names = [sh.split(":")[1].replace("->", "→") for sh in CANDIDATE_SHAPES]
    return _table(["bf16, × frozen (graph replay)", "kernels fwd + bwd", *names], rows)


def table_graph_candidates_hopper() -> str:
    """The TMA kernels and the streams plan (their own run, with the reference candidates re-measured
    beside them), bf16; and the streams plan in exact fp32."""
    folder = RESULTS / "kernel" / "graph-candidates"
    bf16 = pd.read_csv(folder / "hopper-and-streams" / "graph_candidates.csv")
    fp32 = pd.read_csv(folder / "streams-fp32" / "graph_candidates.csv")
    rows = _candidate_rows(bf16, "bf16") + [_frozen_us(bf16, "bf16", "frozen µs")]
    rows += [[f"fp32 {r[0]}", *r[1:]] for r in _candidate_rows(fp32, "fp32", skip={"frozen"})]
    rows.append(_frozen_us(fp32, "fp32", "fp32 frozen µs"))
    names = [sh.split(":")[1].replace("->", "→") for sh in CANDIDATE_SHAPES]
    return _table(["× frozen (graph replay)", "kernels fwd + bwd", *names], rows)


def table_step_kernels() -> str:
    """Best-mode steps: median step, kernels per captured graph, microseconds per kernel, capture."""
    df = pd.read_csv(RESULTS / "kernel" / "graph-kernels" / "runs.csv")
    rows = []
    for _, r in df.iterrows():
        kernels = int(r.graph_kernels_forward + r.graph_kernels_backward + r.graph_kernels_optimizer)
        rows.append([f"{r.model_size} {r.trainable_layers}", f"{r.step_ms_median:.2f}",
                     f"{int(r.graph_kernels_forward)} / {int(r.graph_kernels_backward)} / {int(r.graph_kernels_optimizer)}",
                     f"{kernels:,}", f"{1000 * r.step_ms_median / kernels:.1f}", f"{r.graph_capture_s:.1f}"])
    return _table(["blocks compiled + CUDA graphs + bf16 + fused, one H200", "step ms", "kernels fwd / bwd / opt",
                   "kernels per step", "µs per kernel", "warm-up + capture s"], rows)


def table_five_epochs() -> str:
    """124M, 5 epochs in CUDA graphs: where a whole run's time goes."""
    df = pd.read_csv(RESULTS / "kernel" / "graph-kernels" / "five-epochs" / "runs.csv")
    rows = []
    for _, r in df.iterrows():
        steps_s = r.steps * r.step_ms_median / 1000
        rows.append([f"{r.model_size} {r.trainable_layers}", f"{r.training_time_s:.2f}", f"{int(r.steps)}",
                     f"{r.step_ms_median:.2f}", f"{steps_s:.2f}", f"{r.eval_s:.2f}", f"{r.graph_capture_s:.2f}",
                     f"{r.training_time_s - steps_s - r.eval_s - r.graph_capture_s:.2f}",
                     f"{r.val_acc:.2f} / {r.test_acc:.2f}"])
    return _table(["5 epochs, CUDA graphs + bf16 + fused, one H200", "training s", "steps", "step ms",
                   "steps × step ms, s", "evaluation s", "warm-up + capture s", "rest s", "val / test %"], rows)


def table_qkv_group() -> str:
    """lora-kernel with query/key/value side by side against one by one, A-B-A-B in one call."""
    rows = []
    df = pd.read_csv(RESULTS / "kernel" / "qkv-group" / "runs.csv")
    for size in ("124M", "1558M"):
        part = df[df.model_size == size]
        one = part[~part.cfg_group_qkv.astype(bool)]
        grp = part[part.cfg_group_qkv.astype(bool)]
        fmt = lambda d: " / ".join(f"{v:.2f}" for v in d.step_ms_median)  # noqa: E731
        spread = lambda d: " / ".join(f"{a:.2f}–{b:.2f}" for a, b in zip(d.step_ms_p10, d.step_ms_p90))  # noqa: E731
        k = lambda d: f"{int(d.graph_kernels_forward.iloc[0])} / {int(d.graph_kernels_backward.iloc[0])}"  # noqa: E731
        rows.append([size, fmt(one), fmt(grp), spread(grp), k(one), k(grp),
                     f"{grp.step_ms_median.median() / one.step_ms_median.median():.3f}"])
    return _table(["lora-kernel, CUDA graphs + bf16 + fused, one H200", "one by one, step ms", "grouped, step ms",
                   "grouped p10–p90", "kernels fwd / bwd, one by one", "kernels fwd / bwd, grouped",
                   "grouped / one by one"], rows)


def table_first_use() -> str:
    """A 124M 5-epoch run's one-time costs with cold and warm caches."""
    df = pd.read_csv(RESULTS / "kernel" / "first-use" / "runs.csv")
    rows = []
    for _, r in df.iterrows():
        steps_s = r.steps * r.step_ms_median / 1000
        rows.append([f"124M {r.trainable_layers}, {r.run_id.rsplit('-', 2)[-2]} caches", f"{r.training_time_s:.2f}",
                     f"{r.step_ms_median:.2f}", f"{steps_s:.2f}", f"{r.eval_s:.2f}", f"{r.graph_capture_s:.2f}",
                     f"{r.training_time_s - steps_s - r.eval_s - r.graph_capture_s:.2f}",
                     f"{r.val_acc:.2f} / {r.test_acc:.2f}"])
    return _table(["5 epochs, CUDA graphs + bf16 + fused, one H200", "training s", "step ms", "steps × step ms, s",
                   "evaluation s", "warm-up + capture s", "rest s", "val / test %"], rows)


def table_plan_rules() -> str:
    """lora-kernel's rule table (lora_bench.kernels.rules), first match wins."""
    from lora_bench.kernels.rules import RULES

    rows = [[str(i), r.name, f"`{r.plan.value}`", r.evidence, f"`{r.source}`" if r.source else ""]
            for i, r in enumerate(RULES, 1)]
    return _table(["", "calls", "plan", "measured", "where"], rows, align="---:|---|---|---|---")


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
        rows.append([f"`{path.parent.relative_to(ROOT).as_posix()}`", len(steps), _ms(statistics.median(steps)),
                     f"{_ms(steps[0])}–{_ms(steps[-1])}", env,
                     f"{statistics.median(probe):.1f}" if len(probe) else "not recorded"])
    return _table(["folder", "runs", "step ms (median)", "range", "recorded environment", "host op µs"], rows,
                  align="---|---:|---:|---:|---|---:")


# -- packed sweeps and the quantized base (results/answer/packing, results/answer/quantized) ----------
PACKING = "answer/packing"


def table_packing() -> str:
    """configs/packing-study.yaml packed (--pack 16) against one by one (--pack 1), one call: the
    whole sweep's training time (``training_time_s``, its periodic evaluations included; a pack's is
    shared by its points, so counted once) and of it the evaluations' (``eval_s``), per point, the
    step, aggregate tokens/s, peak memory per point, and the points' validation accuracy."""
    out = {}
    for way in ("packed", "one-by-one"):
        df = runs(f"{PACKING}/{way}")
        df = df[df["status"] == "done"]
        if way == "packed":
            packs = df.groupby("pack_id")
            train = float(packs["training_time_s"].first().sum())
            evals = float(packs["eval_s"].first().sum())
            rate = float(packs["tokens_per_s"].sum().sum())
            mem = float((packs["peak_mem_allocated_mib"].first() / packs.size()).median())
            step = float(packs["step_ms_median"].first().median())
        else:
            train, evals = float(df["training_time_s"].sum()), float(df["eval_s"].sum())
            rate = float(df["tokens_per_s"].median())
            mem = float(df["peak_mem_allocated_mib"].median())
            step = float(df["step_ms_median"].median())
        out[way] = (len(df), train, evals, step, rate, mem, float(df["val_acc"].median()))
    rows = []
    for way, label in (("packed", "`--pack 16`: one pack"), ("one-by-one", "`--pack 1`: one after another")):
        n, train, evals, step, rate, mem, acc = out[way]
        rows.append([label, n, f"{train:.1f}", f"{evals:.1f}", f"{train / n:.2f}", _ms(step),
                     f"{rate:,.0f}", f"{mem:,.0f}", f"{acc:.1f}"])
    (_, tp, ep, _, rp, mp, _), (_, ts, es, _, rs, ms, _) = out["packed"], out["one-by-one"]
    rows.append(["one by one ÷ packed", "", f"{ts / tp:.2f}×", f"{es / ep:.2f}×", f"{ts / tp:.2f}×",
                 "", f"{rs / rp:.2f}×", f"{ms / mp:.2f}×", ""])
    return _table(["124M, 16 LoRA points, 5 epochs, best mode, one H200", "points", "training s (evaluations included)",
                   "of which evaluation s", "training s per point", "step ms", "tokens/s (all points)",
                   "peak MiB per point", "val acc % (median)"], rows)


def table_packing_step() -> str:
    """The packed step against the solo step it replaces, per point, at 124M (the packing-overhead
    repeats' pack; the packing study's solo runs) and 1558M (the pack and the solo runs of one
    call): median step and phases (a pack's
    runs share them: counted once per pack), per point, and peak memory per point."""
    def side(df: pd.DataFrame, packed: bool) -> list:
        df = df[df["step_ms_median"].notna()]
        if packed:
            df = df[df["pack_id"].fillna("").astype(str) != ""]
            first = df.groupby("pack_id").first()
            n = int(df.groupby("pack_id").size().median())
            mem = float((first["peak_mem_allocated_mib"] / n).median())
        else:
            first, n, mem = df, 1, float(df["peak_mem_allocated_mib"].median())
        phases = [float(first[f"{ph}_ms_median"].median()) for ph in ("step", "forward", "backward", "optimizer")]
        return [len(first), n, *phases, mem]

    rows = []
    for size, packed_dir, solo_dir in (("124M", "overhead", "one-by-one"), ("1558M", "1558m-packed", "1558m-one-by-one")):
        pk, so = side(runs(f"{PACKING}/{packed_dir}"), True), side(runs(f"{PACKING}/{solo_dir}"), False)
        for label, (m, n, step, fwd, bwd, opt, mem) in ((f"{size} packed", pk), (f"{size} one by one", so)):
            rows.append([label, m, n, _ms(step), _ms(step / n), _ms(fwd), _ms(bwd), _ms(opt), f"{mem:,.0f}"])
        rows.append([f"{size} packed ÷ one by one, per point", "", "", "", f"{pk[2] / pk[1] / so[2]:.2f}×", "", "", "",
                     f"{pk[6] / so[6]:.2f}×"])
    return _table(["batch 8 per point, best mode, one H200", "packs or runs", "points per step", "step ms",
                   "step ms per point", "forward ms", "backward ms", "optimizer ms", "peak MiB per point"], rows)


QUANTIZED = "answer/quantized"
BASES = ("precision", "bf16", "fp8", "int8", "nf4")


def table_quantized(folder: str = QUANTIZED, bases: tuple[str, ...] = BASES, *, kernels: bool = False) -> str:
    """configs/quantized-base-study.yaml (or another sweep of lora on stored bases in ``folder``) as
    far as it ran: lora's step with its 95 % interval over the finished repeats, its ratio to the
    bf16 base's (repeats paired) with the verdict, its phases (with ``kernels``, the replayed graph's
    kernels per phase) and the stored block weights per base dtype and size (medians over the
    finished repeats)."""
    from lora_bench.report.stats import interval_text, median_interval, ratio_interval, verdict

    df = runs(folder)
    df = df[(df["cfg_implementation"] == "book") & (df["trainable_layers"] == "lora")]
    done = df[df["status"] == "done"]
    steps = _samples(done, folder, ["model_size", "cfg_base_dtype"], "step_ms_median")
    cols = ["forward_ms_median", "backward_ms_median", "base_weight_mib", "peak_mem_allocated_mib",
            "graph_kernels_forward", "graph_kernels_backward"]
    med = done.groupby(["model_size", "cfg_base_dtype"])[cols].median()
    rows = []
    for size in ("124M", "1558M"):
        if (size, "bf16") not in steps:
            continue
        base = steps[(size, "bf16")]
        for dtype in bases:
            if (size, dtype) not in steps:
                continue
            step = steps[(size, dtype)]
            r, ratio = med.loc[(size, dtype)], ratio_interval(step, base)
            n_done = int(((done["model_size"] == size) & (done["cfg_base_dtype"] == dtype)).sum())
            n_all = int(((df["model_size"] == size) & (df["cfg_base_dtype"] == dtype)).sum())
            vs = "1.00× (baseline)" if dtype == "bf16" else f"{interval_text(ratio, unit='×')} {verdict(ratio)}"
            phases = [_ms(r["forward_ms_median"]), _ms(r["backward_ms_median"])]
            if kernels:
                phases += [f"{r['graph_kernels_forward']:,.0f}", f"{r['graph_kernels_backward']:,.0f}"]
            rows.append([f"{size} {dtype}", f"{n_done} of {n_all}", interval_text(median_interval(step)), vs, *phases,
                         f"{r['base_weight_mib']:,.0f}",
                         f"{r['base_weight_mib'] / med.loc[(size, 'bf16')]['base_weight_mib']:.2f}×",
                         f"{r['peak_mem_allocated_mib']:,.0f}"])
    head = ["fwd ms", "bwd ms"] + (["fwd kernels", "bwd kernels"] if kernels else [])
    return _table(["lora, CUDA graphs + bf16 + SDPA + fused ops + fused AdamW" + (", blocks compiled" if kernels else "")
                   + ", one H200", "runs done", "step ms [95 %]", "÷ bf16 base [95 %]", *head, "block weights MiB",
                   "÷ bf16 base", "peak MiB"], rows, align="---|---|" + "|".join(["---:"] * (5 + len(head))))


QUANTIZED_BNB = "answer/quantized-bnb"
QUANTIZED_BNB_SCALES = "answer/quantized-bnb-scales"
QUANTIZED_COMPILED = "answer/quantized-compiled"


def table_quantized_bnb() -> str:
    """configs/quantized-base-bnb.yaml: lora on the bf16 base and on NF4 from torchao and from
    bitsandbytes, in the study's table form."""
    return table_quantized(QUANTIZED_BNB, ("bf16", "nf4", "nf4-bnb"))


def table_quantized_bnb_scales() -> str:
    """configs/quantized-base-bnb-scales.yaml: lora on the bf16 base and on bitsandbytes' NF4 with
    and without double-quantized scales, in the study's table form."""
    return table_quantized(QUANTIZED_BNB_SCALES, ("bf16", "nf4-bnb", "nf4-bnb-nodq"))


def table_quantized_compiled() -> str:
    """configs/quantized-base-compiled.yaml as far as it ran: the study's 1558M lora rows with each
    block compiled, with the replayed graph's kernels per phase."""
    return table_quantized(QUANTIZED_COMPILED, BASES, kernels=True)


QUANTIZED_ACCURACY = "answer/quantized-accuracy"


def table_quantized_accuracy() -> str:
    """configs/quantized-base-accuracy.yaml as far as it ran: lora's validation and test accuracy
    per base dtype and size over the seeds (median and the seeds' range), and each base's
    difference from the bf16 base in points with its 95 % interval (seeds paired: seed r of every
    base starts from the same model)."""
    from lora_bench.config import BASE_DTYPES
    from lora_bench.report.stats import difference_interval, interval_text

    df = runs(QUANTIZED_ACCURACY)
    done = df[df["status"] == "done"]
    rows = []
    for size in ("124M", "1558M"):
        part = done[done["model_size"] == size]
        val = _samples(part, QUANTIZED_ACCURACY, ["cfg_base_dtype"], "val_acc")
        test = _samples(part, QUANTIZED_ACCURACY, ["cfg_base_dtype"], "test_acc")
        for dtype in BASE_DTYPES:
            if (dtype,) not in val:
                continue
            v, t = val[(dtype,)], test[(dtype,)]
            n_all = int(((df["model_size"] == size) & (df["cfg_base_dtype"] == dtype)).sum())
            cells = [f"{size} {dtype}", f"{len(v.values)} of {n_all}",
                     f"{v.point:.1f} ({v.values.min():.1f}–{v.values.max():.1f})",
                     f"{t.point:.1f} ({t.values.min():.1f}–{t.values.max():.1f})"]
            for candidate, baseline in ((v, val[("bf16",)]), (t, test[("bf16",)])):
                cells.append("(baseline)" if dtype == "bf16" else
                             interval_text(difference_interval(candidate, baseline), digits=1, unit=" pt"))
            rows.append(cells)
    return _table(["lora r16, random weights, best mode", "seeds done", "val % median (seeds' range)",
                   "test % median (seeds' range)", "val − bf16 base [95 %]", "test − bf16 base [95 %]"], rows,
                  align="---|---|---:|---:|---:|---:")


QUANTIZED_PROFILE = "answer/quantized-profile"
QUANT_KERNELS = [  # (pattern in the profiler's kernel name, what it does on a stored base), first match wins
    ("qqtst", "float8 GEMM (torch._scaled_mm)"),
    ("nvjet", "bf16 GEMM (cuBLAS)"),
    ("MaxNanFunctor", "absmax of each activation row (fp8 scales)"),
    ("DivFunctor", "divide by a scale"),
    ("MulFunctor", "multiply by a scale"),
    ("CatArrayBatchedCopy", "concatenate (NF4 dequantization)"),
    ("kDequantizeBlockwise", "dequantize blocks (bitsandbytes' NF4 and its scales)"),
    ("index_elementwise", "code-table lookup (NF4 dequantization)"),
    ("bfloat16_copy", "cast to bf16"),
    ("direct_copy", "copy or cast"),
    ("CUDAFunctor_add", "add"),
]
QUANT_GROUPS = [name for _, name in QUANT_KERNELS]
OTHER_KERNELS = "everything else"


def table_quantized_profile() -> str:
    """configs/quantized-base-profile.yaml: kernel ms per step of a 1558M lora step (eager) on each
    base, forward and backward together, grouped by what the kernels do (the 60 costliest kernels of
    each run; the rest as "everything else"), with the phases' totals and launches."""
    df = runs(QUANTIZED_PROFILE)
    df = df[df["status"] == "done"].set_index("cfg_base_dtype")
    from lora_bench.config import BASE_DTYPES

    order = [b for b in BASE_DTYPES if b in df.index]
    groups: dict[str, dict[str, float]] = {g: {} for g in [*QUANT_GROUPS, OTHER_KERNELS]}
    totals: dict[str, dict[str, float]] = {}
    for dtype in order:
        folder = RESULTS / QUANTIZED_PROFILE / df.loc[dtype, "run_id"]
        phases = pd.read_csv(folder / "kernels_by_phase.csv").set_index("phase")
        top = pd.read_csv(folder / "top_kernels.csv")
        top = top[top["phase"].isin(["forward", "backward"])]
        top["what"] = top["kernel"].map(lambda k: _kernel_name(k, QUANT_KERNELS, OTHER_KERNELS))
        by = top.groupby("what")["ms_per_step"].sum()
        fb = phases.loc[["forward", "backward"]]
        for g in groups:
            groups[g][dtype] = float(by.get(g, 0.0))
        groups[OTHER_KERNELS][dtype] += float(fb["kernel_ms_per_step"].sum() - top["ms_per_step"].sum())
        totals[dtype] = {"forward": float(fb.loc["forward", "kernel_ms_per_step"]),
                         "backward": float(fb.loc["backward", "kernel_ms_per_step"]),
                         "launches": float(fb["launches_per_step"].sum())}
    rows = [[what, *(f"{groups[what][d]:.2f}" for d in order)] for what in groups
            if any(groups[what][d] >= 0.005 for d in order)]
    rows += [["**forward kernel ms**", *(f"**{totals[d]['forward']:.1f}**" for d in order)],
             ["**backward kernel ms**", *(f"**{totals[d]['backward']:.1f}**" for d in order)],
             ["launches (forward + backward)", *(f"{totals[d]['launches']:,.0f}" for d in order)]]
    return _table(["1558M lora, eager, kernel ms per step (forward + backward)", *(f"{d} base" for d in order)], rows,
                  align="---|" + "|".join(["---:"] * len(order)))


TABLES = {
    "packing": table_packing,
    "packing-step": table_packing_step,
    "quantized": table_quantized,
    "quantized-accuracy": table_quantized_accuracy,
    "quantized-bnb": table_quantized_bnb,
    "quantized-bnb-scales": table_quantized_bnb_scales,
    "quantized-compiled": table_quantized_compiled,
    "quantized-profile": table_quantized_profile,
    "answer": table_answer,
    "fastest": table_fastest,
    "study-repeats": table_study_repeats,
    "cause": table_cause,
    "spread-124m": table_spread_124m,
    "plan-rules": table_plan_rules,
    "study-eager": table_study_eager,
    "study-graphs": table_study_graphs,
    "study-phases": table_study_phases,
    "phases-124m": table_phases_124m,
    "profilers": table_profilers,
    "modes-124m": table_modes_124m,
    "block-compile": table_block_compile,
    "whole-runs": table_whole_runs,
    "timer-overhead": table_timer_overhead,
    "profile-1558m": table_profile_1558m,
    "peers": table_peers,
    "ddp": table_ddp,
    "graph-candidates": table_graph_candidates,
    "graph-candidates-hopper": table_graph_candidates_hopper,
    "step-kernels": table_step_kernels,
    "five-epochs": table_five_epochs,
    "qkv-group": table_qkv_group,
    "first-use": table_first_use,
}


# -- docs/results-schema.md ------------------------------------------------------------------------
def results_schema() -> str:
    def cols(columns) -> list[list]:
        return [[f"`{c.name}`", c.unit, c.help, c.better] for c in columns]

    settings = [[f"`{SETTING_PREFIX}{name}`", f"`{value!r}`"] for name, value in TrainConfig().to_dict().items()]
    lines = [
        "# Results schema",
        "",
        "<!-- Generated by `python docs/generate.py` from lora_bench/results/schema.py; do not edit. -->",
        "",
        "A results folder (`--results-dir`, default `results/runs`) holds `runs.csv` (one row per run,",
        "rewritten atomically), per run `<run_id>/steps.csv` (one row per training step), `<run_id>/run.json`",
        "(the row, the printed log, the loss and accuracy curves) and profiler outputs, and `manifest.json`",
        "(provenance: one entry per command that wrote into the folder). Units and which direction is better",
        "come from `lora_bench/results/schema.py`, the one declaration the writer, `lora-bench report`,",
        "`lora-bench compare` (whose verdicts follow that direction) and this page share. A",
        "report of a group with one run resamples that run's `steps.csv` for its interval",
        "([measuring.md](measuring.md#repeats-intervals-and-verdicts)).",
        "",
        "Every text cell is quoted. A text cell a spreadsheet would run as a formula (it starts with `=`, `+`,",
        "`-`, `@`, a tab or a carriage return; numbers such as `-1.5` excepted) is stored with a leading `'`, as",
        "is a text that starts with `'` itself; lora-bench's readers drop that one quote, so every value reads",
        "back exactly as it was recorded (`lora_bench/escaping.py`). `lora-bench report --format csv` escapes",
        "formulas the same way.",
        "",
        "## runs.csv: results",
        "",
        _table(["column", "unit", "meaning", "better"], cols(RUN_COLUMNS), align="---|---|---|---").rstrip(),
        "",
        f"The phase columns exist for each phase in {', '.join(PHASES)} (and `step`, their sum).",
        "",
        "## Statuses",
        "",
        _table(["status", "meaning"], [[f"`{k}`", v] for k, v in STATUSES.items()], align="---|---").rstrip(),
        "",
        "A run's record is saved as one: begun before the run trains (its row, then `run.json`, say `running`)",
        "and finished when it ends (`steps.csv`, then `run.json`, then the row). `run.json` wins over `runs.csv`",
        "wherever they differ, and the next write brings the row in line; a terminating signal waits until a",
        "save is done. A run's record is read only from the folder named by its run id (a copied folder is not",
        "the run). Commands exit with 0, 1 (a run failed), 2 (a usage error: nothing ran), 3 (a needed download",
        "could not be done), 4 (a result did not fit on disk: the message names the folder and the space",
        "needed; a sweep stops there) or 128 + N (stopped by signal N, 130 for Ctrl-C).",
        "",
        "## runs.csv: environment",
        "",
        _table(["column", "unit", "meaning", "better"], cols(ENV_COLUMNS), align="---|---|---|---").rstrip(),
        "",
        "## runs.csv: settings",
        "",
        f"Every setting of the run is a column `{SETTING_PREFIX}<name>`; the value here is the default. A column",
        "an older row lacks, or leaves empty, holds the default.",
        "",
        _table(["column", "default"], settings, align="---|---").rstrip(),
        "",
        "## steps.csv",
        "",
        _table(["column", "unit", "meaning", "better"], cols(STEP_COLUMNS), align="---|---|---|---").rstrip(),
        "",
        "## manifest.json",
        "",
        "`{\"description\": str, \"invocations\": [entry, ...]}`, one entry per command that wrote into the folder",
        "(`lora-bench train`, `sweep`, `kernel-bench`, the `benchmarks/` scripts); a sweep's runs in child",
        "processes join their sweep's entry.",
        "",
        _table(["field", "meaning"], [
            ["`id`", "launch time, host, process id and a random suffix"],
            ["`source`", "`recorded at launch`, or `reconstructed from rows` for results older than their manifest"],
            ["`command`", "the command line, the executable written as `lora-bench` or `python -m <module>`"],
            ["`git_commit`", "the source commit when the command started, or `unknown`"],
            ["`git_dirty`", "true when tracked files differed from that commit; null when it cannot be told"],
            ["`commit_source`", "`git` (`git rev-parse` of the checkout), `LORA_BENCH_GIT_COMMIT` (passed in by a copy "
                                "of the tree without git history), `git_commit column` (reconstructed) or `unknown`"],
            ["`started_at`", "UTC start time (ISO 8601)"],
            ["`last_written_at`", "UTC time (ISO 8601) of the command's last write here (a sweep: its last run's row; less `started_at`, the sweep's wall time); absent from older entries"],
            ["`lora_bench_version`", "package version"],
            ["`environment`", "versions, GPUs (as `nvidia-smi` lists them), CPU, host"],
            ["`run_ids`", "the runs the command produced in this folder"],
            ["`outputs`", "other files it wrote, relative to the folder"],
        ], align="---|---").rstrip(),
        "",
        "`lora-bench results index results` writes `results/README.md` from the manifests and rows;",
        "`lora-bench results prune DIR --superseded` moves rows replaced by a newer run of the same sweep,",
        "settings and repeat (and their run folders) to `DIR/superseded/`, numbers untouched.",
    ]
    return "\n".join(lines) + "\n"


# -- driver -----------------------------------------------------------------------------------------
def render_blocks(text: str) -> str:
    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise KeyError(f"unknown generated block {name!r}; known: {', '.join(TABLES)}")
        return m.group(1) + TABLES[name]() + m.group(4)

    return BLOCK.sub(fill, text)


def expected() -> dict[Path, str]:
    """Every generated file (or file with generated blocks) and the content it should have."""
    out = {ROOT / "docs" / "results-schema.md": results_schema()}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.name == "results-schema.md" or not path.is_file():
            continue
        text = path.read_text()
        if BLOCK.search(text):
            out[path] = render_blocks(text)
    return out


def outdated() -> list[Path]:
    return [p for p, text in expected().items() if not p.is_file() or p.read_text() != text]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is out of date")
    args = ap.parse_args()
    stale = outdated()
    if args.check:
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)} (run `python docs/generate.py`)")
        sys.exit(1 if stale else 0)
    for path, text in expected().items():
        if path in stale:
            atomic_write_text(path, text)
            print(f"written: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
