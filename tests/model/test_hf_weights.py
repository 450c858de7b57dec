"""lora_bench.model.hf_checkpoint: one set of random GPT-2 weights is written as an OpenAI TensorFlow checkpoint
and as Hugging Face safetensors (the Hub's layout, written directly, and transformers' own
save_pretrained layout); the book model loaded from either is the same model, bit for bit. Then the
transformers model from the same files, the book -> Hugging Face conversion, the error messages, and
the resolver against a Hugging Face cache laid out on disk (no network)."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from checkpoints import write_tf_checkpoint
from numerics import assert_same_function

from lora_bench.errors import CheckpointError, DownloadError
from lora_bench.model import checkpoints as weights
from lora_bench.model.gpt2 import GPTConfig, GPTModel
from lora_bench.model.hf_checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ensure_hf_checkpoint,
    hf_repo_id,
    hf_state_from_gpt,
    load_gpt_from_hf,
    load_hf_checkpoint_into_gpt,
    load_hf_state,
    read_hf_state,
    verify_hf_blob,
)

safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, CTX, EMB, LAYERS, HEADS = 50, 16, 16, 2, 2
CFG = GPTConfig(vocab_size=VOCAB, context_length=CTX, emb_dim=EMB, n_layers=LAYERS, n_heads=HEADS)
TOKENS = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 49, 0]])


def _openai_arrays() -> dict[str, np.ndarray]:
    """Random non-zero values with OpenAI's names and shapes (conv1d weights with their leading 1)."""
    rng = np.random.default_rng(1)

    def rand(*shape):
        return (rng.uniform(0.1, 1.0, shape) * rng.choice([-1, 1], shape)).astype(np.float32)

    e = EMB
    arrays = {"model/wte": rand(VOCAB, e), "model/wpe": rand(CTX, e), "model/ln_f/g": rand(e), "model/ln_f/b": rand(e)}
    for i in range(LAYERS):
        h = f"model/h{i}/"
        arrays.update({h + "attn/c_attn/w": rand(1, e, 3 * e), h + "attn/c_attn/b": rand(3 * e),
                       h + "attn/c_proj/w": rand(1, e, e), h + "attn/c_proj/b": rand(e),
                       h + "mlp/c_fc/w": rand(1, e, 4 * e), h + "mlp/c_fc/b": rand(4 * e),
                       h + "mlp/c_proj/w": rand(1, 4 * e, e), h + "mlp/c_proj/b": rand(e),
                       h + "ln_1/g": rand(e), h + "ln_1/b": rand(e), h + "ln_2/g": rand(e), h + "ln_2/b": rand(e)})
    return arrays


def _hf_state(arrays) -> dict[str, torch.Tensor]:
    """The same values under GPT2Model's names, written out independently of the code under test:
    Conv1D keeps the TF variables' in×out layout, the layer norms' g/b are weight/bias."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    out = {"wte.weight": t(arrays["model/wte"]), "wpe.weight": t(arrays["model/wpe"]),
           "ln_f.weight": t(arrays["model/ln_f/g"]), "ln_f.bias": t(arrays["model/ln_f/b"])}
    for i in range(LAYERS):
        h, m = f"h.{i}.", f"model/h{i}/"
        for mod in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj"):
            name = h + mod.replace("/", ".")
            out[name + ".weight"] = t(arrays[m + mod + "/w"][0])
            out[name + ".bias"] = t(arrays[m + mod + "/b"])
        for ln in ("ln_1", "ln_2"):
            out[f"{h}{ln}.weight"] = t(arrays[f"{m}{ln}/g"])
            out[f"{h}{ln}.bias"] = t(arrays[f"{m}{ln}/b"])
    return out


@pytest.fixture(scope="module")
def arrays():
    return _openai_arrays()


@pytest.fixture(scope="module")
def tf_folder(tmp_path_factory, arrays):
    return write_tf_checkpoint(tmp_path_factory.mktemp("tf"), arrays, {"n_vocab": VOCAB, "n_ctx": CTX, "n_embd": EMB,
                                                                       "n_head": HEADS, "n_layer": LAYERS})


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory, arrays):
    """The Hub's layout: no prefix, and the causal-mask buffers older transformers saved."""
    folder = tmp_path_factory.mktemp("hub")
    state = _hf_state(arrays)
    for i in range(LAYERS):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(CTX, CTX)).view(1, 1, CTX, CTX)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    safetensors_torch.save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps({"model_type": "gpt2", "n_head": HEADS, "n_layer": LAYERS}))
    return folder


