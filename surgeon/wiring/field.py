"""The rest of the field in `surgeon explain` and `surgeon lint`: TensorRT-LLM and NVIDIA Model
Optimizer's hidden-state collection backends (hf, vllm, trtllm).

- ``trtllm``: TensorRT-LLM's ``eagle3_layers_to_capture`` (id k = layer_out[k], -1 = the post-norm
  last state), from the cited table of :mod:`surgeon.engines.facts.field_tables`.
- ``modelopt-hf`` / ``modelopt-trtllm``: the ``--aux-layers`` list of its hf and trtllm scripts
  (0-based layer-output ids: hidden_states[k + 1], and TensorRT-LLM unchanged).
- ``modelopt-vllm``: the same flag of its vllm script, which hands the ids to vLLM's
  ``eagle_aux_hidden_state_layer_ids`` unchanged; what they capture there is the probed vLLM
  convention of the spec's class (id j = layer_out[j-1] in current releases). So one list means
  one layer earlier through vLLM than through hf and trtllm: :func:`hazards` says so, with the
  lists to pass to each backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from surgeon.core.conventions import EngineConvention, InvalidId, NotExpressible, PointwiseConvention
from surgeon.core.errors import BadInput
from surgeon.core.points import Point
from surgeon.core.spec import Spec
from surgeon.engines.facts.field_tables import (
    MODELOPT,
    MODELOPT_HF,
    MODELOPT_LAST,
    MODELOPT_TRTLLM,
    TRTLLM,
    TRTLLM_CONV,
    TRTLLM_ONE_LAYER,
)
from surgeon.engines.facts.modelopt import ModeloptSource, open_modelopt

FIELD_COLUMNS = ("trtllm", "modelopt-hf", "modelopt-trtllm", "modelopt-vllm")
POINTWISE = {"trtllm": TRTLLM_CONV, "modelopt-hf": MODELOPT_HF, "modelopt-trtllm": MODELOPT_TRTLLM}
TABLE_NOTE = "built-in table read from GitHub source, not verified against a source on this machine"


@dataclass
class FieldList:
    """One column's ids for the fc list (what ``IdList`` is for the engines)."""

    convention: str
    origin: str
    ids: list[int] | None
    error: str | None = None
    captures: list[str] = field(default_factory=list)


@dataclass
class FieldAnswer:
    conventions: dict[str, str]  # column -> title (origin)
    ids: dict[str, dict[str, int | str]]  # capture name -> column -> id, or "not expressible: why"
    fc_lists: dict[str, FieldList]
    notes: list[str]


def modelopt_vllm_ids(vllm: EngineConvention, points: Sequence[Point], num_layers: int) -> list[int]:
    """The vLLM ids for ``points``, refused where the vllm script's range check (0 <= i < L) would."""
    ids = vllm.encode(points, num_layers)
    bad = [(p, i) for p, i in zip(points, ids) if not 0 <= i < num_layers]
    if bad:
        p, i = bad[0]
        why = (f"vLLM id {i}; the script refuses --aux-layers outside [0, {num_layers}) "
               f"({MODELOPT['vllm_range'].path}:{MODELOPT['vllm_range'].line}); id {num_layers} is only its appended last slot")
        raise NotExpressible("modelopt-vllm", why, p)
    return ids


def _single(column: str, point: Point, num_layers: int, vllm: EngineConvention | None) -> int | str:
    try:
        if column == "modelopt-vllm":
            if vllm is None:
                return "not expressible: no vLLM convention for this class"
            return modelopt_vllm_ids(vllm, [point], num_layers)[0]
        return POINTWISE[column].to_id(point, num_layers)
    except NotExpressible as e:
        return f"not expressible: {e.reason}"


def fc_list(column: str, spec: Spec, vllm: EngineConvention | None) -> FieldList:
    points, L = spec.fc_points, spec.num_layers
    if column == "modelopt-vllm":
        if vllm is None:
            return FieldList(column, "vLLM convention unavailable", None, "no vLLM convention for this class")
        try:
            ids = modelopt_vllm_ids(vllm, points, L)
        except NotExpressible as e:
            return FieldList(column, f"vLLM {vllm.origin}", None, str(e))
        return FieldList(column, f"ids handed to {vllm.name} ({vllm.origin})", ids, None,
                         [str(p) for p in vllm.decode(ids, L)])
    conv: PointwiseConvention = POINTWISE[column]
    try:
        ids = conv.encode(points, L)
    except NotExpressible as e:
        return FieldList(column, conv.source, None, str(e))
    return FieldList(column, conv.source, ids, None, [str(p) for p in conv.decode(ids, L)])


def _as_vllm(vllm: EngineConvention, ids: Sequence[int], num_layers: int) -> str:
    try:
        got = vllm.decode(list(ids), num_layers)
    except (InvalidId, ValueError) as e:
        return f"nothing vLLM accepts ({e})"
    return ", ".join("(no capture)" if p is None else str(p) for p in got)


