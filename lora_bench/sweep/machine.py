"""What this machine says of a sweep's runs, asked alike by ``validate``, ``sweep --dry-run`` and
the sweep before its first run, so that what the checks accept the sweep runs: a run for one
process (a sweep runs each run in one), its device (``train.preflight.device_problems``), the
optional packages it needs and whether it fits in the CPU's memory (a GPU's is asked by each run,
on its device: asking here would make a CUDA context in the sweep's own process). Each kind of
question is asked once per distinct answer, so a sweep of thousands of runs is checked in moments."""

from __future__ import annotations

from pathlib import Path

from lora_bench.config import render
from lora_bench.errors import UsageError
from lora_bench.escaping import markup
from lora_bench.train.preflight import device_problems, memory_problem, require_packages


def machine_problems(runs: list) -> list[str]:
    """Every problem this machine has with ``runs`` (``PlannedRun``s), each once."""
    out = []
    parallel = sorted({r.cfg.nproc for r in runs if r.cfg.nproc > 1})
    if parallel:
        out.append(f"nproc={parallel[0]}: a sweep runs each run in one process; run data-parallel runs with "
                   f"lora-bench train --nproc {parallel[0]} (spread a sweep over GPUs with --workers)")
    machines = {(r.cfg.device, r.cfg.cuda_graphs, r.cfg.base_dtype, r.cfg.implementation, r.cfg.emb_dim,
                 r.cfg.model_size, r.cfg.nproc): r.cfg for r in runs}
    out += sorted({p for cfg in machines.values() for p in render(device_problems(cfg))})
    needs = {(r.cfg.implementation, r.cfg.is_lora, r.cfg.weights, r.cfg.weights_source, bool(r.cfg.weights_dir),
              r.cfg.base_dtype, r.cfg.quantized_base): r.cfg for r in runs}
    for cfg in needs.values():
        try:
            require_packages(cfg)
        except UsageError as e:
            if str(e) not in out:
                out.append(str(e))
    shapes = {(r.cfg.model_size, r.cfg.emb_dim, r.cfg.n_layers, r.cfg.n_heads, r.cfg.trainable_layers, r.cfg.lora_rank,
               r.cfg.batch_size, r.cfg.context_length, r.cfg.precision, r.cfg.base_dtype): r for r in runs}
    for run in shapes.values():
        too_big = memory_problem(run.cfg, cuda=False)
        if too_big:
            out.append(f"{run.run_id} ({run.describe()}): {too_big}")
    return out


def preflight_runs(runs: list, console) -> None:
    """UsageError with every problem of ``machine_problems``; a warning for each data file that is
    not there (the runs that read it fail, and are recorded as failed)."""
    problems = machine_problems(runs)
    if problems:
        raise UsageError(problems[0] if len(problems) == 1 else
                         f"{len(problems)} problems on this machine:\n" + "\n".join(f"  - {p}" for p in problems))
    for path in sorted({r.cfg.data_file for r in runs if r.cfg.data_file}):
        if not Path(path).is_file():
            console.print(f"[yellow]warning:[/yellow] data_file {markup(path)} does not exist; runs using it will fail",
                          highlight=False)