@pytest.fixture(scope="module")
def transformers_folder(tmp_path_factory, arrays):
    """What the installed transformers writes for a GPT2LMHeadModel holding these weights."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CTX, n_embd=EMB, n_layer=LAYERS, n_head=HEADS,
                                     bos_token_id=None, eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    model.transformer.load_state_dict(_hf_state(arrays))
    model.save_pretrained(folder)
    return folder


def _book_from_tf(tf_folder, tmp_path):
    folder = shutil.copytree(tf_folder, tmp_path / "tf")
    torch.manual_seed(10)
    model = GPTModel(CFG)
    weights.load_pretrained_into(model, folder)
    return model


@pytest.mark.parametrize("layout", ["hub_folder", "transformers_folder"])
def test_both_formats_give_the_same_book_model(tf_folder, layout, request, tmp_path):
    """Tolerance 0: every parameter and the logits are bit-identical (torch.equal) in float32."""
    folder = request.getfixturevalue(layout)
    from_tf = _book_from_tf(tf_folder, tmp_path)
    torch.manual_seed(11)  # other initial values: a parameter the loader missed would differ
    from_st = GPTModel(CFG)
    load_hf_checkpoint_into_gpt(from_st, folder)
    a, b = from_tf.state_dict(), from_st.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert b[name].dtype == torch.float32 and torch.equal(a[name], b[name]), name
    with torch.no_grad():
        assert torch.equal(from_tf(TOKENS), from_st(TOKENS))


def test_hf_layout_of_the_book_model_is_the_checkpoint(tf_folder, hub_folder, arrays, tmp_path):
    """book -> Hugging Face layout reproduces the file's tensors exactly (and the expected ones)."""
    converted = hf_state_from_gpt(_book_from_tf(tf_folder, tmp_path))
    read = read_hf_state(hub_folder)
    expected = _hf_state(arrays)
    assert converted.keys() == read.keys() == expected.keys()
    for name in expected:
        assert torch.equal(converted[name], expected[name]) and torch.equal(read[name], expected[name]), name
        assert converted[name].is_contiguous(), name


def test_transformers_model_from_the_same_files(transformers_folder, tf_folder, tmp_path):
    """transformers' own from_pretrained and load_hf_state give the same GPT2 body; its LM logits
    are the book model's (float32 in another operation order: both against the book's float64
    evaluation, numerics.same_function_tol)."""
    transformers = pytest.importorskip("transformers")
    lm = transformers.GPT2LMHeadModel.from_pretrained(transformers_folder, attn_implementation="eager").eval()
    with torch.device("meta"):
        body = transformers.GPT2Model(lm.config)
    load_hf_state(body, read_hf_state(transformers_folder))
    for name, value in lm.transformer.state_dict().items():
        assert torch.equal(body.state_dict()[name], value), name
    book = _book_from_tf(tf_folder, tmp_path).eval()
    with torch.no_grad():
        want = book(TOKENS)
        got = lm(TOKENS).logits
        ref = book.double()(TOKENS)
    assert_same_function(got, want, ref, what="LM logits")  # as close to float64 as the book's float32


def test_load_gpt_from_hf_with_a_local_folder(hub_folder, tf_folder, tmp_path):
    model = load_gpt_from_hf(CFG, model_size="124M", weights_dir=hub_folder)
    assert not model.training
    ref = _book_from_tf(tf_folder, tmp_path)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


# -- errors --------------------------------------------------------------------------------------------

def test_truncated_and_foreign_files_are_named(hub_folder, tmp_path):
    bad = shutil.copytree(hub_folder, tmp_path / "bad")
    data = (bad / WEIGHTS_FILE).read_bytes()
    (bad / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or not a safetensors file"):
        read_hf_state(bad)
    state = _hf_state(_openai_arrays())
    state["score.weight"] = torch.zeros(2, EMB)  # a classifier's head: not GPT-2's body
    safetensors_torch.save_file(state, str(bad / WEIGHTS_FILE))
    with pytest.raises(CheckpointError, match="unexpected tensor.*score.weight"):
        read_hf_state(bad)


def test_shape_and_head_mismatches_are_named(hub_folder, tmp_path):
    wide = GPTConfig(vocab_size=VOCAB, context_length=CTX, emb_dim=32, n_layers=LAYERS, n_heads=HEADS)
    with pytest.raises(CheckpointError, match=r"wte.weight' has shape \(50, 16\) but the model needs \(50, 32\)"
                                              r".*another model size"):
        load_hf_checkpoint_into_gpt(GPTModel(wide), hub_folder)  # from the header, before any tensor is read
    folder = shutil.copytree(hub_folder, tmp_path / "heads")
    (folder / CONFIG_FILE).write_text(json.dumps({"n_head": 4}))
    with pytest.raises(CheckpointError, match="n_head=4 but the model has 2 heads"):
        load_hf_checkpoint_into_gpt(GPTModel(CFG), folder)
    transformers = pytest.importorskip("transformers")
    deep = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CTX, n_embd=EMB, n_layer=3, n_head=HEADS,
                                   bos_token_id=None, eos_token_id=None)
    with torch.device("meta"):
        body = transformers.GPT2Model(deep)
    with pytest.raises(CheckpointError, match="missing h.2.attn.c_attn.bias"):
        load_hf_state(body, read_hf_state(hub_folder))


