"""From a spec to every convention's ids: `surgeon explain` and `surgeon render`.

Engine ids are computed for the draft's whole ``fc_input`` list (a setter such as deepseek_v2.py's
reads the list, not each id) and verified by replaying the setter: a rendered id list always
captures exactly the spec's points, in fc order, or rendering refuses with the reason.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from surgeon.core.conventions import (
    DUMP_LAYOUTS,
    EAGLE,
    ENGINE_INSTALL,
    HF,
    POINTWISE,
    EngineConvention,
    NotExpressible,
    PointwiseConvention,
)
from surgeon.core.errors import BadInput, Unverified
from surgeon.core.idrules import ClassConvention
from surgeon.core.points import Point
from surgeon.core.spec import NORM_FLAGS, Spec
from surgeon.engines.facts.sglang_dflash import SETTER as DFLASH_SETTER
from surgeon.engines.facts.sglang_dflash import classify_dflash, dflash_unreadable, read_dflash_runner
from surgeon.engines.view import EngineView, model_class_for, open_engine
from surgeon.wiring.evidence import engine_notes, evidence_lines, refusal
from surgeon.wiring.field import explain_field
from surgeon.wiring.mtp import mtp_lines
from surgeon.wiring.norms import render_lines
from surgeon.wiring.render_field import (
    FIELD_TARGETS,
    Refused,
    TableAnswer,
    check_speculators_dflash,
    render_field,
    specforge_dflash,
    speculators_dflash,
)
from surgeon.wiring.runnercheck import runner_notes, runner_refusal


@dataclass
class IdList:
    """One convention's ids for the fc list, or why there are none (``error``, the reason alone,
    and ``kind``: ``not_expressible`` where the convention cannot name the points, ``refused`` where
    the target cannot serve them or cannot be read here)."""

    convention: str
    origin: str
    ids: list[int] | None
    error: str | None = None
    captures: list[str] = field(default_factory=list)  # what the ids capture, replayed
    kind: Literal["not_expressible", "refused"] | None = None

    @property
    def ok(self) -> bool:
        return self.ids is not None


def _engine_ids(conv: EngineConvention, points: Sequence[Point], num_layers: int) -> IdList:
    try:
        ids = conv.encode(points, num_layers)
    except NotExpressible as e:
        return IdList(conv.name, conv.origin, None, str(e), kind="not_expressible")
    replay = conv.decode(ids, num_layers)
    return IdList(conv.name, conv.origin, ids, None, [str(p) for p in replay])


def pointwise_ids(conv: PointwiseConvention, points: Sequence[Point], num_layers: int) -> IdList:
    """A point-wise convention's ids for ``points`` (HF, EAGLE), or why none."""
    try:
        ids = conv.encode(points, num_layers)
    except NotExpressible as e:
        return IdList(conv.name, conv.source, None, str(e), kind="not_expressible")
    return IdList(conv.name, conv.source, ids, None, [str(p) for p in conv.decode(ids, num_layers)])


# ---------------------------------------------------------------------------------------------
# The render targets: one entry each in TARGETS (at the end of this module, after their functions)
# ---------------------------------------------------------------------------------------------
# (spec, target, engine_root, model_class, view) -> the ids; BadInput where the target gives none
# for a reason other than a point its convention cannot name (that is an IdList with an error).
IdsFn = Callable[[Spec, str, Any, "str | None", "EngineView | None"], IdList]
RenderFn = Callable[[Spec, str, Any, "str | None"], "Rendering"]


@dataclass(frozen=True)
class RenderTarget:
    """One target of ``surgeon render --engine``: the serving engine whose source decides its ids
    (None: a convention or a cited table), its fc-ids function and its renderer."""

    name: str
    engine: str | None
    ids: IdsFn
    render: RenderFn


def _dflash_on_sglang(spec: Spec, target: str) -> bool:
    """SGLang's DFlash path decides the ids (SpecForge captures through SGLang's DFlash setter)."""
    return _kind(spec) == "dflash" and target in ("sglang", "specforge")


