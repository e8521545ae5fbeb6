"""Exporters: surgeon dumps to the training tools' own layouts, refused where they would lie.

* :func:`export_specforge`: SpecForge offline ``.ckpt`` (``torch.save`` dicts): ``input_ids``
  [1, T], ``loss_mask`` [1, T] (ones), ``aux_hidden_state`` [1, T, nH] = the spec's ``fc_input``
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
named like a spec capture but declaring another point is refused as mislabelled. Values are
kept exactly: no dtype change, no arithmetic. Every refusal is :class:`BadInput`, one line.
Files are written to a temporary name and renamed.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from surgeon.capture.dumps import Dump, DumpHeader, read_dump, read_dump_header
from surgeon.core.conventions import EAGLE, NotExpressible
from surgeon.core.errors import BadInput
from surgeon.core.points import FINAL_NORM, Point, layer_out


def _expand(dump_paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """Dump files in order; a directory stands for its shards in write order."""
    from surgeon.capture.dumpwriter import list_shards

    if isinstance(dump_paths, (str, Path)):
        dump_paths = [dump_paths]
    out: list[Path] = []
    for p in map(Path, dump_paths):
        if p.is_dir():
            shards = list_shards(p)
            if not shards:
                raise BadInput(f"{p}: no shard-*.safetensors dump shards in this directory")
            out.extend(shards)
        else:
            out.append(p)
    if not out:
        raise BadInput("no dumps to export")
    return out


def _atomic(path: Path, write: Callable[[str], None]) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _fc(spec, layout: str) -> list[tuple[str, Point]]:
    if not spec.fc_names:
        raise BadInput(f"cannot export to {layout}: spec {spec.name} has no draft.fc_input to say which captures are aux inputs")
    return [(n, spec.captures[n]) for n in spec.fc_names]


def _by_point(dump: Dump | DumpHeader, path: Path, spec, layout: str) -> dict[Point, Any]:
    if dump.num_layers != spec.num_layers:
        raise BadInput(f"{path}: dump is of a {dump.num_layers}-layer target, spec {spec.name} of {spec.num_layers}")
    if dump.hidden_size != spec.hidden_size:
        raise BadInput(f"{path}: dump hidden size {dump.hidden_size}, spec {spec.name} says {spec.hidden_size}")
    found: dict[Point, Any] = {}  # tensors, or shapes for a header
    for name, point, t in dump.captures:
        want = spec.captures.get(name)
        if want is not None and want != point:
            raise BadInput(
                f"cannot export {path} to {layout}: capture {name!r} is {point} in the dump but {want} in spec {spec.name}"
            )
        found[point] = t
    return found


def _need(found: dict[Point, torch.Tensor], point: Point, what: str, path: Path, layout: str) -> torch.Tensor:
    t = found.get(point)
    if t is None:
        have = ", ".join(map(str, found)) or "nothing"
        raise BadInput(f"cannot export {path} to {layout}: no {point} capture for {what} (the dump holds {have})")
    return t


def _same_dtype(tensors: Sequence[torch.Tensor], path: Path, layout: str) -> None:
    dtypes = {str(t.dtype).replace("torch.", "") for t in tensors}
    if len(dtypes) > 1:
        raise BadInput(f"cannot export {path} to {layout}: captures differ in dtype ({', '.join(sorted(dtypes))}); "
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


def _export(dump_paths, out_dir: str | Path, spec, layout: str, needs: list[tuple[Point, str]],
            build: Callable[[int, Dump, list[torch.Tensor], Path, Path], Path]) -> list[Path]:
    """Check every shard can fill the layout (metadata only) before writing any file, then write
    each through ``build(index, dump, needed tensors, out_dir, path)``."""
    paths = _expand(dump_paths)
    for path in paths:
        found = _by_point(read_dump_header(path), path, spec, layout)
        for point, what in needs:
            _need(found, point, what, path, layout)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i, path in enumerate(paths):
        dump = read_dump(path)
        found = _by_point(dump, path, spec, layout)
        written.append(build(i, dump, [_need(found, p, what, path, layout) for p, what in needs], out, path))
    return written


def export_specforge(dump_paths, out_dir: str | Path, *, spec) -> list[Path]:
    """Write ``data_{i}.ckpt`` per dump shard; returns the paths written (in dump order)."""
    fc = check_specforge(spec)
    needs = [(FINAL_NORM, "SpecForge's hidden_state (after the final norm)")] + [(p, f"fc input {n!r}") for n, p in fc]

    def build(i: int, dump: Dump, tensors: list[torch.Tensor], out: Path, path: Path) -> Path:
        final, aux = tensors[0], tensors[1:]
        _same_dtype(aux, path, "SpecForge")
        ids = dump.input_ids.reshape(1, -1)
        data = {
            "input_ids": ids,
            "loss_mask": torch.ones_like(ids),
            "aux_hidden_state": torch.cat(aux, dim=-1).unsqueeze(0),
            "hidden_state": final.unsqueeze(0),
        }
        return _atomic(out / f"data_{i}.ckpt", lambda tmp: torch.save(data, tmp))

    return _export(dump_paths, out_dir, spec, "SpecForge", needs, build)


def export_speculators(dump_paths, out_dir: str | Path, *, spec) -> list[Path]:
    """Write ``hs_{i}.safetensors`` per dump shard; returns the paths written (in dump order)."""
    from safetensors.torch import save_file

    fc = check_speculators(spec)
    L = spec.num_layers
    needs = [(p, f"fc input {n!r}") for n, p in fc] + [
        (layer_out(L - 1), f"speculators' last slot (layer_out[{L - 1}] before the final norm; final_norm is not a substitute)")]

    def build(i: int, dump: Dump, slots: list[torch.Tensor], out: Path, path: Path) -> Path:
        _same_dtype(slots, path, "speculators")
        tensors = {"token_ids": dump.input_ids.reshape(-1).contiguous(),
                   "hidden_states": torch.stack(slots, dim=1).contiguous()}
        return _atomic(out / f"hs_{i}.safetensors", lambda tmp: save_file(tensors, tmp))

    return _export(dump_paths, out_dir, spec, "speculators", needs, build)
