"""Robust file downloads and safe zip extraction.

This module owns getting one file from the network onto disk *correctly*: trying a primary URL and
then its fallbacks, streaming into a temporary file beside the destination, checking the byte count
(Content-Length and an expected size) and an optional sha256, and only then moving the file into
place atomically. A destination path therefore either holds a complete, verified file or nothing.
It also owns extracting zip archives without letting a member escape the target folder.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import sys
import urllib.error
import urllib.request
import zipfile
import zlib
from contextlib import nullcontext
from pathlib import Path, PurePosixPath, PureWindowsPath

from lora_bench import __version__
from lora_bench.errors import DataError, DownloadError

CHUNK_SIZE = 1 << 16
USER_AGENT = f"lora-bench/{__version__}"


class _UrlFailed(Exception):
    """One URL did not yield a verified file; ``reason`` is shown to the user."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_complete(dest: Path, expected_size: int | None, sha256: str | None) -> bool:
    """True when ``dest`` exists and matches what is known about it (existence alone otherwise)."""
    if not dest.is_file():
        return False
    if expected_size is not None and dest.stat().st_size != expected_size:
        return False
    return sha256 is None or sha256_of(dest) == sha256.lower()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return f"cannot connect ({exc.reason})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _progress_bar(enabled: bool):
    """A transient rich bar with bytes, speed and ETA; a no-op when disabled or not on a terminal."""
    if not enabled or not sys.stderr.isatty():
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=True)


def _fetch(url: str, tmp: Path, *, timeout: float, bar, label: str) -> tuple[int, str]:
    """Stream ``url`` into ``tmp``; returns (bytes, sha256). Network problems raise _UrlFailed;
    local write problems (disk full, permissions) propagate as OSError: another URL won't help."""
    try:
        request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    except ValueError as exc:  # malformed URL string
        raise _UrlFailed(f"invalid URL ({exc})") from exc
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        raise _UrlFailed(_describe(exc)) from exc
    with response:
        header = response.headers.get("Content-Length")
        length = int(header) if header and header.isdigit() else None
        task = bar.add_task(label, total=length) if bar is not None else None
        digest = hashlib.sha256()
        received = 0
        with open(tmp, "wb") as out:
            while True:
                try:
                    chunk = response.read(CHUNK_SIZE)
                except (http.client.HTTPException, OSError) as exc:  # IncompleteRead, reset, timeout
                    raise _UrlFailed(f"transfer interrupted after {received} bytes "
                                     f"({_describe(exc)})") from exc
                if not chunk:
                    break
                out.write(chunk)
                digest.update(chunk)
                received += len(chunk)
                if task is not None:
                    bar.update(task, advance=len(chunk))
        if task is not None:
            bar.remove_task(task)
    # http.client returns b"" (no exception) when a server closes early, so count the bytes.
    if length is not None and received != length:
        raise _UrlFailed(f"transfer interrupted: received {received} of {length} bytes")
    return received, digest.hexdigest()


