"""lora_bench.model.checkpoints: a tiny TF1 Saver checkpoint named like OpenAI's is written once per module,
then read, mapped onto GPTModel (checked tensor by tensor), converted to .pt and reloaded without
TensorFlow; ensure_checkpoint is exercised against a local HTTP server."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys

import numpy as np
import pytest
import torch
from checkpoints import write_tf_checkpoint
from conftest import refused_url

from lora_bench.errors import CheckpointError, DownloadError
from lora_bench.model import checkpoints as weights
from lora_bench.model.checkpoints import (
    CHECKPOINT_FILES,
    CONVERTED_NAME,
    default_cache_dir,
    ensure_checkpoint,
    load_pretrained_into,
    load_tf_checkpoint,
    load_weights_into_gpt,
)
from lora_bench.model.gpt2 import GPTConfig, GPTModel

VOCAB, CTX, EMB, LAYERS, HEADS = 50, 16, 16, 2, 2
CFG = GPTConfig(vocab_size=VOCAB, context_length=CTX, emb_dim=EMB, n_layers=LAYERS, n_heads=HEADS)


def _openai_like_arrays() -> dict[str, np.ndarray]:
    """Random (never zero) values with OpenAI's names and shapes, incl. the leading singleton dim
    of the conv1d weights."""
    rng = np.random.default_rng(0)

    def rand(*shape):
        return (rng.uniform(0.1, 1.0, shape) * rng.choice([-1, 1], shape)).astype(np.float32)

    e = EMB
    arrays = {"model/wte": rand(VOCAB, e), "model/wpe": rand(CTX, e),
              "model/ln_f/g": rand(e), "model/ln_f/b": rand(e)}
    for i in range(LAYERS):
        h = f"model/h{i}/"
        arrays.update({h + "attn/c_attn/w": rand(1, e, 3 * e), h + "attn/c_attn/b": rand(3 * e),
                       h + "attn/c_proj/w": rand(1, e, e), h + "attn/c_proj/b": rand(e),
                       h + "mlp/c_fc/w": rand(1, e, 4 * e), h + "mlp/c_fc/b": rand(4 * e),
                       h + "mlp/c_proj/w": rand(1, 4 * e, e), h + "mlp/c_proj/b": rand(e),
                       h + "ln_1/g": rand(e), h + "ln_1/b": rand(e),
                       h + "ln_2/g": rand(e), h + "ln_2/b": rand(e)})
    return arrays


@pytest.fixture(scope="module")
def tf_ckpt(tmp_path_factory):
    """(folder, arrays): a TF1 Saver checkpoint, as OpenAI's files are, plus hparams.json."""
    tf = pytest.importorskip("tensorflow")
    arrays = _openai_like_arrays()
    hparams = {"n_vocab": VOCAB, "n_ctx": CTX, "n_embd": EMB, "n_head": HEADS, "n_layer": LAYERS}
    folder = write_tf_checkpoint(tmp_path_factory.mktemp("ckpt"), arrays, hparams)
    assert sorted(n for n, _ in tf.train.list_variables(str(folder / "model.ckpt"))) == sorted(arrays)
    return folder, arrays


@pytest.fixture
def ckpt_copy(tf_ckpt, tmp_path):
    """A private copy of the checkpoint folder, for tests that write or break files."""
    return shutil.copytree(tf_ckpt[0], tmp_path / "ckpt")


def _expected_state(arrays) -> dict[str, np.ndarray]:
    """The reference mapping, written out independently of the code under test."""
    e = EMB
    out = {"tok_emb.weight": arrays["model/wte"], "pos_emb.weight": arrays["model/wpe"],
           "final_norm.scale": arrays["model/ln_f/g"], "final_norm.shift": arrays["model/ln_f/b"],
           "out_head.weight": arrays["model/wte"]}
    for i in range(LAYERS):
        h, m = f"model/h{i}/", f"trf_blocks.{i}."
        w, b = arrays[h + "attn/c_attn/w"][0], arrays[h + "attn/c_attn/b"]
        for j, part in enumerate(["W_query", "W_key", "W_value"]):
            out[f"{m}att.{part}.weight"] = w[:, j * e:(j + 1) * e].T
            out[f"{m}att.{part}.bias"] = b[j * e:(j + 1) * e]
        for src, dst in [("attn/c_proj", "att.out_proj"), ("mlp/c_fc", "ff.layers.0"),
                         ("mlp/c_proj", "ff.layers.2")]:
            out[f"{m}{dst}.weight"] = arrays[h + src + "/w"][0].T
            out[f"{m}{dst}.bias"] = arrays[h + src + "/b"]
        for src, dst in [("ln_1", "norm1"), ("ln_2", "norm2")]:
            out[f"{m}{dst}.scale"] = arrays[h + src + "/g"]
            out[f"{m}{dst}.shift"] = arrays[h + src + "/b"]
    return out


