"""``surgeon doctor``: what is wrong with an engine root's patch state, and what can be rebuilt.

It checks, in order, and stops where going on would mean trusting something untrustworthy:

1. the state directory and each node in it (no link, the right kind, owner and mode), and the
   engine root it belongs to (another root's state is reported and never touched; one made by an
   earlier surgeon whose manifest was made elsewhere is adopted only with ``--repair``);
2. the journal (an interrupted transaction: ``--repair`` finishes or rolls it back);
3. the manifest, and for every recorded file its stored original and patched copies (a lost copy
   is rebuilt from the file on disk only when the file hashes to the recorded sha256);
4. files carrying a patch marker that the manifest does not record: ``--repair`` restores one
   from the stored original its marker names, only when the file is byte-identical to a patched
   copy surgeon stored (so nothing anyone changed since is lost), and deletes a generated hooks
   module next to it only when it too is byte-identical to one surgeon stored.

It never guesses: whatever it cannot prove, it reports with what to do instead.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgeon.core.atomicfile import ABSENT, sha256_bytes
from surgeon.core.atomicfile import atomic_write as _atomic_write
from surgeon.core.atomicfile import file_mode as _mode
from surgeon.patch.manifest import PatchManager, Unrecorded
from surgeon.patch.markers import hooks_relpath
from surgeon.patch.statedir import PatchError, others_may_write

__all__ = ["Finding", "DoctorResult", "doctor"]

_REINSTALL = "reinstall the engine package (pip install --force-reinstall --no-deps <engine>==<version>) to restore it"


@dataclass
class Finding:
    path: str  # the file or directory concerned
    problem: str
    action: str  # what was done, what --repair would do, or what to do by hand
    fixed: bool = False
    repairable: bool = False  # --repair would fix it


@dataclass
class DoctorResult:
    root: Path
    repair: bool
    findings: list[Finding] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return all(f.fixed for f in self.findings)

    def add(self, path: Any, problem: str, action: str, *, fixed: bool = False, repairable: bool = False) -> None:
        self.findings.append(Finding(str(path), problem, action, fixed, repairable))


def doctor(manager: PatchManager, *, repair: bool = False) -> DoctorResult:
    """Diagnose (and with ``repair`` rebuild what can be proven) the patch state of ``manager``'s root."""
    out = DoctorResult(manager.root, repair)
    store = manager.store
    st = os.stat(manager.root_resolved)
    if others_may_write(st):
        out.add(manager.root_resolved, f"engine root writable by others (mode {stat.S_IMODE(st.st_mode):04o}, no sticky "
                f"bit): anyone could swap its files under a patch", "apply and revert refuse it: chmod o-w it")
    try:
        exists = store.check()
    except PatchError as e:
        out.add(store.state, str(e), "fix or remove it by hand; surgeon does not touch what it cannot trust")
        return out
    if not exists:
        _check_markers(manager, {"patches": {}}, out, repair)
        return out
    unproven = store.record_problem()
    if unproven:
        if not repair:
            out.add(store.state, unproven, "--repair records this root as its owner: only if it is this root's "
                    "own state; if another root uses it (a mount, a copy), move it aside instead", repairable=True)
        else:
            out.add(store.state, unproven, "recorded this root as its owner (--repair)", fixed=True)
    with store.locked(write=repair, adopt=repair):
        manifest = _check_journal_and_manifest(manager, out, repair)
        if manifest is not None:
            _check_blobs(manager, manifest, out, repair)
        _check_markers(manager, manifest or {"patches": {}}, out, repair)
    return out


def _check_journal_and_manifest(manager: PatchManager, out: DoctorResult, repair: bool) -> dict[str, Any] | None:
    store = manager.store
    try:
        journal = store.load_journal()
    except PatchError as e:
        out.add(store.journal_path, str(e), "cannot be rebuilt: the files it names may be half-way; check them "
                "with `surgeon status` after moving the journal aside")
        return None
    if journal is not None:
        if repair:
            try:
                done = manager._recover_locked()
            except PatchError as e:
                out.add(store.journal_path, f"interrupted {journal['kind']}", f"recovery failed: {e}")
                return None
            out.add(store.journal_path, f"interrupted {journal['kind']}", done or "recovered", fixed=True)
        else:
            out.add(store.journal_path, f"interrupted {journal['kind']} pending",
                    "--repair finishes or rolls it back", repairable=True)
    try:
        return store.load_manifest()
    except PatchError as e:
        out.add(store.manifest_path, str(e), "cannot be rebuilt from what is stored; files carrying "
                "markers are listed below")
        return None