def hazards(spec: Spec, vllm: EngineConvention | None, source: ModeloptSource | None) -> list[str]:
    """Where one Model Optimizer --aux-layers list captures different states per backend, for
    this spec's fc list, its presets, and the dump's last state. Empty when nothing differs."""
    L = spec.num_layers
    out: list[str] = []
    if vllm is None:
        return out
    where = f"{MODELOPT['vllm_ids'].path}:{MODELOPT['vllm_ids'].line},{MODELOPT['vllm_config'].line}"
    try:
        hf_ids = MODELOPT_HF.encode(spec.fc_points, L) if spec.fc_points else []
    except NotExpressible:
        hf_ids = []
    if hf_ids:
        want = ", ".join(str(p) for p in spec.fc_points)
        got = _as_vllm(vllm, hf_ids, L)
        if got != want:
            fix = fc_list("modelopt-vllm", spec, vllm)
            out.append(
                f"modelopt: hazard: --aux-layers {','.join(map(str, hf_ids))} captures {want} through its hf and "
                f"trtllm backends, but {got} through its vllm backend ({where} hand the ids to vLLM's "
                f"eagle_aux_hidden_state_layer_ids unchanged, read as {vllm.name})"
                + (f"; for the vllm backend pass --aux-layers {','.join(map(str, fix.ids))}" if fix.ids else
                   f"; the vllm backend cannot capture it ({fix.error})"))
    if source is not None:
        out.extend(_preset_hazards(source, vllm, L))
    last = {b: p.replace("L-1", str(L - 1)) for b, (p, _) in MODELOPT_LAST.items()}
    if len(set(last.values())) > 1:
        out.append("modelopt: hazard: the dump's hidden_states (last state) is "
                   + ", ".join(f"{p} through {b} ({MODELOPT_LAST[b][1].path}"
                               f"{':' + str(MODELOPT_LAST[b][1].line) if MODELOPT_LAST[b][1].line else ''})"
                               for b, p in last.items())
                   + ": pre- vs post-norm (cf. NVIDIA/Model-Optimizer#1846); do not mix dumps of the backends")
    return out


def _preset_hazards(source: ModeloptSource, vllm: EngineConvention, num_layers: int) -> list[str]:
    out = []
    try:
        dflash, came = source.dflash_preset_cited(num_layers)
    except BadInput as e:  # a preset the evaluator cannot run for this L: say so, never guess
        return [f"modelopt: dflash preset not evaluated for L={num_layers}: {e}"]
    theirs = ", ".join(f"layer_out[{k}]" for k in dflash)
    read = source.reads.get("dflash_offset")
    out.append(f"modelopt: hazard: --aux-layers dflash = {dflash} (returned at {came}): {theirs} through hf "
               f"(what its DFlash training "
               f"reads: {read or 'hidden_states[k + 1], not re-read'}) but {_as_vllm(vllm, dflash, num_layers)} "
               f"through its vllm backend (ids unchanged; vLLM itself adds 1 only to dflash_config.target_layer_ids)")
    return out


def explain_field(spec: Spec, vllm: EngineConvention | None, *, modelopt_root=None) -> FieldAnswer:
    """The field's columns for ``surgeon explain``: ids per capture, fc lists, origins and notes."""
    L = spec.num_layers
    source = open_modelopt(modelopt_root)
    conventions = {c: f"{POINTWISE[c].title} ({TABLE_NOTE})" for c in POINTWISE}
    conventions["modelopt-vllm"] = ("Model Optimizer --aux-layers, vllm backend (compute_hidden_states_vllm.py), "
                                    f"read as {vllm.name if vllm else 'vLLM (unavailable)'}")
    ids: dict[str, dict[str, int | str]] = {
        name: {c: _single(c, p, L, vllm) for c in FIELD_COLUMNS} for name, p in spec.captures.items()}
    fc_lists = {c: fc_list(c, spec, vllm) for c in FIELD_COLUMNS} if spec.fc_names else {}
    notes = [f"trtllm: evidence: {c}" for c in TRTLLM.values()]
    default = ", ".join(str(p) for p in TRTLLM_CONV.decode(None, L)) if L > 5 else (
        TRTLLM_ONE_LAYER if L == 1 else "none: Eagle3SpecMetadata raises for 2 to 5 layers")
    notes.append(f"trtllm: default when no ids are given: {default} ({TRTLLM['default']})")
    if source is None:
        notes.append("modelopt: its source is not on this machine (pip install --no-deps nvidia-modelopt==0.47.0; "
                     "from a checkout, scripts/fetch-engines): presets not evaluated")
    else:
        notes.append(f"modelopt: presets probed from {source.origin}")
        notes.extend(f"modelopt: evidence: {r}" for r in source.reads.values())
        try:
            eagle, came = source.eagle_default_cited(L)
            notes.append(f"modelopt: --aux-layers eagle (the default) = {eagle} (returned at {came}): "
                         f"{', '.join(str(p) for p in MODELOPT_HF.decode(eagle, L))} through hf and trtllm")
        except BadInput as e:  # reported, not guessed
            notes.append(f"modelopt: eagle preset not evaluated for L={L}: {e}")
    notes.extend(f"modelopt: evidence: {c} ({TABLE_NOTE})" for c in MODELOPT.values())
    notes.append(f"modelopt: dump: {{conversation_id}}.pt, torch.save of {{input_ids [T], aux_hidden_states [T, n*H] "
                 f"(ascending ids), hidden_states [T, H] (the last state: final_norm via hf and trtllm, "
                 f"layer_out[{L - 1}] via vllm), loss_mask [T], conversation_id}} ({MODELOPT['dump'].path}:"
                 f"{MODELOPT['dump'].line}; load with torch.load(weights_only=True))")
    notes.extend(hazards(spec, vllm, source))
    return FieldAnswer(conventions, ids, fc_lists, notes)
