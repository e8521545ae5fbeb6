"""Deliver a spec's capture patch as an engine plugin: an installable package, the engine root untouched.

``build_plugin`` computes what ``surgeon apply`` would write (:func:`surgeon.patch.apply.plan_patch`:
the rewritten model file and the generated hooks module, from the pristine engine files, writing
nothing) and packs it into ``DIR``::

    DIR/pyproject.toml                      pip install DIR (setuptools; the entry point below)
    DIR/<package>/__init__.py
    DIR/<package>/_surgeon_plugin_runtime.py   surgeon/patch/pluginruntime.py, verbatim
    DIR/<package>/manifest.json             every per-plugin value the runtime reads
    DIR/<package>/<carried module>.py       the rewritten engine file, imports made absolute
    DIR/<package>/_surgeon_hooks_<name>.py  the generated hooks module
    DIR/<distribution>-1.dist-info/         METADATA, entry_points.txt, top_level.txt, RECORD

so that ``PYTHONPATH=DIR`` alone makes ``importlib.metadata`` find the ``vllm.general_plugins``
entry point, and ``pip install DIR`` installs the same. Removing DIR from the path (or ``pip
uninstall``) is the revert: the engine root is never written. What happens at engine start (the
release and sha256 checks, how the patched class is installed, how a mismatch stops the start) is
in :mod:`surgeon.patch.pluginruntime`.

The carried module is the rewritten engine file with its relative imports turned into absolute
imports of the engine package, and its import of the generated hooks module pointed at the
package's copy (both with libcst). The package, distribution and entry-point names are identifiers
derived from the spec name; user text never goes into generated source, only into the JSON manifest.

SGLang: refused, with the reason read from the release's ``srt/models/registry.py`` (see
:func:`delivery_refusal`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from surgeon.core.errors import BadInput
from surgeon.core.spec import Spec, load_spec
from surgeon.patch.apply import DEFAULT_MAX_TOKENS, PatchPlan, SpecIdentity, plan_patch

__all__ = ["CarriedModule", "PluginBuild", "PluginNames", "build_plugin", "plugin_names", "carried_source", "delivery_refusal"]

RUNTIME_MODULE = "_surgeon_plugin_runtime"
MANIFEST = "manifest.json"
PLUGIN_VERSION = "1"
ENTRY_GROUP = "vllm.general_plugins"


@dataclass(frozen=True)
class PluginNames:
    """The identifiers of one spec's plugin: import package, distribution and entry point."""

    package: str
    distribution: str
    entry_point: str

    @property
    def dist_info(self) -> str:
        return f"{self.package}-{PLUGIN_VERSION}.dist-info"


def plugin_names(spec_name: str) -> PluginNames:
    """``surgeon_plugin_<spec name, lower case, runs of other characters as _>``."""
    stem = re.sub(r"[^0-9a-z]+", "_", spec_name.lower()).strip("_") or "spec"
    package = f"surgeon_plugin_{stem}"[:100].rstrip("_")
    assert package.isidentifier()
    return PluginNames(package, package.replace("_", "-"), package)


@dataclass(frozen=True)
class CarriedModule:
    """One engine module the plugin replaces: its engine name and file, the pristine file's sha256
    recorded at build time, and the package's rewritten copy."""

    module: str  # vllm.model_executor.models.llama
    relpath: str  # model_executor/models/llama.py, under the engine root
    file: str  # the copy's file name inside the package
    sha256: str  # the engine's pristine file
    carried_sha256: str  # the package's copy
    loop_class: str | None


@dataclass
class PluginBuild:
    """What ``deliver_plugin`` built (``surgeon apply --deliver plugin``)."""

    out: Path
    names: PluginNames
    engine: str
    engine_version: str
    engine_root: Path
    version_pin: str | None
    spec: SpecIdentity
    mode: str
    max_tokens: int
    modules: list[CarriedModule]
    hooks_module: str
    architectures: list[str]  # the registry's architectures whose class the carried module defines
    anchors: list[str]
    files: list[str] = field(default_factory=list)  # relpaths under out
    replaced: bool = False  # a previous build of the same plugin was in out

    @property
    def package(self) -> str:
        return self.names.package

    @property
    def entry_point(self) -> str | None:
        return f"{ENTRY_GROUP}:{self.names.entry_point}" if self.engine == "vllm" else None

    @property
    def activate(self) -> str:
        """How the engine picks the plugin up without pip."""
        return f"PYTHONPATH={self.out}"

    def environment(self, pythonpath: str | None = None) -> dict[str, str]:
        """The environment entry that activates the plugin for an engine process: its folder first on
        PYTHONPATH, before ``pythonpath`` (default: this process's own)."""
        rest = os.environ.get("PYTHONPATH") if pythonpath is None else pythonpath
        return {"PYTHONPATH": os.pathsep.join([str(self.out)] + ([rest] if rest else []))}

    @property
    def install(self) -> str:
        return f"pip install {self.out}"

    @property
    def uninstall(self) -> str:
        return f"pip uninstall {self.names.distribution} (or drop {self.out} from PYTHONPATH)"


