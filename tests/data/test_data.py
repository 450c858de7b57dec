"""The reference's data pipeline: parsing quirk, balance, split hashes, tokenizer, datasets."""

from __future__ import annotations

import hashlib

import pandas as pd
import pytest

from lora_bench.data.sms_spam import balance_and_split, build_loaders, prepare_splits, read_raw
from lora_bench.data.tokenizer import ENCODER_JSON_SHA256, VOCAB_BPE_SHA256, bpe_files, gpt2_tokenizer, sha256_file
from lora_bench.errors import DataError, UsageError

SPLIT_SHA256 = {
    "train": "ec2895b026553ce06475815818c52cf44828af0605b07b257935a194e611195a",
    "validation": "f92996ef2ae2ed6d6937e96bc7a3f739f2bae59b07d1babd7f3725e473f2d2bd",
    "test": "f82216f37a6d785b52f99a84a3552dcc9835316018758c2117b2ca133e6c1409",
}


def test_raw_parse_keeps_the_quote_quirk(sms_file):
    df = read_raw(sms_file)
    assert len(df) == 5572  # 5,574 lines: two quotes swallow line breaks
    assert df["Label"].value_counts().to_dict() == {"ham": 4825, "spam": 747}


def test_split_sizes_and_first_rows(sms_file):
    train, val, test = balance_and_split(read_raw(sms_file))
    assert (len(train), len(val), len(test)) == (1045, 149, 300)
    assert len(train) + len(val) + len(test) == 2 * 747
    # the first rows of the reference's train.csv, validation.csv and test.csv
    assert train.iloc[0]["Label"] == 0
    assert train.iloc[0]["Text"].startswith("Leave it wif me lar...")
    assert train.iloc[1]["Label"] == 1 and train.iloc[1]["Text"].startswith("Enjoy the jamster videosound")
    assert val.iloc[0]["Text"].startswith("Free entry in 2 a wkly comp")
    assert test.iloc[0]["Text"].startswith("Congrats! 2 mobile 3G Videophones")


def test_prepare_reproduces_reference_hashes(sms_file, tmp_path):
    paths = prepare_splits(sms_file, tmp_path)
    for name, path in paths.items():
        assert sha256_file(path) == SPLIT_SHA256[name], name
    assert not list(tmp_path.glob("*.tmp"))


def test_cli_data_prepare(sms_file, tmp_path, run_cli):
    code, out = run_cli("data", "prepare", "--data-file", str(sms_file), "--out", str(tmp_path / "d"))
    assert code == 0
    for name, digest in SPLIT_SHA256.items():
        assert digest in out
        assert hashlib.sha256((tmp_path / "d" / f"{name}.csv").read_bytes()).hexdigest() == digest


def test_tokenizer_offline_and_exact():
    vocab, encoder = bpe_files()
    assert sha256_file(vocab) == VOCAB_BPE_SHA256 and sha256_file(encoder) == ENCODER_JSON_SHA256
    tok = gpt2_tokenizer()
    assert tok.n_vocab == 50257
    assert tok.encode("Hello, world!") == [15496, 11, 995, 0]
    assert tok.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert tok.decode(tok.encode("Free entry in 2 a wkly comp")) == "Free entry in 2 a wkly comp"


def test_tokenizer_rejects_wrong_files(tmp_path):
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\n")
    (tmp_path / "encoder.json").write_text("{}")
    with pytest.raises(DataError, match="sha256"):
        bpe_files(tmp_path)


def test_datasets_and_loaders(sms_file, tmp_path):
    splits = prepare_splits(sms_file, tmp_path)
    tok = gpt2_tokenizer()
    ld = build_loaders(splits, tok, context_length="longest_training_example", model_context=1024,
                       batch_size=8, no_padding=False)
    assert ld.max_length == 120
    assert (len(ld.train), len(ld.val), len(ld.test)) == (130, 19, 38)  # drop_last on train only
    x, y = ld.val.dataset[0]
    assert x.shape == (120,) and x.dtype.is_floating_point is False
    assert (ld.test.dataset[0][0].shape == (120,))
    ld2 = build_loaders(splits, tok, context_length="model_context_length", model_context=1024,
                        batch_size=8, no_padding=False)
    assert ld2.train.dataset[0][0].shape == (1024,) and ld2.val.dataset[0][0].shape == (1024,)
    ld3 = build_loaders(splits, tok, context_length="longest_training_example", model_context=1024,
                        batch_size=1, no_padding=True)
    lengths = {len(t) for t in ld3.train.dataset.encoded_texts}
    assert len(lengths) > 10 and max(lengths) == 120 and 50256 not in ld3.train.dataset.encoded_texts[0]
    with pytest.raises(UsageError, match="exceeds the model's context length 1024"):
        build_loaders(splits, tok, context_length="2048", model_context=1024, batch_size=8, no_padding=False)


def test_missing_and_malformed_data_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_raw(tmp_path / "nope.tsv")
    bad = tmp_path / "bad.tsv"
    bad.write_text("a\tb\nc\td\n" * 20)
    with pytest.raises(DataError, match="does not look like"):
        read_raw(bad)
    assert isinstance(pd.DataFrame(), pd.DataFrame)