def _assert_loaded(model, arrays):
    state = model.state_dict()
    expected = _expected_state(arrays)
    assert set(expected) == set(state)  # every parameter is covered by the mapping
    for name, value in expected.items():
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name], torch.from_numpy(np.ascontiguousarray(value))), name


def test_params_layout_matches_reference(tf_ckpt):
    folder, arrays = tf_ckpt
    settings, params = load_tf_checkpoint(folder)
    assert settings["n_embd"] == EMB and len(params["blocks"]) == LAYERS
    assert params["blocks"][1]["attn"]["c_attn"]["w"].shape == (EMB, 3 * EMB)  # singleton squeezed
    np.testing.assert_array_equal(params["blocks"][1]["mlp"]["c_proj"]["w"], arrays["model/h1/mlp/c_proj/w"][0])
    np.testing.assert_array_equal(params["g"], arrays["model/ln_f/g"])  # ln_f lands at top level
    np.testing.assert_array_equal(params["wte"], arrays["model/wte"])


def test_mapping_and_forward(tf_ckpt):
    folder, arrays = tf_ckpt
    _, params = load_tf_checkpoint(folder)
    torch.manual_seed(0)
    model = GPTModel(CFG)
    load_weights_into_gpt(model, params)
    _assert_loaded(model, arrays)
    assert model.out_head.weight is not model.tok_emb.weight  # tied by value, as in the reference
    logits = model(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))
    assert logits.shape == (2, 4, VOCAB) and torch.isfinite(logits).all()


@pytest.mark.parametrize("cfg, needle", [
    (GPTConfig(vocab_size=VOCAB, context_length=CTX, emb_dim=32, n_layers=LAYERS, n_heads=HEADS),
     "tok_emb.weight has shape (50, 32)"),
    (GPTConfig(vocab_size=VOCAB, context_length=8, emb_dim=EMB, n_layers=LAYERS, n_heads=HEADS),
     "pos_emb.weight has shape (8, 16)"),
    (GPTConfig(vocab_size=VOCAB, context_length=CTX, emb_dim=EMB, n_layers=3, n_heads=HEADS),
     "2 transformer blocks but the model has 3"),
])
def test_shape_mismatch_is_named(tf_ckpt, cfg, needle):
    _, params = load_tf_checkpoint(tf_ckpt[0])
    with pytest.raises(CheckpointError) as err:
        load_weights_into_gpt(GPTModel(cfg), params)
    assert needle in str(err.value) and "another model size" in str(err.value)
    if "tok_emb" in needle:
        assert "(50, 16)" in str(err.value)  # the checkpoint's shape too


