"""The read side of a :class:`surgeon.patch.manifest.PatchManager`: status, markers, diff, pristine bytes.

Nothing here writes, except that :meth:`PatchReader.inspect` finishes an interrupted transaction
where the state may be written (and says so); on a read-only root it reports it as pending. Reads
take a shared lock when the lock file exists and none otherwise, so they work on a root the user
cannot write.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgeon.core.atomicfile import ABSENT, sha256_bytes
from surgeon.patch.markers import Marker, hooks_relpath, scan
from surgeon.patch.rootpaths import EngineRootPaths
from surgeon.patch.rootrecord import derived_id
from surgeon.patch.statedir import PatchError
from surgeon.patch.statestore import StateStore

__all__ = ["FileStatus", "Inspection", "PatchReader", "PatchStatus", "Unrecorded", "default_scan_dirs"]


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
class Unrecorded:
    """A file carrying a patch marker that the manifest does not record (patched but unrecorded)."""

    relpath: str
    marker: Marker
    restorable: bool  # the stored original its marker names is there (`surgeon doctor --repair`)

    def advice(self) -> str:
        if self.restorable:
            return "`surgeon doctor --repair` restores it from the stored original"
        return "its original is not stored here: reinstall the engine package to restore it"


@dataclass
class Inspection:
    patches: list[PatchStatus]
    recovered: str | None = None  # what recovery of an interrupted transaction did
    pending: str | None = None  # an interrupted transaction left as it is (read-only root)
    unrecorded: list[Unrecorded] = field(default_factory=list)


class PatchReader:
    """Status, markers, diff and pristine bytes of one engine root (see the module docstring)."""

    root: Path
    root_resolved: Path
    store: StateStore
    paths: EngineRootPaths
    scan_dirs: list[str]

    @property
    def manifest_path(self) -> Path:
        return self.store.manifest_path

    @property
    def journal_path(self) -> Path:
        return self.store.journal_path

    def _recover_locked(self) -> str | None:
        raise NotImplementedError

    def manifest_id(self) -> str:
        """The id of this root's manifest (markers carry it). Without a manifest yet, one derived
        from the root's path and inode, so concurrent plans agree and another root (even one
        sharing this state directory) gets another. Reads only."""
        if self.store.exists():
            with self.store.locked(write=False):
                mid = self.store.load_manifest().get("id")
                if mid:
                    return str(mid)
        return derived_id(self.root_resolved)

    def _file_state(self, f: dict[str, Any]) -> str:
        current = self.paths.version(f["relpath"])
        if current == ABSENT:
            return "missing"
        return "applied" if current == f["sha256_after"] else "drifted"

    def _patched_bytes(self, f: dict[str, Any]) -> bytes:
        """The patched bytes of file record ``f``: the stored blob, else (blob lost) the file on
        disk when it hashes to the recorded ``sha256_after`` (then it is exactly those bytes)."""
        if self.store.has_blob("patched", f["sha256_after"]):
            data = self.store.read_blob("patched", f["sha256_after"])
            assert data is not None  # sha256_after is never ABSENT (validated on read)
            return data
        path = self.paths.resolve(f["relpath"])
        if self.paths.version(f["relpath"]) == f["sha256_after"]:
            data = path.read_bytes()
            if sha256_bytes(data) == f["sha256_after"]:
                return data
        raise PatchError(f"{self.store.blob_path('patched', f['sha256_after'])}: stored patched copy of "
                         f"{f['relpath']} is missing and the file is no longer as patched")

    def _nothing_recorded(self) -> str:
        """Why there is nothing to revert: no record, and whether patched files say otherwise."""
        lost = self.unrecorded({})
        if lost:
            return (f"{self.root}: no surgeon patch is recorded here, but {', '.join(sorted({u.relpath for u in lost}))} "
                    f"carry surgeon patch markers (patched but unrecorded); `surgeon doctor` says how to restore them")
        return f"{self.root}: no surgeon patches applied here"

    def inspect(self) -> Inspection:
        """Every recorded patch with its files' states, and every patched file nobody recorded.

        Creates nothing and takes a shared lock (none when there is no lock file). Only when an
        interrupted transaction is there and the state may be written is it finished or rolled
        back first, under the exclusive lock, and that is reported; on a read-only root it is
        reported as pending instead."""
        recovered = None
        if self.store.check() and self.store.journal_exists() and self.store.writable():
            with self.store.locked():
                recovered = self._recover_locked()
        with self.store.locked(write=False):
            pending = None
            if self.store.exists() and self.store.journal_exists():  # (no writer runs while we hold the lock)
                pending = (f"{self.journal_path}: an interrupted transaction is pending (not finished: "
                           f"no write access); run surgeon with write access to finish or roll it back")
            manifest = self.store.load_manifest() if self.store.exists() else self.store.empty_manifest()
            out = [PatchStatus(p["name"], p["spec"]["name"], p["spec"]["sha256"], p["engine"]["name"],
                               p["engine"]["version"], p["created"],
                               [FileStatus(f["relpath"], self._file_state(f), f["sha256_before"], f["sha256_after"])
                                for f in p["files"]])
                   for p in sorted(manifest["patches"].values(), key=lambda p: p["name"])]
            return Inspection(out, recovered, pending, self.unrecorded(manifest))

    def status(self) -> list[PatchStatus]:
        return self.inspect().patches

    def unrecorded(self, manifest: dict[str, Any]) -> list[Unrecorded]:
        """Files carrying a patch marker that ``manifest`` does not record for them (or records
        under another manifest id); each says whether its stored original is there to restore."""
        mid = manifest.get("id")
        recorded = {(f["relpath"], p["name"]) for p in manifest["patches"].values() for f in p["files"]}
        dirs = self.scan_dirs + [r.rpartition("/")[0] for r, _ in recorded]
        out = []
        for relpath, found in sorted(scan(self.root_resolved, dirs).items()):
            for mk in found:
                if (relpath, mk.name) in recorded and mid in (None, mk.manifest_id):
                    continue
                restorable = self.store.exists() and self.store.has_blob("originals", mk.original_sha256)
                out.append(Unrecorded(relpath, mk, restorable))
        return out

    def _marked_blobs(self) -> set[str]:
        """Names of the stored copies that patched files found by their markers still need: the
        originals the markers name, the files as they are now, and their generated hooks modules."""
        manifest = self.store.load_manifest()
        dirs = self.scan_dirs + [f["relpath"].rpartition("/")[0] for p in manifest["patches"].values() for f in p["files"]]
        out: set[str] = set()
        for relpath, found in scan(self.root_resolved, dirs).items():
            out.add(self.paths.version(relpath))
            for mk in found:
                out.add(mk.original_sha256)
                out.add(self.paths.version(hooks_relpath(relpath, mk.name)))
        return out

    def owners(self) -> dict[str, str]:
        """relpath -> name of the patch that owns it, read without recovering or writing anything."""
        if not self.store.exists():
            return {}
        with self.store.locked(write=False):
            return {f["relpath"]: p["name"] for p in self.store.load_manifest()["patches"].values() for f in p["files"]}

    def original_bytes(self, relpath: str, *, recover: bool = True) -> bytes:
        """The pristine bytes of ``relpath`` (from the stored original if a patch changed it).

        This is what a rewriter must start from, e.g. before ``apply(..., replace=True)``. With
        ``recover=False`` nothing is written: an interrupted transaction is refused instead of
        finished or rolled back (for dry runs).
        """
        self.paths.resolve(relpath)
        if self.store.exists():
            with self.store.locked(write=recover):
                if not recover and self.store.journal_exists():
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
        path = self.paths.existing_file(relpath)
        try:
            return path.read_bytes()
        except OSError as e:
            raise PatchError(f"{path}: cannot read it ({e.strerror or e})") from None

    def diff(self, name: str) -> str:
        """Unified diff original -> patched for every file of patch ``name`` (from stored blobs;
        a lost patched copy is taken from the file on disk when it still hashes as recorded)."""
        if not self.store.exists():
            raise PatchError(f"{name}: no such patch applied under {self.root}")
        with self.store.locked(write=False):
            patches = self.store.load_manifest()["patches"]
            if name not in patches:
                raise PatchError(f"{name}: no such patch applied under {self.root}")
            chunks: list[str] = []
            for f in patches[name]["files"]:
                before = self.store.read_blob("originals", f["sha256_before"])
                after = self._patched_bytes(f)
                a = (before or b"").decode("utf-8", "replace")
                b = after.decode("utf-8", "replace")
                chunks.extend(difflib.unified_diff(a.splitlines(keepends=True), b.splitlines(keepends=True),
                                                   fromfile="/dev/null" if before is None else f"a/{f['relpath']}",
                                                   tofile=f"b/{f['relpath']}"))
            out = []
            for line in chunks:  # keep the diff parseable when a file lacks a final newline
                out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
            return "".join(out)


def default_scan_dirs(root: Path) -> list[str]:
    """The engines' model directories under ``root`` (an engine package, or a site-packages holding them)."""
    from surgeon.engines.source.locate import LAYOUTS

    out = []
    for layout in LAYOUTS.values():
        for rel in (layout.models_dir, f"{layout.package}/{layout.models_dir}"):
            if (root / rel).is_dir():
                out.append(rel)
    return out
