"""On-disk cache of probe results.

Keyed on the content of every model file of the engine root and on the source of the probe
itself, so an edited engine file or a new surgeon both miss. Entries are plain JSON under
``$XDG_CACHE_HOME/surgeon`` (default ``~/.cache/surgeon``); deleting the directory is always safe,
and any unreadable entry is treated as a miss.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from surgeon.core.atomicfile import atomic_write
from surgeon.core.idrules import (
    ArchDispatch,
    Branch,
    Bypass,
    ClassConvention,
    DefaultTerm,
    EngineProbe,
    Evidence,
    FirstIdEquals,
    IdRule,
    MaxIdEquals,
    PlatformTarget,
    SiteRecord,
)
from surgeon.engines.source.index import SourceIndex

FORMAT = 3


def directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "surgeon"


def _code_version() -> str:
    h = hashlib.sha256(str(FORMAT).encode())
    here = Path(__file__).parents[1]
    # the probe's own modules (every wing of engines/) and the id-rule data model it fills
    for p in sorted([*here.rglob("*.py"), here.parent / "core" / "idrules.py"]):
        h.update(p.relative_to(here.parent).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def key(engine: str, index: SourceIndex, platform: str = "all", support: list[str] | None = None) -> str | None:
    """The entry's key: engine, platform, the probe's code, and the content of every model file
    and of the other files it reads (``support``: vLLM's ``platforms/``)."""
    try:
        h = hashlib.sha256()
        h.update(engine.encode())
        h.update(b"\0platform=" + platform.encode() + b"\0")
        h.update(_code_version().encode())
        h.update(index.fingerprint([*index.model_files, *(support or [])]).encode())
        return h.hexdigest()[:40]
    except OSError:
        return None


def _path(cache_key: str) -> Path:
    return directory() / f"probe-{cache_key}.json"


def load(cache_key: str, index: SourceIndex | None = None) -> EngineProbe | None:
    try:
        data = json.loads(_path(cache_key).read_text(encoding="utf-8"))
        if index is not None and any(index.fingerprint([p]) != h for p, h in data.get("outside", {}).items()):
            return None  # a file read outside the model files changed since
        return _decode(data)
    except Exception:  # a missing, stale or damaged entry is a miss
        return None


def store(cache_key: str, probe: EngineProbe, outside: dict[str, str] | None = None) -> None:
    """Keep ``probe``; ``outside``: content hashes of the files the probe read beyond the model
    files of the key (a helper followed into ``srt/layers/communicator.py``, say), checked by
    :func:`load` so an edit there is a miss too."""
    try:
        d = directory()
        d.mkdir(parents=True, exist_ok=True)
        payload = json.dumps(_encode(probe) | {"outside": outside or {}})
        atomic_write(_path(cache_key), payload.encode("utf-8"))
    except OSError:
        pass  # a read-only home is not an error


def _encode(probe: EngineProbe) -> dict:
    return {
        "format": FORMAT,
        "engine": probe.engine,
        "version": probe.version,
        "root": probe.root,
        "files_scanned": probe.files_scanned,
        "platform": probe.platform,
        "dispatch": {a: asdict(d) for a, d in probe.dispatch.items()},
        "defining": sorted(probe.defining),
        "architectures": probe.architectures,
        "registered": probe.registered,
        "unreadable": probe.unreadable,
        "classes": {k: asdict(c) for k, c in probe.classes.items()},
    }


def _decode(data: dict) -> EngineProbe:
    if data.get("format") != FORMAT:
        raise ValueError("old cache format")
    probe = EngineProbe(engine=data["engine"], version=data["version"], root=data["root"],
                        files_scanned=data["files_scanned"], defining=set(data["defining"]),
                        architectures=dict(data["architectures"]), platform=data["platform"],
                        registered=dict(data.get("registered", {})), unreadable=dict(data.get("unreadable", {})))
    for a, d in data["dispatch"].items():
        targets = tuple(PlatformTarget(**t) for t in d["targets"])
        probe.dispatch[a] = ArchDispatch(d["architecture"], d["module"], d["platform"], targets, d["disagree"])
    for k, c in data["classes"].items():
        probe.classes[k] = _decode_class(c)
    return probe


def _decode_class(c: dict) -> ClassConvention:
    c = dict(c)
    if c.get("id_rule") is not None:
        c["id_rule"] = IdRule(tuple(Branch(b["offset"], _decode_condition(b["condition"])) for b in c["id_rule"]["branches"]))
    if c.get("default") is not None:
        c["default"] = tuple(DefaultTerm(**t) for t in c["default"])
    c["bypasses"] = tuple(Bypass(**b) for b in c.get("bypasses", ()))
    c["sites"] = tuple(SiteRecord(**x) for x in c.get("sites", ()))
    c["evidence"] = tuple(Evidence(**x) for x in c.get("evidence", ()))
    return ClassConvention(**c)


def _decode_condition(d: dict | None) -> FirstIdEquals | MaxIdEquals | None:
    if d is None:
        return None
    if "term" in d:
        return MaxIdEquals(DefaultTerm(**d["term"]))
    return FirstIdEquals(d["value"])
