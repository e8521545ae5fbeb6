"""The state directory ``<root>/.surgeon``: manifest and journal JSON, content-addressed blobs, the
record of the root it belongs to, and the lock every operation holds. Knows the on-disk formats;
knows nothing of patches.

Every node is reached through a :class:`surgeon.patch.statedir.DirHandle` (no link followed,
owner and mode checked, and once checked used through its descriptor only) and every JSON file is
validated by :mod:`surgeon.patch.statefiles` on read. While the lock is held the state directory
stays open: a ``.surgeon`` swapped for a link meanwhile is noticed (:meth:`StateStore.verify`)
and never written through. A store opened for reading only (``status``, ``diff``, ``doctor``)
creates nothing: it takes a shared lock when the lock file exists, none otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from surgeon.core.atomicfile import ABSENT, TMP_SUFFIX, sha256_bytes
from surgeon.patch import rootrecord
from surgeon.patch.statedir import DirHandle, PatchError, check_node, open_dir, others_may_write
from surgeon.patch.statefiles import MANIFEST_FORMAT, SHA_RE, parse_journal, parse_manifest

__all__ = ["StateStore", "BLOB_KINDS"]

BLOB_KINDS = ("originals", "patched")
MANIFEST, JOURNAL, LOCK = "manifest.json", "journal.json", "lock"
_NODES = ((LOCK, "file"), (MANIFEST, "file"), (JOURNAL, "file"), (rootrecord.RECORD, "file"),
          ("originals", "dir"), ("patched", "dir"))
_PID_WIDTH = 24  # the lock holds the holder's pid, padded: written in place, never truncated


class StateStore:
    """``<root>/.surgeon``, every node checked before use (see the module docstring)."""

    def __init__(self, state: Path, root: Path, lock_timeout: float) -> None:
        self.state, self.root, self.lock_timeout = state, root, lock_timeout
        self._dir: DirHandle | None = None  # the state directory, held open while locked
        self._root_dir: DirHandle | None = None
        self._lock_depth = 0
        self._exclusive = False

    @property
    def manifest_path(self) -> Path:
        return self.state / MANIFEST

    @property
    def journal_path(self) -> Path:
        return self.state / JOURNAL

    # -- the directory -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _opened(self) -> Iterator[DirHandle | None]:
        """The state directory held open: the locked session's, else opened for this call (None
        when absent)."""
        if self._dir is not None:
            yield self._dir
            return
        with open_dir(self.state.parent) as root:
            d = root.sub(self.state.name)
            with d or contextlib.nullcontext():
                yield d

    def _held(self) -> DirHandle:
        if self._dir is None:
            raise RuntimeError("the patch state is written only under its lock")
        return self._dir

    def exists(self) -> bool:
        """True when the state directory is there (refused if it is a link or not ours)."""
        return check_node(self.state, "dir") is not None

    def check(self) -> bool:
        """Whether the state directory is there, every node surgeon keeps in it checked (a link,
        a node of the wrong kind, another owner's or one writable by others is refused), and its
        root record, when it has one, this root's (another root's state is refused)."""
        with self._opened() as d:
            if d is None:
                return False
            self._check_nodes(d)
            return True

    def _check_nodes(self, d: DirHandle) -> None:
        for name, kind in _NODES:
            d.check(name, kind)
        data = d.read(rootrecord.RECORD)
        if data is not None:
            rec = rootrecord.parse_record(d.path / rootrecord.RECORD, data)
            me = rootrecord.identity(self.state.parent)
            if not rootrecord.belongs(rec, me):
                raise PatchError(rootrecord.foreign(self.state, rec, me))

    def verify(self) -> None:
        """Refuse to go on when ``.surgeon`` is no longer the directory this lock was taken in
        (moved away, swapped for a link): nothing is written through what replaced it."""
        if self._dir is not None and self._root_dir is not None and not self._dir.still_named(self._root_dir,
                                                                                               self.state.name):
            raise PatchError(f"{self.state}: moved or replaced while surgeon held it open; nothing was written "
                             f"through what is there now")

    def writable(self) -> bool:
        """Whether this process may write the state (the directory, else the root to create it)."""
        return os.access(self.state if self.exists() else self.root, os.W_OK)

    def journal_exists(self) -> bool:
        with self._opened() as d:
            return d is not None and d.check(JOURNAL, "file") is not None

    def record_problem(self) -> str | None:
        """Why a state directory without a root record may not be adopted as this root's: its
        manifest records patches under an id made elsewhere. None: it may be (or it has a record,
        or its manifest is damaged, which is reported as such)."""
        try:
            return self._unproven()
        except PatchError:
            return None

    def _unproven(self) -> str | None:
        with self._opened() as d:
            if d is None or d.check(rootrecord.RECORD, "file") is not None:
                return None
            data = d.read(MANIFEST)
        manifest = parse_manifest(self.manifest_path, data) if data is not None else self.empty_manifest()
        mid = manifest.get("id")
        if not manifest["patches"] or not mid or mid == rootrecord.derived_id(self.state.parent):
            return None
        return rootrecord.unproven(self.state, str(mid), rootrecord.identity(self.state.parent))

    def _adopt(self, d: DirHandle, force: bool) -> None:
        """Record this root as the state directory's owner when it has no record yet (see
        :mod:`surgeon.patch.rootrecord`); refused when its manifest says it was made elsewhere,
        unless ``force`` (``doctor --repair``). A damaged manifest adopts nothing (it is refused
        as damaged where it is read)."""
        if d.check(rootrecord.RECORD, "file") is not None:
            return
        try:
            why = self._unproven()
        except PatchError:
            return
        if why and not force:
            raise PatchError(why)
        me = rootrecord.identity(self.state.parent)
        d.write_atomic(rootrecord.RECORD, (json.dumps(me, indent=2, sort_keys=True) + "\n").encode())

    # -- blobs -------------------------------------------------------------------------------
    def blob_path(self, kind: str, sha: str) -> Path:
        if kind not in BLOB_KINDS or not isinstance(sha, str) or not SHA_RE.fullmatch(sha):
            raise PatchError(f"{self.state}: damaged state: {kind}/{str(sha)[:80]!r} is not a stored blob name")
        return self.state / kind / sha

    def store_blob(self, kind: str, data: bytes | None) -> str:
        if data is None:
            return ABSENT
        sha = sha256_bytes(data)
        self.blob_path(kind, sha)
        sub = self._held().sub(kind, create=True)
        assert sub is not None
        with sub:
            if sub.check(sha, "file") is None:
                sub.write_atomic(sha, data, 0o644)
        return sha

    @contextlib.contextmanager
    def _blobs(self, kind: str) -> Iterator[DirHandle | None]:
        """The ``kind`` blob directory held open (None when it or the state directory is absent)."""
        with self._opened() as d:
            sub = d.sub(kind) if d is not None else None
            with sub or contextlib.nullcontext():
                yield sub

    def has_blob(self, kind: str, sha: str) -> bool:
        if sha == ABSENT:
            return True
        self.blob_path(kind, sha)
        with self._blobs(kind) as sub:
            return sub is not None and sub.check(sha, "file") is not None

    def read_blob(self, kind: str, sha: str) -> bytes | None:
        if sha == ABSENT:
            return None
        path = self.blob_path(kind, sha)
        with self._blobs(kind) as sub:
            data = sub.read(sha) if sub is not None else None
        if data is None:
            raise PatchError(f"{path}: stored blob is missing; the state directory is damaged "
                             f"(`surgeon doctor` says what can be rebuilt)")
        if sha256_bytes(data) != sha:
            raise PatchError(f"{path}: stored blob does not match its sha256; the state directory is damaged")
        return data

    def blob_names(self, kind: str) -> list[str]:
        with self._blobs(kind) as sub:
            return [] if sub is None else sub.names()

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
        for kind in BLOB_KINDS:  # (ABSENT has no blob: it is never a file name here)
            gone = [name for k, name in drop if k == kind and name not in spared]
            with self._blobs(kind) as sub:
                for name in gone:
                    if sub is not None:
                        with contextlib.suppress(OSError):
                            sub.unlink(name)

    def clean_tmp(self) -> None:
        """Remove temp files a killed write left in the state directory and its blob directories."""
        _clean(self._held())
        for kind in BLOB_KINDS:
            with self._blobs(kind) as sub:
                if sub is not None:
                    _clean(sub)

    # -- manifest and journal ----------------------------------------------------------------
    @staticmethod
    def empty_manifest() -> dict[str, Any]:
        return {"format": MANIFEST_FORMAT, "txid": None, "patches": {}}

    def load_journal(self) -> dict[str, Any] | None:
        with self._opened() as d:
            data = d.read(JOURNAL) if d is not None else None
        return None if data is None else parse_journal(self.journal_path, data)

    def load_manifest(self) -> dict[str, Any]:
        with self._opened() as d:
            data = d.read(MANIFEST) if d is not None else None
        return self.empty_manifest() if data is None else parse_manifest(self.manifest_path, data)

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        """Replace state file ``name`` (``manifest.json``, ``journal.json``) atomically."""
        d = self._held()
        d.check(name, "file")  # a link or a directory there is refused, not replaced
        d.write_atomic(name, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode(), 0o644)

    def remove_journal(self) -> None:
        d = self._held()
        d.unlink(JOURNAL)
        d.fsync()

    # -- lock --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self, *, write: bool = True, adopt: bool = False) -> Iterator[bool]:
        """Hold the state directory's flock (re-entrant within this object) and the directory
        itself open; yields whether the lock is exclusive. ``write=False`` creates nothing: a
        shared lock when the lock file is there, none when it (or the state directory) is not.
        ``adopt``: record this root as the state's owner even where its manifest was made
        elsewhere (``doctor --repair``)."""
        if self._lock_depth:
            if write and not self._exclusive:
                raise RuntimeError("an exclusive patch lock asked for inside a shared one")
            self._lock_depth += 1
            try:
                yield True
            finally:
                self._lock_depth -= 1
            return
        with open_dir(self.state.parent) as root:
            if write:
                self._refuse_open_root(root)
            d = root.sub(self.state.name, create=write)
            if d is None:  # read-only and no state directory: nothing to lock or read
                yield False
                return
            with d:
                self._check_nodes(d)
                fd = d.open(LOCK, os.O_RDWR | os.O_CREAT if write else os.O_RDONLY, 0o644)
                self._dir, self._root_dir, self._lock_depth, self._exclusive = d, root, 1, write
                try:
                    with self._flocked(fd, write):
                        self.verify()
                        if write:
                            self._adopt(d, adopt)
                        yield write and fd is not None
                finally:
                    self._dir, self._root_dir, self._lock_depth, self._exclusive = None, None, 0, False

    def _refuse_open_root(self, root: DirHandle) -> None:
        """A root anyone may write into (mode o+w without the sticky bit) is refused for writing:
        anyone could swap the engine's files, or the state directory, under a patch."""
        st = root.stat()
        if others_may_write(st):
            raise PatchError(f"{self.state.parent}: engine root writable by others (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}, no sticky bit): anyone could swap its files "
                             f"under a patch; refusing to patch it (chmod o-w it first)")

    @contextlib.contextmanager
    def _flocked(self, fd: int | None, write: bool) -> Iterator[None]:
        """flock ``fd`` (exclusive when ``write``; nothing when None), the holder's pid written in
        place while held; closed afterwards."""
        if fd is None:  # read-only and no lock file: nobody can be writing without one
            yield
            return
        try:
            self._wait_for_lock(fd, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
            if write:
                os.pwrite(fd, f"{os.getpid()}\n".ljust(_PID_WIDTH).encode(), 0)
            try:
                yield
            finally:
                if write:
                    with contextlib.suppress(OSError):
                        os.pwrite(fd, b" " * _PID_WIDTH, 0)
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
                    raise PatchError(f"{self.state / LOCK}: cannot lock it ({e.strerror or e})") from None
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    raise PatchError(
                        f"{self.root}: another surgeon process (pid {holder}) holds the patch lock; "
                        f"waited {self.lock_timeout:g} s, try again when it finishes"
                    ) from None
                time.sleep(0.05)


def _clean(d: DirHandle) -> None:
    for name in d.names():
        if name.startswith(".") and name.endswith(TMP_SUFFIX):
            with contextlib.suppress(OSError):
                d.unlink(name)
