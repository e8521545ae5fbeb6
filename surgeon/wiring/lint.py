"""`surgeon lint`: a spec is well formed, and each engine it targets can feed the draft's fc
exactly what it declares (expressible, in an order the engine keeps), per the installed source.

Lint is at least as strict as ``render``: whatever render refuses for an engine (a class the engine,
or without it the built-in table, does not have; an answer :class:`~surgeon.core.errors.Unverified`
where it decides which class runs; a point it cannot capture; a runner that ignores the ids; a
declared norm flag it would serve the draft without) is an error for that engine, whether or not the
engine was asked for. ``strict`` adds the answers render gives but marks unverified (a capture site
not read to the end, a runner's device graphs, a pipeline not checked) and MTP answers not decided."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from surgeon.core.conventions import NotExpressible
from surgeon.core.errors import BadInput
from surgeon.core.idrules import ClassConvention
from surgeon.core.spec import Issue, Spec, SpecError, load_spec
from surgeon.engines.facts.modelopt import open_modelopt
from surgeon.engines.view import SERVING_ENGINES, EngineView, model_class_for, open_engine
from surgeon.wiring.evidence import engine_notes, evidence_lines, refusal
from surgeon.wiring.field import hazards
from surgeon.wiring.mtp import mtp_lines
from surgeon.wiring.pins import check_pins
from surgeon.wiring.runnercheck import runner_graph_hazard, runner_refusal

if TYPE_CHECKING:
    from surgeon.engines.probes.pipeline import PipelineAnswer


@dataclass
class LintResult:
    file: str
    spec: Spec | None
    issues: list[Issue] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)  # what was checked, one line each
    # `lint --pp`: per engine checked, where each capture's pipeline stage is (surgeon.engines.probes.pipeline)
    pipeline: list[PipelineAnswer] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(i.severity == "error" for i in self.issues)


def engines_to_check(spec: Spec, requested: Sequence[str]) -> tuple[list[str], bool]:
    """(engines, explicit): what the user asked for, else what the spec pins, else every serving
    engine (then an engine without an MTP head for the target is a warning, not an error)."""
    if requested:
        return list(requested), True
    declared = [e for e in SERVING_ENGINES if spec.pin(e) is not None]
    if declared:
        return declared, True
    return list(SERVING_ENGINES), False


def lint_spec(spec: Spec, *, engines: Sequence[str] = (), roots: dict[str, str | None] | None = None,
              strict: bool = False, pp: int | None = None, tp: int = 1) -> LintResult:
    """``strict``: an engine answer render gives but marks unverified (one resting on code the probe
    did not read) is an error, not a warning (so ``surgeon lint --strict`` exits 2 on it); what render
    refuses is an error either way. ``pp``: also check which
    pipeline stage captures each fc point and whether it reaches the draft
    (:mod:`surgeon.engines.probes.pipeline`)."""
    roots = roots or {}
    result = LintResult(spec.file, spec)
    targets, explicit = engines_to_check(spec, engines)
    if spec.model.draft is None:
        result.checked.append("no draft section: engine ids not checked")
        return result
    fc_path = ("draft", "fc_input")
    kind = spec.model.draft.kind
    if kind == "mtp":
        result.checked.append("mtp draft: it reads the returned hidden state, no aux ids to check")
        for engine in targets:
            _lint_mtp(spec, engine, roots.get(engine), result, strict=strict, explicit=explicit)
        return result
    for engine in targets:
        if kind == "dflash" and engine == "sglang":
            _lint_sglang_dflash(spec, roots.get(engine), result, strict=strict, pp=pp)
            continue
        view = open_engine(engine, roots.get(engine))
        pin_issues, pin_checked = check_pins(spec, engine, view)
        result.issues.extend(pin_issues)
        result.checked.extend(pin_checked)
        cls = model_class_for(spec, engine)
        try:
            conv = view.convention(cls)
        except BadInput as e:  # render refuses this engine (no such class, unverified dispatch): so does lint
            scope = "" if explicit else (" (every serving engine is checked unless the spec pins some under "
                                         "engines: or --engine names them)")
            result.issues.append(spec.issue(("target", "architecture"), f"{e}{scope}"))
            continue
        result.checked.append(f"{engine}: {conv.name} via {conv.origin}")
        positions = [p.position for p in spec.fc_points if p.position is not None]
        refused = refusal(conv.cc, positions, spec.num_layers)
        if refused is not None:
            result.issues.append(spec.issue(fc_path, f"{engine}: {refused}"))
            continue
        unverified = conv.cc.unverified_for(positions, spec.num_layers)
        if unverified is not None:
            result.issues.append(spec.issue(
                fc_path, f"{engine}: unverified: {conv.cc.class_name} ({conv.cc.path}:{conv.cc.line}): {unverified}",
                severity="error" if strict else "warning"))
        try:
            ids = conv.encode(spec.fc_points, spec.num_layers)
        except NotExpressible as e:
            result.issues.append(spec.issue(fc_path, f"{engine}: {e}"))
            continue
        result.checked.append(f"{engine}: ids {ids} capture {', '.join(str(p) for p in spec.fc_points)}"
                              + ("" if unverified is None else " (unverified)"))
        result.checked.extend(n if n.startswith(f"{engine}:") else f"{engine}: {n}"
                              for n in engine_notes(conv.cc, positions, spec.num_layers) if not n.startswith("unverified"))
        result.checked.extend(f"{engine}: evidence: {e}" for e in evidence_lines(conv.cc, positions, spec.num_layers))
        if pp is not None and kind != "eagle3":
            result.checked.append(f"{engine}: pp {pp}: not checked for a {kind} draft (only eagle3 captures are read)")
        elif pp is not None:
            _lint_pipeline(spec, engine, view, conv.cc, result, pp=pp, tp=tp, strict=strict)
        _lint_runner(spec, engine, view, conv.cc, ids, result, strict=strict)
        _lint_norms(spec, engine, roots.get(engine), result)
        for b in conv.cc.bypasses:
            result.issues.append(spec.issue(
                fc_path,
                f"{engine}: {b.path or conv.cc.path}:{b.line}: {b.description} (when: {b.layers})",
                severity="warning",
            ))
    _lint_field(spec, roots, result, targets)
    return result


def _lint_runner(spec: Spec, engine: str, view: EngineView, cc: ClassConvention, ids: list[int], result: LintResult, *,
                 strict: bool) -> None:
    """What the release's model runner does with the ids: an error where it ignores them; where it
    builds its device graphs with the model's default before the draft's ids arrive (read, not run:
    a warning, an error under ``strict``) when the spec's captures differ from that default."""
    fc_path = ("draft", "fc_input")
    ignored = runner_refusal(view.probe, cc, ids, spec.num_layers)
    if ignored:
        result.issues.append(spec.issue(fc_path, f"{engine}: {ignored}"))
    kind = spec.model.draft.kind if spec.model.draft is not None else "eagle3"
    hazard = runner_graph_hazard(view.probe, cc, ids, spec.num_layers, kind)
    if hazard:
        result.issues.append(spec.issue(fc_path, f"{engine}: {hazard}", severity="error" if strict else "warning"))