def download_file(
    urls: list[str],
    dest: Path,
    *,
    expected_size: int | None = None,
    sha256: str | None = None,
    description: str | None = None,
    progress: bool = True,
    timeout: float = 30,
    offline_hint: str | None = None,
) -> Path:
    """Download ``dest`` from the first of ``urls`` that gives a complete, verified file.

    Skips the network when ``dest`` already matches ``expected_size``/``sha256`` (existence is
    enough when neither is given). ``offline_hint`` replaces the generic advice in the error
    raised when every URL fails (e.g. which command-line option points at a local copy).
    """
    dest = Path(dest)
    label = description or dest.name
    if _is_complete(dest, expected_size, sha256):
        return dest
    if not urls:
        raise DownloadError(f"no URL given for {label}; put the file at {dest}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DownloadError(f"cannot create folder {dest.parent} for {label}: {exc}") from exc

    failures: list[str] = []
    # Same folder, so os.replace is atomic (same filesystem); the pid keeps two concurrent runs out
    # of each other's partial file. (Not mkstemp: its 0600 mode would stick to the final file.)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.part")
    try:
        with _progress_bar(progress) as bar:
            for url in urls:
                try:
                    size, digest = _fetch(url, tmp, timeout=timeout, bar=bar, label=label)
                    if expected_size is not None and size != expected_size:
                        raise _UrlFailed(f"got {size} bytes, expected {expected_size}")
                    if sha256 is not None and digest != sha256.lower():
                        raise _UrlFailed(f"sha256 {digest} does not match expected {sha256.lower()}")
                except _UrlFailed as failed:
                    failures.append(f"  - {url}: {failed.reason}")
                    continue
                except OSError as exc:
                    raise DownloadError(f"cannot write {label} to {tmp}: {exc}") from exc
                try:
                    os.replace(tmp, dest)
                except OSError as exc:
                    raise DownloadError(f"cannot move {tmp} to {dest}: {exc}") from exc
                return dest
    finally:
        tmp.unlink(missing_ok=True)

    hint = offline_hint or (f"to work offline, download it elsewhere and put it at {dest} "
                            "(or pass --data-file / --weights-dir to use a local copy)")
    raise DownloadError(f"could not download {label}; tried {len(urls)} URL(s):\n"
                        + "\n".join(failures) + f"\n{hint}")


def _member_escapes(name: str, root: Path) -> bool:
    # zipfile.extract silently rewrites such names; we refuse them instead, since an archive that
    # contains them is not the one we expected.
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
        return True
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        return True
    return not (root / name).resolve().is_relative_to(root)


def safe_extract_zip(zip_path: Path, out_dir: Path, *, members: list[str] | None = None,
                     max_bytes: int | None = None) -> list[Path]:
    """Extract ``members`` (all by default) of ``zip_path`` into ``out_dir``; returns their paths.

    Every member is checked before anything is written: one whose path is absolute or leads out of
    ``out_dir`` raises DataError naming it, and so does one that declares more than ``max_bytes``
    (a zip bomb). The cap is enforced again while writing, since a crafted archive's declared size
    need not be true.
    """
    zip_path, out_dir = Path(zip_path), Path(out_dir)
    try:
        archive = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DataError(f"{zip_path} is not a readable zip archive ({exc}); delete it and "
                        "download it again") from exc
    with archive:
        names = archive.namelist()
        wanted = names if members is None else list(members)
        missing = [m for m in wanted if m not in names]
        if missing:
            raise DataError(f"{zip_path} has no member(s) {', '.join(map(repr, missing))}; "
                            f"it holds: {', '.join(names[:20])}")
        out_dir.mkdir(parents=True, exist_ok=True)
        root = out_dir.resolve()
        for name in wanted:
            if _member_escapes(name, root):
                raise DataError(f"refusing to extract {zip_path}: member {name!r} would be written "
                                f"outside {out_dir}; the archive is not the expected one")
            declared = archive.getinfo(name).file_size
            if max_bytes is not None and declared > max_bytes:
                raise DataError(f"refusing to extract {zip_path}: member {name!r} expands to {declared:,} bytes, "
                                f"more than the {max_bytes:,} expected; the archive is not the expected one")
        return [_extract_capped(archive, name, out_dir, zip_path=zip_path, max_bytes=max_bytes) for name in wanted]


def _extract_capped(archive: zipfile.ZipFile, name: str, out_dir: Path, *, zip_path: Path,
                    max_bytes: int | None) -> Path:
    dest = out_dir / name
    if name.endswith("/"):
        dest.mkdir(parents=True, exist_ok=True)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    try:
        with archive.open(name) as src, open(dest, "wb") as out:
            for block in iter(lambda: src.read(CHUNK_SIZE), b""):
                written += len(block)
                if max_bytes is not None and written > max_bytes:
                    raise DataError(f"refusing to extract {zip_path}: member {name!r} expands past "
                                    f"{max_bytes:,} bytes; the archive is not the expected one")
                out.write(block)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        dest.unlink(missing_ok=True)
        raise DataError(f"{zip_path} is damaged ({exc}); delete it and download it again") from exc
    except DataError:
        dest.unlink(missing_ok=True)
        raise
    return dest
