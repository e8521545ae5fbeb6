"""Commands on capture code and dumps: hooks, check-hooks, dump-info, export."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from surgeon.commands.outputs.capture import DumpCapture, DumpProducer, DumpRecord, DumpSpec
from surgeon.commands.results import GeneratedText, write_new_file
from surgeon.core.errors import BadInput, InternalError


def hooks(*, spec: str, mode: Literal["aux", "dump"], max_tokens: int, output: str | None = None) -> GeneratedText:
    """The CUDA-graph-safe capture hooks module for ``spec``, checked before anyone gets it."""
    from surgeon.capture.graphsafe import check_source
    from surgeon.capture.hooks import generate_hooks_module
    from surgeon.core.spec import load_spec

    source = generate_hooks_module(load_spec(spec), mode=mode, max_tokens=max_tokens)
    findings = check_source(source, "<generated>")
    if findings:  # the generator's own contract: never hand out unsafe code
        raise InternalError(f"generated hooks fail the graph-safety check: {findings[0]}")
    return write_new_file(source, output)


def check_hooks(*, files: Sequence[str]) -> HookCheck:
    """Static graph-safety check of hook code; any finding is a mismatch (exit 3)."""
    from surgeon.capture.graphsafe import check_file

    findings = []
    for f in files:
        try:
            findings += check_file(f)
        except (OSError, UnicodeDecodeError) as e:
            raise BadInput(f"{f}: cannot read as UTF-8 text: {getattr(e, 'strerror', None) or e}") from None
    return HookCheck(len(files), findings)


_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def dump_info(*, dump: str, slots: Sequence[str] = (), spec: str | None = None) -> DumpInfo:
    """What a dump says it is. A surgeon dump: from its header alone (no tensor loaded, no torch).
    A TensorRT-LLM or Model Optimizer dump: its layout, which producers its keys allow, its
    records, and each slot's point as ``slots`` (``PRODUCER:IDS``) labels it, or None: such a file
    does not record its layers. ``spec`` gives the layer count labelling by ids needs."""
    from surgeon.capture.tensorfiles import SAFETENSORS, open_tensor_file

    gated = open_tensor_file(dump)
    if gated.format != SAFETENSORS:
        return _field_dump_info(dump, slots, spec)
    from surgeon.capture.dumps import read_dump_header

    if gated.kind != "dump" and "hidden_states" in gated.tensors:
        return _training_file_info(dump, slots, spec)
    if slots:
        raise BadInput(f"{dump}: a safetensors file (a surgeon dump declares its own slots' points); --slots "
                       "is for TensorRT-LLM and Model Optimizer .pt dumps and hidden_states stacks (vllm:IDS)")
    d = read_dump_header(gated)
    return DumpInfo(dump, {k: v for k, v in d.meta.items() if k != "captures"},
                    [DumpCapture(name=n, point=str(p), shape=shape,
                                 dtype=_ST_DTYPES.get(gated.tensors[n]["dtype"], gated.tensors[n]["dtype"].lower()))
                     for n, p, shape in d.captures],
                    records=[DumpRecord(index=0, id=None, tokens=d.tokens, input_ids=True, loss_mask=None)])


def _training_file_info(dump: str, slots: Sequence[str], spec: str | None) -> DumpInfo:
    """A SpecForge ``.ckpt`` or a ``hidden_states`` stack (vLLM's connector, speculators): each slot's
    point as the file, the export record beside it or ``--slots`` says it, None where nothing does."""
    from surgeon.core.spec import load_spec
    from surgeon.verify.subjects import read_subject

    loaded = load_spec(spec) if spec else None
    num_layers = loaded.num_layers if loaded else None
    sub = read_subject(dump, slots=slots, spec=loaded)
    T, H = sub.slots[0][2].shape
    dtypes = ",".join(sorted({str(t.dtype).removeprefix("torch.") for _, _, t in sub.slots}))
    engine = "SpecForge" if sub.layout == "specforge" else "vLLM hidden-state connector or speculators"
    meta = {"engine": engine, "num_layers": str(num_layers) if num_layers else "", "hidden_size": str(H),
            "tokens": str(T), "dtype": dtypes}
    captures = [_capture(n, p, t) for n, p, t in sub.slots]
    records = [DumpRecord(index=0, id=None, tokens=int(T), input_ids=sub.input_ids is not None, loss_mask=None)]
    return DumpInfo(dump, meta, captures, sub.layout, None, records, list(sub.notes))


def _field_dump_info(dump: str, slots: Sequence[str], spec: str | None) -> DumpInfo:
    from surgeon.core.spec import load_spec
    from surgeon.verify.fielddumps import read_field_dump

    num_layers = load_spec(spec).num_layers if spec else None
    fd = read_field_dump(dump, slots, num_layers)
    if fd is None:
        from surgeon.verify.fielddumps import load_pickle

        data = load_pickle(dump)
        if isinstance(data, dict) and "aux_hidden_state" in data:
            return _training_file_info(dump, slots, spec)
        raise BadInput(f"{dump}: neither a surgeon dump nor a TensorRT-LLM or Model Optimizer dump")
    first = fd.records[0]  # the top-level fields describe it, as a surgeon dump's its one sequence
    T, H = first.tensors[-1].shape
    meta = {"engine": "TensorRT-LLM" if fd.layout == "trtllm" else "Model Optimizer",
            "num_layers": str(num_layers) if num_layers else "", "hidden_size": str(H), "tokens": str(T),
            "dtype": _dtypes(first)}
    captures = [_capture(n, p, t) for n, p, t in zip(first.names, first.declared, first.tensors)]
    records = [DumpRecord(index=i, id=r.record, tokens=int(r.tensors[-1].shape[0]), input_ids=r.ids is not None,
                          loss_mask=int((r.loss_mask != 0).sum()) if r.loss_mask is not None else None)
               for i, r in enumerate(fd.records)]
    given = f"{fd.producer.name}:{fd.producer.ids_text}" if fd.producer else None
    notes = list(first.notes)
    if len(fd.records) > 1:
        notes.append(f"hidden_size, tokens, dtype and captures are the first record's; records lists each one's "
                     f"tokens ({sum(int(r.tensors[-1].shape[0]) for r in fd.records)} in all)")
        odd = [f"{r.record or i} ({_dtypes(r)}, hidden {r.tensors[-1].shape[1]})" for i, r in enumerate(fd.records)
               if (_dtypes(r), r.tensors[-1].shape[1]) != (meta["dtype"], H)]
        if odd:
            notes.append(f"records differing from the first in dtype or hidden size: {', '.join(odd[:5])}"
                         + (f" and {len(odd) - 5} more" if len(odd) > 5 else ""))
    return DumpInfo(dump, meta, captures, fd.layout, DumpProducer(detected=fd.candidates, why=fd.why, given=given),
                    records, notes)


def _capture(name: str, point: object, tensor) -> DumpCapture:
    """A slot of a file that is not a surgeon dump: its point where something records it (else None)."""
    return DumpCapture(name=name, point=str(point) if point is not None else None, shape=list(tensor.shape),
                       dtype=str(tensor.dtype).removeprefix("torch."))


def _dtypes(record) -> str:
    return ",".join(sorted({str(t.dtype).removeprefix("torch.") for t in record.tensors}))


def export(*, dumps: Sequence[str], spec: str, layout: str, out_dir: str, slots: Sequence[str] = ()) -> Exported:
    """Export dumps to a training tool's layout (specforge or speculators), or refuse. Surgeon
    dumps declare their points; TensorRT-LLM and Model Optimizer dumps need ``slots``
    (``PRODUCER:IDS``) to say them."""
    from surgeon.capture.exporters import MANIFEST, export_specforge, export_speculators
    from surgeon.core.spec import load_spec
    from surgeon.verify.fielddumps import export_reader

    s = load_spec(spec)
    exporter = export_specforge if layout == "specforge" else export_speculators
    written = list(exporter(list(dumps), out_dir, spec=s, read=export_reader(slots, s.num_layers, spec=s)))
    return Exported(layout, out_dir, written, Path(out_dir) / MANIFEST)


_DUMP_KEYS = ("surgeon.kind", "surgeon.format", "spec.name", "spec.sha256", "engine", "engine.version", "model",
              "num_layers", "hidden_size", "tokens", "dtype")


def _number(text: str | None) -> int | None:
    """A count from the dump's (string-only) safetensors metadata; None when absent or not a number."""
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


@dataclass
class DumpInfo:
    """What a dump says it is. ``dump-info --json`` prints it through
    :class:`surgeon.commands.outputs.capture.DumpInfoOutput`, which reads the attributes and the
    properties below (the metadata's fields, an empty one read as not recorded) by its field names."""

    file: str
    meta: dict  # the dump's metadata, without its captures list (safetensors metadata: all strings)
    captures: list[DumpCapture]  # point None: not recorded
    layout: str = "surgeon"  # surgeon | trtllm | modelopt | specforge | vllm-connector
    producer: DumpProducer | None = None  # a field dump's: which writers its keys allow, and --slots
    records: list[DumpRecord] = field(default_factory=list)  # per sequence
    notes: list[str] = field(default_factory=list)

    @property
    def labelled(self) -> bool:
        return all(c.point is not None for c in self.captures)

    def _text(self, key: str) -> str | None:
        return self.meta.get(key) or None  # an empty field is "not recorded"

    @property
    def dump_format(self) -> int | None:
        """The dump file's own format number."""
        return _number(self.meta.get("surgeon.format"))

    @property
    def spec(self) -> DumpSpec:
        return DumpSpec(name=self._text("spec.name"), sha256=self._text("spec.sha256"))

    @property
    def engine(self) -> str | None:
        return self._text("engine")

    @property
    def engine_version(self) -> str | None:
        return self._text("engine.version")

    @property
    def model(self) -> str | None:
        return self._text("model")

    @property
    def num_layers(self) -> int | None:
        return _number(self.meta.get("num_layers"))

    @property
    def hidden_size(self) -> int | None:
        return _number(self.meta.get("hidden_size"))

    @property
    def tokens(self) -> int | None:
        return _number(self.meta.get("tokens"))

    @property
    def dtype(self) -> str | None:
        return self._text("dtype")

    @property
    def other_metadata(self) -> dict[str, str]:
        """The metadata keys this surgeon does not interpret."""
        return {k: v for k, v in self.meta.items() if k not in _DUMP_KEYS}


@dataclass
class Exported:
    layout: str
    out_dir: str
    written: list[Path]
    manifest: Path | None = None  # surgeon-export.json: each written slot's point and source


@dataclass
class HookCheck:
    """Graph-safety findings in hook files: any finding is a mismatch with the contract."""

    files: int
    findings: list[Any]  # surgeon.capture.graphsafe.Finding

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 3
