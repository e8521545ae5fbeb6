"""The manifest and the journal, validated on every read: a damaged state file is one clear error.

A manifest of random bytes, ``{"format": 1}``, ``"patches": []``, an entry ``{}``, a stored hash
``../..``: each is refused with a :class:`PatchError` (exit 2) that names the file and what is
wrong, before any of it is used as a path or a key. Hashes are lowercase hex sha256 (or
:data:`ABSENT` for a file a patch created), paths are relative, '/'-separated and stay inside the
engine root (:func:`check_relpath`, the same rule every engine path obeys).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from surgeon.core.atomicfile import ABSENT
from surgeon.patch.statedir import PatchError

__all__ = ["MANIFEST_FORMAT", "NAME_RE", "SHA_RE", "check_relpath", "parse_journal", "parse_manifest"]

MANIFEST_FORMAT = 1
SHA_RE = re.compile(r"[0-9a-f]{64}")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
TXID_RE = re.compile(r"[0-9a-f]{16}")
ID_RE = re.compile(r"[0-9a-f]{16}")


class _Bad(Exception):
    """What is wrong, at which key (turned into a PatchError naming the file)."""


def check_relpath(relpath: object, state_dir_name: str = ".surgeon") -> str:
    """``relpath`` if it is a plain relative '/'-separated path inside the root, else a PatchError."""
    if not isinstance(relpath, str) or not relpath:
        raise PatchError(f"{relpath!r}: empty path")
    if "\\" in relpath or "\0" in relpath:
        raise PatchError(f"{relpath!r}: path must be '/'-separated and plain")
    if relpath.startswith("/") or re.match(r"^[A-Za-z]:", relpath):
        raise PatchError(f"{relpath}: absolute path; paths are relative to the engine root")
    parts = relpath.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise PatchError(f"{relpath}: path must not contain '..', '.' or empty components")
    if parts[0] == state_dir_name:
        raise PatchError(f"{relpath}: inside surgeon's own state directory")
    return relpath


def _obj(value: Any, where: str, keys: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"{where}: expected an object, found {type(value).__name__}")
    for k, t in keys.items():
        if k not in value:
            raise _Bad(f"{where}: missing {k!r}")
        if not isinstance(value[k], t) or isinstance(value[k], bool):
            raise _Bad(f"{where}.{k}: wrong type {type(value[k]).__name__}")
    return value


def _sha(value: str, where: str, absent_ok: bool = False) -> None:
    if not (SHA_RE.fullmatch(value) or (absent_ok and value == ABSENT)):
        raise _Bad(f"{where}: {value[:80]!r} is not a sha256")


def _path(value: str, where: str) -> None:
    try:
        check_relpath(value)
    except PatchError as e:
        raise _Bad(f"{where}: {e}") from None


def _check_patch(name: str, p: Any, where: str) -> None:
    if not NAME_RE.match(name):
        raise _Bad(f"{where}: {name[:80]!r} is not a patch name")
    _obj(p, where, {"name": str, "spec": dict, "engine": dict, "created": str, "files": list})
    if p["name"] != name:
        raise _Bad(f"{where}.name: {p['name'][:80]!r} differs from its key")
    _obj(p["spec"], f"{where}.spec", {"name": str, "sha256": str})
    _obj(p["engine"], f"{where}.engine", {"name": str, "version": str})
    if not p["files"]:
        raise _Bad(f"{where}.files: empty")
    seen = set()
    for i, f in enumerate(p["files"]):
        w = f"{where}.files[{i}]"
        _obj(f, w, {"relpath": str, "sha256_before": str, "sha256_after": str})
        _path(f["relpath"], f"{w}.relpath")
        _sha(f["sha256_before"], f"{w}.sha256_before", absent_ok=True)
        _sha(f["sha256_after"], f"{w}.sha256_after")
        if f["relpath"] in seen:
            raise _Bad(f"{w}.relpath: {f['relpath']} listed twice")
        seen.add(f["relpath"])


def _check_manifest(m: Any, where: str = "manifest") -> None:
    _obj(m, where, {"format": int, "patches": dict})
    if m["format"] != MANIFEST_FORMAT:
        raise _Bad(f"{where}.format: {m['format']!r}; this surgeon reads format {MANIFEST_FORMAT}")
    if m.get("txid") is not None and not (isinstance(m["txid"], str) and TXID_RE.fullmatch(m["txid"])):
        raise _Bad(f"{where}.txid: not a transaction id")
    if m.get("id") is not None and not (isinstance(m["id"], str) and ID_RE.fullmatch(m["id"])):
        raise _Bad(f"{where}.id: not a manifest id")
    owner: dict[str, str] = {}
    for name, p in m["patches"].items():
        _check_patch(name, p, f"{where}.patches[{name[:80]!r}]")
        for f in p["files"]:
            if f["relpath"] in owner:
                raise _Bad(f"{f['relpath']}: owned by both {owner[f['relpath']]} and {name}")
            owner[f["relpath"]] = name


def _check_journal(j: Any) -> None:
    _obj(j, "journal", {"format": int, "txid": str, "kind": str, "files": list, "manifest": dict})
    if j["format"] != MANIFEST_FORMAT:
        raise _Bad(f"journal.format: {j['format']!r}; this surgeon reads format {MANIFEST_FORMAT}")
    if not TXID_RE.fullmatch(j["txid"]):
        raise _Bad("journal.txid: not a transaction id")
    if j["kind"] not in ("apply", "revert", "repair"):
        raise _Bad(f"journal.kind: {j['kind'][:40]!r}")
    for i, op in enumerate(j["files"]):
        w = f"journal.files[{i}]"
        _obj(op, w, {"relpath": str, "from": str, "from_kind": str, "to": str, "to_kind": str})
        _path(op["relpath"], f"{w}.relpath")
        for end in ("from", "to"):
            _sha(op[end], f"{w}.{end}", absent_ok=True)
            if op[f"{end}_kind"] not in ("originals", "patched"):
                raise _Bad(f"{w}.{end}_kind: {op[f'{end}_kind'][:40]!r}")
    _check_manifest(j["manifest"], "journal.manifest")


def _parse(path: Path, data: bytes) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PatchError(f"{path}: damaged (not UTF-8 text at byte {e.start}); "
                         f"`surgeon doctor` says what can be rebuilt") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PatchError(f"{path}:{e.lineno}:{e.colno}: damaged ({e.msg}); "
                         f"`surgeon doctor` says what can be rebuilt") from None
    except RecursionError:
        raise PatchError(f"{path}: damaged (nested too deeply)") from None


def _validated(path: Path, data: bytes, check: Callable[[Any], None]) -> dict[str, Any]:
    parsed = _parse(path, data)
    try:
        check(parsed)
    except _Bad as e:
        raise PatchError(f"{path}: damaged ({e}); `surgeon doctor` says what can be rebuilt") from None
    return parsed


def parse_manifest(path: Path, data: bytes) -> dict[str, Any]:
    """The manifest in ``data`` (read from ``path``), validated."""
    return _validated(path, data, _check_manifest)


def parse_journal(path: Path, data: bytes) -> dict[str, Any]:
    """The journal in ``data`` (read from ``path``), validated."""
    return _validated(path, data, _check_journal)
