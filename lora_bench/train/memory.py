"""Whether a run fits in its device's memory, asked before anything is built: the memory it needs,
estimated from its settings alone (parameters × bytes, gradients and AdamW's two moments for the
trainable ones, the causal masks, a rough activation term, and what a LoRA variant adds: DoRA's
magnitudes and the tensors its layers keep for backward, a merged layer's merged weights), against
what the device has free (the CPU's available RAM from /proc/meminfo or sysconf, a CUDA device's
from ``torch.cuda.mem_get_info``).

The estimate is a floor, not a forecast: its parameter counts are exact, its activation term below
what runs measured, and it leaves out the allocator's slack, the data and the evaluation, so a run
it lets through may still run out, but one it refuses cannot fit."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from lora_bench.config import BF16_TRUE, FROZEN, TrainConfig
from lora_bench.model.sizes import MODEL_SIZES, GPTConfig, resolve_model_size
from lora_bench.results.metrics import adapted_layers

FLOAT, HALF = 4, 2  # bytes: fp32, and bf16 (frozen linear weights and activations in bf16 mode)
ADAM = 3 * FLOAT  # a trainable parameter's gradient and AdamW's two moments, fp32 in every mode (bf16-true
# holds more: a bf16 gradient, its fp32 copy and the fp32 master)
CLASSES = 2
# Tokens per text when the length is the longest training text (known only once the data is
# tokenised): the SMS Spam Collection's, 120. A floor: another corpus's texts may be longer.
LONGEST_TRAINING_TEXT = 120
# Activations a block keeps for backward, per token: 8 widths and one attention map of the
# sequence's length per head; fewer than the block stores (the MLP alone keeps 4x-wide tensors), so
# the term stays below what GPT-2 124M to 1558M measured in fp32 and bf16 (peak_mem_allocated_mib).
ACT_WIDTHS, ACT_MAPS = 8, 1
# Weight-sized tensors a merged layer keeps for backward, per adapted layer: LoRA's merged weight;
# DoRA's merged weight, its direction and the weight scaled by m (measured on the layers' autograd
# graphs: tests/train/test_variant_estimates.py).
MERGED_SAVED = {"lora": 1, "dora": 3}
GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a run needs at least on its device, by what needs them."""

    params: int  # parameters of the model as built (before the vocabulary-wide head is replaced)
    trainable: int
    weights: int  # parameters and causal masks while training (bf16: frozen linear weights halved)
    training_state: int  # gradients and AdamW's moments
    activations: int
    host_copy: int  # on the CPU only: the random base's state, kept for the next run of that size

    def total(self, device_type: str = "cpu") -> int:
        host = self.host_copy if device_type == "cpu" else 0
        return self.weights + self.training_state + self.activations + host

    def text(self, device_type: str = "cpu") -> str:
        host = f", the kept random base {self.host_copy / GIB:,.1f}" if device_type == "cpu" and self.host_copy else ""
        return (f"about {self.total(device_type) / GIB:,.1f} GiB (weights {self.weights / GIB:,.1f}, gradients and "
                f"AdamW state {self.training_state / GIB:,.1f}, activations {self.activations / GIB:,.1f}{host})")


def _shape(cfg: TrainConfig) -> GPTConfig:
    e, n_layers, h = MODEL_SIZES[resolve_model_size(cfg.model_size)]
    return GPTConfig(emb_dim=cfg.emb_dim or e, n_layers=cfg.n_layers or n_layers, n_heads=cfg.n_heads or h,
                     disable_causal_mask=cfg.disable_causal_mask)


def block_linear_params(e: int) -> int:
    """A block's linear layers: four e×e attention projections, the MLP's e×4e and 4e×e, biases."""
    return 4 * (e * e + e) + (e * 4 * e + 4 * e) + (4 * e * e + e)


def block_params(e: int) -> int:
    """One transformer block: its linear layers and two layer norms."""
    return block_linear_params(e) + 4 * e


def model_params(m: GPTConfig) -> int:
    """The book GPT-2 as built: embeddings, blocks, the final norm, the vocabulary-wide head."""
    return m.vocab_size * m.emb_dim + m.context_length * m.emb_dim + m.n_layers * block_params(m.emb_dim) \
        + 2 * m.emb_dim + m.emb_dim * m.vocab_size


def lora_params(m: GPTConfig, rank: int) -> int:
    """Adapters on every linear layer: (in + out)·r for the six of each block and the head."""
    e = m.emb_dim
    return rank * (m.n_layers * (4 * 2 * e + 5 * e + 5 * e) + e + CLASSES)


def dora_outputs(cfg: TrainConfig, m: GPTConfig) -> int:
    """The outputs of every layer DoRA adapts (0 for LoRA): one trained magnitude each, and per token
    one value its layer keeps for backward (the products before the scale m/‖·‖, which m's gradient
    reads)."""
    if not cfg.is_lora or cfg.lora_variant != "dora":
        return 0
    return sum(n for _, n, _ in adapted_layers(m, n_classes=CLASSES, implementation=cfg.implementation))


def trainable_params(cfg: TrainConfig, m: GPTConfig) -> int:
    """What the classifier trains: the new head, and the blocks or adapters the setting names (DoRA:
    and its magnitudes)."""
    e = m.emb_dim
    head = e * CLASSES + CLASSES
    if cfg.trainable_layers == "all":
        return model_params(m) - e * m.vocab_size + head
    if cfg.is_lora:
        return lora_params(m, cfg.lora_rank) + dora_outputs(cfg, m) + head
    if cfg.trainable_layers == FROZEN:
        return m.context_length * e + head
    blocks = min({"last_block": 1, "last_two_blocks": 2}.get(cfg.trainable_layers, 0), m.n_layers)
    return blocks * block_params(e) + (2 * e if blocks else 0) + head


