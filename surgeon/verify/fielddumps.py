"""The rest of the field's dumps as subjects: TensorRT-LLM's ``SaveHiddenStatesDecodingConfig``
files and NVIDIA Model Optimizer's ``collect_hidden_states`` files (hf, vllm and trtllm backends).

Layouts, recognised by their keys (never by the file's name), each read from its source:

* TensorRT-LLM (``tensorrt_llm/_torch/speculative/save_hidden_state.py``, NVIDIA/TensorRT-LLM@3e906a0
  lines 36-63, 69): ``torch.save`` of a *list* of records, one per request, each
  ``{"id": int, "input_ids": long [T], "hidden_state": [T, H], "aux_hidden_states": [T, n*H]}``.
  ``hidden_state`` is the last H columns of the capture buffer, the ``-1`` slot (the final
  post-norm state); the aux key is present only with more than one capture, holds every column
  but the last (all of them when the user listed ``-1``), and is ``hidden_state_features`` in
  releases such as @17c59c3. The columns follow ``layers_to_capture``: sorted, ``-1`` last.
* Model Optimizer (examples/speculative_decoding/collect_hidden_states at a2fbac7): a *dict*
  ``{"input_ids": [T], "hidden_states": [T, H], "aux_hidden_states": [T, n*H], "loss_mask": [T],
  "conversation_id": ...}`` written by hf (compute_hidden_states_hf.py:193-201) and vllm
  (compute_hidden_states_vllm.py:317-325; ``aux_hidden_states`` is ``torch.empty(0)`` without aux
  ids, :303); the trtllm backend rewrites TensorRT-LLM's record (compute_hidden_states_trtllm.py:
  236-241: ``id`` dropped, ``conversation_id`` added, ``hidden_state`` renamed ``hidden_states``).
  The hf and vllm backends write the same keys, so the backend is never guessed: the caller says it.

Which point a slot holds depends on the ids the tool was given, which no file records. The
caller names the producer and its ids as one ``--slots`` entry, ``PRODUCER:IDS``
(``trtllm:1,15,28``, ``modelopt-vllm:1,17,29``; presets ``eagle``/``dflash`` for Model Optimizer,
``default`` for TensorRT-LLM, its tuple for 6 layers or more: it raises for fewer), and each slot
is labelled by that tool's cited convention
(:mod:`surgeon.engines.facts.field_tables`). Without it only what the layout itself fixes is labelled:
TensorRT-LLM's ``hidden_state``. Labels are declarations: ``verify``/``match`` still identify
every slot against the reference.

A ``hidden_states [T, n, H]`` stack (vLLM's hidden-state connector; SGLang's aux states saved as
one) is labelled in one place, :func:`label_connector`: by the capture sidecar beside it, and by
``--slots vllm:IDS`` (the installed vLLM's probe of the target class) or ``--slots sglang:ALGO:IDS``
(ALGO EAGLE3 or DFLASH: the installed SGLang class's setter for that algorithm; DSPARK's setter is
not read, so refused), which must agree with a sidecar that is there.

``verify``/``match`` read one sequence (a file's first record); ``dump-info`` and ``export`` read the
whole file (:func:`read_field_dump`: every record, which producers its keys allow), and
:func:`export_reader` hands its records to :mod:`surgeon.capture.exporters` as dumps, refusing a file
whose slots no ``--slots`` labelled.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from surgeon.capture.tensorfiles import PICKLE, ZIP, TensorFile, held, open_tensor_file
from surgeon.core.conventions import EngineConvention, InvalidId, builtin_convention
from surgeon.core.errors import BadInput, SurgeonError
from surgeon.core.points import FINAL_NORM, Point
from surgeon.engines.facts.field_tables import MODELOPT, MODELOPT_HF, MODELOPT_TRTLLM, TRTLLM, TRTLLM_CONV, TRTLLM_ONE_LAYER, Cite

PRODUCERS = ("trtllm", "modelopt-hf", "modelopt-vllm", "modelopt-trtllm", "vllm", "sglang")
_DIRECTIVE = re.compile(r"\s*(?P<producer>trtllm|modelopt-hf|modelopt-vllm|modelopt-trtllm|vllm|sglang)\s*:\s*(?P<ids>.*)",
                        re.S)
IDS_KEYS = ("input_ids", "token_ids")  # a subject's token ids, in this order of preference
TRT_AUX_KEYS = ("aux_hidden_states", "hidden_state_features")
TRT_RECORD_KEYS = frozenset({"id", "input_ids", "hidden_state", *TRT_AUX_KEYS})
MODELOPT_KEYS = frozenset({"input_ids", "hidden_states", "loss_mask", "conversation_id", *TRT_AUX_KEYS})
TABLE = "from a cited table, not verified against a source on this machine"
TRT_SAVE = "NVIDIA/TensorRT-LLM@3e906a0 tensorrt_llm/_torch/speculative/save_hidden_state.py"
TRT_DUMP_NOTE = (f"{TRT_SAVE}:41-49: hidden_state is the capture buffer's last H columns, the -1 slot "
                 f"(TensorRT-LLM's final post-norm state: {TRTLLM['minus_one']}), {TABLE}")


@dataclass(frozen=True)
class Producer:
    """A ``--slots PRODUCER:IDS`` entry: which tool wrote the file, and the ids it was given."""

    name: str
    ids_text: str


@dataclass
class FileSlots:
    """What one file layout yields before ``--slots`` renames anything: slots in file order, the
    points the layout itself declares, and its input ids (every reader of
    :mod:`surgeon.verify.subjects` and of this module returns one)."""

    layout: str
    names: list[str]
    tensors: list[torch.Tensor]
    declared: list[Point | None]
    ids: torch.Tensor | None = None
    notes: list[str] = field(default_factory=list)
    record: str | None = None  # which sequence of the file: "id 1", "conversation 7"
    loss_mask: torch.Tensor | None = None  # Model Optimizer's, as the file holds it
    keyed: bool = False  # each slot is a tensor the file names (a dict, named safetensors): read by name, never by position


def split_producer(entries: Sequence[str]) -> tuple[Producer | None, list[str]]:
    """The ``PRODUCER:IDS`` entry of ``--slots``, if any, and the other entries. A producer entry
    stands alone: it names every slot (the file's own names are kept)."""
    found = [(raw, m) for raw in entries if (m := _DIRECTIVE.fullmatch(raw)) is not None]
    if not found:
        return None, list(entries)
    if len(found) > 1 or len(entries) > 1:
        raise BadInput(f"--slots {found[0][0]!r} names the producer and its ids; give it alone (one --slots entry)")
    m = found[0][1]
    return Producer(m.group("producer"), m.group("ids").strip()), []


def detect(data: Any) -> str | None:
    """``trtllm``, ``modelopt`` or None, from the loaded object's structure and keys. A file that
    carries a field layout's markers but keys the source never writes is refused, one line."""
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data) \
            and any("hidden_state" in r for r in data):
        for r in data:
            extra = sorted(map(str, set(r) - TRT_RECORD_KEYS))
            missing = sorted({"id", "input_ids", "hidden_state"} - set(r))
            if extra or missing:
                raise BadInput("a list of records like TensorRT-LLM's SaveHiddenStates dump, but a record has "
                               + (f"unexpected keys {extra}" if extra else f"no {missing}")
                               + f" (its records hold {sorted(TRT_RECORD_KEYS)})")
        return "trtllm"
    if isinstance(data, dict) and "hidden_states" in data and (
            set(TRT_AUX_KEYS) & set(data) or "conversation_id" in data):
        extra = sorted(map(str, set(data) - MODELOPT_KEYS))
        if extra or "input_ids" not in data:
            raise BadInput("a dict like Model Optimizer's collect_hidden_states dump, but with "
                           + (f"unexpected keys {extra}" if extra else "no input_ids")
                           + f" (it writes {sorted(MODELOPT_KEYS)})")
        return "modelopt"
    return None


