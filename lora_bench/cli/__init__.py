"""The ``lora-bench`` command line: thin typer commands that declare options and call the library.
Domain errors become one clear message and an exit code (2 for usage errors), no traceback."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from lora_bench import __version__
from lora_bench.cli.results import results_app
from lora_bench.config import (
    ATTENTION,
    COMPILE_SCOPES,
    OPS,
    OPTIMIZERS,
    PRECISIONS,
    PROFILES,
    TIMING,
    TOKEN_POSITIONS,
    TRAINABLE_LAYERS,
    WEIGHTS,
    TrainConfig,
)
from lora_bench.errors import Interrupted, LoraBenchError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
                  pretty_exceptions_show_locals=False,
                  help="Benchmark and ablation harness for LoRA fine-tuning of GPT-2 (SMS spam classification).")
data_app = typer.Typer(no_args_is_help=True, help="Data set commands.")
app.add_typer(data_app, name="data")
app.add_typer(results_app, name="results")
# piped output (logs, CI) would be cut at rich's default 80 columns: tables get room there
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)

D = TrainConfig()  # defaults: one source


def _choices(values) -> str:
    return ", ".join(values)


def _output_dir(path: Path, flag: str) -> None:
    """A folder the command will write into: refuse a file in its place or a folder that takes no
    new file; create it now."""
    from lora_bench.errors import UsageError
    from lora_bench.fileio import check_writable_dir

    why = check_writable_dir(Path(path))
    if why:
        raise UsageError(f"{flag} {path}: {why}")


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def _check_data_file(path: Path) -> None:
    from lora_bench.errors import UsageError

    if path.is_dir():
        raise UsageError(f"--data-file {path} is a folder; give the raw SMSSpamCollection TSV file")
    if not path.is_file():
        raise UsageError(f"--data-file {path}: no such file")


def _check_machine_inputs(cfg: TrainConfig) -> None:
    """What only this machine can tell (a data file, a GPU), checked before a run starts, so a user
    mistake leaves no failed row behind."""
    from lora_bench.errors import UsageError
    from lora_bench.train.run import resolve_device

    if cfg.data_file:
        _check_data_file(Path(cfg.data_file))
    if cfg.weights_dir and not Path(cfg.weights_dir).is_dir():
        raise UsageError(f"--weights-dir {cfg.weights_dir}: no such folder (it should hold the OpenAI GPT-2 "
                         "checkpoint files: checkpoint, hparams.json, model.ckpt.*)")
    device = resolve_device(cfg.device)  # --device cuda on a machine without CUDA: one message
    if cfg.cuda_graphs and device.type != "cuda":
        raise UsageError("--cuda-graphs needs a CUDA device, and none is available here")


# Shared option aliases (reused by several commands)
ResultsDir = Annotated[Path, typer.Option("--results-dir", help="Folder for runs.csv and per-run files.")]
CacheDir = Annotated[Optional[Path], typer.Option("--cache-dir", envvar="LORA_BENCH_CACHE",
                                                  help="Download cache (default ~/.cache/lora-bench).")]
NoProgress = Annotated[bool, typer.Option("--no-progress", help="No progress bars (logs, CI).")]


def _version(value: bool) -> None:
    if value:
        console.print(f"lora-bench {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    pass


@app.command(no_args_is_help=False)
def train(
    model_size: Annotated[str, typer.Option(help="124M, 355M, 774M, 1558M, tiny, or 'gpt2-small (124M)' ...")] = D.model_size,
    weights: Annotated[str, typer.Option(help=_choices(WEIGHTS))] = D.weights,
    weights_dir: Annotated[Optional[Path], typer.Option(help="Local OpenAI checkpoint folder (no download).")] = None,
    emb_dim: Annotated[Optional[int], typer.Option(help="Override width (random weights).")] = None,
    n_layers: Annotated[Optional[int], typer.Option(help="Override number of blocks (random weights).")] = None,
    n_heads: Annotated[Optional[int], typer.Option(help="Override number of heads (random weights).")] = None,
    trainable_layers: Annotated[str, typer.Option(help=_choices(TRAINABLE_LAYERS))] = D.trainable_layers,
    rank: Annotated[int, typer.Option("--rank", "--lora-rank", help="LoRA rank.")] = D.lora_rank,
    alpha: Annotated[float, typer.Option("--alpha", "--lora-alpha", help="LoRA alpha (not divided by rank).")] = D.lora_alpha,
    trainable_token_pos: Annotated[str, typer.Option("--trainable-token-pos", "--token-position",
                                                     help=_choices(TOKEN_POSITIONS))] = D.trainable_token_pos,
    average_embeddings: Annotated[bool, typer.Option("--average-embeddings", help="Classify from the mean over positions.")] = False,
    context_length: Annotated[str, typer.Option(help="longest_training_example, model_context_length, or an integer.")] = D.context_length,
    no_padding: Annotated[bool, typer.Option("--no-padding", help="No padding (batch size must be 1).")] = False,
    batch_size: Annotated[int, typer.Option(help="Batch size.")] = D.batch_size,
    accumulation_steps: Annotated[int, typer.Option(help="Gradient accumulation steps.")] = D.accumulation_steps,
    num_epochs: Annotated[int, typer.Option("--num-epochs", "--epochs", help="Epochs.")] = D.num_epochs,
    learning_rate: Annotated[float, typer.Option("--learning-rate", "--lr", help="AdamW learning rate.")] = D.learning_rate,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay.")] = D.weight_decay,
    disable_causal_mask: Annotated[bool, typer.Option("--disable-causal-mask", help="Disable the causal mask.")] = False,
    ignore_index: Annotated[int, typer.Option(help="Cross-entropy ignore_index.")] = D.ignore_index,
    seed: Annotated[int, typer.Option(help="Seed (the reference uses 123).")] = D.seed,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N.")] = D.device,
    eval_freq: Annotated[int, typer.Option(help="Periodic loss every N steps (0 = never).")] = D.eval_freq,
    eval_iter: Annotated[int, typer.Option(help="Batches per periodic evaluation.")] = D.eval_iter,
    max_steps: Annotated[Optional[int], typer.Option(help="Stop after N steps (timing runs).")] = None,
    skip_final_eval: Annotated[bool, typer.Option("--skip-final-eval", help="Skip the final full-loader accuracies.")] = False,
    precision: Annotated[str, typer.Option(help=_choices(PRECISIONS))] = D.precision,
    attention: Annotated[str, typer.Option(help=_choices(ATTENTION))] = D.attention,
    ops: Annotated[str, typer.Option(help=_choices(OPS))] = D.ops,
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile the model.")] = False,
    compile_scope: Annotated[str, typer.Option(help=_choices(COMPILE_SCOPES) + " (with --compile: the whole model, "
                                               "or each transformer block — compiles once for any depth)")] = D.compile_scope,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs", help="Capture and replay the step (and evaluation) as CUDA graphs.")] = False,
    optimizer: Annotated[str, typer.Option(help=_choices(OPTIMIZERS) + " (book: AdamW's default update; fused: AdamW(fused=True))")] = D.optimizer,
    timing: Annotated[str, typer.Option(help=_choices(TIMING) + " (sync perturbs the step)")] = D.timing,
    warmup_steps: Annotated[int, typer.Option(help="Steps excluded from the timing summaries.")] = D.warmup_steps,
    profile: Annotated[str, typer.Option(help=_choices(PROFILES))] = D.profile,
    data_file: Annotated[Optional[Path], typer.Option(help="Raw SMSSpamCollection TSV (no download).")] = None,
    results_dir: ResultsDir = Path("results/runs"),
    run_id: Annotated[Optional[str], typer.Option(help="Run id (default: settings hash + time).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the run of the same --run-id, if any.")] = False,
    cache_dir: CacheDir = None,
    no_progress: NoProgress = False,
) -> None:
    """Fine-tune GPT-2 on SMS spam and record accuracy and per-phase timings.

    Example: [bold]lora-bench train --trainable-layers lora --rank 16 --alpha 16[/bold]
    """
    from lora_bench.report.phase_table import phase_table
    from lora_bench.train.run import execute_run

    cfg = TrainConfig(
        model_size=model_size, emb_dim=emb_dim, n_layers=n_layers, n_heads=n_heads, weights=weights,
        weights_dir=str(weights_dir) if weights_dir else None, trainable_layers=trainable_layers,
        lora_rank=rank, lora_alpha=alpha, trainable_token_pos=trainable_token_pos,
        average_embeddings=average_embeddings, context_length=context_length, no_padding=no_padding,
        batch_size=batch_size, accumulation_steps=accumulation_steps, num_epochs=num_epochs,
        learning_rate=learning_rate, weight_decay=weight_decay, disable_causal_mask=disable_causal_mask,
        ignore_index=ignore_index, seed=seed, eval_freq=eval_freq, eval_iter=eval_iter, max_steps=max_steps,
        skip_final_eval=skip_final_eval, device=device, precision=precision, attention=attention, ops=ops,
        compile=compile, compile_scope=compile_scope, cuda_graphs=cuda_graphs, optimizer=optimizer, timing=timing, warmup_steps=warmup_steps, profile=profile,
        data_file=str(data_file) if data_file else None,
    )
    _validate_as_flags(cfg)
    _check_machine_inputs(cfg)
    _output_dir(results_dir, "--results-dir")
    try:
        row = execute_run(cfg, results_dir=results_dir, run_id=run_id, console=console, progress=not no_progress,
                          cache_dir=cache_dir, overwrite=overwrite)
    except Interrupted as e:  # recorded, and execute_run said where: 128 + the signal, as a shell reports
        raise typer.Exit(e.exit_code) from None
    if row.get("timing_clock") not in (None, "off"):
        console.print(phase_table(row))
    console.print(f"results: {results_dir / 'runs.csv'} (run_id {row['run_id']})")


_FLAG_NAMES = {"lora_rank": "--rank", "lora_alpha": "--alpha"}


def _validate_as_flags(cfg: TrainConfig) -> None:
    """Validate, naming problems by their command-line flags (the YAML keys are the field names)."""
    from lora_bench.errors import ConfigError

    problems = cfg.problems()
    if not problems:
        return
    import re

    out = []
    for p in problems:
        for name in sorted(TrainConfig.field_names(), key=len, reverse=True):
            flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
            p = p.replace(f"{name}=", f"{flag}=").replace(f"needs {name}", f"needs {flag}")
            if "_" in name:  # snake_case names are unambiguous anywhere in a message
                p = re.sub(rf"(?<![\w-]){name}(?![\w-])", flag, p)
        out.append(p)
    raise ConfigError(out)


@app.command()
def show(results_dir: Annotated[Path, typer.Argument(help="A results folder holding runs.csv.")],
         run_id: Annotated[Optional[str], typer.Argument(help="Run id (default: the latest run).")] = None) -> None:
    """Print a run's phase breakdown again, from the files."""
    from lora_bench.report.phase_table import phase_table
    from lora_bench.results.store import find_run

    console.print(phase_table(find_run(results_dir, run_id)))


