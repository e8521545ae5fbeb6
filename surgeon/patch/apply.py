"""Apply a spec's captures to an engine's real model file, and take them back out.

This is the library behind ``surgeon apply / revert / status / diff``: it joins the spec
(:mod:`surgeon.core.spec`), the engine's location and probe (:mod:`surgeon.engines.view`), the recipes and the
libcst rewriter (:mod:`surgeon.patch.rewriter`), the generated hooks module (:mod:`surgeon.capture.hooks`) and the
journaled file transactions (:mod:`surgeon.patch.manifest`).

One patch is two files, applied and reverted as one transaction:

* the model file (``model_executor/models/llama.py``), rewritten from its *pristine* bytes (the
  stored original when a patch is already applied, so re-applying never stacks captures), and
* the generated hooks module it imports, created next to it as ``_surgeon_hooks_<patch>.py``
  (deleted again on revert; a file of that name that surgeon did not create is never touched).

Which file and class: ``model_file`` / ``loop_class`` when given; else the probe of the installed
engine, which knows the file and class owning the decoder-layer loop of the pinned (or target)
model class (it may be another file: vLLM's Qwen3 runs ``Qwen2Model.forward`` from qwen2.py); else
the spec's pinned ``engines.<e>.model_file``, with the file's only loop-owning class.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from surgeon.core.errors import BadInput
from surgeon.core.shapes import Reads, reads
from surgeon.core.spec import Spec, load_spec
from surgeon.engines.source.locate import EngineLocation, ProbeError, locate_engine
from surgeon.patch.manifest import ApplyResult, FileChange, PatchError, PatchManager, PatchStatus, RevertResult
from surgeon.patch.markers import Marker, hooks_relpath

__all__ = [
    "ApplyOutcome", "PatchPlan", "SpecIdentity", "plan_patch", "apply_spec", "revert_patch", "patch_status",
    "manager_for", "DEFAULT_MAX_TOKENS", "hooks_module_relpath",
]

# The largest default cap on tokens per forward step (vLLM's max_num_batched_tokens for the LLM
# class on GPUs with >= 70 GiB, vllm/engine/arg_utils.py get_batch_defaults; SGLang's chunked
# prefill is smaller); buffers are max_tokens x hidden per slot, and a larger step raises.
DEFAULT_MAX_TOKENS = 16384

_PATCH_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


@dataclass
class PatchPlan:
    """What an apply would write (computed without touching the engine)."""

    name: str
    engine: str
    engine_root: Path
    engine_version: str
    model_file: str  # relpath under the engine root
    loop_class: str | None  # the class whose forward was rewritten (None: the file's only loop owner)
    hooks_file: str  # relpath of the generated module
    hooks_module: str  # its import name
    mode: str
    max_tokens: int
    anchors: list[str]
    changes: list[FileChange]
    spec_name: str
    spec_sha256: str
    recipe: str
    manifest_id: str = ""  # the id the marker in the model file carries (the root's manifest's)

    def diff(self, manager: PatchManager) -> str:
        """Unified diff of the planned change against the pristine files."""
        import difflib

        out: list[str] = []
        for c in self.changes:
            old = b"" if c.create else manager.original_bytes(c.relpath, recover=False)
            a = old.decode("utf-8", "replace").splitlines(keepends=True)
            b = c.new_text_bytes.decode("utf-8", "replace").splitlines(keepends=True)
            out += difflib.unified_diff(a, b, fromfile="/dev/null" if c.create else f"a/{c.relpath}",
                                        tofile=f"b/{c.relpath}")
        return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in out)


@dataclass(frozen=True)
class SpecIdentity:
    """Which spec a patch was made from: its name and the sha256 of its file."""

    name: str
    sha256: str


@reads("plan", "engine engine_version engine_root model_file loop_class hooks_file hooks_module mode max_tokens recipe anchors")
@dataclass
class ApplyOutcome:
    """What ``surgeon apply`` did: the plan, and (unless a dry run) the transaction's result. The
    properties below are the plan's and the result's fields as ``surgeon apply --json`` reports
    them (its output model, ``surgeon.commands.outputs.patches.ApplyOutput``, reads them)."""

    plan: PatchPlan
    applied: bool  # False for a dry run
    result: ApplyResult | None = None
    diff: str | None = None
    plugin: Any = None  # `--deliver plugin`: the surgeon.patch.plugin.PluginBuild carrying this plan (engine unwritten)

    patch = Reads("plan.name")

    @property
    def spec(self) -> SpecIdentity:
        return SpecIdentity(self.plan.spec_name, self.plan.spec_sha256)

    @property
    def dry_run(self) -> bool:
        return not self.applied

    @property
    def changed(self) -> bool | None:
        """Whether the transaction changed anything (None: a dry run)."""
        return None if self.result is None else self.result.changed

    @property
    def files_written(self) -> list[str]:
        return [] if self.result is None else self.result.files

    @property
    def replaced(self) -> list[str]:
        return [] if self.result is None else self.result.replaced

    @property
    def recovered(self) -> str | None:
        return None if self.result is None else self.result.recovered


def _locate(engine: str, engine_root: str | Path | None) -> EngineLocation:
    try:
        return locate_engine(engine, engine_root)
    except ProbeError as e:
        where = f"--engine-root {engine_root}" if engine_root is not None else engine
        raise BadInput(f"{where}: {e}") from None


def manager_for(engine: str, engine_root: str | Path | None = None) -> PatchManager:
    """The patch manager of the engine's package directory (installed one by default)."""
    return PatchManager(_locate(engine, engine_root).root)


