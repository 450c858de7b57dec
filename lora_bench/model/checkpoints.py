"""OpenAI GPT-2 checkpoints: download, read, map onto :class:`lora_bench.model.gpt2.GPTModel`.

This module owns the pretrained weights: fetching the seven OpenAI files of one model size into
the cache, reading the TensorFlow checkpoint into the reference's nested ``params`` dict, the
reference's checkpoint->model mapping (with shape checks), and a converted ``.pt`` copy beside the
checkpoint so that only the first load of a checkpoint needs TensorFlow.

Nothing a checkpoint folder declares is trusted before it is checked against the model: hparams.json
is read only up to a size, the number of blocks (hparams.json, the converted file's header, block
names) is compared with the model's, and every variable the index lists, with its shape, is compared
with the model's (or, without a model, with the shapes hparams.json declares, each bounded) before
anything is allocated for it; the converted copy is written only after every tensor has been loaded
into the model with its shape checked.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from lora_bench.download import download_file
from lora_bench.errors import CheckpointError
from lora_bench.fileio import TooLarge, read_capped
from lora_bench.model.sizes import (
    CHECKPOINT_NAMES,
    MAX_BLOCKS,
    MAX_CONTEXT,
    MAX_VOCAB,
    MAX_WIDTH,
    GPTConfig,
    resolve_model_size,
)
from lora_bench.safe_yaml import short_repr

CHECKPOINT_FILES = ("checkpoint", "encoder.json", "hparams.json", "model.ckpt.data-00000-of-00001",
                    "model.ckpt.index", "model.ckpt.meta", "vocab.bpe")
PRIMARY_BASE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/models"
FALLBACK_BASE_URL = "https://f001.backblazeb2.com/file/LLMs-from-scratch/gpt2"
BASE_URLS = (PRIMARY_BASE_URL, FALLBACK_BASE_URL)
# The tokenizer files are identical for every size (reference-behaviour.md), so pin them.
KNOWN_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
# What reading the weights needs (model.ckpt.meta and "checkpoint" are not read: we open the
# "model.ckpt" prefix directly, so a moved folder still works).
TF_FILES = ("hparams.json", "model.ckpt.index", "model.ckpt.data-00000-of-00001")
CONVERTED_NAME = "lora_bench_state.pt"
CONVERTED_FORMAT = 1
_BLOCK = re.compile(r"h(\d+)$")
MAX_HPARAMS_BYTES = 64 << 10  # OpenAI's hparams.json: 90 bytes
MAX_INDEX_BYTES = 64 << 20  # the index lists the variables (1558M's: 23 KB); TensorFlow reads it whole


def default_cache_dir() -> Path:
    """``$LORA_BENCH_CACHE`` if set, else ``~/.cache/lora-bench``."""
    env = os.environ.get("LORA_BENCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lora-bench"


def ensure_checkpoint(
    model_size: str,
    *,
    cache_dir: Path | None = None,
    base_urls: list[str] | None = None,
    progress: bool = True,
) -> Path:
    """Download the seven files of ``model_size`` (e.g. "124M") into ``<cache>/gpt2/<size>/``
    unless already there; returns that folder. ``base_urls`` are tried in order for each file."""
    try:
        size = CHECKPOINT_NAMES[resolve_model_size(model_size)]
    except (ValueError, KeyError):
        raise CheckpointError(f"model_size={model_size!r} has no pretrained OpenAI checkpoint; "
                              f"choose one of {', '.join(CHECKPOINT_NAMES)} or use random weights") from None
    folder = Path(cache_dir or default_cache_dir()) / "gpt2" / size
    bases = list(base_urls) if base_urls is not None else list(BASE_URLS)
    for name in CHECKPOINT_FILES:
        dest = folder / name
        download_file([f"{b.rstrip('/')}/{size}/{name}" for b in bases], dest,
                      sha256=KNOWN_SHA256.get(name), description=f"GPT-2 {size} {name}",
                      progress=progress,
                      offline_hint=(f"to work offline, copy the GPT-2 {size} files "
                                    f"({', '.join(CHECKPOINT_FILES)}) into {folder}, "
                                    "or pass --weights-dir <folder holding them>, or train from random "
                                    "weights with --weights random"))
    return folder


def _missing_hint(ckpt_dir: Path) -> str:
    return (f"if {ckpt_dir} is lora-bench's download cache, delete it to have the files downloaded again; "
            "otherwise pass --weights-dir <folder with the OpenAI GPT-2 files>")


def _insert(params: dict, name: str, value) -> None:
    """Place one tensor at the reference's position: 'h3/attn/c_attn/w' ->
    params['blocks'][3]['attn']['c_attn']['w']; 'ln_f/g' -> params['g'] (the reference drops
    every path part between the first and the last one)."""
    parts = name.split("/")
    target = params
    match = _BLOCK.match(parts[0])
    if match:
        index = int(match.group(1))
        if index >= len(params["blocks"]):  # never grown from a name: the block count is checked first
            raise CheckpointError(f"checkpoint tensor {name!r} belongs to block {index}, but the checkpoint "
                                  f"declares {len(params['blocks'])} blocks: it is damaged or not GPT-2's")
        target = params["blocks"][index]
    for key in parts[1:-1]:
        target = target.setdefault(key, {})
    target[parts[-1]] = value


def _read_settings(ckpt_dir: Path) -> dict:
    return read_settings_file(ckpt_dir / "hparams.json", hint=_missing_hint(ckpt_dir))


# The size settings a checkpoint's settings file may hold (OpenAI's hparams.json, Hugging Face's
# config.json): each, when present, a whole number; lora-bench compares them with the model's.
SIZE_SETTINGS = ("n_layer", "n_head", "n_embd", "n_ctx", "n_vocab", "n_positions", "vocab_size")


def read_settings_file(path: Path, *, hint: str, max_bytes: int = MAX_HPARAMS_BYTES) -> dict:
    """A checkpoint's settings: a JSON object of at most ``max_bytes`` whose size settings are whole
    numbers, never ``Infinity`` or ``NaN``; one CheckpointError naming the file and the value otherwise."""
    try:
        text = read_capped(path, max_bytes).decode("utf-8")
    except TooLarge as exc:
        name = Path(path).name
        raise CheckpointError(f"{path} has {exc.size:,} bytes, more than the {max_bytes:,} "
                              f"a{'n' if name[0] in 'aeiouh' else ''} {name} may have; {hint}") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise CheckpointError(f"cannot read {path} ({why}); {hint}") from None

    def refuse(constant: str):
        raise ValueError(f"{constant} is not a JSON number")

    try:
        data = json.loads(text, parse_constant=refuse)
    except ValueError as exc:
        raise CheckpointError(f"{path} is not JSON settings ({exc}); {hint}") from None
    except RecursionError:  # JSON nested thousands deep: past the parser's recursion limit
        raise CheckpointError(f"cannot read {path} (its JSON is nested too deep); {hint}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object of settings; {hint}")
    for key in SIZE_SETTINGS:
        value = data.get(key)
        if key in data and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"  # a value quoted cut short
            raise CheckpointError(f"{path}: {key}={shown} is not a count (a whole number, 0 or more); {hint}")
    return data


def _declared_blocks(settings: dict, source: str, expected: int | None) -> int:
    """The block count a checkpoint declares, checked against the model's (when given)."""
    n = settings.get("n_layer", 0)
    if isinstance(n, bool) or not isinstance(n, int):
        raise CheckpointError(f"{source} declares n_layer={short_repr(n)}, not a block count")
    if expected is not None and n != expected:
        raise CheckpointError(f"{source} declares {short_repr(n)} transformer blocks but the model has {expected}: "
                              "the checkpoint is for another model size (or damaged)")
    if not 0 <= n <= MAX_BLOCKS:
        raise CheckpointError(f"{source} declares n_layer={short_repr(n)}; lora-bench reads 0 to {MAX_BLOCKS:,} blocks")
    return n


