"""GPT-2 checkpoints in the Hugging Face layout (``model.safetensors``), the second source of
pretrained weights: find the file (the Hub's cache, a download through ``huggingface_hub``, or a
local folder), read it into the Hugging Face key layout, and map it onto
:class:`lora_bench.model.gpt2.GPTModel` through :mod:`lora_bench.model.checkpoints`' reference
mapping (Conv1D weights are stored in×out, as the OpenAI TensorFlow variables are, so the two
sources give bit-identical models); also convert a book model's weights into that layout and load
them into transformers' ``GPT2Model``. safetensors and huggingface_hub are optional
(``pip install "lora-bench[peers]"``) and imported only when used. Nothing the files declare is
trusted before it is checked: config.json is read only up to a size, and the safetensors header
(its length, the number of tensors, each one's name, dtype, shape and place in the file, and,
where the model is known, its shape against the model's) before any tensor is read."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
import torch.nn as nn

from lora_bench.download import sha256_of
from lora_bench.errors import CheckpointError, DownloadError
from lora_bench.model.checkpoints import TF_FILES, load_weights_into_gpt, read_settings_file
from lora_bench.model.gpt2 import CHECKPOINT_NAMES, GPTConfig, GPTModel, resolve_model_size
from lora_bench.model.safetensors_header import read_header
from lora_bench.model.sizes import MAX_BLOCKS
from lora_bench.optional import require
from lora_bench.safe_yaml import short_repr

HF_REPOS = {
    "124M": "openai-community/gpt2",
    "355M": "openai-community/gpt2-medium",
    "774M": "openai-community/gpt2-large",
    "1558M": "openai-community/gpt2-xl",
}
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Saved by transformers (5.x: every key under "transformer."; the Hub's files: no prefix).
PREFIX = "transformer."
# Not weights of the GPT-2 body: the tied LM head (the book model copies wte into its head, and the
# classifier replaces the head anyway) and the causal-mask buffers older transformers saved.
_SKIPPED = re.compile(r"^(lm_head\.weight|h\.\d+\.attn\.(bias|masked_bias))$")
_BLOCK_KEY = re.compile(r"^h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj|ln_1|ln_2)\.(weight|bias)$")
_TOP_KEYS = {"wte.weight": ("wte",), "wpe.weight": ("wpe",), "ln_f.weight": ("g",), "ln_f.bias": ("b",)}
_SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")
MAX_CONFIG_BYTES = 1 << 20  # GPT-2's config.json: under 1 KB


def hf_repo_id(model_size: str) -> str:
    """The Hub repository of a GPT-2 size ('124M' -> 'openai-community/gpt2')."""
    try:
        return HF_REPOS[CHECKPOINT_NAMES[resolve_model_size(model_size)]]
    except (ValueError, KeyError):
        raise CheckpointError(f"model_size={model_size!r} has no Hugging Face GPT-2 checkpoint; choose one of "
                              f"{', '.join(HF_REPOS)} or use random weights") from None


# -- finding the files ------------------------------------------------------------------------------

def ensure_hf_checkpoint(
    model_size: str,
    *,
    weights_dir: Path | str | None = None,
    cache_dir: Path | str | None = None,
    revision: str | None = None,
    local_files_only: bool | None = None,
    progress: bool = True,
) -> Path:
    """The folder holding ``model.safetensors`` (and ``config.json`` where there is one) of ``model_size``.

    With ``weights_dir``, that folder, as given. Otherwise ``huggingface_hub.hf_hub_download`` finds the
    files in the Hub's cache (``cache_dir``, else ``HF_HUB_CACHE`` / ``HF_HOME``), downloading what is
    missing unless ``local_files_only`` or ``HF_HUB_OFFLINE=1``; the returned folder is the cache's
    snapshot, named by the commit. A file downloaded now is checked against its sha256 (the cache names
    each blob by it); huggingface_hub itself checks the size.
    """
    if weights_dir is not None:
        return _local_folder(Path(weights_dir))
    repo = hf_repo_id(model_size)
    hub = require("huggingface_hub", purpose="downloading the Hugging Face GPT-2 weights")
    errors = require("huggingface_hub.errors", purpose="downloading the Hugging Face GPT-2 weights")
    hub_utils = require("huggingface_hub.utils", purpose="downloading the Hugging Face GPT-2 weights")
    kw = dict(cache_dir=str(cache_dir) if cache_dir is not None else None, revision=revision)
    if local_files_only is not None:
        kw["local_files_only"] = local_files_only
    hint = (f"to work offline, run `hf download {repo} {WEIGHTS_FILE} {CONFIG_FILE}` where there is a network "
            f"and copy the Hugging Face cache here, or put {WEIGHTS_FILE} in a folder and pass "
            "--weights-dir <that folder>, or train from random weights with --weights random")
    quiet = not progress and not hub_utils.are_progress_bars_disabled()
    if quiet:
        hub_utils.disable_progress_bars()
    try:
        cached = hub.try_to_load_from_cache(repo, WEIGHTS_FILE, cache_dir=kw["cache_dir"], revision=revision)
        try:
            weights_path = Path(hub.hf_hub_download(repo, WEIGHTS_FILE, **kw))
            try:
                hub.hf_hub_download(repo, CONFIG_FILE, **kw)  # shape check only; optional
            except errors.EntryNotFoundError:
                pass
        except errors.LocalEntryNotFoundError as exc:
            raise DownloadError(f"GPT-2 {model_size} ({repo}/{WEIGHTS_FILE}) is not in the Hugging Face cache "
                                f"and cannot be downloaded (offline: HF_HUB_OFFLINE=1, or no network); "
                                f"{hint}") from exc
        except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.EntryNotFoundError) as exc:
            raise DownloadError(f"{repo}/{WEIGHTS_FILE} (revision {revision or 'main'}) is not on the Hub: "
                                f"{type(exc).__name__}; check the revision, or pass --weights-dir") from exc
        except (errors.HfHubHTTPError, OSError) as exc:
            raise DownloadError(f"could not download {repo}/{WEIGHTS_FILE}: {type(exc).__name__}: {exc}\n"
                                f"{hint}") from exc
    finally:
        if quiet:
            hub_utils.enable_progress_bars()
    if not isinstance(cached, str):  # downloaded just now
        verify_hf_blob(weights_path)
    return weights_path.parent


def verify_hf_blob(path: Path) -> None:
    """Check a file of the Hub's cache against the sha256 its blob is named by (LFS files are);
    DownloadError naming the file to delete on a mismatch. Files not named by a hash pass."""
    blob = Path(path).resolve()
    if not _SHA256_NAME.match(blob.name):
        return
    digest = sha256_of(blob)
    if digest != blob.name:
        raise DownloadError(f"{path} (blob {blob}) has sha256 {digest}, not the {blob.name} the Hub gave it: the "
                            "download is corrupt; delete that blob and run again")


def _local_folder(folder: Path) -> Path:
    if folder.is_file() and folder.name == WEIGHTS_FILE:
        return folder.parent
    if not folder.is_dir():
        raise CheckpointError(f"weights folder {folder} does not exist; pass --weights-dir <folder holding "
                              f"{WEIGHTS_FILE}>")
    if not (folder / WEIGHTS_FILE).is_file():
        held = sorted(p.name for p in folder.iterdir())[:12]
        tf = (" It holds an OpenAI TensorFlow checkpoint: use weights_source=openai for it."
              if all((folder / n).is_file() for n in TF_FILES) else "")
        raise CheckpointError(f"weights folder {folder} has no {WEIGHTS_FILE} (it holds: "
                              f"{', '.join(held) or 'nothing'}).{tf}")
    return folder


# -- reading ----------------------------------------------------------------------------------------

def hf_shapes(m: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of GPT-2's body for a model of shape ``m``, in GPT2Model's layout (Conv1D in×out)."""
    e = m.emb_dim
    out = {"wte.weight": (m.vocab_size, e), "wpe.weight": (m.context_length, e), "ln_f.weight": (e,), "ln_f.bias": (e,)}
    for i in range(m.n_layers):
        h = f"h.{i}."
        for module, (rows, cols) in (("attn.c_attn", (e, 3 * e)), ("attn.c_proj", (e, e)), ("mlp.c_fc", (e, 4 * e)),
                                     ("mlp.c_proj", (4 * e, e))):
            out[f"{h}{module}.weight"], out[f"{h}{module}.bias"] = (rows, cols), (cols,)
        out.update({f"{h}{ln}.{p}": (e,) for ln in ("ln_1", "ln_2") for p in ("weight", "bias")})
    return out


