"""SMS Spam Collection: fetch, verify, balance and split exactly as the reference, the token
datasets and the loaders (whose RNG use is part of the reproducible sequence).

The corpus is Almeida & Gómez Hidalgo, "SMS Spam Collection" (2011), UCI Machine Learning
Repository dataset 228, https://doi.org/10.24432/C5CC84, licensed CC BY 4.0. A copy ships with
lora-bench (``SMSSpamCollection.tsv`` beside this module, see ``SMSSpamCollection.LICENSE``) and is
what runs use unless given a data file: nothing is downloaded unless asked (``ensure_sms_spam``).
Every copy, downloaded, cached or shipped, is checked against the known size and sha256 before use."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset

from lora_bench.data.tokenizer import PAD_TOKEN_ID, sha256_file
from lora_bench.download import download_file, safe_extract_zip
from lora_bench.errors import DataError, DownloadError, UsageError
from lora_bench.fileio import (TooLarge, atomic_write_text, check_writable_dir, not_a_file, parse_json, publish,
                               read_capped, refusing)

SMS_URLS = [
    "https://archive.ics.uci.edu/static/public/228/sms+spam+collection.zip",
    "https://f001.backblazeb2.com/file/LLMs-from-scratch/sms%2Bspam%2Bcollection.zip",
]
SMS_MEMBER = "SMSSpamCollection"
SMS_SIZE = 477_907
SMS_SHA256 = "7d039a24a6083ed9ef0f806ebad56bbb976e3aeb8de05669173bfdc4996c239d"
SMS_EXTRACT_CAP = 4 * SMS_SIZE  # a larger archive member is refused before it is written (zip bombs)
PACKAGED_CORPUS = Path(__file__).with_name("SMSSpamCollection.tsv")
SPLIT_FILES = ("train.csv", "validation.csv", "test.csv")
SPLITS_MANIFEST = "sha256.json"  # the splits' hashes and their source's, written with them, checked on reuse
MAX_SPLITS_MANIFEST_BYTES = 1 << 16  # four hashes
SOURCE_KEY = "source_sha256"
# A data file is refused past this size before it is read: 35 times the corpus (0.48 MB), room for a
# corpus of the same kind many times larger, while the file, its pandas frame and its tokens (Python
# ints, about ten times the file's bytes) stay within a few hundred MB on any machine that trains GPT-2.
MAX_DATA_BYTES = 16 * 2**20
# Tokens of a split once every text is padded to the same length: 50 times the corpus's training
# split at the model's whole context (1,045 texts × 1,024 tokens), about 400 MB of token lists. A
# file within MAX_DATA_BYTES of many short texts and one long one would otherwise pad to many GB.
MAX_PADDED_TOKENS = 50_000_000
# The reference balances by sampling as many ham as there are spam messages, then splits 70/10/20
# with int() rounding: the validation split gets a message only from 10 balanced messages on.
MIN_SPAM = 5


def corpus_problem(path: Path) -> str | None:
    """Why ``path`` is not the SMS Spam Collection's TSV byte for byte (size, then sha256), or None."""
    try:
        size = Path(path).stat().st_size
    except OSError as e:
        return f"cannot read it ({e.strerror or e})"
    if size != SMS_SIZE:
        return f"it has {size:,} bytes, the corpus has {SMS_SIZE:,}"
    digest = sha256_file(path)
    if digest != SMS_SHA256:
        return f"its sha256 is {digest}, the corpus's is {SMS_SHA256}"
    return None


def packaged_sms_spam() -> Path:
    """The copy shipped with lora-bench, verified."""
    why = corpus_problem(PACKAGED_CORPUS)
    if why:
        raise DataError(f"the SMS Spam Collection shipped with lora-bench ({PACKAGED_CORPUS}) is damaged: {why}; "
                        "reinstall lora-bench or pass --data-file")
    return PACKAGED_CORPUS


def ensure_sms_spam(cache_dir: Path, *, progress: bool = True, urls: list[str] | None = None) -> Path:
    """The raw TSV downloaded from the corpus's publishers (primary, then fallback URL), verified,
    in ``cache_dir``: only when asked (``data prepare --download``); every other command uses the
    copy shipped with lora-bench, which is the same file byte for byte (``packaged_sms_spam``). A
    cached copy that fails verification (a partial file) is fetched again; DownloadError when no
    URL gives the corpus."""
    folder = Path(cache_dir) / "sms_spam"
    tsv = folder / "SMSSpamCollection.tsv"
    if tsv.is_file():
        if corpus_problem(tsv) is None:
            return tsv
        tsv.unlink()  # a partial or altered corpus: never used, fetched again
    why = check_writable_dir(folder)
    if why:
        raise UsageError(f"cache folder {folder}: {why}; pass a writable --cache-dir (or --data-file)")
    zip_path = folder / "sms_spam_collection.zip"
    for fresh in (False, True):
        if fresh or not zip_path.is_file():
            zip_path.unlink(missing_ok=True)
        download_file(list(urls or SMS_URLS), zip_path, description="SMS Spam Collection", progress=progress)
        try:
            _extract_verified(zip_path, tsv)
            return tsv
        except DataError as e:
            zip_path.unlink(missing_ok=True)  # the cached or downloaded archive is not the corpus's
            if fresh:
                raise DownloadError(f"the downloaded SMS Spam Collection is not the corpus: {e}; the copy shipped "
                                    "with lora-bench needs no download (leave out --download)") from None
    raise AssertionError("unreachable")


