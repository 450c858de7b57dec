"""``lora-bench kernel-bench``: time one LoRA layer, forward / backward / forward+backward.

Implementations: ``frozen`` (a plain frozen nn.Linear whose input requires grad: only the input
gradient, the floor any LoRA layer sits on), ``lora``, ``lora-merged``, ``lora-kernel``; for
measurements ``lora-kernel:PLAN`` forces one of lora-kernel's plans through the plan policy
(:mod:`lora_bench.kernels.policy`), e.g. ``lora-kernel:direct``; and, asked for by name, DoRA's
layers (``DORA_IMPLS``: ``dora``, ``dora-merged``, ``dora-kernel``, ``dora-kernel-detached``: the
book-style pair and the fused layer with the exact or the detached norm; m trains beside A and B).
The ``backend`` column names the plan(s) the layer's calls ran, eagerly and, where it differs,
replayed from a CUDA graph ("direct; graph fused"), and where a fused DoRA layer's norm ran. How
it times (events back to back, implementations interleaved in rounds, fresh inputs beyond the L2):
docs/kernel-design.md#how-kernel-bench-times.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from lora_bench.classifier.book import cast_frozen
from lora_bench.kernels.policy import (
    Plan,
    PlanLog,
    PlanPolicy,
    current_policy,
    parse_plan,
    record_plans,
    use_policy,
)
from lora_bench.lora import lora_class
from lora_bench.results import store
from lora_bench.results.metrics import median_p10_p90
from lora_bench.train.graphs import warm_up
from lora_bench.train.memory import GIB, available_bytes
from lora_bench.bench.kernel_profile import KERNEL_COLUMNS, PROFILED_CALLS, kernels_path, profile_kernels

SHAPE_GROUPS: dict[str, list[str]] = {
    "guide": ["4x512:768->768:r16", "8x256:1024->1024:r32", "2x1024:2048->2048:r16"],
    "124m": ["960:768->768:r16", "960:768->3072:r16", "960:3072->768:r16"],
    "1558m": ["960:1600->1600:r16", "960:1600->6400:r16", "960:6400->1600:r16"],
}
# Published reference timings for the three "guide" shapes on an RTX 4090, (CPU ms, GPU ms); for
# comparison only: what exactly they timed is not recorded.
REFERENCE_4090_MS: dict[str, tuple[float, float]] = {
    "4x512:768->768:r16": (45.0, 15.0), "8x256:1024->1024:r32": (85.0, 22.0), "2x1024:2048->2048:r16": (120.0, 28.0),
}
LORA_IMPLS = ("frozen", "lora", "lora-merged", "lora-kernel")  # what runs when --impls is not given
# DoRA's layers: (the trainable-layers name whose DoRA layer it is, the detached norm)
DORA_IMPLS = {"dora": ("lora", False), "dora-merged": ("lora-merged", False), "dora-kernel": ("lora-kernel", False),
              "dora-kernel-detached": ("lora-kernel", True)}
IMPLS = (*LORA_IMPLS, *DORA_IMPLS)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16-autocast": torch.bfloat16}
# the training precision bf16 (``precision: bf16``): the frozen weight and bias stored in bfloat16,
# the adapters (and DoRA's m) float32, each call under bfloat16 autocast; input and output gradient
# in bfloat16 (the dtype below is theirs)
AUTOCAST = "bf16-autocast"
ALPHA = 2.0
L2_FLUSH_BYTES = 256 << 20  # rotate sets until this much data cycles: ~4× the H200's 60 MB L2
PHASES = ("fwd", "bwd", "fwdbwd")
ROUND = 20  # repeats per implementation per round
COLUMNS = [
    "shape", "tokens", "d_in", "d_out", "rank", "impl", "dtype", "device", "backend",
    *[f"{p}_{s}" for p in PHASES for s in ("ms", "p10_ms", "p90_ms")],
    "graph_fwdbwd_ms", "cpu_fwdbwd_ms", "x_frozen", "x_lora", "ref_4090_cpu_ms", "ref_4090_gpu_ms",
    "repeats", "sets",
]


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    seq: int
    d_in: int
    d_out: int
    rank: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def parse_shape(text: str) -> Shape:
    """'BxT:IN->OUT:rR' or 'N:IN->OUT:rR' (N tokens as one sequence), e.g. '4x512:768->768:r16'."""
    try:
        rows, proj, rank = text.split(":")
        d_in, d_out = (int(v) for v in proj.split("->"))
        b, _, t = rows.partition("x")
        batch, seq = (int(b), int(t)) if t else (1, int(b))
        if not rank.startswith("r"):
            raise ValueError
        shape = Shape(text, batch, seq, d_in, d_out, int(rank[1:]))
        if min(shape.batch, shape.seq, shape.d_in, shape.d_out, shape.rank) < 1:
            raise ValueError
        return shape
    except ValueError:
        raise ValueError(f"shape {text!r}: expected 'BxT:IN->OUT:rR' or 'N:IN->OUT:rR' with positive sizes, "
                         f"or a group {sorted(SHAPE_GROUPS)}") from None


def resolve_shapes(shapes: list[str] | None) -> list[Shape]:
    names = shapes or [s for group in ("guide", "124m", "1558m") for s in SHAPE_GROUPS[group]]
    out: list[Shape] = []
    for name in names:
        for item in SHAPE_GROUPS.get(name.lower(), [name]):
            shape = parse_shape(item)
            if shape not in out:
                out.append(shape)
    return out


class _Autocast(nn.Module):
    """A layer called under bfloat16 autocast, as a step in the training precision bf16 calls it."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, cache_enabled=False):
            return self.layer(x)


