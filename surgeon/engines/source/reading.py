"""Reading one engine source file safely: light (no libcst), so the paths that run without an
engine (lint, the built-in tables) can use it without importing the parser."""

from __future__ import annotations

from pathlib import Path

from surgeon.core.safefile import UnsafeFile, read_bytes

#: The most bytes surgeon reads of one engine source file (the largest model file of a release is
#: well under 1 MiB); a larger one is refused as unreadable, never read into memory.
SOURCE_LIMIT = 16 << 20
#: What reading an engine source file may raise besides FileNotFoundError (a FIFO, a device, a
#: directory or an over-large file named ``*.py`` is :class:`UnsafeFile`; no permission: OSError).
SOURCE_ERRORS = (OSError, UnsafeFile)


def read_source(path: Path, limit: int = SOURCE_LIMIT) -> str:
    """The text of engine source file ``path``, through :mod:`surgeon.core.safefile`: a link is
    followed (a site-packages may use them), but only a regular file of at most ``limit`` bytes is
    read; a FIFO is refused at once, never waited on. Undecodable bytes become U+FFFD."""
    return read_bytes(path, limit=limit, follow=True, what="the engine source file").decode("utf-8", "replace")


def dist_version(site: Path, dist_glob: str) -> str | None:
    """The ``Version:`` of the first ``<dist_glob>-*.dist-info/METADATA`` under ``site`` that says
    one (read safely, like any source file), or None."""
    import re

    for meta in sorted(site.glob(f"{dist_glob}-*.dist-info/METADATA")):
        try:
            m = re.search(r"^Version:\s*(\S+)", read_source(meta), re.M)
        except SOURCE_ERRORS:
            continue
        if m:
            return m.group(1)
    return None
