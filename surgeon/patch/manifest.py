"""Apply and revert file changes to an engine root (SGLang / vLLM install) without ever losing data.

The rewriter is a pure function ``text -> text``; this module takes its output as
:class:`FileChange` objects (bytes, untouched) and applies them to ``engine_root`` as one
transaction, records what it did in a manifest, and reverts byte-identically.

State lives inside the engine root, in ``<root>/.surgeon/``::

    manifest.json         the committed state: every applied patch and its files (atomic JSON)
    journal.json          present only while a transaction is in flight (atomic JSON)
    lock                  fcntl.flock'd by every operation (holder's pid written inside)
    originals/<sha256>    original bytes of every patched file (content-addressed)
    patched/<sha256>      patched bytes of every patched file (for diff and roll-forward)

A file a patch creates (the generated hooks module next to a model file) has the original
``absent`` (:data:`ABSENT` in place of a sha256): reverting it deletes the file, and a file of
that name that surgeon did not create is never overwritten.

Transaction protocol (apply, revert, apply --replace):

1. store the blobs of both versions of every touched file (fsync'd);
2. write ``journal.json`` atomically: a fresh ``txid``, every file with ``from``/``to`` sha256,
   and the complete manifest that will be committed;
3. replace each file atomically (temp file in the same directory, fsync, ``os.replace``, fsync
   of the directory; file mode kept);
4. commit: write ``manifest.json`` atomically, carrying the journal's ``txid``;
5. delete the journal (directory fsync'd), then drop blobs the manifest no longer needs.

Crash-recovery policy (:meth:`PatchManager.recover`, run at the start of every operation, under
the lock): if a journal exists and the manifest carries the journal's ``txid``, the commit record
was written, so the transaction is **rolled forward** (any file still at ``from`` is brought to
``to``; after step 4 that is normally nothing). Otherwise the transaction is **rolled back**: every
file at ``to`` is restored to ``from`` from its blob. Either way each file is always whole (atomic
replace) and after recovery the files and the manifest agree. A file matching neither ``from`` nor
``to`` (edited by hand in the crash window) is left alone and reported.

Every error the user can act on is a :class:`PatchError` (a :class:`surgeon.core.errors.BadInput`, exit
2) with a one-line message.
"""
from __future__ import annotations

import contextlib
import difflib
import errno
import fcntl
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from surgeon.core.errors import BadInput
from surgeon.patch.atomicfile import ABSENT, TMP_SUFFIX, sha256_bytes

# Every write goes through this module-level name (a test injects failures here).
from surgeon.patch.atomicfile import atomic_write as _atomic_write
from surgeon.patch.atomicfile import file_mode as _mode
from surgeon.patch.atomicfile import file_sha as _file_sha
from surgeon.patch.atomicfile import file_version as _file_version
from surgeon.patch.atomicfile import fsync_dir as _fsync_dir

__all__ = ["ABSENT", "MANIFEST_FORMAT", "TMP_SUFFIX", "ApplyResult", "FileChange", "FileStatus", "PatchError",
           "PatchManager", "PatchStatus", "RevertResult", "sha256_bytes"]

MANIFEST_FORMAT = 1

# Test hooks (fault injection). Never set in normal use.
_ENV_DELAY = "SURGEON_MANIFEST_TEST_DELAY"  # seconds to sleep at every transaction step
_ENV_CRASH_AT = "SURGEON_MANIFEST_TEST_CRASH_AT"  # os._exit(99) at the Nth step (1-based)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


class PatchError(BadInput):
    """A patch operation refused or failed; the message is one line."""


@dataclass
class FileChange:
    relpath: str  # relative to the engine root, '/'-separated
    new_text_bytes: bytes
    # optional guard: sha256 of the pristine bytes the rewriter read; refused if it differs
    base_sha256: str | None = None
    # the file must not exist yet (a generated module): revert deletes it
    create: bool = False


@dataclass
class FileStatus:
    relpath: str
    state: str  # applied | drifted | missing
    sha256_before: str
    sha256_after: str