def _make_layer(impl: str, shape: Shape, dtype: torch.dtype, device: torch.device, *,
                autocast: bool = False) -> tuple[nn.Module, list]:
    """A layer with random weights (B too: a zero B would skip nothing but is not real data);
    ``autocast``: in the training precision bf16's dtypes, called under autocast (``AUTOCAST``)."""
    dtype = torch.float32 if autocast else dtype
    lin = nn.Linear(shape.d_in, shape.d_out, device=device, dtype=dtype)  # built where it runs: fast
    nn.init.normal_(lin.weight, std=shape.d_in ** -0.5)
    nn.init.normal_(lin.bias, std=0.02)
    lin.requires_grad_(False)
    if impl == "frozen":
        layer, params = lin.to(device, dtype), []
    else:
        if impl in DORA_IMPLS:
            name, detach = DORA_IMPLS[impl]
            layer = lora_class(name, "dora")(lin, shape.rank, ALPHA, detach_norm=detach)
        else:
            layer = lora_class(impl.split(":")[0])(lin, shape.rank, ALPHA)
        nn.init.normal_(layer.lora.B, std=0.02)
        layer = layer.to(device, dtype)
        params = [layer.lora.A, layer.lora.B, *([layer.m] if impl in DORA_IMPLS else [])]
    if autocast:
        cast_frozen(layer, torch.bfloat16)
        layer = _Autocast(layer)
    return layer, params


def _make_sets(impl: str, shape: Shape, dtype: torch.dtype, device: torch.device, n_sets: int, *,
               autocast: bool = False) -> list[tuple]:
    sets = []
    for _ in range(n_sets):
        layer, params = _make_layer(impl, shape, dtype, device, autocast=autocast)
        x = torch.randn(shape.batch, shape.seq, shape.d_in, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(shape.batch, shape.seq, shape.d_out, device=device, dtype=dtype)
        sets.append((layer, x, g, [x, *params]))
    return sets


def _n_sets(shape: Shape, dtype: torch.dtype, device: torch.device) -> int:
    if device.type != "cuda":
        return 2
    elt = torch.tensor([], dtype=dtype).element_size()
    per_set = elt * (shape.d_in * shape.d_out + shape.tokens * (shape.d_in + shape.d_out))
    return max(2, min(8, math.ceil(L2_FLUSH_BYTES / per_set)))


def group_bytes(impls: list[str], shape: Shape, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes one (shape, dtype) group holds at least while it is timed: every implementation's sets,
    each a layer (frozen weight and bias, A and B), its input and output gradient, and what forward
    and backward make (the output, the input's and the adapters' gradients, the rank-wide product)."""
    elt = torch.tensor([], dtype=dtype).element_size()
    d_in, d_out, r, t = shape.d_in, shape.d_out, shape.rank, shape.tokens
    per_set = d_in * d_out + d_out + 2 * t * (d_in + d_out) + t * r
    adapters = 2 * r * (d_in + d_out) + 2 * d_out  # A and B (and DoRA's m), and their gradients
    sets = _n_sets(shape, dtype, device)
    return elt * sum(sets * (per_set + (0 if impl == "frozen" else adapters)) for impl in impls)


def memory_problem(impls: list[str], shape: Shape, dtype_name: str, device: torch.device) -> str | None:
    """Why the group cannot fit in ``device``'s free memory (``group_bytes`` against
    ``train.memory.available_bytes``, the estimate a run is checked with), or None."""
    need = group_bytes(impls, shape, DTYPES[dtype_name], device)
    have = available_bytes(device)
    if have is None or need <= have:
        return None
    return (f"shape {shape.name} ({dtype_name}) needs about {need / GIB:,.1f} GiB for its {len(impls)} "
            f"implementation(s), estimated from its sizes, but {device} has {have / GIB:,.1f} GiB available; "
            "choose a smaller shape (rows, widths or rank) or fewer --impls")


def _time_phase(sets: list[tuple], phase: str, *, repeats: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds per repeat of one phase, rotating over the sets."""
    cuda = device.type == "cuda"
    spans = []
    for i in range(warmup + repeats):
        layer, x, g, inputs = sets[i % len(sets)]
        y = layer(x) if phase == "bwd" else None  # untimed forward for a backward-only timing
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        if phase != "bwd":
            y = layer(x)
        if phase != "fwd":
            torch.autograd.grad(y, inputs, g)
        del y
        if cuda:
            end.record()
            if i >= warmup:
                spans.append((start, end))
        elif i >= warmup:
            spans.append(1e3 * (time.perf_counter() - t0))
    if cuda:
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in spans]
    return spans


