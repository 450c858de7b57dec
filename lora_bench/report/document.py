"""What a study report says, in reading order, independent of the output format: the title and
question, a one-line setting, the answer at a glance (three lines, ``glance``) beside the crossover
figure, then the generated answer, the crossover, and the details (where the time goes, kernel
profiles, accuracy, the setup, every group). Each renderer walks this list. A report of the table
of groups alone (``--group-by``, ``--metrics``) carries the same answer above its table."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from lora_bench.report.aggregate import Report
from lora_bench.report.answer import MIN_SHARE, Point, answer
from lora_bench.report.empty import why_empty
from lora_bench.report.floor_kernels import floor_tables
from lora_bench.report.glance import glance
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
    glance: list[str] = field(default_factory=list)  # the answer in at most three lines, first of all
    glance_figure: str = ""  # key of the figure shown beside the glance (then not in its section)


def build_document(study: Study, rep: Report | None, *, figures: set[str]) -> Document:
    """The report's sections; ``figures`` names the figures that exist (they are referenced)."""
    facts = dict(header_facts(study))
    setting = " · ".join(v for v in (facts.get("device"), facts.get("software"), facts.get("runs started")) if v)
    sections = answer_sections(study, figures=figures)
    fastest = fastest_lora_table(study)
    if fastest is not None:
        sections.append(Section("How fast LoRA can be made", tables=[fastest]))
    sections.append(Section("Where the time goes", tables=why_tables(study, min_share=MIN_SHARE),
                            figure="phases" if "phases" in figures else "", figure_first=True))
    prof = profiles_table(study)
    if prof is not None:
        sections.append(Section("Kernel profiles", tables=[prof]))
    above = floor_tables(study)
    if above is not None:
        sections.append(Section("Device time above the floor", tables=[above[0]]))
        if above[1]:
            sections.append(Section("Kernel classes above the floor, by phase", tables=above[1], terminal=False))
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
                    sections=sections, **_at_a_glance(study, figures))


def answer_sections(study: Study, *, figures: set[str]) -> list[Section]:
    """The answer and the crossover (its table; its figure where the glance does not show it), or
    why there is no comparison."""
    points = answer(study)
    if not points:
        why = ("the runs hold a single trainable-layer choice, so there is nothing to compare; "
               "pick a baseline with --baseline key=value" if not study.baseline else
               "no group has a baseline group of the same size, mode and condition")
        return [Section("Answer", text=[f"No comparison: {why}."], first_screen=True)]
    called = f" ({study.baseline_name} below)" if study.baseline_name != study.baseline_text else ""
    intro = (f"On {study.device}, the {STEP_STATISTIC}; a ratio below 1.0 is faster than "
             f"{study.baseline_text}{called}. In brackets: intervals with the repeats they stand on (n) and the confidence they "
             f"reach (order statistics, exact at any n); slower or faster only from {MIN_REPEATS} repeats a side "
             f"and where a ratio's whole interval clears 1 ± {threshold_text(study.threshold)}. Generated "
             f"from the runs by the rules in `{RULES_AT}`.")
    text = [intro] + ([STEPS_FOOTNOTE + "."] if study.per_step else [])
    shown_apart = "crossover" in figures and not glance(study)
    return [Section("Answer", points=points, first_screen=True, text=text),
            Section("The crossover", tables=[crossover_table(study)], first_screen=True,
                    figure="crossover" if shown_apart else "")]


def _at_a_glance(study: Study, figures: set[str]) -> dict:
    lines = glance(study)
    return {"glance": lines, "glance_figure": "crossover" if lines and "crossover" in figures else ""}


def table_document(rep: Report, *, title: str, study: Study | None = None, figures: set[str] = frozenset()) -> Document:
    """The table of groups (what ``--metrics`` or ``--group-by`` ask for), below the study's answer
    where there is a study to answer from."""
    table = Section("Every group" if study is not None else "", tables=[groups_table(rep)],
                    first_screen=study is None)
    if study is None:
        return Document(title=title, question="", setting="", sections=[table])
    return Document(title=title, question=study.header.question, setting="", sections=[
        *answer_sections(study, figures=figures), table], **_at_a_glance(study, figures))


def study_runs(study: Study) -> pd.DataFrame:
    return pd.concat([g.runs for g in study.groups]) if study.groups else pd.DataFrame()
