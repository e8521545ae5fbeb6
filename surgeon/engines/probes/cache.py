"""On-disk cache of probe results, that cannot lie.

Keyed on the content of every model file of the engine root and on the source of the probe
itself, so an edited engine file or a new surgeon both miss. Entries live under
``$XDG_CACHE_HOME/surgeon`` (default ``~/.cache/surgeon``); deleting the directory is always safe.

An entry decides answers (the ids ``render`` prints), and ``~/.cache`` is restored by CI caches,
shared through careless modes, or edited by hand. So (issue 36):

* **the directory** is used only when :func:`~surgeon.core.safefile.untrusted_dir` finds nothing
  wrong (not a link, yours or root's, not writable by group or others); otherwise the probe is
  computed without the cache and that is said once on stderr;
* **every entry** is one JSON object: the key it was computed from (itself a hash of the engine,
  the platform, surgeon's own source and the content of the engine files read), the SHA-256 of
  its payload, an HMAC-SHA256 of key and payload under a per-user secret, and the payload. It is
  read through :mod:`surgeon.core.safefile` (never through a link, never a FIFO, at most
  :data:`ENTRY_LIMIT` bytes), and believed only when key, digest and HMAC all match; otherwise a
  one-line note goes to stderr, the probe is recomputed, and the entry replaced atomically (a link
  or FIFO there is replaced, never followed or written through);
* **the secret** (:data:`SECRET_NAME`, 32 random bytes) lives *outside* the cache, under
  ``$XDG_STATE_HOME/surgeon`` (default ``~/.local/state/surgeon``, checked like the cache
  directory); it is created on first store with mode 0600, and believed only when the open
  descriptor shows a regular file of yours that no one else may read; otherwise it is replaced
  (so every entry signed with the old one is recomputed).

Why an HMAC and not a plain digest: a digest catches damage, but whoever edits an entry can
recompute a public digest. The HMAC needs the secret, which only you can read. Why the secret is
not in the cache directory: what restores or copies a cache (a CI cache action restoring
``~/.cache`` from another run, an rsync, a shared volume) would bring a matching secret along, and
the entries would be believed whoever wrote them; kept in the state directory, a restored or
copied cache is not believed on a machine that did not write it (each entry is recomputed once,
with a note, and re-signed). The owner and mode of both directories are checked first: in a
directory others can write, neither entries nor secret prove anything. What no local check can
stop is whoever can read your secret (your own account): they could as well edit surgeon itself.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
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
from surgeon.core.safefile import UnsafeFile, open_regular, read_bytes, untrusted_dir
from surgeon.core.safefile import note as safe_note  # the one note writer; this module's note keeps its own 'once'
from surgeon.engines.source.index import SourceIndex
from surgeon.engines.source.reading import SOURCE_LIMIT

FORMAT = 4
ENTRY_LIMIT = 64 << 20  # the largest probe entry (vLLM 0.33, every class) is under 1 MiB
SECRET_NAME = "cache-secret"
SECRET_BYTES = 32

_noted: set[str] = set()


class Mismatch(Exception):
    """An entry that must not be believed (why, one line)."""


def note(message: str) -> None:
    """``surgeon: note: <message>`` on stderr, once per message in this process."""
    safe_note(message, _noted)


def directory() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "surgeon"


def trusted(d: Path, what: str = "the probe cache") -> bool:
    """Whether cache directory ``d`` may be used; when not, a note says why (once)."""
    why = untrusted_dir(d)
    if why is not None:
        note(f"not using {what} ({why}); computing without it")
    return why is None


def make_private(d: Path, what: str = "the probe cache") -> bool:
    """Create cache directory ``d`` (mode 0700) if absent; whether it may be used."""
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return False  # a read-only home is not an error: no cache
    return trusted(d, what)


# -- the per-user secret --------------------------------------------------------------------------
def _read_secret(path: Path) -> bytes | None:
    """The secret at ``path`` (None: absent); :class:`Mismatch` when it cannot be believed."""
    try:
        fd = open_regular(path, follow=False, what="the cache secret")
    except FileNotFoundError:
        return None
    except UnsafeFile as e:
        raise Mismatch(str(e)) from None
    try:
        st = os.fstat(fd)
        data = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise Mismatch(f"{path}: the cache secret is owned by uid {st.st_uid} with mode "
                       f"{stat.S_IMODE(st.st_mode):04o} (want yours, 0600)")
    if len(data) != SECRET_BYTES:
        raise Mismatch(f"{path}: the cache secret has {len(data)} bytes, not {SECRET_BYTES}")
    return data


def _new_secret(path: Path, replace: bool) -> bytes | None:
    """A fresh secret at ``path``: written to a private temp file, then linked in (never over
    another process's secret) or, with ``replace``, renamed over a bad one."""
    data = secrets.token_bytes(SECRET_BYTES)
    fd, tmp = tempfile.mkstemp(prefix=".secret.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
            return data
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process made one first: use it
            return _read_secret(path)
        return data
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def secret_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "surgeon"


def secret(*, create: bool, what: str = "the probe cache") -> bytes | None:
    """This user's cache secret (in :func:`secret_dir`); None when there is none (and not
    ``create``), its directory is not to be trusted, or it cannot be made. A secret that cannot
    be believed is replaced when ``create`` (with a note), else None."""
    d = secret_dir()
    if not (make_private(d, what) if create else trusted(d, what)):
        return None
    path = d / SECRET_NAME
    try:
        found = _read_secret(path)
    except Mismatch as e:
        if not create:
            return None
        note(f"{e}; replacing it (entries signed with it will be recomputed)")
        found, replace = None, True
    else:
        replace = False
    if found is not None or not create:
        return found
    try:
        return _new_secret(path, replace)
    except (OSError, Mismatch):
        return None


# -- sealed entries --------------------------------------------------------------------------------
def _mac(key: bytes, cache_key: str, payload: bytes) -> str:
    return hmac.new(key, cache_key.encode() + b"\0" + payload, hashlib.sha256).hexdigest()


def seal(key: bytes, cache_key: str, payload: bytes) -> bytes:
    """An entry: ``payload`` with the key it was computed from, its SHA-256 and its HMAC."""
    return json.dumps({"format": FORMAT, "key": cache_key, "sha256": hashlib.sha256(payload).hexdigest(),
                       "hmac": _mac(key, cache_key, payload), "payload": payload.decode("utf-8")}).encode()


def unseal(key: bytes | None, cache_key: str, raw: bytes) -> bytes:
    """The payload of entry ``raw`` sealed for ``cache_key``; :class:`Mismatch` (why) when it
    is damaged, was computed for another key, or was not sealed with this user's secret."""
    try:
        entry = json.loads(raw)
        payload = entry["payload"].encode("utf-8")
        fmt, got_key, digest, mac = entry["format"], entry["key"], entry["sha256"], entry["hmac"]
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeError):
        raise Mismatch("damaged (not a sealed cache entry)") from None
    if fmt != FORMAT:
        raise Mismatch(f"format {fmt!r}, not {FORMAT}")
    if got_key != cache_key:
        raise Mismatch("computed for another key")
    if not isinstance(digest, str) or not hmac.compare_digest(digest, hashlib.sha256(payload).hexdigest()):
        raise Mismatch("its content does not match its digest (edited or damaged)")
    if key is None or not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(key, cache_key, payload)):
        raise Mismatch("not signed with your cache secret (edited, or copied from elsewhere)")
    return payload


