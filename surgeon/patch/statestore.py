"""The state directory ``<root>/.surgeon``: manifest and journal JSON, content-addressed blobs, and
the lock every operation holds. Knows the on-disk formats; knows nothing of patches.

Every node is reached through :mod:`surgeon.patch.statedir` (no link followed, owner and mode
checked) and every JSON file is validated by :mod:`surgeon.patch.statefiles` on read. A store
opened for reading only (``status``, ``diff``, ``doctor``) creates nothing: it takes a shared lock
when the lock file exists, none otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from surgeon.core.atomicfile import ABSENT, TMP_SUFFIX, sha256_bytes

# Every write goes through this module-level name (a test injects failures here).
from surgeon.core.atomicfile import atomic_write as _atomic_write
from surgeon.patch.statedir import PatchError, check_node, ensure_dir, open_file, read_file
from surgeon.patch.statefiles import MANIFEST_FORMAT, SHA_RE, parse_journal, parse_manifest

__all__ = ["StateStore", "BLOB_KINDS"]

BLOB_KINDS = ("originals", "patched")


class StateStore:
    """``<root>/.surgeon``, every node checked before use (see the module docstring)."""

    def __init__(self, state: Path, root: Path, lock_timeout: float) -> None:
        self.state, self.root, self.lock_timeout = state, root, lock_timeout
        self._lock_fd: int | None = None
        self._lock_depth = 0

    @property
    def manifest_path(self) -> Path:
        return self.state / "manifest.json"

    @property
    def journal_path(self) -> Path:
        return self.state / "journal.json"

    def exists(self) -> bool:
        """True when the state directory is there (refused if it is a link or not ours)."""
        return check_node(self.state, "dir") is not None

    def check(self) -> bool:
        """Whether the state directory is there, every node surgeon keeps in it checked (a link,
        a node of the wrong kind, another owner's or one writable by others is refused)."""
        if not self.exists():
            return False
        for name, kind in (("lock", "file"), ("manifest.json", "file"), ("journal.json", "file"),
                           ("originals", "dir"), ("patched", "dir")):
            check_node(self.state / name, kind)
        return True

    def writable(self) -> bool:
        """Whether this process may write the state (the directory, else the root to create it)."""
        return os.access(self.state if self.exists() else self.root, os.W_OK)

    def journal_exists(self) -> bool:
        return check_node(self.journal_path, "file") is not None

    # -- blobs -------------------------------------------------------------------------------
    def blob_path(self, kind: str, sha: str) -> Path:
        if kind not in BLOB_KINDS or not isinstance(sha, str) or not SHA_RE.fullmatch(sha):
            raise PatchError(f"{self.state}: damaged state: {kind}/{str(sha)[:80]!r} is not a stored blob name")
        return self.state / kind / sha

    def store_blob(self, kind: str, data: bytes | None) -> str:
        if data is None:
            return ABSENT
        sha = sha256_bytes(data)
        path = self.blob_path(kind, sha)
        ensure_dir(path.parent)
        if check_node(path, "file") is None:
            _atomic_write(path, data, 0o644)
        return sha

    def has_blob(self, kind: str, sha: str) -> bool:
        return sha == ABSENT or (check_node(self.state / kind, "dir") is not None
                                 and check_node(self.blob_path(kind, sha), "file") is not None)

    def read_blob(self, kind: str, sha: str) -> bytes | None:
        if sha == ABSENT:
            return None
        path = self.blob_path(kind, sha)
        check_node(path.parent, "dir")
        data = read_file(path)
        if data is None:
            raise PatchError(f"{path}: stored blob is missing; the state directory is damaged "
                             f"(`surgeon doctor` says what can be rebuilt)")
        if sha256_bytes(data) != sha:
            raise PatchError(f"{path}: stored blob does not match its sha256; the state directory is damaged")
        return data

    def blob_names(self, kind: str) -> list[str]:
        d = self.state / kind
        if check_node(d, "dir") is None:
            return []
        return sorted(p.name for p in d.iterdir())

    def gc(self, manifest: dict[str, Any], protect: Callable[[], set[str]] | None = None) -> None:
        """Drop blobs the committed manifest no longer references (only with no journal present),
        except those ``protect()`` names (asked only when there is something to drop: the copies
        patched files that no manifest records still need, so that nothing is lost)."""
        if self.journal_exists():
            return
        keep: dict[str, set[str]] = {"originals": set(), "patched": set()}
        for p in manifest["patches"].values():
            for f in p["files"]:
                keep["originals"].add(f["sha256_before"])
                keep["patched"].add(f["sha256_after"])
        drop = [(kind, name) for kind, shas in keep.items() for name in self.blob_names(kind) if name not in shas]
        spared = protect() if drop and protect is not None else set()
        for kind, name in drop:  # (ABSENT has no blob: it is never a file name here)
            if name not in spared:
                with contextlib.suppress(OSError):
                    os.unlink(self.state / kind / name)  # unlink never follows a link

    def clean_tmp(self, directory: Path, name: str | None = None) -> None:
        if check_node(directory, "dir") is None:
            return
        pattern = f".{name}.*{TMP_SUFFIX}" if name else f".*{TMP_SUFFIX}"
        for tmp in directory.glob(pattern):
            with contextlib.suppress(OSError):
                tmp.unlink()
        if name is None:
            for sub in BLOB_KINDS:
                if check_node(directory / sub, "dir") is not None:
                    self.clean_tmp(directory / sub)

    # -- manifest and journal ----------------------------------------------------------------
    @staticmethod
    def empty_manifest() -> dict[str, Any]:
        return {"format": MANIFEST_FORMAT, "txid": None, "patches": {}}

    def load_journal(self) -> dict[str, Any] | None:
        data = read_file(self.journal_path)
        return None if data is None else parse_journal(self.journal_path, data)

    def load_manifest(self) -> dict[str, Any]:
        data = read_file(self.manifest_path)
        return self.empty_manifest() if data is None else parse_manifest(self.manifest_path, data)

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        check_node(path, "file")  # a link or a directory there is refused, not replaced
        _atomic_write(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode(), 0o644)

    # -- lock --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self, *, write: bool = True) -> Iterator[bool]:
        """Hold the state directory's flock (re-entrant within this object); yields whether the
        lock is exclusive. ``write=False`` creates nothing: a shared lock when the lock file is
        there, none when it (or the state directory) is not."""
        if self._lock_depth:
            self._lock_depth += 1
            try:
                yield True
            finally:
                self._lock_depth -= 1
            return
        if write:
            ensure_dir(self.state)
            self.check()
            fd = open_file(self.state / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        else:
            fd = open_file(self.state / "lock", os.O_RDONLY) if self.check() else None
        if fd is None:  # read-only and no lock file: nobody can be writing without one
            yield False
            return
        try:
            self._wait_for_lock(fd, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
            if not write:
                yield False
                return
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._lock_fd, self._lock_depth = fd, 1
            try:
                yield True
            finally:
                self._lock_fd, self._lock_depth = None, 0
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _wait_for_lock(self, fd: int, how: int) -> None:
        """flock ``fd``, polling until ``lock_timeout``; then name the holder's pid."""
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                fcntl.flock(fd, how | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise PatchError(f"{self.state / 'lock'}: cannot lock it ({e.strerror or e})") from None
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    raise PatchError(
                        f"{self.root}: another surgeon process (pid {holder}) holds the patch lock; "
                        f"waited {self.lock_timeout:g} s, try again when it finishes"
                    ) from None
                time.sleep(0.05)
