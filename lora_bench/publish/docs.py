"""The generated parts of the documentation: docs/results-schema.md in full, and every table between
``<!-- generated:NAME -->`` and ``<!-- /generated -->`` in README.md and docs/*.md, each computed by
the function TABLES names from the committed results. ``expected`` is what the files should hold;
``outdated`` the files that do not hold it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from lora_bench.publish import docs_method as method
from lora_bench.publish import docs_quantized as quantized
from lora_bench.publish import docs_study as study
from lora_bench.publish import docs_variants as variants
from lora_bench.publish.docs_stats import table_order_stats
from lora_bench.publish.docs_schema import results_schema
from lora_bench.publish.source import ROOT

BLOCK = re.compile(r"(<!-- generated:([a-z0-9-]+) -->\n)(.*?)(<!-- /generated -->)", re.S)

TABLES: dict[str, Callable[[], str]] = {
    "packing": quantized.table_packing,
    "packing-step": quantized.table_packing_step,
    "quantized": quantized.table_quantized,
    "quantized-accuracy": quantized.table_quantized_accuracy,
    "quantized-bnb": quantized.table_quantized_bnb,
    "quantized-bnb-scales": quantized.table_quantized_bnb_scales,
    "quantized-compiled": quantized.table_quantized_compiled,
    "quantized-profile": quantized.table_quantized_profile,
    "answer": study.table_answer,
    "fastest": study.table_fastest,
    "floor": study.table_floor,
    "book-whole-runs": study.table_book_whole_runs,
    "study-repeats": study.table_study_repeats,
    "cause": study.table_cause,
    "spread-124m": study.table_spread_124m,
    "plan-rules": method.table_plan_rules,
    "study-eager": study.table_study_eager,
    "study-graphs": study.table_study_graphs,
    "study-phases": study.table_study_phases,
    "phases-124m": study.table_phases_124m,
    "profilers": study.table_profilers,
    "modes-124m": method.table_modes_124m,
    "block-compile": method.table_block_compile,
    "whole-runs": method.table_whole_runs,
    "timer-overhead": method.table_timer_overhead,
    "profile-1558m": method.table_profile_1558m,
    "peers": method.table_peers,
    "graph-candidates": method.table_graph_candidates,
    "graph-candidates-hopper": method.table_graph_candidates_hopper,
    "step-kernels": method.table_step_kernels,
    "five-epochs": method.table_five_epochs,
    "qkv-group": method.table_qkv_group,
    "first-use": method.table_first_use,
    "order-stats": table_order_stats,
    "variants-best": variants.table_variants_best,
    "variants-ahead": variants.table_norms_ahead,
    "variants-pissa-init": variants.table_pissa_init_best,
    "variants-reference": variants.table_variants_reference,
    "variants-accuracy": variants.table_variants_accuracy,
}


def render_blocks(text: str, tables: dict[str, Callable[[], str]]) -> str:
    def fill(m: re.Match) -> str:
        name = m.group(2)
        if name not in tables:
            raise KeyError(f"unknown generated block {name!r}; known: {', '.join(tables)}")
        return m.group(1) + tables[name]() + m.group(4)

    return BLOCK.sub(fill, text)


def expected(tables: dict[str, Callable[[], str]] = TABLES, *, root: Path = ROOT) -> dict[Path, str]:
    """Every generated file (or file with generated blocks) and the content it should have."""
    out = {root / "docs" / "results-schema.md": results_schema()}
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if path.name == "results-schema.md" or not path.is_file():
            continue
        text = path.read_text()
        if BLOCK.search(text):
            out[path] = render_blocks(text, tables)
    return out


def outdated(files: dict[Path, str]) -> list[Path]:
    """The files of ``files`` (path -> what it should hold) that do not hold it."""
    return [p for p, text in files.items() if not p.is_file() or p.read_text() != text]