def _served_ids(spec: Spec, target: str, engine_root, model_class: str | None, view: EngineView | None) -> IdList:
    """sglang, vllm, speculators (vLLM's aux capture), specforge: the probed class's setter, SGLang's
    DFlash setter, or the EAGLE config convention."""
    if _dflash_on_sglang(spec, target):
        ans = sglang_dflash(spec, engine_root, model_class, target)
        return IdList(ans.conv.name, ans.conv.origin, ans.ids, None, ans.captures)
    engine = ENGINE_FOR.get(target)
    if engine is None:  # specforge: its EAGLE config ids
        return pointwise_ids(EAGLE, spec.fc_points, spec.num_layers)
    view = view or open_engine(engine, engine_root)
    conv = view.convention(model_class_for(spec, engine, model_class))
    lst = _engine_ids(conv, spec.fc_points, spec.num_layers)
    if lst.ids is None:
        return lst
    # what the engine cannot serve although its rule names the points: a capture site that cannot be
    # evaluated, an index no site reaches, a model runner that ignores the ids
    positions = [p.position for p in spec.fc_points if p.position is not None]
    why = refusal(conv.cc, positions, spec.num_layers) or runner_refusal(view.probe, conv.cc, lst.ids, spec.num_layers)
    if why:
        raise Refused(spec.file, target, why)
    if target == "speculators" and _kind(spec) == "dflash":
        check_speculators_dflash(spec, lst.ids)  # its data generation appends id L itself
    return lst


def _table_ids(spec: Spec, target: str, engine_root, model_class: str | None, view: EngineView | None) -> IdList:
    """A cited-table target: the ids its rendering carries (BadInput, a :class:`Refused`, where none)."""
    ans = render_field(spec, target, engine_root, model_class)
    return IdList(ans.convention, ans.origin, ans.ids, None, list(ans.captured))


def render_target(target: str) -> RenderTarget:
    """The entry of ``target`` (BadInput naming the listed targets for any other)."""
    found = TARGETS.get(target)
    if found is None:
        raise BadInput(f"unknown render target {target!r}; expected one of {', '.join(RENDER_TARGETS)}")
    return found


def _reason(spec: Spec, target: str, e: BadInput) -> str:
    """Why ``target`` gives no ids, once: the structured reason where there is one, else the
    message without the file and target that each report adds itself."""
    text = getattr(e, "reason", None) or str(e)
    for prefix in (f"{spec.file}: ", f"cannot render for {target}: "):
        text = text.removeprefix(prefix)
    return text


def fc_ids(
    spec: Spec, target: str, *, engine_root=None, model_class: str | None = None, view: EngineView | None = None
) -> IdList:
    """The ids ``target`` (one of :data:`RENDER_TARGETS`, or a point-wise convention: ``hf``,
    ``eagle``) needs so that the draft's fc receives the spec's ``fc_input`` points, from its entry
    in :data:`TARGETS`: an IdList whose ``error`` says why where its convention cannot name them;
    BadInput where the target refuses them or cannot be read here (a :class:`Refused` carries the
    reason alone), and for a name that is neither. :func:`target_ids` never raises for a listed one."""
    if target in POINTWISE:
        return pointwise_ids(POINTWISE[target], spec.fc_points, spec.num_layers)
    return render_target(target).ids(spec, target, engine_root, model_class, view)


def target_ids(
    spec: Spec, target: str, *, engine_root=None, model_class: str | None = None, view: EngineView | None = None
) -> IdList:
    """:func:`fc_ids`, with a refusal as an IdList too (``kind`` "refused", ``error`` the reason
    alone): every listed target gives ids or a structured reason (infer-wiring, explain)."""
    try:
        return fc_ids(spec, target, engine_root=engine_root, model_class=model_class, view=view)
    except Refused as e:
        return IdList(target, "", None, e.reason, kind="not_expressible" if e.kind == "not_expressible" else "refused")
    except BadInput as e:
        if target not in TARGETS and target not in POINTWISE:
            raise
        return IdList(target, "", None, _reason(spec, target, e), kind="refused")


