"""The resume state of an audit: a JSON-lines file, one header line, then one line per finished file
(its result as the driver completed it, stale findings included), appended and flushed as each
file finishes, so a run killed at any point leaves every finished file recorded.

A file is *done* when its path, size and mtime (ns) equal the recorded ones; a file changed since
is audited again. A file recorded twice (its exact identification, run after the statistics pass
of the whole set, :mod:`surgeon.audit.exact`) is what its later record says. The header records
what the results depend on (the spec's sha256, the profile, the mode, the exact identification
budget): a state written under anything else is refused (exit 2), not silently mixed in. Only each
file's key and byte offset are held in memory; a result is read back when its turn comes.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import IO, Any

from surgeon.core.errors import BadInput
from surgeon.core.safefile import UnsafeFile, open_append, open_regular, write_file

# 2: row hashes of a 64-column block, identity on several statistics; 3: the profile's files; 4: the exact
# identification budget (a file's later record, with its exact identification, supersedes the first)
VERSION = 4
WHAT = "the audit state"
LINE_LIMIT = 64 << 20  # bytes a line of the state may hold (a file's result is a few KB): more is no state of ours


def _is_record(r: Any) -> bool:
    """Whether ``r`` has the shape of a file's result, as far as a resumed run reads it back."""
    def listed(key: str, ok) -> bool:
        return isinstance(r.get(key), list) and all(ok(x) for x in r[key])

    return isinstance(r, dict) and isinstance(r.get("path"), str) and isinstance(r.get("size"), int) \
        and (r.get("mtime_ns") is None or isinstance(r.get("mtime_ns"), int)) \
        and listed("findings", lambda f: isinstance(f, dict) and isinstance(f.get("kind"), str)) \
        and listed("slots", lambda s: isinstance(s, dict) and isinstance(s.get("name"), str)) \
        and listed("hashes", lambda h: isinstance(h, list) and len(h) == 4
                   and all(type(v) is int and -(2**63) <= v < 2**63 for v in h) and 0 <= h[0] < 2**31)


def _first_line(path: Path) -> bytes | None:
    """The first line of the state file at ``path`` (None where there is none: absent, empty);
    opened as :mod:`surgeon.core.safefile` opens surgeon's own files: a link, a FIFO or a device
    there is UnsafeFile, never followed or waited on."""
    try:
        fd = open_regular(path, follow=False, what=WHAT)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.readline(LINE_LIMIT + 1) or None


def _header(line: bytes | None) -> dict[str, Any] | None:
    try:
        header = json.loads(line) if line else None
    except ValueError:
        return None
    return header if isinstance(header, dict) and "surgeon.audit.state" in header else None


