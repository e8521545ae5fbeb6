"""Exporters: surgeon dumps to the training tools' own layouts, refused where they would lie.

* :func:`export_specforge`: SpecForge offline ``.ckpt`` (``torch.save`` dicts): ``input_ids``
  [1, T], ``loss_mask`` [1, T] (ones, or the dump's own), ``aux_hidden_state`` [1, T, nH] = the spec's ``fc_input``
  captures concatenated in fc order, ``hidden_state`` [1, T, H] = the ``final_norm`` capture
  (SpecForge's hidden_state is after the final norm). Refused when the dump has no final_norm,
  an fc capture is missing, or an fc point is one EAGLE config ids cannot name (``embed``,
  ``layer_out[L-1]``, ``final_norm``) or the fc order is not layer order (SpecForge captures in
  layer order whatever the id list says).
* :func:`export_speculators`: speculators ``hs_{i}.safetensors``: ``token_ids`` [T],
  ``hidden_states`` [T, n+1, H] = fc captures in ascending layer order, then ``layer_out[L-1]``
  (before the final norm, speculators' last slot). Refused without a ``layer_out[L-1]`` capture
  (a ``final_norm`` is not a substitute) or when the fc order is not ascending.

Captures are found by their declared *point* (the dump says what each tensor is); a capture
of a surgeon dump named like a spec capture but declaring another point is refused as
mislabelled. Values are kept exactly: no dtype change, no arithmetic (captures stacked into one
tensor must share a dtype). Every refusal is :class:`BadInput`, one line, and comes before any
file is written: a first pass checks every unit (structure, points, dtypes) and nothing else.
Then everything, the manifest included, is written into a staging folder on the output folder's
filesystem, published only once all of it is written: a new folder by one rename, an existing one
file by file, the files a previous export there wrote and this one does not removed, the manifest
last. An existing folder holding files no export wrote is refused first (a trainer globbing it would
mix them in). Any error before publishing (an internal one too) removes the staging folder and any
parent folder it made, so nothing partial is left.

What is read is a :data:`Reader`'s business: surgeon dumps by default (one unit per file); the
verify layer's :func:`surgeon.verify.fielddumps.export_reader` also reads TensorRT-LLM and Model
Optimizer dumps (one unit per record, points as ``--slots PRODUCER:IDS`` labels them, Model
Optimizer's ``loss_mask`` carried into SpecForge's) and vLLM connector stacks (rows labelled by the
capture sidecar beside them, :mod:`surgeon.capture.sidecar`). Last, ``surgeon-export.json`` (:data:`MANIFEST`)
records per written file its sha256, its source (file and record), its producer and, per slot of the layout,
the physical point it holds and the source slot it came from: the trainer files keep their own
layout, the manifest says what is in them.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from surgeon.capture.dumps import Dump, DumpHeader, read_dump, read_dump_header
from surgeon.capture.sidecar import SIDECAR
from surgeon.core.conventions import EAGLE, NotExpressible
from surgeon.core.errors import BadInput
from surgeon.core.points import FINAL_NORM, Point, layer_out
from surgeon.core.safefile import UnsafeFile, open_regular, read_bytes

MANIFEST = "surgeon-export.json"


def _expand(dump_paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """Dump files in order; a directory stands for its shards in write order, or, without shards,
    for its ``*.pt`` files (a TensorRT-LLM or Model Optimizer output directory) in name order, or for
    the ``*.safetensors`` files of a capture route's directory (a :data:`SIDECAR` beside them)."""
    from surgeon.capture.dumpwriter import list_shards

    if isinstance(dump_paths, (str, Path)):
        dump_paths = [dump_paths]
    out: list[Path] = []
    for p in map(Path, dump_paths):
        if p.is_dir():
            shards = list_shards(p) or sorted(f for f in p.glob("*.pt") if f.is_file())
            if not shards and (p / SIDECAR).is_file():  # a native route's directory: one stack per request
                shards = sorted(f for f in p.glob("*.safetensors") if f.is_file())
            if not shards:
                raise BadInput(f"{p}: no shard-*.safetensors dump shards, *.pt dumps, or a capture route's "
                               f"*.safetensors beside a {SIDECAR} in this directory")
            out.extend(shards)
        else:
            out.append(p)
    if not out:
        raise BadInput("no dumps to export")
    return out


def read_surgeon_dump(path: Path, header_only: bool) -> list[Dump | DumpHeader]:
    """The :data:`Reader` of surgeon dumps: one unit per file, its header alone when checking."""
    return [read_dump_header(path) if header_only else read_dump(path)]