def hooks_module_relpath(model_file: str, patch_name: str) -> str:
    return hooks_relpath(model_file.replace("\\", "/"), patch_name)


def _import_name(package: str, relpath: str) -> str:
    parts = PurePosixPath(relpath).with_suffix("").parts
    if not all(p.isidentifier() for p in parts):
        raise BadInput(f"{relpath}: not importable as a module path ({'.'.join(parts)})")
    return ".".join((package,) + parts)


def _spec_positions(spec: Spec, mode: str) -> tuple[set[int], bool]:
    from surgeon.capture.hooks import slot_names

    try:
        names = slot_names(spec, mode)
    except ValueError as e:
        raise BadInput(f"{spec.file}: {e}") from None
    positions: set[int] = set()
    final = False
    for n in names:
        p = spec.captures[n]
        if p.kind == "final_norm":
            final = True
        elif p.position is not None:  # embed or layer_out: the kinds on the residual stream
            positions.add(p.position)
        else:  # layer_delta: the layer's own output without the residual; the rewriter reads sums
            raise BadInput(f"{spec.file}: capture {n!r} is {p}: a patch captures the residual stream "
                           f"(embed, layer_out[k], final_norm), not a layer's delta")
    return positions, final


def _target_file(spec: Spec, location: EngineLocation, model_file: str | None,
                 loop_class: str | None) -> tuple[str, str | None]:
    """(model file relpath, loop-owning class or None) for the spec on this engine.

    The decoder-layer loop may live in another file than the model class (vLLM's Qwen3 runs
    ``Qwen2Model.forward`` from qwen2.py): the probe's ``loop_owner`` says where, and wins over the
    pinned ``model_file`` (which names where the class and its setter are)."""
    engine = location.engine
    if model_file is not None:
        return model_file.replace("\\", "/"), loop_class
    pin = spec.pin(engine)
    cls = (pin.model_class if pin is not None and pin.model_class else None) or spec.model.target.architecture
    from surgeon.engines.view import open_engine

    view = open_engine(engine, location.root)
    cc = view.probe.get(cls) if view.probe is not None else None
    owner = getattr(cc, "loop_owner", None) if cc is not None else None  # "path:Class.method"
    if owner and ":" in owner:
        path, qual = owner.split(":", 1)
        return path, loop_class or qual.split(".")[0]
    if pin is not None and pin.model_file:
        return pin.model_file, loop_class
    if cc is not None:
        return cc.path, loop_class
    raise BadInput(f"{engine} {location.version} has no capture-aware class {cls!r} to find the model file from; "
                   f"pin engines.{engine}.model_file in the spec or pass --model-file")