# ---------------------------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------------------------
@dataclass
class CaptureRow:
    name: str
    point: str
    fc_slot: int | None
    dump_slot: str | None
    ids: dict[str, int | str]  # convention -> id, or "not expressible: why"


@dataclass
class Explanation:
    spec: str
    file: str
    sha256: str
    num_layers: int
    hidden_size: int
    conventions: dict[str, str]  # column -> where its rule came from
    rows: list[CaptureRow]
    fc_lists: dict[str, IdList]
    notes: list[str]


def _single(fn, point: Point, num_layers: int) -> int | str:
    try:
        return fn(point, num_layers)
    except NotExpressible as e:
        return f"not expressible: {e.reason}"


def explain(
    spec: Spec, *, roots: dict[str, str | None] | None = None, model_classes: dict[str, str] | None = None
) -> Explanation:
    roots, model_classes = roots or {}, model_classes or {}
    L = spec.num_layers
    fc_names = spec.fc_names
    notes: list[str] = []
    engines: dict[str, EngineConvention] = {}
    views: dict[str, EngineView] = {}
    conventions = {"hf": HF.title, "eagle": EAGLE.title}
    dflash: dict[str, IdList] = {}  # engines whose DFlash ids were read by their own path (render's)
    for engine in ("sglang", "vllm"):
        cls = model_class_for(spec, engine, model_classes.get(engine))
        if engine == "sglang" and _kind(spec) == "dflash":
            found = _explain_sglang_dflash(spec, roots.get(engine), cls, notes)
            if found is not None:
                engines[engine], dflash[engine], conventions[engine] = found
            continue
        view = views[engine] = open_engine(engine, roots.get(engine))
        try:
            conv = view.convention(cls)
        except BadInput as e:
            if model_classes.get(engine):  # the class the user named is not there: their input, as in render
                raise
            notes.append(f"{engine}: {e}")
            continue
        engines[engine] = conv
        conventions[engine] = _explain_engine(engine, conv, spec.fc_points, L, notes)

    fc_lists: dict[str, IdList] = {}
    per_fc: dict[str, dict[str, int | str]] = {}
    for engine, conv in engines.items():
        lst = dflash.get(engine) or (target_ids(spec, engine, engine_root=roots.get(engine), view=views[engine],
                                                model_class=model_classes.get(engine)) if fc_names else None)
        if lst is None:
            continue
        fc_lists[engine] = lst
        if lst.ids is not None:  # lst.ok, spelled so that the type narrows
            for name, p in zip(fc_names, spec.fc_points):
                per_fc.setdefault(name, {})[engine] = _id_for(conv, lst.ids, p, L)
            if engine not in dflash:  # the DFlash path read its own runner
                notes.extend(_runner_lines(engine, views[engine], conv, lst.ids, L, _kind(spec)))
        else:  # a refusal (what the engine cannot serve) or a point its rule cannot name
            label = "cannot serve this wiring" if lst.kind == "refused" else "fc_input cannot be rendered"
            notes.append(f"{engine}: {label}: {lst.error}")
    for pointwise in (EAGLE, HF):
        if fc_names:
            fc_lists[pointwise.name] = pointwise_ids(pointwise, spec.fc_points, L)

    dump_labels: dict[str, str] = {}
    if spec.model.dumps is not None:
        slots = spec.dump_slots
        labels = DUMP_LAYOUTS[spec.model.dumps.layout].slots(slots, [spec.captures[n] for n in slots], L)
        dump_labels = {n: f"{spec.model.dumps.layout} {lab}" for n, lab in zip(slots, labels)}

    for engine in ("sglang", "vllm"):
        notes.extend(render_lines(spec, engine, roots.get(engine)))
        notes.extend(f"{engine}: {d}" for _, _, d in mtp_lines(spec, engine, roots.get(engine)))
    field = explain_field(spec, engines.get("vllm"))
    conventions.update(field.conventions)
    fc_lists.update({c: IdList(f.convention, f.origin, f.ids, f.error, f.captures) for c, f in field.fc_lists.items()})
    notes.extend(field.notes)

    rows = []
    for name, point in spec.captures.items():
        ids: dict[str, int | str] = {"hf": _single(HF.to_id, point, L)}
        for engine, conv in engines.items():
            if name in per_fc and engine in per_fc[name]:
                ids[engine] = per_fc[name][engine]
            else:
                ids[engine] = _single(lambda p, n, c=conv: c.encode([p], n)[0], point, L)
        ids["eagle"] = _single(EAGLE.to_id, point, L)
        ids.update(field.ids[name])
        fc_slot = fc_names.index(name) if name in fc_names else None
        rows.append(CaptureRow(name, str(point), fc_slot, dump_labels.get(name), ids))
    return Explanation(spec.name, spec.file, spec.sha256, L, spec.hidden_size, conventions, rows, fc_lists, notes)