def _lint_norms(spec: Spec, engine: str, root: str | None, result: LintResult) -> None:
    """The draft's declared norm flags as ``render`` reads them for ``engine``
    (:func:`surgeon.wiring.norms.render_lines`): a flag the engine would build the draft without,
    which render refuses, is an error here too; the other lines are what was checked."""
    draft = spec.model.draft
    if draft is None or draft.norms is None:
        return
    from surgeon.wiring.norms import render_lines  # reads the engine's draft model (libcst): only for declared flags

    for line in render_lines(spec, engine, root):
        if "NOT SERVED" in line or "NOT TRAINED" in line:
            result.issues.append(spec.issue(("draft", "norms"), line))
        else:
            result.checked.append(line if line.startswith(f"{engine}:") else f"{engine}: {line}")


def _lint_pipeline(spec: Spec, engine: str, view: EngineView, cc: ClassConvention, result: LintResult, *,
                   pp: int, tp: int, strict: bool) -> None:
    from surgeon.engines.probes.pipeline import lint_pipeline

    if view.probe is None:
        result.issues.append(spec.issue(("draft", "fc_input"), f"{engine}: pp {pp}: not checked: {engine} is not installed",
                                        severity="error" if strict else "warning"))
        return
    issues, checked, answer = lint_pipeline(spec, engine, view.probe.root, view.probe.version, cc, pp, tp, strict=strict)
    result.issues.extend(issues)
    result.checked.extend(checked)
    if answer is not None:
        result.pipeline.append(answer)