@data_app.command("prepare")
def data_prepare(
    out: Annotated[Path, typer.Option("--out", help="Folder for train.csv, validation.csv, test.csv.")],
    data_file: Annotated[Optional[Path], typer.Option(help="Raw SMSSpamCollection TSV (default: download).")] = None,
    cache_dir: CacheDir = None,
    no_progress: NoProgress = False,
) -> None:
    """Balance and split the SMS Spam Collection exactly as the reference."""
    from lora_bench.data.sms_spam import ensure_sms_spam, prepare_splits
    from lora_bench.data.tokenizer import sha256_file
    from lora_bench.train.run import default_cache_dir

    raw = data_file or ensure_sms_spam(cache_dir or default_cache_dir(), progress=not no_progress)
    for name, path in prepare_splits(raw, out).items():
        console.print(f"{name:>10}: {path}  sha256 {sha256_file(path)}")


# -- sweeps and reports (lora_bench.sweep.spec, lora_bench.sweep.runner, lora_bench.report.aggregate) ---------------------
SweepFiles = Annotated[list[Path], typer.Argument(help="Sweep YAML files.", show_default=False)]


@app.command()
def validate(files: SweepFiles) -> None:
    """Check every run of each sweep file and report all problems at once (nothing runs)."""
    from lora_bench.sweep.spec import validate_files

    validate_files(files, console=console)


