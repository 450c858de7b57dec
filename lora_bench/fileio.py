"""Atomic file writes: a destination holds either its old content or the complete new one, never a
torn file, and new files get ordinary permissions."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def publish(tmp: str | Path, dest: Path) -> None:
    """Move a finished temporary file into place atomically, with ordinary permissions (mkstemp
    creates files 0600, which would otherwise stick to results and data files)."""
    mask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)
    os.replace(tmp, dest)


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
