"""Commands on engine patches: apply, revert, status, diff, coverage."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from surgeon.commands.outputs.patches import EngineRevert
from surgeon.commands.platform import platform_command
from surgeon.commands.progress import QUIET, Progress, open_engines
from surgeon.core.errors import BadInput
from surgeon.core.shapes import Reads, reads
from surgeon.patch.apply import SpecIdentity
from surgeon.patch.manifest import ABSENT, FileStatus, PatchStatus, Unrecorded

ENGINES = ("sglang", "vllm")


def engines_with_managers(engine: str | None, engine_root: str | None) -> list[tuple[str, Any]]:
    """(engine, PatchManager) for ``engine``, else for every engine installed here."""
    from surgeon.patch.apply import manager_for

    if engine_root and not engine:
        raise BadInput("--engine-root needs --engine")
    if engine:
        return [(engine, manager_for(engine, engine_root))]
    found = []
    for e in ENGINES:
        try:
            found.append((e, manager_for(e)))
        except BadInput:
            continue  # not installed here
    if not found:
        raise BadInput("neither sglang nor vllm is installed here; pass --engine and --engine-root")
    return found


@platform_command
def apply(*, spec: str, engine: str, engine_root: str | None = None, mode: Literal["dump", "aux"] = "dump",
          max_tokens: int | None = None, model_file: str | None = None, loop_class: str | None = None,
          name: str | None = None, dry_run: bool = False, diff: bool = False, replace: bool = False,
          guard_bypass: bool = False, deliver: Literal["disk", "plugin"] = "disk", out: str | None = None,
          platform: str | None = None, progress: Progress = QUIET) -> Any:
    """Put the spec's captures into the engine's model file (one journaled transaction), or with
    ``deliver="plugin"`` build them as an engine plugin in ``out`` (the engine root only read);
    returns the library's ApplyOutcome (a plugin's: the plan it carries, with ``plugin`` set)."""
    from surgeon.core.spec import load_spec
    from surgeon.patch.apply import DEFAULT_MAX_TOKENS, apply_spec

    if deliver not in ("disk", "plugin"):
        raise BadInput(f"--deliver must be disk or plugin, not {deliver!r}")
    if (deliver == "plugin") != (out is not None):
        raise BadInput("-o/--out names the plugin's folder: give it with --deliver plugin, and only then")
    if deliver == "plugin" and (dry_run or replace or guard_bypass or name):
        raise BadInput("--deliver plugin takes none of --dry-run, --replace, --guard-bypass, --name")
    s = load_spec(spec)
    if not model_file:  # the probe finds the loop's file: probe first, with its own progress
        open_engines([engine], {engine: engine_root}, progress)
    tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if deliver == "plugin":
        assert out is not None
        build = deliver_plugin(spec=spec, engine=engine, out=out, engine_root=engine_root, mode=mode, max_tokens=tokens,
                               model_file=model_file, loop_class=loop_class, progress=progress)
        carried = apply_spec(s, engine=engine, engine_root=engine_root, mode=mode, max_tokens=tokens,
                             model_file=model_file, loop_class=loop_class, dry_run=True, diff=diff)
        carried.plugin = build
        carried.diff = carried.diff if diff else None  # a dry run always carries its diff; shown only when asked
        return carried
    with progress.spinner("rewriting and applying"):
        return apply_spec(s, engine=engine, engine_root=engine_root, mode=mode, max_tokens=tokens,
                          model_file=model_file, loop_class=loop_class, name=name, dry_run=dry_run,
                          diff=diff, replace=replace, guard_bypass=guard_bypass)


def deliver_plugin(*, spec: str, engine: str, out: str, engine_root: str | None = None,
                   mode: Literal["dump", "aux"] = "dump", max_tokens: int | None = None, model_file: str | None = None,
                   loop_class: str | None = None, progress: Progress = QUIET) -> Any:
    """Build the spec's patch as an engine plugin package in ``out`` (``surgeon apply --deliver
    plugin -o DIR``): the engine root is only read. Returns the library's
    ``surgeon.patch.plugin.PluginBuild`` (the ``plugin`` key of apply's ``--json``)."""
    from surgeon.core.spec import load_spec
    from surgeon.patch.apply import DEFAULT_MAX_TOKENS
    from surgeon.patch.plugin import build_plugin

    s = load_spec(spec)
    if not model_file:  # the probe finds the loop's file: probe first, with its own progress
        open_engines([engine], {engine: engine_root}, progress)
    with progress.spinner(f"building the {engine} plugin"):
        return build_plugin(s, engine=engine, out=out, engine_root=engine_root, mode=mode,
                            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                            model_file=model_file, loop_class=loop_class)


def _applied_summary(applied: dict[str, list[str]]) -> str:
    return "; ".join(f"{e}: {', '.join(v) if v else 'none'}" for e, v in applied.items())


def choose_reverts(managers: list[tuple[str, Any]], name: str | None, all_: bool) -> list[tuple[str, Any]]:
    """The engines whose patches a revert touches: the one holding ``name``; with ``all_`` every
    one holding any; otherwise the only patch applied, refusing when there is none or several.
    ``name`` and ``all_`` are exclusive (:func:`revert` refuses both before looking)."""
    seen = {e: m.inspect() for e, m in managers}
    applied = {e: [p.name for p in seen[e].patches] for e, _ in managers}
    lost = sorted({f"{e} {u.relpath}" for e, _ in managers for u in seen[e].unrecorded})
    hint = (f"; but {', '.join(lost)} carry surgeon patch markers no manifest records (patched but unrecorded): "
            f"`surgeon doctor` says how to restore them") if lost else ""
    if name:
        holders = [(e, m) for e, m in managers if name in applied[e]]
        if not holders:
            raise BadInput(f"{name}: no such patch applied ({_applied_summary(applied)}){hint}")
        return holders
    holding = [(e, m) for e, m in managers if applied[e]]
    if all_ and (holding or not lost):
        return holding
    if not holding:
        raise BadInput(f"no surgeon patches applied ({_applied_summary(applied)}){hint}")
    if len(holding) > 1 or len(applied[holding[0][0]]) > 1:
        raise BadInput(f"several patches applied ({_applied_summary(applied)}); name one or pass --all")
    return holding


def revert(*, name: str | None = None, all_: bool = False, force: bool = False, engine: str | None = None,
           engine_root: str | None = None) -> RevertReport:
    """Restore the byte-identical originals of patch ``name`` (or the only patch, or ``all_``)."""
    if name and all_:
        raise BadInput("give a patch NAME or --all, not both")
    report = RevertReport()
    for e, m in choose_reverts(engines_with_managers(engine, engine_root), name, all_):
        r = m.revert(name, all=all_, force=force)
        report.reverted.append(EngineRevert(engine=e, engine_root=str(m.root), reverted=r.reverted, restored=r.restored,
                                            warnings=r.warnings, recovered=r.recovered))
    return report


def status(*, engine: str | None = None, engine_root: str | None = None) -> StatusReport:
    """Every surgeon patch in each engine, and whether its files are still as patched (exit 3 if not)."""
    report = StatusReport([])
    for e, m in engines_with_managers(engine, engine_root):
        seen = m.inspect()
        report.patches += [EnginePatch(e, m.root, p) for p in seen.patches]
        report.unrecorded += [EngineUnrecorded(e, u) for u in seen.unrecorded]
        report.recovered += [f"{e} {m.root}: {seen.recovered}"] if seen.recovered else []
        report.pending += [seen.pending] if seen.pending else []
    return report


def diff(*, name: str | None = None, engine: str | None = None, engine_root: str | None = None) -> DiffReport:
    """The unified diff of patch ``name``, or of every patch, from the stored bytes."""
    found = [PatchDiff(e, p, m.diff(p.name)) for e, m in engines_with_managers(engine, engine_root)
             for p in m.status() if name is None or p.name == name]
    if not found:
        raise BadInput(f"{name}: no such patch applied" if name else "no surgeon patches applied")
    return DiffReport(found)


def coverage(*, engine: str, engine_root: str | None = None, jobs: int | None = None,
             platform: str | None = None, progress: Progress = QUIET) -> Any:
    """Which loop-owning classes of the engine surgeon can patch (the library's CoverageReport);
    the native-capture column holds for ``platform``."""
    from surgeon.patch.coverage import coverage as engine_coverage

    with progress.spinner(f"reading {engine} model files"):
        return engine_coverage(engine, Path(engine_root) if engine_root else None, jobs=jobs, platform=platform)


@dataclass
class EngineDoctor:
    """One engine root's diagnosis, as ``surgeon doctor --json`` reports it."""

    engine: str
    result: Any  # surgeon.patch.doctor.DoctorResult

    engine_root = Reads("result.root")
    repair = Reads("result.repair")
    healthy = Reads("result.healthy")
    findings = Reads("result.findings")  # surgeon.patch.doctor.Finding


@dataclass
class DoctorReport:
    """Per engine root, what is wrong with the patch state and what was (or could be) rebuilt;
    exit 3 while anything is left unfixed."""

    results: list[tuple[str, Any]] = field(default_factory=list)  # (engine, surgeon.patch.doctor.DoctorResult)

    @property
    def healthy(self) -> bool:
        return all(r.healthy for _, r in self.results)

    ok = Reads("healthy")

    @property
    def engines(self) -> list[EngineDoctor]:
        return [EngineDoctor(e, r) for e, r in self.results]

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 3


def doctor(*, engine: str | None = None, engine_root: str | None = None, repair: bool = False) -> DoctorReport:
    """Check each engine's patch state (links, owners, damaged files, lost copies, patched files no
    manifest records); with ``repair``, rebuild what can be proven from stored copies and markers."""
    from surgeon.patch.doctor import doctor as diagnose

    return DoctorReport([(e, diagnose(m, repair=repair)) for e, m in engines_with_managers(engine, engine_root)])


@dataclass
class RevertReport:
    """What each engine's revert did; each entry is its output model (one declaration of the shape)."""

    reverted: list[EngineRevert] = field(default_factory=list)  # empty: --all with nothing applied


class PatchedFile(FileStatus):
    """A patched file's status, and whether the patch created it (no original: revert deletes it)."""

    @classmethod
    def of(cls, f: FileStatus) -> PatchedFile:
        return cls(f.relpath, f.state, f.sha256_before, f.sha256_after)

    @property
    def created(self) -> bool:
        return self.sha256_before == ABSENT


class _PatchView:
    """The fields of an applied patch (``self.patch``, a surgeon.patch.manifest.PatchStatus) that
    the ``status`` and ``diff`` outputs report."""

    patch: PatchStatus

    name = Reads("patch.name")
    state = Reads("patch.state")

    @property
    def files(self) -> list[PatchedFile]:
        return [PatchedFile.of(f) for f in self.patch.files]


@dataclass
class EnginePatch(_PatchView):
    """One applied patch and the engine holding it."""

    engine: str
    engine_root: Path
    patch: PatchStatus

    @property
    def spec(self) -> SpecIdentity:
        return SpecIdentity(self.patch.spec_name, self.patch.spec_sha256)

    engine_version = Reads("patch.engine_version")

    @property
    def created(self) -> str:
        """When the patch was applied."""
        return self.patch.created


class _Unrecorded(NamedTuple):
    engine: str
    file: Unrecorded


@reads("file.marker", "spec_sha256 manifest_id original_sha256")
class EngineUnrecorded(_Unrecorded):
    """A file carrying a patch marker no manifest records, and the engine it is in (unpacks as
    ``(engine, file)``)."""

    relpath = Reads("file.relpath")
    patch = Reads("file.marker.name")
    restorable = Reads("file.restorable")

    @property
    def advice(self) -> str:
        return self.file.advice()


@dataclass
class StatusReport:
    """Every applied patch; a drifted or missing file is a mismatch with what was applied."""

    patches: list[EnginePatch]
    # files carrying a patch marker no manifest records, each an (engine, surgeon.patch.manifest.Unrecorded) pair
    unrecorded: list[EngineUnrecorded] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)  # interrupted transactions finished or rolled back
    pending: list[str] = field(default_factory=list)  # interrupted transactions left (read-only root)

    @property
    def ok(self) -> bool:
        return all(p.patch.state == "applied" for p in self.patches) and not self.unrecorded and not self.pending

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 3


@dataclass
class PatchDiff(_PatchView):
    engine: str
    patch: PatchStatus
    diff: str


@dataclass
class DiffReport:
    patches: list[PatchDiff]

    @property
    def text(self) -> str:
        return "".join(p.diff for p in self.patches)
