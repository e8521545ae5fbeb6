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
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

STAMP = ".complete"  # written last into an unpacked release: "<dist>==<version>"
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
    """The unpacked release under ``dest`` when it is complete (its stamp present), else None."""
    folder = release_dir(dist, version, dest)
    return folder if (folder / STAMP).is_file() else None


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
    when it is not there complete: (its folder, the number of files unpacked; None when it was
    already there). Atomic: unpacked into a temporary folder beside it, stamped, then renamed."""
    folder = release_dir(dist, version, dest)
    if cached(dist, version, dest) is not None:
        return folder, None
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=f".{dist}-{version}-") as tmp:
        wheel = download(dist, version, Path(tmp) / "wheel", quiet_pip=quiet_pip)
        staging = Path(tmp) / "release"
        try:
            n = unpack(wheel, staging)
        except zipfile.BadZipFile as e:
            raise ReleaseError(f"{wheel.name} is not a readable wheel: {e}") from None
        (staging / STAMP).write_text(f"{dist}=={version}\n")
        _put(staging, folder)
    return folder, n


def _put(staging: Path, folder: Path) -> None:
    """Rename the complete ``staging`` to ``folder``, replacing an incomplete one left by an older
    run; a complete one another process put there first is kept."""
    if folder.exists() and not (folder / STAMP).is_file():
        shutil.rmtree(folder, ignore_errors=True)
    try:
        os.replace(staging, folder)
    except OSError:
        if not (folder / STAMP).is_file():
            raise
