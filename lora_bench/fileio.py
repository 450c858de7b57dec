"""File I/O: atomic writes (a destination holds either its old content or the complete new one,
never a torn file, and new files get ordinary permissions), reads bounded by size (a file given
as input is refused past a limit before more than the limit is read), JSON bounded by nesting
(``parse_json``), and one refusal for a folder that takes no file (``NotWritable``: an OSError that
keeps its errno, and a one-line usage error for the command line)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from pathlib import Path

from lora_bench.errors import UsageError

CHUNK = 1 << 20
MAX_JSON_DEPTH = 64  # nesting levels of any JSON lora-bench reads: its own files need five
# why a folder takes no new file: read-only, no permission, full, over quota, a name too long
REFUSED = frozenset((errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG,
                     errno.EFBIG))
SHOWN_NAME = 120  # characters of a file name shown in a message (a name may be thousands long)


class NotWritable(OSError, UsageError):
    """A file could not be created or written where a command writes (``refusing``): the OSError
    keeps its errno (a save's full-disk handling reads it), and the message is one line naming
    the place and the file system's reason."""

    def __init__(self, code: int, reason: str, where: Path | str):
        super().__init__(code, reason)
        self.where = shown_path(where)

    def __str__(self) -> str:
        return f"cannot write {self.where}: {self.strerror}; nothing was written there"


def shown_path(path: Path | str) -> str:
    """``path`` for a message: a file name longer than SHOWN_NAME characters is cut, its length said."""
    path = Path(path)
    name = path.name
    if len(name) <= SHOWN_NAME:
        return str(path)
    return str(path.parent / f"{name[:SHOWN_NAME]}…") + f" (a name of {len(name.encode(errors='replace')):,} bytes)"


def name_problem(path: Path | str, *, room: int = 0) -> str | None:
    """Why the file system would refuse ``path``'s name (longer than its folder's limit, 255 bytes on
    most, less ``room`` for a suffix the command adds), or None."""
    path = Path(path)
    try:
        limit = os.pathconf(path.parent if path.parent.is_dir() else ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    size = len(path.name.encode(errors="surrogateescape"))
    if size + room <= limit:
        return None
    extra = f", less {room} for the suffixes added to it" if room else ""
    return f"its name has {size:,} bytes; a file name has at most {limit} here{extra}"


@contextlib.contextmanager
def refusing(where: Path | str):
    """Turn an OSError that says the place takes no file (REFUSED) into ``NotWritable`` naming
    ``where``; any other error passes unchanged."""
    try:
        yield
    except NotWritable:
        raise
    except OSError as e:
        if e.errno not in REFUSED:
            raise
        raise NotWritable(e.errno, e.strerror or str(e), where) from e


class JsonTooDeep(ValueError):
    """A JSON text nested past MAX_JSON_DEPTH levels: refused, never parsed into a RecursionError."""


def parse_json(data: bytes | str, *, max_depth: int = MAX_JSON_DEPTH):
    """The value of the JSON text ``data``; ValueError when it is not JSON, JsonTooDeep (a
    ValueError) when it nests more than ``max_depth`` levels. The parser's own recursion stops a
    text nested thousands deep in bounded time and memory; the value is then measured without
    recursion."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise JsonTooDeep(f"it nests more than {max_depth} levels deep") from None
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                raise JsonTooDeep(f"it nests more than {max_depth} levels deep")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return value


def not_a_file(path: Path | str) -> str | None:
    """Why ``path`` cannot be read as an input file, in a few words ("no such file", "a folder", "not
    a regular file (a pipe, device or socket)"), or None when it is a regular file."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_dir():
        return "a folder, not a file"
    return "not a regular file (a pipe, device or socket)" if path.exists() else "no such file"


class TooLarge(Exception):
    """A file holds more bytes than the reader allows; ``size`` is its size when the file system
    tells it, else the bytes read before stopping (limit + 1)."""

    def __init__(self, path: Path, *, size: int, limit: int):
        self.path, self.size, self.limit = Path(path), size, limit
        super().__init__(f"{path}: {size:,} bytes; at most {limit:,} are read")


def read_capped(path: Path | str, limit: int) -> bytes:
    """The bytes of the regular file ``path``, refused (TooLarge) past ``limit`` bytes: its size is
    checked before reading, and at most ``limit + 1`` bytes are read, so a file that grows meanwhile
    or a /proc file that reports size 0 cannot slip past. A pipe, device or socket is refused
    (OSError) without waiting on it: it is opened non-blocking and never read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file (a folder, pipe, device or socket)")
        if info.st_size > limit:
            raise TooLarge(path, size=info.st_size, limit=limit)
        parts, got = [], 0
        while got <= limit:
            part = os.read(fd, min(CHUNK, limit + 1 - got))
            if not part:
                break
            parts.append(part)
            got += len(part)
        if got > limit:
            raise TooLarge(path, size=max(got, info.st_size), limit=limit)
        return b"".join(parts)
    finally:
        os.close(fd)


def publish(tmp: str | Path, dest: Path) -> None:
    """Move a finished temporary file into place atomically, with ordinary permissions (mkstemp
    creates files 0600, which would otherwise stick to results and data files)."""
    mask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)
    os.replace(tmp, dest)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a synced temporary file in the same folder: a reader sees
    the old file or the whole new one, never a part."""
    path = Path(path)
    with refusing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        # the temporary's name is cut short (a long name has no room for its prefix and suffix): a name
        # past the file system's limit is then refused by the rename, with its own reason
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:200]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            publish(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def overwrite_in_place(path: Path, data: bytes) -> None:
    """Rewrite the existing file ``path`` in its own blocks: for a folder with no room left for a
    temporary copy. Not atomic: a process stopped midway leaves the new bytes followed by the old
    file's tail, which a reader must refuse (a JSON text then holds trailing data)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable_dir(path: Path) -> str | None:
    """Create the folder ``path`` if needed and prove it takes a new file; returns None when it
    does, else why not in a few words. Tried, not asked: ``os.access`` answers yes for root on a
    read-only or pseudo file system."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return "a file is in the way of this folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".write-test.", suffix=".tmp")
    except (FileExistsError, NotADirectoryError):
        return "a file is in the way of this folder"
    except OSError as e:
        return f"cannot write here ({e.strerror or e})"
    os.close(fd)
    os.unlink(tmp)
    return None


def names_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed or replaced since): a
    lock taken on a file its holder has just removed guards nothing."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)
