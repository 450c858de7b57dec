"""lora_bench.report.per_layer: the adapters' µs per adapted layer, a LoRA group's step less its
floor's over the layers an adapter wraps, paired per repeat of one sweep with the order-statistic
interval of the median; from hand-built run folders (known step times per repeat), through the
study's crossover table in Markdown, HTML and on the terminal, and in the docs' generated floor
table."""

from __future__ import annotations

import io
import re
import statistics

import pandas as pd
import pytest
from rich.console import Console

from lora_bench.publish import docs_study
from lora_bench.report.document import build_document
from lora_bench.report.load import load_results
from lora_bench.report.per_layer import NO_FLOOR, UNIT, against_floor, layer_count, per_layer, per_layer_text
from lora_bench.report.render_html import to_html
from lora_bench.report.render_markdown import to_markdown
from lora_bench.report.render_terminal import print_document
from lora_bench.report.stats import REPEATS
from lora_bench.report.study import build_study
from lora_bench.report.tables import crossover_table
from lora_bench.results.store import read_runs

# one sweep's five repeats: the floor's step moves with the host from repeat to repeat, and each
# LoRA repeat sits 9, 14, 10, 12 and 11 µs per layer above the floor of its own repeat (124M: 73 layers)
FLOOR_MS = (2.0, 3.0, 2.2, 2.05, 2.6)
ABOVE_US = (9.0, 14.0, 10.0, 12.0, 11.0)
LAYERS_124M = 73


def _run(run_id: str, *, size: str, layers: str, step: float, repeat: int, **settings) -> dict:
    row = {"run_id": run_id, "status": "done", "started_at": f"2026-01-01T00:0{repeat}:00+00:00",
           "model_size": size, "trainable_layers": layers, "cfg_model_size": size, "cfg_trainable_layers": layers,
           "cfg_batch_size": "8", "cfg_lora_rank": "16", "cfg_precision": "bf16", "cfg_cuda_graphs": "True",
           "cfg_profile": "none", "sweep_name": "floor", "repeat": repeat, "step_ms_median": step,
           "gpu_name": "NVIDIA H200"}
    row.update({f"cfg_{k}": v for k, v in settings.items()})
    for ph, share in (("data", 0.0), ("forward", 0.45), ("backward", 0.45), ("optimizer", 0.1)):
        row[f"{ph}_ms_median"] = share * step
        row[f"host_{ph}_ms_median"] = 0.1 * share * step
    return row


def _folder(tmp_path, *, floor_sizes=("124M",), lora_sizes=("124M",)) -> pd.DataFrame:
    rows = []
    for r, (floor, above) in enumerate(zip(FLOOR_MS, ABOVE_US)):
        rows += [_run(f"{s}-frozen-r{r}", size=s, layers="frozen", step=floor, repeat=r) for s in floor_sizes]
        rows += [_run(f"{s}-lora-r{r}", size=s, layers="lora", step=floor + above * LAYERS_124M / 1000, repeat=r)
                 for s in lora_sizes]
    pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
    return load_results([tmp_path])


def _study(tmp_path, **kw):
    return build_study(_folder(tmp_path, **kw), baseline="trainable_layers=frozen")


def test_the_per_layer_cost_is_the_median_of_the_paired_differences_with_its_interval(tmp_path):
    df = _folder(tmp_path)
    lora, floor = df[df["trainable_layers"] == "lora"], df[df["trainable_layers"] == "frozen"]
    e = per_layer(lora, floor)
    # paired per repeat: the median of 9, 14, 10, 12, 11 and, at n = 5, [min, max] with 1 − 2⁻⁴ confidence
    assert e.value == pytest.approx(11.0) and (e.lo, e.hi) == (pytest.approx(9.0), pytest.approx(14.0))
    assert e.paired and e.n == 5 and e.over == REPEATS and e.confidence == pytest.approx(0.9375)
    assert per_layer_text(lora, floor) == "11.0 [9.0–14.0] (n = 5, 93.8 %)"
    # unpaired (the floor's host speed does not cancel) the difference of the medians would differ
    unpaired = (statistics.median(lora["step_ms_median"]) - statistics.median(floor["step_ms_median"])) * 1000 / 73
    assert abs(unpaired - 11.0) > 0.5


