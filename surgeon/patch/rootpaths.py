"""Relative paths of engine files, turned into paths that are certainly inside the engine root."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from surgeon.core.atomicfile import ABSENT, sha256_bytes
from surgeon.patch.statedir import PatchError, describe_mode, others_may_write
from surgeon.patch.statefiles import check_relpath

__all__ = ["EngineRootPaths"]


class EngineRootPaths:
    """Every file a patch touches goes through here first, so a manifest or a change can never make
    surgeon write outside the root, through a symlink, or into its own state directory."""

    def __init__(self, root: Path, root_resolved: Path, state_dir_name: str) -> None:
        self.root, self.root_resolved, self.state_dir_name = root, root_resolved, state_dir_name

    def resolve(self, relpath: str) -> Path:
        """The absolute path for ``relpath``, refused unless it lies inside the root (no symlinks)."""
        parts = check_relpath(relpath, self.state_dir_name).split("/")
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

    def refuse_open_dirs(self, relpath: str) -> None:
        """Refuse to write ``relpath`` where anyone may swap it under the patch: the root or a
        directory between it and the file writable by others without the sticky bit."""
        cur = self.root_resolved
        for part in ["", *check_relpath(relpath, self.state_dir_name).split("/")[:-1]]:
            cur = cur / part if part else cur
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                return
            if others_may_write(st):
                raise PatchError(f"{cur}: writable by others (mode {stat.S_IMODE(st.st_mode):04o}, no sticky bit): "
                                 f"anyone could swap {relpath} under the patch; refusing to write it (chmod o-w it first)")

    def existing_file(self, relpath: str) -> Path:
        path = self.resolve(relpath)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise PatchError(f"{relpath}: no such file under {self.root}") from None
        if not stat.S_ISREG(st.st_mode):
            raise PatchError(f"{relpath}: is {describe_mode(st.st_mode)}, not a regular file")
        return path

    def new_file(self, relpath: str) -> Path:
        """Where a patch may create ``relpath``: inside the root, in an existing directory."""
        path = self.resolve(relpath)
        if not path.parent.is_dir():
            raise PatchError(f"{relpath}: directory {path.parent.relative_to(self.root_resolved)} does not exist")
        return path

    def version(self, relpath: str) -> str:
        """sha256 of the engine file ``relpath`` (:data:`ABSENT` when there is none); a FIFO or a
        device there is refused, never read (it could block forever)."""
        path = self.resolve(relpath)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return ABSENT
        if not stat.S_ISREG(st.st_mode):
            raise PatchError(f"{relpath}: is {describe_mode(st.st_mode)}, not a regular file")
        try:
            return sha256_bytes(path.read_bytes())
        except FileNotFoundError:
            return ABSENT
        except OSError as e:
            raise PatchError(f"{path}: cannot read it ({e.strerror or e})") from None
