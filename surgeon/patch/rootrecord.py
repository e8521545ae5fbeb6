"""Which engine root a state directory belongs to: ``<root>/.surgeon/root.json``.

One ``.surgeon`` reached from two roots (a bind mount, a copy with ``cp -a``) would let root B's
``revert --force`` drop root A's records and stored originals. So a state directory records, when
it is created, the engine root it belongs to: the root's real path and its ``(st_dev, st_ino)``.
It belongs to the root it is used from when either matches: the same path (a root whose
filesystem was remounted, a container layer, keeps its path but may change device numbers) or
the same directory (a root reached through another mount keeps its device and inode). A copy or a
mount of another root's state matches neither and is refused, for every command; nothing is ever
"repaired" by deleting its records.

A state directory made before this record existed gets it on first write, when nothing says it
is another root's: no manifest, no patch recorded, no manifest id, or the id derived from this
root (:func:`derived_id`, the id every manifest made here carries). Otherwise it is refused until
``surgeon doctor --repair`` records this root, a step the user takes knowingly.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from surgeon.patch.statedir import PatchError

__all__ = ["RECORD", "belongs", "derived_id", "foreign", "identity", "parse_record", "unproven"]

RECORD = "root.json"
FORMAT = 1


def identity(root_resolved: Path) -> dict[str, Any]:
    """The record of ``root_resolved`` as it is now."""
    st = os.stat(root_resolved)
    return {"format": FORMAT, "root": str(root_resolved), "dev": st.st_dev, "ino": st.st_ino}


def derived_id(root_resolved: Path) -> str:
    """The manifest id of a root that has no manifest yet: from its path and inode, so concurrent
    plans agree and another root (even one sharing this state directory) gets another."""
    st = os.stat(root_resolved)
    return hashlib.sha256(f"{root_resolved}\0{st.st_dev}\0{st.st_ino}".encode()).hexdigest()[:16]


def parse_record(path: Path, data: bytes) -> dict[str, Any]:
    """The record in ``data`` (read from ``path``), validated; damage is a one-line PatchError."""
    try:
        rec = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        rec = None
    ok = (isinstance(rec, dict) and rec.get("format") == FORMAT and isinstance(rec.get("root"), str)
          and all(isinstance(rec.get(k), int) and not isinstance(rec.get(k), bool) for k in ("dev", "ino")))
    if not ok:
        raise PatchError(f"{path}: damaged (not a record of the engine root this state directory belongs to); "
                         f"surgeon cannot tell whose state this is: fix or remove it by hand")
    assert isinstance(rec, dict)
    return rec


def belongs(rec: dict[str, Any], me: dict[str, Any]) -> bool:
    return rec["root"] == me["root"] or (rec["dev"], rec["ino"]) == (me["dev"], me["ino"])


def foreign(state: Path, rec: dict[str, Any], me: dict[str, Any]) -> str:
    """Why the state directory ``state`` (recorded as ``rec``'s) is refused from root ``me``."""
    return (f"{state}: belongs to engine root {rec['root']} (device {rec['dev']}, inode {rec['ino']}), not to "
            f"{me['root']} (device {me['dev']}, inode {me['ino']}): a copy or a mount of another root's state; "
            f"surgeon never uses or changes another root's records (move it aside if it is a stale copy)")


def unproven(state: Path, manifest_id: str, me: dict[str, Any]) -> str:
    """Why a state directory without a record, whose manifest was made elsewhere, is refused."""
    return (f"{state}: records no engine root (made by an earlier surgeon) and its manifest id {manifest_id} was "
            f"not made for {me['root']}: it may be another root's state (a copy or a mount); refusing to "
            f"change it. If it is this root's own (moved or remounted), `surgeon doctor --repair` records this root")
