"""What only this machine can tell about a run's settings: whether its device exists (and is a
CUDA device where CUDA graphs need one), whether its data file and checkpoint folder are there, and
whether the optional packages the settings need (transformers, PEFT, …) can be imported, and
whether the run fits in memory. ``train`` asks once (``preflight``) and a sweep once for its plan
(its parts, ``lora_bench.sweep.runner``), before the first run starts, so that a mistake leaves no
failed row behind. The rules between settings themselves are ``lora_bench.config``'s."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lora_bench.classifier.book import model_config
from lora_bench.config import Problem, TrainConfig, problem, raw, render
from lora_bench.config.setting_rules import CPU_BASE_DTYPES
from lora_bench.data.sms_spam import MAX_DATA_BYTES
from lora_bench.errors import UsageError
from lora_bench.fileio import not_a_file
from lora_bench.lora.quantized import BNB_FORMATS, NF4_BLOCK, bitsandbytes, cpu_row_problem, torchao
from lora_bench.optional import require
from lora_bench.peers.hf import QLORA_FORMATS
from lora_bench.train.memory import fit_problem
from lora_bench.train.setup import resolve_device


def device_problems(cfg: TrainConfig) -> list[Problem]:
    """The device: there, and a CUDA one for CUDA graphs. Counts devices only: a CUDA context
    made here would hold GPU memory for as long as the process lives."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = []
    if cfg.device.startswith("cuda"):
        index = int(cfg.device[5:]) if cfg.device.startswith("cuda:") else 0
        if index >= count:
            out.append(problem("device", "{device}={d} but this machine has {n} CUDA device(s); use {device}=cpu "
                                         "or auto", d=cfg.device, n=raw(count)))
    elif cfg.cuda_graphs and cfg.device == "auto" and count == 0:
        out.append(problem("cuda_graphs", "{cuda_graphs} needs a CUDA device, and none is available here"))
    if cfg.base_dtype == "fp8" and cfg.device == "auto" and count == 0:
        out.append(problem("base_dtype", "{base_dtype}=fp8 needs a CUDA GPU of compute capability 8.9 or newer "
                                         "(torch._scaled_mm's float8 products), and none is available here; on the "
                                         "CPU choose {base_dtype} one of: {allowed}",
                           allowed=raw(", ".join(CPU_BASE_DTYPES))))
    bnb = (cfg.implementation == "hf" and cfg.base_dtype in QLORA_FORMATS) or cfg.base_dtype in BNB_FORMATS
    if bnb and (cfg.device == "cpu" or (cfg.device == "auto" and count == 0)):
        why = cpu_row_problem(model_config(cfg).emb_dim)
        if why:
            with_hf = " with {implementation}=hf" if cfg.implementation == "hf" else ""
            out.append(problem("base_dtype", "{base_dtype}={b}" + with_hf + " on the CPU is refused: {why}; "
                                             "use a CUDA device or an {emb_dim} that is a multiple of {block}",
                               b=raw(cfg.base_dtype), why=raw(why), block=raw(NF4_BLOCK)))
    if cfg.nproc > 1 and count and cfg.device in ("auto", "cuda") and count < cfg.nproc:
        out.append(problem("nproc", "{nproc}={n} needs {n} GPUs (one per process); this machine has {c}",
                           n=raw(cfg.nproc), c=raw(count)))
    return out


def input_problems(cfg: TrainConfig) -> list[Problem]:
    """The data file and the checkpoint folder the settings name: there, of the right kind, and
    the data file within the size a data file may have."""
    out = []
    if cfg.data_file:
        path = Path(cfg.data_file)
        why = not_a_file(path)
        if path.is_dir():
            out.append(problem("data_file", "{data_file} {p} is a folder; give the raw SMSSpamCollection TSV file",
                               p=str(path)))
        elif why:
            out.append(problem("data_file", "{data_file} {p}: {why}", p=str(path), why=raw(why)))
        elif path.stat().st_size > MAX_DATA_BYTES:
            out.append(problem("data_file", "{data_file} {p} has {n} bytes; a data file may hold at most {m}",
                               p=str(path), n=raw(f"{path.stat().st_size:,}"), m=raw(f"{MAX_DATA_BYTES:,}")))
    if cfg.weights_dir and not Path(cfg.weights_dir).is_dir():
        what = ("the Hugging Face GPT-2 checkpoint: model.safetensors" if cfg.weights_source == "hf" else
                "the OpenAI GPT-2 checkpoint files: checkpoint, hparams.json, model.ckpt.*")
        out.append(problem("weights_dir", "{weights_dir} {p}: no such folder (it should hold {what})",
                           p=cfg.weights_dir, what=raw(what)))
    return out


def require_packages(cfg: TrainConfig) -> None:
    """Import the optional packages the settings need, or stop (UsageError) with the command that
    installs them. The book implementation with the OpenAI weights needs none, and imports none."""
    if cfg.implementation == "hf":
        require("transformers", purpose="implementation=hf")
        if cfg.is_lora:
            require("peft", purpose=f"trainable_layers={cfg.trainable_layers} with implementation=hf")
    if cfg.quantized_base and cfg.implementation == "hf":  # QLoRA: bitsandbytes stores the body
        bitsandbytes(f"base_dtype={cfg.base_dtype} with implementation=hf")
    elif cfg.base_dtype in BNB_FORMATS:
        bitsandbytes(f"base_dtype={cfg.base_dtype}")
    elif cfg.quantized_base:
        torchao(f"base_dtype={cfg.base_dtype}")
    if cfg.weights == "pretrained" and cfg.weights_source == "hf":
        require("safetensors", purpose="weights_source=hf")
        if not cfg.weights_dir:
            require("huggingface_hub", purpose="weights_source=hf without weights_dir (the download)")


def memory_problem(cfg: TrainConfig, *, cuda: bool, pack: Sequence[TrainConfig] = ()) -> str | None:
    """Whether the run fits its device's free memory (``lora_bench.train.memory``): the CPU's always;
    a CUDA device's only with ``cuda``, since asking makes a CUDA context, which a process that does
    not train there (a sweep's parent, the launcher of data-parallel ranks) must not hold."""
    on_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if on_cuda and not (cuda and cfg.nproc == 1):
        return None
    device = resolve_device(cfg.device) if on_cuda else torch.device("cpu")
    return fit_problem(cfg, device, processes=cfg.nproc, pack=pack)


def preflight(cfg: TrainConfig, *, name_of: Callable[[str], str] | None = None) -> None:
    """The one check of a run's settings on this machine, before anything is recorded: UsageError
    listing every device and input problem (named by ``name_of``), or naming the optional package
    they need that is missing; then whether the run fits in memory (this process trains on the
    device it names, so a CUDA device is asked too)."""
    problems = render(device_problems(cfg) + input_problems(cfg), name_of)
    if problems:
        raise UsageError(problems[0] if len(problems) == 1 else
                         f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))
    require_packages(cfg)
    too_big = memory_problem(cfg, cuda=True)
    if too_big:
        raise UsageError(too_big)
