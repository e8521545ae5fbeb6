"""The code a surgeon-built engine plugin runs inside the engine (copied verbatim into each package).

:mod:`surgeon.patch.plugin` builds a package that carries the rewritten engine model module(s), the
generated hooks module and a ``manifest.json``; this file goes into it unchanged as
``_surgeon_plugin_runtime.py``. It imports nothing from surgeon (the engine's environment need not
have surgeon installed): only the standard library, ``packaging`` (a dependency of vLLM)
and the engine itself. Every per-plugin value comes from the manifest next to it; no user text is
ever formatted into source.

vLLM (``vllm.general_plugins`` entry point ``register``): vLLM calls ``register()`` in every process
that loads general plugins (``vllm/plugins/__init__.py`` ``load_general_plugins``: the front end's
``EngineArgs``, the engine core, each worker, the registry's inspection subprocess). It

1. checks the installed engine's version against the release the plugin was built for and the
   spec's version pin;
2. for each carried module, finds the engine's own file without importing it
   (``importlib.util.find_spec(module).origin``; the parent package is imported, the module is not)
   and checks its sha256 against the one recorded at build time;
3. on any mismatch raises :class:`PluginRefused` with one line naming the file and both sha256s.
   vLLM runs plugin functions without a ``try`` (only ``plugin.load()``, the import, is wrapped and
   logged), so the exception stops the engine start. Because ``load_general_plugins`` marks itself
   done before it calls the plugins, a second engine start in the same process would not call us
   again: the refused module names are therefore also *poisoned* in ``sys.modules`` (any attribute
   read, such as the registry's ``getattr(module, class_name)``, raises the same message), so no
   later start in that process can load the pristine, unpatched class;
4. otherwise executes each carried module *under the engine's own module name* and puts it in
   ``sys.modules`` (and on its parent package) before vLLM imports the model file. Every importer
   then gets the patched classes, including files that import the loop-owning class from another
   file (vLLM's ``qwen3.py`` does ``from .qwen2 import Qwen2Model``), which registering one
   architecture with ``ModelRegistry.register_model`` could not reach. A module already imported
   from the engine's file before the plugin ran cannot be replaced safely (classes may already be
   bound elsewhere): that is refused too.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "PluginRefused", "check", "register"]

FORMAT = 1  # the manifest format this runtime reads
_MANIFEST = "manifest.json"
_MARK = "__surgeon_plugin__"  # set on a carried module this plugin installed


class PluginRefused(RuntimeError):
    """The plugin does not fit the installed engine: the message is one line naming what differs."""


def _manifest(here: Path) -> dict[str, Any]:
    data = json.loads((here / _MANIFEST).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PluginRefused(f"{here / _MANIFEST}: not a surgeon plugin manifest of format {FORMAT}")
    return data


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _public(version: str) -> str:
    return version.partition("+")[0]


def _check_version(m: dict[str, Any]) -> None:
    """The installed engine is the release the plugin was built for, and the spec's pin allows it."""
    engine = importlib.import_module(m["engine_package"])
    found = str(getattr(engine, "__version__", "") or "")
    who = f"surgeon plugin {m['plugin']}"
    if not found:
        raise PluginRefused(f"{who}: {m['engine_package']} has no __version__ to check against {m['engine_version']}")
    if _public(found) != _public(m["engine_version"]):
        raise PluginRefused(f"{who} was built for {m['engine']} {m['engine_version']} but {found} is installed; "
                            f"rebuild it for this release or uninstall it")
    pin = m.get("version_pin")
    if pin:
        from packaging.specifiers import SpecifierSet

        if not SpecifierSet(pin).contains(_public(found), prereleases=True):
            raise PluginRefused(f"{who}: spec {m['spec']['name']} pins {m['engine']} {pin}, and {found} is installed")


def _check_module(m: dict[str, Any], here: Path, c: dict[str, Any]) -> bool:
    """Whether carried module ``c`` still needs installing (False: this plugin already did, here);
    refuses an engine file whose sha256 differs from the recorded one, and a damaged package."""
    who = f"surgeon plugin {m['plugin']}"
    name = c["module"]
    current = sys.modules.get(name)
    if current is not None:
        if getattr(current, _MARK, None) == m["plugin"]:
            return False
        raise PluginRefused(f"{who}: {name} was imported before the plugin ran; it cannot replace it in this process")
    carried = here / c["file"]
    if _sha256(carried) != c["carried_sha256"]:
        raise PluginRefused(f"{who}: its own {carried} was changed after the build; rebuild the plugin")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:
        raise PluginRefused(f"{who}: cannot find {name} in the installed {m['engine']} ({e})") from None
    if spec is None or not spec.origin:
        raise PluginRefused(f"{who}: the installed {m['engine']} has no {name} ({c['relpath']})")
    found = _sha256(Path(spec.origin))
    if found != c["sha256"]:
        raise PluginRefused(f"{who}: {spec.origin} differs from the file it was built from: recorded sha256 "
                            f"{c['sha256']}, found sha256 {found}; rebuild the plugin for this engine or uninstall it")
    return True


def check(here: Path | None = None) -> list[dict[str, Any]]:
    """The carried modules to install (an empty list: all already installed); raises
    :class:`PluginRefused` on any mismatch. Reads only."""
    here = Path(__file__).resolve().parent if here is None else here
    m = _manifest(here)
    _check_version(m)
    return [c for c in m["modules"] if _check_module(m, here, c)]


class _Refused(types.ModuleType):
    """What a refused engine module becomes in ``sys.modules``: every attribute read raises the refusal."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(name)
        self.__surgeon_refused__ = message

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise PluginRefused(self.__surgeon_refused__)


def _poison(here: Path, message: str) -> None:
    try:
        names = [c["module"] for c in _manifest(here)["modules"]]
    except Exception:
        return
    for name in names:
        sys.modules[name] = _Refused(name, message)


def _install(m: dict[str, Any], here: Path, c: dict[str, Any]) -> None:
    """Execute the carried file under the engine's module name and make it the module everyone imports."""
    name = c["module"]
    spec = importlib.util.spec_from_file_location(name, here / c["file"])
    if spec is None or spec.loader is None:
        raise PluginRefused(f"surgeon plugin {m['plugin']}: cannot load {here / c['file']}")
    module = importlib.util.module_from_spec(spec)
    setattr(module, _MARK, m["plugin"])
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    parent, _, leaf = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], leaf, module)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: check, then install the patched module(s), or stop
    the engine start with the mismatch named."""
    here = Path(__file__).resolve().parent
    try:
        todo = check(here)
    except PluginRefused as e:
        _poison(here, str(e))
        raise
    m = _manifest(here)
    for c in todo:
        _install(m, here, c)