@dataclass
class PatchStatus:
    name: str
    spec_name: str
    spec_sha256: str
    engine: str
    engine_version: str
    created: str
    files: list[FileStatus]

    @property
    def state(self) -> str:
        states = {f.state for f in self.files}
        return "applied" if states <= {"applied"} else ("missing" if "missing" in states else "drifted")


@dataclass
class ApplyResult:
    name: str
    changed: bool  # False: already applied with identical changes (no-op)
    files: list[str] = field(default_factory=list)  # relpaths written by this transaction
    replaced: list[str] = field(default_factory=list)  # patches reverted first (replace=True)
    recovered: str | None = None  # what recover() did before this operation, if anything


@dataclass
class RevertResult:
    reverted: list[str] = field(default_factory=list)  # patch names dropped from the manifest
    restored: list[str] = field(default_factory=list)  # relpaths restored to their originals
    warnings: list[str] = field(default_factory=list)  # force: files left alone and dropped
    recovered: str | None = None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class _FaultInjection:
    """Fault-injection points for tests (env-driven, inert unless the variables are set)."""

    def __init__(self) -> None:
        self.delay = float(os.environ.get(_ENV_DELAY) or 0)
        crash = os.environ.get(_ENV_CRASH_AT)
        self.crash_at = int(crash) if crash else None
        self.count = 0

    def step(self, what: str) -> None:
        self.count += 1
        if self.crash_at is not None and self.count == self.crash_at:
            os._exit(99)
        if self.delay:
            time.sleep(self.delay)


class EngineRootPaths:
    """Relative paths of engine files, turned into paths that are certainly inside the engine root.

    Every file a patch touches goes through here first, so a manifest or a change can never make
    surgeon write outside the root, through a symlink, or into its own state directory."""

    def __init__(self, root: Path, root_resolved: Path, state_dir_name: str) -> None:
        self.root, self.root_resolved, self.state_dir_name = root, root_resolved, state_dir_name

    def resolve(self, relpath: str) -> Path:
        """The absolute path for ``relpath``, refused unless it lies inside the root (no symlinks)."""
        if not isinstance(relpath, str) or not relpath:
            raise PatchError(f"{relpath!r}: empty path")
        if "\\" in relpath or "\0" in relpath:
            raise PatchError(f"{relpath}: path must be '/'-separated and plain")
        if relpath.startswith("/") or re.match(r"^[A-Za-z]:", relpath):
            raise PatchError(f"{relpath}: absolute path; paths are relative to the engine root")
        parts = relpath.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise PatchError(f"{relpath}: path must not contain '..', '.' or empty components")
        if parts[0] == self.state_dir_name:
            raise PatchError(f"{relpath}: inside surgeon's own state directory")
        path = self.root_resolved.joinpath(*parts)
        # no component may be a symlink: the file we replace is exactly the one under the root
        cur = self.root_resolved
        for p in parts:
            cur = cur / p
            if cur.is_symlink():
                target = cur.resolve()
                where = "outside" if not target.is_relative_to(self.root_resolved) else "inside"
                raise PatchError(f"{relpath}: goes through a symlink ({cur.name} -> {where} the engine root)")
        if path.resolve() != path:
            raise PatchError(f"{relpath}: resolves outside the engine root")
        return path

    def existing_file(self, relpath: str) -> Path:
        path = self.resolve(relpath)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise PatchError(f"{relpath}: no such file under {self.root}") from None
        if not stat.S_ISREG(st.st_mode):
            raise PatchError(f"{relpath}: not a regular file")
        return path

    def new_file(self, relpath: str) -> Path:
        """Where a patch may create ``relpath``: inside the root, in an existing directory."""
        path = self.resolve(relpath)
        if not path.parent.is_dir():
            raise PatchError(f"{relpath}: directory {path.parent.relative_to(self.root_resolved)} does not exist")
        return path


