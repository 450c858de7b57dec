"""What a run of N >= 1 points builds before its loop, in the reference's order: the device and
precision, the data splits, the model, the loaders, the optimizer (after re-seeding, as the
reference does), then the execution mode (torch.compile, data parallelism, CUDA graphs for
evaluation). The points' settings agree on all but their adapter's own (lora_bench.train.pack)."""

from __future__ import annotations

from pathlib import Path

import torch

from lora_bench.classifier.book import model_config
from lora_bench.config import TrainConfig
from lora_bench.data.sms_spam import build_loaders, cached_splits, packaged_sms_spam
from lora_bench.data.tokenizer import gpt2_tokenizer
from lora_bench.errors import UsageError
from lora_bench.kernels.policy import PlanLog, policy_for
from lora_bench.train.build import build_model, build_optimizer
from lora_bench.train.distributed import DataParallel
from lora_bench.train.graphs import GraphedEval
from lora_bench.train.loop import LoopSettings
from lora_bench.train.memory import fit_problem
from lora_bench.train.packed_adamw import update_path
from lora_bench.train.profiling import profiles_graphs
from lora_bench.train.setup import amp_context, compile_model, resolve_device, set_precision


class RunContext:
    """A run's device, model, loaders and optimizer, and the models its loop and evaluation call;
    kept for the profilers and CUDA graphs. The steps run in the order the reference builds things
    (the data split, the model's random draws, then the seed before the optimizer), so book mode
    stays bit-exact. ``cfgs``: the points' settings (one TrainConfig: a solo run); ``cfg`` is the
    first's, which holds every setting the points share."""

    def __init__(self, cfgs: TrainConfig | list[TrainConfig], *, cache_dir: Path, progress: bool,
                 dp: DataParallel | None = None):
        self.cfgs = [cfgs] if isinstance(cfgs, TrainConfig) else list(cfgs)
        self.cfg, self.n = self.cfgs[0], len(self.cfgs)
        self.dp = dp  # data-parallel runs: this rank's part (its device, the DDP wrapper)
        self._setup_device()
        splits = self._setup_splits(cache_dir, progress=progress)
        self._setup_model(cache_dir, progress=progress)
        self._setup_loaders(splits)
        self._setup_optimizer()
        self._setup_execution()

    # ------------------------------------------------------------------ the steps, in order
    def _setup_device(self) -> None:
        # lora-kernel: the plan policy of this run (its kernel_plan setting may force a plan), and
        # the plans its layers run, noted while the loop runs
        self.kernel_policy = policy_for(self.cfg.kernel_plan, adapter_grads=self.cfg.adapter_grads,
                                        adapter_h=self.cfg.adapter_h, gemm_tiles=self.cfg.gemm_tiles)
        self.kernel_plans = PlanLog()
        self.device = self.dp.device if self.dp is not None else resolve_device(self.cfg.device)
        set_precision(self.cfg)
        self.amp = amp_context(self.cfg, self.device)

    def _setup_splits(self, cache_dir: Path, *, progress: bool) -> dict[str, Path]:
        cfg = self.cfg
        raw = Path(cfg.data_file) if cfg.data_file else packaged_sms_spam()  # no download: the same bytes
        return cached_splits(raw, cache_dir)

    def _setup_model(self, cache_dir: Path, *, progress: bool) -> None:
        cfg = self.cfg
        # before anything is allocated; a pack: every run's adapters, head and batch on one base
        too_big = fit_problem(cfg, self.device, processes=cfg.nproc, pack=self.cfgs)
        if too_big:
            raise UsageError(too_big if self.n == 1 else f"a pack of {self.n} runs: {too_big} (or pack fewer runs)")
        self.mcfg = model_config(cfg)
        built = build_model(self.cfgs, self.device, cache_dir=cache_dir, progress=progress)
        self.model, self.notes, self.base_weight_mib = built.model, built.notes, built.base_weight_mib
        self.adapter_init_s = built.adapter_init_s
        self.trainable_params, self.total_params = built.trainable_params, built.total_params  # per point

    def _setup_loaders(self, splits: dict[str, Path]) -> None:
        cfg = self.cfg
        self.loaders = build_loaders(splits, gpt2_tokenizer(), context_length=cfg.context_length,
                                     model_context=self.mcfg.context_length, batch_size=cfg.batch_size,
                                     no_padding=cfg.no_padding)

    def _setup_optimizer(self) -> None:
        self.optimizer = build_optimizer(self.model, self.cfgs)

    def _setup_execution(self) -> None:
        self.forward_model, self.eval_model = execution_models(self.model, self.cfg, self.device, dp=self.dp)

    # ------------------------------------------------------------------ what the loop reads
    def loop_settings(self) -> LoopSettings:
        return LoopSettings.of(self.cfg)

    def backend(self) -> str:
        """The lora-kernel plans the training step's layers ran, as recorded while the loop ran
        (``kernel_plans``), '+'-joined when layers differ (1558M's MLP under CUDA graphs; the head
        left out of a block-scoped compile). '' for other trainable-layer settings, or before any
        training step ran."""
        if self.cfg.trainable_layers != "lora-kernel":
            return ""
        return self.kernel_plans.backend()

    def dora_norms(self) -> str:
        """Where the training step's fused DoRA layers formed their norms, as they recorded it
        (``PlanLog.dora_norms``); '' for other settings, or before any training step ran."""
        if self.cfg.trainable_layers != "lora-kernel" or self.cfg.lora_variant != "dora":
            return ""
        return self.kernel_plans.dora_norms()

    def gemm_tiles(self) -> str:
        """Under gemm_tiles timed, each fused GEMM launch shape's tile as the layers recorded it
        (``PlanLog.gemm_tiles``); '' otherwise."""
        if self.cfg.trainable_layers != "lora-kernel":
            return ""
        return self.kernel_plans.gemm_tiles()

    def optimizer_update(self) -> str:
        """Where the optimizer's updates ran, as it noted them (``packed_adamw.update_path``): the
        one-launch and packed AdamW; '' for torch's AdamW."""
        return update_path(self.optimizer)


def execution_models(model: torch.nn.Module, cfg: TrainConfig, device: torch.device,
                     dp: DataParallel | None = None) -> tuple:
    """The model a run's training step calls (torch.compile'd when ``cfg.compile``; wrapped by
    DDP on a data-parallel rank) and the one its evaluations call (forwards replayed from CUDA
    graphs under ``cfg.cuda_graphs`` on a CUDA device): a solo run's and a pack's alike."""
    if cfg.compile:
        # Runs in one process (inline sweeps) share dynamo's caches; compiled code of earlier
        # models would pile up to the recompile limit, after which dynamo silently runs eager.
        torch._dynamo.reset()
    if dp is not None:  # blocks compile inside DDP; a whole-model compile wraps DDP
        if cfg.compile and cfg.compile_scope == "blocks":
            compile_model(model, "blocks")
        wrapped = dp.wrap(model, timed=cfg.timing != "off", bucket_mb=cfg.ddp_bucket_mb, cuda_graphs=cfg.cuda_graphs)
        forward = compile_model(wrapped, "model") if cfg.compile and cfg.compile_scope == "model" else wrapped
    else:
        forward = compile_model(model, cfg.compile_scope) if cfg.compile else model
    graphed = cfg.cuda_graphs and device.type == "cuda" and not profiles_graphs(cfg)  # a profile captures nothing
    return forward, (GraphedEval(forward) if graphed else forward)
