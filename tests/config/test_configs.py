"""Every shipped sweep file in configs/ validates, opens with the command that runs it, and holds
what it promises: the 19 published rows, the all-vs-LoRA timing grid, a download-free smoke run."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_bench.model.gpt2 import MODEL_SIZES
from lora_bench.sweep.spec import load_sweep, validate_files
from paths import ROOT

REPO = ROOT
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_the_three_promised_configs_ship():
    assert {p.name for p in CONFIGS} >= {"book-table.yaml", "all-vs-lora.yaml", "smoke.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_validates_and_names_its_command(path):
    sw = load_sweep(path)
    assert sw.runs and sw.name == path.stem
    first = path.read_text().splitlines()[0]
    assert first == f"# lora-bench sweep configs/{path.name}" or first.startswith(f"# lora-bench sweep configs/{path.name} ")


def test_validate_command_accepts_all_configs():
    from rich.console import Console

    assert len(validate_files(CONFIGS, console=Console(quiet=True))) == len(CONFIGS)


def test_book_table_rows():
    runs = load_sweep(REPO / "configs" / "book-table.yaml").runs
    assert len(runs) == 19
    row = {int(r.label.split(":")[0].removeprefix("row ")): r.cfg for r in runs}
    assert sorted(row) == list(range(1, 20))
    assert [n for n, c in row.items() if c.weights == "random"] == [10]
    assert all(c.num_epochs == 5 and c.max_steps is None and not c.skip_final_eval for c in row.values())
    expect = {
        1: dict(model_size="124M", trainable_layers="last_block"),
        2: dict(trainable_token_pos="first"), 3: dict(trainable_layers="last_layer"),
        4: dict(trainable_layers="last_two_blocks"), 5: dict(trainable_layers="all"),
        6: dict(model_size="355M", trainable_layers="last_block"), 7: dict(model_size="774M"),
        8: dict(model_size="1558M", trainable_layers="last_block"),
        9: dict(model_size="1558M", trainable_layers="all"),
        10: dict(model_size="124M", trainable_layers="all", weights="random"),
        11: dict(model_size="124M", trainable_layers="lora", lora_rank=16, lora_alpha=16.0),
        12: dict(model_size="1558M", trainable_layers="lora", lora_rank=16, lora_alpha=8.0),
        13: dict(context_length="model_context_length"),
        14: dict(no_padding=True, batch_size=1, accumulation_steps=1),
        15: dict(no_padding=True, batch_size=1, accumulation_steps=8),
        16: dict(trainable_token_pos="flexible"), 17: dict(disable_causal_mask=True),
        18: dict(ignore_index=50256), 19: dict(average_embeddings=True),
    }
    for n, settings in expect.items():
        assert {k: getattr(row[n], k) for k in settings} == settings, f"row {n}"
    # the ablation rows change exactly their own setting(s) from row 1
    for n in (2, 3, 4, 5, 13, 14, 15, 16, 17, 18, 19):
        diff = {k for k, v in row[n].to_dict().items() if v != row[1].to_dict()[k]}
        assert diff == {k for k, v in expect[n].items() if getattr(row[1], k) != v}, f"row {n}"


def test_all_vs_lora_grid():
    path = REPO / "configs" / "all-vs-lora.yaml"
    sw = load_sweep(path)
    assert sw.repeats >= 3
    got = {(r.cfg.model_size, r.cfg.trainable_layers) for r in sw.runs}
    assert got == {(s, t) for s in ("124M", "355M", "774M", "1558M")
                   for t in ("all", "lora", "lora-merged", "lora-kernel")}
    modes = {(r.cfg.precision, r.cfg.attention, r.cfg.ops, r.cfg.cuda_graphs, r.cfg.optimizer) for r in sw.runs}
    assert ("fp32", "book", "book", False, "book") in modes and ("bf16", "sdpa", "fused", True, "fused") in modes
    assert {r.cfg.batch_size for r in sw.runs} == {8, 32}  # the tokens-per-step axis
    assert len(sw.runs) == 16 * len(modes) * 2 * sw.repeats
    for r in sw.runs:
        c = r.cfg
        assert c.weights == "random" and c.skip_final_eval and c.eval_freq == 0
        assert c.max_steps and 30 <= c.max_steps <= 200 and c.warmup_steps < c.max_steps
    assert "timing" in path.read_text().lower() and "skip_final_eval" in path.read_text()


def test_smoke_needs_no_download_and_stays_small():
    sw = load_sweep(REPO / "configs" / "smoke.yaml")
    for r in sw.runs:
        c = r.cfg
        assert c.model_size == "tiny" and MODEL_SIZES["tiny"] and c.weights == "random"
        assert c.device in ("cpu", "auto") and c.max_steps <= 10 and c.skip_final_eval
        data = Path(c.data_file)
        assert data.is_file() and REPO in data.parents  # shipped in the repo: no download
    assert len(sw.runs) <= 16


def test_quantized_base_study_covers_every_base_and_the_qlora_peer():
    """Both sizes × lora on every base dtype and lora-kernel on the full-precision one (on a stored
    base it runs lora's layer) in the book model's best mode, and the QLoRA peer beside the peer's
    bf16-cast base, 5 repeats."""
    sw = load_sweep(REPO / "configs" / "quantized-base-study.yaml")
    assert sw.repeats == 5
    settings = {(r.cfg.model_size, r.cfg.implementation, r.cfg.trainable_layers, r.cfg.base_dtype, r.cfg.compile,
                 r.cfg.cuda_graphs) for r in sw.runs}
    for size in ("124M", "1558M"):
        for base in ("precision", "bf16", "fp8", "int8", "nf4"):
            assert (size, "book", "lora", base, False, True) in settings
        assert (size, "book", "lora-kernel", "precision", False, True) in settings
        assert not any(s[0] == size and s[2] == "lora-kernel" and s[3] != "precision" for s in settings)
        for base in ("nf4", "precision"):
            assert (size, "hf", "lora", base, True, False) in settings
    for r in sw.runs:
        cfg = r.cfg
        assert (cfg.weights, cfg.batch_size, cfg.precision, cfg.attention, cfg.ops, cfg.optimizer) == \
            ("random", 8, "bf16", "sdpa", "fused", "fused")
    assert len(sw.runs) == 20 * 5


def test_quantized_base_compiled_is_the_studys_1558m_lora_rows_with_each_block_compiled():
    """The compiled sweep is the study's 1558M lora rows on the precision, bf16, fp8, int8 and nf4
    bases in the study's mode (CUDA graphs), each block compiled, 3 repeats."""
    study = {r.cfg.base_dtype: r.cfg for r in load_sweep(REPO / "configs" / "quantized-base-study.yaml").runs
             if r.cfg.model_size == "1558M" and r.cfg.implementation == "book" and r.cfg.trainable_layers == "lora"}
    sw = load_sweep(REPO / "configs" / "quantized-base-compiled.yaml")
    assert sw.repeats == 3
    assert sorted({r.cfg.base_dtype for r in sw.runs}) == sorted(["precision", "bf16", "fp8", "int8", "nf4"])
    same = ("weights", "batch_size", "lora_rank", "lora_alpha", "precision", "attention", "ops", "optimizer",
            "max_steps", "warmup_steps", "eval_freq", "skip_final_eval", "cuda_graphs")
    for r in sw.runs:
        cfg = r.cfg
        assert (cfg.model_size, cfg.trainable_layers, cfg.compile, cfg.compile_scope) == \
            ("1558M", "lora", True, "blocks")
        assert {k: getattr(cfg, k) for k in same} == {k: getattr(study[cfg.base_dtype], k) for k in same}


def test_quantized_base_scales_sweep_is_the_bnb_sweep_with_and_without_double_quantization():
    """The scales sweep sets bitsandbytes' NF4 with double quantization (nf4-bnb) against the same
    without it (nf4-bnb-nodq), beside the bf16 base, in the bitsandbytes sweep's mode at both sizes,
    5 repeats."""
    bnb = {(r.cfg.model_size, r.cfg.base_dtype): r.cfg
           for r in load_sweep(REPO / "configs" / "quantized-base-bnb.yaml").runs}
    sw = load_sweep(REPO / "configs" / "quantized-base-bnb-scales.yaml")
    assert sw.repeats == 5
    assert sorted({(r.cfg.model_size, r.cfg.base_dtype) for r in sw.runs}) == sorted(
        (size, base) for size in ("124M", "1558M") for base in ("bf16", "nf4-bnb", "nf4-bnb-nodq"))
    same = ("weights", "trainable_layers", "batch_size", "lora_rank", "lora_alpha", "precision", "attention", "ops",
            "optimizer", "max_steps", "warmup_steps", "eval_freq", "skip_final_eval", "cuda_graphs", "compile")
    for r in sw.runs:
        ref = bnb[(r.cfg.model_size, "nf4-bnb")]
        assert {k: getattr(r.cfg, k) for k in same} == {k: getattr(ref, k) for k in same}


def test_quantized_base_accuracy_trains_every_stored_base_from_the_same_seeds():
    """The accuracy sweep trains lora on the bf16 base and on every quantized base the project
    declares, at 124M for 5 epochs and 1558M for 1, from 5 seeds with full evaluations; seed r's
    runs of one size differ in their base dtype alone (so each starts from the same model)."""
    from lora_bench.config import QUANTIZED_BASES

    sw = load_sweep(REPO / "configs" / "quantized-base-accuracy.yaml")
    assert sw.repeats == 5
    bases = ("bf16", *QUANTIZED_BASES)
    assert sorted((r.cfg.model_size, r.cfg.base_dtype) for r in sw.runs) == sorted(
        (size, base) for size in ("124M", "1558M") for base in bases for _ in range(5))
    by_point: dict[tuple[str, int], set] = {}
    for r in sw.runs:
        cfg = r.cfg
        assert (cfg.trainable_layers, cfg.num_epochs, cfg.skip_final_eval) == \
            ("lora", {"124M": 5, "1558M": 1}[cfg.model_size], False)
        rest = tuple(sorted((k, str(v)) for k, v in vars(cfg).items() if k != "base_dtype"))
        by_point.setdefault((cfg.model_size, r.repeat), set()).add(rest)
    assert all(len(v) == 1 for v in by_point.values())
    assert len({next(iter(v)) for v in by_point.values()}) == 10  # the seeds differ between repeats


def test_quantized_base_profile_profiles_the_studys_1558m_lora_rows_eagerly():
    """The profile sweep is the study's 1558M lora rows on each stored base (bf16, fp8, int8, nf4)
    and the bitsandbytes sweeps' nf4-bnb and nf4-bnb-nodq rows, in their mode but eager (a profiler
    sees no kernels inside a replayed CUDA graph), profiled per phase with its top kernels."""
    study = {r.cfg.base_dtype: r.cfg for name in ("quantized-base-study", "quantized-base-bnb",
                                                  "quantized-base-bnb-scales")
             for r in load_sweep(REPO / "configs" / f"{name}.yaml").runs
             if r.cfg.model_size == "1558M" and r.cfg.implementation == "book" and r.cfg.trainable_layers == "lora"}
    profile = load_sweep(REPO / "configs" / "quantized-base-profile.yaml").runs
    assert sorted(r.cfg.base_dtype for r in profile) == sorted(["bf16", "fp8", "int8", "nf4", "nf4-bnb",
                                                                "nf4-bnb-nodq"])
    same = ("weights", "batch_size", "lora_rank", "lora_alpha", "precision", "attention", "ops", "optimizer",
            "max_steps", "warmup_steps", "eval_freq", "skip_final_eval", "compile")
    for r in profile:
        cfg = r.cfg
        assert (cfg.model_size, cfg.trainable_layers, cfg.profile) == ("1558M", "lora", "kernels")
        assert not cfg.cuda_graphs
        assert {k: getattr(cfg, k) for k in same} == {k: getattr(study[cfg.base_dtype], k) for k in same}


def test_floor_study_measures_every_variant_beside_the_floor_in_both_bf16_precisions():
    sw = load_sweep(REPO / "configs" / "floor-study.yaml")
    got = {(r.cfg.model_size, r.cfg.trainable_layers, r.cfg.precision, r.cfg.adapter_grads) for r in sw.runs}
    rows = {("frozen", "bf16", "inline"), ("frozen", "bf16-true", "inline"), ("all", "bf16", "inline"),
            ("lora", "bf16", "inline"), ("lora", "bf16-true", "inline"), ("lora-kernel", "bf16", "inline"),
            ("lora-kernel", "bf16", "deferred"), ("lora-kernel", "bf16-true", "deferred")}
    assert got == {(s, *row) for s in ("124M", "1558M") for row in rows}
    assert sw.repeats == 5 and len(sw.runs) == len(got) * 5
    for r in sw.runs:
        c = r.cfg
        assert (c.attention, c.ops, c.optimizer, c.cuda_graphs, c.batch_size, c.lora_rank) == ("sdpa", "fused", "fused",
                                                                                                 True, 8, 16)
        assert c.weights == "random" and c.skip_final_eval and c.eval_freq == 0 and c.warmup_steps < c.max_steps


# (implementation, trainable_layers, lora_variant, dora_norm, lora_scaling, loraplus_lr_ratio, lora_init)
VARIANT_ROWS = {
    ("book", "frozen", "lora", "exact", "alpha", 1.0, "kaiming"),
    ("book", "lora", "lora", "exact", "alpha", 1.0, "kaiming"),
    ("book", "lora", "lora", "exact", "rslora", 1.0, "kaiming"),
    ("book", "lora", "lora", "exact", "alpha", 16.0, "kaiming"),
    ("book", "lora", "dora", "exact", "alpha", 1.0, "kaiming"),
    ("book", "lora", "dora", "detached", "alpha", 1.0, "kaiming"),
    ("book", "lora-merged", "dora", "exact", "alpha", 1.0, "kaiming"),
    ("book", "lora", "lora", "exact", "alpha", 1.0, "pissa"),
    ("book", "lora-kernel", "lora", "exact", "alpha", 1.0, "kaiming"),
    ("book", "lora-kernel", "lora", "exact", "rslora", 1.0, "kaiming"),
    ("book", "lora-kernel", "dora", "exact", "alpha", 1.0, "kaiming"),
    ("book", "lora-kernel", "dora", "detached", "alpha", 1.0, "kaiming"),
    ("hf", "lora", "lora", "exact", "alpha", 1.0, "kaiming"),
    ("hf", "lora", "dora", "detached", "alpha", 1.0, "kaiming"),
    ("hf", "lora", "lora", "exact", "rslora", 1.0, "kaiming"),
    ("hf", "lora", "lora", "exact", "alpha", 1.0, "pissa"),
}


def test_the_variants_study_still_plans_every_run_its_folder_records():
    """A sweep resumes by run id: every run recorded in results/answer/variants is one the study's
    file plans (its fused DoRA rows name the launch they ran, whatever the default is now)."""
    from lora_bench.results.store import result_rows

    planned = {r.run_id for r in load_sweep(REPO / "configs" / "variants-study.yaml").runs}
    recorded = {r["run_id"] for r in result_rows(REPO / "results" / "answer" / "variants")
                if r.get("sweep_name") == "variants-study"}
    assert recorded and recorded <= planned, sorted(recorded - planned)[:5]


def test_variants_study_runs_every_variant_in_both_modes_at_both_sizes():
    """Every variant row at 124M and 1558M in the reference mode (the defaults) and the best mode (the
    floor study's for the book model, configs/peers.yaml's compiled one for hf), 5 repeats of the
    floor study's timing runs."""
    sw = load_sweep(REPO / "configs" / "variants-study.yaml")
    floor = load_sweep(REPO / "configs" / "floor-study.yaml").runs[0].cfg
    got = {(r.cfg.model_size, r.label, r.cfg.implementation, r.cfg.trainable_layers, r.cfg.lora_variant,
            r.cfg.dora_norm, r.cfg.lora_scaling, r.cfg.loraplus_lr_ratio, r.cfg.lora_init, r.cfg.dora_norm_launch)
           for r in sw.runs}
    ahead = {("best", *row[:4], "alpha", 1.0, "kaiming", "ahead")
             for row in [("book", "lora-kernel", "dora", "exact"), ("book", "lora-kernel", "dora", "detached")]}
    # the fused DoRA rows name their launch (inline, and ahead in the best mode); the others leave the default
    launch = {row: "inline" if row[1:3] == ("lora-kernel", "dora") else "auto" for row in VARIANT_ROWS}
    assert got == {(s, mode, *row, launch[row]) for s in ("124M", "1558M") for mode in ("reference", "best")
                   for row in VARIANT_ROWS} | {(s, *row) for s in ("124M", "1558M") for row in ahead}
    assert sw.repeats == 5 and len(sw.runs) == len(got) * 5
    modes = {("reference", "book"): ("fp32", "book", "book", "book", False, False),
             ("reference", "hf"): ("fp32", "book", "book", "book", False, False),
             ("best", "book"): ("bf16", "sdpa", "fused", "fused", True, False),
             ("best", "hf"): ("bf16", "sdpa", "fused", "fused", False, True)}
    for r in sw.runs:
        c = r.cfg
        mode = (c.precision, c.attention, c.ops, c.optimizer, c.cuda_graphs, c.compile)
        assert mode == modes[(r.label, c.implementation)]
        assert (c.batch_size, c.lora_rank, c.lora_alpha, c.weights) == (8, 16, 16.0, "random")
        assert (c.max_steps, c.warmup_steps, c.eval_freq, c.skip_final_eval) == \
            (floor.max_steps, floor.warmup_steps, 0, True)


def test_variants_accuracy_trains_each_variant_of_one_lora_run_from_5_seeds():
    """Each row is the lora row with its own variant settings changed alone (124M, 5 epochs, random
    weights, so it runs offline, in the best mode); 5 seeds, repeat r of every row from the same
    seed, and so from the same random model."""
    sw = load_sweep(REPO / "configs" / "variants-accuracy.yaml")
    assert sw.repeats == 5 and sw.vary_seed
    variants = {"lora": {}, "rslora": {"lora_scaling": "rslora"}, "loraplus": {"loraplus_lr_ratio": 16.0},
                "dora-exact": {"lora_variant": "dora", "dora_norm": "exact"},
                "dora-detached": {"lora_variant": "dora", "dora_norm": "detached"}, "pissa": {"lora_init": "pissa"}}
    assert sorted(r.label for r in sw.runs) == sorted(label for label in variants for _ in range(5))
    lora = {r.repeat: r.cfg for r in sw.runs if r.label == "lora"}
    seeds: dict[int, set[int]] = {}
    for r in sw.runs:
        assert r.cfg.to_dict() == lora[r.repeat].to_dict() | variants[r.label], r.label
        c = r.cfg
        assert (c.model_size, c.num_epochs, c.weights, c.trainable_layers, c.lora_rank, c.lora_alpha) == \
            ("124M", 5, "random", "lora", 16, 16.0)
        assert (c.precision, c.attention, c.ops, c.optimizer, c.cuda_graphs, c.skip_final_eval) == \
            ("bf16", "sdpa", "fused", "fused", True, False)
        seeds.setdefault(r.repeat, set()).add(c.seed)
    assert all(len(s) == 1 for s in seeds.values()) and len({next(iter(s)) for s in seeds.values()}) == 5


def test_variants_cause_profiles_each_reference_row_of_the_variants_study_once():
    """Each profiled run is a reference-mode row of configs/variants-study.yaml with only the profiler
    added, and every such row has one: the report pairs them by what their steps launch."""
    study = load_sweep(REPO / "configs" / "variants-study.yaml")
    cause = load_sweep(REPO / "configs" / "variants-cause.yaml")
    reference = {r.cfg.to_dict().__repr__() for r in study.runs if r.label == "reference" and r.repeat == 0}
    assert cause.repeats == 1 and len(cause.runs) == len(reference)
    profiled = set()
    for r in cause.runs:
        assert r.cfg.profile == "kernels" and not r.cfg.cuda_graphs
        profiled.add((r.cfg.to_dict() | {"profile": "none"}).__repr__())
    assert profiled == reference


def test_packing_overhead_holds_the_floor_at_the_packs_batch():
    """The 16-point pack's step is set against the floor at batch 128 (16 × 8 rows): the floor's
    run differs from the plain LoRA run at that batch only in what trains."""
    sw = load_sweep(REPO / "configs" / "packing-overhead.yaml")
    plain = {r.cfg.trainable_layers: r.cfg for r in sw.runs if r.label == "plain" and r.repeat == 0}
    packed = [r.cfg for r in sw.runs if r.label == "packed" and r.repeat == 0]
    assert plain["frozen"].batch_size == len(packed) * packed[0].batch_size == 128
    assert plain["frozen"].to_dict() | {"trainable_layers": "lora"} == plain["lora"].to_dict()