def _explain_engine(engine: str, conv: EngineConvention, points: Sequence[Point], num_layers: int,
                    notes: list[str]) -> str:
    """The notes an engine's probed class adds to ``explain`` (bypasses, refusals, evidence); returns
    its column's title."""
    positions = [p.position for p in points if p.position is not None]
    for b in conv.cc.bypasses:
        notes.append(f"{conv.name}: {b.path or conv.cc.path}:{b.line}: {b.description} (when: {b.layers})")
    notes.extend(f"{engine}: {n}" if not n.startswith(f"{engine}:") else n
                 for n in engine_notes(conv.cc, positions, num_layers))
    notes.extend(f"{engine}: evidence: {e}" for e in evidence_lines(conv.cc, positions, num_layers))
    return f"{conv.name} ({conv.origin})" + ("" if conv.cc.unverified_for(positions, num_layers) is None
                                             else " (unverified)")


def _explain_sglang_dflash(spec: Spec, engine_root, model_class: str | None,
                           notes: list[str]) -> tuple[EngineConvention, IdList, str] | None:
    """SGLang's column for a DFlash draft: the answer ``render`` gives (:func:`sglang_dflash`: the
    class's set_dflash_layers_to_capture and the DFlash runner path), or None with why in ``notes``."""
    try:
        ans = sglang_dflash(spec, engine_root, model_class)
    except BadInput as e:
        notes.append(f"sglang: DFlash: {str(e).removeprefix(spec.file + ': ')}")
        return None
    notes.extend(ans.notes)
    notes.extend(f"sglang: evidence: {e}" for e in ans.evidence)
    lst = IdList(ans.conv.name, ans.conv.origin, ans.ids, None, ans.captures)
    return ans.conv, lst, f"{ans.conv.name} ({ans.conv.origin})" + ("" if ans.unverified is None else " (unverified)")


def _runner_lines(engine: str, view: EngineView, conv: EngineConvention, ids: list[int], num_layers: int,
                  kind: str) -> list[str]:
    """What the release's model runner does with these ids: refused when it ignores them, else
    the runner calls read (file:line) or why the runner is unverified."""
    ignored = runner_refusal(view.probe, conv.cc, ids, num_layers)
    lines = [f"{engine}: cannot serve this wiring: {ignored}"] if ignored else []
    return lines + [n if n.startswith(f"{engine}") else f"{engine}: {n}" for n in runner_notes(view.probe, kind)]


def _kind(spec: Spec) -> str:
    """The draft's kind (its setter calls are the runner's that count); eagle3 without a draft section."""
    return spec.model.draft.kind if spec.model.draft is not None else "eagle3"


def _id_for(conv: EngineConvention, ids: list[int], point: Point, num_layers: int) -> int:
    """Which id of a verified list yields ``point``: replay the list with each id's capture
    index (the rule applies to the whole list, so the index is the id plus the branch's offset)."""
    indices = conv.cc.capture_indices(ids, num_layers)
    assert point.position is not None  # an fc point is on the residual stream (the spec check refuses others)
    return ids[indices.index(point.position)]


