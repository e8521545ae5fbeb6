"""One transaction under ``journal.json``, and the recovery of an interrupted one.

The protocol and the crash-recovery policy are described in :mod:`surgeon.patch.manifest`. Every
engine file is written through ``_atomic_write`` here (a test injects failures at this name); an
``OSError`` (disk full, file too large, permission denied) becomes a :class:`PatchError` naming
the path, after the transaction was rolled back.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from surgeon.core.atomicfile import TMP_SUFFIX

# Every write goes through this module-level name (a test injects failures here).
from surgeon.core.atomicfile import atomic_write as _atomic_write
from surgeon.core.atomicfile import file_mode as _mode
from surgeon.patch.rootpaths import EngineRootPaths
from surgeon.patch.statedir import PatchError, check_node
from surgeon.patch.statefiles import MANIFEST_FORMAT
from surgeon.patch.statestore import StateStore

__all__ = ["TransactionJournal", "os_error", "now"]

# Test hooks (fault injection). Never set in normal use.
_ENV_DELAY = "SURGEON_MANIFEST_TEST_DELAY"  # seconds to sleep at every transaction step
_ENV_CRASH_AT = "SURGEON_MANIFEST_TEST_CRASH_AT"  # os._exit(99) at the Nth step (1-based)


def os_error(e: OSError) -> str:
    """An OSError as ``path: reason`` (the path it failed on, when the error knows it)."""
    return f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e)


def now() -> str:
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


class TransactionJournal:
    """Runs a transaction under ``journal.json`` and recovers an interrupted one (the protocol and
    the crash-recovery policy in the module docstring). Call only with the store's lock held."""

    def __init__(self, store: StateStore, paths: EngineRootPaths,
                 protect: Callable[[], set[str]] | None = None) -> None:
        self.store, self.paths = store, paths
        self.protect = protect  # blob names gc must keep beyond the manifest's (see StateStore.gc)

    def run(self, kind: str, ops: list[dict[str, Any]], blobs: dict[tuple[str, str], bytes | None],
            new_manifest: dict[str, Any]) -> None:
        """ops: {relpath, from, from_kind, to, to_kind}; blobs: (kind, sha) -> bytes for every from/to."""
        faults = _FaultInjection()
        txid = secrets.token_hex(8)
        new_manifest = dict(new_manifest, txid=txid)
        journal = {"format": MANIFEST_FORMAT, "txid": txid, "kind": kind, "created": now(),
                   "files": ops, "manifest": new_manifest}
        for op in ops:
            self.paths.refuse_open_dirs(op["relpath"])
        try:
            for (bkind, sha), data in blobs.items():
                if self.store.store_blob(bkind, data) != sha:
                    raise PatchError(f"{self.store.state}: a stored blob does not hash to its name")
            faults.step("blobs")
            self.store.verify()
            self.store.write_json("journal.json", journal)
        except OSError as e:  # (atomic_write removed its temp file; no engine file was touched)
            raise PatchError(f"{kind} failed before any file changed: {os_error(e)}") from None
        faults.step("journal")
        try:
            self.store.verify()  # the journal is where the state directory is: engine files may change
            for op in ops:
                path = self.paths.resolve(op["relpath"])
                current = self.paths.version(op["relpath"])
                if current != op["from"]:
                    raise PatchError(f"{op['relpath']}: changed on disk during the operation; rolled back")
                _atomic_write(path, blobs[(op["to_kind"], op["to"])], _mode(path))
                faults.step("file")
            self.store.verify()
            self.store.write_json("manifest.json", new_manifest)  # the commit record
        except BaseException as e:
            try:
                self.recover()  # manifest not committed -> rolls back
            except (OSError, PatchError) as again:
                why = os_error(e) if isinstance(e, OSError) else str(e)
                again_why = os_error(again) if isinstance(again, OSError) else str(again)
                raise PatchError(f"{kind} failed ({why}) and rolling it back failed too ({again_why}); "
                                 f"the journal is kept: any later surgeon command finishes the roll back") from None
            if isinstance(e, (PatchError, KeyboardInterrupt, SystemExit)):
                raise
            if isinstance(e, OSError):
                raise PatchError(f"{kind} failed and was rolled back: {os_error(e)}") from None
            raise
        faults.step("manifest")
        self._finish(new_manifest)
        faults.step("done")

    def _finish(self, manifest: dict[str, Any]) -> None:
        self.store.remove_journal()
        self.store.gc(manifest, self.protect)

    def recover(self) -> str | None:
        """Finish (manifest committed) or roll back (not committed) an interrupted transaction.

        Returns a one-line description of what was done, or None when there was nothing to do."""
        store = self.store
        store.clean_tmp()
        journal = store.load_journal()
        if journal is None:  # (blobs of a transaction killed before its journal stay until the next one
            return None       # completes: with the manifest lost they may be all that is left to restore from)
        manifest = store.load_manifest()
        forward = manifest.get("txid") == journal["txid"]
        restored, warnings = [], []
        for op in journal["files"]:
            path = self.paths.resolve(op["relpath"])
            _clean_engine_tmp(path.parent, path.name)
            want, other = ("to", "from") if forward else ("from", "to")
            current = self.paths.version(op["relpath"])
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




def _clean_engine_tmp(directory: Path, name: str) -> None:
    """Remove the temp files a killed write of engine file ``name`` left beside it."""
    try:
        if check_node(directory, "dir") is None:
            return
    except PatchError:
        return  # a directory surgeon does not trust: its temp files are left alone
    for tmp in directory.glob(f".{name}.*{TMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            tmp.unlink()
