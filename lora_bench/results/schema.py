"""Results: the one schema of the per-run (``runs.csv``) and per-step (``steps.csv``) tables —
every measured column with its unit, dtype and which direction is better."""

from __future__ import annotations

from dataclasses import dataclass

from lora_bench.config import SETTINGS, TrainConfig
from lora_bench.timing import PHASES


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str  # pandas dtype: "string", "float64", "Int64", "boolean"
    unit: str
    help: str
    better: str = ""  # "lower", "higher" or "" (not a metric)


def _phase_cols() -> list[Column]:
    cols = []
    for ph in (*PHASES, "step"):
        for stat in ("median", "p10", "p90"):
            cols.append(Column(f"{ph}_ms_{stat}", "float64", "ms", f"device time of the {ph} phase, {stat} over measured steps", "lower"))
            cols.append(Column(f"host_{ph}_ms_{stat}", "float64", "ms", f"host time of the {ph} phase, {stat}", "lower"))
    return cols


# Columns no longer written. Rows that hold them keep them (runs.csv and run.json are records);
# readers leave them out and say why. How each reads in an older row:
RETIRED_COLUMNS: dict[str, str] = {
    f"bound_{ph}": (f"'host' where the {ph} phase's median host time reached 0.9 × its device time, else 'device': "
                    "an inference, not a cause (host ≈ device time holds for a busy GPU too): the measured cause "
                    "is the GPU's busy fraction from a profiled repeat (`lora-bench show`, `report`)")
    for ph in PHASES}


# What a run's ``status`` says, for the schema page; the values are the writers' (train.run, sweep).
STATUSES: dict[str, str] = {
    "running": "begun and not yet ended: its process executes it; readers show it as interrupted once no process "
               "holds its folder (the process was killed outright), and the next write records it so",
    "done": "ran to its end; its numbers are results",
    "diverged": "ran to its end, but a loss was not finite (NaN or inf) from `diverged_at_step` on: measured, not a "
                "result; `report` leaves it out and names it, a resumed sweep does not run it again",
    "failed": "an error ended it (`error`); also a run whose record did not fit on disk, kept with its measured "
              "columns",
    "interrupted": "a signal ended it (`error` names it), or its process died; the summary of the steps measured so "
                   "far is kept",
}

