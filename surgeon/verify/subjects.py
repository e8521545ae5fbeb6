"""Readers: hidden-state tensors to identify (a training dump, an engine capture), as named slots.

Formats (by content, not by file name):

* SpecForge offline ``.ckpt`` dicts: ``aux_hidden_state`` [1, T, nH] split into n slots in capture
  order, ``hidden_state`` [1, T, H] (after the final norm in SpecForge's semantics), ``input_ids``;
* ``hidden_states`` [T, n, H] and ``token_ids`` [T]: vLLM's hidden-state connector
  (``extract_hidden_states``) and speculators' ``hs_{i}.safetensors`` (that connector's files). The
  stack is ordered by ascending vLLM id, but neither writer records the ids: its rows are declared
  by the capture sidecar ``surgeon plan`` writes beside the files (:mod:`surgeon.capture.sidecar`),
  or by ``--slots vllm:IDS`` (the ids vLLM was given) or ``--slots sglang:ALGO:IDS`` (the ids SGLang's
  setter for that algorithm was given), which must agree with a sidecar that is there
  (:func:`surgeon.verify.fielddumps.label_connector`, the one labelling export uses too); else none
  is declared (a spec may label them);
* TensorRT-LLM ``SaveHiddenStatesDecodingConfig`` ``.pt`` lists and NVIDIA Model Optimizer
  ``collect_hidden_states`` ``.pt`` dicts (hf, vllm, trtllm backends), labelled per the tool's cited
  convention when ``--slots PRODUCER:IDS`` names the ids it was given (:mod:`surgeon.verify.fielddumps`);
* a surgeon dump (``surgeon.kind = dump``, :mod:`surgeon.capture.dumps`): slots named and declared by the dump;
* a surgeon reference file (``surgeon.kind = reference``): one slot per point, labelled;
* plain ``.pt`` / ``.safetensors`` holding a list, a dict or a stacked tensor, named with ``--slots``.

Pickles are read with ``torch.load(..., weights_only=True)`` only. Nothing declares a slot's
point except what the caller says (``--slots name=point``, a spec) or what the file records.

Names over positions: a file whose tensors carry names (a dict, a safetensors file of several
tensors, a surgeon dump or reference) is read by those names (``FileSlots.keyed``): ``--slots``
picks its keys (``KEY``, ``NAME=KEY``, ``KEY=POINT``) and a spec labels the keys that are its
capture names, whatever order the file stores them in (safetensors sorts its keys). Order is used
only where the layout defines one: a stacked tensor, a list, SpecForge's ``aux_hidden_state``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from surgeon.capture.sidecar import SIDECAR
from surgeon.capture.tensorfiles import SAFETENSORS, TensorFile, open_tensor_file, read_safetensors
from surgeon.core.errors import BadInput
from surgeon.core.points import Point, PointError, parse_point
from surgeon.verify import fielddumps
from surgeon.verify.fielddumps import IDS_KEYS, FileSlots

__all__ = ["IDS_KEYS", "Subject", "align", "read_subject"]


@dataclass
class Subject:
    slots: list[tuple[str, Point | None, torch.Tensor]]  # name, declared point, [T, H]
    input_ids: torch.Tensor | None
    source: str
    layout: str
    notes: list[str] = field(default_factory=list)
    keyed: bool = False  # the slots are tensors the file names: read by those names, never by position
    missing: list[str] = field(default_factory=list)  # a spec's dump slots at points no slot's record gives

    @property
    def names(self) -> list[str]:
        return [n for n, _, _ in self.slots]


def slot_entries(entries: Sequence[str]) -> list[tuple[str, str | None]]:
    """``--slots`` entries as written: ``(left, right)`` for ``left=right``, ``(entry, None)`` alone."""
    out: list[tuple[str, str | None]] = []
    for raw in entries:
        for entry in (e.strip() for e in raw.split(",")):
            if entry:
                name, eq, rhs = entry.partition("=")
                out.append((name.strip(), rhs.strip() if eq else None))
    return out


def parse_slot_names(entries: Sequence[str], num_layers: int | None) -> list[tuple[str, Point | None]]:
    """``--slots`` entries for a file whose slots have an order: ``name``, ``point`` (``layer_out[3]``),
    or ``name=point``, one per slot in that order."""
    out: list[tuple[str, Point | None]] = []
    for name, rhs in slot_entries(entries):
        entry = name if rhs is None else f"{name}={rhs}"
        try:
            if rhs is not None:
                out.append((name, parse_point(rhs, num_layers)))
            else:
                try:
                    out.append((name, parse_point(name, num_layers)))
                except PointError:
                    out.append((name, None))
        except PointError as e:
            raise BadInput(f"--slots {entry!r}: {e.message}") from None
    return out


def _point_or_none(text: str, num_layers: int | None) -> Point | None:
    try:
        return parse_point(text, num_layers)
    except PointError:
        return None


def select_by_key(p: Path, entries: Sequence[str], read: FileSlots,
                  num_layers: int | None) -> tuple[list[str], list[Point | None], list[torch.Tensor]]:
    """``--slots`` on a file whose tensors carry names: each entry picks a key (``KEY``,
    ``NAME=KEY``, or ``KEY=POINT`` declaring it); a bare name or point that is no key is refused,
    never taken as a position."""
    index = {k: i for i, k in enumerate(read.names)}
    keys = ", ".join(read.names)
    names: list[str] = []
    declared: list[Point | None] = []
    tensors: list[torch.Tensor] = []
    taken: dict[str, str] = {}
    for name, rhs in slot_entries(entries):
        entry = name if rhs is None else f"{name}={rhs}"
        if rhs is not None and rhs in index:  # NAME=KEY
            key, point = rhs, read.declared[index[rhs]]
        elif name in index:  # KEY or KEY=POINT
            key = name
            point = read.declared[index[name]]
            if rhs is not None:
                point = _point_or_none(rhs, num_layers)
                if point is None:
                    raise BadInput(f"{p}: --slots {entry!r}: {rhs!r} is neither a key of the file ({keys}) nor a point")
        else:
            raise BadInput(f"{p}: --slots {entry!r}: the file's tensors carry names ({keys}) and are read by them, "
                           f"not by position: name a slot by its key (NAME=KEY, or KEY=POINT)")
        if key in taken:
            raise BadInput(f"{p}: --slots {entry!r}: key {key!r} is already taken by {taken[key]!r}")
        if name in names:
            raise BadInput(f"{p}: --slots {entry!r}: slot name {name!r} is given twice")
        taken[key] = entry
        names.append(name)
        declared.append(point)
        tensors.append(read.tensors[index[key]])
    return names, declared, tensors


def _stacked(t: torch.Tensor, n: int | None, what: str) -> list[torch.Tensor]:
    """Split a [n, T, H] or [T, n, H] stack; ``n`` (from --slots) decides when both could be."""
    while t.dim() > 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 3:
        raise BadInput(f"{what}: expected a stacked [n, T, H] or [T, n, H] tensor, got {tuple(t.shape)}")
    if n is None:
        raise BadInput(f"{what}: a stacked tensor of shape {tuple(t.shape)} needs --slots to say how many slots it holds")
    if t.shape[0] == n and t.shape[1] != n:
        return [t[i] for i in range(n)]
    if t.shape[1] == n and t.shape[0] != n:
        return [t[:, i] for i in range(n)]
    if t.shape[0] == n:
        return [t[i] for i in range(n)]
    raise BadInput(f"{what}: shape {tuple(t.shape)} has no axis of {n} slots")


def read_subject(path: str | Path, *, slots: Sequence[str] = (), num_layers: int | None = None,
                 spec=None) -> Subject:
    """Read ``path`` as named slots. ``slots`` (``--slots``) picks or names them and may declare
    points; ``num_layers`` (or ``spec``, whose target also names the class whose ids ``--slots
    vllm:IDS`` are read by) lets ids label them."""
    if spec is not None:
        num_layers = spec.num_layers
    gated = open_tensor_file(path)  # the one sniff: a regular file, its format and header
    p = gated.path
    producer, slots = fielddumps.split_producer(slots)
    n = len(slot_entries(slots)) or fielddumps.stack_rows(producer)
    if gated.format != SAFETENSORS:
        read = _read_pickled(gated, n, producer, num_layers)
    elif gated.kind == "dump":
        read = _read_dump(gated)
    else:
        read = _read_safetensors_slots(gated, n, num_layers)
    _label_beside(p, read, producer, num_layers, spec)
    if read.layout == "vllm-connector" and all(d is None for d in read.declared):
        read.notes.append("which point each slot holds is not recorded, so each is identified, not assumed "
                          f"(a capture sidecar beside the file, {SIDECAR}, --slots vllm:IDS or sglang:ALGO:IDS, "
                          "or a spec labels them)")
    if not read.tensors:
        raise BadInput(f"{p}: holds no hidden-state tensors")
    if read.keyed and slots:
        names, declared, tensors = select_by_key(p, slots, read, num_layers)
    else:
        named = parse_slot_names(slots, num_layers)
        if named and read.layout == "vllm-connector" and any(d is not None for d in read.declared):
            _agree_with_record(p, named, read)
        names, declared = _apply_slot_names(p, named, read)
        tensors = read.tensors
    _check_shapes(p, tensors, read.ids)
    return Subject(list(zip(names, declared, tensors)), read.ids, str(p), read.layout, read.notes, keyed=read.keyed)


def _label_beside(p: Path, read: FileSlots, producer: fielddumps.Producer | None, num_layers: int | None,
                  spec=None) -> None:
    """Labels from what lies beside the file or ``--slots PRODUCER:IDS``: the record an export wrote
    (a training file), then, for a ``hidden_states`` stack, the capture sidecar and the ids
    (:func:`surgeon.verify.fielddumps.label_connector`, the one labelling of a stack, export's too)."""
    if producer is None and read.layout in ("vllm-connector", "specforge"):
        _label_by_export_record(p, read, num_layers)
    if read.layout == "vllm-connector" or (producer is not None and producer.name == "sglang"
                                           and read.layout == "plain" and not read.keyed):
        fielddumps.label_connector(p, read, producer, num_layers, spec)
    elif producer is not None and read.layout not in ("trtllm", "modelopt"):
        what = "vLLM hidden-state connector (or speculators)" if producer.name == "vllm" else producer.name
        raise BadInput(f"{p}: --slots {producer.name}:... names a {what} dump, but this is a {read.layout} file")


def _agree_with_record(p: Path, named: list[tuple[str, Point | None]], read: FileSlots) -> None:
    """``--slots`` names or points given for rows a record beside the file declares: they must agree."""
    for i, ((name, point), (own, recorded)) in enumerate(zip(named, zip(read.names, read.declared))):
        if (point is not None and point != recorded) or (point is None and name != own):
            raise BadInput(f"{p}: --slots gives row {i} as {name}{'=' + str(point) if point else ''}, but the record "
                           f"beside the file declares it {own}={recorded} ({'; '.join(read.notes[-1:])})")


_SPECFORGE_AUX = re.compile(r"aux_hidden_state\[(\d+)\]")


def _label_by_export_record(p: Path, read: FileSlots, num_layers: int | None) -> None:
    """A file ``surgeon export`` wrote carries its record beside it (``surgeon-export.json``: each
    written slot's point): its slots are declared from it, the one record a training file has."""
    from surgeon.capture.exporters import MANIFEST

    manifest = p.parent / MANIFEST
    try:
        st = manifest.stat()
    except OSError:
        return
    entry = _export_records(str(manifest), st.st_mtime_ns, st.st_size).get(p.name)
    if entry is None:
        return
    by_key = {}
    for key, text in entry:
        try:
            by_key[key] = parse_point(text, num_layers)
        except PointError as e:
            raise BadInput(f"{manifest}: {p.name}: slot {key!r}: {e.message}") from None
    if set(by_key) != set(read.names):
        raise BadInput(f"{manifest}: records slots {sorted(by_key)} for {p.name}, which holds {read.names}: "
                       "the record does not describe this file")
    read.declared = [by_key[n] for n in read.names]
    read.notes.append(f"slots declared by {manifest.name}, the record surgeon export wrote beside the file")


@lru_cache(maxsize=8)
def _export_records(manifest: str, mtime_ns: int, size: int) -> dict[str, list[tuple[str, str]]]:
    """file name -> [(slot key as the readers name it, point text)] of an export's record, parsed
    once per version of the file (an audit reads it for every file of the set)."""
    import json

    where = f"{manifest}: the record of a surgeon export"
    try:
        data = json.loads(Path(manifest).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BadInput(f"{manifest}:{e.lineno}:{e.colno}: {e.msg} (the record of a surgeon export)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{where} cannot be read ({e})") from None
    if not isinstance(data, dict) or data.get("surgeon.kind") != "export":
        return {}
    files = data.get("files")
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("file"), str) for f in files):
        raise BadInput(f"{where}: 'files' is not a list of {{file, captures}} entries")
    out: dict[str, list[tuple[str, str]]] = {}
    for f in files:
        caps = f.get("captures")
        if not isinstance(caps, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("point"), str) for c in caps):
            raise BadInput(f"{where}: {f['file']}: 'captures' is not a list of {{name, point}} entries")
        out[f["file"]] = [(f"aux_{m.group(1)}" if (m := _SPECFORGE_AUX.fullmatch(c["name"])) else c["name"], c["point"])
                          for c in caps]  # SpecForge's aux_hidden_state[i] is this reader's aux_i
    return out