# ---------------------------------------------------------------------------------------------
# render
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    """A target's launch command: its arguments (``<DRAFT>``: the draft's path), and the same quoted."""

    argv: list[str]

    @property
    def shell(self) -> str:
        """Quoted for a POSIX shell."""
        return shlex.join(self.argv)


@dataclass
class RenderedSlot:
    """One fc slot of a rendering: the spec's capture there and what the rendered ids capture."""

    fc_slot: int
    name: str
    point: str
    captured: str | None  # what the ids capture there, replayed through the engine's setter
    site: str | None = None  # file:line of the capture site the engine uses (engine targets)
    verified: bool | None = None  # False when that site's value was not read; None: no site asked


def rendered_slots(spec: Spec, captured: list) -> list[RenderedSlot]:
    """The spec's fc slots, each with what the ids capture there (``captured``, in fc order)."""
    return [RenderedSlot(i, n, str(p), captured[i]) for i, (n, p) in enumerate(zip(spec.fc_names, spec.fc_points))]


@dataclass
class Rendering:
    spec: str
    target: str
    model_class: str | None
    convention: str
    origin: str
    ids: list[int]
    captures: list[RenderedSlot]
    draft_config: dict
    launch_flags: list[str]  # argv: one argument per item, for the engine's launch command
    dump: dict | None
    notes: list[str]
    # False when the answer rests on engine code the probe did not read (the reason says what)
    verified: bool = True
    unverified_reason: str | None = None
    evidence: list[str] = field(default_factory=list)  # file:line of the setter, loop, capture sites, runner
    # The platform the engine answer holds for ("cuda", "rocm", "cpu"; "all" where the engine does
    # not dispatch per platform); None for training tools and built-in tables.
    platform: str | None = None

    @property
    def launch(self) -> Launch:
        return Launch(self.launch_flags)

    @property
    def launch_shell(self) -> str:
        """The launch flags quoted for a POSIX shell (``<DRAFT>`` is a placeholder to replace)."""
        return self.launch.shell


def _engine_answer(spec: Spec, view: EngineView, cc: ClassConvention, notes: list[str]) -> tuple[str | None, list[str]]:
    """Add the notes read from that release to ``notes`` (what the engine cannot serve was refused by
    the target's fc-ids function, :func:`_served_ids`); returns (why the answer is unverified or None,
    the evidence lines)."""
    engine = view.engine
    positions = [p.position for p in spec.fc_points if p.position is not None]
    notes.extend(engine_notes(cc, positions, spec.num_layers))
    notes.extend(runner_notes(view.probe, _kind(spec)))
    for b in cc.bypasses:
        notes.append(f"{b.path or cc.path}:{b.line}: {b.description} (when: {b.layers})")
    if view.probe is None:
        notes.append(f"{engine} is not installed here: ids follow the built-in table ({cc.path}:{cc.line} "
                     f"{cc.class_name}); to render against its source: {ENGINE_INSTALL[engine]}, or pass --engine-root")
    return cc.unverified_for(positions, spec.num_layers), evidence_lines(cc, positions, spec.num_layers)


def render(spec: Spec, target: str, *, engine_root=None, model_class: str | None = None) -> Rendering:
    """The draft-config fragment and launch flags that make ``target`` feed the draft's fc with
    the spec's points (its renderer in :data:`TARGETS`). BadInput when the spec has no draft or the
    target cannot express it."""
    entry = render_target(target)
    if spec.model.draft is None:
        raise BadInput(f"{spec.file}: the spec has no draft section, so there is no fc input to render")
    if spec.model.draft.kind == "mtp":
        checked = [d for _, _, d in mtp_lines(spec, target, engine_root)]
        raise BadInput(
            f"{spec.file}: an MTP draft reads the target's returned hidden state, not aux ids: there are no ids to render"
            + (f" ({checked[0]})" if checked else "")
        )
    return entry.render(spec, target, engine_root, model_class)


