"""The docs tables of the method and kernel pages: execution modes, block compilation, whole runs,
the 1558M profile, the timer's overhead, the peer rows, one layer's candidate plans under graph
replay, the best mode's kernels per step, and the rule table of lora-kernel's plans."""

from __future__ import annotations

import pandas as pd

from lora_bench.kernels.plan_rules import RULES
from lora_bench.publish.source import LAYERS, RESULTS, fmt_ms, kernel_name, md_table, runs

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
        rows.append([what, *(fmt_ms(step[x]) if step[x] else "-" for x in LAYERS),
                     f"{step['lora'] / step['all']:.2f}", f"`{folder}`"])
    return md_table(["124M, batch 8, median step ms", *LAYERS, "lora ÷ all", "results"], rows,
                  align="---|---:|---:|---:|---:|---")


def table_block_compile() -> str:
    df = runs("method/modes/block-compile").set_index("run_id")
    rows = []
    for size in ("124M", "1558M"):
        r = {x: df.loc[f"{size}-bcompile-graphs-bf16-fused-fopt-{x}"] for x in LAYERS}
        rows.append([size, *(f"{fmt_ms(r[x]['step_ms_median'])} ({fmt_ms(r[x]['step_ms_p10'])}–{fmt_ms(r[x]['step_ms_p90'])})"
                             for x in LAYERS),
                     f"{r['lora']['step_ms_median'] / r['all']['step_ms_median']:.2f}",
                     f"{r['lora-kernel']['step_ms_median'] / r['all']['step_ms_median']:.2f}"])
    return md_table(["block-compiled + graphs + bf16 + fused ops + fused AdamW, median step ms (p10–p90)", *LAYERS,
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
    return md_table(["run (random weights)", "mode", "epochs", "training s (incl. evaluation)", "val %", "test %",
                   "results"], rows, align="---|---|---:|---:|---:|---:|---")


def table_profile_1558m() -> str:
    """Kernel time per step of a 1558M lora-kernel step (eager bf16), grouped by what the kernels do."""
    folder = RESULTS / "method" / "profile-1558m" / "1558M-eager-bf16-fused-lora-kernel"
    top = pd.read_csv(folder / "top_kernels.csv")
    top["what"] = top["kernel"].map(kernel_name)
    phases = pd.read_csv(folder / "kernels_by_phase.csv").set_index("phase")
    rows = []
    for phase in ("forward", "backward", "optimizer"):
        total = phases.loc[phase]
        rows.append([f"**{phase}**", "", f"**{total['launches_per_step']:,.0f}**", f"**{total['kernel_ms_per_step']:.1f}**"])
        part = top[top["phase"] == phase].groupby("what", sort=False)[["calls_per_step", "ms_per_step"]].sum()
        for what, r in part.sort_values("ms_per_step", ascending=False).head(5).iterrows():
            rows.append(["", what, f"{r['calls_per_step']:,.0f}", f"{r['ms_per_step']:.2f}"])
    return md_table(["1558M lora-kernel, eager bf16", "kernels", "launches per step", "kernel ms per step"], rows,
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
            rows.append([f"{size}, {mode}", fmt_ms(b["all"]), fmt_ms(b["lora"]), fmt_ms(b["lora-kernel"]), fmt_ms(h["all"]),
                         fmt_ms(h["lora"]), f"{b['lora'] / b['all']:.2f}", f"{h['lora'] / h['all']:.2f}",
                         f"{b['lora-kernel'] / h['lora']:.2f}"])
    return md_table(["median step ms, batch 8, one H200", "book all", "book lora", "book lora-kernel", "PEFT all",
                   "PEFT lora", "lora ÷ all (book)", "lora ÷ all (PEFT)", "lora-kernel ÷ PEFT lora"], rows)


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
    return md_table(["bf16, × frozen (graph replay)", "kernels fwd + bwd", *names], rows)


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
    return md_table(["× frozen (graph replay)", "kernels fwd + bwd", *names], rows)


def table_step_kernels() -> str:
    """Best-mode steps: median step, kernels per captured graph, microseconds per kernel, capture."""
    df = pd.read_csv(RESULTS / "kernel" / "graph-kernels" / "runs.csv")
    rows = []
    for _, r in df.iterrows():
        kernels = int(r.graph_kernels_forward + r.graph_kernels_backward + r.graph_kernels_optimizer)
        rows.append([f"{r.model_size} {r.trainable_layers}", f"{r.step_ms_median:.2f}",
                     f"{int(r.graph_kernels_forward)} / {int(r.graph_kernels_backward)} / {int(r.graph_kernels_optimizer)}",
                     f"{kernels:,}", f"{1000 * r.step_ms_median / kernels:.1f}", f"{r.graph_capture_s:.1f}"])
    return md_table(["blocks compiled + CUDA graphs + bf16 + fused, one H200", "step ms", "kernels fwd / bwd / opt",
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
    return md_table(["5 epochs, CUDA graphs + bf16 + fused, one H200", "training s", "steps", "step ms",
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
    return md_table(["lora-kernel, CUDA graphs + bf16 + fused, one H200", "one by one, step ms", "grouped, step ms",
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
    return md_table(["5 epochs, CUDA graphs + bf16 + fused, one H200", "training s", "step ms", "steps × step ms, s",
                   "evaluation s", "warm-up + capture s", "rest s", "val / test %"], rows)


def table_plan_rules() -> str:
    """lora-kernel's rule table (lora_bench.kernels.plan_rules), first match wins."""
    rows = [[str(i), r.name, f"`{r.plan.value}`", r.evidence, f"`{r.source}`" if r.source else ""]
            for i, r in enumerate(RULES, 1)]
    return md_table(["", "calls", "plan", "measured", "where"], rows, align="---:|---|---|---|---")
