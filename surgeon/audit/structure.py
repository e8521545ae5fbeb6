"""The structure pass: what each file of a training set holds, from its header where the format
allows, checked against the spec's dump slots.

* speculators ``hs_*.safetensors`` and surgeon dumps: the safetensors header the gate
  (:func:`surgeon.capture.tensorfiles.open_tensor_file`) already parsed; no tensor is read;
* SpecForge ``.ckpt`` (``torch.save`` zip): loaded with ``weights_only=True`` onto the meta
  device, which reads the pickle (names, shapes, dtypes) and each storage's offset in the file,
  and no tensor data; a legacy (non-zip) pickle has no such index and is read whole.

Where the format says so, the structure also says where each slot's rows lie in the file (a
:class:`surgeon.audit.rows.RowPlan`): the value pass then reads them in chunks, not through the
tensors.

Checked per file: the slot count against the spec's dump slots, the hidden size, one dtype for
every slot, input ids present and as long as the slots, the loss mask as long (SpecForge), and for
a self-describing surgeon dump the slot names, their order and their declared points. Each
disagreement is a finding (``structure``), never an exception: one bad file does not stop an audit.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgeon.audit.rows import FLOATS, INTS, Region, RowPlan, plan
from surgeon.audit.torchzip import TorchZip
from surgeon.capture.tensorfiles import SAFETENSORS, ZIP, TensorFile, held, open_tensor_file
from surgeon.core.errors import BadInput

SUFFIXES = (".ckpt", ".safetensors", ".pt")
STATE_NAME = ".surgeon-audit-state.jsonl"


@dataclass
class Structure:
    """One file's structure as its header says it, and what disagrees with the spec."""

    layout: str  # specforge | speculators | surgeon | plain | unreadable
    tokens: int | None = None
    hidden: int | None = None
    names: list[str] = field(default_factory=list)  # slot names in file order
    dtypes: list[str] = field(default_factory=list)
    ids: bool = False
    findings: list[str] = field(default_factory=list)
    loaded: Any = field(default=None, repr=False)  # a SpecForge dict as loaded (meta tensors from a zip)
    rows: RowPlan | None = field(default=None, repr=False)  # where the slots' rows lie, where the format says
    points: list[str] | None = None  # a surgeon dump's declared point of each slot, and its target's layers
    num_layers: int | None = None
    gated: TensorFile | None = field(default=None, repr=False)  # the file as the gate read it: every later read is of it


def discover(root: str | Path) -> Iterator[Path]:
    """Every tensor file under ``root`` (``.ckpt``, ``.safetensors``, ``.pt``), in sorted path
    order (numbers in names compared as numbers: ``hs_9`` before ``hs_10``, the order a writer of
    unpadded names wrote them in, which the cross-file stale check takes for the order of the
    set), streamed directory by directory (a 100k-file tree is never listed whole at once). A
    link to a folder is followed (shards linked into one set) once: a folder already walked,
    under another name or up a loop of links, is not walked again."""
    stack = [Path(root)]
    seen = _ancestors(Path(root))  # a link up to DIR or a folder above it would walk beyond DIR
    while stack:
        d = stack.pop()
        try:
            st = os.stat(d)
            if (st.st_dev, st.st_ino) in seen:  # walked already: not listed again
                continue
            seen.add((st.st_dev, st.st_ino))
            entries = sorted(os.scandir(d), key=lambda e: (_natural(e.name), e.name))
        except OSError as e:
            raise BadInput(f"{d}: cannot list: {e.strerror or e}") from None
        dirs = []
        for entry in entries:
            try:
                is_dir = entry.is_dir()  # a link to a folder too
            except OSError:  # a loop of links, a target that cannot be searched: not a folder to walk
                is_dir = False
            if is_dir:
                dirs.append(Path(entry.path))
            elif entry.name.endswith(SUFFIXES) and not entry.name.startswith("."):
                yield Path(entry.path)
        stack.extend(reversed(dirs))


