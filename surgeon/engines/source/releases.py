"""Engine releases as sources, never installed: a release is ``pip download --no-deps``'d as its
wheel, and only its Python files and its dist-info ``METADATA`` are unpacked, into a
site-packages-like folder ``<dest>/<dist>-<version>/`` (``.../vllm-0.34.0/vllm/...``) stamped
complete when the whole wheel is there.

Two callers share this one home of the download and the unpacking: ``scripts/fetch-engines``
(the test matrix in ``.engines/``, run by ``scripts/setup`` before surgeon is installed, which is
why this module imports nothing of surgeon and only the standard library at module level: the
script loads it by file path) and ``surgeon upgrade-check`` (a release named by version, cached in
``$XDG_CACHE_HOME/surgeon/releases/``).

Nothing in an archive is trusted: a member with an absolute path or a ``..`` part is never
extracted, and a release is unpacked into a temporary folder renamed into place only when complete,
so a folder with its stamp is always a whole release.

Nothing in the cache is trusted either (issue 36; the source read decides what upgrade-check says):

* **digests**: each release records the SHA-256 of every file it unpacked (:data:`MANIFEST`,
  ``<sha256>  <path>`` lines, written before the stamp); a release is reused only when its files
  are exactly those, each with its digest (no file missing, added, changed, linked or special).
  A mismatch is said in a note and the release fetched again, never used silently. A release
  complete without a manifest (fetched by an older surgeon, as ``.engines/`` of a checkout may be)
  has one recorded on first use, with a note;
* **owner and mode**: the user's cache (:func:`cache_dir`, and the ``surgeon`` folder above it)
  is used only when :func:`surgeon.core.safefile.untrusted_dir`, the one trust rule of surgeon's
  caches, finds nothing wrong, and each release in it only when the same rule passes for its
  folder; otherwise a release found there is not used and none is fetched into it (one line: why).
  ``.engines/`` of a checkout is not checked so: it sits among surgeon's own source, which whoever
  could write it could edit as well.

This module is loaded by file path before surgeon is installed; the one trust rule is imported
when first needed, from the checkout this file sits in when surgeon is not importable (it needs
the standard library only).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from types import ModuleType

STAMP = ".complete"  # written last into an unpacked release: "<dist>==<version>"
MANIFEST = ".sha256"  # written before the stamp: "<sha256>  <path>" of every file unpacked
MANIFEST_LIMIT = 64 << 20  # the largest manifest (vLLM, ~2000 files) is under 1 MiB
# A version as pip is asked for it (PEP 440's public part, with an optional local label): anything
# else given where a version is expected is bad input before pip runs.
_VERSION = re.compile(r"^v?\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?(\+[A-Za-z0-9.]+)?$")


class ReleaseError(Exception):
    """A release cannot be had: pip found no wheel for it, or the wheel is not what was asked. One line."""


def is_version(text: str) -> bool:
    """``text`` reads as a release version (``0.34.0``, ``0.5.23``, ``1.0rc1``, ``0.32.0+cpu``)."""
    return bool(_VERSION.match(text.strip()))


def cache_dir() -> Path:
    """Where releases named by version are kept: ``$XDG_CACHE_HOME/surgeon/releases`` (default
    ``~/.cache/surgeon/releases``), beside surgeon's probe cache; deleting it is always safe."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "surgeon" / "releases"


def release_dir(dist: str, version: str, dest: Path) -> Path:
    return dest / f"{dist}-{version}"


def cached(dist: str, version: str, dest: Path) -> Path | None:
    """The unpacked release under ``dest`` when it is complete (its stamp present), trusted and
    whole (its digests match, see the module's text), else None (with a note saying why, when it
    is there but not used)."""
    folder = release_dir(dist, version, dest)
    if not (folder / STAMP).is_file():
        return None
    why = _unusable(dest, folder)
    if why is not None:
        _note(f"not using {folder} ({why})")
        return None
    return folder


def _unusable(dest: Path, folder: Path) -> str | None:
    """Why release ``folder`` in ``dest`` must not be used (None: it may be)."""
    if not (folder / STAMP).is_file():
        return "incomplete: no stamp"
    return _untrusted(dest, folder) or _mismatch(folder)


# -- trust and digests ------------------------------------------------------------------------------
_noted: set[str] = set()


def _note(message: str) -> None:
    """:func:`surgeon.core.safefile.note`, once per message in this process."""
    _safefile().note(message, _noted)


