"""SMS Spam Collection: fetch, balance and split exactly as the reference, the token datasets and
the loaders (whose RNG use is part of the reproducible sequence)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset

from lora_bench.data.tokenizer import PAD_TOKEN_ID, sha256_file
from lora_bench.download import download_file, safe_extract_zip
from lora_bench.errors import DataError, UsageError
from lora_bench.fileio import publish

SMS_URLS = [
    "https://archive.ics.uci.edu/static/public/228/sms+spam+collection.zip",
    "https://f001.backblazeb2.com/file/LLMs-from-scratch/sms%2Bspam%2Bcollection.zip",
]
SMS_MEMBER = "SMSSpamCollection"
SMS_SIZE = 477_907
SMS_SHA256 = "7d039a24a6083ed9ef0f806ebad56bbb976e3aeb8de05669173bfdc4996c239d"
SPLIT_FILES = ("train.csv", "validation.csv", "test.csv")


def ensure_sms_spam(cache_dir: Path, *, progress: bool = True, urls: list[str] | None = None) -> Path:
    """The raw TSV, downloaded (primary then fallback URL) and extracted into ``cache_dir`` once."""
    folder = Path(cache_dir) / "sms_spam"
    tsv = folder / "SMSSpamCollection.tsv"
    if tsv.is_file() and sha256_file(tsv) == SMS_SHA256:
        return tsv
    folder.mkdir(parents=True, exist_ok=True)
    zip_path = download_file(list(urls or SMS_URLS), folder / "sms_spam_collection.zip",
                             description="SMS Spam Collection", progress=progress)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        safe_extract_zip(zip_path, Path(tmp), members=[SMS_MEMBER])
        extracted = Path(tmp) / SMS_MEMBER
        if not extracted.is_file():
            raise DataError(f"{zip_path} holds no {SMS_MEMBER!r}; delete it and retry, or pass --data-file")
        os.replace(extracted, tsv)
    return tsv


def read_raw(path: Path) -> pd.DataFrame:
    """Read the raw TSV with pandas' default quoting, as the reference does: 5,572 rows from
    5,574 lines, because two quote characters swallow line breaks (kept on purpose)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path} (pass --data-file with the raw SMSSpamCollection TSV, "
                        "or leave it out to download it)")
    try:
        df = pd.read_csv(path, sep="\t", header=None, names=["Label", "Text"])
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        raise DataError(f"cannot parse {path} as the SMS Spam Collection TSV: {e}") from e
    labels = set(df["Label"].dropna().unique())
    if not labels or not labels <= {"ham", "spam"} or len(df) < 10:
        raise DataError(f"{path} does not look like the SMS Spam Collection "
                        f"(labels {sorted(map(str, labels))[:5]}, {len(df)} rows; expected ham/spam lines)")
    return df


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
    """Write train/validation/test CSVs (header ``Label,Text``, no index), each atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, part in zip(SPLIT_FILES, balance_and_split(read_raw(raw_file))):
        dest = out_dir / name
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        try:
            part.to_csv(tmp, index=None)
            publish(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        paths[name.removesuffix(".csv")] = dest
    return paths


def cached_splits(raw_file: Path, cache_dir: Path) -> dict[str, Path]:
    """Splits of ``raw_file`` under the cache, keyed by the raw file's content."""
    if not Path(raw_file).is_file():
        read_raw(raw_file)  # raises the clear "not found" error
    digest = hashlib.sha256(Path(raw_file).read_bytes()).hexdigest()[:16]
    folder = Path(cache_dir) / "sms_spam" / f"splits-{digest}"
    if all((folder / f).is_file() for f in SPLIT_FILES):
        return {f.removesuffix(".csv"): folder / f for f in SPLIT_FILES}
    return prepare_splits(raw_file, folder)


class SpamDataset(Dataset):
    """The reference's dataset: encode, truncate to ``max_length``, right-pad with 50256."""

    def __init__(self, csv_file: Path, tokenizer, *, max_length: int | None = None, no_padding: bool = False,
                 pad_token_id: int = PAD_TOKEN_ID):
        self.data = pd.read_csv(csv_file)
        self.encoded_texts = [tokenizer.encode(text) for text in self.data["Text"]]
        if max_length is None:
            max_length = max(len(t) for t in self.encoded_texts)
        self.max_length = max_length
        self.encoded_texts = [t[:max_length] for t in self.encoded_texts]
        if not no_padding:
            self.encoded_texts = [t + [pad_token_id] * (max_length - len(t)) for t in self.encoded_texts]
        self.labels = self.data["Label"].tolist()

    def __getitem__(self, index):
        return (torch.tensor(self.encoded_texts[index], dtype=torch.long),
                torch.tensor(self.labels[index], dtype=torch.long))

    def __len__(self):
        return len(self.data)


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
