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
from pathlib import Path
from typing import IO, Any

from surgeon.core.errors import BadInput

# 2: row hashes of a 64-column block, identity on several statistics; 3: the profile's files; 4: the exact
# identification budget (a file's later record, with its exact identification, supersedes the first)
VERSION = 4


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


class State:
    def __init__(self, path: Path, header: dict[str, Any], resume: bool):
        self.path = path
        self.header = {"surgeon.audit.state": VERSION, **header}
        self._done: dict[str, tuple[int, int, int]] = {}  # path -> (size, mtime_ns, offset)
        try:
            if resume and path.is_file():
                self._load()
                self._out: IO[str] = path.open("a", encoding="utf-8")
            else:
                self._out = path.open("w", encoding="utf-8")
                self._write(self.header)
        except OSError as e:
            raise BadInput(f"{path}: cannot write the audit state ({e.strerror or e}): pass --state FILE elsewhere") from None

    def _load(self) -> None:
        with self.path.open("rb") as f:
            first = f.readline()
            try:
                header = json.loads(first)
            except ValueError:
                header = None
            if not isinstance(header, dict) or "surgeon.audit.state" not in header:
                raise BadInput(f"{self.path}:1:1: not an audit state file (remove it, or run without --resume)") from None
            if header != self.header:
                differs = sorted(k for k in set(header) | set(self.header) if header.get(k) != self.header.get(k))
                raise BadInput(f"{self.path}:1:1: the state was written for another audit (differs in "
                               f"{', '.join(differs)}): remove it, or run without --resume")
            for number in itertools.count(2):
                offset = f.tell()
                line = f.readline()
                if not line:
                    break
                if not line.endswith(b"\n"):  # the last line of a killed run: not finished
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
        """Cut a half-written last line (a run killed mid-write) so appends start on a clean line."""
        with self.path.open("rb+") as f:
            data_end = f.seek(0, 2)
            keep = max((o for _, _, o in self._done.values()), default=None)
            if keep is None:
                f.seek(0)
                f.readline()
                f.truncate(f.tell())
                return
            f.seek(keep)
            f.readline()
            if f.tell() < data_end:
                f.truncate(f.tell())

    def done(self, key: dict[str, Any], read: bool = True) -> dict[str, Any] | None:
        """The recorded result of the file ``key`` (path, size, mtime_ns), or None if not done
        (``read=False``: an empty dict for a done file, without reading its result back)."""
        rec = self._done.get(key["path"])
        if rec is None or rec[:2] != (key["size"], key["mtime_ns"]):
            return None
        if not read:
            return {}
        with self.path.open("rb") as f:
            f.seek(rec[2])
            return json.loads(f.readline())

    @staticmethod
    def prompt_files(path: Path) -> list[str]:
        """The files the profile of the audit recorded at ``path`` was built on (none where there is
        no such state: its own checks come when it is opened)."""
        try:
            with path.open("rb") as f:
                header = json.loads(f.readline())
        except (OSError, ValueError):
            return []
        files = header.get("prompt_files") if isinstance(header, dict) else None
        return [p for p in files if isinstance(p, str)] if isinstance(files, list) else []

    @property
    def recorded(self) -> int:
        return len(self._done)

    def record(self, result: dict[str, Any]) -> None:
        """Append a file's result (a file recorded again: the later record is the one :meth:`done` reads)."""
        import os

        self._out.flush()
        offset = os.fstat(self._out.fileno()).st_size  # appended: the record starts at the file's end
        self._write(result)
        self._done[result["path"]] = (result["size"], result["mtime_ns"], offset)

    def _write(self, obj: dict[str, Any]) -> None:
        self._out.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._out.flush()

    def close(self) -> None:
        self._out.close()