def _lint_sglang_dflash(spec: Spec, root: str | None, result: LintResult, *, strict: bool, pp: int | None) -> None:
    """SGLang DFlash: the class's ``set_dflash_layers_to_capture`` and the runner's path to it, read
    from the installed source (:func:`surgeon.wiring.render.sglang_dflash`), graded like the EAGLE-3
    path: whatever render refuses (SGLang or the class missing, a runner not read to the end, what
    SGLang cannot serve) is an error; a capture site render marks unverified is a warning (an error
    under ``strict``). The spec's ``engines.sglang`` pins are checked as for EAGLE-3."""
    from surgeon.wiring.render import sglang_dflash

    fc_path = ("draft", "fc_input")
    view = open_engine("sglang", root)
    pin_issues, pin_checked = check_pins(spec, "sglang", view)
    result.issues.extend(pin_issues)
    result.checked.extend(pin_checked)
    if pp is not None:
        result.checked.append(f"sglang: pp {pp}: not checked for a dflash draft (only eagle3 captures are read)")
    try:
        ans = sglang_dflash(spec, root)
    except BadInput as e:  # whatever render refuses (SGLang or the class missing, an unverified runner) is an error
        result.issues.append(spec.issue(fc_path, f"sglang: DFlash: {str(e).removeprefix(spec.file + ': ')}"))
        return
    if ans.unverified is not None:
        result.issues.append(spec.issue(fc_path, f"sglang: DFlash unverified: {ans.unverified}",
                                        severity="error" if strict else "warning"))
    result.checked.append(f"sglang: DFlash {ans.conv.name} via {ans.conv.origin}")
    result.checked.append(f"sglang: DFlash dflash_config.target_layer_ids {ans.ids} capture "
                          + ", ".join(str(p) for p in spec.fc_points))
    result.checked.extend(n if n.startswith("sglang:") else f"sglang: {n}" for n in ans.notes)
    result.checked.extend(f"sglang: evidence: {e}" for e in ans.evidence)


def _lint_mtp(spec: Spec, engine: str, root: str | None, result: LintResult, *, strict: bool, explicit: bool) -> None:
    """The state ``engine`` hands an MTP head against the spec's ``draft.mtp_input``: the lines
    ``check-draft`` reports (:func:`surgeon.wiring.mtp.mtp_lines`), graded for lint. A different
    state is an error; an answer not decided by the source read (or an engine not installed) is a
    warning, an error under ``strict``; an engine without an MTP head for the target is an error
    when the engine was asked for, else a warning; an undeclared ``mtp_input`` is a warning."""
    path = ("draft", "mtp_input") if spec.mtp_input is not None else ("draft",)
    for severity, kind, detail in mtp_lines(spec, engine, root):
        if severity == "info":
            result.checked.append(detail if detail.startswith(f"{engine}") else f"{engine}: {detail}")
            continue
        if kind in ("mtp_unverified", "mtp_unchecked"):
            severity = "error" if strict else "warning"
        elif kind == "mtp_no_head":
            severity = "error" if explicit else "warning"
        result.issues.append(spec.issue(path, detail if detail.startswith(engine) else f"{engine}: {detail}",
                                        severity=severity))


def _lint_field(spec: Spec, roots: dict[str, str | None], result: LintResult, targets: Sequence[str]) -> None:
    """Model Optimizer's backends read one --aux-layers list differently (its vllm backend hands the
    ids to vLLM unchanged): listed as checked lines, not warnings, because the spec does not say that
    its dumps come from Model Optimizer (a warning on every spec would not be about the spec). Only
    when vLLM is among the engines checked (the hazard is read through vLLM's convention), and its
    DFlash preset only for a DFlash draft."""
    if "vllm" not in targets:
        return
    try:
        vllm = open_engine("vllm", roots.get("vllm")).convention(model_class_for(spec, "vllm"))
    except BadInput as e:
        result.checked.append(f"modelopt: vllm backend not checked: {e}")
        vllm = None
    kind = spec.model.draft.kind if spec.model.draft is not None else None
    result.checked.extend(hazards(spec, vllm, open_modelopt() if kind == "dflash" else None))


def lint_files(
    paths: Sequence[str | Path], *, engines: Sequence[str] = (), roots: dict[str, str | None] | None = None,
    strict: bool = False, pp: int | None = None, tp: int = 1,
) -> list[LintResult]:
    out = []
    for path in paths:
        try:
            spec = load_spec(path)
        except SpecError as e:
            out.append(LintResult(str(path), None, list(e.issues)))
            continue
        out.append(lint_spec(spec, engines=engines, roots=roots, strict=strict, pp=pp, tp=tp))
    return out
