"""surgeon dumps: self-describing safetensors files of captured hidden states.

A dump says what it is: per tensor the capture name and its physical point, plus the spec's name
and sha256, the engine and its version, the model, dtype, token count and the input ids, so no
later script can relabel it by position. Metadata (all strings, as safetensors requires):

===================  =========================================================================
``surgeon.kind``     ``"dump"``
``surgeon.format``   ``"1"``
``captures``         JSON list of ``{"name", "point"}`` in slot order; tensor ``name`` is [T, H]
``spec.name``        the spec's name, and ``spec.sha256`` its file's sha256 ("" without a spec)
``engine``           engine name and ``engine.version`` ("hf", "vllm", ...)
``model``            model path or id; ``num_layers`` and ``hidden_size`` of the target
``dtype``            dtype of the captures; ``tokens`` the token count
===================  =========================================================================

``input_ids`` is stored as an int64 tensor. Files are written to a temporary name and renamed when
complete, so a reader never sees half a dump. The CUDA-graph-safe capture hooks and their
asynchronous writer produce these files; this module is the format, its writer and its reader.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from surgeon.capture.tensorfiles import TensorFile, gated_safetensors, held, unreadable
from surgeon.core.atomicfile import atomic_writer
from surgeon.core.errors import BadInput, SurgeonError
from surgeon.core.points import Point, PointError, parse_point

if TYPE_CHECKING:
    import torch

FORMAT = "1"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class Dump:
    captures: list[tuple[str, Point, torch.Tensor]]
    input_ids: torch.Tensor
    meta: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, list[int]] = field(default_factory=dict)  # tensor shapes, also when not loaded
    loss_mask: torch.Tensor | None = None  # a field dump's own (Model Optimizer); a surgeon dump has none

    @property
    def num_layers(self) -> int:
        return int(self.meta["num_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.meta["hidden_size"])


def write_dump(path: str | Path, captures: Sequence[tuple[str, Point, torch.Tensor]], *, input_ids: torch.Tensor,
               num_layers: int, spec=None, engine: str = "", engine_version: str = "", model: str = "") -> Path:
    """Write one dump shard atomically. ``captures``: (name, point, [T, H] tensor) in slot order."""
    import torch
    from safetensors.torch import save_file

    if not captures:
        raise ValueError("a dump holds at least one capture")
    ids = torch.as_tensor(input_ids).reshape(-1).to(torch.int64).contiguous()
    T = ids.numel()
    tensors: dict[str, torch.Tensor] = {"input_ids": ids}
    listed = []
    dtypes = set()
    H = None
    for name, point, t in captures:
        if not _NAME.fullmatch(name) or name == "input_ids" or name in tensors:
            raise ValueError(f"capture name {name!r} must be a unique identifier other than input_ids")
        if t.dim() != 2 or t.shape[0] != T or (H is not None and t.shape[1] != H):
            raise ValueError(f"capture {name!r} has shape {tuple(t.shape)}, expected [{T}, {H or 'H'}]")
        H = t.shape[1]
        tensors[name] = t.detach().to("cpu").contiguous()
        dtypes.add(str(t.dtype).replace("torch.", ""))
        listed.append({"name": name, "point": str(point)})
    meta = {
        "surgeon.kind": "dump", "surgeon.format": FORMAT, "captures": json.dumps(listed),
        "spec.name": spec.name if spec is not None else "", "spec.sha256": spec.sha256 if spec is not None else "",
        "engine": engine, "engine.version": engine_version, "model": model,
        "num_layers": str(num_layers), "hidden_size": str(H), "dtype": ",".join(sorted(dtypes)), "tokens": str(T),
    }
    out = Path(path)
    with atomic_writer(out) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return out


@dataclass
class DumpHeader:
    """What a dump declares, read from its header alone (no tensor loaded, no torch needed)."""

    path: Path
    captures: list[tuple[str, Point, list[int]]]  # name, point, shape [T, H], in slot order
    meta: dict[str, str]
    num_layers: int
    hidden_size: int
    tokens: int
    gated: TensorFile | None = None  # the gate's read of the file, which the tensor read reopens


def read_dump_header(path: str | Path | TensorFile) -> DumpHeader:
    """The declared captures of a dump, checked against its tensors' shapes (each [T, H], T >= 1
    tokens, H the declared hidden size); anything malformed or degenerate is BadInput, one line."""
    gated = gated_safetensors(path)
    p, meta = gated.path, gated.metadata
    if meta.get("surgeon.kind") != "dump":
        raise BadInput(f"{p}: not a surgeon dump (surgeon.kind is {meta.get('surgeon.kind')!r})")
    if meta.get("surgeon.format") != FORMAT:
        raise BadInput(f"{p}: dump format {meta.get('surgeon.format')!r}; this surgeon reads format {FORMAT}")
    try:
        listed = json.loads(meta["captures"])
        L, H = int(meta["num_layers"]), int(meta["hidden_size"])
        if not (isinstance(listed, list) and all(isinstance(c, dict) for c in listed) and L >= 1 and H >= 1):
            raise ValueError
    except (KeyError, ValueError):
        raise BadInput(f"{p}: dump metadata 'captures'/'num_layers'/'hidden_size' is malformed") from None
    if "input_ids" not in gated.tensors:
        raise BadInput(f"{p}: dump has no input_ids tensor")
    ids_shape = gated.shape("input_ids")
    if len(ids_shape) != 1 or ids_shape[0] < 1:
        raise BadInput(f"{p}: dump input_ids has shape {ids_shape}: a dump holds at least one token")
    T = ids_shape[0]
    if not listed:
        raise BadInput(f"{p}: dump lists no captures")
    captures = []
    for c in listed:
        name, text = c.get("name"), c.get("point")
        if not isinstance(name, str) or name not in gated.tensors or name == "input_ids":
            raise BadInput(f"{p}: capture {name!r} is listed but has no tensor")
        try:
            point = parse_point(text, L)
        except PointError as e:
            raise BadInput(f"{p}: capture {name!r}: {e.message}") from None
        shape = gated.shape(name)
        if shape != [T, H]:
            raise BadInput(f"{p}: capture {name!r} has shape {shape}, expected [{T}, {H}] ({T} tokens, hidden size {H})")
        captures.append((name, point, shape))
    return DumpHeader(p, captures, meta, L, H, T, gated)


def read_dump(path: str | Path | TensorFile) -> Dump:
    """Read a dump: its header checked first (:func:`read_dump_header`), then its tensors."""
    from safetensors import safe_open

    head = read_dump_header(path)
    try:
        with held(head.gated) if head.gated is not None else contextlib.nullcontext(str(head.path)) as fname, \
                safe_open(fname, framework="pt") as f:
            ids = f.get_tensor("input_ids")
            captures = [(name, point, f.get_tensor(name)) for name, point, _ in head.captures]
    except SurgeonError:
        raise
    except Exception as e:
        raise unreadable(head.path, e) from None
    return Dump(captures, ids, head.meta, {name: shape for name, _, shape in head.captures})