def _apply_slot_names(p: Path, named: list[tuple[str, Point | None]],
                      read: FileSlots) -> tuple[list[str], list[Point | None]]:
    """Slot names and declared points of a file whose slots have an order: ``--slots`` overrides
    the layout's, one entry per slot in that order."""
    if not named:
        return read.names, read.declared
    if len(named) != len(read.tensors):
        raise BadInput(f"{p}: --slots names {len(named)} slots but the file holds {len(read.tensors)} ({', '.join(read.names)})")
    return [nm for nm, _ in named], [pt if pt is not None else d for (_, pt), d in zip(named, read.declared)]


def _check_shapes(p: Path, tensors: list[torch.Tensor], ids: torch.Tensor | None) -> None:
    T = {t.shape[0] for t in tensors}
    Hs = {t.shape[1] for t in tensors}
    if len(T) != 1 or len(Hs) != 1:
        raise BadInput(f"{p}: slots disagree in shape ({sorted(T)} tokens, {sorted(Hs)} hidden)")
    if 0 in T or 0 in Hs:
        raise BadInput(f"{p}: slots of shape [{next(iter(T))}, {next(iter(Hs))}]: nothing to identify in 0 tokens "
                       "or a hidden size of 0")
    if ids is not None and ids.numel() != next(iter(T)):
        raise BadInput(f"{p}: {ids.numel()} input ids for {next(iter(T))} tokens")