def _time_graph(sets: list[tuple], *, repeats: int, device: torch.device) -> float | None:
    """Median ms of replaying forward+backward from a CUDA graph (one graph per set)."""
    graphs = []
    try:
        for layer, x, g, inputs in sets:
            warm_up(lambda: torch.autograd.grad(layer(x), inputs, g), 3)  # (device: set by run_kernel_bench)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                torch.autograd.grad(layer(x), inputs, g)
            graphs.append(graph)
    except RuntimeError as exc:  # report, don't fail the whole bench
        print(f"kernel-bench: CUDA graph capture failed: {exc}", file=sys.stderr)
        return None
    for i in range(5):
        graphs[i % len(graphs)].replay()
    spans = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs[i % len(graphs)].replay()
        end.record()
        spans.append((start, end))
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in spans)


def _policy(impl: str, base: PlanPolicy) -> PlanPolicy:
    """The plan policy an implementation runs under: ``base``, with ``lora-kernel:PLAN``'s plan forced."""
    base_impl, _, plan = impl.partition(":")
    return dataclasses.replace(base, forced=parse_plan(plan)) if base_impl == "lora-kernel" and plan else base


def _plans(log: PlanLog) -> str:
    """The plans noted, by name, and where DoRA's norms ran: 'direct', 'cpp+fused', 'dora-norm-triton+fused', ..."""
    return log.backend()


def _kernel(impl: str) -> bool:
    """Whether the implementation is a fused layer (its plans are noted)."""
    return impl.startswith("lora-kernel") or DORA_IMPLS.get(impl, ("",))[0] == "lora-kernel"