def _safefile() -> ModuleType:
    """:mod:`surgeon.core.safefile` (standard library only): imported, or, when surgeon is not
    installed (scripts/fetch-engines during setup), from the checkout this file sits in."""
    try:
        from surgeon.core import safefile
    except ImportError:
        sys.path.append(str(Path(__file__).resolve().parents[3]))
        from surgeon.core import safefile
    return safefile


def _is_cache(dest: Path) -> bool:
    return os.path.abspath(dest) == os.path.abspath(cache_dir())


def _untrusted(dest: Path, folder: Path | None = None) -> str | None:
    """Why the releases in ``dest`` must not be used (None: they may be): checked only for the
    user's cache (``dest`` is :func:`cache_dir`), on it, the folder above it, and ``folder`` (a
    release in it; a link there is the user's own, its target is checked)."""
    if not _is_cache(dest):
        return None
    safefile = _safefile()
    why = safefile.untrusted_dir(dest.parent) or safefile.untrusted_dir(dest)
    if why is None and folder is not None:
        try:
            why = safefile.distrust(folder, os.stat(folder))
        except OSError as e:
            why = f"{folder}: cannot inspect it ({e.strerror or e})"
    return why


def _digests(folder: Path) -> dict[str, str]:
    """The SHA-256 of every file under ``folder`` (its stamp and manifest aside), by '/'-separated
    path; ``ValueError`` (why, naming it) for anything there but folders and regular files."""
    safefile = _safefile()
    voice = safefile.Voice(what="a file of the release", not_regular=", where a release holds regular files only")
    out: dict[str, str] = {}
    for top, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            path = Path(top) / name
            rel = path.relative_to(folder).as_posix()
            if rel in (STAMP, MANIFEST) or (name in dirs and not path.is_symlink()):
                continue
            try:
                fd = safefile.open_at(path, os.O_RDONLY, follow=False, voice=voice)[0]
            except (OSError, safefile.UnsafeFile) as e:
                raise ValueError(str(e)) from None
            with os.fdopen(fd, "rb") as f:
                out[rel] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


def record(folder: Path) -> None:
    """Write ``folder``'s :data:`MANIFEST`: the digest of every file in it now."""
    lines = "".join(f"{digest}  {rel}\n" for rel, digest in sorted(_digests(folder).items()))
    _safefile().write_file(folder / MANIFEST, lines.encode(), overwrite=True, what="the digest manifest", mode=0o644)


def _recorded(folder: Path) -> dict[str, str] | None:
    """The digests ``folder``'s manifest records (None: it has none); ``ValueError`` when it
    cannot be read or parsed."""
    safefile = _safefile()
    try:
        text = safefile.read_text(folder / MANIFEST, limit=MANIFEST_LIMIT, follow=False, what="the digest manifest")
    except FileNotFoundError:
        return None
    except safefile.UnsafeFile as e:
        raise ValueError(str(e)) from None
    out = {}
    for line in text.splitlines():
        digest, sep, rel = line.partition("  ")
        if not sep or not re.fullmatch(r"[0-9a-f]{64}", digest) or not rel:
            raise ValueError(f"{folder / MANIFEST}: not a digest manifest (line {line[:80]!r})")
        out[rel] = digest
    return out


def _mismatch(folder: Path) -> str | None:
    """Why ``folder``'s files are not the ones its manifest records (None: they are). A folder
    without a manifest has one recorded now (first use; a read-only one is used unverified,
    with a note)."""
    try:
        want = _recorded(folder)
        have = _digests(folder)
    except ValueError as e:
        return str(e)
    if want is None:
        try:
            record(folder)
        except _safefile().UnsafeFile as e:
            _note(f"{folder}: its files' digests are not recorded and cannot be ({e}); used unverified")
            return None
        _note(f"{folder}: recorded the digests of its {len(have)} files (first use; checked from now on)")
        return None
    return _difference(want, have)


def _difference(want: dict[str, str], have: dict[str, str]) -> str | None:
    """The first file (by path) that is missing, added or changed, as a reason; None when none is."""
    for rel in sorted(set(want) | set(have)):
        if rel not in have:
            return f"{rel} is missing"
        if rel not in want:
            return f"{rel} was added"
        if want[rel] != have[rel]:
            return f"{rel} changed (sha256 {have[rel][:12]}..., recorded {want[rel][:12]}...)"
    return None
