"""Apply and revert file changes to an engine root (SGLang / vLLM install) without ever losing data.

The rewriter is a pure function ``text -> text``; this module takes its output as
:class:`FileChange` objects (bytes, untouched) and applies them to ``engine_root`` as one
transaction, records what it did in a manifest, and reverts byte-identically.

State lives inside the engine root, in ``<root>/.surgeon/``::

    manifest.json         the committed state: every applied patch and its files (atomic JSON)
    journal.json          present only while a transaction is in flight (atomic JSON)
    lock                  fcntl.flock'd by every operation (holder's pid written in place, never truncated)
    root.json             the engine root this state belongs to (path, device, inode): another root's is refused
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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgeon.core.atomicfile import ABSENT, TMP_SUFFIX, sha256_bytes
from surgeon.patch.journal import TransactionJournal, now, os_error
from surgeon.patch.markers import find_markers
from surgeon.patch.reader import FileStatus, Inspection, PatchReader, PatchStatus, Unrecorded, default_scan_dirs
from surgeon.patch.rootpaths import EngineRootPaths
from surgeon.patch.statedir import PatchError
from surgeon.patch.statefiles import MANIFEST_FORMAT
from surgeon.patch.statefiles import NAME_RE as _NAME_RE
from surgeon.patch.statestore import StateStore

__all__ = ["ABSENT", "MANIFEST_FORMAT", "TMP_SUFFIX", "ApplyResult", "FileChange", "FileStatus", "Inspection",
           "PatchError", "PatchManager", "PatchStatus", "RevertResult", "Unrecorded", "sha256_bytes"]

@dataclass
class FileChange:
    relpath: str  # relative to the engine root, '/'-separated
    new_text_bytes: bytes
    # optional guard: sha256 of the pristine bytes the rewriter read; refused if it differs
    base_sha256: str | None = None
    # the file must not exist yet (a generated module): revert deletes it
    create: bool = False


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


class PatchManager(PatchReader):
    """Apply, revert and inspect named patches of one engine root, each operation one transaction
    under the state directory's lock, after recovering any interrupted one."""

    def __init__(self, engine_root: Path, *, state_dir_name: str = ".surgeon", lock_timeout: float = 5.0,
                 scan_dirs: list[str] | None = None):
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
        self.journal = TransactionJournal(self.store, self.paths, self._marked_blobs)
        # where status looks for patch markers (besides the directories of recorded files)
        self.scan_dirs = default_scan_dirs(self.root_resolved) if scan_dirs is None else list(scan_dirs)

    def _recover_locked(self) -> str | None:
        try:
            return self.journal.recover()
        except OSError as e:
            raise PatchError(f"recovering an interrupted transaction failed: {os_error(e)}") from None

    def _drifted(self, patch: dict[str, Any]) -> list[str]:
        """``relpath (state)`` of every file of ``patch`` that is not as the patch wrote it."""
        return [f"{f['relpath']} ({s})" for f in patch["files"] if (s := self._file_state(f)) != "applied"]

    # ------------------------------------------------------------------ apply
    def apply(self, name: str, changes: list[FileChange], *, spec_name: str, spec_sha256: str, engine: str,
              engine_version: str, replace: bool = False, manifest_id: str | None = None) -> ApplyResult:
        """Apply ``changes`` as patch ``name`` (one transaction). ``manifest_id``: the id the
        changes' markers carry (:meth:`manifest_id` at plan time); refused if the root's differs."""
        self._check_changes(name, changes)
        with self.store.locked():
            recovered = self._recover_locked()
            manifest = self.store.load_manifest()
            mid = self._check_manifest_id(manifest, manifest_id)
            patches = manifest["patches"]
            owner = {f["relpath"]: p["name"] for p in patches.values() for f in p["files"]}
            originals = self._pristine_originals(changes, patches, owner)
            self.refuse_foreign_markers(changes, owner, originals)
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
            new: dict[str, Any] = {"format": MANIFEST_FORMAT, "txid": None, "id": mid,
                                   "patches": {k: v for k, v in patches.items() if k not in to_revert}}
            new["patches"][name] = {**record, "created": now(), "files": files}
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

    def _check_manifest_id(self, manifest: dict[str, Any], manifest_id: str | None) -> str:
        """The id the new manifest carries: the root's (refused when the plan's differs), else the plan's."""
        mid = manifest.get("id")
        if mid and manifest_id and mid != manifest_id:
            raise PatchError(f"{self.manifest_path}: its id changed since the patch was planned "
                             f"({manifest_id} -> {mid}); plan it again")
        return str(mid or manifest_id or self.manifest_id())

    def refuse_foreign_markers(self, changes: list[FileChange], owner: dict[str, str],
                                originals: dict[str, bytes | None]) -> None:
        """A file no recorded patch owns but which carries a patch marker is still patched (the
        manifest was lost, a forced revert kept it, another root's state patched it): refused,
        never stacked on."""
        for c in changes:
            data = originals[c.relpath]
            if c.relpath in owner or data is None:
                continue
            found = find_markers(data)
            if found:
                mk = found[0]
                raise PatchError(f"{c.relpath}: already carries surgeon patch {mk.name} (manifest {mk.manifest_id}) "
                                 f"that {self.manifest_path} does not record; refusing to patch it again: "
                                 f"`surgeon doctor` says how to restore it")

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
        blobs[("patched", f["sha256_after"])] = self._patched_bytes(f)
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
        if not self.store.exists():
            raise PatchError(self._nothing_recorded())
        with self.store.locked():
            recovered = self._recover_locked()
            manifest = self.store.load_manifest()
            patches = manifest["patches"]
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
            new = {"format": MANIFEST_FORMAT, "txid": None, "id": manifest.get("id") or self.manifest_id(),
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
            raise PatchError(self._nothing_recorded())
        raise PatchError(f"several patches applied ({', '.join(sorted(patches))}); name one or pass --all")

    def _revert_patch_files(self, pname: str, files: list[dict[str, Any]], force: bool, ops: list[dict[str, Any]],
                            blobs: dict[tuple[str, str], bytes | None], drifted: list[str], result: RevertResult) -> None:
        """Add the journal ops that restore patch ``pname``'s files; collect drift (and, with
        ``force``, the warnings for files left alone) instead of refusing here."""
        # a file left alone (drifted, with force) may still import what the patch created:
        # then the created files stay too, or the engine would no longer import
        kept = force and any(self.paths.version(f["relpath"]) not in (f["sha256_after"], f["sha256_before"])
                             for f in files if f["sha256_before"] != ABSENT)
        for f in files:
            current = self.paths.version(f["relpath"])
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
        if not self.store.exists():
            return None
        with self.store.locked():
            return self._recover_locked()