def tf_shapes(m: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every variable of an OpenAI checkpoint for a model of shape ``m`` (without the ``model/``
    prefix), with its shape as ``np.squeeze`` leaves it (the conv1d weights' leading 1 dropped)."""
    e = m.emb_dim
    out = {"wte": (m.vocab_size, e), "wpe": (m.context_length, e), "ln_f/g": (e,), "ln_f/b": (e,)}
    for i in range(m.n_layers):
        h = f"h{i}/"
        out.update({h + "attn/c_attn/w": (e, 3 * e), h + "attn/c_attn/b": (3 * e,), h + "attn/c_proj/w": (e, e),
                    h + "attn/c_proj/b": (e,), h + "mlp/c_fc/w": (e, 4 * e), h + "mlp/c_fc/b": (4 * e,),
                    h + "mlp/c_proj/w": (4 * e, e), h + "mlp/c_proj/b": (e,)})
        out.update({f"{h}{ln}/{p}": (e,) for ln in ("ln_1", "ln_2") for p in ("g", "b")})
    return out


def _declared_shape(settings: dict, source: str, n_blocks: int) -> GPTConfig:
    """The model shape hparams.json declares, each size bounded (for a checkpoint read without a model)."""
    sizes = {}
    for key, top in (("n_vocab", MAX_VOCAB), ("n_ctx", MAX_CONTEXT), ("n_embd", MAX_WIDTH)):
        v = settings.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
            raise CheckpointError(f"{source} declares {key}={short_repr(v)}; lora-bench reads 1 to {top:,}")
        sizes[key] = v
    return GPTConfig(vocab_size=sizes["n_vocab"], context_length=sizes["n_ctx"], emb_dim=sizes["n_embd"],
                     n_layers=n_blocks, n_heads=1)


def _check_listed(listed: list[tuple[str, list[int]]], want: dict[str, tuple[int, ...]], prefix: str) -> None:
    """Every variable the index lists under ``model/`` is one the model has, of its shape, before any is
    read (TensorFlow allocates what a variable declares)."""
    for name, shape in listed:
        if not name.startswith("model/"):
            continue
        key = name[len("model/"):]
        declared = tuple(int(d) for d in shape if d != 1)
        if key not in want:
            raise CheckpointError(f"the TensorFlow checkpoint {prefix}.* holds variable {short_repr(name)}, which "
                                  "GPT-2 does not have: it is damaged or not an OpenAI GPT-2 checkpoint")
        if declared != tuple(d for d in want[key] if d != 1):
            raise CheckpointError(f"checkpoint variable {name} declares shape {short_repr(tuple(shape))} but the model "
                                  f"needs {want[key]}: the checkpoint is for another model size (or damaged)")


def load_tf_checkpoint(ckpt_dir: Path, *, n_blocks: int | None = None,
                       shape: GPTConfig | None = None) -> tuple[dict, dict]:
    """Read an OpenAI TensorFlow checkpoint: (settings from hparams.json, nested params).
    ``n_blocks``: the model's block count, which hparams.json must declare; ``shape``: the model's,
    which every variable must have (without it, the shape hparams.json declares)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint folder {ckpt_dir} does not exist; {_missing_hint(ckpt_dir)}")
    missing = [n for n in TF_FILES if not (ckpt_dir / n).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint folder {ckpt_dir} lacks {', '.join(missing)}; "
                              + _missing_hint(ckpt_dir))
    settings = _read_settings(ckpt_dir)
    blocks = _declared_blocks(settings, str(ckpt_dir / "hparams.json"), n_blocks)
    want = tf_shapes(shape if shape is not None else _declared_shape(settings, str(ckpt_dir / "hparams.json"), blocks))
    index = ckpt_dir / "model.ckpt.index"
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise CheckpointError(f"{index} has {index.stat().st_size:,} bytes, more than the {MAX_INDEX_BYTES:,} a GPT-2 "
                              f"index may have; {_missing_hint(ckpt_dir)}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's C++ start-up chatter is no help here
    try:
        import tensorflow as tf  # lazy: ~4 s, and only needed until the converted copy exists
    except ImportError as exc:
        raise CheckpointError(f"reading {ckpt_dir} needs TensorFlow (pip install tensorflow-cpu), "
                              f"since it has no {CONVERTED_NAME} yet ({exc})") from exc
    prefix = str(ckpt_dir / "model.ckpt")
    params: dict = {"blocks": [{} for _ in range(blocks)]}
    listed = _tf_read(tf, prefix, ckpt_dir, name=None)
    _check_listed(listed, want, prefix)
    for name, _ in listed:
        if name.startswith("model/"):
            _insert(params, name[len("model/"):], np.squeeze(_tf_read(tf, prefix, ckpt_dir, name=name)))
    return settings, params


def _tf_read(tf, prefix: str, ckpt_dir: Path, *, name: str | None):
    """The variables, (name, shape) each (name=None), or one variable's value; TF's failures ->
    CheckpointError. TF reports some C++ statuses as builtin exceptions (a truncated data file:
    IndexError)."""
    try:
        if name is None:
            return [(n, list(shape)) for n, shape in tf.train.list_variables(prefix)]
        return tf.train.load_variable(prefix, name)
    except (tf.errors.OpError, IndexError, RuntimeError, ValueError) as exc:
        what = "" if name is None else f" variable {name!r}"
        raise CheckpointError(f"cannot read the TensorFlow checkpoint {prefix}.*{what} "
                              f"({type(exc).__name__}: {exc}); {_missing_hint(ckpt_dir)}") from exc


def _assign(param: torch.nn.Parameter, value, *, param_name: str, source: str) -> None:
    value = torch.as_tensor(np.asarray(value), dtype=torch.float32)
    if tuple(param.shape) != tuple(value.shape):
        raise CheckpointError(
            f"checkpoint tensor {source} has shape {tuple(value.shape)} but model parameter "
            f"{param_name} has shape {tuple(param.shape)}: the checkpoint is for another model "
            "size; choose the matching model size or --weights-dir")
    with torch.no_grad():  # copy_ keeps the Parameter objects (and requires_grad) in place
        param.copy_(value)


def load_weights_into_gpt(model, params: dict) -> None:
    """Copy the reference mapping of ``params`` into ``model`` (float32), checking every shape."""
    blocks = params.get("blocks", [])
    if len(blocks) != len(model.trf_blocks):
        raise CheckpointError(f"checkpoint has {len(blocks)} transformer blocks but the model has "
                              f"{len(model.trf_blocks)}: the checkpoint is for another model size")

    def get(tree: dict, path: str, where: str):
        node = tree
        for key in path.split("/"):
            if not isinstance(node, dict) or key not in node:
                raise CheckpointError(f"checkpoint has no tensor {where}{path}; it is incomplete "
                                      "or not an OpenAI GPT-2 checkpoint")
            node = node[key]
        return node

    def put(module_path: str, value, source: str) -> None:
        _assign(model.get_parameter(module_path), value, param_name=module_path, source=source)

    put("tok_emb.weight", get(params, "wte", ""), "wte")
    put("pos_emb.weight", get(params, "wpe", ""), "wpe")
    for i, block in enumerate(blocks):
        h, m = f"h{i}/", f"trf_blocks.{i}."
        q_w, k_w, v_w = np.split(get(block, "attn/c_attn/w", h), 3, axis=-1)
        q_b, k_b, v_b = np.split(get(block, "attn/c_attn/b", h), 3, axis=-1)
        for part, w, b in (("W_query", q_w, q_b), ("W_key", k_w, k_b), ("W_value", v_w, v_b)):
            put(f"{m}att.{part}.weight", w.T, f"{h}attn/c_attn/w ({part} third, transposed)")
            put(f"{m}att.{part}.bias", b, f"{h}attn/c_attn/b ({part} third)")
        for src, dst in (("attn/c_proj", "att.out_proj"), ("mlp/c_fc", "ff.layers.0"),
                         ("mlp/c_proj", "ff.layers.2")):
            put(f"{m}{dst}.weight", get(block, f"{src}/w", h).T, f"{h}{src}/w (transposed)")
            put(f"{m}{dst}.bias", get(block, f"{src}/b", h), f"{h}{src}/b")
        for src, dst in (("ln_1", "norm1"), ("ln_2", "norm2")):
            put(f"{m}{dst}.scale", get(block, f"{src}/g", h), f"{h}{src}/g")
            put(f"{m}{dst}.shift", get(block, f"{src}/b", h), f"{h}{src}/b")
    put("final_norm.scale", get(params, "g", "ln_f/"), "ln_f/g")
    put("final_norm.shift", get(params, "b", "ln_f/"), "ln_f/b")
    put("out_head.weight", get(params, "wte", ""), "wte (tied output head)")


def _flatten(params: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for key, value in params.items():
        if key == "blocks":
            for i, block in enumerate(value):
                flat.update(_flatten(block, f"h{i}/"))
        elif isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[prefix + key] = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
    return flat


def _fingerprint(ckpt_dir: Path) -> dict[str, int]:
    """Sizes of the TF weight files: a re-downloaded checkpoint of another size invalidates the
    converted copy, while copying the folder elsewhere (new mtimes) does not."""
    return {n: (ckpt_dir / n).stat().st_size for n in TF_FILES[1:] if (ckpt_dir / n).is_file()}


def convert_checkpoint(ckpt_dir: Path) -> Path:
    """Read the TF checkpoint once and write ``<ckpt_dir>/lora_bench_state.pt`` atomically."""
    ckpt_dir = Path(ckpt_dir)
    settings, params = load_tf_checkpoint(ckpt_dir)
    return _write_converted(ckpt_dir, settings, params)


def _write_converted(ckpt_dir: Path, settings: dict, params: dict) -> Path:
    path = ckpt_dir / CONVERTED_NAME
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    payload = {"format": CONVERTED_FORMAT, "settings": settings, "source": _fingerprint(ckpt_dir),
               "n_blocks": len(params["blocks"]), "tensors": _flatten(params)}
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _read_converted(ckpt_dir: Path, *, n_blocks: int | None = None) -> tuple[dict, dict] | None:
    """(settings, params) from the converted file, or None when it is absent, corrupt or stale.
    A header that declares another block count than ``n_blocks`` (the model's) is refused before
    anything is allocated for it."""
    path = ckpt_dir / CONVERTED_NAME
    if not path.is_file():
        return None
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as exc:
        warnings.warn(f"{path} is unreadable ({type(exc).__name__}); converting the TensorFlow "
                      "checkpoint again", RuntimeWarning, stacklevel=3)
        return None
    if not (isinstance(payload, dict) and payload.get("format") == CONVERTED_FORMAT
            and isinstance(payload.get("settings"), dict) and isinstance(payload.get("tensors"), dict)
            and all(isinstance(t, torch.Tensor) for t in payload["tensors"].values())):
        warnings.warn(f"{path} is not a lora-bench converted checkpoint of format "
                      f"{CONVERTED_FORMAT}; converting again", RuntimeWarning, stacklevel=3)
        return None
    current = _fingerprint(ckpt_dir)
    if current and current != payload.get("source"):
        return None  # the TF files changed since conversion: quietly convert again
    declared = payload.get("n_blocks", 0)
    if not isinstance(declared, int) or isinstance(declared, bool):
        raise CheckpointError(f"{path} declares n_blocks={short_repr(declared)}, not a block count; delete it to "
                              "have the TensorFlow checkpoint converted again")
    if n_blocks is not None and declared != n_blocks:
        raise CheckpointError(f"{path} declares {short_repr(declared)} transformer blocks but the model has "
                              f"{n_blocks}: "
                              "it is for another model size or damaged; delete it to have the TensorFlow "
                              "checkpoint converted again")
    if not 0 <= declared <= MAX_BLOCKS:
        raise CheckpointError(f"{path} declares n_blocks={declared}; lora-bench reads 0 to {MAX_BLOCKS:,} blocks")
    _declared_blocks(payload["settings"], str(path), n_blocks)
    params: dict = {"blocks": [{} for _ in range(declared)]}
    for name, tensor in payload["tensors"].items():
        _insert(params, name, tensor.numpy())
    return payload["settings"], params


def load_pretrained_into(model, ckpt_dir: Path) -> dict:
    """Load the checkpoint in ``ckpt_dir`` into ``model``; returns its hparams settings.

    Uses ``lora_bench_state.pt`` when present and valid; otherwise reads the TensorFlow files and,
    once every tensor is in the model with its shape checked, writes the converted file into the
    folder (when it takes files) so the next run needs no TensorFlow.
    """
    ckpt_dir = Path(ckpt_dir)
    n_blocks = len(model.trf_blocks)
    loaded = _read_converted(ckpt_dir, n_blocks=n_blocks)
    converted = loaded is not None
    settings, params = loaded if converted else load_tf_checkpoint(ckpt_dir, n_blocks=n_blocks, shape=model.cfg)
    heads = settings.get("n_head")
    if heads is not None and model.trf_blocks and heads != model.trf_blocks[0].att.num_heads:
        raise CheckpointError(f"checkpoint {ckpt_dir} has n_head={short_repr(heads)} but the model has "
                              f"{model.trf_blocks[0].att.num_heads} heads; choose the matching model size")
    load_weights_into_gpt(model, params)
    if not converted and os.access(ckpt_dir, os.W_OK):
        try:
            _write_converted(ckpt_dir, settings, params)
        except OSError as exc:  # full disk, read-only mount: loading still succeeded
            warnings.warn(f"could not write {ckpt_dir / CONVERTED_NAME} ({exc}); the next run "
                          "will read the TensorFlow checkpoint again", RuntimeWarning, stacklevel=2)
    return settings
