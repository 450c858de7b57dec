"""``lora-bench report``: read result folders, aggregate, render to the terminal or a file, plot."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.measure import Measurement

from lora_bench.errors import UsageError
from lora_bench.report.aggregate import FORMATS, build_report, load_results, to_csv, to_markdown, to_rich
from lora_bench.report.plots import plot_report


def report_command(paths: list[Path], *, group_by: str | None, baseline: str | None, metrics: str | None,
                   fmt: str, output: Path | None, plot: Path | None, console) -> None:
    """What ``lora-bench report`` does: read, aggregate, render, optionally plot."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not allowed; choose one of: {', '.join(FORMATS)}")

    def split(text):
        return [s for s in (t.strip() for t in text.split(",")) if s] if text else None

    rep = build_report(load_results(paths), group_by=split(group_by), baseline=baseline, metrics=split(metrics))
    if fmt == "table":
        title = f"{len(rep.done)} finished runs from {', '.join(map(str, paths))}"
        table = to_rich(rep, title=title)
        target = Console(file=open(output, "w"), no_color=True) if output else console
        # never clip a number to fit a narrow terminal or a log's 80 columns: print at full width
        width = max(target.width, Measurement.get(target, target.options.update_width(10_000), table).maximum)
        Console(file=target.file, width=width, force_terminal=target.is_terminal,
                no_color=target.no_color).print(table)
        if output:
            target.file.close()
    else:
        text = to_markdown(rep) if fmt == "markdown" else to_csv(rep)
        if output:
            Path(output).write_text(text)
        else:
            console.out(text, end="", highlight=False)
    if output:
        console.print(f"wrote {output}", highlight=False)
    if plot:
        plot_report(rep, plot)
        console.print(f"wrote {plot}", highlight=False)