def _read_pickled(gated: TensorFile, n: int | None, producer: fielddumps.Producer | None = None,
                  num_layers: int | None = None) -> FileSlots:
    """A ``torch.save`` file: a SpecForge dict, a TensorRT-LLM or Model Optimizer dump, another dict
    of tensors, a list, or one tensor."""
    p = gated.path
    data = fielddumps.load_pickle(gated)
    try:
        kind = fielddumps.detect(data)
    except BadInput as e:
        raise BadInput(f"{p}: {e}") from None
    if kind is not None:
        reader = fielddumps.read_trtllm if kind == "trtllm" else fielddumps.read_modelopt
        return reader(str(p), data, producer, num_layers)
    if isinstance(data, dict) and "aux_hidden_state" in data:
        return _read_specforge(p, data, n)
    if isinstance(data, dict):
        ids_key = next((k for k in IDS_KEYS if k in data), None)
        ids = fielddumps.int_1d(data[ids_key], f"{p}: {ids_key}") if ids_key else None
        items = [(k, v) for k, v in data.items() if k not in IDS_KEYS and isinstance(v, torch.Tensor) and v.is_floating_point()]
        if len(items) == 1 and items[0][1].dim() >= 3 and items[0][1].shape[-3:-2] != (1,):
            tensors = _stacked(items[0][1], n, f"{p}: {items[0][0]}")
            default_names = [f"{items[0][0]}[{i}]" for i in range(len(tensors))]
        else:
            tensors = [fielddumps.float_2d(v, f"{p}: {k}") for k, v in items]
            return _keyed_plain(p, [str(k) for k, _ in items], tensors, ids, num_layers)
        return FileSlots("plain", default_names, tensors, [None] * len(tensors), ids)
    if isinstance(data, (list, tuple)):
        tensors = [fielddumps.float_2d(v, f"{p}: item {i}") for i, v in enumerate(data)]
    elif isinstance(data, torch.Tensor):
        tensors = _stacked(data, n, str(p)) if data.dim() >= 3 else [fielddumps.float_2d(data, str(p))]
    else:
        raise BadInput(f"{p}: holds a {type(data).__name__}, not tensors")
    return FileSlots("plain", [f"slot{i}" for i in range(len(tensors))], tensors, [None] * len(tensors))