Reader = Callable[[Path, bool], "list[Dump | DumpHeader]"]
"""``reader(path, header_only)``: the units (one sequence each, as :class:`Dump`, or its header when
``header_only`` and the format has one) a file holds, slots declared, or BadInput (one line)."""


def _label(path: Path, unit: Dump | DumpHeader) -> str:
    record = unit.meta.get("record")
    return f"{path} ({record})" if record else str(path)


@contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A fresh folder to write into, on ``out``'s own filesystem: inside ``out`` where it exists (a
    symlink to another disk included), else next to it; published into ``out`` when the block ends
    without error, else removed with the parent folders it made (nothing partial is left)."""
    if out.is_symlink() and not out.exists():
        raise BadInput(f"{out}: a symlink to nothing")
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: exists and is not a folder")
    if out.is_dir() and (foreign := sorted(set(os.listdir(out)) - _listed(out) - {MANIFEST})):
        raise BadInput(f"{out}: holds files no surgeon export wrote, or changed since ({', '.join(foreign[:3])}"
                       f"{', ...' if len(foreign) > 3 else ''}): a trainer reading the folder would mix them in; "
                       "export into a new or empty folder")
    made = [a for a in out.parents if not a.exists()]
    home = out if out.exists() else out.parent
    stage = home / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        home.mkdir(parents=True, exist_ok=True)
        stage.mkdir()  # the default mode (umask), as a folder made by mkdir -p
    except OSError as e:
        _remove_made(made)
        raise BadInput(f"{out}: cannot create a folder {'in' if home == out else 'next to'} it to write into: "
                       f"{e.strerror or e}") from None
    try:
        yield stage
        _publish(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        _remove_made(made)
        raise


def _remove_made(made: list[Path]) -> None:
    for a in made:  # deepest first
        try:
            a.rmdir()
        except OSError:
            break


#: a previous export's manifest is read whole: at most this many bytes
MANIFEST_BYTES = 64 << 20


def _digest(path: Path) -> str | None:
    """The sha256 of the regular file ``path``, opened without following a link (None: absent, a
    link, not a regular file, or unreadable)."""
    try:
        fd = open_regular(path, follow=False, what="an exported file")
    except (OSError, UnsafeFile):
        return None
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _recorded(out: Path) -> dict[str, str]:
    """File name -> sha256 as a previous export's manifest in ``out`` records them (plain names
    only; an entry without a digest records nothing). The manifest is read without following a
    link, bounded: a link, FIFO or device there is refused (one line)."""
    try:
        raw = read_bytes(out / MANIFEST, limit=MANIFEST_BYTES, follow=False, what="the previous export's manifest")
        files = json.loads(raw.decode("utf-8")).get("files", [])
    except FileNotFoundError:
        return {}
    except (ValueError, AttributeError):  # not JSON, not UTF-8, not an object: it records nothing
        return {}
    if not isinstance(files, list):
        return {}
    return {f["file"]: f["sha256"] for f in files if isinstance(f, dict) and isinstance(f.get("file"), str)
            and isinstance(f.get("sha256"), str) and "/" not in f["file"] and "\\" not in f["file"]
            and f["file"] not in ("", ".", "..", MANIFEST)}


def _listed(out: Path) -> set[str]:
    """The files in ``out`` a previous export wrote: listed in its manifest with their digest, and
    there now as regular files (not links) with that very content. A forged or edited manifest
    therefore names nothing export may replace or delete: whatever it lists otherwise counts as
    the user's file."""
    return {name for name, digest in _recorded(out).items() if _digest(out / name) == digest}


def _publish(stage: Path, out: Path) -> None:
    """``stage`` becomes ``out``: by one rename when ``out`` does not exist, else each file
    replaced into it, then the files of a previous export there that this one does not write
    removed, the manifest last (a reader who sees the manifest sees every file, and only them).
    Only files a previous export wrote and that are unchanged since (:func:`_listed`, checked
    again here) are ever replaced or removed: a file that appeared meanwhile is refused."""
    if not out.exists():
        try:
            os.rename(stage, out)
            return
        except OSError:  # made meanwhile: fall through
            pass
    old = _listed(out)
    names = sorted(p.name for p in stage.iterdir())
    clash = [n for n in names if n != MANIFEST and n not in old and os.path.lexists(out / n)]
    if clash:
        raise BadInput(f"{out / clash[0]}: appeared while exporting, and no surgeon export wrote it; not replaced")
    for name in [n for n in names if n != MANIFEST]:
        os.replace(stage / name, out / name)
    for name in sorted(old - set(names)):
        (out / name).unlink(missing_ok=True)
    if MANIFEST in names:
        os.replace(stage / MANIFEST, out / MANIFEST)
    stage.rmdir()