def _extract_verified(zip_path: Path, dest: Path) -> None:
    """Extract the corpus member (size-capped) and move it to ``dest`` only once it verifies."""
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        safe_extract_zip(zip_path, Path(tmp), members=[SMS_MEMBER], max_bytes=SMS_EXTRACT_CAP)
        extracted = Path(tmp) / SMS_MEMBER
        why = corpus_problem(extracted)
        if why:
            raise DataError(f"{zip_path} holds a {SMS_MEMBER} that is not the corpus ({why})")
        os.replace(extracted, dest)


def read_raw(path: Path) -> pd.DataFrame:
    """Read the raw TSV as the reference does (see ``parse_raw``); refuses a file the reference
    split cannot use (see ``check_corpus``) or one too large to read (``raw_bytes``)."""
    return parse_raw(raw_bytes(path), path)


def raw_bytes(path: Path) -> bytes:
    """The data file's bytes, read once (what is hashed is what is parsed), refused (DataError)
    when it is missing or larger than ``MAX_DATA_BYTES``, before more than that is read."""
    path = Path(path)
    why = not_a_file(path)
    if why == "no such file":
        raise DataError(f"data file not found: {path} (pass --data-file with the raw SMSSpamCollection TSV, "
                        "or leave it out to use the copy shipped with lora-bench)")
    if why:
        raise DataError(f"data file {path}: {why}; give the raw SMSSpamCollection TSV file")
    try:
        return read_capped(path, MAX_DATA_BYTES)
    except TooLarge as e:
        raise DataError(f"data file {path} has {e.size:,} bytes; a data file may hold at most {MAX_DATA_BYTES:,} "
                        f"(16 MiB; the SMS Spam Collection has {SMS_SIZE:,})") from None
    except OSError as e:
        raise DataError(f"cannot read data file {path} ({e.strerror or e})") from None


def parse_raw(data: bytes, path: Path) -> pd.DataFrame:
    """Parse the raw TSV's bytes with pandas' default quoting and missing-value markers, as the
    reference's ``read_csv(sep="\\t", header=None, names=["Label", "Text"])`` does: 5,572 rows
    from 5,574 lines, because two quote characters swallow line breaks (kept on purpose), and a
    message such as ``NA`` or ``null`` read as no text. ``path`` names the file in messages."""
    try:
        df = pd.read_csv(io.BytesIO(data), sep="\t", header=None, names=["Label", "Text"])
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise DataError(f"cannot parse {path} as the SMS Spam Collection TSV: {e}") from e
    check_corpus(df, path, data=data)
    return df


def check_corpus(df: pd.DataFrame, path: Path, *, data: bytes | None = None) -> None:
    """Labels ham/spam only, every message with text, and enough of each class for the
    reference's balancing (as many ham as spam are sampled) and 70/10/20 split (every split
    non-empty): at least MIN_SPAM spam messages and at least as many ham. ``data``: the bytes
    parsed, to quote a message that pandas read as missing."""
    labels = df["Label"].dropna()
    other = ~labels.isin(["ham", "spam"])
    if labels.empty or other.any():
        # what the file holds is not quoted: a file given here by mistake (a key, a password file) stays unshown
        what = (f"{int(other.sum()):,} of its {len(df):,} rows (the first: row {int(labels.index[other][0]) + 1}) "
                "have a label other than ham or spam" if other.any() else "no row has a label")
        raise DataError(f"{path} does not look like the SMS Spam Collection: {what}; expected lines of "
                        "'<ham|spam><TAB><message>'")
    text = df["Text"]
    empty = [i for i, t in enumerate(text) if not isinstance(t, str) or not t.strip()]
    if empty:
        shown = ", ".join(str(i + 1) for i in empty[:5]) + (", ..." if len(empty) > 5 else "")
        markers = _missing_markers(data, empty) if data is not None else []
        why = (f"; {', '.join(repr(m) for m in markers[:5])} read as a missing value, as pandas' read_csv reads "
               "it for the reference (its split cannot use such a message either)") if markers else ""
        raise DataError(f"{path}: {len(empty)} of {len(df)} messages have no text (messages {shown}){why}; "
                        "every line must be '<ham|spam><TAB><message>'")
    spam = int((df["Label"] == "spam").sum())
    ham = int((df["Label"] == "ham").sum())
    if spam < MIN_SPAM or ham < spam:
        raise DataError(f"{path} has {ham} ham and {spam} spam messages; the reference split needs at least "
                        f"{MIN_SPAM} spam messages and at least as many ham as spam (it samples ham down to the "
                        "spam count, then splits 70/10/20 so that every split gets a message)")