def _read_specforge(p: Path, data: dict, n: int | None) -> FileSlots:
    """SpecForge's ``aux_hidden_state`` [1, T, nH], split into its n slots by the hidden width."""
    hidden = data.get("hidden_state")
    aux = data["aux_hidden_state"]
    if not isinstance(aux, torch.Tensor):
        raise BadInput(f"{p}: aux_hidden_state is not a tensor")
    aux = fielddumps.float_2d(aux, f"{p}: aux_hidden_state")
    H = hidden.shape[-1] if isinstance(hidden, torch.Tensor) else None
    if H is None:
        if n is None:
            raise BadInput(f"{p}: no hidden_state to tell the width; pass --slots for the aux slots")
        H = aux.shape[-1] // n
    if H < 1 or aux.shape[-1] < 1:
        raise BadInput(f"{p}: aux_hidden_state width {aux.shape[-1]} and hidden size {H}: a hidden size of 0 holds no state")
    if aux.shape[-1] % H:
        raise BadInput(f"{p}: aux_hidden_state width {aux.shape[-1]} is not a multiple of hidden {H}")
    k = aux.shape[-1] // H
    read = FileSlots("specforge", [f"aux_{i}" for i in range(k)], [aux[:, i * H:(i + 1) * H] for i in range(k)],
                      [None] * k)
    if isinstance(hidden, torch.Tensor):
        read.tensors.append(fielddumps.float_2d(hidden, f"{p}: hidden_state"))
        read.names.append("hidden_state")
        read.declared.append(None)
        read.notes.append("SpecForge's hidden_state is documented as after the final norm; it is identified, not assumed")
    if "input_ids" in data:
        read.ids = fielddumps.int_1d(data["input_ids"], f"{p}: input_ids")
    return read