def _fc(spec, layout: str) -> list[tuple[str, Point]]:
    if not spec.fc_names:
        raise BadInput(f"cannot export to {layout}: spec {spec.name} has no draft.fc_input to say which captures are aux inputs")
    return [(n, spec.captures[n]) for n in spec.fc_names]


def _by_point(dump: Dump | DumpHeader, label: str, spec, layout: str) -> dict[Point, tuple[str, Any]]:
    if dump.num_layers != spec.num_layers:
        raise BadInput(f"{label}: dump is of a {dump.num_layers}-layer target, spec {spec.name} of {spec.num_layers}")
    if dump.hidden_size != spec.hidden_size:
        raise BadInput(f"{label}: dump hidden size {dump.hidden_size}, spec {spec.name} says {spec.hidden_size}")
    found: dict[Point, tuple[str, Any]] = {}  # name and tensor, or shape for a header
    for name, point, t in dump.captures:
        want = spec.captures.get(name) if dump.meta.get("surgeon.kind") == "dump" else None  # names a spec's
        if want is not None and want != point:
            raise BadInput(
                f"cannot export {label} to {layout}: capture {name!r} is {point} in the dump but {want} in spec {spec.name}"
            )
        found[point] = (name, t)
    return found


def _need(found: dict[Point, tuple[str, Any]], point: Point, what: str, label: str, layout: str) -> tuple[str, Any]:
    t = found.get(point)
    if t is None:
        have = ", ".join(map(str, found)) or "nothing"
        raise BadInput(f"cannot export {label} to {layout}: no {point} capture for {what} (the dump holds {have})")
    return t


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _dtypes(unit: Dump | DumpHeader, picked: Sequence[tuple[str, Any]]) -> list[str]:
    """The dtype of each picked capture: a tensor's own, or a header's as its safetensors file
    declares it (no tensor loaded)."""
    from surgeon.capture.tensorfiles import gated_safetensors

    header = gated_safetensors(unit.path).tensors if isinstance(unit, DumpHeader) else {}
    return [str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor)
            else _ST_DTYPES.get(header[name]["dtype"], header[name]["dtype"].lower()) for name, t in picked]


def _same_dtype(dtypes: Sequence[str], label: str, layout: str) -> None:
    if len(set(dtypes)) > 1:
        raise BadInput(f"cannot export {label} to {layout}: captures differ in dtype ({', '.join(sorted(set(dtypes)))}); "
                       "stacking them would convert values")


def check_specforge(spec) -> list[tuple[str, Point]]:
    """The fc captures if SpecForge can hold them truthfully; BadInput (one line) otherwise."""
    fc = _fc(spec, "SpecForge")
    try:
        EAGLE.encode([p for _, p in fc], spec.num_layers)  # expressible ids, strictly layer order
    except NotExpressible as e:
        raise BadInput(f"cannot export to SpecForge: fc_input [{', '.join(f'{n}={p}' for n, p in fc)}]: {e}") from None
    return fc


def check_speculators(spec) -> list[tuple[str, Point]]:
    fc = _fc(spec, "speculators")
    L = spec.num_layers
    for n, p in fc:
        if p.position is None:
            raise BadInput(f"cannot export to speculators: fc capture {n!r} is {p}, not a residual-stream state")
        if p == layer_out(L - 1):
            raise BadInput(
                f"cannot export to speculators: fc capture {n!r} is layer_out[{L - 1}], which is already the last slot"
            )
    positions = [p.position for _, p in fc if p.position is not None]  # all of them: checked just above
    if positions != sorted(set(positions)):
        raise BadInput(f"cannot export to speculators: fc_input [{', '.join(f'{n}={p}' for n, p in fc)}] is not in ascending "
                       "layer order; vLLM captures aux states in layer order, so the slots would be permuted")
    return fc


def _mask_note(layout: str, unit: Dump) -> str | None:
    if layout == "SpecForge":
        return "the dump's" if unit.loss_mask is not None else "ones (the dump has none)"
    return "the dump's is not kept (the layout has no loss mask)" if unit.loss_mask is not None else None


Need = tuple[Point, str, str]  # the point, what the layout uses it for, the key it lands at in the written file
Build = Callable[[Dump, list[torch.Tensor], Path], None]  # writes one unit's file at the path given