def _tokens(cfg: TrainConfig, m: GPTConfig) -> int:
    if cfg.context_length == "model_context_length":
        return m.context_length
    if cfg.context_length.isdigit():
        return int(cfg.context_length)
    return min(LONGEST_TRAINING_TEXT, m.context_length)


def estimate(cfg: TrainConfig, *, processes: int = 1, pack: Sequence[TrainConfig] = ()) -> MemoryEstimate:
    """What one process of the run needs at least (``processes``: data-parallel ranks, each with
    its share of the batch; ``pack``: the settings of each run of a pack, which shares ``cfg``'s
    base model and holds every run's adapters, head and batch)."""
    pack = list(pack) or [cfg]
    m = _shape(cfg)
    book = cfg.implementation == "book"  # transformers' GPT-2 keeps no mask buffers and attends by sdpa
    e, n_layers = m.emb_dim, m.n_layers
    params = model_params(m)
    trainable = sum(trainable_params(c, m) for c in pack)
    if cfg.trainable_layers == "all":
        saved_blocks, frozen_blocks = n_layers, 0
    elif cfg.is_lora or cfg.trainable_layers == FROZEN:  # the gradient goes back through every block
        saved_blocks, frozen_blocks = n_layers, n_layers
    else:
        saved_blocks = min({"last_block": 1, "last_two_blocks": 2}.get(cfg.trainable_layers, 0), n_layers)
        frozen_blocks = n_layers - saved_blocks
    bf16 = cfg.precision in ("bf16", BF16_TRUE)
    # adapters, DoRA's magnitudes and (book) its frozen weights' row norms, kept from the start
    adapters = sum(lora_params(m, c.lora_rank) + (2 if book else 1) * dora_outputs(c, m) for c in pack) \
        if cfg.is_lora else 0
    masks = n_layers * m.context_length ** 2 if book and not m.disable_causal_mask else 0
    body = params - e * m.vocab_size + e * CLASSES + CLASSES  # the vocabulary head replaced by the classifier's
    halved = frozen_blocks * block_linear_params(e) if bf16 else 0  # frozen linear weights, cast once to bf16
    weights = FLOAT * (body + adapters + masks) - (FLOAT - HALF) * halved
    if cfg.precision == BF16_TRUE:  # everything in bf16 (the float32 masters count under AdamW's state)
        weights = HALF * (body + adapters + masks)
    t = _tokens(cfg, m)
    batch = max(1, sum(c.batch_size for c in pack) // max(1, processes))
    maps = ACT_MAPS * m.n_heads * t if book and cfg.attention == "book" else 0  # sdpa keeps no attention map
    per_block = batch * t * (ACT_WIDTHS * e + maps)
    act = HALF if bf16 else FLOAT
    activations = act * (per_block * (saved_blocks + 1) + _variant_saved(cfg, m, batch=batch, tokens=t))
    return MemoryEstimate(params=params, trainable=trainable, weights=weights, training_state=ADAM * trainable,
                          activations=activations, host_copy=FLOAT * params if cfg.weights == "random" else 0)


def _variant_saved(cfg: TrainConfig, m: GPTConfig, *, batch: int, tokens: int) -> int:
    """Values a LoRA variant's layers keep for backward beyond the block's activations: a merged
    layer's weight-sized tensors (``MERGED_SAVED``), an unmerged DoRA layer's products before its
    scale (batch × tokens × out)."""
    if not cfg.is_lora:
        return 0
    if cfg.trainable_layers == "lora-merged":  # the first block's query, key and value read the embeddings, which
        # need no gradient: their product keeps no weight for one
        layers = adapted_layers(m, n_classes=CLASSES, implementation=cfg.implementation)
        first = 3 * m.emb_dim ** 2 if cfg.implementation == "book" else 0
        return MERGED_SAVED[cfg.lora_variant] * sum(k * n for k, n, _ in layers) - first
    return batch * tokens * dora_outputs(cfg, m)


def available_bytes(device: torch.device) -> int | None:
    """Memory free for a run on ``device``: a CUDA device's free memory (this makes its CUDA context,
    so ask only in the process that runs on it), else the RAM available without swapping (a cgroup's
    limit counts); None when the system does not say."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    ram = _meminfo_available()
    if ram is None:
        try:
            ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            ram = None
    sizes = [s for s in (ram, _cgroup_room()) if s is not None]
    return min(sizes) if sizes else None


def _meminfo_available() -> int | None:
    """MemAvailable: free memory plus the page cache the kernel can drop (sysconf's free pages,
    the fallback, leave the cache out and so understate it)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """The memory limit of this process's control group (memory.max) minus what the group uses, where
    one is set."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def fit_problem(cfg: TrainConfig, device: torch.device, *, processes: int = 1,
                pack: Sequence[TrainConfig] = ()) -> str | None:
    """Why the run (or the pack of runs ``pack``) cannot fit on ``device`` (its estimate and what is
    available), or None. Data-parallel processes on the CPU share its memory: each needs its own copy."""
    need = estimate(cfg, processes=processes, pack=pack)
    have = available_bytes(device)
    sharing = processes if device.type == "cpu" else 1
    if have is None or need.total(device.type) * sharing <= have:
        return None
    each = f" for each of its {sharing} processes" if sharing > 1 else ""
    return (f"the run needs {need.text(device.type)}{each}, estimated from its settings, but {device} has "
            f"{have / GIB:,.1f} GiB available; choose a smaller model (model_size, emb_dim, n_layers), "
            "lora_rank, batch_size or context_length")