# -- the carried module: relative imports made absolute, the hooks import pointed at the package ----------
def _dotted(parts: list[str]) -> Any:
    import libcst as cst

    node: Any = cst.Name(parts[0])
    for p in parts[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(p))
    return node


def _absolutizer(package: str, old_hooks: str, new_hooks: str) -> Any:
    import libcst as cst
    from libcst.helpers import get_full_name_for_node

    class Absolutize(cst.CSTTransformer):
        renamed = 0

        def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
            if not updated.relative:
                return updated
            base = package.split(".")
            up = len(updated.relative) - 1
            if up >= len(base):
                raise BadInput(f"{package}: a relative import {len(updated.relative)} levels up leaves the engine package")
            parts = base[:len(base) - up]
            if updated.module is not None:
                parts += (get_full_name_for_node(updated.module) or "").split(".")
            return updated.with_changes(relative=(), module=_dotted(parts))

        def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
            if get_full_name_for_node(updated) == old_hooks:
                self.renamed += 1
                return _dotted(new_hooks.split("."))
            return updated

    return Absolutize()


def carried_source(data: bytes, *, module: str, old_hooks: str, new_hooks: str) -> bytes:
    """The rewritten engine file ``data`` (engine module ``module``) as the plugin carries it."""
    import libcst as cst

    tree = cst.parse_module(data)
    t = _absolutizer(module.rpartition(".")[0], old_hooks, new_hooks)
    out = tree.visit(t)
    if t.renamed == 0:  # the rewriter always imports and calls its hooks module
        raise RuntimeError(f"the rewritten {module} never names its hooks module {old_hooks}")
    return out.code.encode(out.encoding)


# -- what goes into the package -------------------------------------------------------------------------
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _module_name(package: str, relpath: str) -> str:
    return ".".join((package,) + PurePosixPath(relpath).with_suffix("").parts)


def _architectures(plan: PatchPlan, spec: Spec) -> list[str]:
    """Architectures vLLM's registry maps to a class of the carried file (read, never imported),
    and the spec's own (its class may import the loop owner from the carried file)."""
    from surgeon.engines.probes.vllm import MODELS, registry_entries
    from surgeon.engines.source.index import SourceIndex
    from surgeon.engines.source.locate import locate_engine

    loc = locate_engine(plan.engine, plan.engine_root)
    entries = registry_entries(SourceIndex(loc.root, loc.layout.package, loc.models_dirs))
    found = {a for a, (mod, _) in entries.items() if f"{MODELS}/{mod.replace('.', '/')}.py" == plan.model_file}
    return sorted(found | {spec.model.target.architecture})


def _pyproject(names: PluginNames, engine: str) -> str:
    """pyproject.toml (setuptools); the only values are the derived identifiers, as TOML strings."""
    q = json.dumps
    entry = (f'\n[project.entry-points."{ENTRY_GROUP}"]\n{names.entry_point} = '
             f"{q(f'{names.package}.{RUNTIME_MODULE}:register')}\n") if engine == "vllm" else ""
    return (f'[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
            f"[project]\nname = {q(names.distribution)}\nversion = {q(PLUGIN_VERSION)}\n"
            f'description = "A surgeon capture patch, delivered as an engine plugin"\n{entry}\n'
            f"[tool.setuptools]\npackages = [{q(names.package)}]\n\n"
            f"[tool.setuptools.package-data]\n{names.package} = [{q(MANIFEST)}]\n")


