"""lora-kernel's adapter gradients inline against deferred (``adapter_grads``: a side stream joined
once per backward pass, lora_bench.kernels.deferred), in the fastest mode: CUDA graphs, bf16
autocast, SDPA, fused ops and AdamW, query/key/value grouped, r16, random weights.

First a correctness check per ``--check-sizes``: the adapters' gradients of one step, deferred
against inline, eager (the fused plan forced, so the Python Function runs) and replayed from a
captured graph (the plans the rules give), each within twice the bf16-autocast kernel bound of
tests/numerics.py (another order of the fp32 atomic adds, not another result). Then the harness's
own timing runs (``execute_run``, the run rows of ``lora-bench train``), inline and deferred
interleaved A-B-A-B in one process, and a table of median step times last.

    python -m benchmarks.adapter_grads --results-dir results/kernel/adapter-grads --data-file TSV \\
        [--sizes 124M 1558M] [--repeats 2] [--steps 60] [--check-sizes 124M]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from lora_bench.classifier.book import build_classifier, cast_frozen
from lora_bench.config import TrainConfig
from lora_bench.kernels import deferred
from lora_bench.kernels.policy import Plan, PlanPolicy, use_policy
from lora_bench.lora.kernel import group_qkv
from lora_bench.train.graphs import warm_up
from lora_bench.train.run import execute_run

MODES = ("inline", "deferred")
BEST = dict(weights="random", trainable_layers="lora-kernel", lora_rank=16, lora_alpha=16.0, precision="bf16",
            attention="sdpa", ops="fused", optimizer="fused", cuda_graphs=True)
# the bf16-autocast kernel bound of tests/numerics.py (kernel_tol("bf16", autocast=True): 6 roundings
# of 2^-8), twice: two evaluations of the same function, each within it of the exact value
BOUND = 2 * 6 * 2.0 ** -8


def _model(size: str, data_file):
    cfg = TrainConfig(model_size=size, data_file=data_file, **BEST)
    model = build_classifier(cfg, cache_dir=Path(tempfile.mkdtemp(prefix="adapter-grads-")), progress=False)
    cast_frozen(model, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        if name.endswith("lora.B"):  # (zero at init: grad_A would be zero in every mode)
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.cuda()
    group_qkv(model)
    return model


def _loss(model, idx):
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        return model(idx)[:, -1, :].float().logsumexp(-1).mean()


def _grads(model) -> dict[str, torch.Tensor]:
    torch.cuda.synchronize()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if ".lora." in n}


def _one_mode(model, mode: str, *, idx, idx2) -> tuple[dict, dict, dict]:
    """(eager grads, replayed grads, deferral counts of the capture) under ``mode``."""
    model.zero_grad(set_to_none=True)
    with use_policy(PlanPolicy(forced=Plan.FUSED, adapter_grads=mode)):
        _loss(model, idx).backward()
    eager = _grads(model)
    static = idx.clone()

    def step():
        model.zero_grad(set_to_none=True)
        _loss(model, static).backward()

    with use_policy(PlanPolicy(adapter_grads=mode)):
        warm_up(step, 3)
        model.zero_grad(set_to_none=True)
        before = dict(deferred.COUNTS)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _loss(model, static).backward()
        counts = {k: deferred.COUNTS[k] - before[k] for k in before}
    static.copy_(idx2)
    graph.replay()
    replayed = _grads(model)
    del graph
    return eager, replayed, counts


def check(size: str, data_file, console: Console) -> bool:
    model = _model(size, data_file)
    gen = torch.Generator(device="cuda").manual_seed(1)
    idx, idx2 = (torch.randint(0, 50257, (8, 120), device="cuda", generator=gen) for _ in range(2))
    runs = {mode: _one_mode(model, mode, idx=idx, idx2=idx2) for mode in MODES}
    ok = runs["inline"][2]["joins"] == 0 and runs["deferred"][2]["joins"] == 1
    console.print(f"{size} capture: inline {runs['inline'][2]}, deferred {runs['deferred'][2]} "
                  "(deferred: layer backwards deferred, passes joined; expected joins 0 and 1)")
    for i, what in enumerate(("eager (fused forced)", "graph replay")):
        want, got = runs["inline"][i], runs["deferred"][i]
        errs = {n: float((got[n].double() - want[n].double()).norm() / want[n].double().norm().clamp_min(1e-300))
                for n in want}
        same = sum(torch.equal(got[n], want[n]) for n in want)
        worst = max(errs, key=errs.get)
        good = got.keys() == want.keys() and errs[worst] <= BOUND
        ok = ok and good
        console.print(f"{size} {what}: {len(want)} adapter gradients, {same} bit-equal, largest relative "
                      f"difference {errs[worst]:.2e} ({worst}) against a bound of {BOUND:.2e}: "
                      f"{'OK' if good else 'FAILED'}")
    del model
    torch.cuda.empty_cache()
    return ok


def _ms(row: dict, key: str) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results-dir", required=True, type=Path)
    ap.add_argument("--data-file", default=None, help="Raw SMSSpamCollection TSV.")
    ap.add_argument("--sizes", nargs="+", default=["124M", "1558M"])
    ap.add_argument("--repeats", type=int, default=2, help="A-B pairs per size")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--check-sizes", nargs="*", default=["124M"], help="sizes of the correctness check (none: skip)")
    args = ap.parse_args(argv)
    console = Console(width=160)
    checks = [check(size, args.data_file, console) for size in args.check_sizes]

    rows: dict[tuple[str, str], list[dict]] = {}
    for size in args.sizes:
        for i in range(args.repeats):
            for mode in MODES:
                cfg = TrainConfig(model_size=size, data_file=args.data_file, device="cuda", max_steps=args.steps,
                                  warmup_steps=args.warmup_steps, eval_freq=0, skip_final_eval=True, **BEST)
                rid = f"{size}-{mode}-{i}"
                before = dict(deferred.COUNTS)
                with use_policy(PlanPolicy(adapter_grads=mode)):
                    row = execute_run(cfg, results_dir=args.results_dir, run_id=rid, console=Console(quiet=True),
                                      progress=False)
                counts = {k: deferred.COUNTS[k] - before[k] for k in before}
                rows.setdefault((size, mode), []).append(row)
                console.print(f"{rid}: step {_ms(row, 'step_ms_median')} ms (p10 {_ms(row, 'step_ms_p10')}, p90 "
                              f"{_ms(row, 'step_ms_p90')}), backward {_ms(row, 'backward_ms_median')} ms, "
                              f"kernels bwd {row.get('graph_kernels_backward')}, backend {row.get('backend')}, "
                              f"deferred {counts['deferred']} layer backwards in {counts['joins']} passes")

    table = Table(title="lora-kernel step ms, CUDA graphs + bf16 + fused, adapter gradients inline vs deferred")
    for col in ("size", "inline, each run", "deferred, each run", "inline", "deferred", "deferred / inline"):
        table.add_column(col)
    for size in args.sizes:
        med = {m: [r["step_ms_median"] for r in rows[(size, m)]] for m in MODES}
        a, b = statistics.median(med["inline"]), statistics.median(med["deferred"])
        table.add_row(size, " / ".join(f"{x:.3f}" for x in med["inline"]),
                      " / ".join(f"{x:.3f}" for x in med["deferred"]), f"{a:.3f}", f"{b:.3f}", f"{b / a:.3f}")
    console.print(table)
    if checks:
        console.print(f"correctness: {'OK' if all(checks) else 'FAILED'} ({', '.join(args.check_sizes)})")
    return 0 if all(checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