RUN_COLUMNS: list[Column] = [
    Column("run_id", "string", "", "unique run id (settings hash, repeat or time stamp)"),
    Column("status", "string", "", "running, done, diverged, failed or interrupted (see Statuses below)"),
    Column("error", "string", "", "error message when not done"),
    Column("started_at", "string", "ISO-8601", "start time (UTC)"),
    Column("model_size", "string", "", "GPT-2 size"),
    Column("weights", "string", "", "pretrained or random"),
    Column("trainable_layers", "string", "", "trainable-layer choice / LoRA variant"),
    Column("lora_rank", "Int64", "", "LoRA rank (blank when not LoRA)"),
    Column("lora_alpha", "float64", "", "LoRA alpha (blank when not LoRA)"),
    Column("trainable_params", "Int64", "params", "parameters with requires_grad"),
    Column("total_params", "Int64", "params", "all parameters"),
    Column("train_acc", "float64", "%", "final accuracy on the whole train loader", "higher"),
    Column("val_acc", "float64", "%", "final accuracy on the whole validation loader", "higher"),
    Column("test_acc", "float64", "%", "final accuracy on the whole test loader", "higher"),
    Column("final_train_loss", "float64", "", "last periodic train loss", "lower"),
    Column("final_val_loss", "float64", "", "last periodic validation loss", "lower"),
    Column("training_time_s", "float64", "s", "wall time of the loop incl. periodic evaluation (the reference's figure)", "lower"),
    Column("training_time_min", "float64", "min", "the same in minutes", "lower"),
    Column("steps", "Int64", "steps", "training steps run"),
    Column("diverged_at_step", "Int64", "step", "diverged runs: the first step whose training loss, or the periodic "
           "evaluation after it, is not finite"),
    Column("device", "string", "", "torch device"),
    Column("backend", "string", "", "lora-kernel's plan(s) its layers ran in the training step, as they recorded them (docs/kernel-design.md): direct (the C++ op launching the Triton kernels itself: eager bf16/fp16 CUDA), cpp (the C++ op with ATen GEMMs: eager fp32 CUDA, and captured layers of 1558M-MLP size), fused (the Triton kernels: captured or compiled layers), cublas (cuBLAS GEMMs with Triton adapter gradients: captured or compiled layers in exact fp32, compiled layers of 1558M-MLP size), torch (CPU); with lora_variant dora also where its norm ran, dora-norm-triton (one Triton launch) or dora-norm-torch (torch ops: the CPU, no Triton; docs/variants.md); joined with + when layers differ; blank for other choices. Runs recorded under earlier names read as these (triton: fused, cpp-direct: direct)"),
    Column("dora_norms", "string", "", "lora-kernel with lora_variant dora: where its layers' norms formed in the "
           "training step, as they recorded it ('; '-joined): triton (the norm's Triton kernels in the layer's call), "
           "triton: the norm formed ahead (dora_norm_launch ahead, or auto where a one-GPU step replays CUDA graphs), "
           "triton: the norm formed ahead, the scale in the LoRA GEMM (its epilogue scaled the output), torch: why "
           "(torch ops: the CPU, no Triton, a dtype or rank the kernels do not take, torch.compile) "
           "(docs/variants.md); blank for other choices"),
    Column("gemm_tiles", "string", "", "lora-kernel with gemm_tiles timed: each fused GEMM launch shape's tile "
           "('; '-joined): the launch (mm, mm_scale), rows x inner -> columns, dtype, the adapter columns padded "
           "(R) and H-in where H was formed before the launch, then the tile chosen with every candidate's µs "
           "per launch, or picked (why it was not timed) (docs/kernel-design.md); blank otherwise"),
    Column("optimizer_update", "string", "", "optimizer one-launch, and a pack's AdamW: where its updates ran, "
           "as it recorded them ('; '-joined): triton (the Triton kernel), torch: why (torch's single-tensor "
           "update: the CPU, Triton not loaded with its error, a tensor the kernel does not take) "
           "(docs/kernel-design.md); blank for torch's AdamW"),
    Column("timing_clock", "string", "", "cuda_events, cuda_sync (perturbing), host (CPU) or off"),
    Column("warmup_steps", "Int64", "steps", "steps excluded from the summaries"),
    Column("measured_steps", "Int64", "steps", "steps in the summaries"),
    *_phase_cols(),
    Column("phase_sum_pct", "float64", "%", "sum of the phase medians vs the median step, in % of the median step "
           "(each step's phases add up exactly; the medians drift apart when the host changes regime within a run)"),
    Column("eval_s", "float64", "s", "time spent in periodic and per-epoch evaluation (device time on CUDA)", "lower"),
    Column("graph_capture_s", "float64", "s", "CUDA graphs: wall time of the step's warm-up iterations and capture, "
           "paid once per run inside training_time_s (blank otherwise)", "lower"),
    Column("graph_kernels_forward", "Int64", "kernels", "CUDA graphs: kernel nodes of the captured forward+loss "
           "graph, the kernels one step launches in that phase (blank otherwise)", "lower"),
    Column("graph_kernels_backward", "Int64", "kernels", "CUDA graphs: kernel nodes of the captured backward graph",
           "lower"),
    Column("graph_kernels_optimizer", "Int64", "kernels", "CUDA graphs: kernel nodes of the captured optimizer graph",
           "lower"),
    Column("tokens_per_step", "float64", "tokens", "median tokens per step"),
    Column("tokens_per_s", "float64", "tokens/s", "tokens per second of median step time", "higher"),
    Column("flops_per_step", "float64", "FLOP", "analytic FLOPs per step for the trainable set and the adapter "
           "(LoRA's products, the merged weight's, DoRA's norm and scale; results.metrics.flops_per_step)"),
    Column("achieved_tflops", "float64", "TFLOP/s", "flops_per_step / median step time", "higher"),
    Column("peak_tflops", "float64", "TFLOP/s", "datasheet dense peak for the GPU and precision (blank when unknown)"),
    Column("mfu", "float64", "fraction", "model-FLOPs utilisation (achieved / peak)", "higher"),
    Column("peak_mem_allocated_mib", "float64", "MiB", "peak CUDA memory allocated", "lower"),
    Column("peak_mem_reserved_mib", "float64", "MiB", "peak CUDA memory reserved", "lower"),
    Column("peak_rss_mib", "float64", "MiB", "peak host resident memory of the process", "lower"),
    Column("base_weight_mib", "float64", "MiB", "weights of the transformer blocks' linear layers as stored "
           "(base_dtype: quantized values with their scales; precision=bf16: the frozen weights cast to bfloat16; "
           "implementation=hf: its Conv1D weights, or under base_dtype=nf4 bitsandbytes' 4-bit codes with their "
           "quant state; biases, embeddings, norms and adapters left out)", "lower"),
    Column("adapter_init_s", "float64", "s", "lora_init=pissa: wall time of the adapters' one-time initialisation "
           "(the SVDs of the frozen weights, on the run's device), paid before training and outside training_time_s "
           "(blank otherwise)", "lower"),
    # the host's speed, which a host-bound step's time follows (environment.host_speed, timing.host_op_us)
    Column("host_op_us", "float64", "µs", "host time of one small tensor op on the run's device (on a GPU its "
           "launch), median of 5 blocks of 200 before training", "lower"),
    Column("cpu_mhz", "float64", "MHz", "CPU clock the OS reports (median over the CPUs the process may use)"),
    Column("cpu_affinity", "Int64", "CPUs", "CPUs the process may run on"),
    Column("torch_threads", "Int64", "threads", "torch's intra-op threads"),
    # data parallelism (`nproc` > 1: one process per GPU under torchrun; the step times are the global step's)
    Column("world_size", "Int64", "processes", "processes that ran the step together (1: one process)"),
    Column("rank_step_ms_min", "float64", "ms", "smallest per-rank median step time", "lower"),
    Column("rank_step_ms_max", "float64", "ms", "largest per-rank median step time (the ranks wait for the slowest)", "lower"),
    Column("rank_step_spread_pct", "float64", "%", "(max - min) / min of the per-rank median step times", "lower"),
    Column("allreduce_ms_median", "float64", "ms", "per step, time during which a gradient bucket's all-reduce was pending or running (rank 0; empty for a step captured as CUDA graphs)", "lower"),
    Column("allreduce_exposed_ms_median", "float64", "ms", "per step, all-reduce time after backward's compute ended: what backward did not hide", "lower"),
    Column("allreduce_buckets", "Int64", "buckets", "DDP gradient buckets all-reduced per step"),
    # packing (`sweep --pack N`: runs trained together on one model; blank for a run trained alone)
    Column("pack_size", "Int64", "runs", "runs trained together in the run's pack, on one frozen model (blank: alone)"),
    Column("pack_id", "string", "", "the pack the run trained in (its runs share it; blank: alone)"),
    Column("share_step_ms_median", "float64", "ms", "packed runs: the pack's median step time over its size, the "
           "run's share of the step (the step_ms columns are the whole pack's step)", "lower"),
    # sweep provenance (blank for one-off `lora-bench train` runs)
    Column("sweep_name", "string", "", "name of the sweep the run belongs to"),
    Column("sweep_file", "string", "", "sweep YAML file the run was expanded from"),
    Column("sweep_sha256", "string", "", "sha256 of that YAML file when the run started"),
    Column("sweep_label", "string", "", "the run's label in the sweep file (e.g. 'row 10'), if any"),
    Column("repeat", "Int64", "", "repeat index within the sweep (0-based)"),
]
ENV_COLUMNS: list[Column] = [
    Column(n, "string", "", h) for n, h in [
        ("gpu_name", "GPU name"), ("gpu_driver", "NVIDIA driver"), ("torch_version", "torch version"),
        ("cuda_version", "CUDA version torch was built with"), ("cudnn_version", "cuDNN version"),
        ("triton_version", "Triton version"), ("python_version", "Python version"),
        ("platform", "OS / machine"), ("cpu", "CPU model"), ("hostname", "host name"),
        ("git_commit", "lora-bench git commit (+dirty)"), ("lora_bench_version", "package version"),
        ("tf32_matmul", "torch.backends.cuda.matmul.allow_tf32"), ("tf32_cudnn", "torch.backends.cudnn.allow_tf32"),
        ("float32_matmul_precision", "torch.get_float32_matmul_precision()"),
        ("transformers_version", "transformers version (runs with implementation=hf or weights_source=hf)"),
        ("peft_version", "PEFT version (the same runs)"),
        ("safetensors_version", "safetensors version (the same runs)"),
        ("huggingface_hub_version", "huggingface_hub version (the same runs)"),
        ("torchao_version", "torchao version (runs with base_dtype fp8, int8 or nf4, whose frozen base it stores)"),
        ("bitsandbytes_version", "bitsandbytes version (runs with base_dtype nf4-bnb or nf4-bnb-nodq, and with "
                                 "implementation=hf and base_dtype=nf4: QLoRA, whose 4-bit weights it stores)"),
    ]
]
SETTING_PREFIX = "cfg_"  # every setting is a column cfg_<name>
_DTYPES = {str: "string", int: "Int64", float: "float64", bool: "boolean"}
# Generated from the settings' declaration (lora_bench.config). They hold each run's settings as
# written; readers compare them as text, so they are left out of ``column_index``'s conversions.
SETTING_COLUMNS: list[Column] = [
    Column(SETTING_PREFIX + name, _DTYPES[s.type], "", s.spec.help) for name, s in SETTINGS.items()]

