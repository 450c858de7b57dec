"""The SMS Spam Collection is verified wherever it comes from (download, cache, the copy shipped
with the package); archives are extracted under a size cap; corpora the reference split cannot
use are refused with one message; `data prepare` leaves nothing behind when it fails."""

from __future__ import annotations

import io
import struct
import time
import zipfile
from pathlib import Path

import pytest
from conftest import refused_url

from lora_bench.data import sms_spam
from lora_bench.data.sms_spam import (
    MIN_SPAM,
    PACKAGED_CORPUS,
    SMS_SHA256,
    SMS_SIZE,
    cached_splits,
    corpus_problem,
    ensure_sms_spam,
    packaged_sms_spam,
)
from lora_bench.data.tokenizer import sha256_file
from lora_bench.download import safe_extract_zip
from lora_bench.errors import DataError, DownloadError
from paths import FIXTURES

SAMPLE = FIXTURES / "sms_spam_sample.tsv"
TINY = ["--model-size", "tiny", "--weights", "random", "--device", "cpu", "--no-progress", "--max-steps", "2",
        "--warmup-steps", "1", "--eval-freq", "0", "--skip-final-eval"]


def _zip(member: bytes, name: str = "SMSSpamCollection") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(name, member)
    return buf.getvalue()


def _offline(monkeypatch):
    monkeypatch.setattr(sms_spam, "SMS_URLS", [refused_url("/a.zip"), refused_url("/b.zip")])


def test_the_shipped_corpus_is_the_corpus():
    assert PACKAGED_CORPUS.stat().st_size == SMS_SIZE and sha256_file(PACKAGED_CORPUS) == SMS_SHA256
    assert "CC BY 4.0" in PACKAGED_CORPUS.with_name("SMSSpamCollection.LICENSE").read_text()


def test_train_and_prepare_use_the_shipped_copy_and_download_only_when_asked(tmp_path, http_server, monkeypatch,
                                                                              run_cli):
    corpus = PACKAGED_CORPUS.read_bytes()
    http_server.routes["/sms.zip"] = ("ok", _zip(corpus))
    monkeypatch.setattr(sms_spam, "SMS_URLS", [http_server.url + "/sms.zip"])
    code, out = run_cli("train", *TINY, "--cache-dir", tmp_path / "cache", "--results-dir", tmp_path / "r")
    assert code == 0 and "download" not in out, out
    code, out = run_cli("data", "prepare", "--output", tmp_path / "shipped", "--cache-dir", tmp_path / "cache")
    assert code == 0 and "download" not in out and http_server.hits["/sms.zip"] == 0, out
    code, out = run_cli("data", "prepare", "--output", tmp_path / "fetched", "--download",
                        "--cache-dir", tmp_path / "cache", "--no-progress")
    assert code == 0 and http_server.hits["/sms.zip"] == 1, out
    assert corpus_problem(tmp_path / "cache" / "sms_spam" / "SMSSpamCollection.tsv") is None
    for name in sms_spam.SPLIT_FILES:
        assert (tmp_path / "fetched" / name).read_bytes() == (tmp_path / "shipped" / name).read_bytes()


def test_an_asked_download_that_cannot_be_done_says_so(tmp_path, monkeypatch, run_cli):
    _offline(monkeypatch)
    code, out = run_cli("data", "prepare", "--output", tmp_path / "s", "--download", "--cache-dir", tmp_path / "c",
                        "--no-progress")
    assert code != 0 and "Traceback" not in out and "could not download SMS Spam Collection" in out, out
    assert "leave out --download" in out or "--data-file" in out, out
    assert not (tmp_path / "s").exists()


def test_a_damaged_shipped_copy_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "SMSSpamCollection.tsv"
    bad.write_bytes(PACKAGED_CORPUS.read_bytes()[:1000])
    monkeypatch.setattr(sms_spam, "PACKAGED_CORPUS", bad)
    with pytest.raises(DataError, match="is damaged: it has 1,000 bytes"):
        packaged_sms_spam()


