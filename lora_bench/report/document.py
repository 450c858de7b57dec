"""What a study report says, in reading order, independent of the output format: the title and
question, a one-line setting, the generated answer, the crossover, then the details (where the
time goes, kernel profiles, accuracy, the setup, every group). Each renderer walks this list."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from lora_bench.report.aggregate import Report
from lora_bench.report.answer import MIN_SHARE, Point, answer
from lora_bench.report.empty import why_empty
from lora_bench.report.group_table import groups_table
from lora_bench.report.order_stats import MIN_REPEATS
from lora_bench.report.stats import threshold_text
from lora_bench.report.study_model import Study
from lora_bench.report.tables import (
    STEP_STATISTIC,
    STEPS_FOOTNOTE,
    Table,
    accuracy_table,
    crossover_table,
    fastest_lora_table,
    header_facts,
    profiles_table,
    why_tables,
)

RULES_AT = "lora_bench/report/answer.py"


@dataclass
class Section:
    title: str
    text: list[str] = field(default_factory=list)  # paragraphs (Markdown-style **bold** allowed)
    points: list[Point] = field(default_factory=list)  # bullets with a bold heading and sub-bullets
    tables: list[Table] = field(default_factory=list)
    figure: str = ""  # key of a figure: 'crossover' or 'phases'
    figure_first: bool = False  # the figure before the tables (it reads faster than they do)
    facts: list[tuple[str, str]] = field(default_factory=list)
    first_screen: bool = False
    terminal: bool = True  # shown on the terminal too (the long table of every group is for files)


@dataclass
class Document:
    title: str
    question: str
    setting: str  # one line: device, software, dates
    sections: list[Section]


def build_document(study: Study, rep: Report | None, *, figures: set[str]) -> Document:
    """The report's sections; ``figures`` names the figures that exist (they are referenced)."""
    facts = dict(header_facts(study))
    setting = " · ".join(v for v in (facts.get("device"), facts.get("software"), facts.get("runs started")) if v)
    sections = []
    points = answer(study)
    if points:
        intro = (f"On {study.device}, the {STEP_STATISTIC}; a ratio below 1.0 is faster than "
                 f"{study.baseline_text}. In brackets: intervals with the repeats they stand on (n) and the confidence they "
                 f"reach (order statistics, exact at any n); slower or faster only from {MIN_REPEATS} repeats a side "
                 f"and where a ratio's whole interval clears 1 ± {threshold_text(study.threshold)}. Generated "
                 f"from the runs by the rules in `{RULES_AT}`.")
        text = [intro] + ([STEPS_FOOTNOTE + "."] if study.per_step else [])
        sections.append(Section("Answer", points=points, first_screen=True, text=text))
        sections.append(Section("The crossover", tables=[crossover_table(study)], first_screen=True,
                                figure="crossover" if "crossover" in figures else ""))
    else:
        why = ("the runs hold a single trainable-layer choice, so there is nothing to compare; "
               "pick a baseline with --baseline key=value" if not study.baseline else
               "no group has a baseline group of the same size, mode and condition")
        sections.append(Section("Answer", text=[f"No comparison: {why}."], first_screen=True))
    fastest = fastest_lora_table(study)
    if fastest is not None:
        sections.append(Section("How fast LoRA can be made", tables=[fastest]))
    sections.append(Section("Where the time goes", tables=why_tables(study, min_share=MIN_SHARE),
                            figure="phases" if "phases" in figures else "", figure_first=True))
    prof = profiles_table(study)
    if prof is not None:
        sections.append(Section("Kernel profiles", tables=[prof]))
    acc = accuracy_table(study)
    if acc is not None:
        sections.append(Section("Accuracy next to speed", tables=[acc]))
    else:
        sections.append(Section("Accuracy next to speed", text=[why_empty(study_runs(study), "test_acc") + "."]))
    setup = [(k, v) for k, v in header_facts(study) if k not in ("device", "software")]
    sections.append(Section("Setup", facts=setup, text=study.notes))
    if rep is not None:
        sections.append(Section("Every group", tables=[groups_table(rep)], terminal=False))
    return Document(title=f"Study report: {study.header.title}", question=study.header.question, setting=setting,
                    sections=sections)


def table_document(rep: Report, *, title: str) -> Document:
    """Only the table of groups (what ``--metrics`` or ``--group-by`` ask for)."""
    return Document(title=title, question="", setting="", sections=[Section("", tables=[groups_table(rep)], first_screen=True)])


def study_runs(study: Study) -> pd.DataFrame:
    return pd.concat([g.runs for g in study.groups]) if study.groups else pd.DataFrame()