def _check_names(path: Path, header: dict[str, tuple[str, tuple[int, ...]]], shape: GPTConfig | None) -> None:
    """GPT-2's names only, block numbers below MAX_BLOCKS (the model's count where it is known), and
    with the model's shape known, each tensor of its shape and none of the others larger than its
    largest."""
    want = hf_shapes(shape) if shape is not None else None
    blocks = shape.n_layers if shape is not None else MAX_BLOCKS
    largest = max(map(math.prod, want.values())) if want else None
    unknown = []
    order = {name: i for i, name in enumerate(_TOP_KEYS)}  # the embeddings first: their mismatch says most
    top_first = sorted(header.items(), key=lambda item: order.get(item[0].removeprefix(PREFIX), len(order)))
    for key, (_, dims) in top_first:
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        block = re.match(r"h\.(\d+)\.", name)
        if block and int(block.group(1)) >= blocks:
            raise CheckpointError(f"{path} holds tensor {short_repr(key)} of block {short_repr(int(block.group(1)))}, "
                                  f"but the model has {blocks} blocks: the checkpoint is for another model size")
        if _SKIPPED.match(name):
            if largest is not None and math.prod(dims) > largest:
                raise CheckpointError(f"{path} holds {short_repr(key)} of shape {short_repr(dims)}, larger than any "
                                      "tensor of the model: it is damaged or not GPT-2's")
            continue
        if name not in _TOP_KEYS and not _BLOCK_KEY.match(name):
            unknown.append(key)
        elif want is not None and dims != want.get(name, dims):
            raise CheckpointError(f"checkpoint tensor {short_repr(key)} has shape {short_repr(dims)} but the model "
                                  f"needs {want[name]}: the checkpoint is for another model size")
    if unknown:
        raise CheckpointError(f"{path} is not a GPT-2 checkpoint in the Hugging Face layout: unexpected "
                              f"tensor(s) {', '.join(short_repr(k) for k in sorted(unknown)[:5])}")