def test_a_partial_corpus_in_the_cache_is_fetched_again(tmp_path, http_server, monkeypatch):
    corpus = PACKAGED_CORPUS.read_bytes()
    http_server.routes["/sms.zip"] = ("ok", _zip(corpus))
    monkeypatch.setattr(sms_spam, "SMS_URLS", [http_server.url + "/sms.zip"])
    folder = tmp_path / "sms_spam"
    folder.mkdir()
    (folder / "SMSSpamCollection.tsv").write_bytes(corpus[: len(corpus) // 3])  # a cut copy
    (folder / "sms_spam_collection.zip").write_bytes(_zip(corpus[: len(corpus) // 3]))  # and a cut archive
    got = ensure_sms_spam(tmp_path, progress=False)
    assert got == folder / "SMSSpamCollection.tsv" and corpus_problem(got) is None
    assert http_server.hits["/sms.zip"] == 1  # the cached archive failed verification: fetched again


def test_a_mirror_serving_another_file_is_not_used(tmp_path, http_server, monkeypatch):
    http_server.routes["/sms.zip"] = ("ok", _zip(b"ham\thello\n" * 100))
    monkeypatch.setattr(sms_spam, "SMS_URLS", [http_server.url + "/sms.zip"])
    with pytest.raises(DownloadError, match="not the corpus.*1,000 bytes"):
        ensure_sms_spam(tmp_path, progress=False)
    assert not (tmp_path / "sms_spam" / "SMSSpamCollection.tsv").exists()


def test_a_zip_bomb_in_the_cache_is_not_extracted(tmp_path, monkeypatch):
    _offline(monkeypatch)
    folder = tmp_path / "sms_spam"
    folder.mkdir()
    (folder / "sms_spam_collection.zip").write_bytes(_zip(b"\0" * (64 << 20)))  # 64 MiB from ~64 KiB
    refused = []

    def spy(*args, **kw):
        try:
            return safe_extract_zip(*args, **kw)
        except DataError as e:
            refused.append(str(e))
            raise

    monkeypatch.setattr(sms_spam, "safe_extract_zip", spy)
    with pytest.raises(DownloadError):  # offline: the bomb is refused, then no download can replace it
        ensure_sms_spam(tmp_path, progress=False)
    assert len(refused) == 1 and "expands to 67,108,864 bytes, more than the" in refused[0]  # before writing
    assert not (folder / "sms_spam_collection.zip").exists()  # and the bomb is gone from the cache
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_extraction_cap_holds_against_a_lying_header(tmp_path):
    blob = bytearray(_zip(b"x" * 100_000))
    # claim 100 bytes in both the local and the central header; the data stays 100,000 bytes
    struct.pack_into("<I", blob, blob.index(b"PK\x03\x04") + 22, 100)
    struct.pack_into("<I", blob, blob.index(b"PK\x01\x02") + 24, 100)
    (tmp_path / "lie.zip").write_bytes(bytes(blob))
    with pytest.raises(DataError):
        safe_extract_zip(tmp_path / "lie.zip", tmp_path / "out", max_bytes=1000)
    assert not (tmp_path / "out" / "SMSSpamCollection").exists()
    (tmp_path / "big.zip").write_bytes(_zip(b"x" * 5000))
    with pytest.raises(DataError, match="expands to 5,000 bytes, more than the 1,000 expected"):
        safe_extract_zip(tmp_path / "big.zip", tmp_path / "out", max_bytes=1000)


def test_altered_cached_splits_are_prepared_again(tmp_path):
    first = cached_splits(SAMPLE, tmp_path)
    good = first["train"].read_bytes()
    first["train"].write_bytes(good[: len(good) // 2])
    again = cached_splits(SAMPLE, tmp_path)
    assert again["train"].read_bytes() == good


def _corpus(tmp_path: Path, name: str, lines: list[str]) -> Path:
    path = tmp_path / f"{name}.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def degenerate(tmp_path) -> dict[str, Path]:
    lines = SAMPLE.read_text().splitlines()
    ham = [x for x in lines if x.startswith("ham\t")]
    spam = [x for x in lines if x.startswith("spam\t")]
    return {
        "only-ham": _corpus(tmp_path, "only-ham", ham),
        "only-spam": _corpus(tmp_path, "only-spam", spam),
        "few-spam": _corpus(tmp_path, "few-spam", ham[:16] + spam[:MIN_SPAM - 1]),  # a 20-line corpus
        "more-spam-than-ham": _corpus(tmp_path, "more-spam", ham[:6] + spam[:10]),
    }


@pytest.mark.parametrize("name", ["only-ham", "only-spam", "few-spam", "more-spam-than-ham"])
def test_corpora_the_reference_split_cannot_use_are_refused(name, degenerate, tmp_path, run_cli):
    code, out = run_cli("train", *TINY, "--data-file", degenerate[name], "--results-dir", tmp_path / "r",
                        "--cache-dir", tmp_path / "c")
    assert code == 2 and "Traceback" not in out, out
    assert f"at least {MIN_SPAM} spam messages and at least as many ham as spam" in out
    code, out = run_cli("data", "prepare", "--out", tmp_path / "splits", "--data-file", degenerate[name])
    assert code == 2 and "the reference split needs" in out, out
    assert not (tmp_path / "splits").exists()  # no empty output folder


def test_messages_without_text_are_refused(tmp_path, run_cli):
    path = tmp_path / "empty.tsv"
    path.write_text("".join("spam\t\n" if i % 2 else "ham\t \n" for i in range(40)))
    code, out = run_cli("data", "prepare", "--out", tmp_path / "splits", "--data-file", path)
    assert code == 2 and "40 of 40 messages have no text" in out and "Traceback" not in out, out
    assert not (tmp_path / "splits").exists()


def test_a_training_split_smaller_than_a_batch_is_refused(tmp_path, run_cli):
    lines = SAMPLE.read_text().splitlines()
    path = _corpus(tmp_path, "small", [x for x in lines if x.startswith("ham\t")][:6]
                   + [x for x in lines if x.startswith("spam\t")][:6])
    code, out = run_cli("train", *TINY, "--data-file", path, "--results-dir", tmp_path / "r",
                        "--cache-dir", tmp_path / "c", "--batch-size", "16")
    assert code == 2 and "fewer than batch_size=16" in out and "Traceback" not in out, out


def test_data_prepare_out_naming_a_file(tmp_path, run_cli):
    (tmp_path / "a-file").write_text("x")
    code, out = run_cli("data", "prepare", "--out", tmp_path / "a-file", "--data-file", SAMPLE)
    assert code == 2 and "a file is in the way" in out and "Traceback" not in out, out
    assert (tmp_path / "a-file").read_text() == "x"


def _other_corpus(tmp_path: Path) -> Path:
    """A second usable corpus: the sample with its messages in another order (other splits)."""
    lines = SAMPLE.read_text().splitlines()
    return _corpus(tmp_path, "other", lines[::-1])


def test_the_cached_splits_are_those_of_the_bytes_hashed(tmp_path, monkeypatch):
    """A data file replaced while its splits are prepared: the cache entry named after the bytes
    that were hashed holds those bytes' splits, never the replacement's."""
    raw = tmp_path / "data.tsv"
    raw.write_bytes(SAMPLE.read_bytes())
    other = _other_corpus(tmp_path)
    want = {k: p.read_bytes() for k, p in cached_splits(SAMPLE, tmp_path / "clean").items()}
    real = sms_spam.pd.read_csv

    def swap_then_read(*args, **kw):
        raw.write_bytes(other.read_bytes())  # replaced between the hash and the parse
        return real(*args, **kw)

    monkeypatch.setattr(sms_spam.pd, "read_csv", swap_then_read)
    got = cached_splits(raw, tmp_path / "cache")
    monkeypatch.undo()
    assert {k: p.read_bytes() for k, p in got.items()} == want
    raw.write_bytes(SAMPLE.read_bytes())
    assert {k: p.read_bytes() for k, p in cached_splits(raw, tmp_path / "cache").items()} == want


@pytest.mark.parametrize("manifest", ["without its source", "naming another source"])
def test_a_cache_entry_holding_another_files_splits_is_prepared_again(manifest, tmp_path):
    other = _other_corpus(tmp_path)
    good = {k: p.read_bytes() for k, p in cached_splits(SAMPLE, tmp_path / "clean").items()}
    entry = cached_splits(SAMPLE, tmp_path / "cache")["train"].parent
    for name, path in cached_splits(other, tmp_path / "other").items():  # poison: the other file's splits
        (entry / path.name).write_bytes(path.read_bytes())
    hashes = {f: sha256_file(entry / f) for f in sms_spam.SPLIT_FILES}
    if manifest == "naming another source":
        hashes["source_sha256"] = sha256_file(other)
    (entry / sms_spam.SPLITS_MANIFEST).write_text(__import__("json").dumps(hashes))
    again = cached_splits(SAMPLE, tmp_path / "cache")
    assert {k: p.read_bytes() for k, p in again.items()} == good


def test_a_message_pandas_reads_as_missing_is_named_as_such(tmp_path, run_cli):
    """``NA`` (and pandas' other missing-value markers) is no text for the reference's read_csv
    too: refused, and the message says why rather than claiming the line is empty."""
    lines = SAMPLE.read_text().splitlines()
    path = _corpus(tmp_path, "na", lines[:5] + ["ham\tNA", "spam\tnull"] + lines[5:])
    assert sms_spam.pd.read_csv(path, sep="\t", header=None, names=["Label", "Text"])["Text"].isna().sum() == 2
    code, out = run_cli("data", "prepare", "--out", tmp_path / "splits", "--data-file", path)
    assert code == 2 and "Traceback" not in out, out
    assert "2 of" in out and "(messages 6, 7)" in out and "'NA', 'null' read as a missing value" in out, out
    assert "read_csv" in out and "reference" in out


def test_a_special_token_in_a_message_is_named_with_its_message(tmp_path, run_cli):
    """tiktoken's encode refuses special tokens in text, in the reference as here: one message
    naming the split file, the message and the token, instead of tiktoken's traceback."""
    lines = SAMPLE.read_text().splitlines()
    first_spam = next(i for i, x in enumerate(lines) if x.startswith("spam\t"))  # every spam message is kept
    path = _corpus(tmp_path, "special", [x.replace("\t", "\tsee <|endoftext|> ", 1) if i == first_spam else x
                                         for i, x in enumerate(lines)])
    code, out = run_cli("train", *TINY, "--data-file", path, "--results-dir", tmp_path / "r",
                        "--cache-dir", tmp_path / "c")
    assert code == 2 and "Traceback" not in out, out
    assert "'<|endoftext|>'" in out and "special token" in out and "tiktoken" in out and ".csv" in out, out


def test_a_data_file_past_the_size_limit_is_refused_unread(tmp_path, run_cli):
    """The data file's size is checked before it is read (a 3 GB file was read whole, then killed
    for memory), and the message names the limit."""
    path = tmp_path / "big.tsv"
    with open(path, "wb") as f:
        f.write(b"ham\thello\n")
        f.truncate(40 * 2**20)  # holes: no disk space used
    with pytest.raises(DataError, match=r"41,943,040 bytes; a data file may hold at most 16,777,216"):
        sms_spam.read_raw(path)
    with open(path, "r+b") as f:
        f.truncate(3 * 2**30)
    t0 = time.monotonic()
    code, out = run_cli("train", *TINY, "--data-file", path, "--results-dir", tmp_path / "r", "--cache-dir",
                        tmp_path / "c")
    assert code == 2 and "3,221,225,472 bytes" in out and "at most 16,777,216" in out and "Traceback" not in out, out
    code, out = run_cli("data", "prepare", "--out", tmp_path / "splits", "--data-file", path)
    assert code == 2 and "3,221,225,472 bytes" in out, out
    assert time.monotonic() - t0 < 20 and not (tmp_path / "r").exists()


def test_a_file_that_is_not_the_corpus_is_not_quoted(tmp_path, run_cli):
    """A file given as data by mistake (here shaped like a password file) is refused without its
    content in the message."""
    path = tmp_path / "shadow"
    path.write_text("".join(f"user{i}:$6$secretsalt$hashhashhash{i}:19000:0:99999:7:::\n" for i in range(30)))
    code, out = run_cli("data", "prepare", "--out", tmp_path / "splits", "--data-file", path)
    assert code == 2 and "does not look like the SMS Spam Collection" in out, out
    assert "secret" not in out and "user" not in out, out


def test_many_texts_padded_to_one_long_text_are_refused_before_padding(tmp_path, monkeypatch, run_cli):
    """Short texts and one long one: every text would be padded to the long one's length. The limit
    is lowered here so that a small file shows it; the real one is 50 times the corpus at the
    model's whole context."""
    monkeypatch.setattr(sms_spam, "MAX_PADDED_TOKENS", 20_000)
    lines = [f"{'spam' if i % 2 else 'ham'}\tmessage {i}" for i in range(400)]
    lines += [f"{label}\t" + "word " * 900 for label in ("ham", "spam") * 5]  # some land in the training split
    path = tmp_path / "long.tsv"
    path.write_text("\n".join(lines) + "\n")
    code, out = run_cli("train", *TINY, "--data-file", path, "--results-dir", tmp_path / "r", "--cache-dir",
                        tmp_path / "c")
    assert code == 2 and "Traceback" not in out, out
    assert "texts padded to" in out and "more than 20,000" in out and "--context-length" in out, out
