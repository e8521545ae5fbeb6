"""Crash-safe file primitives: atomic replace, directory fsync, content hashes.

Every file surgeon writes in place of another goes through :func:`atomic_write` (bytes in hand)
or :func:`atomic_writer` (a writer that wants a file name, such as safetensors' ``save_file``), so
a file is always either its old or its new bytes, whatever moment the process dies at: the patch
state (engine files, blobs, the manifest, the journal), a pinned spec, a dump, a fingerprint, the
probe cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

TMP_SUFFIX = ".surgeon-tmp"
ABSENT = "absent"  # the "sha256" of a file that does not exist (created by a patch, deleted on revert)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | None, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically: temp in the same dir, fsync, replace, fsync dir.

    ``data=None`` deletes the file (a created file going back to absent). An ``OSError`` (disk
    full, file too large, permission denied) leaves ``path`` as it was, removes the temp file and
    names ``path``."""
    if data is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        fsync_dir(path.parent)
        return
    with atomic_writer(path, mode) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: int | None = None) -> Iterator[Path]:
    """A temporary file name beside ``path`` for a writer to fill; when the block ends it is
    fsynced and replaces ``path`` (then the directory is fsynced). An exception in the block, or an
    ``OSError`` on the way, leaves ``path`` as it was and removes the temporary file."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
        os.close(fd)
    except OSError as e:
        raise _named(e, path) from None
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _named(e, path) from None
        raise
    fsync_dir(path.parent)


def _named(e: OSError, path: Path) -> OSError:
    """``e`` with ``path`` as its file name (the temp file's name means nothing to the user)."""
    return type(e)(e.errno, e.strerror or str(e), str(path)) if e.errno is not None else e


def file_sha(path: Path) -> str | None:
    try:
        return sha256_bytes(path.read_bytes())
    except FileNotFoundError:
        return None


def file_version(path: Path) -> str:
    """sha256 of the file, or :data:`ABSENT` when there is none (for journal comparisons)."""
    return file_sha(path) or ABSENT


def file_mode(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o644
