"""``lora-bench report``: read result folders, build the study and its answer, render it to the
terminal, Markdown, one self-contained HTML page, CSV or JSON, and draw its figures.

With ``--metrics`` or ``--group-by`` the output is the table of groups, as asked, below the
study's answer where the runs give one (CSV and JSON: the table alone). Figures: ``--plot FILE``
writes the crossover to FILE and the phases beside it (FILE-phases); where the runs hold no
crossover (one model size, no baseline) FILE gets the phase figure, and where no figure applies the
command stops with the reason (exit 2). Markdown written to a file gets its figures beside it
unless --plot names them; HTML embeds them. No two figures, and no figure and the report, share a
file."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from lora_bench.errors import UsageError
from lora_bench.escaping import markup
import lora_bench.report.figures as figs
from lora_bench.report.aggregate import FORMATS, build_report, plan_report, refused_notes, report_of
from lora_bench.report.document import build_document, table_document
from lora_bench.report.filters import filter_runs
from lora_bench.report.load import RESULTS_DIR, load_results
from lora_bench.report.render import emit
from lora_bench.report.stats import THRESHOLD
from lora_bench.report.study import build_study, study_baseline
from lora_bench.results.folder_files import LOCK_SUFFIX, RESULTS_FILES


FIGURES = ("crossover", "phases")


def _renamed(folder: str, paths: list[Path], names: list[str]) -> str:
    """``folder`` (one of ``paths`` or a folder inside one) under its name in ``names``."""
    for path, name in zip(paths, names):
        base = str(path)
        if folder == base or folder.startswith(base.rstrip("/") + "/"):
            return name + folder[len(base):]
    return folder


def report_command(paths: list[Path], *, group_by: str | None, baseline: str | None, metrics: str | None,
                   fmt: str, output: Path | None, plot: Path | None, console, threshold: float = THRESHOLD,
                   names: list[str] | None = None, filters: list[str] | None = None) -> list[Path]:
    """What ``lora-bench report`` does: read, aggregate, explain, render, draw; returns the files
    written. ``names``: how the report names ``paths`` (default: as given), so that a report
    rendered from elsewhere reads the same."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not allowed; choose one of: {', '.join(FORMATS)}")

    def split(text):
        return [s for s in (t.strip() for t in text.split(",")) if s] if text else None

    df = filter_runs(load_results(paths), filters)  # --filter KEY=VALUE (lora_bench.report.filters)
    if names:  # the folders as the report names them, in its notes too (run_dir stays the path read)
        df[RESULTS_DIR] = df[RESULTS_DIR].map(lambda v: _renamed(v, paths, names))
    table_only = bool(group_by or metrics) or fmt in ("csv", "json")
    # the table of groups is set against the study's baseline unless it is asked for on its own terms
    against = baseline or (None if group_by or metrics else study_baseline(df))
    plan = plan_report(df, group_by=split(group_by), metrics=split(metrics), baseline=against, threshold=threshold)
    study = None
    if table_only:  # the table of groups as asked, the study's answer above it (not in CSV or JSON)
        rep = build_report(df, group_by=split(group_by), metrics=split(metrics), baseline=against,
                           threshold=threshold)
        if fmt not in ("csv", "json") or plot is not None:
            study = _study(df, baseline=baseline, title=_title(paths), threshold=threshold, optional=plot is None)
    else:  # the runs grouped once: the study's groups are the table of every group's rows too
        study = build_study(df, baseline=baseline, title=_title(paths), threshold=threshold, metrics=plan.numeric)
        rep = report_of(plan, study.run_groups, keys=study.keys)
    for option, path in (("--output", output), *(("--plot", p) for p in
                                                  figure_paths(plot, fmt=fmt, output=output,
                                                               table_only=table_only).values())):
        if path is not None and (Path(path).name in RESULTS_FILES or Path(path).name.endswith(LOCK_SUFFIX)):
            raise UsageError(f"{option} {path}: a report never writes over a results file "
                             f"({', '.join(RESULTS_FILES)}, *{LOCK_SUFFIX}); give the report another name")
    drawn = _draw(study, fmt=fmt, output=output, plot=plot, table_only=table_only)
    wrote = list(dict.fromkeys(drawn["files"].values()))
    if table_only:
        doc = table_document(rep, title=f"{len(rep.done)} finished runs from {', '.join(names or map(str, paths))}",
                             study=study, figures=set(drawn["files"]) | set(drawn["embedded"]))
    else:
        doc = build_document(study, rep, figures=set(drawn["files"]) | set(drawn["embedded"]))
    emit(fmt, doc=doc, rep=rep, drawn=drawn, output=output, console=console)
    if output:
        wrote.insert(0, output)
    status = console if fmt not in ("csv", "json") or output else Console(stderr=True)  # stdout stays parseable
    for note in [*drawn["notes"], *refused_notes(df)]:
        status.print(note, highlight=False, markup=False)
    for path in wrote:
        status.print(f"wrote {markup(path)}", highlight=False)
    return [Path(p) for p in wrote]


