"""docs/variants.md's tables of what each variant costs (lora_bench.publish.docs_variants), on a
results folder the test writes: rows of the variants study's shape (its settings in ``cfg_``
columns, some left out as runs.csv leaves them for older rows), five repeats each. Each row's
median, its ratio to its own implementation's LoRA (paired by repeat) and to the floor; a row the
folder lacks reads "not run yet"; runs of the other mode do not count; the rows of norms formed ahead
stand apart from the inline ones, in the best mode's table alone."""

from __future__ import annotations

import pandas as pd
import pytest

from lora_bench.publish import docs_variants as dv
from lora_bench.publish import source

# (row name, settings as the study writes them, step ms of repeat 0; each repeat adds 1 %)
RUNS = [
    (dv.FLOOR, {"trainable_layers": "frozen"}, 2.0),
    ("LoRA (`lora`)", {"trainable_layers": "lora"}, 6.0),
    ("rsLoRA (α/√r)", {"trainable_layers": "lora", "cfg_lora_scaling": "rslora"}, 6.0),
    ("DoRA, detached norm", {"trainable_layers": "lora", "cfg_lora_variant": "dora", "cfg_dora_norm": "detached"}, 9.0),
    ("DoRA, exact norm", {"trainable_layers": "lora", "cfg_lora_variant": "dora", "cfg_dora_norm": "exact"}, 12.0),
    ("LoRA+ (B's rate 16×)", {"trainable_layers": "lora", "cfg_loraplus_lr_ratio": "16.0"}, 6.0),
    ("fused LoRA (`lora-kernel`)", {"trainable_layers": "lora-kernel"}, 4.0),
    ("fused DoRA, exact norm", {"trainable_layers": "lora-kernel", "cfg_lora_variant": "dora"}, 5.0),
    ("fused DoRA, detached norm, norms ahead", {"trainable_layers": "lora-kernel", "cfg_lora_variant": "dora",
                                               "cfg_dora_norm": "detached", "cfg_dora_norm_launch": "ahead"}, 4.6),
    ("PEFT LoRA", {"trainable_layers": "lora", "cfg_implementation": "hf"}, 16.0),
    ("PEFT DoRA (`use_dora`)", {"trainable_layers": "lora", "cfg_implementation": "hf", "cfg_lora_variant": "dora",
                                "cfg_dora_norm": "detached"}, 24.0),
]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setattr(source, "RESULTS", tmp_path)
    monkeypatch.setattr(dv, "RESULTS", tmp_path)
    rows = []
    for repeat in range(5):
        for name, settings, ms in RUNS:
            for label, scale in (("best", 1.0), ("reference", 10.0)):
                rows.append({"run_id": f"{name}-{label}-r{repeat}", "status": "done", "model_size": "124M",
                             "sweep_name": "variants-study", "sweep_label": label, "repeat": repeat,
                             "step_ms_median": ms * scale * (1 + 0.01 * repeat),
                             "cfg_implementation": "book", **settings})
    df = pd.DataFrame(rows)
    df = df.drop(columns=["cfg_lora_init"], errors="ignore")  # a column older rows lack: its default
    (tmp_path / dv.VARIANTS).mkdir(parents=True)
    df.to_csv(tmp_path / dv.VARIANTS / "runs.csv", index=False)
    return tmp_path


