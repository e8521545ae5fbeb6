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
import hashlib
import json
import os
import re
import secrets
import stat
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from surgeon.core.errors import BadInput

MANIFEST_FORMAT = 1
TMP_SUFFIX = ".surgeon-tmp"

# Test hooks (fault injection). Never set in normal use.
_ENV_DELAY = "SURGEON_MANIFEST_TEST_DELAY"  # seconds to sleep at every transaction step
_ENV_CRASH_AT = "SURGEON_MANIFEST_TEST_CRASH_AT"  # os._exit(99) at the Nth step (1-based)

ABSENT = "absent"  # the "sha256" of a file that does not exist (created by a patch, deleted on revert)

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


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes | None, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically: temp in the same dir, fsync, replace, fsync dir.

    ``data=None`` deletes the file (a created file going back to absent)."""
    if data is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        _fsync_dir(path.parent)
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _file_sha(path: Path) -> str | None:
    try:
        return sha256_bytes(path.read_bytes())
    except FileNotFoundError:
        return None


def _file_version(path: Path) -> str:
    """sha256 of the file, or :data:`ABSENT` when there is none (for journal comparisons)."""
    return _file_sha(path) or ABSENT


def _mode(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o644


class _Hooks:
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


class PatchManager:
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
        self._lock_fd: int | None = None
        self._lock_depth = 0

    # ------------------------------------------------------------------ paths and storage
    @property
    def manifest_path(self) -> Path:
        return self.state / "manifest.json"

    @property
    def journal_path(self) -> Path:
        return self.state / "journal.json"

    def _blob(self, kind: str, sha: str) -> Path:
        assert kind in ("originals", "patched") and re.fullmatch(r"[0-9a-f]{64}", sha), (kind, sha)
        return self.state / kind / sha

    def _store_blob(self, kind: str, data: bytes | None) -> str:
        if data is None:
            return ABSENT
        sha = sha256_bytes(data)
        path = self._blob(kind, sha)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, data, 0o644)
        return sha

    def _read_blob(self, kind: str, sha: str) -> bytes | None:
        if sha == ABSENT:
            return None
        path = self._blob(kind, sha)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise PatchError(f"{path}: stored blob is missing; the state directory is damaged") from None
        if sha256_bytes(data) != sha:
            raise PatchError(f"{path}: stored blob does not match its sha256; the state directory is damaged")
        return data

    def _resolve(self, relpath: str) -> Path:
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

    def _existing_file(self, relpath: str) -> Path:
        path = self._resolve(relpath)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise PatchError(f"{relpath}: no such file under {self.root}") from None
        if not stat.S_ISREG(st.st_mode):
            raise PatchError(f"{relpath}: not a regular file")
        return path

    # ------------------------------------------------------------------ manifest and journal
    def _empty_manifest(self) -> dict[str, Any]:
        return {"format": MANIFEST_FORMAT, "txid": None, "patches": {}}

    def _load_json(self, path: Path) -> dict[str, Any] | None:
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

    def _load_manifest(self) -> dict[str, Any]:
        return self._load_json(self.manifest_path) or self._empty_manifest()

    def _write_json(self, path: Path, data: dict[str, Any]) -> None:
        _atomic_write(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode(), 0o644)

    # ------------------------------------------------------------------ lock
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
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
        deadline = time.monotonic() + self.lock_timeout
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
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

    # ------------------------------------------------------------------ transactions
    def _run_transaction(self, kind: str, ops: list[dict[str, Any]], blobs: dict[tuple[str, str], bytes],
                         new_manifest: dict[str, Any]) -> None:
        """ops: {relpath, from, from_kind, to, to_kind}; blobs: (kind, sha) -> bytes for every from/to."""
        hooks = _Hooks()
        for (bkind, sha), data in blobs.items():
            assert self._store_blob(bkind, data) == sha
        hooks.step("blobs")
        txid = secrets.token_hex(8)
        new_manifest = dict(new_manifest, txid=txid)
        journal = {"format": MANIFEST_FORMAT, "txid": txid, "kind": kind, "created": _now(),
                   "files": ops, "manifest": new_manifest}
        self._write_json(self.journal_path, journal)
        hooks.step("journal")
        try:
            for op in ops:
                path = self._resolve(op["relpath"])
                current = _file_version(path)
                if current != op["from"]:
                    raise PatchError(f"{op['relpath']}: changed on disk during the operation; rolled back")
                _atomic_write(path, blobs[(op["to_kind"], op["to"])], _mode(path))
                hooks.step("file")
            self._write_json(self.manifest_path, new_manifest)  # the commit record
        except BaseException as e:
            self._recover_locked()  # manifest not committed -> rolls back
            if isinstance(e, (PatchError, KeyboardInterrupt, SystemExit)):
                raise
            if isinstance(e, OSError):
                raise PatchError(f"{kind} failed and was rolled back: {e.strerror or e}") from e
            raise
        hooks.step("manifest")
        self._finish_journal(new_manifest)
        hooks.step("done")

    def _finish_journal(self, manifest: dict[str, Any]) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.journal_path)
        _fsync_dir(self.state)
        self._gc(manifest)

    def _gc(self, manifest: dict[str, Any]) -> None:
        """Drop blobs the committed manifest no longer references (only with no journal present)."""
        if self.journal_path.exists():
            return
        keep = {"originals": set(), "patched": set()}
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

    def recover(self) -> str | None:
        """Finish (manifest committed) or roll back (not committed) an interrupted transaction.

        Returns a one-line description of what was done, or None when there was nothing to do.
        """
        if not self.state.is_dir():
            return None
        with self._locked():
            return self._recover_locked()

    def _recover_locked(self) -> str | None:
        self._clean_tmp(self.state)
        journal = self._load_json(self.journal_path)
        if journal is None:
            if (self.state / "originals").is_dir() or (self.state / "patched").is_dir():
                self._gc(self._load_manifest())  # blobs of a transaction killed before its journal
            return None
        manifest = self._load_manifest()
        forward = manifest.get("txid") == journal["txid"]
        restored, warnings = [], []
        for op in journal["files"]:
            path = self._resolve(op["relpath"])
            self._clean_tmp(path.parent, path.name)
            want, other = ("to", "from") if forward else ("from", "to")
            current = _file_version(path)
            if current == op[want]:
                continue
            if current == op[other]:
                data = self._read_blob(op[f"{want}_kind"], op[want])
                _atomic_write(path, data, _mode(path))
                restored.append(op["relpath"])
            else:
                warnings.append(f"{op['relpath']} matches neither version; left alone")
        self._finish_journal(manifest)
        verb = "completed" if forward else "rolled back"
        msg = f"interrupted {journal['kind']} {verb}: {len(restored)} file(s) rewritten"
        if warnings:
            msg += "; " + "; ".join(warnings)
        return msg

    def _clean_tmp(self, directory: Path, name: str | None = None) -> None:
        if not directory.is_dir():
            return
        pattern = f".{name}.*{TMP_SUFFIX}" if name else f".*{TMP_SUFFIX}"
        for tmp in directory.glob(pattern):
            with contextlib.suppress(OSError):
                tmp.unlink()
        if name is None:
            for sub in ("originals", "patched"):
                if (directory / sub).is_dir():
                    self._clean_tmp(directory / sub)

    # ------------------------------------------------------------------ operations
    def _file_state(self, f: dict[str, Any]) -> str:
        current = _file_sha(self._resolve(f["relpath"]))
        if current is None:
            return "missing"
        return "applied" if current == f["sha256_after"] else "drifted"

    def _new_file(self, relpath: str) -> Path:
        """Where a patch may create ``relpath``: inside the root, in an existing directory."""
        path = self._resolve(relpath)
        if not path.parent.is_dir():
            raise PatchError(f"{relpath}: directory {path.parent.relative_to(self.root_resolved)} does not exist")
        return path

    def apply(self, name: str, changes: list[FileChange], *, spec_name: str, spec_sha256: str, engine: str,
              engine_version: str, replace: bool = False) -> ApplyResult:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise PatchError(f"{name!r}: a patch name is letters, digits and . _ + - (at most 128)")
        if not changes:
            raise PatchError(f"{name}: no file changes")
        seen: set[str] = set()
        for c in changes:
            if c.create:
                self._new_file(c.relpath)
            else:
                self._existing_file(c.relpath)
            if c.relpath in seen:
                raise PatchError(f"{c.relpath}: changed twice in patch {name}")
            seen.add(c.relpath)
        with self._locked():
            recovered = self._recover_locked()
            old = self._load_manifest()
            patches = old["patches"]
            owner = {f["relpath"]: p["name"] for p in patches.values() for f in p["files"]}
            originals: dict[str, bytes | None] = {}  # relpath -> pristine bytes (None: absent)
            for c in changes:
                if c.relpath in owner:
                    f = next(f for f in patches[owner[c.relpath]]["files"] if f["relpath"] == c.relpath)
                    originals[c.relpath] = self._read_blob("originals", f["sha256_before"])
                    if (originals[c.relpath] is None) != c.create:
                        raise PatchError(f"{c.relpath}: patch {owner[c.relpath]} "
                                         + ("edits it as an engine file; it cannot be created" if c.create
                                            else "created it; it cannot be edited as an engine file"))
                elif c.create:
                    path = self._new_file(c.relpath)
                    if path.exists():
                        left = path.is_file() and path.read_bytes()[:64] == c.new_text_bytes[:64]
                        raise PatchError(f"{c.relpath}: already exists and no applied surgeon patch created it"
                                         + ("; it looks like one a forced revert kept: delete it if nothing imports it"
                                            if left else "") + "; refusing to overwrite it")
                    originals[c.relpath] = None
                else:
                    originals[c.relpath] = self._existing_file(c.relpath).read_bytes()
                base = originals[c.relpath]
                if c.base_sha256 is not None and (base is None or sha256_bytes(base) != c.base_sha256):
                    raise PatchError(f"{c.relpath}: the original is not the file the rewriter read (sha256 differs)")
            target = {c.relpath: c.new_text_bytes for c in changes if c.new_text_bytes != originals[c.relpath]}
            if not target:
                raise PatchError(f"{name}: the changes leave every file as it is")
            target_sha = {r: sha256_bytes(b) for r, b in target.items()}


            if name in patches:
                mine = patches[name]
                same = ({f["relpath"]: f["sha256_after"] for f in mine["files"]} == target_sha
                        and mine["spec"] == {"name": spec_name, "sha256": spec_sha256}
                        and mine["engine"] == {"name": engine, "version": engine_version})
                if same:
                    bad = [f"{f['relpath']} ({s})" for f in mine["files"] if (s := self._file_state(f)) != "applied"]
                    if bad:
                        raise PatchError(f"{name}: already applied but drifted: {', '.join(bad)}; `surgeon revert --force` it first")
                    return ApplyResult(name, False, [], [], recovered)
            to_revert = sorted({owner[r] for r in target if r in owner} | ({name} if name in patches else set()))
            if to_revert and not replace:
                clash = sorted(r for r in target if r in owner and owner[r] != name)
                what = []
                if name in patches:
                    what.append(f"patch {name} is already applied with different changes")
                if clash:
                    what.append(f"{', '.join(clash)} already patched by {', '.join(sorted({owner[r] for r in clash}))}")
                what = "; ".join(what)
                raise PatchError(f"{name}: {what}; pass --replace to revert it first")
            for pname in to_revert:
                bad = [f"{f['relpath']} ({s})" for f in patches[pname]["files"] if (s := self._file_state(f)) != "applied"]
                if bad:
                    raise PatchError(f"cannot replace {pname}: drifted files {', '.join(bad)}; `surgeon revert --force` it first")

            ops: dict[str, dict[str, Any]] = {}
            blobs: dict[tuple[str, str], bytes] = {}
            for pname in to_revert:  # revert replaced patches: after -> original
                for f in patches[pname]["files"]:
                    ops[f["relpath"]] = {"relpath": f["relpath"], "from": f["sha256_after"], "from_kind": "patched",
                                         "to": f["sha256_before"], "to_kind": "originals"}
                    blobs[("patched", f["sha256_after"])] = self._read_blob("patched", f["sha256_after"])
                    blobs[("originals", f["sha256_before"])] = self._read_blob("originals", f["sha256_before"])
            files = []
            for relpath in sorted(target):
                orig_sha = ABSENT if originals[relpath] is None else sha256_bytes(originals[relpath])
                blobs[("originals", orig_sha)] = originals[relpath]
                blobs[("patched", target_sha[relpath])] = target[relpath]
                start = ops.get(relpath, {"from": orig_sha, "from_kind": "originals"})
                ops[relpath] = {"relpath": relpath, "from": start["from"], "from_kind": start["from_kind"],
                                "to": target_sha[relpath], "to_kind": "patched"}
                files.append({"relpath": relpath, "sha256_before": orig_sha, "sha256_after": target_sha[relpath]})
            op_list = [ops[r] for r in sorted(ops) if ops[r]["from"] != ops[r]["to"]]

            new = {"format": MANIFEST_FORMAT, "txid": None,
                   "patches": {k: v for k, v in patches.items() if k not in to_revert}}
            new["patches"][name] = {
                "name": name, "spec": {"name": spec_name, "sha256": spec_sha256},
                "engine": {"name": engine, "version": engine_version}, "created": _now(), "files": files,
            }
            self._run_transaction("apply", op_list, blobs, new)
            return ApplyResult(name, True, [op["relpath"] for op in op_list], [p for p in to_revert if p != name],
                               recovered)

    def revert(self, name: str | None = None, *, all: bool = False, force: bool = False) -> RevertResult:
        """Restore the originals of one patch (``name``), or of every patch (``all``).

        With neither, the single applied patch is reverted (refused when there are several).
        Drift (a file not byte-equal to what the patch wrote) is refused, naming the files; with
        ``force`` a file still equal to its original or patched version is handled normally and any
        other file is left alone, dropped from the manifest, and reported in ``warnings``.
        """
        if not self.state.is_dir():
            raise PatchError(f"{self.root}: no surgeon patches applied here")
        with self._locked():
            recovered = self._recover_locked()
            old = self._load_manifest()
            patches = old["patches"]
            if all:
                names = sorted(patches)
            elif name is not None:
                if name not in patches:
                    raise PatchError(f"{name}: no such patch applied under {self.root}")
                names = [name]
            elif len(patches) == 1:
                names = list(patches)
            elif not patches:
                raise PatchError(f"{self.root}: no surgeon patches applied here")
            else:
                raise PatchError(f"several patches applied ({', '.join(sorted(patches))}); name one or pass --all")
            result = RevertResult(recovered=recovered)
            ops, blobs, drifted = [], {}, []
            for pname in names:
                files = patches[pname]["files"]
                # a file left alone (drifted, with force) may still import what the patch created:
                # then the created files stay too, or the engine would no longer import
                kept = force and any(_file_version(self._resolve(f["relpath"])) not in (f["sha256_after"], f["sha256_before"])
                                     for f in files if f["sha256_before"] != ABSENT)
                for f in files:
                    current = _file_version(self._resolve(f["relpath"]))
                    if kept and f["sha256_before"] == ABSENT and current != ABSENT:
                        result.warnings.append(f"{f['relpath']}: created by {pname}, kept because a drifted file "
                                               f"left alone may import it; delete it once nothing does")
                        continue
                    if current == f["sha256_after"]:
                        ops.append({"relpath": f["relpath"], "from": f["sha256_after"], "from_kind": "patched",
                                    "to": f["sha256_before"], "to_kind": "originals"})
                        blobs[("patched", f["sha256_after"])] = self._read_blob("patched", f["sha256_after"])
                        blobs[("originals", f["sha256_before"])] = self._read_blob("originals", f["sha256_before"])
                    elif current == f["sha256_before"] and force:
                        result.warnings.append(f"{f['relpath']}: already original")
                    else:
                        state = "missing" if current == ABSENT else "drifted"
                        drifted.append(f"{f['relpath']} ({state})")
                        if force:
                            result.warnings.append(
                                f"{f['relpath']}: {state} (neither original nor as patched); left alone, dropped")
            if drifted and not force:
                raise PatchError(f"drift in {', '.join(names)}: {', '.join(drifted)}; "
                                 f"engine upgraded or edited by hand; `surgeon revert --force` leaves them alone and drops them")
            new = {"format": MANIFEST_FORMAT, "txid": None,
                   "patches": {k: v for k, v in patches.items() if k not in names}}
            self._run_transaction("revert", ops, blobs, new)
            result.reverted = names
            result.restored = [op["relpath"] for op in ops]
            return result

    def status(self) -> list[PatchStatus]:
        if not self.state.is_dir():
            return []
        with self._locked():
            self._recover_locked()
            out = []
            for p in sorted(self._load_manifest()["patches"].values(), key=lambda p: p["name"]):
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
        with self._locked():
            return {f["relpath"]: p["name"] for p in self._load_manifest()["patches"].values() for f in p["files"]}

    def original_bytes(self, relpath: str, *, recover: bool = True) -> bytes:
        """The pristine bytes of ``relpath`` (from the stored original if a patch changed it).

        This is what a rewriter must start from, e.g. before ``apply(..., replace=True)``. With
        ``recover=False`` nothing is written: an interrupted transaction is refused instead of
        finished or rolled back (for dry runs).
        """
        self._resolve(relpath)
        if self.state.is_dir():
            with self._locked():
                if not recover and self.journal_path.exists():
                    raise PatchError(f"{self.root}: an interrupted transaction is pending; "
                                     f"`surgeon status` finishes or rolls it back")
                if recover:
                    self._recover_locked()
                for p in self._load_manifest()["patches"].values():
                    for f in p["files"]:
                        if f["relpath"] == relpath:
                            if f["sha256_before"] == ABSENT:
                                raise PatchError(f"{relpath}: created by patch {p['name']}; it has no original")
                            return self._read_blob("originals", f["sha256_before"])  # type: ignore[return-value]
        return self._existing_file(relpath).read_bytes()

    def diff(self, name: str) -> str:
        """Unified diff original -> patched for every file of patch ``name`` (from stored blobs)."""
        if not self.state.is_dir():
            raise PatchError(f"{name}: no such patch applied under {self.root}")
        with self._locked():
            self._recover_locked()
            patches = self._load_manifest()["patches"]
            if name not in patches:
                raise PatchError(f"{name}: no such patch applied under {self.root}")
            chunks = []
            for f in patches[name]["files"]:
                before = self._read_blob("originals", f["sha256_before"])
                after = self._read_blob("patched", f["sha256_after"]) or b""
                a = (before or b"").decode("utf-8", "replace")
                b = after.decode("utf-8", "replace")
                chunks.extend(difflib.unified_diff(a.splitlines(keepends=True), b.splitlines(keepends=True),
                                                   fromfile="/dev/null" if before is None else f"a/{f['relpath']}",
                                                   tofile=f"b/{f['relpath']}"))
            out = []
            for line in chunks:  # keep the diff parseable when a file lacks a final newline
                out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
            return "".join(out)
