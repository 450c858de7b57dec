"""``lora-bench kernel-bench``: one LoRA layer timed against the frozen layer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lora_bench.cli.options import NoProgress, console, output_dir, results_dir_option, split_list
from lora_bench.errors import UsageError

CSV_NAME = "kernel_bench.csv"
KERNELS_NAME = "kernel_bench_kernels.csv"  # bench.kernel_profile.kernels_path(CSV_NAME)

HELP = f"""Time one LoRA layer (forward, backward, both) against the frozen layer: the floor.

Writes {CSV_NAME} into the results folder.

Example: [bold]lora-bench kernel-bench --shapes '4x512:768->768:r16' --dtypes bf16[/bold]
"""


def kernel_bench(
    shapes: Annotated[Optional[str], typer.Option(help="Comma-separated: groups guide, 124m, 1558m, or specs "
                                                       "like '4x512:768->768:r16' (quote them in a shell) "
                                                       "(default: all groups).")] = None,
    impls: Annotated[Optional[str], typer.Option(help="Comma-separated subset of frozen, lora, lora-merged, "
                                                      "lora-kernel (lora-kernel:MODE forces a plan: direct, cpp, "
                                                      "fused, cublas, torch) (default: these four), and DoRA's "
                                                      "dora, dora-merged, dora-kernel, "
                                                      "dora-kernel-detached.")] = None,
    dtypes: Annotated[str, typer.Option(help="Comma-separated: fp32, bf16, fp16, and bf16-autocast (the "
                                              "training precision bf16: the frozen weight stored in bfloat16, "
                                              "the adapters float32, each call under autocast).")] = "fp32,bf16",
    device: Annotated[str, typer.Option(help="auto (the first GPU if there is one, else the CPU), cuda, cuda:N, "
                                             "or cpu.")] = "auto",
    repeats: Annotated[int, typer.Option(help="Timed repeats per measurement (median, p10, p90).")] = 200,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up calls.")] = 20,
    cpu: Annotated[bool, typer.Option("--cpu", help="Add a CPU forward+backward column (fp32 rows).")] = False,
    kernels: Annotated[bool, typer.Option("--kernels", help="After the timings, profile each implementation's "
                                                            "eager forward and backward (torch.profiler) and "
                                                            f"write each kernel's launches and device time per "
                                                            f"call to {KERNELS_NAME}.")] = False,
    results_dir: Annotated[Path, results_dir_option(f"Folder for {CSV_NAME}.")] = Path("results/kernel-bench"),
    out: Annotated[Optional[Path], typer.Option("--out", hidden=True, help="The CSV file itself.")] = None,
    no_progress: NoProgress = False,
) -> None:
    import torch

    from lora_bench.bench.kernel_bench import render_kernel_table, run_kernel_bench
    from lora_bench.bench.kernel_profile import kernels_path, render_kernels
    from lora_bench.results.manifest import record_invocation

    csv = out if out is not None else results_dir / CSV_NAME
    made = not csv.parent.exists()
    output_dir(csv.parent, "--out" if out is not None else "--results-dir")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    found: list[dict] | None = [] if kernels else None
    try:
        rows = run_kernel_bench(shapes=split_list(shapes), impls=split_list(impls), dtypes=split_list(dtypes),
                                device=device, repeats=repeats, warmup=warmup, out_csv=csv, cpu=cpu,
                                progress=not no_progress, kernels=found)
    except (ValueError, UsageError) as e:  # bad names or counts, no GPU for device=cuda, a group too big
        if made and csv.parent.is_dir() and not any(csv.parent.iterdir()):
            csv.parent.rmdir()  # refused: nothing left behind, not even the folder made for it
        raise UsageError(str(e)) from e
    written = [csv] + ([kernels_path(csv)] if found is not None else [])
    record_invocation(csv.parent, outputs=[p.name for p in written])
    console.print(render_kernel_table(rows))
    if found is not None:
        console.print(render_kernels(found))
    for p in written:
        console.print(f"written: {p}")
