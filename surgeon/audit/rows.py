"""Where each slot's rows lie in a training file, and two readers of them.

A file's slots sit in one or more *regions*: runs of ``T`` dense rows, each row the ``H`` values of
one or more slots side by side (a speculators ``hidden_states`` ``[T, n, H]``, a SpecForge
``aux_hidden_state`` ``[T, k*H]`` and its ``hidden_state`` ``[T, H]``, or one ``[T, H]`` tensor of a
surgeon dump per capture). The headers give their byte offsets: the safetensors header, or the
pickle of a ``torch.save`` zip loaded onto the meta device (each storage's record offset, checked
against the zip; nothing read).

Two ways to read them give the same bytes at different costs, and which is cheaper depends on the
page cache, not on the file (measured, ``benchmarks/audit.py`` and Linux 6.18 on ext4):

* :func:`chunks` reads each region into one reused buffer a few MB long, and the value pass
  computes on each chunk while it is in the CPU's cache: one copy of every byte, as a plain read
  makes. Faster for files just written (their cached pages map a few KB a page fault: 19% here)
  and for files coming from disk (large sequential reads; a map faults its way through).
* :func:`mapped` maps the file (copy-on-write, never written) and hands out each region whole: no
  copy, a page fault per mapped folio. Faster for files the kernel read ahead into large folios
  (9% here).

:class:`ReadChooser` times both on a few files of the run now and then and uses the faster.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

CHUNK_BYTES = 4 << 20  # bytes a read: a few MB stays in the cache for the pass that follows (measured: 2-8 MB best)

# the dtypes a slot may have, by their safetensors and torch names
FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
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


def plan(path: str, regions: list[Region], ids: tuple[int, int, str] | None, size: int) -> RowPlan | None:
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
    return RowPlan(path, tuple(regions), ids)


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


def _read_at(f, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from ``offset`` of the open (unbuffered) file ``f``; a short read, of a file cut
    short since its header was read, is BadInput."""
    from surgeon.core.errors import BadInput

    f.seek(offset)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise BadInput(f"{path}: ends at byte {offset + got}, its header says {offset + len(view)}: truncated?")
        got += n


def chunks(rp: RowPlan, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[Region, int, Any]]:
    """(region, first row, ``[n, len(region.slots), H]`` torch view) for consecutive runs of rows,
    each region in turn. The view is of a buffer the next chunk overwrites: copy what you keep."""
    import torch

    buf = _buffer(max(chunk_bytes, max(r.row_bytes for r in rp.regions)))
    mv = memoryview(buf.numpy())
    with open(rp.path, "rb", buffering=0) as f:
        for reg in rp.regions:
            per = max(1, chunk_bytes // reg.row_bytes)
            for r0 in range(0, reg.rows, per):
                n = min(per, reg.rows - r0)
                nbytes = n * reg.row_bytes
                _read_at(f, mv[:nbytes], reg.offset + r0 * reg.row_bytes, rp.path)
                yield reg, r0, buf[:nbytes].view(getattr(torch, reg.dtype)).view(n, len(reg.slots), reg.hidden)


def mapped(rp: RowPlan) -> Iterator[tuple[Region, int, Any]]:
    """(region, 0, ``[T, len(region.slots), H]`` torch view) of each region whole, from a
    copy-on-write map of the file (nothing is written to it). The views die with the map: copy what
    you keep. A file shorter than its header says (cut since it was read) is BadInput, before any
    access past its end could fault."""
    import mmap

    import torch

    from surgeon.core.errors import BadInput

    end = max(r.offset + r.rows * r.row_bytes for r in rp.regions)
    with open(rp.path, "rb") as f:
        try:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise BadInput(f"{rp.path}: cannot be mapped ({e})") from None
    if (size := len(m)) < end:
        m.close()
        raise BadInput(f"{rp.path}: ends at byte {size}, its header says {end}: truncated?")
    t = torch.frombuffer(m, dtype=torch.uint8)
    try:
        for reg in rp.regions:
            x = t[reg.offset:reg.offset + reg.rows * reg.row_bytes]
            yield reg, 0, x.view(getattr(torch, reg.dtype)).view(reg.rows, len(reg.slots), reg.hidden)
    finally:
        del t
        try:
            m.close()
        except BufferError:  # the caller still holds a view: the map goes when it does
            pass


def mappable(rp: RowPlan) -> bool:
    """Whether :func:`mapped` can view every region in its dtype (each starts at a multiple of its
    item size; safetensors does not promise that)."""
    return all(r.offset % r.itemsize == 0 for r in rp.regions)


class ReadChooser:
    """Which read (:func:`chunks`: ``"read"``, :func:`mapped`: ``"map"``) is faster in this process
    now: every ``SPAN`` files it times :data:`PROBE` files each way (alternating, the gather's whole
    time per byte: a map's cost shows as page faults in the pass over the rows) and keeps the
    faster. Both give the same bytes, so only the speed depends on the choice."""

    PROBE = 3
    SPAN = 200

    def __init__(self) -> None:
        self.choice = "read"
        self._seen = 0
        self._cost: dict[str, list[float]] = {"read": [0.0, 0.0], "map": [0.0, 0.0]}

    def pick(self) -> str:
        k = self._seen % (2 * self.PROBE + self.SPAN)
        return ("read", "map")[k % 2] if k < 2 * self.PROBE else self.choice

    def record(self, how: str, nbytes: int, seconds: float) -> None:
        k = self._seen % (2 * self.PROBE + self.SPAN)
        self._seen += 1
        if k >= 2 * self.PROBE:
            return
        cost = self._cost[how]
        cost[0] += seconds
        cost[1] += nbytes
        if k == 2 * self.PROBE - 1:
            rate = {h: b / s if s > 0 else 0.0 for h, (s, b) in self._cost.items()}
            self.choice = max(rate, key=lambda h: rate[h])
            self._cost = {"read": [0.0, 0.0], "map": [0.0, 0.0]}


READS = ReadChooser()  # this process's (a pool worker or a Ray task's process)


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
    with open(rp.path, "rb", buffering=0) as f:
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
    with open(rp.path, "rb", buffering=0) as f:
        _read_at(f, memoryview(raw.numpy()), off, rp.path)
    return raw.view(getattr(torch, name)).to(torch.int64)