STEP_COLUMNS: list[Column] = [
    Column("run_id", "string", "", "run id"),
    Column("step", "Int64", "", "global step (0-based)"),
    Column("epoch", "Int64", "", "epoch (1-based)"),
    Column("warmup", "boolean", "", "excluded from summaries"),
    *[Column(f"{p}_ms", "float64", "ms", f"device time of the {p} phase") for p in (*PHASES, "step")],
    *[Column(f"host_{p}_ms", "float64", "ms", f"host time of the {p} phase") for p in (*PHASES, "step")],
    Column("allreduce_ms", "float64", "ms", "data-parallel runs: union of the buckets' all-reduce intervals (inside backward)"),
    Column("allreduce_exposed_ms", "float64", "ms", "data-parallel runs: all-reduce time after the last bucket was ready"),
    Column("allreduce_buckets", "Int64", "buckets", "data-parallel runs: buckets all-reduced in the step"),
    Column("share_step_ms", "float64", "ms", "packed runs: the pack's step time over its size (the run's share)"),
    Column("share_host_step_ms", "float64", "ms", "packed runs: the pack's host step time over its size"),
    Column("tokens", "Int64", "tokens", "tokens in the (global) batch; packed runs: the run's own batch"),
    Column("loss", "float64", "", "training loss of the batch (after division by accumulation steps)"),
]


