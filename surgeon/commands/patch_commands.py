"""Commands on engine patches: apply, revert, status, diff, coverage."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from surgeon.commands.platform import platform_command
from surgeon.commands.progress import QUIET, Progress, open_engines
from surgeon.commands.results import DiffReport, EnginePatch, EngineRevert, PatchDiff, RevertReport, StatusReport
from surgeon.core.errors import BadInput

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
          guard_bypass: bool = False, platform: str | None = None, progress: Progress = QUIET) -> Any:
    """Put the spec's captures into the engine's model file (one journaled transaction); returns
    the library's ApplyOutcome."""
    from surgeon.core.spec import load_spec
    from surgeon.patch.apply import DEFAULT_MAX_TOKENS, apply_spec

    s = load_spec(spec)
    if not model_file:  # the probe finds the loop's file: probe first, with its own progress
        open_engines([engine], {engine: engine_root}, progress)
    with progress.spinner("rewriting and applying"):
        return apply_spec(s, engine=engine, engine_root=engine_root, mode=mode,
                          max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                          model_file=model_file, loop_class=loop_class, name=name, dry_run=dry_run,
                          diff=diff, replace=replace, guard_bypass=guard_bypass)


def _applied_summary(applied: dict[str, list[str]]) -> str:
    return "; ".join(f"{e}: {', '.join(v) if v else 'none'}" for e, v in applied.items())


def choose_reverts(managers: list[tuple[str, Any]], name: str | None, all_: bool) -> list[tuple[str, Any]]:
    """The engines whose patches a revert touches: the one holding ``name``; with ``all_`` every
    one holding any; otherwise the only patch applied, refusing when there is none or several.
    ``name`` and ``all_`` are exclusive (:func:`revert` refuses both before looking)."""
    applied = {e: [p.name for p in m.status()] for e, m in managers}
    if name:
        holders = [(e, m) for e, m in managers if name in applied[e]]
        if not holders:
            raise BadInput(f"{name}: no such patch applied ({_applied_summary(applied)})")
        return holders
    holding = [(e, m) for e, m in managers if applied[e]]
    if all_:
        return holding
    if not holding:
        raise BadInput(f"no surgeon patches applied ({_applied_summary(applied)})")
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
        report.reverted.append(EngineRevert(e, str(m.root), r.reverted, r.restored, r.warnings, r.recovered))
    return report


def status(*, engine: str | None = None, engine_root: str | None = None) -> StatusReport:
    """Every surgeon patch in each engine, and whether its files are still as patched (exit 3 if not)."""
    return StatusReport([EnginePatch(e, m.root, p) for e, m in engines_with_managers(engine, engine_root)
                         for p in m.status()])


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