def _dist_info(names: PluginNames, engine: str, package_files: dict[str, bytes]) -> dict[str, bytes]:
    meta = (f"Metadata-Version: 2.1\nName: {names.distribution}\nVersion: {PLUGIN_VERSION}\n"
            "Summary: A surgeon capture patch, delivered as an engine plugin\n")
    files = {"METADATA": meta.encode(), "top_level.txt": f"{names.package}\n".encode()}
    if engine == "vllm":
        files["entry_points.txt"] = (f"[{ENTRY_GROUP}]\n{names.entry_point} = "
                                     f"{names.package}.{RUNTIME_MODULE}:register\n").encode()
    out = {f"{names.dist_info}/{k}": v for k, v in files.items()}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
              for p, d in sorted({**package_files, **out}.items())]
    out[f"{names.dist_info}/RECORD"] = ("\n".join(record + [f"{names.dist_info}/RECORD,,"]) + "\n").encode()
    return out


def _runtime_source() -> bytes:
    return (Path(__file__).resolve().parent / "pluginruntime.py").read_bytes()


def _manifest(build: PluginBuild) -> dict[str, Any]:
    return {
        "format": 1, "plugin": build.names.package, "engine": build.engine, "engine_package": build.engine,
        "engine_version": build.engine_version, "version_pin": build.version_pin,
        "spec": {"name": build.spec.name, "sha256": build.spec.sha256}, "mode": build.mode,
        "max_tokens": build.max_tokens, "hooks_module": build.hooks_module, "architectures": build.architectures,
        "modules": [{"module": c.module, "relpath": c.relpath, "file": c.file, "sha256": c.sha256,
                     "carried_sha256": c.carried_sha256, "loop_class": c.loop_class} for c in build.modules],
    }


def package_files(build: PluginBuild, carried: dict[str, bytes], hooks: bytes) -> dict[str, bytes]:
    """Every file of the build, by relpath under ``out``."""
    pkg = build.names.package
    files = {f"{pkg}/__init__.py": b'"""A surgeon capture patch, delivered as an engine plugin (see manifest.json)."""\n',
             f"{pkg}/{RUNTIME_MODULE}.py": _runtime_source(),
             f"{pkg}/{build.hooks_module.rpartition('.')[2]}.py": hooks,
             f"{pkg}/{MANIFEST}": (json.dumps(_manifest(build), indent=2, sort_keys=True) + "\n").encode()}
    files.update({f"{pkg}/{name}": data for name, data in carried.items()})
    files.update(_dist_info(build.names, build.engine, files))
    files["pyproject.toml"] = _pyproject(build.names, build.engine).encode()
    return files


# -- the output folder: new, empty, or a previous build of the same plugin; written atomically --------------
def _previous_build(out: Path, package: str) -> bool:
    path = out / package / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError):
        data = None
    return isinstance(data, dict) and data.get("plugin") == package and data.get("format") == 1


def check_out(out: Path, package: str, engine_root: Path) -> bool:
    """Whether ``out`` holds a previous build (replaced); refuses anything else that is not empty
    or absent, a link, and a folder inside the engine root. Writes nothing."""
    if out.is_symlink():
        raise BadInput(f"{out}: is a symbolic link; give the plugin's folder itself")
    resolved = out.resolve()
    if resolved.is_relative_to(engine_root.resolve()) or engine_root.resolve().is_relative_to(resolved):
        raise BadInput(f"{out}: overlaps the engine root {engine_root}; a plugin is built outside the engine")
    if not out.exists():
        return False
    if not out.is_dir():
        raise BadInput(f"{out}: exists and is not a folder")
    if not any(out.iterdir()):
        return False
    if _previous_build(out, package):
        return True
    raise BadInput(f"{out}: is not empty and is not a previous build of plugin {package}; give a new or empty folder")


