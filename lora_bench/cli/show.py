"""``lora-bench show``: a run's phase breakdown again, from the files, with each phase's measured
cause where the folder holds a profiled repeat of the run's settings ("not measured" otherwise). A
run is named by its id or by the start of it: a prefix that begins one run id names that run; one
that begins several is refused with the candidates (exit 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from lora_bench.cli.options import console
from lora_bench.errors import UsageError

SHOWN_CANDIDATES = 8  # an ambiguous prefix's candidates named in its error, at most


def show(results_dir: Annotated[Path, typer.Argument(help="A results folder holding runs.csv.")],
         run_id: Annotated[Optional[str], typer.Argument(help="Run id, or its start where that begins one run id "
                                                             "(default: the latest finished run).")] = None
         ) -> None:
    """Print a run's phase breakdown again, from the files (without RUN_ID: the latest finished run)."""
    from lora_bench.escaping import clip, markup
    from lora_bench.report.phase_table import phase_table
    from lora_bench.report.run_cause import folder_cause
    from lora_bench.results.lookup import find_run, unfinished_since

    row = find_run(results_dir, run_id if run_id is None else matching_run_id(results_dir, run_id))
    cause = folder_cause(results_dir, row)
    console.print(phase_table(row, busy=cause.busy, profile=cause.profile))
    if run_id is None and row.get("status") == "done":
        later = unfinished_since(results_dir, row)
        if later:
            shown = markup(", ".join(f"{clip(r['run_id'], 80)} ({r.get('status')})" for r in later[-3:]))
            console.print(f"{len(later)} later run(s) did not finish: {shown}; `lora-bench show {results_dir} RUN_ID` "
                          "shows one", highlight=False)


def matching_run_id(results_dir: Path, run_id: str) -> str:
    """The run id ``run_id`` names in ``results_dir``: itself where a run has that id, else the one
    run id it begins; ``run_id`` unchanged where it begins none (``find_run`` says what there is).
    A prefix of several run ids is a UsageError naming them."""
    from lora_bench.results.store import result_rows

    ids = [r["run_id"] for r in result_rows(Path(results_dir), warn=None)] if Path(results_dir).is_dir() else []
    if run_id in ids or not run_id:
        return run_id
    hits = sorted({i for i in ids if isinstance(i, str) and i.startswith(run_id)})
    if len(hits) == 1:
        return hits[0]
    if hits:
        more = f" and {len(hits) - SHOWN_CANDIDATES} more" if len(hits) > SHOWN_CANDIDATES else ""
        raise UsageError(f"run_id {run_id!r} begins {len(hits)} run ids in {results_dir}: "
                         f"{', '.join(hits[:SHOWN_CANDIDATES])}{more}; give more of it")
    return run_id