def _check_blobs(manager: PatchManager, manifest: dict[str, Any], out: DoctorResult, repair: bool) -> None:
    """Every recorded file's stored original and patched copy; a lost one is rebuilt from the file
    on disk only when the file hashes to the recorded sha256."""
    store = manager.store
    for p in manifest["patches"].values():
        for f in p["files"]:
            current = manager.paths.version(f["relpath"])
            for kind, key in (("originals", "sha256_before"), ("patched", "sha256_after")):
                sha = f[key]
                if sha == ABSENT:
                    continue
                try:
                    if store.has_blob(kind, sha):
                        store.read_blob(kind, sha)  # checks its hash
                        continue
                    problem = "missing"
                except PatchError as e:
                    out.add(store.blob_path(kind, sha), str(e), "delete it: a wrong copy is worse than none")
                    continue
                path = store.blob_path(kind, sha)
                what = f"stored {'original' if kind == 'originals' else 'patched copy'} of {f['relpath']} ({p['name']})"
                if current == sha:
                    if repair:
                        data = manager.paths.resolve(f["relpath"]).read_bytes()
                        if sha256_bytes(data) == sha:
                            store.store_blob(kind, data)
                            out.add(path, f"{what} {problem}", "rebuilt from the file on disk", fixed=True)
                            continue
                    out.add(path, f"{what} {problem}", "--repair rebuilds it from the file on disk (it hashes as "
                            "recorded)", repairable=True)
                elif kind == "patched":
                    out.add(path, f"{what} {problem}", "not needed while the file is as patched; the file no "
                            "longer is, so `surgeon revert --force` then reinstall if it must go")
                else:
                    out.add(path, f"{what} {problem}", f"cannot be rebuilt; after `surgeon revert --force "
                            f"{p['name']}`, {_REINSTALL}")


def _check_markers(manager: PatchManager, manifest: dict[str, Any], out: DoctorResult, repair: bool) -> None:
    patched = set(manager.store.blob_names("patched")) if manager.store.exists() else set()
    for u in manager.unrecorded(manifest):
        path = manager.paths.resolve(u.relpath)
        problem = f"patched but unrecorded: carries surgeon patch {u.marker.name} (manifest {u.marker.manifest_id})"
        if not u.restorable:
            out.add(u.relpath, problem, f"its original is not stored here: {_REINSTALL}")
            continue
        if manager.paths.version(u.relpath) not in patched:
            out.add(u.relpath, problem, f"changed since surgeon patched it: restoring "
                    f"{manager.store.blob_path('originals', u.marker.original_sha256)} would drop those changes; "
                    f"copy it over by hand if that is what you want")
            continue
        if not repair:
            out.add(u.relpath, problem, "--repair restores the stored original (the file is exactly as surgeon "
                    "patched it)", repairable=True)
            continue
        _atomic_write(path, manager.store.read_blob("originals", u.marker.original_sha256), _mode(path))
        out.add(u.relpath, problem, "restored the stored original", fixed=True)
        _drop_hooks_modules(manager, u, patched, out)


def _drop_hooks_modules(manager: PatchManager, u: Unrecorded, patched: set[str], out: DoctorResult) -> None:
    """The generated hooks module of the patch just taken out of ``u.relpath`` (named after the
    patch, next to the file): deleted only when no manifest records it and it is byte-identical to
    a copy surgeon stored, else reported."""
    rel = hooks_relpath(u.relpath, u.marker.name)
    if rel in manager.owners() or manager.paths.version(rel) == ABSENT:
        return
    if manager.paths.version(rel) in patched:
        _atomic_write(manager.paths.resolve(rel), None)
        out.add(rel, f"generated hooks module of unrecorded patch {u.marker.name}", "deleted (as surgeon created it)",
                fixed=True)
    else:
        out.add(rel, f"hooks module of unrecorded patch {u.marker.name}", "left alone: it is not byte-identical "
                "to one surgeon stored; delete it once nothing imports it")
