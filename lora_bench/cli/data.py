"""``lora-bench data prepare``: the reference's train / validation / test splits as CSV files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lora_bench.cli.options import CacheDir, NoProgress, console
from lora_bench.errors import UsageError

OutputDir = Annotated[Optional[Path], typer.Option("--output", "-o", metavar="DIR", show_default=False,
                                                   help="Folder for train.csv, validation.csv, test.csv.")]
OldOutputDir = Annotated[Optional[Path], typer.Option("--out", hidden=True, help="The same as --output.")]


def data_prepare(
    output: OutputDir = None,
    data_file: Annotated[Optional[Path], typer.Option(
        help="Raw SMSSpamCollection TSV (default: the copy shipped with lora-bench).")] = None,
    download: Annotated[bool, typer.Option(
        "--download", help="Download the corpus from its publishers (UCI, then a mirror) into the cache, verify it "
                           "and split that copy; it is the shipped copy byte for byte.")] = False,
    cache_dir: CacheDir = None,
    no_progress: NoProgress = False,
    out: OldOutputDir = None,
) -> None:
    """Balance and split the SMS Spam Collection exactly as the reference."""
    from lora_bench.data.sms_spam import ensure_sms_spam, packaged_sms_spam, prepare_splits
    from lora_bench.data.tokenizer import sha256_file
    from lora_bench.model.checkpoints import default_cache_dir

    if output is not None and out is not None and output != out:
        raise UsageError("give the output folder once (--output)")
    folder = output or out
    if folder is None:
        raise UsageError("--output DIR is needed: the folder for train.csv, validation.csv, test.csv")
    if data_file is not None and download:
        raise UsageError("--data-file and --download exclude each other: give a file, or have the corpus downloaded")
    if data_file is not None:
        raw = data_file
    elif download:
        raw = ensure_sms_spam(cache_dir or default_cache_dir(), progress=not no_progress)
    else:
        raw = packaged_sms_spam()
    for name, path in prepare_splits(raw, folder).items():
        console.print(f"{name:>10}: {path}  sha256 {sha256_file(path)}")