def read_hf_state(folder: Path, *, shape: GPTConfig | None = None) -> dict[str, torch.Tensor]:
    """The GPT-2 body of ``<folder>/model.safetensors`` in GPT2Model's key layout ('wte.weight',
    'h.0.attn.c_attn.weight', ...), float32 on the CPU; other keys of a GPT-2 checkpoint are dropped
    (see ``_SKIPPED``), any further key is refused. The header is checked first (``read_header``;
    with ``shape``, the model's, every tensor against it), before any tensor is read."""
    path = Path(folder) / WEIGHTS_FILE
    st = require("safetensors.torch", purpose=f"reading {WEIGHTS_FILE}")
    safetensors = require("safetensors", purpose=f"reading {WEIGHTS_FILE}")
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; pass --weights-dir <folder holding {WEIGHTS_FILE}>")
    _check_names(path, read_header(path), shape)
    try:
        raw = st.load_file(str(path), device="cpu")
    except (safetensors.SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path} ({type(exc).__name__}: {exc}); it is truncated or not a "
                              "safetensors file: delete it to have it downloaded again, or pass --weights-dir") from exc
    state: dict[str, torch.Tensor] = {}
    unknown = []
    for key, tensor in raw.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        if _SKIPPED.match(name):
            continue
        if name not in _TOP_KEYS and not _BLOCK_KEY.match(name):
            unknown.append(key)
            continue
        state[name] = tensor.to(torch.float32)
    if unknown:
        raise CheckpointError(f"{path} is not a GPT-2 checkpoint in the Hugging Face layout: unexpected "
                              f"tensor(s) {', '.join(sorted(unknown)[:5])}")
    return state


