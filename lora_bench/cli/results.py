"""``lora-bench results``: provenance of results folders — the generated index
(``results/README.md``), superseded sweep runs, manifests rebuilt from rows, descriptions, and the
reports each folder declares, rendered again from its runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

results_app = typer.Typer(no_args_is_help=True, help="Results folders: index, provenance, superseded runs, reports.")
console = Console(width=None if sys.stdout.isatty() else 160)

Folder = Annotated[Path, typer.Argument(help="A results folder (holding runs.csv and/or manifest.json).",
                                        show_default=False)]


def _folder(path: Path):
    from lora_bench.errors import UsageError

    if not path.is_dir():
        raise UsageError(f"{path}: no such results folder")
    return path


@results_app.command("index")
def index(
    root: Annotated[Path, typer.Argument(help="The folder of results folders.")] = Path("results"),
    check: Annotated[bool, typer.Option("--check", help="Write nothing; exit 1 when README.md is not up to date.")] = False,
) -> None:
    """Generate ROOT/README.md from every folder's manifest.json and rows."""
    from lora_bench.publish.results_index import render_index, write_index
    from lora_bench.results.index import INDEX

    _folder(root)
    if check:
        current = (root / INDEX).read_text() if (root / INDEX).is_file() else ""
        if current != render_index(root):
            console.print(f"{root / INDEX} is not up to date: run `lora-bench results index {root}`", highlight=False)
            raise typer.Exit(1)
        console.print(f"{root / INDEX} is up to date", highlight=False)
        return
    console.print(f"written: {write_index(root)}", highlight=False)


@results_app.command("prune")
def prune(
    folder: Folder,
    superseded: Annotated[bool, typer.Option("--superseded", help="Move rows replaced by a newer run of the same "
                                             "sweep, settings and repeat (and their run folders) to superseded/.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would move; move nothing.")] = False,
) -> None:
    """Keep one row per (sweep, settings, repeat) in runs.csv: the newest. Numbers are not changed."""
    from lora_bench.errors import UsageError
    from lora_bench.results.prune import SUPERSEDED, prune_superseded

    if not superseded:
        raise UsageError("results prune: say what to prune; allowed: --superseded")
    found = prune_superseded(_folder(folder), dry_run=dry_run)
    for s in found:
        console.print(f"{'would move' if dry_run else 'moved'} {s.run_id} (superseded by {s.superseded_by})",
                      highlight=False)
    where = folder / SUPERSEDED
    console.print(f"{len(found)} superseded run(s)" + ("" if dry_run or not found else f" now in {where}"),
                  highlight=False)


@results_app.command("reconstruct")
def reconstruct(
    folders: Annotated[list[Path], typer.Argument(help="Results folders without a manifest.", show_default=False)],
    description: Annotated[Optional[str], typer.Option(help="What the folder holds (one folder only).")] = None,
) -> None:
    """Write manifest.json for folders written before they had one, from the rows' own columns
    (git_commit, versions, GPU, start time); marked 'reconstructed from rows'."""
    from lora_bench.errors import UsageError
    from lora_bench.results.manifest import MANIFEST, read_manifest, reconstruct_entries, update_manifest
    from lora_bench.results.prune import SUPERSEDED
    from lora_bench.results.store import result_rows

    if description is not None and len(folders) != 1:
        raise UsageError(f"--description applies to one folder; {len(folders)} given")
    for folder in folders:
        _folder(folder)
        if read_manifest(folder)["invocations"]:
            raise UsageError(f"{folder / MANIFEST} already has entries; reconstruct only folders without one")
        rows = result_rows(folder)
        run_dirs = {r["run_id"] for r in rows}
        outputs = [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*"))
                   if p.is_file() and p.name not in (MANIFEST, "README.md", "runs.csv") and not p.name.endswith(".lock")
                   and p.relative_to(folder).parts[0] not in (*run_dirs, SUPERSEDED)]
        entries = reconstruct_entries(rows, outputs=outputs)

        def change(data: dict, entries=entries) -> None:
            data["invocations"] = entries
            if description is not None:
                data["description"] = description.strip()

        update_manifest(folder, change)
        console.print(f"{folder / MANIFEST}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} "
                      f"reconstructed from {len(rows)} row(s)", highlight=False)


@results_app.command("describe")
def describe(folder: Folder,
             text: Annotated[Optional[str], typer.Argument(help="What the folder holds, in a sentence or two.",
                                                           show_default=False)] = None,
             question: Annotated[bool, typer.Option("--question", help="The folder groups results folders by "
                                                    "the question they answer; TEXT is the question.")] = False,
             timings: Annotated[Optional[str], typer.Option(
                 metavar="measured|shared", help="shared: the folder's runs ran side by side on one GPU (seeds of an "
                 "accuracy sweep, say), so their times are not a measurement and reports leave them out; "
                 "measured (the default) undoes it.", show_default=False)] = None) -> None:
    """Set the folder's description (the 'what' column of the index), or a group's question, and
    whether its runs' times are a measurement."""
    from lora_bench.errors import UsageError
    from lora_bench.results.manifest import TIMINGS_CHOICES, set_description, set_timings

    if text is None and timings is None:
        raise UsageError("nothing to set: give TEXT (the description), --timings, or both")
    if timings is not None and timings not in TIMINGS_CHOICES:  # before anything is written
        raise UsageError(f"--timings {timings!r}: use one of {', '.join(TIMINGS_CHOICES)}")
    if text is not None:
        set_description(_folder(folder), text, question=question)
    if timings is not None:
        set_timings(_folder(folder), timings)
    console.print(f"described: {folder}", highlight=False)


