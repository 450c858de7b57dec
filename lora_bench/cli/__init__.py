"""The ``lora-bench`` command line: thin typer commands (one module each) that declare options and
call the library. Domain errors become one clear message and an exit code (2 for usage errors),
no traceback. ``-h`` and ``--help`` work everywhere. Shell completion is typer's
(``lora-bench --install-completion``); the program is named ``lora-bench`` however it is started,
so the completion script and the usage lines name the command a user types."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from lora_bench import __version__
from lora_bench.cli import bench, compare, data, report, show, sweep, train
from lora_bench.cli.options import CONTEXT, console, err_console
from lora_bench.cli.results import results_app
from lora_bench.errors import LoraBenchError
from lora_bench.escaping import clip_words, markup

PROG = "lora-bench"
app = typer.Typer(add_completion=True, no_args_is_help=True, rich_markup_mode="rich", context_settings=CONTEXT,
                  pretty_exceptions_show_locals=False,
                  help="Benchmark and ablation harness for LoRA fine-tuning of GPT-2 (SMS spam classification).")
data_app = typer.Typer(no_args_is_help=True, context_settings=CONTEXT, help="Data set commands.")
app.add_typer(data_app, name="data")
app.add_typer(results_app, name="results", context_settings=CONTEXT)

app.command("train", no_args_is_help=False, help=train.HELP)(train.command())
app.command("show")(show.show)
app.command("validate")(sweep.validate)
app.command("sweep", help=sweep.SWEEP_HELP)(sweep.sweep)
app.command("report")(report.report)
app.command("compare", help=compare.HELP)(compare.compare)
app.command("kernel-bench", help=bench.HELP)(bench.kernel_bench)
data_app.command("prepare")(data.data_prepare)


def _version(value: bool) -> None:
    if value:
        console.print(f"lora-bench {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, metavar="",
                                                help="Print the version and exit.")] = False) -> None:
    pass


def main() -> None:
    """Entry point: typer handles usage errors (exit 2); domain errors become one message."""
    try:
        app(prog_name=PROG)
    except LoraBenchError as e:
        err_console.print(f"[bold red]error:[/bold red] {markup(clip_words(e), newlines=True)}", highlight=False)
        sys.exit(e.exit_code)