def float_2d(t: Any, what: str) -> torch.Tensor:
    """A subject's slot: a floating-point ``[tokens, hidden]`` tensor (leading 1-sized dims dropped)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise BadInput(f"{what}: expected a floating-point tensor")
    while t.dim() > 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise BadInput(f"{what}: expected a [tokens, hidden] tensor, got shape {tuple(t.shape)}")
    return t


def int_1d(t: Any, what: str) -> torch.Tensor:
    """A subject's input ids: an integer tensor, flattened to int64."""
    if not isinstance(t, torch.Tensor) or t.is_floating_point():
        raise BadInput(f"{what}: input ids must be an integer tensor")
    return t.reshape(-1).to(torch.int64)


def _state(p: str, t: Any, what: str) -> torch.Tensor:
    """A record's own last state: [T, H] with T, H >= 1, checked before the aux columns are split by H."""
    last = float_2d(t, f"{p}: {what}")
    T, H = last.shape
    if T == 0 or H == 0:
        raise BadInput(f"{p}: {what} has shape [{T}, {H}]: no state to read (0 tokens or a hidden size of 0)")
    return last


def _ids(p: str, t: Any, what: str, T: int) -> torch.Tensor:
    ids = int_1d(t, f"{p}: {what}")
    if ids.numel() != T:
        raise BadInput(f"{p}: {what} holds {ids.numel()} ids for {T} tokens")
    return ids


