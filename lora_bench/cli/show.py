"""``lora-bench show``: a run's phase breakdown again, from the files, with each phase's measured
cause where the folder holds a profiled repeat of the run's settings ("not measured" otherwise)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from lora_bench.cli.options import console


def show(results_dir: Annotated[Path, typer.Argument(help="A results folder holding runs.csv.")],
         run_id: Annotated[Optional[str], typer.Argument(help="Run id (default: the latest finished run).")] = None
         ) -> None:
    """Print a run's phase breakdown again, from the files (without RUN_ID: the latest finished run)."""
    from lora_bench.escaping import clip, markup
    from lora_bench.report.phase_table import phase_table
    from lora_bench.report.run_cause import folder_cause
    from lora_bench.results.store import find_run, unfinished_since

    row = find_run(results_dir, run_id)
    cause = folder_cause(results_dir, row)
    console.print(phase_table(row, busy=cause.busy, profile=cause.profile))
    if run_id is None and row.get("status") == "done":
        later = unfinished_since(results_dir, row)
        if later:
            shown = markup(", ".join(f"{clip(r['run_id'], 80)} ({r.get('status')})" for r in later[-3:]))
            console.print(f"{len(later)} later run(s) did not finish: {shown}; `lora-bench show {results_dir} RUN_ID` "
                          "shows one", highlight=False)