def write_tree(out: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into a fresh sibling folder, then swap it in for ``out`` (checked by
    :func:`check_out` first): a reader sees the old build or the new one, never half of one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        for rel, data in files.items():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.rmdir(old)
            os.rename(out, old)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- the builder ----------------------------------------------------------------------------------------------
def _pristine_on_disk(plan: PatchPlan) -> str:
    """sha256 of the engine's model file as it is on disk, refused when it is not the pristine file
    the patch was planned from (an on-disk surgeon patch is applied: a plugin never stacks on it)."""
    model = plan.changes[0]
    on_disk = _sha((plan.engine_root / plan.model_file).read_bytes())
    if on_disk != model.base_sha256:
        raise BadInput(f"{plan.engine_root / plan.model_file}: carries an on-disk surgeon patch (sha256 {on_disk}, "
                       f"pristine {model.base_sha256}); `surgeon revert` it before building a plugin")
    return on_disk


def build_plugin(spec: Spec | str | Path, *, engine: str, out: str | Path, engine_root: str | Path | None = None,
                 mode: Literal["dump", "aux"] = "dump", max_tokens: int = DEFAULT_MAX_TOKENS,
                 model_file: str | None = None, loop_class: str | None = None) -> PluginBuild:
    """Build the plugin package of ``spec`` for ``engine`` in ``out``; see the module docstring."""
    if not isinstance(spec, Spec):
        spec = load_spec(spec)
    if (why := delivery_refusal(engine, engine_root)) is not None:
        raise BadInput(why)
    names = plugin_names(spec.name)
    plan = plan_patch(spec, engine=engine, engine_root=engine_root, mode=mode, max_tokens=max_tokens,
                      model_file=model_file, loop_class=loop_class)
    replaced = check_out(Path(out), names.package, plan.engine_root)
    build, carried, hooks = assemble(plan, spec, names, Path(out))
    build.replaced = replaced
    files = package_files(build, carried, hooks)
    build.files = sorted(files)
    write_tree(Path(out), files)
    return build


def assemble(plan: PatchPlan, spec: Spec, names: PluginNames, out: Path) -> tuple[PluginBuild, dict[str, bytes], bytes]:
    """The build's description, the carried module(s) by file name, and the hooks module's bytes."""
    pristine = _pristine_on_disk(plan)
    module = _module_name(plan.hooks_module.split(".")[0], plan.model_file)
    new_hooks = f"{names.package}.{plan.hooks_module.rpartition('.')[2]}"
    data = carried_source(plan.changes[0].new_text_bytes, module=module, old_hooks=plan.hooks_module, new_hooks=new_hooks)
    file = "_".join(PurePosixPath(plan.model_file).with_suffix("").parts) + ".py"
    carried = CarriedModule(module, plan.model_file, file, pristine, _sha(data), plan.loop_class)
    pin = spec.pin(plan.engine)
    build = PluginBuild(out=out, names=names, engine=plan.engine, engine_version=plan.engine_version,
                        engine_root=plan.engine_root, version_pin=pin.version if pin is not None else None,
                        spec=SpecIdentity(plan.spec_name, plan.spec_sha256), mode=plan.mode,
                        max_tokens=plan.max_tokens, modules=[carried], hooks_module=new_hooks,
                        architectures=_architectures(plan, spec), anchors=plan.anchors)
    return build, {file: data}, plan.changes[1].new_text_bytes



def _sglang_external_site(root: Path) -> tuple[str, int | None, int | None]:
    """(registry relpath, line reading ``SGLANG_EXTERNAL_MODEL_PACKAGE`` or None, line of
    ``def import_model_classes`` or None), read with ast from the release's ``srt/models/registry.py``."""
    import ast

    rel = "srt/models/registry.py"
    try:
        tree = ast.parse((root / rel).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return rel, None, None
    env = next((n.lineno for n in ast.walk(tree) if (isinstance(n, ast.Attribute) and n.attr == "SGLANG_EXTERNAL_MODEL_PACKAGE")
                or (isinstance(n, ast.Constant) and n.value == "SGLANG_EXTERNAL_MODEL_PACKAGE")), None)
    fn = next((n.lineno for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "import_model_classes"), None)
    return rel, env, fn



def delivery_refusal(engine: str, engine_root: str | Path | None = None) -> str | None:
    """Why ``surgeon apply --deliver plugin`` builds nothing for this engine (None: it builds, for
    vLLM); for SGLang the reason is read from the release's ``srt/models/registry.py``."""
    if engine == "vllm":
        return None
    if engine != "sglang":
        return f"--deliver plugin is for vllm (or sglang, refused with its reason), not {engine!r}"
    from surgeon.engines.source.locate import ProbeError, locate_engine

    try:
        loc = locate_engine("sglang", engine_root)
    except ProbeError as e:
        return f"sglang: {e}"
    rel, env, fn = _sglang_external_site(loc.root)
    if env is None:
        return (f"sglang {loc.version}: no out-of-tree model package to deliver a plugin through "
                f"({rel} never reads SGLANG_EXTERNAL_MODEL_PACKAGE); use the on-disk patch (surgeon apply)")
    return (f"sglang {loc.version}: not built: SGLang takes an out-of-tree model package "
            f"(SGLANG_EXTERNAL_MODEL_PACKAGE, {rel}:{env}) but its import_model_classes ({rel}:{fn}) logs and skips "
            f"a module that fails to import (the built-in, unpatched class then runs), and SGLang cannot run here to "
            f"verify a package that stops the start on drift instead; use the on-disk patch (surgeon apply --engine sglang)")