def _missing_markers(data: bytes, rows: list[int]) -> list[str]:
    """The texts of ``rows`` as written, where pandas' missing-value markers (NA, N/A, null, NaN,
    ...) made them no text; the same rows, as pandas' quoting makes them either way."""
    try:
        raw = pd.read_csv(io.BytesIO(data), sep="\t", header=None, names=["Label", "Text"], dtype=str,
                          keep_default_na=False)["Text"]
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError):
        return []
    return list(dict.fromkeys(str(raw.iloc[i]) for i in rows if i < len(raw) and str(raw.iloc[i]).strip()))


def balance_and_split(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The reference's balancing (sample ham to the spam count, seed 123) and 70/10/20 split."""
    num_spam = int((df["Label"] == "spam").sum())
    ham_subset = df[df["Label"] == "ham"].sample(num_spam, random_state=123)
    balanced = pd.concat([ham_subset, df[df["Label"] == "spam"]])
    balanced = balanced.sample(frac=1, random_state=123).reset_index(drop=True)
    balanced["Label"] = balanced["Label"].map({"ham": 0, "spam": 1})
    shuffled = balanced.sample(frac=1, random_state=123).reset_index(drop=True)
    n = len(shuffled)
    train_end = int(n * 0.7)
    val_end = train_end + int(n * 0.1)
    return shuffled[:train_end], shuffled[train_end:val_end], shuffled[val_end:]


def prepare_splits(raw_file: Path, out_dir: Path) -> dict[str, Path]:
    """Write train/validation/test CSVs (header ``Label,Text``, no index), each atomically. The
    data is checked before the folder is made, and a folder this call made is removed again
    when writing fails: a failed prepare leaves nothing behind."""
    return write_splits(balance_and_split(read_raw(raw_file)), out_dir)


def write_splits(parts: tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame], out_dir: Path) -> dict[str, Path]:
    """``prepare_splits``'s writing half, for splits already made."""
    out_dir = Path(out_dir)
    made = not out_dir.exists()
    why = check_writable_dir(out_dir)
    if why:
        raise UsageError(f"output folder {out_dir}: {why}")
    paths = {}
    try:
        for name, part in zip(SPLIT_FILES, parts):
            dest = out_dir / name
            with refusing(out_dir):  # a full disk or quota: one message naming the folder
                fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
                os.close(fd)
                try:
                    part.to_csv(tmp, index=None)
                    publish(tmp, dest)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            paths[name.removesuffix(".csv")] = dest
    except BaseException:
        if made:
            for path in paths.values():
                path.unlink(missing_ok=True)
            try:
                out_dir.rmdir()
            except OSError:
                pass
        raise
    return paths


def cached_splits(raw_file: Path, cache_dir: Path) -> dict[str, Path]:
    """Splits of ``raw_file`` under the cache, keyed by the raw file's content. The file is read
    once, and those bytes are both hashed and parsed, so an entry never holds the splits of a file
    that replaced the one hashed; an entry is reused only when its manifest names those bytes'
    hash as its source and the split files still have the hashes recorded with them."""
    data = raw_bytes(raw_file)
    source = hashlib.sha256(data).hexdigest()
    folder = Path(cache_dir) / "sms_spam" / f"splits-{source[:16]}"
    manifest = folder / SPLITS_MANIFEST
    try:
        want = parse_json(read_capped(manifest, MAX_SPLITS_MANIFEST_BYTES))
        if want[SOURCE_KEY] == source and all(sha256_file(folder / f) == want[f] for f in SPLIT_FILES):
            return {f.removesuffix(".csv"): folder / f for f in SPLIT_FILES}
    except (OSError, ValueError, KeyError, TypeError, TooLarge):
        pass  # absent, partial, altered or of another source: prepared again below
    why = check_writable_dir(Path(cache_dir))
    if why:
        raise UsageError(f"cache folder {cache_dir}: {why}; pass a writable --cache-dir")
    manifest.unlink(missing_ok=True)  # the entry is not trusted while it is rewritten
    paths = write_splits(balance_and_split(parse_raw(data, Path(raw_file))), folder)
    hashes = {f: sha256_file(folder / f) for f in SPLIT_FILES}
    atomic_write_text(manifest, json.dumps({SOURCE_KEY: source, **hashes}, indent=1))
    return paths