class State:
    """The state file, opened once for the run: appended through one descriptor (never through a
    link, never a FIFO: :func:`surgeon.core.safefile.open_append`), read back through another on the
    same file (checked to be the same inode), never reopened by path."""

    def __init__(self, path: Path, header: dict[str, Any], resume: bool):
        self.path = path
        self.header = {"surgeon.audit.state": VERSION, **header}
        self._done: dict[str, tuple[int, int, int]] = {}  # path -> (size, mtime_ns, offset)
        try:
            if resume and os.path.lexists(path):
                self._open()
                self._load()
            else:
                self._fresh()
        except OSError as e:
            raise BadInput(f"{path}: cannot write the audit state ({e.strerror or e}): pass --state FILE elsewhere") from None

    def _fresh(self) -> None:
        """A new state: its header written atomically in place of a state of an earlier run (never
        of a file that is not one: a link, a FIFO, a file of the user's own)."""
        first = _first_line(self.path) if os.path.lexists(self.path) else None
        if first is not None and _header(first) is None:
            raise UnsafeFile(f"{self.path}: already exists and is not an audit state; refusing to overwrite it "
                             "(remove it, or pass --state FILE elsewhere)")
        write_file(self.path, (json.dumps(self.header, separators=(",", ":")) + "\n").encode(), overwrite=True,
                   what=WHAT)
        self._open()

    def _open(self) -> None:
        self._fd = -1
        self._out: IO[bytes] = open_append(self.path, what=WHAT)
        try:
            self._fd = open_regular(self.path, follow=False, what=WHAT)
        except BaseException:
            self._out.close()
            raise
        a, b = os.fstat(self._out.fileno()), os.fstat(self._fd)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) or a.st_nlink > 1:
            self.close()
            raise UnsafeFile(f"{self.path}: {WHAT} " + ("has other hard links; refusing to write to a file shared "
                                                         "with another name" if a.st_nlink > 1 else
                                                         "was replaced while being opened") + " (pass --state FILE elsewhere)")

    def _line_at(self, offset: int) -> bytes:
        """The line from ``offset`` (read through the open descriptor; at most :data:`LINE_LIMIT` + 1 bytes)."""
        out = bytearray()
        while len(out) <= LINE_LIMIT:
            chunk = os.pread(self._fd, 1 << 14, offset + len(out))
            if not chunk:
                break
            end = chunk.find(b"\n")
            out += chunk if end < 0 else chunk[:end + 1]
            if end >= 0:
                break
        return bytes(out)

    def _load(self) -> None:
        with os.fdopen(os.dup(self._fd), "rb") as f:  # a buffered reader of the same file, for this pass only
            f.seek(0)
            header = _header(f.readline(LINE_LIMIT + 1))
            if header is None:
                raise BadInput(f"{self.path}:1:1: not an audit state file (remove it, or run without --resume)") from None
            if header != self.header:
                differs = sorted(k for k in set(header) | set(self.header) if header.get(k) != self.header.get(k))
                raise BadInput(f"{self.path}:1:1: the state was written for another audit (differs in "
                               f"{', '.join(differs)}): remove it, or run without --resume")
            for number in itertools.count(2):
                offset = f.tell()
                line = f.readline(LINE_LIMIT + 1)
                if len(line) > LINE_LIMIT:
                    raise BadInput(f"{self.path}:{number}:1: a line over {LINE_LIMIT} bytes, not a file's audit result: "
                                   "remove the state, or run without --resume")
                if not line or not line.endswith(b"\n"):  # the last line of a killed run: not finished
                    break
                try:
                    r = json.loads(line)
                except ValueError:
                    break
                if not _is_record(r):
                    raise BadInput(f"{self.path}:{number}:1: not a file's audit result (path, size, mtime_ns): "
                                   "remove the state, or run without --resume")
                self._done[r["path"]] = (r["size"], r["mtime_ns"], offset)
        self._truncate_partial()

    def _truncate_partial(self) -> None:
        """Cut a half-written last line (a run killed mid-write) so appends start on a clean line
        (through the append descriptor: the file checked when it was opened, nothing by path)."""
        data_end = os.fstat(self._fd).st_size
        keep = max((o for _, _, o in self._done.values()), default=0)  # none recorded: after the header
        end = keep + len(self._line_at(keep))
        if end < data_end:
            os.ftruncate(self._out.fileno(), end)

    def done(self, key: dict[str, Any], read: bool = True) -> dict[str, Any] | None:
        """The recorded result of the file ``key`` (path, size, mtime_ns), or None if not done
        (``read=False``: an empty dict for a done file, without reading its result back)."""
        rec = self._done.get(key["path"])
        if rec is None or rec[:2] != (key["size"], key["mtime_ns"]):
            return None
        if not read:
            return {}
        return json.loads(self._line_at(rec[2]))

    @staticmethod
    def prompt_files(path: Path) -> list[str]:
        """The files the profile of the audit recorded at ``path`` was built on (none where there is
        no such state: its own checks come when it is opened)."""
        try:
            header = _header(_first_line(path))
        except (OSError, BadInput):
            return []
        files = header.get("prompt_files") if header else None
        return [p for p in files if isinstance(p, str)] if isinstance(files, list) else []

    @property
    def recorded(self) -> int:
        return len(self._done)

    def record(self, result: dict[str, Any]) -> None:
        """Append a file's result (a file recorded again: the later record is the one :meth:`done` reads)."""
        self._out.flush()
        offset = os.fstat(self._out.fileno()).st_size  # appended: the record starts at the file's end
        self._write(result)
        self._done[result["path"]] = (result["size"], result["mtime_ns"], offset)

    def _write(self, obj: dict[str, Any]) -> None:
        self._out.write((json.dumps(obj, separators=(",", ":")) + "\n").encode())
        self._out.flush()

    def close(self) -> None:
        self._out.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