def _study(df, *, baseline: str | None, title: str, threshold: float, optional: bool):
    """The study's view of the runs; where only the table of groups was asked for, None when the
    runs give no study (the table still stands)."""
    try:
        return build_study(df, baseline=baseline, title=title, threshold=threshold)
    except UsageError:
        if optional:
            return None
        raise


def _title(paths: list[Path]) -> str:
    return ", ".join(Path(p).resolve().name if Path(p).is_dir() else Path(p).resolve().parent.name for p in paths)


def figure_paths(plot: Path | None, *, fmt: str, output: Path | None, table_only: bool) -> dict[str, Path]:
    """Where each figure goes: --plot FILE for the crossover and FILE-phases beside it, else beside
    a Markdown file; refuses a figure path that is the report's own file."""
    if plot is not None:
        plot = Path(plot)
        files = {"crossover": plot, "phases": plot.with_name(f"{plot.stem}-phases{plot.suffix}")}
    elif fmt == "markdown" and output is not None and not table_only:
        files = {k: Path(output).with_name(f"{Path(output).stem}-{k}.png") for k in FIGURES}
    else:
        return {}
    if output is not None and any(p.resolve() == Path(output).resolve() for p in files.values()):
        raise UsageError(f"--plot {plot}: a figure would overwrite the report's --output {output}; "
                         "give the figure another name")
    return files


def _draw(study, *, fmt: str, output: Path | None, plot: Path | None, table_only: bool) -> dict:
    """Draw the figures the output needs: files (key -> path), embedded (key -> base64 PNG) and
    notes (what was drawn instead of what, and why)."""
    files = figure_paths(plot, fmt=fmt, output=output, table_only=table_only)
    embed = fmt == "html" and study is not None
    out = {"files": {}, "embedded": {}, "notes": []}
    if not files and not embed:
        return out
    made = {key: make(study) for key, make in (("crossover", figs.crossover_figure), ("phases", figs.phase_figure))}
    if plot is not None:
        if made["crossover"] is None and made["phases"] is None:
            raise UsageError(f"--plot {plot}: no figure applies to these runs: {figs.why_no_crossover(study)}, and "
                             "no phase was timed (the phase figure needs step timings: timing=off leaves none)")
        if made["crossover"] is None:  # the file asked for holds the figure that applies
            files["phases"] = files.pop("crossover")
            out["notes"].append(f"no crossover figure ({figs.why_no_crossover(study)}): {plot} holds the phase "
                                "figure")
    for key, fig in made.items():
        if fig is None:
            continue
        if key in files:
            out["files"][key] = figs.save(fig, files[key])
        if embed:
            out["embedded"][key] = figs.png_base64(fig)
        figs.close(fig)
    return out
