"""What a run sets up around its model: the device, the float32 matmul precision and autocast, the
model's dtypes and the optimizer the precision asks for (``prepare_precision``, ``build_optimizer``),
torch.compile's scope, and the settings a data-parallel rank runs."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from lora_bench.config import BF16_TRUE, TrainConfig
from lora_bench.config.declaration import ONE_LAUNCH
from lora_bench.errors import UsageError
from lora_bench.train.distributed import RankEnv
from lora_bench.train.master_weights import MasterWeights
from lora_bench.train.one_launch_adamw import OneLaunchAdamW


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"device={name!r} but CUDA is not available here; use --device cpu or auto")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"device={name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def set_precision(cfg: TrainConfig) -> None:
    # fp32 is the reference: no TF32 anywhere in matmuls (torch's default); tf32 opts in.
    torch.set_float32_matmul_precision("high" if cfg.precision == "tf32" else "highest")
    torch.backends.cuda.matmul.allow_tf32 = cfg.precision == "tf32"
    torch.backends.cudnn.allow_tf32 = cfg.precision == "tf32"


def amp_context(cfg: TrainConfig, device: torch.device):
    if cfg.precision != "bf16":
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def prepare_precision(model: torch.nn.Module, cfg: TrainConfig, cast_frozen: Callable[..., object]) -> None:
    """The model's dtypes for ``cfg.precision``: bf16 stores the frozen linear weights in bfloat16
    once (``cast_frozen(model, torch.bfloat16)``: autocast computes in bfloat16 from fp32 trainable
    parameters); bf16-true casts every parameter and buffer to bfloat16 (a stored base's quantized
    weights are no parameters and stay as stored) and returns the logits in float32, so the loss
    is computed in float32; fp32 and tf32 change nothing."""
    if cfg.precision == "bf16":
        cast_frozen(model, torch.bfloat16)
    elif cfg.precision == BF16_TRUE:
        model.to(torch.bfloat16)
        model.logits_dtype = torch.float32


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, **options) -> torch.optim.Optimizer | MasterWeights:
    """The run's AdamW (its learning rate and weight decay, and ``options``) over the model's
    parameters; under bf16-true over float32 master copies of the trainable bfloat16 ones
    (``train.master_weights``)."""
    kw = dict(lr=cfg.learning_rate, weight_decay=cfg.weight_decay, **options)
    adamw = adamw_class(cfg)
    return over_masters(cfg, model.parameters(), lambda params: adamw(params, **kw))


def adamw_class(cfg: TrainConfig) -> type[torch.optim.Optimizer]:
    """``torch.optim.AdamW``, or with ``optimizer: one-launch`` the same update in one launch
    (``train.one_launch_adamw``)."""
    return OneLaunchAdamW if cfg.optimizer == ONE_LAUNCH else torch.optim.AdamW


def over_masters(cfg: TrainConfig, params, make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
    """``make(params)``; under bf16-true ``make`` over float32 master copies of the trainable ones
    among ``params`` (``train.master_weights``)."""
    params = list(params)
    return MasterWeights(params, make) if cfg.precision == BF16_TRUE else make(params)


def compile_model(model: torch.nn.Module, scope: str, **compile_kw) -> torch.nn.Module:
    """torch.compile the whole model (returns the compiled wrapper), or each transformer block in
    place (returns the model itself). Blocks share their code, so with scope "blocks" a 48-block
    model compiles about as fast as a 12-block one: one graph for the first block (its input needs
    no gradient), one reused by all the others."""
    if scope == "model":
        return torch.compile(model, **compile_kw)
    if scope == "blocks":
        for block in model.trf_blocks:
            block.compile(**compile_kw)
        return model
    raise ValueError(f"compile scope {scope!r}: expected model or blocks")


def rank_settings(cfg: TrainConfig, env: RankEnv | None) -> TrainConfig:
    """The settings a rank of a data-parallel job runs: ``nproc`` is the job's world size (a job
    started by torchrun itself, leaving ``nproc`` at 1, records it too); any other value is refused."""
    if env is None:
        if cfg.nproc > 1:
            raise UsageError(f"nproc={cfg.nproc}: a data-parallel run starts under torchrun; run it with "
                             f"lora-bench train --nproc {cfg.nproc} (a sweep runs each run in one process)")
        return cfg
    if cfg.nproc == 1:
        return cfg.replace(nproc=env.world_size)
    if cfg.nproc != env.world_size:
        raise UsageError(f"nproc={cfg.nproc} but torchrun started {env.world_size} processes (WORLD_SIZE); "
                         "leave nproc unset under torchrun, or set it to the world size")
    return cfg