def _bench_group(impls: list[str], shape: Shape, dtype_name: str, *, device: torch.device, repeats: int,
                 warmup: int, cpu: bool, policies: dict[str, PlanPolicy],
                 kernels: list[dict] | None = None) -> list[dict]:
    """All implementations of one (shape, dtype), interleaved round by round (module docstring).
    ``policies``: the plan policy of each implementation; ``kernels``: where given, each
    implementation's profiled kernels (``kernel_profile.profile_kernels``) are appended to it."""
    dtype = DTYPES[dtype_name]
    sets, rows, eager_plans = {}, {}, {}
    for impl in impls:
        torch.manual_seed(zlib.crc32(f"{impl}|{shape.name}|{dtype_name}".encode()))
        sets[impl] = _make_sets(impl, shape, dtype, device, _n_sets(shape, dtype, device),
                                autocast=dtype_name == AUTOCAST)
        rows[impl] = {"shape": shape.name, "tokens": shape.tokens, "d_in": shape.d_in, "d_out": shape.d_out,
                      "rank": shape.rank, "impl": impl, "dtype": dtype_name, "device": device.type,
                      "backend": "" if _kernel(impl) else ("cublas" if device.type == "cuda" else "torch"),
                      "repeats": repeats, "sets": len(sets[impl])}
        eager_plans[impl] = PlanLog()
    n_rounds = max(1, math.ceil(repeats / ROUND))
    blocks = [repeats // n_rounds + (1 if i < repeats % n_rounds else 0) for i in range(n_rounds)]  # sum = repeats
    ratio_base = [b for b in ("frozen", "lora") if b in impls]
    round_ratios: dict[str, dict[str, list[float]]] = {i: {b: [] for b in ratio_base} for i in impls}
    for phase in PHASES:
        samples: dict[str, list[float]] = {i: [] for i in impls}
        for rnd in range(n_rounds):
            order = impls[rnd % len(impls):] + impls[:rnd % len(impls)]
            block_median = {}
            for impl in order:  # later rounds: a short re-warm after the other implementations ran
                with use_policy(policies[impl]), record_plans(eager_plans[impl]):
                    ms = _time_phase(sets[impl], phase, repeats=blocks[rnd], warmup=warmup if rnd == 0 else min(2, warmup),
                                     device=device)
                samples[impl] += ms
                block_median[impl] = statistics.median(ms)
            if phase == "fwdbwd":
                for impl in impls:
                    for b in ratio_base:
                        round_ratios[impl][b].append(block_median[impl] / block_median[b])
        for impl in impls:
            r = rows[impl]
            r[f"{phase}_ms"], r[f"{phase}_p10_ms"], r[f"{phase}_p90_ms"] = median_p10_p90(samples[impl])
    for impl in impls:
        r = rows[impl]
        for b in ratio_base:
            r[f"x_{b}"] = statistics.median(round_ratios[impl][b])
        if _kernel(impl):
            r["backend"] = _plans(eager_plans[impl])
        if device.type == "cuda":  # every implementation, replayed from a CUDA graph
            with use_policy(policies[impl]), record_plans() as graph_plans:
                r["graph_fwdbwd_ms"] = _time_graph(sets[impl], repeats=repeats, device=device)
            if _kernel(impl) and len(graph_plans) and _plans(graph_plans) != r["backend"]:
                r["backend"] += f"; graph {_plans(graph_plans)}"
        if cpu and dtype_name == "fp32":
            if device.type == "cpu":
                r["cpu_fwdbwd_ms"] = r["fwdbwd_ms"]
            else:
                cpu_dev = torch.device("cpu")
                with use_policy(policies[impl]):
                    cpu_sets = _make_sets(impl, shape, dtype, cpu_dev, 2)
                    n = max(3, repeats // 10)
                    r["cpu_fwdbwd_ms"] = statistics.median(
                        _time_phase(cpu_sets, "fwdbwd", repeats=n, warmup=min(2, warmup), device=cpu_dev))
        ref = REFERENCE_4090_MS.get(shape.name)
        r["ref_4090_cpu_ms"], r["ref_4090_gpu_ms"] = ref if ref else (None, None)
        if kernels is not None:  # after its timings: the profiler perturbs nothing timed
            with use_policy(policies[impl]), record_plans() as profiled_plans:
                found = profile_kernels(sets[impl], calls=PROFILED_CALLS, device=device)
            backend = _plans(profiled_plans) if _kernel(impl) else r["backend"]
            kernels += [{"shape": shape.name, "dtype": dtype_name, "impl": impl, "backend": backend, **k}
                        for k in found]
    return [rows[i] for i in impls]


def write_csv(rows: list[dict], path: Path, columns: list[str] = COLUMNS) -> None:
    """The bench table (or, with ``KERNEL_COLUMNS``, the kernel table), written atomically through
    the results module's writer."""
    store.write_csv(path, ({c: r.get(c) for c in columns} for r in rows), list(columns))


def _out_of_memory(e: BaseException) -> bool:
    """An allocation failure: CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError."""
    text = str(e).lower()
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in text \
        or "out of memory" in text


def run_kernel_bench(
    *, shapes: list[str] | None = None, impls: list[str] | None = None, dtypes: list[str] | None = None,
    device: str = "cuda", repeats: int = 200, warmup: int = 20, out_csv: Path | None = None,
    cpu: bool = False, progress: bool = False, kernels: list[dict] | None = None,
) -> list[dict]:
    """Time every (shape, impl, dtype); returns rows (keys = ``COLUMNS``) and writes ``out_csv``.

    shapes: names, groups ('guide', '124m', '1558m') or 'BxT:IN->OUT:rR' specs; None = all groups.
    impls: subset of ``IMPLS`` (or 'lora-kernel:PLAN'; None: ``LORA_IMPLS``); dtypes: subset of 'fp32', 'bf16', 'fp16'.
    device: where the main columns are timed ('cuda', 'cuda:1' or 'cpu'); cpu=True adds a CPU
    forward+backward column to the fp32 rows. Plain ``lora-kernel`` runs the policy in force.
    kernels: a list to receive each implementation's profiled kernels (``KERNEL_COLUMNS``), also
    written to ``kernels_path(out_csv)``; None: no profile."""
    if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"device {device!r}: expected cuda, cuda:N or cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("kernel-bench: device is CUDA but no GPU is visible; use --device cpu")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats}, warmup={warmup}: need repeats >= 1 and warmup >= 0")
    impls = impls or list(LORA_IMPLS)
    base_policy = current_policy()
    policies = {}
    for impl in impls:
        base, _, mode = impl.partition(":")
        if base not in IMPLS:
            raise ValueError(f"impl {impl!r} is not one of {IMPLS} (or lora-kernel:PLAN)")
        if mode and base != "lora-kernel":
            raise ValueError(f"impl {impl!r}: only lora-kernel takes a :PLAN suffix")
        try:
            policies[impl] = _policy(impl, base_policy)
        except ValueError:
            raise ValueError(f"impl {impl!r}: lora-kernel's plans are {', '.join(p.value for p in Plan)}") from None
    dtypes = dtypes or ["fp32", "bf16"]
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"dtype {d!r} is not one of {sorted(DTYPES)}")
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    rows = []
    for shape in resolve_shapes(shapes):
        for dtype_name in dtypes:
            if too_big := memory_problem(impls, shape, dtype_name, dev):  # before anything is allocated
                raise ValueError(too_big)
            try:
                group = _bench_group(impls, shape, dtype_name, device=dev, repeats=repeats, warmup=warmup, cpu=cpu,
                                     policies=policies, kernels=kernels)
            except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
                if not _out_of_memory(e):
                    raise
                raise ValueError(f"shape {shape.name} ({dtype_name}) does not fit in {dev} memory: "
                                 f"{str(e).splitlines()[0][:200]}; choose a smaller shape") from None
            rows += group
            if out_csv is not None:  # rewritten after every group: an error later loses nothing measured
                write_csv(rows, out_csv)
                if kernels is not None:
                    write_csv(kernels, kernels_path(out_csv), KERNEL_COLUMNS)
            if progress:
                for r in group:
                    print(f"kernel-bench {shape.name} {dtype_name} {r['impl']}: fwd+bwd {1e3 * r['fwdbwd_ms']:.1f} us",
                          file=sys.stderr, flush=True)
    if out_csv is not None:
        write_csv(rows, out_csv)
        if kernels is not None:
            write_csv(kernels, kernels_path(out_csv), KERNEL_COLUMNS)
    return rows


