"""``lora-bench show``: a run's phase breakdown again, from the files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lora_bench.cli.options import console


def show(results_dir: Annotated[Path, typer.Argument(help="A results folder holding runs.csv.")],
         run_id: Annotated[Optional[str], typer.Argument(help="Run id (default: the latest run).")] = None) -> None:
    """Print a run's phase breakdown again, from the files."""
    from lora_bench.report.phase_table import phase_table
    from lora_bench.results.store import find_run

    console.print(phase_table(find_run(results_dir, run_id)))