def _cells(table: str) -> dict[str, list[str]]:
    lines = [line for line in table.splitlines()[2:] if line.startswith("|")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


def test_each_row_against_its_own_lora_and_the_floor(folder):
    cells = _cells(dv.table_variants("best"))
    assert list(cells) == [name for name, _f, _c in dv.ROWS]
    assert cells[dv.FLOOR][:3] == [cells[dv.FLOOR][0], "-", "1"] and cells[dv.FLOOR][0].startswith("2.04 ")
    # every repeat's ratio is the same: the paired ratio is exact
    assert cells["DoRA, exact norm"][1].startswith("2.00 [2.00–2.00]")
    assert cells["DoRA, exact norm"][2].startswith("6.00")
    assert cells["DoRA, detached norm"][1].startswith("1.50")
    assert cells["fused DoRA, exact norm"][1].startswith("1.25")  # against the fused LoRA, not the book's
    # the norms formed ahead: a row of their own, not pooled with the inline rows of the same norm
    assert cells["fused DoRA, detached norm, norms ahead"][1].startswith("1.15")
    assert cells["fused DoRA, detached norm"][0] == dv.NOT_RUN
    assert cells["PEFT DoRA (`use_dora`)"][1].startswith("1.50")  # against PEFT's LoRA
    assert cells["LoRA (`lora`)"][1] == "1" and cells["fused LoRA (`lora-kernel`)"][1] == "1"
    assert cells["rsLoRA (α/√r)"][1].startswith("1.00") and cells["LoRA+ (B's rate 16×)"][1].startswith("1.00")
    # rows the folder lacks, and the size it lacks
    assert cells["PiSSA"][0] == dv.NOT_RUN and cells["fused rsLoRA"][0] == dv.NOT_RUN
    assert all(cells[name][3] == dv.NOT_RUN for name in cells)
    # the other mode: its own numbers, ten times these
    ref = _cells(dv.table_variants("reference"))
    assert ref["LoRA (`lora`)"][0].startswith("61.2") and ref["DoRA, exact norm"][1].startswith("2.00")
    assert [name for name in dv.BEST_ONLY if name in ref] == []  # run in the best mode alone


def test_without_the_folder_every_row_is_not_run_yet(tmp_path, monkeypatch):
    monkeypatch.setattr(dv, "RESULTS", tmp_path)
    cells = _cells(dv.table_variants_best())
    assert len(cells) == len(dv.ROWS) and all(c[0] == c[3] == dv.NOT_RUN for c in cells.values())


def test_pissa_init_is_its_median_svd_time_and_the_steps_it_equals(tmp_path, monkeypatch):
    """PiSSA's one-time cost: the median adapter_init_s over its repeats with its interval, and that
    time in the row's own median steps; a row or size the folder lacks reads "not run yet"."""
    monkeypatch.setattr(source, "RESULTS", tmp_path)
    monkeypatch.setattr(dv, "RESULTS", tmp_path)
    rows = []
    for repeat in range(5):
        for size, init_s, step_ms in (("124M", 3.0, 6.0), ("1558M", 40.0, 40.0)):
            rows.append({"run_id": f"pissa-{size}-r{repeat}", "status": "done", "model_size": size,
                         "sweep_name": "variants-study", "sweep_label": "best", "repeat": repeat,
                         "trainable_layers": "lora", "cfg_implementation": "book", "cfg_lora_init": "pissa",
                         "adapter_init_s": init_s + 0.1 * repeat, "step_ms_median": step_ms})
        rows.append({"run_id": f"peft-124M-r{repeat}", "status": "done", "model_size": "124M",
                     "sweep_name": "variants-study", "sweep_label": "best", "repeat": repeat,
                     "trainable_layers": "lora", "cfg_implementation": "hf", "cfg_lora_init": "pissa",
                     "adapter_init_s": 5.0, "step_ms_median": 20.0})
    (tmp_path / dv.VARIANTS).mkdir(parents=True)
    pd.DataFrame(rows).to_csv(tmp_path / dv.VARIANTS / "runs.csv", index=False)
    cells = _cells(dv.table_pissa_init("best"))
    assert cells["PiSSA"][0].startswith("3.2 [3.0–3.4]") and cells["PiSSA"][1] == "533"
    assert cells["PiSSA"][2].startswith("40.2 [40.0–40.4]") and cells["PiSSA"][3] == "1,005"
    assert cells["PEFT PiSSA"][0].startswith("5.0") and cells["PEFT PiSSA"][1] == "250"
    assert cells["PEFT PiSSA"][2] == dv.NOT_RUN
    assert all(c[0] == dv.NOT_RUN for c in _cells(dv.table_pissa_init("reference")).values())


def test_accuracy_each_variant_over_its_seeds_against_lora_paired_by_seed(tmp_path, monkeypatch):
    """The accuracy table: each variant's median val and test accuracy over its seeds with the seeds'
    range, and its difference from LoRA's in points, paired by seed (a difference the same at every
    seed has a zero-width interval); a variant without finished runs reads "not run yet", and its
    count of seeds done says how many of its runs the folder holds."""
    monkeypatch.setattr(source, "RESULTS", tmp_path)
    monkeypatch.setattr(dv, "RESULTS", tmp_path)
    rows = []
    for repeat in range(5):
        for label, shift in (("lora", 0.0), ("dora-exact", 1.5), ("rslora", -2.0)):
            rows.append({"run_id": f"{label}-r{repeat}", "status": "done", "model_size": "124M",
                         "sweep_name": "variants-accuracy", "sweep_label": label, "repeat": repeat,
                         "val_acc": 90.0 + repeat + shift, "test_acc": 80.0 + 2 * repeat + shift})
    rows.append({"run_id": "pissa-r0", "status": "failed", "model_size": "124M", "sweep_name": "variants-accuracy",
                 "sweep_label": "pissa", "repeat": 0, "val_acc": None, "test_acc": None})
    (tmp_path / dv.VARIANTS_ACCURACY).mkdir(parents=True)
    pd.DataFrame(rows).to_csv(tmp_path / dv.VARIANTS_ACCURACY / "runs.csv", index=False)
    cells = _cells(dv.table_variants_accuracy())
    assert list(cells) == [name for name, _ in dv.ACCURACY_ROWS]
    assert cells["LoRA"][:3] == ["5 of 5", "92.0 (90.0–94.0)", "84.0 (80.0–88.0)"]
    assert cells["LoRA"][3:] == ["(baseline)", "(baseline)"]
    assert cells["DoRA, exact norm"][1:3] == ["93.5 (91.5–95.5)", "85.5 (81.5–89.5)"]
    assert cells["DoRA, exact norm"][3].startswith("1.5 pt [1.5–1.5] (n = 5")
    assert cells["rsLoRA (α/√r)"][4].startswith("-2.0 pt [-2.0 to -2.0] (n = 5")
    assert cells["PiSSA"] == ["0 of 1", dv.NOT_RUN, dv.NOT_RUN, "-", "-"]
    assert cells["LoRA+ (B's rate 16×)"][0] == "0 of 0"


def test_accuracy_without_the_folder_every_row_is_not_run_yet(tmp_path, monkeypatch):
    monkeypatch.setattr(dv, "RESULTS", tmp_path)
    cells = _cells(dv.table_variants_accuracy())
    assert len(cells) == len(dv.ACCURACY_ROWS) and all(c[1] == c[2] == dv.NOT_RUN for c in cells.values())


def test_norms_ahead_against_inline_paired_by_repeat(tmp_path, monkeypatch):
    """The norms-ahead table: each norm's inline and ahead rows at a size, ahead ÷ inline paired by
    repeat with its verdict, the forward phase's medians and the forward graph's kernels; a norm
    or size without both rows reads "not run yet"; the reference mode's rows do not count."""
    monkeypatch.setattr(source, "RESULTS", tmp_path)
    monkeypatch.setattr(dv, "RESULTS", tmp_path)
    rows = []
    base = {"trainable_layers": "lora-kernel", "cfg_lora_variant": "dora", "cfg_dora_norm": "detached",
            "cfg_implementation": "book", "model_size": "124M", "status": "done", "sweep_name": "variants-study"}
    for repeat in range(5):
        for launch, ms, fwd, kernels in (("inline", 4.8, 2.3, 353), ("ahead", 4.56, 2.1, 402)):
            for label in ("best", "reference"):
                rows.append({**base, "run_id": f"{launch}-{label}-r{repeat}", "sweep_label": label, "repeat": repeat,
                             "cfg_dora_norm_launch": launch,
                             "step_ms_median": (ms if label == "best" else 10 * ms) * (1 + 0.01 * repeat),
                             "forward_ms_median": fwd, "graph_kernels_forward": kernels})
    (tmp_path / dv.VARIANTS).mkdir(parents=True)
    pd.DataFrame(rows).to_csv(tmp_path / dv.VARIANTS / "runs.csv", index=False)
    lines = [line for line in dv.table_norms_ahead().splitlines()[2:] if line.startswith("|")]
    cells = {(c[0], c[1]): c[2:] for c in ([x.strip() for x in line.strip("|").split("|")] for line in lines)}
    assert list(cells) == [(norm, size) for norm in ("detached", "exact") for size in dv.SIZES]
    got = cells[("detached", "124M")]
    assert got[0].startswith("4.90 ") and got[1].startswith("4.65 ")
    assert got[2].startswith("0.950 [0.950–0.950]") and got[2].endswith("faster")  # 4.56 / 4.8 in every repeat
    assert got[3:] == ["2.30 → 2.10", "353 → 402"]
    assert all(c[0] == c[1] == dv.NOT_RUN for key, c in cells.items() if key != ("detached", "124M"))
