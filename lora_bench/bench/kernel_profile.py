"""``lora-bench kernel-bench --kernels``: each implementation's eager forward and backward under
torch.profiler, kernel by kernel (``train.profiling.kernel_summary``), written beside the bench
table and shown as the longest kernels per phase."""

from __future__ import annotations

from pathlib import Path

import torch

from lora_bench.train.profiling import kernel_summary

# --kernels: each implementation's eager forward and backward under torch.profiler, kernel by kernel
KERNEL_COLUMNS = ["shape", "dtype", "impl", "backend", "phase", "kernel", "launches_per_call", "us_per_call",
                  "share_of_phase", "unit", "calls"]
PROFILED_CALLS = 20  # profiled forward+backward calls per implementation, after the timed ones


def profile_kernels(sets: list[tuple], *, calls: int, device: torch.device) -> list[dict]:
    """The kernels ``calls`` eager forward+backward calls launch, per phase ('fwd', 'bwd'): each
    kernel's launches and device µs per call (``train.profiling.kernel_summary``: CUDA kernels and
    copies on a GPU, top-level aten ops and their CPU µs on the CPU). Eager, not replayed: a
    profiler sees the kernels each call launches, and the fused layer's eager plan is in the
    ``backend`` column beside them."""
    cuda = device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])

    def call(i: int) -> None:
        # each phase waits for the device before its range closes: a kernel the profiler links to
        # no op counts by where it ran on the device (``kernel_summary``), and it ran inside its phase
        layer, x, g, inputs = sets[i % len(sets)]
        with torch.profiler.record_function("phase:fwd"):
            y = layer(x)
            if cuda:
                torch.cuda.synchronize(device)
        with torch.profiler.record_function("phase:bwd"):
            torch.autograd.grad(y, inputs, g)
            if cuda:
                torch.cuda.synchronize(device)

    for i in range(2):  # whatever a first call compiles or caches stays out of the profile
        call(i)
    if cuda:
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=acts, record_shapes=False) as prof:
        for i in range(calls):
            call(i)
        if cuda:
            torch.cuda.synchronize(device)
    phases, top = kernel_summary(prof, steps=calls, cuda=cuda)
    total = {r["phase"]: r["kernel_ms_per_step"] for r in phases}
    unit = phases[0]["unit"] if phases else ""
    order = ("fwd", "bwd")  # forward's kernels, then backward's, each the longest first
    return [{"phase": t["phase"], "kernel": t["kernel"], "launches_per_call": t["calls_per_step"],
             "us_per_call": 1e3 * t["ms_per_step"],
             "share_of_phase": t["ms_per_step"] / total[t["phase"]] if total.get(t["phase"]) else None,
             "unit": unit, "calls": calls}
            for t in sorted((t for t in top if t["phase"] in order),
                            key=lambda t: (order.index(t["phase"]), -t["ms_per_step"]))]


def kernels_path(out_csv: Path) -> Path:
    """Where ``--kernels`` writes its table: beside the bench table, ``<name>_kernels.csv``."""
    return out_csv.with_name(out_csv.stem + "_kernels.csv")


def render_kernels(kernels: list[dict], *, top: int = 4):
    """A rich Table of ``--kernels``' profile: per shape, dtype, implementation and phase, the
    ``top`` kernels by device time per call, with what the phase's kernels come to in all."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"Kernels per forward / backward call (eager, profiled; the {top} longest per phase)")
    for col in ("shape", "dtype", "impl", "phase", "kernel", "launches", "us", "share"):
        t.add_column(col, justify="right" if col in ("launches", "us", "share") else "left")
    seen: dict[tuple, int] = {}
    for k in kernels:
        key = (k["shape"], k["dtype"], k["impl"], k["phase"])
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > top:
            continue
        share = k.get("share_of_phase")
        t.add_row(*(Text(str(v)) for v in (*key, k["kernel"][:80])), f"{k['launches_per_call']:g}",
                  f"{k['us_per_call']:.1f}", "" if share is None else f"{100 * share:.0f} %")
    return t


__all__ = ["KERNEL_COLUMNS", "PROFILED_CALLS", "kernels_path", "profile_kernels", "render_kernels"]