@app.command()
def sweep(
    file: Annotated[Path, typer.Argument(help="Sweep YAML file (see configs/).", show_default=False)],
    device: Annotated[Optional[str], typer.Option(help="Override every run's device (auto, cpu, cuda, cuda:N).")] = None,
    data_file: Annotated[Optional[Path], typer.Option(help="Override every run's data_file (raw SMS TSV).")] = None,
    results_dir: Annotated[Optional[Path], typer.Option("--results-dir", help="Results folder (default: results/<name> of the sweep).")] = None,
    cache_dir: CacheDir = None,
    isolation: Annotated[str, typer.Option(help="process (each run in a child process) or inline.")] = "process",
    fresh: Annotated[bool, typer.Option("--fresh", help="Forget earlier results of these runs and start over.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and list the runs; run nothing.")] = False,
    shard: Annotated[Optional[str], typer.Option(help="Run only shard I of N (I/N, 1-based), e.g. 2/4.")] = None,
    no_progress: NoProgress = False,
) -> None:
    """Run every configuration of a sweep file; resumes by default (finished runs are skipped).

    Example: [bold]lora-bench sweep configs/smoke.yaml[/bold]
    """
    from lora_bench.errors import UsageError
    from lora_bench.sweep.command import sweep_command

    if data_file is not None:
        _check_data_file(data_file)
    if results_dir is not None and results_dir.exists() and not results_dir.is_dir():
        raise UsageError(f"--results-dir {results_dir}: a file is in the way of this folder")
    overrides = {"device": device, "data_file": str(data_file.resolve()) if data_file else None}
    raise typer.Exit(sweep_command(file, overrides=overrides, results_dir=results_dir, cache_dir=cache_dir,
                                   isolation=isolation, fresh=fresh, dry_run=dry_run, shard=shard,
                                   progress=not no_progress, console=console))