def test_missing_folder_and_files(ckpt_copy, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist.*--weights-dir"):
        load_tf_checkpoint(tmp_path / "nowhere")
    (ckpt_copy / "model.ckpt.index").unlink()
    with pytest.raises(CheckpointError) as err:
        load_pretrained_into(GPTModel(CFG), ckpt_copy)
    msg = str(err.value)
    assert "model.ckpt.index" in msg and str(ckpt_copy) in msg and "delete" in msg


def test_unreadable_checkpoint(ckpt_copy):
    data = ckpt_copy / "model.ckpt.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:100])  # truncated weights
    with pytest.raises(CheckpointError, match="cannot read the TensorFlow checkpoint"):
        load_tf_checkpoint(ckpt_copy)
    (ckpt_copy / "hparams.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="hparams.json"):
        load_tf_checkpoint(ckpt_copy)


def test_converted_file_used_without_tensorflow(ckpt_copy, tf_ckpt, monkeypatch):
    first = GPTModel(CFG)
    settings = load_pretrained_into(first, ckpt_copy)
    assert settings["n_layer"] == LAYERS
    assert (ckpt_copy / CONVERTED_NAME).is_file()
    assert not [p for p in ckpt_copy.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # any `import tensorflow` now fails
    second = GPTModel(CFG)
    load_pretrained_into(second, ckpt_copy)
    _assert_loaded(second, tf_ckpt[1])
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    # without the converted file, the missing TensorFlow is reported with the fix
    (ckpt_copy / CONVERTED_NAME).unlink()
    with pytest.raises(CheckpointError, match="needs TensorFlow"):
        load_pretrained_into(GPTModel(CFG), ckpt_copy)


def test_corrupt_converted_file_is_rewritten(ckpt_copy, tf_ckpt):
    (ckpt_copy / CONVERTED_NAME).write_bytes(b"garbage, not a torch file")
    model = GPTModel(CFG)
    with pytest.warns(RuntimeWarning, match="unreadable") as record:
        load_pretrained_into(model, ckpt_copy)
    assert len(record) == 1
    _assert_loaded(model, tf_ckpt[1])
    payload = torch.load(ckpt_copy / CONVERTED_NAME, weights_only=True, map_location="cpu")
    assert payload["tensors"]["h0/attn/c_attn/w"].shape == (EMB, 3 * EMB)


def test_converted_file_alone_suffices(ckpt_copy, tf_ckpt):
    weights.convert_checkpoint(ckpt_copy)
    for name in ("model.ckpt.index", "model.ckpt.data-00000-of-00001"):
        (ckpt_copy / name).unlink()  # e.g. TF files deleted to save space
    model = GPTModel(CFG)
    load_pretrained_into(model, ckpt_copy)
    _assert_loaded(model, tf_ckpt[1])


def test_no_converted_file_is_written_for_a_checkpoint_that_does_not_fit(ckpt_copy):
    wider = GPTConfig(vocab_size=VOCAB, context_length=CTX, emb_dim=2 * EMB, n_layers=LAYERS, n_heads=HEADS)
    with pytest.raises(CheckpointError, match="another model size"):
        load_pretrained_into(GPTModel(wider), ckpt_copy)
    assert not (ckpt_copy / CONVERTED_NAME).exists()  # checked first, converted only once it fits


def _crafted(folder, *, n_blocks, tensors=None, n_layer=LAYERS):
    """A converted-file header as a hostile or damaged copy may declare it (stub TF files, so the
    header's fingerprint matches)."""
    folder.mkdir(exist_ok=True)
    (folder / "hparams.json").write_text(json.dumps({"n_head": HEADS, "n_layer": n_layer}))
    for name in ("model.ckpt.index", "model.ckpt.data-00000-of-00001"):
        (folder / name).write_bytes(b"x")
    torch.save({"format": 1, "settings": {"n_head": HEADS, "n_layer": n_layer},
                "source": {"model.ckpt.index": 1, "model.ckpt.data-00000-of-00001": 1},
                "n_blocks": n_blocks, "tensors": tensors or {}}, folder / CONVERTED_NAME)


def test_a_converted_header_declaring_a_billion_blocks_is_refused_before_allocating(tmp_path):
    import tracemalloc

    _crafted(tmp_path / "w", n_blocks=10**9)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="declares 1000000000 transformer blocks but the model has 2"):
            load_pretrained_into(GPTModel(CFG), tmp_path / "w")
        assert tracemalloc.get_traced_memory()[1] < 50 << 20
    finally:
        tracemalloc.stop()


def test_block_names_beyond_the_declared_count_are_refused(tmp_path):
    _crafted(tmp_path / "w", n_blocks=LAYERS, tensors={"h999999/ln_1/g": torch.ones(EMB)})
    with pytest.raises(CheckpointError, match="belongs to block 999999, but the checkpoint declares 2 blocks"):
        load_pretrained_into(GPTModel(CFG), tmp_path / "w")


def test_hparams_declaring_other_block_counts_are_refused_before_reading(tmp_path, monkeypatch):
    _crafted(tmp_path / "w", n_blocks=LAYERS, n_layer=10**9)
    (tmp_path / "w" / CONVERTED_NAME).unlink()
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # refused before TensorFlow would be needed
    with pytest.raises(CheckpointError, match="declares 1000000000 transformer blocks but the model has 2"):
        load_pretrained_into(GPTModel(CFG), tmp_path / "w")


# --- ensure_checkpoint against a local server -------------------------------------------------

@pytest.fixture
def mirror(monkeypatch, http_server):
    """A server holding a fake 124M tree under /mirror; the tokenizer hashes pinned to its files."""
    tree = {name: f"fake {name} ".encode() * 50 for name in CHECKPOINT_FILES}
    http_server.routes.update({f"/mirror/124M/{n}": ("ok", b) for n, b in tree.items()})
    monkeypatch.setattr(weights, "KNOWN_SHA256", {n: hashlib.sha256(tree[n]).hexdigest()
                                                  for n in ("vocab.bpe", "encoder.json")})
    return http_server.url, tree, http_server


@pytest.mark.parametrize("primary", ["dead", "404"])
def test_ensure_checkpoint_falls_back(mirror, tmp_path, primary):
    url, tree, handler = mirror
    first = refused_url("/models") if primary == "dead" else url + "/models"
    folder = ensure_checkpoint("gpt2-small (124M)", cache_dir=tmp_path, base_urls=[first, url + "/mirror"],
                               progress=False)
    assert folder == tmp_path / "gpt2" / "124M"
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == tree
    assert sum(handler.hits.values()) == (7 if primary == "dead" else 14)
    handler.hits.clear()
    ensure_checkpoint("124M", cache_dir=tmp_path, base_urls=[first, url + "/mirror"], progress=False)
    assert sum(handler.hits.values()) == 0  # complete: no request at all


def test_ensure_checkpoint_rejects_wrong_tokenizer_file(mirror, tmp_path, monkeypatch):
    url, _, _ = mirror
    monkeypatch.setitem(weights.KNOWN_SHA256, "vocab.bpe", "0" * 64)
    with pytest.raises(DownloadError) as err:
        ensure_checkpoint("124M", cache_dir=tmp_path, base_urls=[url + "/mirror"], progress=False)
    assert "vocab.bpe" in str(err.value) and "--weights-dir" in str(err.value)
    assert not (tmp_path / "gpt2" / "124M" / "vocab.bpe").exists()


def test_ensure_checkpoint_unknown_size_and_cache_dir(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="'tiny'"):
        ensure_checkpoint("tiny", cache_dir=tmp_path)
    monkeypatch.setenv("LORA_BENCH_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("LORA_BENCH_CACHE")
    assert default_cache_dir().parts[-2:] == (".cache", "lora-bench")


MALFORMED_SETTINGS = {
    "a list": (b"[12, 4]", "not an object"),
    "a string": (b'"n_layer"', "not an object"),
    "Infinity": (b'{"n_layer": Infinity}', "Infinity"),
    "NaN": (b'{"n_layer": 2, "n_head": NaN}', "NaN"),
    "text for a number": (b'{"n_layer": "2"}', "n_layer='2'"),
    "a fraction": (b'{"n_layer": 2, "n_head": 1.5}', "n_head=1.5"),
    "a boolean": (b'{"n_layer": true}', "n_layer=True"),
    "negative": (b'{"n_layer": -2}', "n_layer=-2"),
    "binary": (b"\xff\xfe\x00garbage", "cannot read"),
    "not JSON": (b"{n_layer: 2", "not JSON"),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED_SETTINGS))
def test_malformed_hparams_are_one_clear_error(kind, tmp_path, monkeypatch):
    blob, needle = MALFORMED_SETTINGS[kind]
    _crafted(tmp_path / "w", n_blocks=LAYERS)
    (tmp_path / "w" / CONVERTED_NAME).unlink()
    (tmp_path / "w" / "hparams.json").write_bytes(blob)
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # refused before TensorFlow would be needed
    with pytest.raises(CheckpointError) as err:
        load_pretrained_into(GPTModel(CFG), tmp_path / "w")
    assert str(tmp_path / "w" / "hparams.json") in str(err.value) and needle in str(err.value), str(err.value)


# --- hostile metadata: bounded and checked before anything is allocated from it ---------------

def test_an_oversized_or_foreign_hparams_json_is_refused(ckpt_copy):
    path = ckpt_copy / "hparams.json"
    with open(path, "wb") as f:
        f.truncate(2 * 2**30)  # holes: no disk space
    with pytest.raises(CheckpointError, match=r"2,147,483,648 bytes, more than the 65,536 an hparams.json may have"):
        load_pretrained_into(GPTModel(CFG), ckpt_copy)
    path.write_text("[1, 2, 3]")
    with pytest.raises(CheckpointError, match="not an object of settings"):
        load_pretrained_into(GPTModel(CFG), ckpt_copy)


@pytest.mark.parametrize("key, value, needle", [
    ("n_layer", 10**5, "n_layer=100000; lora-bench reads 0 to 2,048 blocks"),
    ("n_embd", 10**9, "n_embd=1000000000; lora-bench reads 1 to 65,536"),
    ("n_vocab", "50257" * 1000, "n_vocab='50257502575025750257"),
])
def test_hparams_read_without_a_model_are_bounded(ckpt_copy, key, value, needle):
    """Without a model to compare with, the sizes hparams.json declares are bounded, and a value is
    quoted cut short."""
    hparams = {"n_vocab": VOCAB, "n_ctx": CTX, "n_embd": EMB, "n_head": HEADS, "n_layer": LAYERS, key: value}
    (ckpt_copy / "hparams.json").write_text(json.dumps(hparams))
    with pytest.raises(CheckpointError) as err:
        load_tf_checkpoint(ckpt_copy)
    assert needle in str(err.value) and len(str(err.value)) < 400, str(err.value)


def test_an_oversized_index_is_refused_before_tensorflow_reads_it(ckpt_copy, monkeypatch):
    with open(ckpt_copy / "model.ckpt.index", "r+b") as f:
        f.truncate(100 << 20)
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # refused before TensorFlow would be needed
    with pytest.raises(CheckpointError, match=r"104,857,600 bytes, more than the 67,108,864 a GPT-2 index"):
        load_pretrained_into(GPTModel(CFG), ckpt_copy)


@pytest.mark.parametrize("change, needle", [
    ({"model/wte": np.ones((VOCAB, EMB + 1), np.float32)},
     "model/wte declares shape (50, 17) but the model needs (50, 16): the checkpoint is for another model size"),
    ({"model/h0/attn/c_attn/w": np.ones((1, EMB, 3 * EMB + 3), np.float32)}, "declares shape (1, 16, 51)"),
    ({"model/h1/mlp/extra": np.ones((4, 4), np.float32)}, "holds variable 'model/h1/mlp/extra', which GPT-2 does not have"),
])
def test_variables_the_model_does_not_have_are_refused_before_any_is_read(tmp_path, monkeypatch, change, needle):
    """The index's variables and shapes are compared with the model's first: TensorFlow allocates
    what a variable declares, so none is read from a checkpoint that does not fit."""
    tf = pytest.importorskip("tensorflow")
    hparams = {"n_vocab": VOCAB, "n_ctx": CTX, "n_embd": EMB, "n_head": HEADS, "n_layer": LAYERS}
    folder = write_tf_checkpoint(tmp_path, {**_openai_like_arrays(), **change}, hparams)
    reads = []
    real = tf.train.load_variable
    monkeypatch.setattr(tf.train, "load_variable", lambda *a, **k: reads.append(a[1]) or real(*a, **k))
    with pytest.raises(CheckpointError) as err:
        load_pretrained_into(GPTModel(CFG), folder)
    assert needle in str(err.value), str(err.value)
    assert reads == []


def test_json_nested_thousands_deep_is_a_checkpoint_error(ckpt_copy):
    (ckpt_copy / "hparams.json").write_text("[" * 30_000 + "]" * 30_000)  # 60 KB: within the size limit
    with pytest.raises(CheckpointError, match="cannot read .*hparams.json"):
        load_pretrained_into(GPTModel(CFG), ckpt_copy)