def _render_served(spec: Spec, target: str, engine_root, model_class: str | None) -> Rendering:
    """sglang, vllm, specforge, speculators: ids from the target's fc-ids function, verified against
    the probed class (refusals, runner, notes, evidence), then the target's fragment."""
    if _dflash_on_sglang(spec, target):
        return _render_sglang_dflash(spec, engine_root, model_class, target)
    if target == "specforge" and engine_root is not None:
        raise BadInput("--engine-root does not apply to specforge (its ids follow the EAGLE config convention)")
    engine = ENGINE_FOR.get(target)
    view = open_engine(engine, engine_root) if engine else None
    cls = model_class_for(spec, engine, model_class) if engine else None
    lst = TARGETS[target].ids(spec, target, engine_root, model_class, view)
    ids = lst.ids
    if ids is None:
        raise BadInput(f"{spec.file}: cannot render for {target}: {lst.error}")
    notes: list[str] = []
    unverified_reason: str | None = None
    evidence: list[str] = []
    if view is not None:
        cc = view.class_convention(cls)
        unverified_reason, evidence = _engine_answer(spec, view, cc, notes)
    verified = unverified_reason is None
    captures = rendered_slots(spec, lst.captures)
    if view is not None:
        for c, p in zip(captures, spec.fc_points):
            site = cc.site_for(p.position, spec.num_layers) if p.position is not None else None
            c.site = None if site is None else f"{site.path}:{site.line}"
            c.verified = p.position is not None and cc.unverified_for([p.position], spec.num_layers) is None
    draft_config, flags, dump = _fragment(spec, target, ids, captures, notes, evidence)
    _norm_flags(spec, target, engine_root, draft_config, notes)
    platform = view.probe.platform if view is not None and view.probe is not None else None
    return Rendering(spec.name, target, cls, lst.convention, lst.origin, ids, captures, draft_config, flags, dump, notes,
                     verified, unverified_reason, evidence, platform)


def _fragment(spec: Spec, target: str, ids: list[int], captures: list[RenderedSlot], notes: list[str],
              evidence: list[str]) -> tuple[dict, list[str], dict | None]:
    """The draft-config fragment, launch flags and dump layout for an engine-decided target
    (sglang, vllm, speculators) or SpecForge's EAGLE config; adds the target's notes and evidence."""
    kind = _kind(spec)
    dump = None
    draft_config: dict[str, object]  # the fragment each target's draft config reads
    if target == "sglang":
        draft_config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
        flags = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "<DRAFT>"]
        notes.append("SGLang reads the ids from the draft config's eagle_config only; top-level ids are ignored there")
    elif kind == "dflash" and target == "speculators":
        draft_config, flags, more, cited = speculators_dflash(spec, ids)
        notes.extend(more)
        evidence.extend(cited)
    elif kind == "dflash":  # vLLM adds 1 to DFlash's output-of-layer ids when it reads them
        draft_config = {"dflash_config": {"target_layer_ids": [i - 1 for i in ids]}}
        flags = ["--speculative-config", '{"method": "dflash", "model": "<DRAFT>", "num_speculative_tokens": 3}']
        notes.append("vLLM reads dflash_config.target_layer_ids + 1 only when the draft config has "
                     "no eagle_aux_hidden_state_layer_ids and no eagle_config")
    elif target in ("vllm", "speculators"):
        draft_config = {"eagle_aux_hidden_state_layer_ids": ids}
        flags = ["--speculative-config", '{"method": "eagle3", "model": "<DRAFT>", "num_speculative_tokens": 3}']
    else:  # specforge
        draft_config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
        flags = ["scripts/prepare_hidden_states.py", "--enable-aux-hidden-states", "--draft-model-config",
                 "<DRAFT>/config.json"]
        dump = {"layout": "specforge", "aux_hidden_state": [c.point for c in captures], "hidden_state": "final_norm"}
        notes.append("SpecForge ids are layer outputs (id k = layer_out[k]); it refuses -1, so embed cannot be an fc input")
    if target == "speculators":
        last = f"layer_out[{spec.num_layers - 1}]"
        dump = {"layout": "speculators", "tensor": "hidden_states [T, n, H]",
                "slots": [c.point for c in captures] + [last],
                "note": f"the last slot is {last}, before the final norm"}
    return draft_config, flags, dump


