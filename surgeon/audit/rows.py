"""Where each slot's rows lie in a training file, and a reader of them in chunks.

A file's slots sit in one or more *regions*: runs of ``T`` dense rows, each row the ``H`` values of
one or more slots side by side (a speculators ``hidden_states`` ``[T, n, H]``, a SpecForge
``aux_hidden_state`` ``[T, k*H]`` and its ``hidden_state`` ``[T, H]``, or one ``[T, H]`` tensor of a
surgeon dump per capture). The headers give their byte offsets: the safetensors header, or the
pickle of a ``torch.save`` zip loaded onto the meta device (each storage's record offset, checked
against the zip; nothing read).

:func:`chunks` reads each region into one reused buffer a few MB long, and the value pass computes
on each chunk while it is in the CPU's cache: one copy of every byte, as a plain read makes. A
memory map of the file (what the audit used before) was measured both ways, depending on the page
cache, not the file (``benchmarks/audit.py``, Linux 6.18, ext4): ~20% slower on files just written
(their cached pages map a few KB a page fault, and unmapping costs as much), 5-9% faster on files
the kernel read ahead into large folios, and slower from disk. It is not used: a file that shrinks
while mapped (rewritten in place, another NFS client) kills the process with SIGBUS, where a read
gets a short count, which is bad input in one line (:func:`_read_at`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

CHUNK_BYTES = 4 << 20  # bytes a read: a few MB stays in the cache for the pass that follows (measured: 2-8 MB best)

# the dtypes a slot may have, by their safetensors and torch names
FLOATS = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
INTS = {"I64": "int64", "I32": "int32", "I16": "int16", "U8": "uint8", "I8": "int8"}


@dataclass(frozen=True)
class Region:
    """``rows`` dense rows from ``offset`` in the file, each the ``hidden`` values of ``slots``
    (indices into the file's slots) side by side, in ``dtype`` (a torch dtype's name)."""

    offset: int
    rows: int
    slots: tuple[int, ...]
    hidden: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]

    @property
    def row_bytes(self) -> int:
        return len(self.slots) * self.hidden * self.itemsize


@dataclass(frozen=True)
class RowPlan:
    """Where a file's slots and token ids lie: every slot in exactly one region, one T, H and dtype
    across them (what :func:`plan` checks); ``ids``: (offset, count, dtype name) or None."""

    path: str
    regions: tuple[Region, ...]
    ids: tuple[int, int, str] | None
    ident: tuple[int, int] | None = None  # (device, inode) of the file whose header gave the plan: the one read

    @property
    def slots(self) -> int:
        return sum(len(r.slots) for r in self.regions)

    @property
    def tokens(self) -> int:
        return self.regions[0].rows

    @property
    def hidden(self) -> int:
        return self.regions[0].hidden

    @property
    def dtype(self) -> str:
        return self.regions[0].dtype


def plan(path: str, regions: list[Region], ids: tuple[int, int, str] | None, size: int,
         ident: tuple[int, int] | None = None) -> RowPlan | None:
    """A :class:`RowPlan` where the regions cover slots 0..S-1 once, each a consecutive run, with
    one T >= 1, H >= 1 and
    dtype, T ids (where there are ids), and every byte inside the file (``size``); None otherwise (the caller reads the
    file's tensors instead, and their checks say what is wrong)."""
    if not regions or not all(r.slots for r in regions):
        return None
    covered = sorted(s for r in regions for s in r.slots)
    if covered != list(range(len(covered))) or len({(r.rows, r.hidden, r.dtype) for r in regions}) != 1:
        return None
    if any(list(r.slots) != list(range(r.slots[0], r.slots[0] + len(r.slots))) for r in regions if r.slots):
        return None  # a region's slots are consecutive (laid out as one block of the file's slots)
    if regions[0].rows < 1 or regions[0].hidden < 1:
        return None
    if any(r.offset < 0 or r.offset + r.rows * r.row_bytes > size for r in regions):
        return None
    if ids is not None and (ids[1] != regions[0].rows or ids[0] < 0 or ids[0] + ids[1] * _int_size(ids[2]) > size):
        return None
    return RowPlan(path, tuple(regions), ids, ident)


def _int_size(name: str) -> int:
    return {"int64": 8, "int32": 4, "int16": 2, "uint8": 1, "int8": 1}[name]


_BUFFER: list[Any] = []  # this process's read buffer (uint8 torch, CHUNK_BYTES), reused across files


def _buffer(nbytes: int):
    """A buffer of at least ``nbytes``: this process's own, or, for a row wider than it, one of its
    own for that file (not kept: one odd file does not hold its memory for the rest of the run)."""
    import torch

    if nbytes > CHUNK_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    if not _BUFFER:
        _BUFFER.append(torch.empty(CHUNK_BYTES, dtype=torch.uint8))
    return _BUFFER[0]


def _open(rp: RowPlan):
    """The plan's file opened unbuffered, never blocking: a file gone since its header was read, or
    a FIFO, device or other file swapped in at its path, is BadInput
    (:func:`surgeon.capture.tensorfiles.reopen`)."""
    import os

    from surgeon.capture.tensorfiles import reopen

    return os.fdopen(reopen(rp.path, rp.ident), "rb", buffering=0)


def _read_at(f, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from ``offset`` of the open (unbuffered) file ``f``; a short read, of a file cut
    short since its header was read, or a read error is BadInput."""
    from surgeon.core.errors import BadInput, ReadFailure

    got = 0
    try:
        f.seek(offset)
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise BadInput(f"{path}: ends at byte {offset + got}, its header says {offset + len(view)}: truncated?")
            got += n
    except OSError as e:
        raise ReadFailure(f"{path}: cannot be read at byte {offset + got} ({e.strerror or e})") from None


def chunks(rp: RowPlan, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[Region, int, Any]]:
    """(region, first row, ``[n, len(region.slots), H]`` torch view) for consecutive runs of rows,
    each region in turn. The view is of a buffer the next chunk overwrites: copy what you keep."""
    import torch

    buf = _buffer(max(chunk_bytes, max(r.row_bytes for r in rp.regions)))
    mv = memoryview(buf.numpy())
    with _open(rp) as f:
        for reg in rp.regions:
            per = max(1, chunk_bytes // reg.row_bytes)
            for r0 in range(0, reg.rows, per):
                n = min(per, reg.rows - r0)
                nbytes = n * reg.row_bytes
                _read_at(f, mv[:nbytes], reg.offset + r0 * reg.row_bytes, rp.path)
                yield reg, r0, buf[:nbytes].view(getattr(torch, reg.dtype)).view(n, len(reg.slots), reg.hidden)


def rows_of(rp: RowPlan, slot: int, idx) -> Any:
    """``[len(idx), H]`` torch (a copy): the rows ``idx`` (ascending ints) of slot ``slot``, read
    a run of consecutive rows at a time, at most :data:`CHUNK_BYTES` a read (for the few rows a
    check looks at again; a slot bad throughout is read a chunk at a time)."""
    import torch

    reg = next(r for r in rp.regions if slot in r.slots)
    j = reg.slots.index(slot)
    idx = [int(i) for i in idx]
    out = torch.empty(len(idx), reg.hidden, dtype=getattr(torch, reg.dtype))
    most = max(1, CHUNK_BYTES // reg.row_bytes)
    with _open(rp) as f:
        at = 0
        while at < len(idx):
            end = at + 1
            while end < len(idx) and end - at < most and idx[end] == idx[end - 1] + 1:
                end += 1
            span = torch.empty((end - at) * reg.row_bytes, dtype=torch.uint8)
            _read_at(f, memoryview(span.numpy()), reg.offset + idx[at] * reg.row_bytes, rp.path)
            out[at:end] = span.view(out.dtype).view(end - at, len(reg.slots), reg.hidden)[:, j]
            at = end
    return out


def read_ids(rp: RowPlan) -> Any:
    """The token ids (flat int64 torch), or None where the file has none."""
    import torch

    if rp.ids is None:
        return None
    off, n, name = rp.ids
    raw = torch.empty(n * _int_size(name), dtype=torch.uint8)
    with _open(rp) as f:
        _read_at(f, memoryview(raw.numpy()), off, rp.path)
    return raw.view(getattr(torch, name)).to(torch.int64)