def _split_aux(p: str, aux: Any, key: str, H: int, T: int) -> list[torch.Tensor]:
    """[T, n*H] into n [T, H] slots (H >= 1); the vllm backend's ``torch.empty(0)`` (no aux ids) is none."""
    if isinstance(aux, torch.Tensor) and aux.numel() == 0 and aux.dim() == 1:
        return []
    aux = float_2d(aux, f"{p}: {key}")
    if aux.shape[0] != T or aux.shape[1] == 0 or aux.shape[1] % H:
        raise BadInput(f"{p}: {key} of shape {tuple(aux.shape)} is not [{T}, n*{H}] with n >= 1")
    return [aux[:, i * H:(i + 1) * H] for i in range(aux.shape[1] // H)]


def _int_list(producer: Producer) -> list[int]:
    try:
        ids = [int(t) for t in producer.ids_text.split(",") if t.strip()]
    except ValueError:
        raise BadInput(f"--slots {producer.name}:{producer.ids_text}: expected comma-separated integer ids"
                       + (" or eagle/dflash" if producer.name.startswith("modelopt") else " or default")) from None
    if not ids:
        raise BadInput(f"--slots {producer.name}: names no ids")
    return ids


def _modelopt_ids(producer: Producer, L: int, notes: list[str]) -> list[int]:
    """The backend's aux ids in dump order, as common.py / the vllm script resolve --aux-layers."""
    preset = producer.ids_text.strip().lower()
    if preset in ("eagle", "dflash"):
        if preset == "eagle" and producer.name == "modelopt-vllm":
            raise BadInput(f"--slots modelopt-vllm:eagle: the vllm backend does not take 'eagle' ({MODELOPT['vllm_presets']})")
        from surgeon.engines.facts.modelopt import open_modelopt

        source = open_modelopt()
        if source is None:
            raise BadInput(f"--slots {producer.name}:{preset}: the preset needs the Model Optimizer source "
                           "(pip install --no-deps nvidia-modelopt==0.47.0; from a checkout, scripts/fetch-engines); "
                           "pass the ids instead")
        ids = source.eagle_default(L) if preset == "eagle" else source.dflash_preset(L)
        notes.append(f"--aux-layers {preset} = {ids}, evaluated from {source.origin}")
        return sorted(set(ids)) if producer.name == "modelopt-trtllm" else ids  # TRT-LLM sorts its set
    ids = _int_list(producer)
    bad = [i for i in ids if not 0 <= i < L]
    if bad:
        raise BadInput(f"--slots {producer.name}: ids {bad} are outside [0, {L}), which the script refuses "
                       f"({MODELOPT['common_presets']})")
    return sorted(set(ids))  # common.py resolve_aux_layers and the vllm script's line 76 both sort and de-duplicate


def _trtllm_ids(producer: Producer, L: int) -> list[int]:
    """eagle3_layers_to_capture as the engine orders it: sorted, -1 last (added when absent)."""
    if producer.ids_text.strip().lower() == "default":
        if L == 1:  # handled before the tuple, differently from version to version
            raise BadInput(f"--slots trtllm:default: {TRTLLM_ONE_LAYER}; pass the ids")
        if L <= 5:
            raise BadInput(f"--slots trtllm:default: TensorRT-LLM has no default eagle3_layers_to_capture for a "
                           f"{L}-layer target, it raises for 2 to 5 layers ({TRTLLM['default']}); pass the ids")
        ids = [t.evaluate(L) for t in TRTLLM_CONV.default or ()]  # the source's tuple, as it is
    else:
        ids = sorted(set(_int_list(producer)))
        if ids[0] == -1:
            ids = ids[1:] + [-1]
    return ids if -1 in ids else [*ids, -1]


def _decode(conv_name: str, ids: list[int], L: int) -> list[Point]:
    try:
        if conv_name == "modelopt-vllm":
            vllm = EngineConvention(builtin_convention("vllm", None), "built-in")
            points = vllm.decode(ids, L)
        else:
            conv = {"trtllm": TRTLLM_CONV, "modelopt-hf": MODELOPT_HF, "modelopt-trtllm": MODELOPT_TRTLLM}[conv_name]
            points = conv.decode(ids, L)
    except (InvalidId, ValueError) as e:
        raise BadInput(f"--slots {conv_name}: {e}") from None
    if any(pt is None for pt in points):
        raise BadInput(f"--slots {conv_name}: ids {ids} are not all captured for {L} layers")
    return [pt for pt in points if pt is not None]


def _need_layers(producer: Producer, num_layers: int | None) -> int:
    if num_layers is None:
        raise BadInput(f"--slots {producer.name}:{producer.ids_text}: labelling by ids needs the target's layer "
                       "count: pass --spec")
    return num_layers


def _cite(c: Cite) -> str:
    return f"{c.path.rsplit('/', 1)[-1]}:{c.line}" if c.line else c.path.rsplit("/", 1)[-1]


def read_trtllm(p: str, data: list, producer: Producer | None, num_layers: int | None, index: int = 0) -> FileSlots:
    """One record of a TensorRT-LLM SaveHiddenStates dump (the first by default: a subject is one sequence)."""
    if producer is not None and producer.name != "trtllm":
        raise BadInput(f"{p}: a TensorRT-LLM SaveHiddenStates dump (a list of records), not a Model Optimizer "
                       f"{producer.name} file: pass --slots trtllm:IDS (its eagle3_layers_to_capture)")
    rec = data[index]
    last = _state(p, rec["hidden_state"], f"id {rec['id']}: hidden_state")
    T, H = last.shape
    key = next((k for k in TRT_AUX_KEYS if k in rec), None)
    aux = _split_aux(p, rec[key], f"id {rec['id']}: {key}", H, T) if key else []
    out = FileSlots("trtllm", [f"{key}[{i}]" for i in range(len(aux))] + ["hidden_state"], [*aux, last],
                     [None] * len(aux) + [FINAL_NORM], _ids(p, rec["input_ids"], f"id {rec['id']}: input_ids", T),
                     record=f"id {rec['id']}")
    out.notes.append(f"TensorRT-LLM SaveHiddenStates dump: record {index + 1} of {len(data)} (id {rec['id']}); "
                     f"{TRT_DUMP_NOTE}")
    if key == "hidden_state_features":
        out.notes.append("hidden_state_features is the aux key of older releases (NVIDIA/TensorRT-LLM@17c59c3); "
                         "one of them wrote the last captured layer as hidden_state unless "
                         "save_last_layer_post_norm: the label is what current releases write, identification decides")
    if producer is None:
        out.notes.append("aux slots unlabelled: the file does not record eagle3_layers_to_capture; "
                         "pass --slots trtllm:IDS (or trtllm:default) to label them")
        return out
    L = _need_layers(producer, num_layers)
    full = _trtllm_ids(producer, L)
    if len(aux) not in (len(full), len(full) - 1):
        raise BadInput(f"{p}: {len(aux)} aux slots, but eagle3_layers_to_capture {full} gives {len(full) - 1} "
                       f"(or {len(full)} with -1 listed): the ids do not fit this file")
    points = _decode("trtllm", full, L)
    out.declared = [*points[:len(aux)], FINAL_NORM]
    out.notes.append(f"labelled as TensorRT-LLM eagle3_layers_to_capture {full} (sorted, -1 last: "
                     f"{_cite(TRTLLM['sorted'])}, {_cite(TRTLLM['minus_one_last'])}; id k = layer_out[k]: "
                     f"{TRTLLM['call']}), {TABLE}")
    return out


def read_modelopt(p: str, data: dict, producer: Producer | None, num_layers: int | None) -> FileSlots:
    """A Model Optimizer collect_hidden_states dump, any backend."""
    last = _state(p, data["hidden_states"], "hidden_states")
    T, H = last.shape
    key = next((k for k in TRT_AUX_KEYS if k in data), None)
    aux = _split_aux(p, data[key], key, H, T) if key else []
    out = FileSlots("modelopt", [f"{key}[{i}]" for i in range(len(aux))] + ["hidden_states"], [*aux, last],
                     [None] * (len(aux) + 1), _ids(p, data["input_ids"], "input_ids", T),
                     record=f"conversation {data['conversation_id']}" if "conversation_id" in data else None)
    out.notes.append(f"Model Optimizer collect_hidden_states dump (conversation {data.get('conversation_id', '?')}): "
                     f"keys as {_cite(MODELOPT['dump'])} (hf) and compute_hidden_states_vllm.py:317 write them, "
                     f"NVIDIA/Model-Optimizer@{MODELOPT['dump'].commit[:7]}")
    if "loss_mask" in data:
        mask = data["loss_mask"]
        if not isinstance(mask, torch.Tensor):
            raise BadInput(f"{p}: loss_mask is a {type(mask).__name__}, not a tensor")
        if mask.numel() != T:
            raise BadInput(f"{p}: loss_mask has {mask.numel()} entries for {T} tokens")
        out.loss_mask = mask
        out.notes.append(f"loss_mask: {int((mask != 0).sum())} of {T} tokens in the loss")
    backends, why = modelopt_backends(data)
    if len(backends) == 1:
        out.notes.append(f"written by its {backends[0].removeprefix('modelopt-')} backend: {why}")
    if producer is None:
        ask = " or ".join(f"{b}:IDS" for b in backends)
        out.notes.append("slots unlabelled: the file does not record --aux-layers" + (
            ", and the hf and vllm backends write the same keys (the vllm backend's slots one layer earlier), so "
            "it cannot tell which wrote it" if len(backends) > 1 else "") + f"; pass --slots {ask} to label them")
        return out
    if producer.name == "trtllm":
        raise BadInput(f"{p}: a Model Optimizer dump (a dict), not TensorRT-LLM's own list: pass "
                       "--slots modelopt-trtllm:IDS for its trtllm backend")
    if producer.name not in backends:
        raise BadInput(f"{p}: --slots {producer.name} does not fit this file: {why}")
    L = _need_layers(producer, num_layers)
    ids = _modelopt_ids(producer, L, out.notes)
    extra = 1 if producer.name == "modelopt-trtllm" and len(aux) == len(ids) + 1 else 0  # TRT-LLM's -1 column kept
    if len(aux) != len(ids) + extra:
        raise BadInput(f"{p}: {len(aux)} aux slots, but --aux-layers {ids} gives {len(ids)}: the ids do not fit this file")
    out.declared = _modelopt_labels(producer.name, ids, L, extra, out.notes)
    return out


def _modelopt_labels(backend: str, ids: list[int], L: int, extra: int, notes: list[str]) -> list[Point | None]:
    if backend == "modelopt-vllm":
        vllm_ids = [*ids, L]  # compute_hidden_states_vllm.py:178 extract_layer_ids = [*aux_layer_ids, L]
        points: list[Point | None] = list(_decode(backend, vllm_ids, L))
        notes.append(f"labelled as the vllm backend: ids {vllm_ids} handed to vLLM unchanged "
                     f"({_cite(MODELOPT['vllm_ids'])}, {_cite(MODELOPT['vllm_config'])}), read by surgeon's built-in "
                     f"vLLM table (id j = layer_out[j-1], {builtin_convention('vllm', None).reason}; not probed for "
                     f"the model's class): one layer earlier than hf and trtllm, the last slot layer_out[{L - 1}] "
                     f"before the final norm ({_cite(MODELOPT['vllm_last'])}), {TABLE}")
        return points
    points = [*_decode(backend, ids, L), *([FINAL_NORM] * extra), FINAL_NORM]
    if backend == "modelopt-hf":
        notes.append(f"labelled as the hf backend: aux id k = hidden_states[k + 1] ({_cite(MODELOPT['hf_aux'])}), "
                     f"the last slot the final norm's output ({_cite(MODELOPT['hf_last'])}), {TABLE}")
    else:
        notes.append(f"labelled as the trtllm backend: ids unchanged as eagle3_layers_to_capture "
                     f"({_cite(MODELOPT['trtllm_ids'])}), id k = layer_out[k], hidden_states = TensorRT-LLM's "
                     f"post-norm hidden_state ({_cite(MODELOPT['trtllm_rename'])}), {TABLE}")
    return points


def modelopt_backends(data: dict) -> tuple[list[str], str]:
    """The Model Optimizer backends whose writer gives a dump these keys, and why. Only what the
    writers fix tells them apart: the trtllm backend keeps TensorRT-LLM's keys and adds no loss_mask;
    only the vllm backend writes an empty aux_hidden_states; otherwise hf and vllm are alike."""
    trt = _cite(MODELOPT["trtllm_rename"])
    if "hidden_state_features" in data:
        return ["modelopt-trtllm"], (f"its aux key hidden_state_features is TensorRT-LLM's (older releases), which "
                                     f"only the trtllm backend keeps ({trt})")
    if "loss_mask" not in data:
        return ["modelopt-trtllm"], (f"it has no loss_mask, which the hf (compute_hidden_states_hf.py:193-201) and "
                                     f"vllm (compute_hidden_states_vllm.py:317-325) backends write and the trtllm "
                                     f"backend, rewriting TensorRT-LLM's record, does not ({trt})")
    aux = data.get("aux_hidden_states")
    if isinstance(aux, torch.Tensor) and aux.numel() == 0:
        return ["modelopt-vllm"], ("its aux_hidden_states is empty, which only the vllm backend writes (without aux "
                                   "ids, compute_hidden_states_vllm.py:303; the hf backend's torch.cat needs one, "
                                   f"{_cite(MODELOPT['hf_aux'])})")
    return ["modelopt-hf", "modelopt-vllm"], ("the hf and vllm backends write the same keys, so the file cannot tell "
                                              "which wrote it")


def load_pickle(path: str | Path | TensorFile) -> Any:
    """A ``torch.save`` file, read with ``weights_only=True`` only; BadInput (one line) otherwise.
    Given the gate's read (a :class:`TensorFile`), that very file is loaded, never gated again."""
    gated = path if isinstance(path, TensorFile) else open_tensor_file(path, formats=(PICKLE, ZIP))
    try:
        with held(gated) as name:  # the gate's file, never what was swapped in at the path since
            return torch.load(name, map_location="cpu", weights_only=True)
    except SurgeonError:
        raise
    except Exception as e:  # pickle refusals and corrupt files alike: bad input, one line
        first_line = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise BadInput(f"{path}: cannot be read as a tensor file with weights_only=True: {first_line}") from None


@dataclass
class FieldDump:
    """A whole TensorRT-LLM or Model Optimizer dump file: every record, each labelled as ``--slots``
    says (or left unlabelled where the file does not record its layers)."""

    path: str
    layout: str  # trtllm | modelopt
    candidates: list[str]  # the producers whose writer gives a file these keys
    why: str
    producer: Producer | None
    num_layers: int | None
    records: list[FileSlots]

    @property
    def labelled(self) -> bool:
        return all(d is not None for r in self.records for d in r.declared)


def read_field_dump(path: str | Path, slots: Sequence[str] = (), num_layers: int | None = None) -> FieldDump | None:
    """Read ``path`` whole if it is a TensorRT-LLM or Model Optimizer dump, None if it is another
    torch.save file. ``slots`` is empty or the one ``PRODUCER:IDS`` entry; ``num_layers`` the
    target's, which labelling by ids needs."""
    from surgeon.capture.tensorfiles import SAFETENSORS, open_tensor_file

    gated = open_tensor_file(path)
    p = str(gated.path)
    producer, rest = split_producer(slots)
    if rest:
        raise BadInput(f"--slots {rest[0]!r}: a TensorRT-LLM or Model Optimizer dump takes one PRODUCER:IDS entry "
                       f"({', '.join(PRODUCERS)})")
    if gated.format == SAFETENSORS:
        return None
    data = load_pickle(gated)
    try:
        layout = detect(data)
    except BadInput as e:
        raise BadInput(f"{p}: {e}") from None
    if layout is None:
        return None
    try:
        return _read_whole(p, layout, data, producer, num_layers)
    except BadInput as e:  # every refusal names the file
        raise BadInput(str(e) if str(e).startswith(p) else f"{p}: {e}") from None


def _read_whole(p: str, layout: str, data: Any, producer: Producer | None, num_layers: int | None) -> FieldDump:
    if layout == "trtllm":
        records = [read_trtllm(p, data, producer, num_layers, i) for i in range(len(data))]
        candidates, why = ["trtllm"], ("a list of records with hidden_state is TensorRT-LLM's own SaveHiddenStates "
                                       "file (Model Optimizer's trtllm backend rewrites it into a dict)")
    else:
        records = [read_modelopt(p, data, producer, num_layers)]
        candidates, why = modelopt_backends(data)
    return FieldDump(p, layout, candidates, why, producer, num_layers, records)


def _as_dumps(fd: FieldDump, spec_layers: int) -> list:
    """Each record as a :class:`surgeon.capture.dumps.Dump`, its slots' points as labelled."""
    from surgeon.capture.dumps import Dump

    given = f"{fd.producer.name}:{fd.producer.ids_text}" if fd.producer else None
    out = []
    for r in fd.records:
        H = r.tensors[-1].shape[1]
        meta = {"num_layers": str(spec_layers), "hidden_size": str(H), "record": r.record or "",
                "producer": f"{given} ({'TensorRT-LLM' if fd.layout == 'trtllm' else 'Model Optimizer'} dump)"}
        captures = [(n, pt, t) for n, pt, t in zip(r.names, r.declared, r.tensors) if pt is not None]
        ids = r.ids
        if ids is None:
            raise BadInput(f"{fd.path}: {r.record or 'its record'} has no input ids")
        out.append(Dump(captures, ids, meta, {n: list(t.shape) for n, _, t in captures}, loss_mask=r.loss_mask))
    return out


def export_reader(slots: Sequence[str], num_layers: int, spec=None):
    """The :data:`surgeon.capture.exporters.Reader` for ``surgeon export``: surgeon dumps as they
    declare themselves, TensorRT-LLM and Model Optimizer dumps labelled by ``slots`` (refused
    unlabelled: such a file does not record its layers), ``hidden_states`` stacks (vLLM's connector)
    labelled by the capture sidecar beside them or ``slots`` (``vllm:IDS``, ``sglang:ALGO:IDS``: those
    need ``spec``) through :func:`label_connector`, the one labelling every reader uses."""
    from surgeon.capture.exporters import read_surgeon_dump

    def read(path: Path, header_only: bool) -> list:
        fd = read_field_dump(path, slots, num_layers)
        if fd is None:
            from surgeon.capture.tensorfiles import SAFETENSORS, open_tensor_file

            gated = open_tensor_file(path)
            if gated.format != SAFETENSORS:
                raise BadInput(f"{path}: neither a surgeon dump nor a TensorRT-LLM or Model Optimizer dump")
            if gated.kind != "dump" and STACK_KEY in gated.tensors:
                return [_stack_dump(gated, slots, num_layers, spec)]
            if slots:
                raise BadInput(f"{path}: a safetensors file (a surgeon dump declares its own slots' points); "
                               f"--slots {slots[0]} names a {PRODUCERS[0]} or Model Optimizer .pt dump")
            return read_surgeon_dump(path, header_only)
        if not fd.labelled:
            raise BadInput(f"{fd.path}: a {'TensorRT-LLM' if fd.layout == 'trtllm' else 'Model Optimizer'} dump "
                           f"does not record which layers its slots hold: pass --slots "
                           f"{' or '.join(c + ':IDS' for c in fd.candidates)} ({fd.why})")
        return _as_dumps(fd, num_layers)

    return read


def _stack_dump(gated: TensorFile, slots: Sequence[str], num_layers: int, spec):
    """A ``hidden_states`` stack as one :class:`surgeon.capture.dumps.Dump`, its rows labelled by
    :func:`label_connector`; refused where nothing labels every row."""
    from surgeon.capture.dumps import Dump
    from surgeon.capture.tensorfiles import read_safetensors

    p = gated.path
    producer, rest = split_producer(slots)
    if rest:
        raise BadInput(f"--slots {rest[0]!r}: a hidden_states stack takes one vllm:IDS or sglang:ALGO:IDS entry")
    data, _ = read_safetensors(gated)
    ids_key = next((k for k in IDS_KEYS if k in data), None)
    if ids_key is None:
        raise BadInput(f"{p}: a hidden_states stack without token_ids: the tokens cannot be exported")
    read = read_stack(data, int_1d(data.pop(ids_key), f"{p}: {ids_key}"))
    if read is None:
        raise BadInput(f"{p}: {STACK_KEY} is not a [T, n, H] stack")
    label_connector(p, read, producer, num_layers, spec)
    if any(d is None for d in read.declared):
        raise BadInput(f"{p}: a hidden_states stack does not record which points its rows hold: keep the capture "
                       "sidecar surgeon plan wrote beside it, or pass --slots vllm:IDS (or sglang:ALGO:IDS) with --spec")
    captures = [(n, pt, float_2d(t, f"{p}: {n}")) for n, pt, t in zip(read.names, read.declared, read.tensors)
                if pt is not None]
    H = captures[0][2].shape[1]
    given = f"{producer.name}:{producer.ids_text}" if producer else "capture sidecar"
    meta = {"num_layers": str(num_layers), "hidden_size": str(H), "producer": f"{given} (hidden_states stack)"}
    assert read.ids is not None  # read_stack was handed them
    return Dump(captures, read.ids, meta, {n: list(t.shape) for n, _, t in captures})


VLLM_STACK_NOTE = ("hidden_states [T, n, H] with token_ids [T]: vLLM's hidden-state connector "
                   "(extract_hidden_states, ExampleHiddenStatesConnector) writes these keys, and speculators' "
                   "hs_*.safetensors are that connector's files; neither records the ids it captured")
STACK_KEY = "hidden_states"


def read_stack(data: dict, ids: torch.Tensor | None) -> FileSlots | None:
    """A ``hidden_states [T, n, H]`` stack (vLLM's connector, speculators) as n slots in file order,
    none declared; None where ``data`` (a safetensors file's tensors, ids taken out) holds none."""
    hs = data.get(STACK_KEY)
    if hs is None or hs.dim() != 3:
        return None
    tensors = [hs[:, i] for i in range(hs.shape[1])]
    read = FileSlots("vllm-connector", [f"{STACK_KEY}[:, {i}]" for i in range(len(tensors))], tensors,
                     [None] * len(tensors), ids)
    read.notes.append(VLLM_STACK_NOTE)
    return read


def label_connector(p: Path, read: FileSlots, producer: Producer | None, num_layers: int | None, spec=None) -> None:
    """The one labelling of a stack's rows: from the capture sidecar beside the file
    (:mod:`surgeon.capture.sidecar`, which ``surgeon plan`` writes), and by ``--slots vllm:IDS`` /
    ``sglang:ALGO:IDS`` (:func:`label_stack`), which must then agree with the sidecar. Points a record
    beside the file gave already (``read.declared``: an export's) must agree with the sidecar too."""
    from surgeon.capture.sidecar import SIDECAR, find_sidecar, rows_of

    sidecar = find_sidecar(p)
    if sidecar is not None:
        points = rows_of(sidecar, p, len(read.tensors), STACK_KEY, num_layers)
        if any(d is not None for d in read.declared) and read.declared != points:
            raise BadInput(f"{p}: {SIDECAR} records its rows as {_texts(points)}, the export record beside it as "
                           f"{_texts(read.declared)}: one of them does not describe this file")
        read.names, read.declared = list(sidecar.names), list(points)
        read.notes.append(f"rows declared by {SIDECAR} beside the file ({sidecar.describe()}): "
                          + ", ".join(f"{n}={pt}" for n, pt in zip(sidecar.names, points)))
    if producer is None:
        return
    if spec is None:
        raise BadInput(f"--slots {producer.name}:{producer.ids_text}: labelling by {producer.name} ids needs the "
                       f"target: pass --spec (its class's ids are read from the installed {producer.name})")
    labelled = label_stack(str(p), len(read.tensors), producer, spec, read.notes)
    if sidecar is not None and labelled != read.declared:
        raise BadInput(f"{p}: --slots {producer.name}:{producer.ids_text} labels its rows {_texts(labelled)}, but "
                       f"{p.parent / SIDECAR} records {_texts(read.declared)}: one of them does not describe this file")
    read.declared = list(labelled)


def _texts(points: Sequence[Point | None]) -> str:
    return "[" + ", ".join(str(pt) for pt in points) + "]"


def label_stack(p: str, n_slots: int, producer: Producer, spec, notes: list[str]) -> list[Point]:
    """The points of a stack's rows from the ids its engine was given: ``--slots vllm:IDS`` by the
    installed vLLM's probe of the spec's target class, ``--slots sglang:ALGO:IDS`` by the installed
    SGLang class's setter for that algorithm; rows in the order the engine emits them."""
    from surgeon.engines.view import model_class_for, open_engine

    L = spec.num_layers
    if producer.name == "vllm":
        conv = open_engine("vllm").convention(model_class_for(spec, "vllm"))
        ids = _stack_ids(producer, producer.ids_text, range(0, L + 1), L)
        points = _decode_stack(p, n_slots, producer, ids, L, conv)
        notes.append(f"labelled as vLLM aux ids {ids} read by {conv.name} ({conv.origin}), in the order its "
                     "runner emits them")
        return points
    algo, ids_text = _sglang_algorithm(producer)
    conv, how = _sglang_setter(algo, spec)
    ids = _stack_ids(producer, ids_text, None, L)
    points = _decode_stack(p, n_slots, producer, ids, L, conv)
    notes.append(f"labelled as SGLang {algo} ids {ids} through {conv.name}'s {how} ({conv.origin}); {_order(conv)}")
    positions = [pt.position for pt in points if pt.position is not None]
    unverified = conv.cc.unverified_for(positions, L)
    if unverified:
        notes.append(f"unverified: {unverified}")
    return points


def _stack_ids(producer: Producer, ids_text: str, allowed: range | None, L: int) -> list[int]:
    ids = _int_list(Producer(producer.name, ids_text))
    if len(set(ids)) != len(ids):
        raise BadInput(f"--slots {producer.name}:{producer.ids_text}: an id is repeated")
    bad = [i for i in ids if i not in allowed] if allowed is not None else []
    if bad and allowed is not None:
        raise BadInput(f"--slots {producer.name}: ids {bad} are outside [{allowed.start}, {allowed.stop - 1}] for a "
                       f"target of {L} layers")
    return ids


def _decode_stack(p: str, n_slots: int, producer: Producer, ids: list[int], L: int,
                  convention: EngineConvention) -> list[Point]:
    given = f"--slots {producer.name}:{producer.ids_text}"
    if len(ids) != n_slots:
        raise BadInput(f"{p}: {n_slots} slots, but {given} names {len(ids)} ids: the ids do not fit this file")
    try:
        decoded = convention.decode(ids, L)
    except (InvalidId, ValueError) as e:
        raise BadInput(f"{given}: {e}") from None
    if any(pt is None for pt in decoded) or len(decoded) != n_slots:
        raise BadInput(f"{given}: {convention.name} does not capture one state per id "
                       f"({[str(x) for x in decoded]}): the ids do not fit this file")
    return [pt for pt in decoded if pt is not None]


def _order(conv: EngineConvention) -> str:
    """In which order the class emits its captures, as the probe read it."""
    if conv.keeps_order:
        return "rows in the order of the ids"
    why = "its setter sorts the ids" if conv.cc.sorts else "its capture loop emits by layer-loop membership"
    loop = [f"{e.path}:{e.line}" for e in conv.cc.evidence if e.role == ("setter" if conv.cc.sorts else "loop")]
    return f"rows in ascending layer order ({why}{': ' + ', '.join(loop) if loop else ''})"


SGLANG_ALGORITHMS = ("EAGLE3", "DFLASH", "DSPARK")


def stack_rows(producer: Producer | None) -> int | None:
    """How many rows ``--slots sglang:ALGO:IDS`` says a plain stacked tensor holds (one per id),
    for the reader to split it; None for any other entry (it says nothing of the row count)."""
    if producer is None or producer.name != "sglang":
        return None
    ids = [t for t in producer.ids_text.partition(":")[2].split(",") if t.strip()]
    return len(ids) or None


def _sglang_algorithm(producer: Producer) -> tuple[str, str]:
    algo, sep, ids_text = producer.ids_text.partition(":")
    if not sep or algo.strip().upper() not in SGLANG_ALGORITHMS:
        raise BadInput(f"--slots sglang:{producer.ids_text}: expected sglang:ALGO:IDS with ALGO one of "
                       f"{', '.join(SGLANG_ALGORITHMS)} (the --speculative-algorithm that selects the setter)")
    return algo.strip().upper(), ids_text


def _sglang_setter(algo: str, spec) -> tuple[EngineConvention, str]:
    """The installed SGLang class's setter for ``algo``, as a convention, and what it is."""
    from surgeon.engines.view import model_class_for, open_engine

    view = open_engine("sglang")
    cls = model_class_for(spec, "sglang")
    if algo == "EAGLE3":
        conv = view.convention(cls)
        return conv, conv.cc.setter or "EAGLE-3 setter"
    if view.location is None:
        raise BadInput(f"--slots sglang:{algo}: SGLang is not installed here, and its {algo} setter is read from "
                       "its source only (pip install --no-deps sglang)")
    if algo == "DSPARK":
        raise BadInput(f"--slots sglang:DSPARK: surgeon does not read set_dspark_layers_to_capture, which sglang "
                       f"{view.version} calls where the class has one ({_call_site(view.location.root, DSPARK_SETTER)}), "
                       "else the DFlash setter: its ids are not labelled")
    return _dflash_setter(view, cls)


DSPARK_SETTER = "set_dspark_layers_to_capture"


def _dflash_setter(view, cls: str) -> tuple[EngineConvention, str]:
    from surgeon.engines.facts.sglang_dflash import SETTER, classify_dflash, dflash_unreadable, read_dflash_runner

    cc = classify_dflash(view.location.root, cls)
    if (why := dflash_unreadable(cc, cls)) is not None or cc is None:
        raise BadInput(f"--slots sglang:DFLASH: sglang {view.version} {why}")
    runner = read_dflash_runner(view.location.root)
    direct = [e.removeprefix("runner: ") for e in runner.evidence if "only without a draft" in e]
    how = (f"{SETTER}, handed the ids unchanged without a draft ({'; '.join(direct)})" if direct else
           f"{SETTER} (how the capture-only route hands it the ids was not read: unverified)")
    return EngineConvention(cc, f"{view.origin}; {SETTER}"), how


def _call_site(root: Path, name: str) -> str:
    """``path:line`` of the runner's call of ``name`` (read by the name it carries), or why not found."""
    import ast

    from surgeon.engines.source.reading import SOURCE_ERRORS, read_source

    base = Path(root) / "srt" / "model_executor"
    for f in sorted(base.rglob("*.py")) if base.is_dir() else []:
        try:
            text = read_source(f)
            tree = ast.parse(text) if name in text else None
        except (*SOURCE_ERRORS, SyntaxError, ValueError):
            continue
        for n in ast.walk(tree) if tree is not None else ():
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name:
                return f"{f.relative_to(root).as_posix()}:{n.lineno}"
    return f"no call of {name} found under srt/model_executor"