def _render_table(spec: Spec, target: str, engine_root, model_class: str | None) -> Rendering:
    """A cited-table target (:data:`FIELD_TARGETS`): its answer from :mod:`surgeon.wiring.render_field`."""
    return _table_rendering(spec, target, render_field(spec, target, engine_root, model_class))


def _table_rendering(spec: Spec, target: str, ans: TableAnswer) -> Rendering:
    """A Rendering from a cited-table target's answer (:mod:`surgeon.wiring.render_field`)."""
    captures = rendered_slots(spec, ans.captured)
    return Rendering(spec.name, target, ans.model_class, ans.convention, ans.origin, ans.ids, captures, ans.draft_config,
                     ans.flags, ans.dump, ans.notes, ans.unverified is None, ans.unverified, ans.evidence, None)


def _norm_flags(spec: Spec, target: str, engine_root, draft_config: dict, notes: list[str]) -> None:
    """The spec's declared norm flags go into the draft config's top level (where speculators
    writes them and both engines read them); each engine's reading of them (file:line) goes into
    the notes, and an engine that would build the draft without a declared flag (SpecForge: train
    it without) refuses the render."""
    draft = spec.model.draft
    if draft is None or draft.kind != "eagle3" or draft.norms is None:
        return
    draft_config.update({f: v for f in NORM_FLAGS if (v := getattr(draft.norms, f)) is not None})
    lines = render_lines(spec, target, engine_root)
    wrong = [line for line in lines if "NOT SERVED" in line or "NOT TRAINED" in line]
    if wrong:
        raise BadInput(f"{spec.file}: cannot render for {target}: {wrong[0]}")
    notes.extend(lines)


# ---------------------------------------------------------------------------------------------
# SGLang DFlash
# ---------------------------------------------------------------------------------------------
class DFlashRefused(Refused):
    """SGLang cannot serve the spec's DFlash wiring, per its source (the runner's refusal, ids the
    rule cannot express, ids the runner range-checks out, a target the runner rewrites)."""


class DFlashUnverified(Refused, Unverified):
    """SGLang's DFlash runner was not read to the end: render refuses the answer (and so does lint)."""


@dataclass
class DFlashAnswer:
    """SGLang's DFlash ids for a spec's fc list, with what they rest on."""

    model_class: str
    conv: EngineConvention
    ids: list[int]
    captures: list[str]  # what the ids capture, replayed through the probed setter
    notes: list[str]
    evidence: list[str]
    unverified: str | None


