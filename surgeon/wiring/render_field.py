"""`surgeon render` for the targets whose id conventions are cited tables rather than a probed
engine: TensorRT-LLM (``eagle3_layers_to_capture``), NVIDIA Model Optimizer's hidden-state
collection backends (``--aux-layers``, the columns ``surgeon explain`` shows, computed by
:mod:`surgeon.wiring.field`), z-lab/dflash, and the DFlash configs of SpecForge and speculators
(:mod:`surgeon.engines.facts.dflash_trainers`).

Each answer says that its convention is a table read from GitHub source, not from a source on
this machine; what a target cannot express is refused with the reason (BadInput, exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from surgeon.core.conventions import NotExpressible
from surgeon.core.errors import BadInput
from surgeon.core.spec import Spec
from surgeon.engines.facts.dflash_trainers import SPECFORGE, SPECULATORS, ZLAB, ZLAB_CONV
from surgeon.engines.facts.field_tables import COLLECT, MODELOPT, MODELOPT_LAST, TRTLLM, TRTLLM_CONV, TRTLLM_ONE_LAYER
from surgeon.engines.facts.modelopt import open_modelopt
from surgeon.engines.view import model_class_for, open_engine
from surgeon.wiring.field import fc_list, hazards

FIELD_TARGETS = ("trtllm", "modelopt-hf", "modelopt-trtllm", "modelopt-vllm", "zlab")
TABLE = "not read from an installed source: a built-in table cited from GitHub source (file:line@commit in evidence)"


@dataclass
class TableAnswer:
    """What :func:`surgeon.wiring.render.render` turns into a Rendering for a table target."""

    convention: str
    origin: str
    ids: list[int]
    captured: list[str]  # what the ids capture, per the table
    draft_config: dict
    flags: list[str]
    notes: list[str]
    evidence: list[str] = field(default_factory=list)
    dump: dict | None = None
    unverified: str | None = None
    model_class: str | None = None


class Refused(BadInput):
    """A target that gives no ids for the spec, structured: ``target``, ``reason`` alone and ``kind``
    (``not_expressible``: its convention cannot name the spec's points; ``refused``: it cannot serve
    them); the message adds the file and the target once."""

    def __init__(self, file: str, target: str, reason: str, kind: str = "refused") -> None:
        self.target, self.reason, self.kind = target, reason, kind
        super().__init__(f"{file}: cannot render for {target}: {reason}")


def _refuse(spec: Spec, target: str, why: str, kind: str = "refused") -> Refused:
    return Refused(spec.file, target, why, kind)


def _kind(spec: Spec) -> str:
    return spec.model.draft.kind if spec.model.draft is not None else "eagle3"


def render_field(spec: Spec, target: str, engine_root=None, model_class: str | None = None) -> TableAnswer:
    """The answer for one of :data:`FIELD_TARGETS`. Only modelopt-vllm reads an engine (its ids reach
    vLLM unchanged); for every other table target ``--engine-root`` and ``--model-class`` are refused,
    not ignored."""
    if target != "modelopt-vllm":
        for flag, given in (("--engine-root", engine_root), ("--model-class", model_class)):
            if given is not None:
                raise BadInput(f"{flag} does not apply to {target} (its ids follow a cited table)")
    if target == "trtllm":
        return render_trtllm(spec)
    if target == "zlab":
        return render_zlab(spec)
    return render_modelopt(spec, target.removeprefix("modelopt-"), engine_root, model_class)


def render_trtllm(spec: Spec) -> TableAnswer:
    """``speculative_config`` for TensorRT-LLM's LLM API / ``trtllm-serve --extra_llm_api_options``."""
    if _kind(spec) == "dflash":
        raise _refuse(spec, "trtllm", "TensorRT-LLM's DFlash path (tensorrt_llm/_torch/speculative/dflash.py) is not "
                      "modelled; eagle3_layers_to_capture would not be what it reads")
    points, L = spec.fc_points, spec.num_layers
    # final_norm is never an fc input (the spec check refuses it), so -1 is never rendered; the table
    # says why it could not be anyway: the one-model path leaves -1 first (TRTLLM['one_model_sorts']).
    try:
        ids = TRTLLM_CONV.encode(points, L)
    except NotExpressible as e:
        raise _refuse(spec, "trtllm", f"{e} (TensorRT-LLM takes a set and sorts it: {TRTLLM['sorted']})",
                      "not_expressible") from None
    config = {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model_dir": "<DRAFT>",
              "eagle3_one_model": True, "eagle3_layers_to_capture": ids}
    default = (", ".join(str(p) for p in TRTLLM_CONV.decode(None, L)) if L > 5
               else "none (2 to 5 layers raise)" if L > 1 else TRTLLM_ONE_LAYER)
    notes = [f"trtllm: {TABLE}",
             "trtllm: draft_config is the LLM API options, not the draft's config.json: write it as YAML to "
             "<OPTIONS>.yaml for trtllm-serve, or pass EagleDecodingConfig(**speculative_config) to LLM(...)",
             "trtllm: the ids are a set: TensorRT-LLM captures them in ascending order, so fc_input must be in layer order",
             f"trtllm: without eagle3_layers_to_capture it captures {default} ({TRTLLM['default'].path})"]
    evidence = [str(TRTLLM[k]) for k in ("fields", "model_dir", "one_model_only", "one_model_sorts", "call", "value")]
    return TableAnswer(TRTLLM_CONV.name, TRTLLM_CONV.source, ids, [str(p) for p in TRTLLM_CONV.decode(ids, L)],
                       {"speculative_config": config}, ["--extra_llm_api_options", "<OPTIONS>.yaml"], notes, evidence)


