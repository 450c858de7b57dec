"""The docs tables of packed sweeps and of LoRA on stored (quantized) bases: packed against one by
one, the packed step, and per base its step with the ratio to the bf16 base and its verdict, its
accuracy's difference from the bf16 base, and its kernels (lora_bench.report.groups for every
interval and verdict)."""

from __future__ import annotations

import pandas as pd

from lora_bench.config import BASE_DTYPES
from lora_bench.publish.source import RESULTS, as_read, fmt_ms, kernel_name, md_table, runs
from lora_bench.report.groups import difference, group_runs
from lora_bench.report.samples import sample
from lora_bench.report.stats import UNCLEAR, interval_text

STEP = "step_ms_median"
ACCURACY = ("val_acc", "test_acc")
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
        rows.append([label, n, f"{train:.1f}", f"{evals:.1f}", f"{train / n:.2f}", fmt_ms(step),
                     f"{rate:,.0f}", f"{mem:,.0f}", f"{acc:.1f}"])
    (_, tp, ep, _, rp, mp, _), (_, ts, es, _, rs, ms, _) = out["packed"], out["one-by-one"]
    rows.append(["one by one ÷ packed", "", f"{ts / tp:.2f}×", f"{es / ep:.2f}×", f"{ts / tp:.2f}×",
                 "", f"{rs / rp:.2f}×", f"{ms / mp:.2f}×", ""])
    return md_table(["124M, 16 LoRA points, 5 epochs, best mode, one H200", "points", "training s (evaluations included)",
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
            rows.append([label, m, n, fmt_ms(step), fmt_ms(step / n), fmt_ms(fwd), fmt_ms(bwd), fmt_ms(opt), f"{mem:,.0f}"])
        rows.append([f"{size} packed ÷ one by one, per point", "", "", "", f"{pk[2] / pk[1] / so[2]:.2f}×", "", "", "",
                     f"{pk[6] / so[6]:.2f}×"])
    return md_table(["batch 8 per point, best mode, one H200", "packs or runs", "points per step", "step ms",
                   "step ms per point", "forward ms", "backward ms", "optimizer ms", "peak MiB per point"], rows)


QUANTIZED = "answer/quantized"
BASES = ("precision", "bf16", "fp8", "int8", "nf4")


def table_quantized(folder: str = QUANTIZED, bases: tuple[str, ...] = BASES, *, kernels: bool = False) -> str:
    """configs/quantized-base-study.yaml (or another sweep of lora on stored bases in ``folder``) as
    far as it ran: lora's step with its interval over the finished repeats, its ratio to the
    bf16 base's (repeats paired) with the verdict, its phases (with ``kernels``, the replayed graph's
    kernels per phase) and the stored block weights per base dtype and size (medians over the
    finished repeats)."""
    df = runs(folder)
    df = df[(df["cfg_implementation"] == "book") & (df["trainable_layers"] == "lora")]
    done = df[df["status"] == "done"]
    found = group_runs(as_read(done, folder), ["model_size", "cfg_base_dtype"], metrics=[STEP],
                       baseline={"cfg_base_dtype": "bf16"}, ratio_metric=STEP, lone_baseline=False, unknown=UNCLEAR,
                       sort=True)
    steps = {(g.values["model_size"], g.values["cfg_base_dtype"]): g for g in found}
    cols = ["forward_ms_median", "backward_ms_median", "base_weight_mib", "peak_mem_allocated_mib",
            "graph_kernels_forward", "graph_kernels_backward"]
    med = done.groupby(["model_size", "cfg_base_dtype"])[cols].median()
    rows = []
    for size in ("124M", "1558M"):
        if (size, "bf16") not in steps:
            continue
        for dtype in bases:
            if (size, dtype) not in steps:
                continue
            step = steps[(size, dtype)]
            r, ratio = med.loc[(size, dtype)], step.ratio
            n_done = int(((done["model_size"] == size) & (done["cfg_base_dtype"] == dtype)).sum())
            n_all = int(((df["model_size"] == size) & (df["cfg_base_dtype"] == dtype)).sum())
            vs = "1.00× (baseline)" if dtype == "bf16" else f"{interval_text(ratio, unit='×')} {step.verdict}"
            phases = [fmt_ms(r["forward_ms_median"]), fmt_ms(r["backward_ms_median"])]
            if kernels:
                phases += [f"{r['graph_kernels_forward']:,.0f}", f"{r['graph_kernels_backward']:,.0f}"]
            rows.append([f"{size} {dtype}", f"{n_done} of {n_all}", interval_text(step.estimates[STEP]), vs, *phases,
                         f"{r['base_weight_mib']:,.0f}",
                         f"{r['base_weight_mib'] / med.loc[(size, 'bf16')]['base_weight_mib']:.2f}×",
                         f"{r['peak_mem_allocated_mib']:,.0f}"])
    head = ["fwd ms", "bwd ms"] + (["fwd kernels", "bwd kernels"] if kernels else [])
    return md_table(["lora, CUDA graphs + bf16 + SDPA + fused ops + fused AdamW" + (", blocks compiled" if kernels else "")
                   + ", one H200", "runs done", "step ms [interval]", "÷ bf16 base [interval]", *head, "block weights MiB",
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
    difference from the bf16 base in points with its interval (seeds paired: seed r of every
    base starts from the same model)."""
    df = runs(QUANTIZED_ACCURACY)
    done = df[df["status"] == "done"]
    rows = []
    for size in ("124M", "1558M"):
        part = as_read(done[done["model_size"] == size], QUANTIZED_ACCURACY)
        found = {g.values["cfg_base_dtype"]: g for g in group_runs(part, ["cfg_base_dtype"], sort=True)}
        for dtype in BASE_DTYPES:
            if dtype not in found:
                continue
            v, t = (sample(found[dtype].runs, m) for m in ACCURACY)
            n_all = int(((df["model_size"] == size) & (df["cfg_base_dtype"] == dtype)).sum())
            cells = [f"{size} {dtype}", f"{len(v.values)} of {n_all}",
                     f"{v.point:.1f} ({v.values.min():.1f}–{v.values.max():.1f})",
                     f"{t.point:.1f} ({t.values.min():.1f}–{t.values.max():.1f})"]
            for metric, candidate in zip(ACCURACY, (v, t)):
                d, _ = difference(candidate, sample(found["bf16"].runs, metric))
                cells.append("(baseline)" if dtype == "bf16" else interval_text(d, digits=1, unit=" pt"))
            rows.append(cells)
    return md_table(["lora r16, random weights, best mode", "seeds done", "val % median (seeds' range)",
                   "test % median (seeds' range)", "val − bf16 base [interval]", "test − bf16 base [interval]"], rows,
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
    order = [b for b in BASE_DTYPES if b in df.index]
    groups: dict[str, dict[str, float]] = {g: {} for g in [*QUANT_GROUPS, OTHER_KERNELS]}
    totals: dict[str, dict[str, float]] = {}
    for dtype in order:
        folder = RESULTS / QUANTIZED_PROFILE / df.loc[dtype, "run_id"]
        phases = pd.read_csv(folder / "kernels_by_phase.csv").set_index("phase")
        top = pd.read_csv(folder / "top_kernels.csv")
        top = top[top["phase"].isin(["forward", "backward"])]
        top["what"] = top["kernel"].map(lambda k: kernel_name(k, QUANT_KERNELS, OTHER_KERNELS))
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
    return md_table(["1558M lora, eager, kernel ms per step (forward + backward)", *(f"{d} base" for d in order)], rows,
                  align="---|" + "|".join(["---:"] * len(order)))