def _wanted(name: str) -> bool:
    """A member worth unpacking: a Python file, or the METADATA of the wheel's dist-info."""
    top = name.split("/", 1)[0]
    return name.endswith(".py") or (top.endswith(".dist-info") and name.endswith("/METADATA"))


def _safe(name: str) -> bool:
    """A member name that stays inside the target: relative, without a ``..`` part or a drive."""
    path = PurePosixPath(name.replace("\\", "/"))
    return not (name.startswith(("/", "\\")) or ".." in path.parts or (path.parts and ":" in path.parts[0]))


def unpack(wheel: Path, target: Path) -> int:
    """Unpack the Python files and dist-info METADATA of ``wheel`` into ``target``; members with an
    absolute path or a ``..`` part are refused (never extracted). Returns the number unpacked."""
    n = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if not _wanted(info.filename) or not _safe(info.filename):
                continue
            zf.extract(info, target)
            n += 1
    return n


def download(dist: str, version: str, into: Path, *, quiet_pip: bool = False) -> Path:
    """``pip download --no-deps --only-binary=:all: <dist>==<version>`` into ``into``: the one
    wheel it fetched. ``quiet_pip``: keep pip's own error output (shown otherwise) for the
    :class:`ReleaseError`, whose one line then ends with pip's last line."""
    cmd = [sys.executable, "-m", "pip", "download", "-qq", "--no-deps", "--only-binary=:all:",
           f"{dist}=={version}", "-d", str(into)]
    try:
        done = subprocess.run(cmd, capture_output=quiet_pip, text=True, check=False)
    except OSError as e:
        raise ReleaseError(f"cannot run pip to download {dist}=={version}: {e.strerror or e}") from None
    if done.returncode != 0:
        said = [line.strip() for line in (done.stderr or "").splitlines() if line.strip()]
        raise ReleaseError(f"pip download {dist}=={version} failed (exit {done.returncode})"
                           + (f": {said[-1]}" if said else ""))
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ReleaseError(f"expected one wheel for {dist}=={version}, got {len(wheels)}")
    return wheels[0]


def fetch(dist: str, version: str, dest: Path, *, quiet_pip: bool = False) -> tuple[Path, int | None]:
    """The release unpacked under ``dest`` (``<dest>/<dist>-<version>``), downloaded and unpacked
    when it is not there complete, trusted and whole (:func:`cached`): (its folder, the number of
    files unpacked; None when it was already there). Atomic: unpacked into a temporary folder
    beside it, its digests recorded, stamped, then renamed. :class:`ReleaseError` when ``dest`` is
    the user's cache and must not be trusted."""
    folder = release_dir(dist, version, dest)
    if cached(dist, version, dest) is not None:
        return folder, None
    _private(dest)
    with tempfile.TemporaryDirectory(dir=dest, prefix=f".{dist}-{version}-") as tmp:
        wheel = download(dist, version, Path(tmp) / "wheel", quiet_pip=quiet_pip)
        staging = Path(tmp) / "release"
        try:
            n = unpack(wheel, staging)
        except zipfile.BadZipFile as e:
            raise ReleaseError(f"{wheel.name} is not a readable wheel: {e}") from None
        record(staging)
        (staging / STAMP).write_text(f"{dist}=={version}\n")
        _put(staging, folder)
    return folder, n


def _private(dest: Path) -> None:
    """Create ``dest`` (the user's cache, and the ``surgeon`` folder above it, mode 0700 as the
    probe cache's) and refuse it, :class:`ReleaseError`, when it must not be trusted."""
    if _is_cache(dest):
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        dest.mkdir(mode=0o700, exist_ok=True)
    dest.mkdir(parents=True, exist_ok=True)
    why = _untrusted(dest)
    if why is not None:
        raise ReleaseError(f"not using the releases cache ({why}); fix its owner or mode, or set XDG_CACHE_HOME")


def _put(staging: Path, folder: Path) -> None:
    """Rename the complete ``staging`` to ``folder``, replacing what is there unless it is usable
    (incomplete, left by an older run, changed since, or not to be trusted; a link is removed,
    never followed); a usable one another process put there first is kept."""
    if folder.is_symlink():
        folder.unlink()
    elif folder.exists() and _unusable(folder.parent, folder) is not None:
        shutil.rmtree(folder, ignore_errors=True)
    try:
        os.replace(staging, folder)
    except OSError:
        if _unusable(folder.parent, folder) is not None:
            raise