def plan_patch(spec: Spec | str | Path, *, engine: str, engine_root: str | Path | None = None,
               mode: Literal["dump", "aux"] = "dump", max_tokens: int = DEFAULT_MAX_TOKENS,
               model_file: str | None = None, loop_class: str | None = None, name: str | None = None,
               recipes_dir: str | Path | None = None, guard_bypass: bool = False) -> PatchPlan:
    """Everything an apply would write, computed from the pristine engine files; writes nothing."""
    from surgeon.capture.graphsafe import check_source
    from surgeon.capture.hooks import generate_hooks_module
    from surgeon.patch.rewriter import find_recipe, load_recipes, rewrite

    if not isinstance(spec, Spec):
        spec = load_spec(spec)
    if mode not in ("dump", "aux"):
        raise BadInput(f"--mode must be dump or aux, not {mode!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadInput(f"--max-tokens must be a positive integer, not {max_tokens!r}")
    name = name or spec.name
    if not _PATCH_NAME.match(name):
        raise BadInput(f"{name!r}: a patch name is letters, digits and . _ + - (at most 128)")
    location = _locate(engine, engine_root)
    manager = PatchManager(location.root)
    relpath, cls = _target_file(spec, location, model_file, loop_class)
    positions, final = _spec_positions(spec, mode)
    try:
        original = manager.original_bytes(relpath, recover=False)  # a plan (a dry run) writes nothing
    except PatchError as e:
        raise BadInput(f"{engine} {location.version}: {e}") from None
    owners = manager.owners()
    try:  # a file carrying a patch nobody here records is never patched again (no stacking)
        manager.refuse_foreign_markers([FileChange(relpath, b"")], owners, {relpath: original})
    except PatchError as e:
        raise BadInput(f"{engine} {location.version}: {e}") from None
    hooks_file = hooks_module_relpath(relpath, name)
    owner = owners.get(hooks_file)
    if owner is not None and owner != name:
        raise BadInput(f"patch names {owner!r} and {name!r} give the same hooks module {hooks_file}; "
                       f"choose another --name")
    hooks_module = _import_name(location.layout.package, hooks_file)
    try:
        recipes = load_recipes(recipes_dir)
    except (OSError, ValueError) as e:
        raise BadInput(f"recipes: {e}") from None
    recipe = find_recipe(recipes, engine=engine, relpath=relpath, class_name=cls)
    marker = Marker(name, spec.sha256, manager.manifest_id(), hashlib.sha256(original).hexdigest())
    result = rewrite(original, relpath=relpath, class_name=cls, positions=positions, capture_final=final,
                     hooks_module=hooks_module, recipe=recipe, guard_bypass=guard_bypass, aux_return=mode == "aux",
                     marker=marker)
    try:
        source = generate_hooks_module(spec, mode=mode, max_tokens=max_tokens)
    except ValueError as e:
        raise BadInput(f"{spec.file}: {e}") from None
    problems = check_source(source, f"<hooks of {name}>")
    if problems:  # generated code must pass the graph-safety checker: a failure here is our bug
        raise RuntimeError(f"generated hooks module fails the graph-safety check: {problems[0]}")
    changes = [
        FileChange(relpath, result.new_bytes, base_sha256=hashlib.sha256(original).hexdigest()),
        FileChange(hooks_file, source.encode("utf-8"), create=True),
    ]
    return PatchPlan(name=name, engine=engine, engine_root=location.root, engine_version=location.version,
                     model_file=relpath, loop_class=cls, hooks_file=hooks_file, hooks_module=hooks_module,
                     mode=mode, max_tokens=max_tokens, anchors=result.anchors, changes=changes,
                     spec_name=spec.name, spec_sha256=spec.sha256, recipe=recipe.name,
                     manifest_id=marker.manifest_id)


def apply_spec(spec: Spec | str | Path, *, engine: str, engine_root: str | Path | None = None,
               mode: Literal["dump", "aux"] = "dump", max_tokens: int = DEFAULT_MAX_TOKENS,
               model_file: str | None = None, loop_class: str | None = None, name: str | None = None,
               dry_run: bool = False, diff: bool = False, replace: bool = False,
               recipes_dir: str | Path | None = None, guard_bypass: bool = False) -> ApplyOutcome:
    """Rewrite the engine's model file for ``spec`` and create its hooks module, as one transaction.

    Idempotent (the same spec again is a no-op); a different patch on the same file is refused
    unless ``replace``; ``dry_run`` computes and diffs without writing anything.
    """
    if not dry_run:  # finish or roll back an interrupted transaction before reading the originals
        manager_for(engine, engine_root).recover()
    plan = plan_patch(spec, engine=engine, engine_root=engine_root, mode=mode, max_tokens=max_tokens,
                      model_file=model_file, loop_class=loop_class, name=name, recipes_dir=recipes_dir,
                      guard_bypass=guard_bypass)
    manager = PatchManager(plan.engine_root)
    text = plan.diff(manager) if (diff or dry_run) else None
    if dry_run:
        return ApplyOutcome(plan, False, None, text)
    result = manager.apply(plan.name, plan.changes, spec_name=plan.spec_name, spec_sha256=plan.spec_sha256,
                           engine=plan.engine, engine_version=plan.engine_version, replace=replace,
                           manifest_id=plan.manifest_id)
    return ApplyOutcome(plan, True, result, text)


def revert_patch(name: str | None = None, *, engine: str, engine_root: str | Path | None = None,
                 all: bool = False, force: bool = False) -> RevertResult:
    return manager_for(engine, engine_root).revert(name, all=all, force=force)


def patch_status(*, engine: str, engine_root: str | Path | None = None) -> list[PatchStatus]:
    return manager_for(engine, engine_root).status()