# -- the probe's entries -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _code_version() -> str:
    h = hashlib.sha256(str(FORMAT).encode())
    here = Path(__file__).parents[1]
    # the probe's own modules (every wing of engines/) and the id-rule data model it fills
    for p in sorted([*here.rglob("*.py"), here.parent / "core" / "idrules.py"]):
        h.update(p.relative_to(here.parent).as_posix().encode())
        h.update(read_bytes(p, limit=SOURCE_LIMIT, what="surgeon's own source"))
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
    except (OSError, UnsafeFile):
        return None


def _path(cache_key: str) -> Path:
    return directory() / f"probe-{cache_key}.json"


def load(cache_key: str, index: SourceIndex | None = None) -> EngineProbe | None:
    """The probe kept for ``cache_key``, or None: absent, stale (a file read outside the model
    files changed since), or not to be believed (with a note; the caller recomputes and stores)."""
    d = directory()
    path = _path(cache_key)
    if not trusted(d):
        return None
    try:
        raw = read_bytes(path, limit=ENTRY_LIMIT, follow=False, what="the probe cache entry")
        data = json.loads(unseal(secret(create=False), cache_key, raw))
        if index is not None and any(index.fingerprint([p]) != h for p, h in data.get("outside", {}).items()):
            return None  # a file read outside the model files changed since: a plain miss
        return _decode(data)
    except FileNotFoundError:
        return None
    except (UnsafeFile, Mismatch) as e:
        why = str(e)
    except Exception as e:  # noqa: BLE001 - sealed by us yet not decodable: never believed
        why = f"damaged ({type(e).__name__})"
    note(f"{why if why.startswith(str(path)) else f'{path}: {why}'}; ignored, the probe is recomputed")
    return None


def store(cache_key: str, probe: EngineProbe, outside: dict[str, str] | None = None) -> None:
    """Keep ``probe``; ``outside``: content hashes of the files the probe read beyond the model
    files of the key (a helper followed into ``srt/layers/communicator.py``, say), checked by
    :func:`load` so an edit there is a miss too."""
    d = directory()
    if not make_private(d):
        return
    key_bytes = secret(create=True)
    if key_bytes is None:
        return
    payload = json.dumps(_encode(probe) | {"outside": outside or {}}).encode("utf-8")
    try:  # atomic: replaces whatever is there (a link, a FIFO), never writes through it
        atomic_write(_path(cache_key), seal(key_bytes, cache_key, payload), 0o600)
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
