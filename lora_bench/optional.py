"""Optional dependencies: import one by name, or stop with the command that installs it."""

from __future__ import annotations

import importlib
import logging
from importlib import metadata
from types import ModuleType

from lora_bench.errors import UsageError

PEERS_EXTRA = "peers"  # transformers, peft, safetensors, huggingface_hub (pyproject's extra)
QUANT_EXTRA = "quant"  # torchao, bitsandbytes: a quantized frozen base (base_dtype fp8, int8, nf4; QLoRA peer)


def require(module: str, *, purpose: str, extra: str = PEERS_EXTRA) -> ModuleType:
    """``module`` imported, or a UsageError naming what needs it and the pip command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = module.split(".")[0]
        raise UsageError(f"{purpose} needs the Python package {package!r}, which cannot be imported here "
                         f"({exc}); install it with: pip install \"lora-bench[{extra}]\"") from exc


def require_quietly(module: str, *, purpose: str, extra: str = PEERS_EXTRA) -> ModuleType:
    """``require``, with the package's own logger held at errors while it imports (torchao and
    bitsandbytes log notes about optional kernels a build cannot load)."""
    log = logging.getLogger(module.split(".")[0])
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return require(module, purpose=purpose, extra=extra)
    finally:
        log.setLevel(level)


def installed_version(package: str) -> str | None:
    """The installed distribution's version, or None where it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