def test_local_folder_errors(tmp_path, tf_folder):
    with pytest.raises(CheckpointError, match="does not exist"):
        ensure_hf_checkpoint("124M", weights_dir=tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no model.safetensors.*weights_source=openai"):
        ensure_hf_checkpoint("124M", weights_dir=tf_folder)


# -- the resolver ------------------------------------------------------------------------------------

def test_repo_ids():
    assert hf_repo_id("124M") == "openai-community/gpt2"
    assert hf_repo_id("gpt2-xl (1558M)") == "openai-community/gpt2-xl"
    with pytest.raises(CheckpointError, match="tiny.*no Hugging Face GPT-2 checkpoint"):
        hf_repo_id("tiny")


def _fill_cache(cache, source, *, repo="openai-community/gpt2", commit="a" * 40, blob_name=None):
    """A Hugging Face cache as huggingface_hub lays it out: blobs named by sha256 (LFS) / the git hash,
    snapshots/<commit>/<file> links to them, refs/main naming the commit."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        data = (source / name).read_bytes()
        blob = root / "blobs" / (blob_name if blob_name and name == WEIGHTS_FILE else hashlib.sha256(data).hexdigest())
        blob.write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{blob.name}")
    return snap


def test_cached_checkpoint_found_offline(hub_folder, tmp_path):
    pytest.importorskip("huggingface_hub")
    snap = _fill_cache(tmp_path / "hub", hub_folder)
    folder = ensure_hf_checkpoint("124M", cache_dir=tmp_path / "hub", local_files_only=True, progress=False)
    assert folder == snap
    assert read_hf_state(folder).keys() == read_hf_state(hub_folder).keys()


def test_missing_checkpoint_offline_says_what_to_do(tmp_path):
    pytest.importorskip("huggingface_hub")
    with pytest.raises(DownloadError) as err:
        ensure_hf_checkpoint("355M", cache_dir=tmp_path / "empty", local_files_only=True, progress=False)
    msg = str(err.value)
    assert "openai-community/gpt2-medium" in msg and "HF_HUB_OFFLINE" in msg and "--weights-dir" in msg


def test_blob_hash_is_checked(hub_folder, tmp_path):
    good = _fill_cache(tmp_path / "good", hub_folder) / WEIGHTS_FILE
    verify_hf_blob(good)  # named by its own sha256
    bad = _fill_cache(tmp_path / "bad", hub_folder, blob_name="0" * 64) / WEIGHTS_FILE
    with pytest.raises(DownloadError, match="corrupt; delete that blob"):
        verify_hf_blob(bad)
    verify_hf_blob(hub_folder / WEIGHTS_FILE)  # not a cache blob: nothing to compare with


def test_fresh_download_is_hash_checked(hub_folder, tmp_path, monkeypatch):
    """A file that was not in the cache before the call is verified; one already cached is not."""
    hub = pytest.importorskip("huggingface_hub")
    snap = _fill_cache(tmp_path / "c", hub_folder, blob_name="f" * 64)
    calls = []

    def fake_download(repo_id, filename, **kw):
        calls.append(filename)
        return str(snap / filename)

    monkeypatch.setattr(hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(hub, "try_to_load_from_cache", lambda *a, **k: None)
    with pytest.raises(DownloadError, match="corrupt"):
        ensure_hf_checkpoint("124M", cache_dir=tmp_path / "c", progress=False)
    assert calls == [WEIGHTS_FILE, CONFIG_FILE]
    monkeypatch.setattr(hub, "try_to_load_from_cache", lambda *a, **k: str(snap / WEIGHTS_FILE))
    assert ensure_hf_checkpoint("124M", cache_dir=tmp_path / "c", progress=False) == snap


def test_missing_safetensors_package_names_the_extra(hub_folder, monkeypatch):
    import sys

    from lora_bench.errors import UsageError

    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(UsageError, match=r'pip install "lora-bench\[peers\]"'):
        read_hf_state(hub_folder)


@pytest.mark.parametrize("blob, needle", [(b"[1, 2]", "not an object"), (b'{"n_head": Infinity}', "Infinity"),
                                          (b'{"n_head": "4"}', "n_head='4'"), (b"\xff\x00", "cannot read")])
def test_malformed_config_json_is_one_clear_error(blob, needle, hub_folder, tmp_path):
    folder = tmp_path / "w"
    shutil.copytree(hub_folder, folder)
    (folder / CONFIG_FILE).write_bytes(blob)
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint_into_gpt(GPTModel(CFG), folder)
    assert str(folder / CONFIG_FILE) in str(err.value) and needle in str(err.value), str(err.value)


# -- hostile metadata: the header and config.json are bounded and checked before any tensor is read ---

def _raw_safetensors(folder, header: dict, data: bytes = b"", *, declared: int | None = None):
    """A safetensors file written byte by byte: its header length (``declared`` when it lies), the
    header's JSON, then ``data``."""
    folder.mkdir(exist_ok=True)
    head = json.dumps(header).encode()
    n = len(head) if declared is None else declared
    (folder / WEIGHTS_FILE).write_bytes(n.to_bytes(8, "little") + head + data)
    return folder


def _f32(shape, begin=0):
    end = begin + 4 * int(np.prod(shape))
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, end]}


