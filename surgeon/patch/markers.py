"""Patched files describe themselves: the marker comment a patch puts above its hooks import.

::

    # surgeon-patch: name=<patch> spec=<sha256> manifest=<id> original=<sha256>

``name`` is the patch, ``spec`` the sha256 of the spec it came from, ``manifest`` the id of the
manifest that records it (one per state directory), ``original`` the sha256 of the file before
the patch (so the stored original can be found again without the manifest). The rewriter builds
the comment as a libcst ``Comment`` node from a validated :class:`Marker`, never from user text.

With markers, a patched file the manifest does not know (the manifest or the whole state
directory deleted, a forced revert that kept a drifted file, another root's state) is still
found: :func:`scan` looks for the marker bytes before parsing anything, so ``status`` stays cheap.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from surgeon.patch.statefiles import ID_RE, NAME_RE, SHA_RE

__all__ = ["MARKER_PREFIX", "Marker", "find_markers", "hooks_relpath", "scan"]

MARKER_PREFIX = b"# surgeon-patch: "
_LINE = re.compile(rb"^[ \t]*# surgeon-patch: name=(\S+) spec=(\S+) manifest=(\S+) original=(\S+)[ \t]*\r?$", re.M)
_MAX_SCAN_BYTES = 16 << 20  # a model file is far smaller; a bigger one is not a model file


@dataclass(frozen=True)
class Marker:
    name: str
    spec_sha256: str
    manifest_id: str
    original_sha256: str

    def __post_init__(self) -> None:
        if not (NAME_RE.match(self.name) and SHA_RE.fullmatch(self.spec_sha256)
                and ID_RE.fullmatch(self.manifest_id) and SHA_RE.fullmatch(self.original_sha256)):
            raise ValueError(f"not a valid surgeon patch marker: {self!r}")

    def text(self) -> str:
        """The comment's text (every field validated: no space, newline or '#' can get in)."""
        return (f"{MARKER_PREFIX.decode()}name={self.name} spec={self.spec_sha256} "
                f"manifest={self.manifest_id} original={self.original_sha256}")


def hooks_relpath(model_relpath: str, patch_name: str) -> str:
    """Where patch ``patch_name`` puts its generated hooks module: next to the model file, as
    ``_surgeon_hooks_<patch name, non-word characters as _>.py``."""
    folder = model_relpath.rpartition("/")[0]
    name = f"_surgeon_hooks_{re.sub(r'[^0-9A-Za-z_]', '_', patch_name)}.py"
    return f"{folder}/{name}" if folder else name


def find_markers(data: bytes) -> list[Marker]:
    """Every well-formed marker line in ``data`` (a bytes search first: no parse when there is none)."""
    if MARKER_PREFIX not in data:
        return []
    out = []
    for m in _LINE.finditer(data):
        try:
            out.append(Marker(*(g.decode("ascii") for g in m.groups())))
        except (UnicodeDecodeError, ValueError):
            continue
    return out


def scan(root: Path, dirs: list[str]) -> dict[str, list[Marker]]:
    """relpath -> markers of every ``*.py`` directly in ``dirs`` (relative to ``root``) that
    carries one; links and anything but regular files are skipped (a FIFO is never opened)."""
    found: dict[str, list[Marker]] = {}
    for d in sorted(set(dirs)):
        base = root / d
        try:
            entries = list(os.scandir(base))
        except OSError:
            continue
        for entry in entries:
            if not entry.name.endswith(".py") or not entry.is_file(follow_symlinks=False):
                continue
            try:
                if not stat.S_ISREG(os.lstat(entry.path).st_mode) or entry.stat().st_size > _MAX_SCAN_BYTES:
                    continue
                with open(entry.path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            markers = find_markers(data)
            if markers:
                found[f"{d}/{entry.name}" if d else entry.name] = markers
    return found