def _ancestors(root: Path) -> set[tuple[int, int]]:
    """(device, inode) of every folder above ``root``, as given and as resolved (``root`` itself is
    marked when walked)."""
    out = set()
    for d in {*Path(os.path.abspath(root)).parents, *Path(os.path.realpath(root)).parents}:
        try:
            st = os.stat(d)
        except OSError:
            continue
        out.add((st.st_dev, st.st_ino))
    return out


def _natural(name: str) -> list:
    """``name`` as text and numbers alternating (text first, maybe empty): numbers compare as numbers."""
    return [int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", name))]


def _dt(text: str) -> str:
    return text.replace("torch.", "").lower()


def _safetensors_structure(gated: TensorFile) -> Structure:
    from surgeon.verify.subjects import IDS_KEYS

    meta, tensors = gated.metadata, gated.tensors
    if gated.kind == "dump":
        from surgeon.capture.dumps import read_dump_header

        head = read_dump_header(gated)
        names = [n for n, _, _ in head.captures]
        st = Structure("surgeon", head.tokens, head.hidden_size, names,
                       [FLOATS.get(tensors[n]["dtype"], tensors[n]["dtype"]) for n in names], True,
                       rows=_safetensors_plan(gated, [(n, (i,)) for i, n in enumerate(names)], "input_ids"),
                       points=[str(pt) for _, pt, _ in head.captures], num_layers=head.num_layers)
        _integer_ids(st, "input_ids", tensors["input_ids"]["dtype"])
        return st
    ids_key = next((k for k in IDS_KEYS if k in tensors), None)  # read_subject's order: the same ids either way
    ids_len = gated.shape(ids_key) if ids_key else None
    if "hidden_states" in tensors and len(gated.shape("hidden_states")) == 3:
        T, n, H = gated.shape("hidden_states")
        dtype = tensors["hidden_states"]["dtype"]
        st = Structure("speculators", T, H, [f"hidden_states[:, {i}]" for i in range(n)], [FLOATS.get(dtype, dtype)] * n,
                       ids_key is not None,
                       rows=_safetensors_plan(gated, [("hidden_states", tuple(range(n)))], ids_key))
        _from_sidecar(st, gated, n)
    else:
        floats = [(k, v) for k, v in tensors.items() if v["dtype"] in FLOATS and len(v["shape"]) == 2]
        shapes = {tuple(v["shape"]) for _, v in floats}
        T, H = next(iter(shapes)) if len(shapes) == 1 else (None, None)
        st = Structure("plain", T, H, [k for k, _ in floats], [FLOATS[v["dtype"]] for _, v in floats],
                       ids_key is not None)
        st.findings.append(f"a surgeon {meta['surgeon.kind']} file, not a training sample" if meta.get("surgeon.kind")
                           else "not a training sample of a layout the audit reads (a speculators sample has "
                                "hidden_states [tokens, slots, hidden], a surgeon dump its header): its values are not checked")
    if ids_len is not None and (len(ids_len) != 1 or ids_len[0] != st.tokens):
        st.findings.append(f"{ids_key} has shape {ids_len} for {st.tokens} tokens")
    if ids_key is not None:
        _integer_ids(st, ids_key, tensors[ids_key]["dtype"])
    return st


def _from_sidecar(st: Structure, gated: TensorFile, n: int) -> None:
    """A stack a capture route wrote: its rows named and declared by the capture sidecar beside it
    (:func:`surgeon.capture.sidecar.rows_of`, the check every reader makes), as a dump's header does."""
    from surgeon.capture.sidecar import find_sidecar, rows_of

    sidecar = find_sidecar(gated.path)
    if sidecar is not None:
        points = rows_of(sidecar, gated.path, n, "hidden_states", None)
        st.names, st.points, st.num_layers = list(sidecar.names), [str(pt) for pt in points], sidecar.num_layers


def _integer_ids(st: Structure, key: str, dtype: str) -> None:
    """A finding where the token ids are not integers (safetensors' dtype name, I8..U64, or torch's,
    int8..uint64)."""
    name = {**FLOATS, **INTS}.get(dtype, _dt(dtype))  # safetensors' names said as torch's
    if not name.startswith(("i", "u")):
        st.findings.append(f"{key} are {name}, not integers: no token ids")


def _safetensors_plan(gated: TensorFile, parts: list[tuple[str, tuple[int, ...]]], ids_key: str | None) -> RowPlan | None:
    """Where the slots lie: each of ``parts`` (a tensor, ``[T, H]`` holding one slot or ``[T, n, H]``
    holding n, and the indices of its slots), and the 1-D integer ids ``ids_key``."""
    regions = []
    for name, slots in parts:
        e = gated.tensors[name]
        shape, dtype = e["shape"], FLOATS.get(e["dtype"])
        if dtype is None or not ((len(shape) == 2 and len(slots) == 1) or (len(shape) == 3 and shape[1] == len(slots))):
            return None
        regions.append(Region(gated.data_start + e["data_offsets"][0], shape[0], slots, shape[-1], dtype))
    ids = None
    if ids_key is not None:
        e = gated.tensors[ids_key]
        if e["dtype"] not in INTS or len(e["shape"]) != 1:
            return None
        ids = (gated.data_start + e["data_offsets"][0], e["shape"][0], INTS[e["dtype"]])
    return plan(str(gated.path), regions, ids, gated.size, gated.ident)


def _length(t: Any) -> int | None:
    import torch

    if not isinstance(t, torch.Tensor):
        return None
    return int(t.numel()) if t.dim() <= 1 or all(d == 1 for d in t.shape[:-1]) else -1


def _shape(t: Any) -> str:
    """What a finding says of a value's shape: a tensor's dims, anything else's type."""
    import torch

    return f"has shape {list(t.shape)}" if isinstance(t, torch.Tensor) else f"is a {type(t).__name__}, not a tensor"


def _pickle_structure(gated: TensorFile) -> Structure:
    import torch

    if gated.format == ZIP:  # onto the meta device: the pickle is read, each storage's offset noted, no data read
        tz = TorchZip.open(gated)
        if tz is not None and _native(tz):
            data = tz.meta_load() or _load(gated, "meta")
        else:  # another byte order, or a zip torch's reader cannot open (its load on the CPU says why)
            data = _load(gated, "cpu", mmap=_mappable(gated))
    else:
        data = _load(gated, "cpu")
    if not isinstance(data, dict) or not isinstance(data.get("aux_hidden_state"), torch.Tensor):
        return Structure("plain", findings=["not a SpecForge sample (no aux_hidden_state tensor)"])
    aux, hidden = data["aux_hidden_state"], data.get("hidden_state")
    H = int(hidden.shape[-1]) if isinstance(hidden, torch.Tensor) and hidden.dim() else None
    T = int(aux.shape[-2]) if aux.dim() >= 2 else None
    k = aux.shape[-1] // H if H and aux.dim() and aux.shape[-1] % H == 0 else None
    st = Structure("specforge", T, H, [f"aux_{i}" for i in range(k or 0)], [_dt(str(aux.dtype))] * (k or 0),
                   isinstance(data.get("input_ids"), torch.Tensor), loaded=data)
    if st.ids:
        _integer_ids(st, "input_ids", str(data["input_ids"].dtype))
    if k == 0 or T is None:
        st.findings.append(f"aux_hidden_state shape {list(aux.shape)}: no [tokens, k x hidden] slots in it")
    elif k is None and H:
        st.findings.append(f"aux_hidden_state shape {list(aux.shape)}: its width is not a multiple of hidden_state's {H}")
    if not isinstance(hidden, torch.Tensor):
        st.findings.append("no hidden_state tensor" if hidden is None else f"hidden_state {_shape(hidden)}")
    else:
        st.names.append("hidden_state")
        st.dtypes.append(_dt(str(hidden.dtype)))
        if hidden.dim() < 2 or int(hidden.shape[-2]) != T:
            st.findings.append(f"hidden_state has shape {list(hidden.shape)}, aux_hidden_state {list(aux.shape)}")
    for key in ("input_ids", "loss_mask"):
        n = _length(data.get(key))
        if key in data and n != T:
            st.findings.append(f"{key} {_shape(data[key])} for {T} tokens")
        elif key not in data:
            st.findings.append(f"no {key}")
    if T and k and isinstance(hidden, torch.Tensor) and hidden.dim() >= 2 and aux.is_meta:
        st.rows = _specforge_plan(gated, aux, hidden, data.get("input_ids"), k)
    return st


def _load(gated: TensorFile, where: str, mmap: bool = False) -> Any:
    import warnings

    import torch

    with held(gated) as name:  # the file the gate read, whatever is at its path now
        try:
            with warnings.catch_warnings():  # its complaints (a TorchScript archive...) become the one line below
                warnings.simplefilter("ignore")
                return torch.load(name, map_location=where, weights_only=True, mmap=mmap)
        except Exception as e:
            first = (str(e).splitlines() or [type(e).__name__])[0].replace(name, str(gated.path))
            raise BadInput(f"{gated.path}: cannot be read with weights_only=True: {first[:160]}") from None


def _storage_records(gated: TensorFile) -> dict[str, tuple[int, int, int]]:
    """The zip records of a ``torch.save`` file's tensor storages (``data/N``, under its archive folder)."""
    return {n: v for n, v in gated.records.items() if n.startswith("data/") or "/data/" in n}


def _native(tz: TorchZip) -> bool:
    """Whether a ``torch.save`` zip's storages are in this machine's byte order (torch swaps them as
    it loads, which on the meta device crashes the process, torch 2.13), as its ``byteorder`` record
    says to torch's own reader (Python's zipfile may find another entry of that name than torch does)."""
    if tz.byteorder is None:  # written before torch recorded it: little-endian, as torch assumes
        return sys.byteorder == "little"
    return tz.byteorder == sys.byteorder.encode()


def _mappable(gated: TensorFile) -> bool:
    """Whether a ``torch.save`` zip's storages are stored uncompressed (what a memory map of them needs)."""
    import zipfile

    return all(c == zipfile.ZIP_STORED for _, _, c in _storage_records(gated).values())


def specforge_data(st: Structure, path: str | Path) -> Any:
    """The SpecForge dict with its data: as the structure pass loaded it (a legacy pickle, or a zip
    in another byte order), or, for a zip it loaded onto the meta device, loaded again with its
    storages mapped (read whole where they are compressed)."""
    import torch

    if not any(isinstance(v, torch.Tensor) and v.is_meta for v in st.loaded.values()):
        return st.loaded
    gated = st.gated if st.gated is not None else open_tensor_file(path)
    return _load(gated, "cpu", mmap=_mappable(gated))


def _file_offset(t: Any, records: dict[int, tuple[int, int]]) -> int | None:
    """Where a dense meta tensor loaded from a zip starts in the file: its storage's offset as torch
    recorded it (computed, where the zip says format version >= 1, from the layout torch's own
    writer gives), checked against the zip: the data of a stored record of the storage's size
    (``records``: data offset -> (size, compression) of each record). None otherwise: not dense,
    a torch that does not record offsets, or a zip another tool rewrote."""
    import zipfile

    storage = t.untyped_storage()
    at = getattr(storage, "_checkpoint_offset", None)
    if not isinstance(at, int) or at not in records or not t.is_contiguous() or any(d != 1 for d in t.shape[:-2]):
        return None
    size, how = records[at]
    begin = at + t.storage_offset() * t.element_size()
    if how != zipfile.ZIP_STORED or size != storage.nbytes() or begin + t.numel() * t.element_size() > at + size:
        return None
    return begin


def _specforge_plan(gated: TensorFile, aux: Any, hidden: Any, ids: Any, k: int) -> RowPlan | None:
    """Where a SpecForge sample's slots lie: ``aux_hidden_state`` ``[1, T, k x H]`` (k slots side
    by side) and ``hidden_state`` ``[1, T, H]``, and its ``input_ids``."""
    import torch

    records = {start: (size, how) for start, size, how in _storage_records(gated).values()}
    H, T = int(hidden.shape[-1]), int(aux.shape[-2])
    at_aux, at_hidden = _file_offset(aux, records), _file_offset(hidden, records)
    dtypes = {_dt(str(aux.dtype)), _dt(str(hidden.dtype))}
    if at_aux is None or at_hidden is None or len(dtypes) != 1 or not dtypes <= set(FLOATS.values()) \
            or int(hidden.shape[-2]) != T:
        return None
    dtype = dtypes.pop()
    regions = [Region(at_aux, T, tuple(range(k)), H, dtype), Region(at_hidden, T, (k,), H, dtype)]
    at_ids, ids_type = None, None
    if isinstance(ids, torch.Tensor):
        ids_type = _dt(str(ids.dtype))
        at_ids = _file_offset(ids.reshape(-1, 1), records) if ids.is_contiguous() else None
        if at_ids is None or ids_type not in INTS.values():
            return None
    return plan(str(gated.path), regions, None if at_ids is None else (at_ids, ids.numel(), str(ids_type)), gated.size,
                gated.ident)


def read_structure(path: str | Path) -> Structure:
    """The structure of one file (header only where the format allows); BadInput for a file the
    gate refuses."""
    gated = open_tensor_file(path)
    st = _safetensors_structure(gated) if gated.format == SAFETENSORS else _pickle_structure(gated)
    st.gated = gated
    return st


def check_structure(st: Structure, spec) -> list[str]:
    """What in ``st`` disagrees with ``spec`` (its dump slots, hidden size and, for a dump, names)."""
    out = list(st.findings)
    want = spec.dump_slots
    dumps = spec.model.dumps  # a layout the spec states (the field's default is no statement about the set)
    declared = dumps.layout if dumps is not None and "layout" in dumps.model_fields_set else None
    if declared is not None and st.layout in ("specforge", "speculators", "surgeon") and st.layout != declared:
        out.append(f"a {st.layout} sample, the spec's dumps.layout is {declared} (its slots mean other points)")
    if st.num_layers is not None and st.num_layers != spec.num_layers:
        out.append(f"a {'dump' if st.layout == 'surgeon' else 'capture'} of a {st.num_layers}-layer target, "
                   f"the spec's has {spec.num_layers}")
    if st.points is not None:
        for name, point in zip(st.names, st.points):
            if name in spec.captures and point != str(spec.captures[name]):
                out.append(f"slot {name} is {point} in its {'header' if st.layout == 'surgeon' else 'capture sidecar'}, "
                           f"the spec declares {spec.captures[name]}")
    if st.layout in ("specforge", "speculators", "surgeon") and len(st.names) != len(want):
        out.append(f"{len(st.names)} slots ({', '.join(st.names)}), the spec's dump slots are {len(want)} "
                   f"({', '.join(want)})")
    if st.layout == "surgeon" and len(st.names) == len(want) and sorted(st.names) != sorted(want):
        # a dump's slots are read by their names (worker._declared): the order it stores them in is no fault
        out.append(f"slots named {st.names}, the spec's dump slots are {want}")
    if st.hidden is not None and st.hidden != spec.hidden_size:
        out.append(f"hidden size {st.hidden}, the spec's target has {spec.hidden_size}")
    if len(set(st.dtypes)) > 1:
        out.append(f"slots differ in dtype: {', '.join(st.dtypes)}")
    if not st.ids and not any(f.startswith("no input_ids") for f in out):
        out.append("no input ids: the tokens cannot be checked or re-run")
    if st.tokens == 0 or st.hidden == 0:
        out.append(f"degenerate slots: {st.tokens} tokens x hidden {st.hidden}")
    return out