@pytest.mark.parametrize("header, data, declared, needle", [
    ({}, b"", 2**40, "its header declares 1,099,511,627,776 bytes"),
    ({"wte.weight": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 16]}}, b"\0" * 16, None,
     "tensor 'wte.weight' of shape (1000000, 1000000) does not lie in the file's 16 bytes of data"),
    ({"wte.weight": {"dtype": "X99", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None,
     "tensor 'wte.weight' has no dtype, shape and data offsets lora-bench reads"),
    ({f"h.{i}.ln_1.weight": _f32([0]) for i in range(40_000)}, b"", None, "a mapping of at most 32,784 tensors"),
])
def test_a_hostile_safetensors_header_is_refused_before_any_tensor_is_read(tmp_path, header, data, declared, needle):
    folder = _raw_safetensors(tmp_path / "w", header, data, declared=declared)
    with pytest.raises(CheckpointError) as err:
        read_hf_state(folder)
    assert needle in str(err.value) and len(str(err.value)) < 600, str(err.value)[:600]


def test_a_block_number_far_beyond_the_model_is_refused_before_allocating(tmp_path):
    import tracemalloc

    state = {**_hf_state(_openai_arrays()), "h.1000000.ln_1.weight": torch.ones(EMB)}
    (tmp_path / "w").mkdir()
    safetensors_torch.save_file(state, str(tmp_path / "w" / WEIGHTS_FILE))
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="of block 1000000, but the model has 2 blocks"):
            load_hf_checkpoint_into_gpt(GPTModel(CFG), tmp_path / "w")
        assert tracemalloc.get_traced_memory()[1] < 20 << 20
    finally:
        tracemalloc.stop()


def test_an_oversized_or_foreign_config_json_is_refused(hub_folder, tmp_path):
    folder = shutil.copytree(hub_folder, tmp_path / "cfg")
    with open(folder / CONFIG_FILE, "wb") as f:
        f.truncate(2 * 2**30)  # holes: no disk space
    with pytest.raises(CheckpointError, match=r"2,147,483,648 bytes, more than the 1,048,576 a config.json may have"):
        load_hf_checkpoint_into_gpt(GPTModel(CFG), folder)
    (folder / CONFIG_FILE).write_text('["n_head", 4]')
    with pytest.raises(CheckpointError, match="not an object of settings"):
        load_hf_checkpoint_into_gpt(GPTModel(CFG), folder)
    (folder / CONFIG_FILE).write_text(json.dumps({"n_head": "x" * 10_000}))
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint_into_gpt(GPTModel(CFG), folder)
    assert "n_head='xxxx" in str(err.value) and len(str(err.value)) < 400


def test_json_nested_thousands_deep_is_a_checkpoint_error(hub_folder, tmp_path):
    folder = shutil.copytree(hub_folder, tmp_path / "deep")
    (folder / CONFIG_FILE).write_text("[" * 30_000 + "]" * 30_000)
    with pytest.raises(CheckpointError, match="cannot read .*config.json"):
        load_hf_checkpoint_into_gpt(GPTModel(CFG), folder)
    deep = ("[" * 30_000 + "]" * 30_000).encode()
    (folder / WEIGHTS_FILE).write_bytes(len(deep).to_bytes(8, "little") + deep)
    with pytest.raises(CheckpointError, match="its header is not JSON"):
        read_hf_state(folder)
