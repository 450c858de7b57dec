"""Profilers around the training loop.

``line``: line_profiler over the loop and the loss function, report saved beside the results —
the method of the reference's own profile of its 124M runs, kept so its host-attributed per-line times can be set
against the device phase times. ``torch``: torch.profiler over a window of steps after warm-up;
saves a gzipped Chrome/Perfetto trace and a per-phase kernel summary (launches per step, device time,
top kernels) as CSV. ``kernels``: the same profile, the summaries only (a trace of a 1558M window
is tens of MB). A pack's profile (lora_bench.train.pack) measures the pack's step, every point at
once: its files go into every point's run folder, and its kernel summaries carry the pack's size.

A profiler sees no kernel inside a replayed CUDA graph, so a ``torch`` or ``kernels`` profile of a
run with ``cuda_graphs`` (``profiles_graphs``) captures no graph: its steps run one by one, every
lora-kernel layer choosing its plan as a capture would (``kernels.policy.graph_plan``) and everything
else built as for the graphs (the capturable optimizer, DoRA's norms formed ahead), so the profile
holds the kernels the graphs replay, launched one at a time. Its step times are not the replay's."""

from __future__ import annotations

import collections
import io
from pathlib import Path
from typing import Callable, Sequence

import torch

from lora_bench.fileio import atomic_write_bytes, atomic_write_text
from lora_bench.train import evaluate
from lora_bench.train import loop as train
from lora_bench.train.recording import write_csv

TORCH_WINDOW = 10  # steps recorded after warm-up


def profiles_graphs(cfg) -> bool:
    """A kernel profile of a step set to replay CUDA graphs: its steps run one by one instead, each
    call choosing as under capture (see the module)."""
    return bool(cfg.cuda_graphs) and cfg.profile in ("torch", "kernels")


class Profiler:
    """``pack_size``: the profile is of a pack of that many runs (a column of the kernel summaries);
    ``line_functions``: what line_profiler follows besides the loop it runs (by default the loop and
    its loss: a solo run's, or a pack's points' losses)."""

    def __init__(self, mode: str, *, run_dir: Path, warmup_steps: int, device: torch.device,
                 pack_size: int | None = None, line_functions: Sequence[Callable] | None = None):
        self.mode = mode
        self.run_dir = Path(run_dir)
        self.device = device
        self.pack_size = pack_size
        self.line_functions = (tuple(line_functions) if line_functions is not None
                               else (train.train_classifier,
                                     evaluate.calc_loss_batch if pack_size is None else evaluate.point_losses))
        self.start = warmup_steps
        self.stop = warmup_steps + TORCH_WINDOW
        self._prof = None
        self._lp = None
        self._active = False
        self.recorded_steps = 0

    @property
    def torch_profile(self) -> bool:
        return self.mode in ("torch", "kernels")

    @property
    def labels_phases(self) -> bool:
        return self.torch_profile

    # -- running ------------------------------------------------------------------------------
    def run(self, fn: Callable, *args, **kw):
        if self.mode == "line":
            from line_profiler import LineProfiler

            self._lp = LineProfiler(*self.line_functions)
            return self._lp(fn)(*args, **kw)
        return fn(*args, **kw)

    def chain(self, on_step: Callable) -> Callable:
        if not self.torch_profile:
            return on_step

        def hook(step: int, epoch: int, loss) -> None:
            # ``step`` is the index of the step that just ended
            if self._active:
                self.recorded_steps += 1
            if step + 1 == self.start:
                self._begin()
            elif step + 1 == self.stop:
                self._end()
            on_step(step, epoch, loss)

        if self.start == 0:
            self._begin()
        return hook

    def _begin(self) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts, record_shapes=False)
        self._prof.__enter__()
        self._active = True
        self.recorded_steps = 0

    def _end(self) -> None:
        if not self._active:
            return  # exiting a profiler twice crashes the process
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.__exit__(None, None, None)
        self._active = False

    # -- output -------------------------------------------------------------------------------
    def finish(self, console, *, copies: Sequence[Path] = ()) -> None:
        """Write the profile into the run folder, and the same files into each of ``copies``."""
        dirs = [self.run_dir, *map(Path, copies)]
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        if self._lp is not None:
            buf = io.StringIO()
            self._lp.print_stats(stream=buf, output_unit=1e-3)
            for d in dirs:
                atomic_write_text(d / "line_profile.txt", buf.getvalue())
            console.print(f"line_profiler report: {self.run_dir / 'line_profile.txt'}")
        if self._prof is not None:
            self._end()
            if self.mode == "torch":
                trace = self.run_dir / "trace.json.gz"  # ~50 MB uncompressed for 10 steps of 124M
                self._prof.export_chrome_trace(str(trace))
                if copies:
                    data = trace.read_bytes()
                    for d in dirs[1:]:
                        atomic_write_bytes(d / trace.name, data)
                console.print(f"torch.profiler trace (open in ui.perfetto.dev): {trace}")
            rows, top = kernel_summary(self._prof, steps=max(self.recorded_steps, 1),
                                       cuda=self.device.type == "cuda")
            if self.pack_size is not None:  # the counts are of the pack's step, every point at once
                rows = [{**r, "pack_size": self.pack_size} for r in rows]
                top = [{**r, "pack_size": self.pack_size} for r in top]
            for d in dirs:
                write_csv(d / "kernels_by_phase.csv", rows, list(rows[0]) if rows else ["phase"])
                write_csv(d / "top_kernels.csv", top, list(top[0]) if top else ["phase"])