def test_the_crossover_against_the_floor_shows_it_in_every_format(tmp_path):
    study = _study(tmp_path)
    table = crossover_table(study)
    row = next(r for r in table.rows if r[1].startswith("lora:"))
    assert row[1] == f"lora: {UNIT} [interval]" and row[2] == "11.0\n[9.0–14.0] (n = 5, 93.8 %)"
    assert any(n.startswith(f"{UNIT}:") and "counts three layers" in n for n in table.notes)
    doc = build_document(study, None, figures=set())
    assert "| lora: µs per adapted layer \\[interval\\] | 11.0 \\[9.0–14.0\\] (n = 5, 93.8 %) |" in to_markdown(doc)
    assert re.search(r"<td>lora: µs per adapted layer \[interval\]</td><td[^>]*>11.0<br>\[9.0–14.0\]",
                     to_html(doc))
    console = Console(file=io.StringIO(), width=400, color_system=None)
    print_document(doc, console)
    out = console.file.getvalue()  # rich wraps the cell: its words and its interval, each on a line
    assert "lora: µs per adapted layer" in out and "[9.0–14.0] (n = 5, 93.8 %)" in out


def test_a_lora_group_without_a_floor_reads_no_floor(tmp_path):
    study = _study(tmp_path, lora_sizes=("124M", "355M"))
    row = next(r for r in crossover_table(study).rows if r[1].startswith("lora:"))
    assert row[2].startswith("11.0") and row[3] == NO_FLOOR
    lora = study.groups[-1].runs
    assert per_layer_text(lora, None) == per_layer_text(lora, lora.iloc[:0]) == NO_FLOOR
    assert not per_layer(lora, None).known


def test_a_study_against_another_baseline_shows_no_per_layer_row(tmp_path):
    df = _folder(tmp_path)
    study = build_study(df, baseline="trainable_layers=lora")
    assert not any(UNIT in r[1] for r in crossover_table(study).rows)
    assert against_floor({"cfg_trainable_layers": "frozen"}) and against_floor({"trainable_layers": "Frozen"})
    assert not against_floor({"cfg_trainable_layers": "all"})
    assert not against_floor({"cfg_trainable_layers": "frozen", "cfg_precision": "bf16"})


@pytest.mark.parametrize("row, layers", [
    ({"cfg_model_size": "124M"}, 6 * 12 + 1),  # the book: query, key, value, projection, MLP's two; the head
    ({"cfg_model_size": "1558M", "cfg_implementation": "book"}, 6 * 48 + 1),
    ({"model_size": "124M", "cfg_implementation": "hf"}, 4 * 12),  # PEFT: four Conv1D per block, no head
    ({"cfg_model_size": "1558M", "cfg_implementation": "hf"}, 4 * 48),
    ({"cfg_model_size": "tiny", "cfg_n_layers": "3", "cfg_emb_dim": "64"}, 6 * 3 + 1),  # shape overrides
    # lora-kernel with grouped query/key/value: one call for the three, counted as three layers
    ({"cfg_model_size": "124M", "cfg_trainable_layers": "lora-kernel", "cfg_group_qkv": "True"}, 6 * 12 + 1),
])
def test_the_layer_count_follows_the_model_shape_and_implementation(row, layers):
    assert layer_count(row) == layers


def test_a_row_without_a_known_size_has_no_layer_count():
    assert layer_count({"cfg_model_size": ""}) is None and layer_count({"cfg_model_size": "9000M"}) is None


def test_the_generated_floor_table_has_the_per_layer_column_for_each_size():
    lines = docs_study.table_floor().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head.count(f"124M {UNIT} [interval]") == 1 and head.count(f"1558M {UNIT} [interval]") == 1
    col = head.index(f"124M {UNIT} [interval]")
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")] for r in lines[2:]}
    assert rows["`all`, bf16 autocast"][col] == "-" and rows["the floor (`frozen`), bf16-true"][col] == "-"
    # the cell, computed here from the committed runs: per repeat the step less the floor's of the same
    # repeat and precision, over 124M's 73 layers; the median of the five
    df = read_runs(docs_study.RESULTS / docs_study.FLOOR / "runs.csv")
    df = df[(df["status"] == "done") & (df["model_size"] == "124M") & (df["cfg_precision"] == "bf16")]
    floor = df[df["trainable_layers"] == "frozen"].set_index("repeat")["step_ms_median"]
    kernel = df[(df["trainable_layers"] == "lora-kernel") & (df["cfg_adapter_grads"] == "deferred")]
    diffs = [(float(r.step_ms_median) - float(floor[r.repeat])) * 1000 / LAYERS_124M for r in kernel.itertuples()]
    cell = rows["`lora-kernel`, bf16 autocast, deferred"][col]
    assert len(diffs) == 5
    assert cell == f"{statistics.median(diffs):.1f} [{min(diffs):.1f}–{max(diffs):.1f}]"