@app.command()
def report(
    paths: Annotated[list[Path], typer.Argument(help="Results folders (or runs.csv files); merged by run id.",
                                                show_default=False)],
    group_by: Annotated[Optional[str], typer.Option(help="Comma-separated settings (default: the run labels, or the settings that vary).")] = None,
    baseline: Annotated[Optional[str], typer.Option(help="key=value runs to compare against, e.g. trainable_layers=all.")] = None,
    metrics: Annotated[Optional[str], typer.Option(help="Comma-separated result columns; the first is ratioed.")] = None,
    format: Annotated[str, typer.Option("--format", help="table (terminal), markdown, html (one self-contained page) or csv.")] = "table",
    output: Annotated[Optional[Path], typer.Option(help="Write the report to this file instead of the terminal (Markdown gets its figures beside it).")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Also draw the crossover figure to FILE (.png, .pdf or .svg) and the phases to FILE-phases.")] = None,
) -> None:
    """Explain results: the answer generated from the runs, the crossover against a baseline, where the time goes."""
    from lora_bench.errors import UsageError
    from lora_bench.report.command import report_command

    if plot is not None:
        if plot.suffix.lower() not in PLOT_SUFFIXES:
            raise UsageError(f"--plot {plot}: the file name must end in one of {', '.join(PLOT_SUFFIXES)}")
        _output_dir(plot.parent, "--plot")
    if output is not None:
        if output.is_dir():
            raise UsageError(f"--output {output} is a folder; give the report's file name")
        _output_dir(output.parent, "--output")

    report_command(paths, group_by=group_by, baseline=baseline, metrics=metrics, fmt=format, output=output,
                   plot=plot, console=console)


@app.command("kernel-bench")
def kernel_bench(
    shapes: Annotated[Optional[str], typer.Option(help="Comma-separated: groups guide, 124m, 1558m, or specs "
                                                       "like 4x512:768->768:r16 (default: all groups).")] = None,
    impls: Annotated[Optional[str], typer.Option(help="Comma-separated subset of frozen, lora, lora-merged, "
                                                      "lora-kernel (lora-kernel:MODE forces a plan: direct, cpp, fused, cublas, torch).")] = None,
    dtypes: Annotated[str, typer.Option(help="Comma-separated: fp32, bf16, fp16.")] = "fp32,bf16",
    device: Annotated[str, typer.Option(help="cuda, cuda:N, or cpu.")] = "cuda",
    repeats: Annotated[int, typer.Option(help="Timed repeats per measurement (median, p10, p90).")] = 200,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up calls.")] = 20,
    cpu: Annotated[bool, typer.Option("--cpu", help="Add a CPU forward+backward column (fp32 rows).")] = False,
    out: Annotated[Path, typer.Option(help="CSV output.")] = Path("results/kernel-bench/kernel_bench.csv"),
    no_progress: NoProgress = False,
) -> None:
    """Time one LoRA layer (forward, backward, both) against the frozen layer: the floor."""
    from lora_bench.bench.kernel_bench import render_kernel_table, run_kernel_bench
    from lora_bench.errors import UsageError
    from lora_bench.results.manifest import record_invocation

    split = (lambda v: [x.strip() for x in v.split(",") if x.strip()] if v else None)
    _output_dir(out.parent, "--out")
    try:
        rows = run_kernel_bench(shapes=split(shapes), impls=split(impls), dtypes=split(dtypes), device=device,
                                repeats=repeats, warmup=warmup, out_csv=out, cpu=cpu, progress=not no_progress)
    except ValueError as e:  # bad shape/impl/dtype/device names or counts, or no GPU for device=cuda
        raise UsageError(str(e)) from e
    record_invocation(out.parent, outputs=[out.name])
    console.print(render_kernel_table(rows))
    console.print(f"written: {out}")


def main() -> None:
    """Entry point: typer handles usage errors (exit 2); domain errors become one message."""
    try:
        app()
    except LoraBenchError as e:
        err_console.print(f"[bold red]error:[/bold red] {e}", highlight=False)
        sys.exit(e.exit_code)