def _read_dump(gated: TensorFile) -> FileSlots:
    """A surgeon dump: its slots are named and declared by the dump itself."""
    from surgeon.capture.dumps import read_dump

    p = gated.path
    dump = read_dump(gated)
    note = (f"surgeon dump of spec {dump.meta.get('spec.name') or '-'} on {dump.meta.get('engine') or '?'} "
            f"{dump.meta.get('engine.version', '')}: slots declared by the dump itself")
    return FileSlots("surgeon", [n for n, _, _ in dump.captures],
                      [fielddumps.float_2d(t, f"{p}: {n}") for n, _, t in dump.captures],
                      [pt for _, pt, _ in dump.captures], dump.input_ids, [note], keyed=True)


def _read_safetensors_slots(gated: TensorFile, n: int | None, num_layers: int | None) -> FileSlots:
    """A safetensors file: a surgeon reference, a speculators ``hidden_states`` stack, or plain tensors."""
    p = gated.path
    data, meta = read_safetensors(gated)
    kind = meta.get("surgeon.kind")
    ids_key = next((k for k in IDS_KEYS if k in data), None)
    ids = fielddumps.int_1d(data.pop(ids_key), f"{p}: {ids_key}") if ids_key else None
    if kind == "reference":
        L = int(meta.get("num_layers", "0") or 0) or None
        read = FileSlots("surgeon-reference", [], [], [], ids, keyed=True)
        for k, v in data.items():
            read.names.append(k)
            read.tensors.append(fielddumps.float_2d(v, f"{p}: {k}"))
            read.declared.append(parse_point(k, L, allow_delta=True))
        return read
    stack = fielddumps.read_stack(data, ids)
    if stack is not None:
        return stack
    items = [(k, v) for k, v in data.items() if v.is_floating_point()]
    if len(items) == 1 and items[0][1].dim() == 3:
        tensors = _stacked(items[0][1], n, f"{p}: {items[0][0]}")
        default_names = [f"{items[0][0]}[{i}]" for i in range(len(tensors))]
        return FileSlots("plain", default_names, tensors, [None] * len(tensors), ids)
    tensors = [fielddumps.float_2d(v, f"{p}: {k}") for k, v in items]
    return _keyed_plain(p, [k for k, _ in items], tensors, ids, num_layers)