class SpamDataset(Dataset):
    """The reference's dataset: encode, truncate to ``max_length``, right-pad with 50256."""

    def __init__(self, csv_file: Path, tokenizer, *, max_length: int | None = None, no_padding: bool = False,
                 pad_token_id: int = PAD_TOKEN_ID):
        self.data = pd.read_csv(csv_file)
        self.encoded_texts = [_encode(tokenizer, text, csv_file, i) for i, text in enumerate(self.data["Text"])]
        if max_length is None:
            max_length = max(len(t) for t in self.encoded_texts)
        self.max_length = max_length
        self.encoded_texts = [t[:max_length] for t in self.encoded_texts]
        if not no_padding and len(self.encoded_texts) * max_length > MAX_PADDED_TOKENS:
            raise DataError(f"{csv_file}: {len(self.encoded_texts):,} texts padded to {max_length:,} tokens each would "
                            f"hold {len(self.encoded_texts) * max_length:,} tokens, more than {MAX_PADDED_TOKENS:,}; "
                            "pass a shorter --context-length (texts are cut to it) or use a smaller data file")
        if not no_padding:
            self.encoded_texts = [t + [pad_token_id] * (max_length - len(t)) for t in self.encoded_texts]
        self.labels = self.data["Label"].tolist()

    def __getitem__(self, index):
        return (torch.tensor(self.encoded_texts[index], dtype=torch.long),
                torch.tensor(self.labels[index], dtype=torch.long))

    def __len__(self):
        return len(self.data)


def _encode(tokenizer, text: str, csv_file: Path, index: int) -> list[int]:
    """``tokenizer.encode(text)``, as the reference calls it: tiktoken refuses a special token such
    as ``<|endoftext|>`` inside a message (all special tokens are disallowed by default), in the
    reference as here; here the refusal names the message."""
    try:
        return tokenizer.encode(text)
    except ValueError:
        found = [t for t in sorted(tokenizer.special_tokens_set) if isinstance(text, str) and t in text]
        if not found:
            raise
        excerpt = text if len(text) <= 60 else text[:57] + "..."
        raise DataError(f"{csv_file}, message {index + 1} ({excerpt!r}): it holds {found[0]!r}, a GPT-2 special "
                        "token, which tiktoken's encode refuses in text (the reference's tokenizer.encode refuses it "
                        "too); remove it from the data file") from None


@dataclass
class Loaders:
    train: DataLoader
    val: DataLoader
    test: DataLoader
    max_length: int  # the training set's (per-set longest with no_padding)


def resolve_max_length(context_length: str, *, model_context: int) -> int | None:
    """None = longest training example; otherwise an explicit length checked against the model."""
    if context_length == "longest_training_example":
        return None
    n = model_context if context_length == "model_context_length" else int(context_length)
    if n > model_context:
        raise UsageError(f"context_length={n} exceeds the model's context length {model_context}; "
                         f"use at most {model_context} (or model_context_length)")
    return n


def build_loaders(splits: dict[str, Path], tokenizer, *, context_length: str, model_context: int,
                  batch_size: int, no_padding: bool) -> Loaders:
    """Datasets and loaders exactly as the reference: train shuffled with drop_last, no workers."""
    max_length = None if no_padding else resolve_max_length(context_length, model_context=model_context)
    train_ds = SpamDataset(splits["train"], tokenizer, max_length=max_length, no_padding=no_padding)
    if len(train_ds) < batch_size:  # the loader drops the last partial batch: nothing would train
        raise UsageError(f"the training split has {len(train_ds)} messages, fewer than batch_size={batch_size}, "
                         "so no batch would be trained; use a smaller --batch-size or a larger corpus")
    if train_ds.max_length > model_context:
        raise UsageError(f"the longest training text has {train_ds.max_length} tokens, more than the model's "
                         f"context length {model_context}; pass --context-length {model_context}")
    eval_len = None if no_padding else train_ds.max_length
    val_ds = SpamDataset(splits["validation"], tokenizer, max_length=eval_len, no_padding=no_padding)
    test_ds = SpamDataset(splits["test"], tokenizer, max_length=eval_len, no_padding=no_padding)
    if no_padding:  # each set's own longest text must still fit the model
        longest = max(val_ds.max_length, test_ds.max_length)
        if longest > model_context:
            val_ds = SpamDataset(splits["validation"], tokenizer, max_length=model_context, no_padding=True)
            test_ds = SpamDataset(splits["test"], tokenizer, max_length=model_context, no_padding=True)
    return Loaders(
        train=DataLoader(train_ds, batch_size=batch_size, shuffle=True, num_workers=0, drop_last=True),
        val=DataLoader(val_ds, batch_size=batch_size, num_workers=0, drop_last=False),
        test=DataLoader(test_ds, batch_size=batch_size, num_workers=0, drop_last=False),
        max_length=train_ds.max_length,
    )