def _pick(unit: Dump | DumpHeader, label: str, spec, layout: str, needs: list[Need],
          stacked: slice) -> list[tuple[str, Any]]:
    """The unit's capture (name, tensor or shape) for each need, refused (one line) when one is
    missing or mislabelled, or when the ones ``stacked`` into one tensor differ in dtype."""
    found = _by_point(unit, label, spec, layout)
    picked = [_need(found, p, what, label, layout) for p, what, _ in needs]
    _same_dtype(_dtypes(unit, picked[stacked]), label, layout)
    return picked


def _export(dump_paths, out_dir: str | Path, spec, layout: str, needs: list[Need], stacked: slice,
            file_name: Callable[[int], str], build: Build, read: Reader | None) -> list[Path]:
    """Check every unit can fill the layout (metadata only where the format allows) before writing
    anything, then write each unit's file through ``build(dump, needed tensors, path)`` and last the
    manifest saying which point each written slot holds and where it came from, all staged and
    published together (:func:`_staged`). ``stacked``: the needs stacked into one tensor."""
    read = read or read_surgeon_dump
    paths = _expand(dump_paths)
    for path in paths:
        for unit in read(path, True):
            _pick(unit, _label(path, unit), spec, layout, needs, stacked)
    out = Path(out_dir)
    written: list[Path] = []
    files: list[dict] = []
    with _staged(out) as stage:
        for path in paths:
            for unit in read(path, False):
                assert isinstance(unit, Dump)  # a reader gives whole units when not asked for headers
                picked = _pick(unit, _label(path, unit), spec, layout, needs, stacked)
                name = file_name(len(written))
                build(unit, [t for _, t in picked], stage / name)
                written.append(out / name)
                files.append({"file": name, "sha256": _digest(stage / name), "source": str(path),
                              "record": unit.meta.get("record"),
                              "producer": unit.meta.get("producer") or f"surgeon dump ({unit.meta.get('engine') or '?'})",
                              "loss_mask": _mask_note(layout, unit),
                              "captures": [{"name": key, "point": str(p), "from": src}
                                           for (p, _, key), (src, _) in zip(needs, picked)]})
        manifest = {"surgeon.kind": "export", "surgeon.format": 1, "layout": layout,
                    "spec": {"name": spec.name, "sha256": getattr(spec, "sha256", None)}, "files": files}
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return written


def export_specforge(dump_paths, out_dir: str | Path, *, spec, read: Reader | None = None) -> list[Path]:
    """Write ``data_{i}.ckpt`` per dump unit; returns the paths written (in dump order)."""
    fc = check_specforge(spec)
    needs: list[Need] = [(FINAL_NORM, "SpecForge's hidden_state (after the final norm)", "hidden_state")]
    needs += [(p, f"fc input {n!r}", f"aux_hidden_state[{i}]") for i, (n, p) in enumerate(fc)]

    def build(dump: Dump, tensors: list[torch.Tensor], path: Path) -> None:
        final, aux = tensors[0], tensors[1:]
        ids = dump.input_ids.reshape(1, -1)
        torch.save({
            "input_ids": ids,
            "loss_mask": dump.loss_mask.reshape(1, -1) if dump.loss_mask is not None else torch.ones_like(ids),
            "aux_hidden_state": torch.cat(aux, dim=-1).unsqueeze(0),
            "hidden_state": final.unsqueeze(0),
        }, path)

    return _export(dump_paths, out_dir, spec, "SpecForge", needs, slice(1, None), lambda i: f"data_{i}.ckpt", build, read)


def export_speculators(dump_paths, out_dir: str | Path, *, spec, read: Reader | None = None) -> list[Path]:
    """Write ``hs_{i}.safetensors`` per dump unit; returns the paths written (in dump order)."""
    from safetensors.torch import save_file

    fc = check_speculators(spec)
    L = spec.num_layers
    needs: list[Need] = [(p, f"fc input {n!r}", f"hidden_states[:, {i}]") for i, (n, p) in enumerate(fc)]
    needs.append((layer_out(L - 1), f"speculators' last slot (layer_out[{L - 1}] before the final norm; "
                                    "final_norm is not a substitute)", f"hidden_states[:, {len(fc)}]"))

    def build(dump: Dump, slots: list[torch.Tensor], path: Path) -> None:
        save_file({"token_ids": dump.input_ids.reshape(-1).contiguous(),
                   "hidden_states": torch.stack(slots, dim=1).contiguous()}, str(path))

    return _export(dump_paths, out_dir, spec, "speculators", needs, slice(None), lambda i: f"hs_{i}.safetensors",
                   build, read)