def render_modelopt(spec: Spec, backend: str, engine_root=None, model_class: str | None = None) -> TableAnswer:
    """``--aux-layers`` for one of Model Optimizer's collection scripts (hf, trtllm, vllm): the
    list ``surgeon explain`` shows in that column, with its hazards."""
    target = f"modelopt-{backend}"
    vllm = cls = None
    if backend == "vllm":  # the ids reach vLLM unchanged: the probed vLLM convention decides them
        cls = model_class_for(spec, "vllm", model_class)
        vllm = open_engine("vllm", engine_root).convention(cls)
    lst = fc_list(target, spec, vllm)
    if lst.ids is None:
        raise _refuse(spec, target, lst.error or "no ids", "not_expressible")
    L = spec.num_layers
    script = f"{COLLECT}/compute_hidden_states_{backend}.py"
    last, cite = MODELOPT_LAST[backend]
    notes = [f"{target}: {TABLE}" + (f"; the ids are read as {vllm.name} ({vllm.origin})" if vllm else ""),
             f"{target}: pass the flags to {script}; its dump's aux_hidden_states holds the captures in ascending "
             "id order, so fc_input must be in layer order"]
    if vllm is not None:
        notes.extend(hazards(spec, vllm, open_modelopt(None)))
    keys = {"hf": ("hf_aux", "hf_last", "dump"), "trtllm": ("trtllm_ids", "trtllm_rename", "common_presets"),
            "vllm": ("vllm_ids", "vllm_config", "vllm_range", "vllm_last")}[backend]
    dump = {"layout": "modelopt", "file": "{conversation_id}.pt", "aux_hidden_states": lst.captures,
            "hidden_states": last.replace("L-1", str(L - 1)), "note": f"hidden_states per {cite.path}"}
    return TableAnswer(target, lst.origin, lst.ids, lst.captures, {}, ["--aux-layers", ",".join(map(str, lst.ids))],
                       notes, [str(MODELOPT[k]) for k in keys], dump, model_class=cls)


def render_zlab(spec: Spec) -> TableAnswer:
    """``dflash_config.target_layer_ids`` for z-lab/dflash (read as ``hidden_states[id + 1]``)."""
    if _kind(spec) != "dflash":
        raise _refuse(spec, "zlab", f"z-lab/dflash runs DFlash drafts only; this spec's draft is {_kind(spec)}")
    L = spec.num_layers
    try:
        ids = ZLAB_CONV.encode(spec.fc_points, L)
    except NotExpressible as e:
        raise _refuse(spec, "zlab", str(e), "not_expressible") from None
    notes = [f"zlab: {TABLE}",
             f"zlab: the draft's config.json is the only place it reads them ({ZLAB['key'].path}:{ZLAB['key'].line}); "
             "no launch flag names them"]
    if -1 in ids:
        notes.append("zlab: hazard: id -1 is the embedding here (HF hidden_states[0]); an engine serving the draft reads "
                     "the same config: SGLang's DFlash runner refuses negative ids, vLLM reads -1 + 1 = aux id 0: check "
                     "with surgeon render --engine sglang|vllm before serving")
    return TableAnswer(ZLAB_CONV.name, ZLAB_CONV.source, ids, [str(p) for p in ZLAB_CONV.decode(ids, L)],
                       {"dflash_config": {"target_layer_ids": ids}}, [], notes, [str(c) for c in ZLAB.values()])


def specforge_dflash(ids: list[int]) -> tuple[dict, list[str], list[str], list[str]]:
    """SpecForge's DFlash fragment for SGLang's DFlash ids ``ids``: (draft config, flags, notes, evidence)."""
    notes = [f"specforge: its DFlash capture is SGLang's set_dflash_layers_to_capture, so the ids are SGLang's; "
             f"how SpecForge passes them is {TABLE}"]
    flags = ["scripts/prepare_hidden_states.py", "--draft-model-config", "<DRAFT>/config.json"]
    return ({"dflash_config": {"target_layer_ids": ids}}, flags, notes, [str(c) for c in SPECFORGE.values()])


def check_speculators_dflash(spec: Spec, ids: list[int]) -> None:
    """Refused (BadInput) where speculators' DFlash data generation cannot take vLLM aux ids ``ids``:
    id L, which it appends itself and training splits off."""
    L = spec.num_layers
    if L in ids:
        raise _refuse(spec, "speculators", f"vLLM id {L} (layer_out[{L - 1}]) is the verifier's last state, not an "
                      f"aux id: {SPECULATORS['last']}; {SPECULATORS['flag']}")


def speculators_dflash(spec: Spec, ids: list[int]) -> tuple[dict, list[str], list[str], list[str]]:
    """speculators' DFlash fragment for vLLM aux ids ``ids``: (draft config, flags, notes, evidence);
    BadInput for id L, which its data generation appends and training splits off."""
    check_speculators_dflash(spec, ids)
    notes = [f"speculators: DFlash ids are vLLM aux ids ({SPECULATORS['datagen'].path}:{SPECULATORS['datagen'].line}); "
             f"how speculators passes them is {TABLE}",
             "speculators: pass the same --target-layer-ids to scripts/launch_vllm.py and to training "
             "(launch_vllm.py appends the last layer itself)",
             f"speculators: z-lab's target_layer_ids for the same points are these minus 1 "
             f"({SPECULATORS['zlab'].path}:{SPECULATORS['zlab'].line})"]
    flags = ["--target-layer-ids", *map(str, ids)]
    return ({"aux_hidden_state_layer_ids": ids}, flags, notes, [str(c) for c in SPECULATORS.values()])