def sglang_dflash(spec: Spec, engine_root=None, model_class: str | None = None, target: str = "sglang") -> DFlashAnswer:
    """The ``dflash_config.target_layer_ids`` that make SGLang feed the draft the spec's points, from
    the class's ``set_dflash_layers_to_capture`` (run by the probe's classifier) and the runner's
    path to it (:mod:`surgeon.engines.facts.sglang_dflash`). BadInput with the reason where SGLang or the
    class is missing or the setter was not read to the end; Unverified where the runner was not;
    DFlashRefused where SGLang cannot serve the points. ``target``: what the user asked to render
    for, named in every refusal (SpecForge's ids go through SGLang's convention)."""
    via = "" if target == "sglang" else (
        f"its DFlash ids go through SGLang's convention (it captures through SGLang's {DFLASH_SETTER}): ")

    def no(why: str, cls: type[Refused] = Refused, kind: str = "refused") -> Refused:
        return cls(spec.file, target, via + why, kind)

    view = open_engine("sglang", engine_root)
    cls = model_class_for(spec, "sglang", model_class)
    if view.location is None:
        raise no("SGLang is not installed here: its DFlash ids are read from its source only "
                 f"({ENGINE_INSTALL['sglang']}, or pass --engine-root)")
    where = f"sglang {view.version}"
    cc = classify_dflash(view.location.root, cls)
    if (unread := dflash_unreadable(cc, cls)) is not None or cc is None:
        raise no(f"{where} {unread}")
    runner = read_dflash_runner(view.location.root)
    if not runner.verified:
        raise no(f"{where} runner unverified for DFlash: {runner.reason}", DFlashUnverified)
    hit = sorted(runner.conditional_literals & {spec.model.target.model_type or "", cc.path.rsplit("/", 1)[-1][:-3]})
    if hit:
        raise no(f"{where} rewrites DFlash ids for {hit[0]} targets depending on the draft's architecture: "
                 f"{'; '.join(runner.conditional)}", DFlashRefused)
    L = spec.num_layers
    positions = [p.position for p in spec.fc_points if p.position is not None]
    refused = refusal(cc, positions, L)
    if refused is not None:
        raise no(refused, DFlashRefused)
    conv = EngineConvention(cc, f"{view.origin}; {DFLASH_SETTER}")
    lst = _engine_ids(conv, spec.fc_points, L)
    if lst.ids is None:
        raise no(lst.error or "no ids", DFlashRefused, "not_expressible")
    bad = [i for i in lst.ids if i < 0 or i >= L]
    if bad and runner.range_check:
        raise no(f"DFlash ids {bad} are refused by the runner ({runner.range_check})", DFlashRefused)
    notes = [n if n.startswith("sglang:") else f"sglang: {n}" for n in engine_notes(cc, positions, L)]
    notes.append(f"sglang: the runner passes the draft's dflash_config.target_layer_ids unchanged to {DFLASH_SETTER}")
    notes.extend(f"sglang: not for this target: {c}" for c in runner.conditional)
    evidence = evidence_lines(cc, positions, L) + runner.evidence + ([f"runner: {runner.range_check}"]
                                                                     if runner.range_check else [])
    return DFlashAnswer(cls, conv, lst.ids, lst.captures, notes, evidence, cc.unverified_for(positions, L))


def _render_sglang_dflash(spec: Spec, engine_root, model_class: str | None, target: str = "sglang") -> Rendering:
    """SGLang's DFlash answer, for SGLang or for SpecForge (which captures through SGLang's setter)."""
    ans = sglang_dflash(spec, engine_root, model_class, target)
    captures = rendered_slots(spec, ans.captures)
    draft_config: dict = {"dflash_config": {"target_layer_ids": ans.ids}}
    flags = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "<DRAFT>"]
    notes, evidence = list(ans.notes), list(ans.evidence)
    if target == "specforge":
        draft_config, flags, more, cited = specforge_dflash(ans.ids)
        notes, evidence = more + notes, cited + evidence
    return Rendering(spec.name, target, ans.model_class, ans.conv.name, ans.conv.origin, ans.ids, captures,
                     draft_config, flags, None, notes, ans.unverified is None, ans.unverified, evidence, "all")


# ---------------------------------------------------------------------------------------------
# The render targets' table: the one dispatch of render, explain, infer-wiring, review and pins
# ---------------------------------------------------------------------------------------------
TARGETS: dict[str, RenderTarget] = {t.name: t for t in (
    RenderTarget("sglang", "sglang", _served_ids, _render_served),
    RenderTarget("vllm", "vllm", _served_ids, _render_served),
    RenderTarget("specforge", None, _served_ids, _render_served),  # EAGLE config ids; DFlash: SGLang's setter
    RenderTarget("speculators", "vllm", _served_ids, _render_served),  # speculators configures vLLM's aux capture
    *(RenderTarget(name, "vllm" if name == "modelopt-vllm" else None, _table_ids, _render_table) for name in FIELD_TARGETS),
)}
RENDER_TARGETS = tuple(TARGETS)
# The serving engine whose source decides a target's ids (absent: a cited table or convention).
ENGINE_FOR = {name: t.engine for name, t in TARGETS.items() if t.engine is not None}