def render_kernel_table(rows: list[dict]):
    """A rich Table: medians in microseconds, forward+backward spread, ratios to frozen and lora."""
    from rich.table import Table

    def us(v):
        return "" if v is None or v == "" else f"{1e3 * float(v):.1f}"

    def x(v):
        return "" if v is None or v == "" else f"{float(v):.2f}x"

    t = Table(title="LoRA layer: forward / backward (median us; fwd+bwd p10-p90)")
    for col in ("shape", "dtype", "impl", "backend", "fwd", "bwd", "fwd+bwd", "p10-p90", "graph",
                "x frozen", "x lora", "CPU ms", "4090 ref CPU/GPU ms"):
        t.add_column(col, justify="left" if col in ("shape", "dtype", "impl", "backend") else "right")
    for r in rows:
        ref = (f"{r['ref_4090_cpu_ms']:g}/{r['ref_4090_gpu_ms']:g}" if r.get("ref_4090_cpu_ms") else "")
        cpu_ms = r.get("cpu_fwdbwd_ms")
        t.add_row(r["shape"], r["dtype"], r["impl"], r["backend"], us(r["fwd_ms"]), us(r["bwd_ms"]),
                  us(r["fwdbwd_ms"]), f"{us(r['fwdbwd_p10_ms'])}-{us(r['fwdbwd_p90_ms'])}",
                  us(r.get("graph_fwdbwd_ms")), x(r.get("x_frozen")), x(r.get("x_lora")),
                  "" if cpu_ms in (None, "") else f"{float(cpu_ms):.2f}", ref)
    return t


__all__ = ["run_kernel_bench", "render_kernel_table", "write_csv", "parse_shape", "resolve_shapes",
           "SHAPE_GROUPS", "IMPLS", "COLUMNS"]