# What a run's clock measured: times (and rates and shares of them) of its steps, evaluations and
# set-up, which hold only where the run had its GPU and host to itself.
TIMED_UNITS = ("ms", "s", "min", "µs", "tokens/s")
TIMED_DERIVED = ("achieved_tflops", "mfu", "phase_sum_pct", "rank_step_spread_pct")


def timed_columns() -> list[str]:
    """The ``runs.csv`` columns that a run's clock measured (``TIMED_UNITS``, ``TIMED_DERIVED``)."""
    return [c.name for c in RUN_COLUMNS if c.unit in TIMED_UNITS or c.name in TIMED_DERIVED]


def run_column_names() -> list[str]:
    return [c.name for c in RUN_COLUMNS + ENV_COLUMNS + SETTING_COLUMNS]


def column_index() -> dict[str, Column]:
    cols = {c.name: c for c in RUN_COLUMNS + ENV_COLUMNS}
    cols.update({c.name: c for c in STEP_COLUMNS if c.name not in cols})
    return cols


def settings_columns(cfg: TrainConfig) -> dict:
    """A run's settings as its ``cfg_*`` columns."""
    return {SETTING_PREFIX + k: v for k, v in cfg.to_dict().items()}


def cfg_columns(cfg: TrainConfig) -> dict:
    """The settings part of a run's row, whoever records it (the run, a sweep for a run that died,
    the launcher of a data-parallel run): the headline settings, then every ``cfg_*`` column."""
    return {
        "model_size": cfg.model_size, "weights": cfg.weights, "trainable_layers": cfg.trainable_layers,
        "lora_rank": cfg.lora_rank if cfg.is_lora else None,
        "lora_alpha": cfg.lora_alpha if cfg.is_lora else None,
        "warmup_steps": cfg.warmup_steps, **settings_columns(cfg),
    }
