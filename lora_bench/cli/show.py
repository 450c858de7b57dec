"""``lora-bench show``: a run's phase breakdown again, from the files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lora_bench.cli.options import console
from lora_bench.errors import UsageError


def show(results_dir: Annotated[Path, typer.Argument(help="A results folder holding runs.csv.")],
         run_id: Annotated[Optional[str], typer.Argument(help="Run id (default: the latest run).")] = None) -> None:
    """Print a run's phase breakdown again, from the files."""
    from lora_bench.report.phase_table import phase_table
    from lora_bench.results.store import read_runs

    path = results_dir / "runs.csv"
    if not path.is_file():
        raise UsageError(f"no runs.csv in {results_dir}: run `lora-bench train --results-dir {results_dir}` first")
    df = read_runs(path)
    if run_id is None:
        rows = df.to_dict("records")
        if not rows:
            raise UsageError(f"{path} holds no runs")
        console.print(phase_table(rows[-1]))
        return
    hit = df[df["run_id"] == run_id]
    if hit.empty:
        close = ", ".join(df["run_id"].tail(5))
        raise UsageError(f"run_id {run_id!r} not found in {path}; latest runs: {close}")
    console.print(phase_table(hit.iloc[0].to_dict()))