@results_app.command("render")
def render(
    folders: Annotated[Optional[list[Path]], typer.Argument(help="Results folders whose manifest declares reports "
                                                            "(default: every one under --root).",
                                                            show_default=False)] = None,
    root: Annotated[Path, typer.Option(help="The folder of results folders; reports name their inputs from "
                                            "the folder above it.")] = Path("results"),
    check: Annotated[bool, typer.Option("--check", help="Write nothing; exit 1 naming every report that is not what "
                                                        "its runs give today.")] = False,
) -> None:
    """Render every report a folder's manifest.json declares (its reports recipes), from the folder's runs;
    then ROOT/README.md, where it is there, as `results index` writes it."""
    from lora_bench.errors import UsageError
    from lora_bench.escaping import markup
    from lora_bench.progress import CountProgress
    from lora_bench.publish.committed import declared_folders, recipes, render_all, stale_reports
    from lora_bench.publish.results_index import write_index
    from lora_bench.results.index import INDEX

    _folder(root)
    declared = declared_folders(root)
    if folders:
        for f in folders:
            _folder(f)
            if not f.resolve().is_relative_to(root.resolve()):
                raise UsageError(f"{f} is not inside the results root --root {root}; give --root the folder above it")
            if not recipes(f, root=root):
                raise UsageError(f"{f}: its manifest.json declares no reports (a 'reports' list of recipes: "
                                 "format, output and the report's options)")
    chosen = list(folders) if folders else declared
    if check:
        with CountProgress(console, total=len(chosen), label="checking reports", enabled=True) as bar:
            stale = stale_reports(root, chosen if folders else None, advance=bar.advance)
        for path, why in stale:
            console.print(f"stale: {markup(path)}: {markup(why)}", highlight=False)
        if stale:
            console.print(f"{len(stale)} report file(s) out of date: run `lora-bench results render`", highlight=False)
            raise typer.Exit(1)
        console.print(f"{len(chosen)} folder(s): every report is what its runs give", highlight=False)
        return
    with CountProgress(console, total=len(chosen), label="rendering reports", enabled=True) as bar:
        written = render_all(chosen, root=root, advance=bar.advance)
    for folder, files in written.items():
        for r in recipes(folder, root=root):
            console.print(f"rendered: {markup(r.command())}", highlight=False, soft_wrap=True)
        for p in dict.fromkeys(files):
            console.print(f"wrote {markup(p)}", highlight=False)
    if written and (root / INDEX).is_file():  # the index lists each folder's files with their sizes
        console.print(f"written: {markup(str(write_index(root)))}", highlight=False)


@results_app.command("export")
def export(
    folder: Folder,
    to: Annotated[str, typer.Option("--to", metavar="mlflow|tensorboard",
                                    help="The tracker: mlflow or tensorboard.", show_default=False)],
    tracking_uri: Annotated[Optional[str], typer.Option(help="MLflow: the tracking URI (a server, sqlite:///FILE, "
                                                             "...); default: a SQLite store in FOLDER/mlflow.",
                                                        show_default=False)] = None,
    experiment: Annotated[Optional[str], typer.Option(help="MLflow: the experiment (default: the folder's name in "
                                                           "its own store, its absolute path in a --tracking-uri "
                                                           "store).", show_default=False)] = None,
    output: Annotated[Optional[Path], typer.Option(help="TensorBoard: where the event files go, one subfolder "
                                                        "per run (default: FOLDER/tensorboard).",
                                                   show_default=False)] = None,
) -> None:
    """Write every run of FOLDER to MLflow or TensorBoard: settings as parameters, per-step losses,
    phase times and accuracies as metrics at their steps, provenance as tags (MLflow: run.json as an
    artifact). Runs exported before are skipped when unchanged and replaced when recorded again."""
    from lora_bench.escaping import markup
    from lora_bench.trackers.export import export_folder
    from lora_bench.trackers.mlflow_store import default_uri
    from lora_bench.trackers.tensorboard_files import OUTPUT

    done = export_folder(_folder(folder), to=to, tracking_uri=tracking_uri, output=output, experiment=experiment)
    for run_id, what in done:
        console.print(f"{what}: {markup(run_id)}", highlight=False)
    where = (tracking_uri or default_uri(folder)) if to == "mlflow" else (output or folder / OUTPUT)
    console.print(f"{len(done)} run(s) in {markup(where)}", highlight=False, soft_wrap=True)