def kernel_summary(prof, *, steps: int, cuda: bool) -> tuple[list[dict], list[dict]]:
    """Per phase: device kernels (incl. memcpy/memset) launched per step — top-level aten ops when
    there is no GPU — their device time per step, and the top kernels by time.

    A kernel belongs to the phase whose host-side ``phase:*`` range contains the start of the
    CPU op that launched it (the profiler links each kernel to its op by correlation id). The
    backward's ops run on autograd's own thread, inside the main thread's backward range. A kernel
    launched where no op is open but the phase's own range (a Triton kernel called from an autograd
    Function's forward) is linked to that range itself, so the ranges' kernels count too. A device
    kernel the profiler links to no CPU event at all (a kernel that C++ code launches through the
    driver API, as the ``direct`` plan does) counts in the phase whose range contains its start on
    the device: exact where each phase ends by waiting for the device (``kernel-bench --kernels``),
    else it may fall in a later phase by as much as the device lags the host."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    ranges = sorted((ev.time_range.start, ev.time_range.end, ev.name[6:]) for ev in events
                    if ev.name.startswith("phase:") and ev.device_type == DeviceType.CPU)

    def phase_of(t: float) -> str:
        for start, end, name in ranges:
            if start <= t <= end:
                return name
        return "other"

    count: collections.Counter = collections.Counter()
    dur_us: collections.Counter = collections.Counter()
    per_kernel: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])

    def add(ph: str, name: str, us: float) -> None:
        count[ph] += 1
        dur_us[ph] += us
        acc = per_kernel[(ph, name)]
        acc[0] += 1
        acc[1] += us

    # Which device events the profiler linked to a CPU event: those whose linked correlation id is
    # the id of a CPU event holding kernels (the profiler's own rule). Where the events carry no such
    # ids, the linked kernels as (name, µs), each taken once: two kernels of one name and one
    # duration, one linked and one not, may then trade phases. A range's own device-side span
    # (flagged a user annotation, and named as its CPU range is) is not a kernel.
    cpu = [ev for ev in events if ev.device_type == DeviceType.CPU] if cuda else []
    device = [ev for ev in events if ev.device_type == DeviceType.CUDA] if cuda else []
    by_id = all(hasattr(ev, "id") for ev in cpu) and all(hasattr(ev, "linked_correlation_id") for ev in device)
    linked_ids = {ev.id for ev in cpu if getattr(ev, "kernels", None)} if by_id else set()
    linked: collections.Counter = collections.Counter() if by_id else collections.Counter(
        (k.name, k.duration) for ev in cpu for k in getattr(ev, "kernels", None) or [])
    ranges_named = {ev.name for ev in cpu}

    def linked_to_cpu(ev, key) -> bool:
        if by_id:
            return ev.linked_correlation_id in linked_ids
        if linked[key] > 0:
            linked[key] -= 1
            return True
        return False

    for ev in events:
        if ev.device_type != DeviceType.CPU:
            if (not cuda or ev.device_type != DeviceType.CUDA or getattr(ev, "is_user_annotation", False)
                    or ev.name in ranges_named):
                continue
            key = (ev.name, ev.time_range.end - ev.time_range.start)
            if not linked_to_cpu(ev, key):
                add(phase_of(ev.time_range.start), *key)
            continue
        if cuda:
            ph = ev.name[6:] if ev.name.startswith("phase:") else phase_of(ev.time_range.start)
            for k in getattr(ev, "kernels", None) or []:
                add(ph, k.name, k.duration)
        elif ev.name.startswith("aten::") and not (ev.cpu_parent is not None
                                                   and ev.cpu_parent.name.startswith("aten::")):
            add(phase_of(ev.time_range.start), ev.name, ev.time_range.end - ev.time_range.start)
    unit = "cuda kernels+memcpy" if cuda else "top-level aten ops (CPU)"
    rows = [{"phase": ph, "launches_per_step": count[ph] / steps, "kernel_ms_per_step": dur_us[ph] / 1e3 / steps,
             "unit": unit} for ph in sorted(count)]
    top = sorted(({"phase": ph, "kernel": name[:200], "calls_per_step": c / steps, "ms_per_step": us / 1e3 / steps}
                  for (ph, name), (c, us) in per_kernel.items()), key=lambda r: -r["ms_per_step"])[:60]
    return rows, top