def _keyed_plain(p: Path, keys: list[str], tensors: list[torch.Tensor], ids: torch.Tensor | None,
                 num_layers: int | None) -> FileSlots:
    """Tensors under names: a name that is a point (``layer_out[3]``, ``final_norm``) declares it."""
    declared = [_point_or_none(k, num_layers) for k in keys]
    read = FileSlots("plain", keys, tensors, declared, ids, keyed=True)
    if any(d is not None for d in declared):
        read.notes.append("tensors named as points declare those points: " + ", ".join(
            k for k, d in zip(keys, declared) if d is not None))
    return read


def align(subject_ids: torch.Tensor | None, reference_ids: torch.Tensor, n_tokens: int) -> tuple[slice, slice, str]:
    """(subject slice, reference slice, how): token alignment by the input ids. Equal sequences,
    or one a contiguous window of the other. Without subject ids the token counts must match."""
    R = reference_ids.reshape(-1)
    if subject_ids is None:
        if n_tokens != R.numel():
            raise BadInput(f"the subject has {n_tokens} tokens and no input ids, the reference {R.numel()}: pass --input-ids")
        return slice(None), slice(None), "assumed: same tokens (the subject carries no input ids)"
    S = subject_ids.reshape(-1)
    if S.numel() == R.numel() and torch.equal(S, R):
        return slice(None), slice(None), "input ids equal"
    short, long_, subj_short = (S, R, True) if S.numel() <= R.numel() else (R, S, False)
    for off in range(long_.numel() - short.numel() + 1):
        if torch.equal(long_[off:off + short.numel()], short):
            window = slice(off, off + short.numel())
            return (slice(None), window, f"subject = reference tokens {off}..{window.stop - 1}") if subj_short \
                else (window, slice(None), f"reference = subject tokens {off}..{window.stop - 1}")
    raise BadInput("the subject's input ids do not appear in the reference's: capture the reference on the same input ids")