class StateStore:
    """The state directory ``<root>/.surgeon``: manifest and journal JSON, content-addressed blobs,
    and the lock every operation holds. Knows the on-disk formats; knows nothing of patches."""

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

    # -- blobs -------------------------------------------------------------------------------
    def blob_path(self, kind: str, sha: str) -> Path:
        assert kind in ("originals", "patched") and re.fullmatch(r"[0-9a-f]{64}", sha), (kind, sha)
        return self.state / kind / sha

    def store_blob(self, kind: str, data: bytes | None) -> str:
        if data is None:
            return ABSENT
        sha = sha256_bytes(data)
        path = self.blob_path(kind, sha)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, data, 0o644)
        return sha

    def read_blob(self, kind: str, sha: str) -> bytes | None:
        if sha == ABSENT:
            return None
        path = self.blob_path(kind, sha)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise PatchError(f"{path}: stored blob is missing; the state directory is damaged") from None
        if sha256_bytes(data) != sha:
            raise PatchError(f"{path}: stored blob does not match its sha256; the state directory is damaged")
        return data

    def gc(self, manifest: dict[str, Any]) -> None:
        """Drop blobs the committed manifest no longer references (only with no journal present)."""
        if self.journal_path.exists():
            return
        keep: dict[str, set[str]] = {"originals": set(), "patched": set()}
        for p in manifest["patches"].values():
            for f in p["files"]:
                keep["originals"].add(f["sha256_before"])
                keep["patched"].add(f["sha256_after"])
        for kind, shas in keep.items():
            d = self.state / kind
            if not d.is_dir():
                continue
            for blob in d.iterdir():  # (ABSENT has no blob: it is never a file name here)
                if blob.name not in shas:
                    with contextlib.suppress(OSError):
                        blob.unlink()

    def clean_tmp(self, directory: Path, name: str | None = None) -> None:
        if not directory.is_dir():
            return
        pattern = f".{name}.*{TMP_SUFFIX}" if name else f".*{TMP_SUFFIX}"
        for tmp in directory.glob(pattern):
            with contextlib.suppress(OSError):
                tmp.unlink()
        if name is None:
            for sub in ("originals", "patched"):
                if (directory / sub).is_dir():
                    self.clean_tmp(directory / sub)

    # -- manifest and journal ----------------------------------------------------------------
    @staticmethod
    def empty_manifest() -> dict[str, Any]:
        return {"format": MANIFEST_FORMAT, "txid": None, "patches": {}}

    def load_json(self, path: Path) -> dict[str, Any] | None:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PatchError(f"{path}: unreadable ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise PatchError(f"{path}: unknown format (expected format {MANIFEST_FORMAT})")
        return data

    def load_manifest(self) -> dict[str, Any]:
        return self.load_json(self.manifest_path) or self.empty_manifest()

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        _atomic_write(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode(), 0o644)

    # -- lock --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the state directory's flock (re-entrant within this object)."""
        if self._lock_depth:
            self._lock_depth += 1
            try:
                yield
            finally:
                self._lock_depth -= 1
            return
        try:
            self.state.mkdir(exist_ok=True)
            fd = os.open(self.state / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise PatchError(f"{self.state}: cannot create the lock ({e.strerror or e})") from None
        try:
            self._wait_for_lock(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._lock_fd, self._lock_depth = fd, 1
            try:
                yield
            finally:
                self._lock_fd, self._lock_depth = None, 0
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _wait_for_lock(self, fd: int) -> None:
        """flock ``fd``, polling until ``lock_timeout``; then name the holder's pid."""
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    raise PatchError(
                        f"{self.root}: another surgeon process (pid {holder}) holds the patch lock; "
                        f"waited {self.lock_timeout:g} s, try again when it finishes"
                    ) from None
                time.sleep(0.05)


class TransactionJournal:
    """Runs a transaction under ``journal.json`` and recovers an interrupted one (the protocol and
    the crash-recovery policy in the module docstring). Call only with the store's lock held."""

    def __init__(self, store: StateStore, paths: EngineRootPaths) -> None:
        self.store, self.paths = store, paths

    def run(self, kind: str, ops: list[dict[str, Any]], blobs: dict[tuple[str, str], bytes | None],
            new_manifest: dict[str, Any]) -> None:
        """ops: {relpath, from, from_kind, to, to_kind}; blobs: (kind, sha) -> bytes for every from/to."""
        faults = _FaultInjection()
        for (bkind, sha), data in blobs.items():
            assert self.store.store_blob(bkind, data) == sha
        faults.step("blobs")
        txid = secrets.token_hex(8)
        new_manifest = dict(new_manifest, txid=txid)
        journal = {"format": MANIFEST_FORMAT, "txid": txid, "kind": kind, "created": _now(),
                   "files": ops, "manifest": new_manifest}
        self.store.write_json(self.store.journal_path, journal)
        faults.step("journal")
        try:
            for op in ops:
                path = self.paths.resolve(op["relpath"])
                current = _file_version(path)
                if current != op["from"]:
                    raise PatchError(f"{op['relpath']}: changed on disk during the operation; rolled back")
                _atomic_write(path, blobs[(op["to_kind"], op["to"])], _mode(path))
                faults.step("file")
            self.store.write_json(self.store.manifest_path, new_manifest)  # the commit record
        except BaseException as e:
            self.recover()  # manifest not committed -> rolls back
            if isinstance(e, (PatchError, KeyboardInterrupt, SystemExit)):
                raise
            if isinstance(e, OSError):
                raise PatchError(f"{kind} failed and was rolled back: {e.strerror or e}") from e
            raise
        faults.step("manifest")
        self._finish(new_manifest)
        faults.step("done")

    def _finish(self, manifest: dict[str, Any]) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.store.journal_path)
        _fsync_dir(self.store.state)
        self.store.gc(manifest)

    def recover(self) -> str | None:
        """Finish (manifest committed) or roll back (not committed) an interrupted transaction.

        Returns a one-line description of what was done, or None when there was nothing to do."""
        store = self.store
        store.clean_tmp(store.state)
        journal = store.load_json(store.journal_path)
        if journal is None:
            if (store.state / "originals").is_dir() or (store.state / "patched").is_dir():
                store.gc(store.load_manifest())  # blobs of a transaction killed before its journal
            return None
        manifest = store.load_manifest()
        forward = manifest.get("txid") == journal["txid"]
        restored, warnings = [], []
        for op in journal["files"]:
            path = self.paths.resolve(op["relpath"])
            store.clean_tmp(path.parent, path.name)
            want, other = ("to", "from") if forward else ("from", "to")
            current = _file_version(path)
            if current == op[want]:
                continue
            if current == op[other]:
                data = store.read_blob(op[f"{want}_kind"], op[want])
                _atomic_write(path, data, _mode(path))
                restored.append(op["relpath"])
            else:
                warnings.append(f"{op['relpath']} matches neither version; left alone")
        self._finish(manifest)
        verb = "completed" if forward else "rolled back"
        msg = f"interrupted {journal['kind']} {verb}: {len(restored)} file(s) rewritten"
        if warnings:
            msg += "; " + "; ".join(warnings)
        return msg


class PatchManager:
    """Apply, revert and inspect named patches of one engine root, each operation one transaction
    under the state directory's lock, after recovering any interrupted one."""

    def __init__(self, engine_root: Path, *, state_dir_name: str = ".surgeon", lock_timeout: float = 5.0):
        self.root = Path(engine_root)
        if not self.root.is_dir():
            raise PatchError(f"{engine_root}: engine root is not a directory")
        self.root_resolved = self.root.resolve()
        if not state_dir_name or "/" in state_dir_name or state_dir_name in (".", ".."):
            raise PatchError(f"bad state directory name {state_dir_name!r}")
        self.state_dir_name = state_dir_name
        self.state = self.root_resolved / state_dir_name
        self.lock_timeout = lock_timeout
        self.paths = EngineRootPaths(self.root, self.root_resolved, state_dir_name)
        self.store = StateStore(self.state, self.root, lock_timeout)
        self.journal = TransactionJournal(self.store, self.paths)

    @property
    def manifest_path(self) -> Path:
        return self.store.manifest_path

    @property
    def journal_path(self) -> Path:
        return self.store.journal_path

    def _recover_locked(self) -> str | None:
        return self.journal.recover()

    def _file_state(self, f: dict[str, Any]) -> str:
        current = _file_sha(self.paths.resolve(f["relpath"]))
        if current is None:
            return "missing"
        return "applied" if current == f["sha256_after"] else "drifted"

    def _drifted(self, patch: dict[str, Any]) -> list[str]:
        """``relpath (state)`` of every file of ``patch`` that is not as the patch wrote it."""
        return [f"{f['relpath']} ({s})" for f in patch["files"] if (s := self._file_state(f)) != "applied"]

    # ------------------------------------------------------------------ apply
    def apply(self, name: str, changes: list[FileChange], *, spec_name: str, spec_sha256: str, engine: str,
              engine_version: str, replace: bool = False) -> ApplyResult:
        self._check_changes(name, changes)
        with self.store.locked():
            recovered = self._recover_locked()
            patches = self.store.load_manifest()["patches"]
            owner = {f["relpath"]: p["name"] for p in patches.values() for f in p["files"]}
            originals = self._pristine_originals(changes, patches, owner)
            target = {c.relpath: c.new_text_bytes for c in changes if c.new_text_bytes != originals[c.relpath]}
            if not target:
                raise PatchError(f"{name}: the changes leave every file as it is")
            target_sha = {r: sha256_bytes(b) for r, b in target.items()}
            record = {"name": name, "spec": {"name": spec_name, "sha256": spec_sha256},
                      "engine": {"name": engine, "version": engine_version}}
            if self._already_applied(patches.get(name), record, target_sha):
                return ApplyResult(name, False, [], [], recovered)
            to_revert = self._patches_to_replace(name, patches, owner, target, replace)
            op_list, blobs, files = self._apply_ops(patches, to_revert, originals, target, target_sha)
            new: dict[str, Any] = {"format": MANIFEST_FORMAT, "txid": None,
                   "patches": {k: v for k, v in patches.items() if k not in to_revert}}
            new["patches"][name] = {**record, "created": _now(), "files": files}
            self.journal.run("apply", op_list, blobs, new)
            return ApplyResult(name, True, [op["relpath"] for op in op_list], [p for p in to_revert if p != name],
                               recovered)

    def _check_changes(self, name: str, changes: list[FileChange]) -> None:
        """Refuse a bad name, no changes, a path outside the root, or a file changed twice."""
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise PatchError(f"{name!r}: a patch name is letters, digits and . _ + - (at most 128)")
        if not changes:
            raise PatchError(f"{name}: no file changes")
        seen: set[str] = set()
        for c in changes:
            if c.create:
                self.paths.new_file(c.relpath)
            else:
                self.paths.existing_file(c.relpath)
            if c.relpath in seen:
                raise PatchError(f"{c.relpath}: changed twice in patch {name}")
            seen.add(c.relpath)

    def _pristine_originals(self, changes: list[FileChange], patches: dict[str, Any],
                            owner: dict[str, str]) -> dict[str, bytes | None]:
        """relpath -> pristine bytes (None: absent): the stored original of a patched file, else the
        file on disk; refused where the change does not fit the file (created vs edited, base sha)."""
        originals: dict[str, bytes | None] = {}
        for c in changes:
            if c.relpath in owner:
                f = next(f for f in patches[owner[c.relpath]]["files"] if f["relpath"] == c.relpath)
                originals[c.relpath] = self.store.read_blob("originals", f["sha256_before"])
                if (originals[c.relpath] is None) != c.create:
                    raise PatchError(f"{c.relpath}: patch {owner[c.relpath]} "
                                     + ("edits it as an engine file; it cannot be created" if c.create
                                        else "created it; it cannot be edited as an engine file"))
            elif c.create:
                self._refuse_foreign_file(c)
                originals[c.relpath] = None
            else:
                originals[c.relpath] = self.paths.existing_file(c.relpath).read_bytes()
            base = originals[c.relpath]
            if c.base_sha256 is not None and (base is None or sha256_bytes(base) != c.base_sha256):
                raise PatchError(f"{c.relpath}: the original is not the file the rewriter read (sha256 differs)")
        return originals

    def _refuse_foreign_file(self, c: FileChange) -> None:
        """A file to create must not exist: one no applied patch created is never overwritten."""
        path = self.paths.new_file(c.relpath)
        if path.exists():
            left = path.is_file() and path.read_bytes()[:64] == c.new_text_bytes[:64]
            raise PatchError(f"{c.relpath}: already exists and no applied surgeon patch created it"
                             + ("; it looks like one a forced revert kept: delete it if nothing imports it"
                                if left else "") + "; refusing to overwrite it")

    def _already_applied(self, mine: dict[str, Any] | None, record: dict[str, Any], target_sha: dict[str, str]) -> bool:
        """True when patch ``record['name']`` is applied with exactly these changes (a no-op);
        refused when it is but its files drifted."""
        if mine is None:
            return False
        same = ({f["relpath"]: f["sha256_after"] for f in mine["files"]} == target_sha
                and mine["spec"] == record["spec"] and mine["engine"] == record["engine"])
        if not same:
            return False
        bad = self._drifted(mine)
        if bad:
            raise PatchError(f"{record['name']}: already applied but drifted: {', '.join(bad)}; "
                             f"`surgeon revert --force` it first")
        return True

    def _patches_to_replace(self, name: str, patches: dict[str, Any], owner: dict[str, str],
                            target: dict[str, bytes], replace: bool) -> list[str]:
        """Patches the new one replaces (itself, and owners of files it changes): refused without
        ``replace``, or when any of them drifted."""
        to_revert = sorted({owner[r] for r in target if r in owner} | ({name} if name in patches else set()))
        if to_revert and not replace:
            clash = sorted(r for r in target if r in owner and owner[r] != name)
            what = []
            if name in patches:
                what.append(f"patch {name} is already applied with different changes")
            if clash:
                what.append(f"{', '.join(clash)} already patched by {', '.join(sorted({owner[r] for r in clash}))}")
            raise PatchError(f"{name}: {'; '.join(what)}; pass --replace to revert it first")
        for pname in to_revert:
            bad = self._drifted(patches[pname])
            if bad:
                raise PatchError(f"cannot replace {pname}: drifted files {', '.join(bad)}; `surgeon revert --force` it first")
        return to_revert

    def _revert_op(self, f: dict[str, Any], blobs: dict[tuple[str, str], bytes | None]) -> dict[str, Any]:
        """The journal op taking file record ``f`` from patched back to original; its blobs go to ``blobs``."""
        blobs[("patched", f["sha256_after"])] = self.store.read_blob("patched", f["sha256_after"])
        blobs[("originals", f["sha256_before"])] = self.store.read_blob("originals", f["sha256_before"])
        return {"relpath": f["relpath"], "from": f["sha256_after"], "from_kind": "patched",
                "to": f["sha256_before"], "to_kind": "originals"}

    def _apply_ops(self, patches: dict[str, Any], to_revert: list[str], originals: dict[str, bytes | None],
                   target: dict[str, bytes], target_sha: dict[str, str]) -> tuple[list, dict, list]:
        """(journal ops, blobs, the new patch's file records): replaced patches go back to their
        originals and each target file goes from wherever that leaves it to its patched bytes."""
        ops: dict[str, dict[str, Any]] = {}
        blobs: dict[tuple[str, str], bytes | None] = {}
        for pname in to_revert:  # revert replaced patches: after -> original
            for f in patches[pname]["files"]:
                ops[f["relpath"]] = self._revert_op(f, blobs)
        files = []
        for relpath in sorted(target):
            original = originals[relpath]
            orig_sha = ABSENT if original is None else sha256_bytes(original)
            blobs[("originals", orig_sha)] = original
            blobs[("patched", target_sha[relpath])] = target[relpath]
            start = ops.get(relpath, {"from": orig_sha, "from_kind": "originals"})
            ops[relpath] = {"relpath": relpath, "from": start["from"], "from_kind": start["from_kind"],
                            "to": target_sha[relpath], "to_kind": "patched"}
            files.append({"relpath": relpath, "sha256_before": orig_sha, "sha256_after": target_sha[relpath]})
        op_list = [ops[r] for r in sorted(ops) if ops[r]["from"] != ops[r]["to"]]
        return op_list, blobs, files

    # ------------------------------------------------------------------ revert
    def revert(self, name: str | None = None, *, all: bool = False, force: bool = False) -> RevertResult:
        """Restore the originals of one patch (``name``), or of every patch (``all``).

        With neither, the single applied patch is reverted (refused when there are several).
        Drift (a file not byte-equal to what the patch wrote) is refused, naming the files; with
        ``force`` a file still equal to its original or patched version is handled normally and any
        other file is left alone, dropped from the manifest, and reported in ``warnings``.
        """
        if not self.state.is_dir():
            raise PatchError(f"{self.root}: no surgeon patches applied here")
        with self.store.locked():
            recovered = self._recover_locked()
            patches = self.store.load_manifest()["patches"]
            names = self._patches_to_revert(patches, name, all)
            result = RevertResult(recovered=recovered)
            ops: list[dict[str, Any]] = []
            blobs: dict[tuple[str, str], bytes | None] = {}
            drifted: list[str] = []
            for pname in names:
                self._revert_patch_files(pname, patches[pname]["files"], force, ops, blobs, drifted, result)
            if drifted and not force:
                raise PatchError(f"drift in {', '.join(names)}: {', '.join(drifted)}; "
                                 f"engine upgraded or edited by hand; `surgeon revert --force` leaves them alone and drops them")
            new = {"format": MANIFEST_FORMAT, "txid": None,
                   "patches": {k: v for k, v in patches.items() if k not in names}}
            self.journal.run("revert", ops, blobs, new)
            result.reverted = names
            result.restored = [op["relpath"] for op in ops]
            return result

    def _patches_to_revert(self, patches: dict[str, Any], name: str | None, all: bool) -> list[str]:
        if all:
            return sorted(patches)
        if name is not None:
            if name not in patches:
                raise PatchError(f"{name}: no such patch applied under {self.root}")
            return [name]
        if len(patches) == 1:
            return list(patches)
        if not patches:
            raise PatchError(f"{self.root}: no surgeon patches applied here")
        raise PatchError(f"several patches applied ({', '.join(sorted(patches))}); name one or pass --all")

    def _revert_patch_files(self, pname: str, files: list[dict[str, Any]], force: bool, ops: list[dict[str, Any]],
                            blobs: dict[tuple[str, str], bytes | None], drifted: list[str], result: RevertResult) -> None:
        """Add the journal ops that restore patch ``pname``'s files; collect drift (and, with
        ``force``, the warnings for files left alone) instead of refusing here."""
        # a file left alone (drifted, with force) may still import what the patch created:
        # then the created files stay too, or the engine would no longer import
        kept = force and any(_file_version(self.paths.resolve(f["relpath"])) not in (f["sha256_after"], f["sha256_before"])
                             for f in files if f["sha256_before"] != ABSENT)
        for f in files:
            current = _file_version(self.paths.resolve(f["relpath"]))
            if kept and f["sha256_before"] == ABSENT and current != ABSENT:
                result.warnings.append(f"{f['relpath']}: created by {pname}, kept because a drifted file "
                                       f"left alone may import it; delete it once nothing does")
                continue
            if current == f["sha256_after"]:
                ops.append(self._revert_op(f, blobs))
            elif current == f["sha256_before"] and force:
                result.warnings.append(f"{f['relpath']}: already original")
            else:
                state = "missing" if current == ABSENT else "drifted"
                drifted.append(f"{f['relpath']} ({state})")
                if force:
                    result.warnings.append(
                        f"{f['relpath']}: {state} (neither original nor as patched); left alone, dropped")

    # ------------------------------------------------------------------ inspection
    def recover(self) -> str | None:
        """Finish (manifest committed) or roll back (not committed) an interrupted transaction.

        Returns a one-line description of what was done, or None when there was nothing to do.
        """
        if not self.state.is_dir():
            return None
        with self.store.locked():
            return self._recover_locked()

    def status(self) -> list[PatchStatus]:
        if not self.state.is_dir():
            return []
        with self.store.locked():
            self._recover_locked()
            out = []
            for p in sorted(self.store.load_manifest()["patches"].values(), key=lambda p: p["name"]):
                out.append(PatchStatus(
                    p["name"], p["spec"]["name"], p["spec"]["sha256"], p["engine"]["name"], p["engine"]["version"],
                    p["created"],
                    [FileStatus(f["relpath"], self._file_state(f), f["sha256_before"], f["sha256_after"])
                     for f in p["files"]],
                ))
            return out

    def owners(self) -> dict[str, str]:
        """relpath -> name of the patch that owns it, read without recovering or writing anything."""
        if not self.manifest_path.exists():
            return {}
        with self.store.locked():
            return {f["relpath"]: p["name"] for p in self.store.load_manifest()["patches"].values() for f in p["files"]}

    def original_bytes(self, relpath: str, *, recover: bool = True) -> bytes:
        """The pristine bytes of ``relpath`` (from the stored original if a patch changed it).

        This is what a rewriter must start from, e.g. before ``apply(..., replace=True)``. With
        ``recover=False`` nothing is written: an interrupted transaction is refused instead of
        finished or rolled back (for dry runs).
        """
        self.paths.resolve(relpath)
        if self.state.is_dir():
            with self.store.locked():
                if not recover and self.journal_path.exists():
                    raise PatchError(f"{self.root}: an interrupted transaction is pending; "
                                     f"`surgeon status` finishes or rolls it back")
                if recover:
                    self._recover_locked()
                for p in self.store.load_manifest()["patches"].values():
                    for f in p["files"]:
                        if f["relpath"] == relpath:
                            if f["sha256_before"] == ABSENT:
                                raise PatchError(f"{relpath}: created by patch {p['name']}; it has no original")
                            blob = self.store.read_blob("originals", f["sha256_before"])
                            assert blob is not None  # read_blob returns None only for ABSENT, excluded above
                            return blob
        return self.paths.existing_file(relpath).read_bytes()

    def diff(self, name: str) -> str:
        """Unified diff original -> patched for every file of patch ``name`` (from stored blobs)."""
        if not self.state.is_dir():
            raise PatchError(f"{name}: no such patch applied under {self.root}")
        with self.store.locked():
            self._recover_locked()
            patches = self.store.load_manifest()["patches"]
            if name not in patches:
                raise PatchError(f"{name}: no such patch applied under {self.root}")
            chunks: list[str] = []
            for f in patches[name]["files"]:
                before = self.store.read_blob("originals", f["sha256_before"])
                after = self.store.read_blob("patched", f["sha256_after"]) or b""
                a = (before or b"").decode("utf-8", "replace")
                b = after.decode("utf-8", "replace")
                chunks.extend(difflib.unified_diff(a.splitlines(keepends=True), b.splitlines(keepends=True),
                                                   fromfile="/dev/null" if before is None else f"a/{f['relpath']}",
                                                   tofile=f"b/{f['relpath']}"))
            out = []
            for line in chunks:  # keep the diff parseable when a file lacks a final newline
                out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
            return "".join(out)