def read_hf_settings(folder: Path) -> dict:
    """``config.json`` beside the weights ({} when absent: a bare weights file is enough)."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return {}
    return read_settings_file(path, hint="delete it, or pass --weights-dir", max_bytes=MAX_CONFIG_BYTES)


def params_from_hf_state(state: dict[str, torch.Tensor]) -> dict:
    """The reference's nested ``params`` (as :func:`lora_bench.model.checkpoints.load_tf_checkpoint` returns
    them) from a Hugging Face state: a renaming only, since Conv1D weights are stored in×out like the
    TensorFlow variables."""
    n_blocks = 1 + max((int(m.group(1)) for k in state if (m := _BLOCK_KEY.match(k))), default=-1)
    if n_blocks > MAX_BLOCKS:
        raise CheckpointError(f"the checkpoint names block {short_repr(n_blocks - 1)}; lora-bench reads at most "
                              f"{MAX_BLOCKS:,} blocks")
    params: dict = {"blocks": [{} for _ in range(n_blocks)]}
    for key, tensor in state.items():
        value = tensor.detach().to(torch.float32).cpu().numpy()
        if key in _TOP_KEYS:
            params[_TOP_KEYS[key][0]] = value
            continue
        m = _BLOCK_KEY.match(key)
        if m is None:
            raise CheckpointError(f"tensor {key!r} is not part of GPT-2's Hugging Face layout")
        index, module, kind = int(m.group(1)), m.group(2), m.group(3)
        if module in ("ln_1", "ln_2"):
            leaf, path = ("g" if kind == "weight" else "b"), [module]
        else:
            leaf, path = ("w" if kind == "weight" else "b"), module.split(".")
        node = params["blocks"][index]
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return params


def load_hf_checkpoint_into_gpt(model: GPTModel, folder: Path) -> dict:
    """Load ``<folder>/model.safetensors`` into the book ``model`` (the reference mapping, every shape
    checked); returns the settings of ``config.json`` ({} without one)."""
    folder = Path(folder)
    settings = read_hf_settings(folder)
    heads = settings.get("n_head")
    if heads is not None and model.trf_blocks and heads != model.trf_blocks[0].att.num_heads:
        raise CheckpointError(f"checkpoint {folder} has n_head={short_repr(heads)} but the model has "
                              f"{model.trf_blocks[0].att.num_heads} heads; choose the matching model size")
    load_weights_into_gpt(model, params_from_hf_state(read_hf_state(folder, shape=model.cfg)))
    return settings


def load_gpt_from_hf(mcfg: GPTConfig, *, model_size: str, weights_dir: Path | str | None = None,
                     cache_dir: Path | str | None = None, progress: bool = True) -> GPTModel:
    """The book model with the Hugging Face weights of ``model_size``, in eval mode (as
    ``classifier.load_base_model`` returns the OpenAI ones)."""
    folder = ensure_hf_checkpoint(model_size, weights_dir=weights_dir, cache_dir=cache_dir, progress=progress)
    model = GPTModel(mcfg)
    load_hf_checkpoint_into_gpt(model, folder)
    model.eval()
    return model


# -- the book model in the Hugging Face layout -------------------------------------------------------

def hf_state_from_gpt(model: GPTModel) -> dict[str, torch.Tensor]:
    """The book model's body as a GPT2Model state (copies, contiguous, in the model's dtype): the
    query/key/value weights concatenated and transposed into c_attn, the other linears transposed
    into Conv1D's in×out. The head is left out (GPT2Model has none)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {"wte.weight": sd["tok_emb.weight"].clone(), "wpe.weight": sd["pos_emb.weight"].clone(),
           "ln_f.weight": sd["final_norm.scale"].clone(), "ln_f.bias": sd["final_norm.shift"].clone()}
    for i in range(len(model.trf_blocks)):
        m, h = f"trf_blocks.{i}.", f"h.{i}."
        parts = [f"{m}att.{p}" for p in ("W_query", "W_key", "W_value")]
        out[h + "attn.c_attn.weight"] = torch.cat([sd[p + ".weight"].t() for p in parts], dim=1).contiguous()
        if parts[0] + ".bias" in sd:
            out[h + "attn.c_attn.bias"] = torch.cat([sd[p + ".bias"] for p in parts])
        for src, dst in (("att.out_proj", "attn.c_proj"), ("ff.layers.0", "mlp.c_fc"), ("ff.layers.2", "mlp.c_proj")):
            out[f"{h}{dst}.weight"] = sd[f"{m}{src}.weight"].t().contiguous()
            out[f"{h}{dst}.bias"] = sd[f"{m}{src}.bias"].clone()
        for src, dst in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out[f"{h}{dst}.weight"] = sd[f"{m}{src}.scale"].clone()
            out[f"{h}{dst}.bias"] = sd[f"{m}{src}.shift"].clone()
    return out


def load_hf_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put ``state`` (GPT2Model keys) into ``module`` (transformers' GPT2Model, possibly built on the
    meta device): every key present and every shape equal, else CheckpointError naming the first
    offender. The tensors are taken over (``assign``), not copied."""
    own = module.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise CheckpointError(f"checkpoint and model disagree: missing {', '.join(missing[:5]) or 'nothing'}; "
                              f"unexpected {', '.join(extra[:5]) or 'nothing'} (another model size or layout)")
    for key, tensor in state.items():
        if tuple(own[key].shape) != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint tensor {key} has shape {tuple(tensor.shape)} but the model's has "
                                  f"{tuple(own[key].shape)}: the checkpoint is for another model size")
    module.load_state_dict(state, strict=True, assign=True)

