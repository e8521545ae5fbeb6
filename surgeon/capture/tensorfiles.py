"""The one gate every tensor file passes before anything reads it, and safetensors readers built
on it: dumps, subjects of ``match``/``verify``, references, fingerprints, SpecForge ``.ckpt`` and
speculators files all come through :func:`open_tensor_file`.

The gate (torch-free, so a bad file is refused before torch is even imported):

* the path names a *regular* file: a FIFO would block the reader forever, a device (``/dev/zero``)
  would feed it endless bytes, a directory is not a file; each is refused by name. The file is
  opened through :func:`surgeon.core.safefile.open_at` (``O_NONBLOCK``, then ``fstat``), so even a
  FIFO swapped in after the ``stat`` cannot block the gate itself;
* its header is sane before any tensor is read: a safetensors file's 8-byte header length fits
  the file and safetensors' 100 MB limit, the header is a JSON object whose entries have a
  dtype, non-negative integer dims and data offsets that lie inside the file and match the shape
  (a truncated file is refused here, not halfway through a read); a ``torch.save`` file starts
  with the zip magic (and holds a ``data.pkl``, its entries distinctly named, which every zip
  reader resolves alike, and decompresses to at most :data:`MAX_ZIP_RATIO` times its size: a zip
  bomb is refused before any reader inflates it) or a pickle protocol 2-5 opcode.

A reader that opens the file again after the gate (safetensors, torch's zip reader, ``torch.load``,
the audit's row reader) goes through :func:`reopen` or :func:`held`: opened again with
``O_NONBLOCK``, checked on the descriptor to be the very file the gate read (device and inode), so
a FIFO, a device or another file swapped in after the gate is refused, never waited on or read.

Everything else is :class:`BadInput` (exit 2), one line naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from surgeon.core.errors import BadInput, ReadFailure
from surgeon.core.safefile import Voice, open_at

if TYPE_CHECKING:
    import torch

SAFETENSORS, PICKLE, ZIP = "safetensors", "pickle", "zip"  # torch.save: legacy pickle, or zip (torch >= 1.6)
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on its JSON header
# a torch.save zip's entries, inflated, hold at most this many times the file's bytes (and 1 MiB in any case):
# torch writes them stored (1x), deflate of float data gains ~1.1x, of token ids a few x; a zip bomb, thousands
MAX_ZIP_RATIO = 100
_ZIP_FLOOR = 1 << 20
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
                "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}
# how the gate words what core.safefile.open_at refuses (the gate, then a reader opening the file again)
_GATE = Voice(refused=BadInput, failed=ReadFailure, what="", not_regular=", not a tensor file",
              cannot="cannot be read ({err})")
_AGAIN = dataclasses.replace(_GATE, not_regular=" since its header was read, not a tensor file")


@dataclass(frozen=True)
class TensorFile:
    """A file that passed the gate: its format and, for safetensors, its parsed header."""

    path: Path
    format: str  # SAFETENSORS, PICKLE or ZIP
    size: int
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)  # safetensors: name -> {dtype, shape, data_offsets}
    metadata: dict[str, str] = field(default_factory=dict)
    data_start: int = 0  # safetensors: the file offset its tensors' data_offsets count from
    records: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # zip: name -> (data offset, size, compression)
    ident: tuple[int, int] | None = None  # (device, inode) of the file the gate read: what a reader opens again

    @property
    def kind(self) -> str | None:
        """The ``surgeon.kind`` a safetensors file declares (reference, fingerprint, dump), else None."""
        return self.metadata.get("surgeon.kind")

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name]["shape"])


def open_tensor_file(path: str | Path, *, formats: tuple[str, ...] = (SAFETENSORS, PICKLE, ZIP)) -> TensorFile:
    """Check ``path`` is a regular file with a sane header of one of ``formats``; BadInput (one
    line naming the file) for anything else. Nothing but the header is read."""
    p = Path(path)
    try:
        fd, st = open_at(p, os.O_RDONLY, voice=_GATE)
    except FileNotFoundError:
        raise BadInput(f"{p}: no such file") from None
    with os.fdopen(fd, "rb") as f:
        gated = _sniff(p, f, st.st_size, formats)
    return dataclasses.replace(gated, ident=(st.st_dev, st.st_ino))


def reopen(path: str | Path, ident: tuple[int, int] | None) -> int:
    """A read-only descriptor on ``path`` opened again after the gate (through
    :func:`~surgeon.core.safefile.open_at`): never blocking on a FIFO, checked on the descriptor to
    be a regular file and, where ``ident`` is given, the file the gate read (its device and inode);
    BadInput (one line naming the file) for anything swapped in since, ReadFailure where the system
    cannot open it (gone since, or refused)."""
    p = Path(path)

    def same(st: os.stat_result) -> None:
        if ident is not None and (st.st_dev, st.st_ino) != tuple(ident):
            raise BadInput(f"{p}: replaced by another file since its header was read")

    try:
        return open_at(p, os.O_RDONLY, voice=_AGAIN, check=same)[0]
    except FileNotFoundError as e:
        raise ReadFailure(f"{p}: cannot be read ({e.strerror or e})") from None


_FD_DIRS = ("/proc/self/fd", "/dev/fd")  # a name that opens the file a descriptor holds (Linux, macOS)


@contextlib.contextmanager
def held(gated: TensorFile) -> Iterator[str]:
    """A name for a reader that wants one (safetensors, torch), naming the file the gate read,
    held open (:func:`reopen`) for the block: whatever is renamed over ``gated.path`` meanwhile, the
    name opens the descriptor's file. Where the system has no such name, the path itself, checked
    just before."""
    fd = reopen(gated.path, gated.ident)
    try:
        folder = next((d for d in _FD_DIRS if os.path.isdir(d)), None)
        yield f"{folder}/{fd}" if folder is not None else str(gated.path)
    finally:
        os.close(fd)


def _sniff(p: Path, f, size: int, formats: tuple[str, ...]) -> TensorFile:
    names = " or ".join(([SAFETENSORS] if SAFETENSORS in formats else [])
                        + (["torch.save"] if {PICKLE, ZIP} & set(formats) else []))

    def bad(why: str) -> BadInput:
        return BadInput(f"{p}: not a readable {names} file ({why})")

    if size == 0:
        raise bad("it is empty")
    head = f.read(9)
    # safetensors first: its header length can start with the pickle magic (0x380 bytes -> 80 03)
    if SAFETENSORS in formats and len(head) == 9 and head[8:9] == b"{":
        return _safetensors(p, f, size, int.from_bytes(head[:8], "little"), bad)
    if ZIP in formats and head[:4] == b"PK\x03\x04":
        return _zip(p, f, size, bad)
    if PICKLE in formats and head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        return TensorFile(p, PICKLE, size)
    raise bad(f"it starts with {head[:8].hex(' ')}")


def _safetensors(p: Path, f, size: int, n: int, bad) -> TensorFile:
    if n > size - 8:
        raise bad(f"its header declares {n} bytes but the file has {size - 8} after the length: truncated?")
    if n > MAX_HEADER_BYTES:
        raise bad(f"its header declares {n} bytes, over safetensors' limit of {MAX_HEADER_BYTES}")
    f.seek(8)
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"its header is not JSON: {str(e)[:120]}") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise bad("its __metadata__ is not a map of strings")
    data_bytes = size - 8 - n
    for name, entry in header.items():
        _check_entry(name, entry, data_bytes, bad)
    _check_tiling(header, data_bytes, bad)
    return TensorFile(p, SAFETENSORS, size, header, meta, 8 + n)


def _check_tiling(header: dict, data_bytes: int, bad) -> None:
    """The tensors, in the order of their offsets, tile the data section: from its first byte to the
    file's last, no gap, no overlap (what the safetensors library checks before it loads anything;
    bytes it would refuse are not read here as data: a tail left by a rewrite in place, overlapping
    tensors)."""
    at = 0
    for name, entry in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        start, end = entry["data_offsets"]
        if start != at:
            raise bad(f"tensor {name!r} starts at data byte {start}, the tensors before it end at {at}: "
                      + ("they overlap" if start < at else "a gap"))
        at = end
    if at != data_bytes:
        raise bad(f"its tensors end at data byte {at}, the file holds {data_bytes}: {data_bytes - at} bytes after them")


def _check_entry(name: str, entry: Any, data_bytes: int, bad) -> None:
    """One tensor's header entry: a dtype, non-negative integer dims, offsets inside the data that
    match the shape."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        raise bad(f"tensor {name!r} has no dtype")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise bad(f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise bad(f"tensor {name!r} has data offsets {offsets!r} outside the {data_bytes} data bytes: truncated?")
    width = _DTYPE_BYTES.get(entry["dtype"])
    if width is not None and offsets[1] - offsets[0] != math.prod(shape) * width:
        raise bad(f"tensor {name!r} is {entry['dtype']} {shape} but holds {offsets[1] - offsets[0]} bytes")


def _zip(p: Path, f, size: int, bad) -> TensorFile:
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise bad(f"a damaged zip: {str(e)[:120]}") from None
    _ambiguous(infos, bad)
    if not any(i.filename == "data.pkl" or i.filename.endswith("/data.pkl") for i in infos):
        raise bad("a zip without the data.pkl of torch.save")
    if any(i.header_offset + i.compress_size > size for i in infos):
        raise bad("a zip whose entries run past its end: truncated?")
    _bounded(infos, size, bad)
    return TensorFile(p, ZIP, size, records=_records(f, infos, size, bad))


def _ambiguous(infos: list, bad) -> None:
    """Refuse entry names that readers resolve differently: torch's reader (miniz) takes the first
    entry whose raw name matches with ASCII case folded, Python's zipfile the last of a name, cut at
    a NUL, decoded as cp437 unless flagged UTF-8 (an archive folder named after a file, as torch
    <= 2.0 wrote it, may be non-ASCII). Names whose bytes are distinct with ASCII case folded, without
    a NUL, in a zip that starts with its first entry, are read alike by both; a zip that holds two
    versions of a record, or two zips joined (Python's zipfile reads the last, torch's the first),
    has bytes that depend on the tool that reads it."""
    if infos and min(i.header_offset for i in infos) != 0:
        raise bad("bytes before its first entry (two zips joined?): zip readers disagree on which one is read")
    seen: dict[bytes, str] = {}
    for i in infos:
        name = i.orig_filename
        if "\0" in name:
            raise bad(f"entry name {name!r} holds a NUL: zip readers disagree on it")
        # the name's own bytes (zipfile decoded an unflagged name as cp437, one character a byte)
        key = name.encode("utf-8" if i.flag_bits & 0x800 else "cp437").lower()  # bytes.lower: ASCII, as miniz folds
        if key in seen:
            other = seen[key]
            raise bad(f"two entries named {name!r}" + ("" if other == name else f" and {other!r}")
                      + ": zip readers disagree on which one is read")
        seen[key] = name


def _bounded(infos: list, size: int, bad) -> None:
    """Refuse a zip whose entries inflate beyond :data:`MAX_ZIP_RATIO` times the file (a zip bomb:
    torch's reader allocates and inflates a record whole, by the size its directory declares), or
    a stored entry whose two sizes disagree, before any reader inflates anything."""
    for i in infos:
        if i.compress_type == zipfile.ZIP_STORED and i.file_size != i.compress_size:
            raise bad(f"a stored zip entry {i.filename!r} of {i.compress_size} bytes declares {i.file_size} once read")
    total = sum(i.file_size for i in infos)
    if total > max(MAX_ZIP_RATIO * size, _ZIP_FLOOR):
        big = max(infos, key=lambda i: i.file_size)
        raise bad(f"a zip of {size} bytes whose entries inflate to {total} ({big.filename!r}: {big.compress_size} -> "
                  f"{big.file_size}), over {MAX_ZIP_RATIO} times its size: a zip bomb?")


def _records(f, infos: list, size: int, bad) -> dict[str, tuple[int, int, int]]:
    """Each entry's (data offset, size, compression) from its local header (the central
    directory does not say where the data starts: the local header's name and extra fields do)."""
    out = {}
    for i in infos:
        f.seek(i.header_offset)
        head = f.read(30)
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise bad(f"a damaged zip: entry {i.filename!r} has no local header")
        start = i.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
        if start + i.compress_size > size:
            raise bad(f"a zip whose entry {i.filename!r} runs past its end: truncated?")
        out[i.filename] = (start, i.file_size, i.compress_type)
    return out


def unreadable(path: str | Path, error: BaseException) -> BadInput:
    """The one-line BadInput for a file safetensors cannot read (its errors span several lines)."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return BadInput(f"{path}: not a readable safetensors file ({first})")


def gated_safetensors(path: str | Path | TensorFile) -> TensorFile:
    """``path`` through the gate as a safetensors file (a file that already passed it as one, as is)."""
    if isinstance(path, TensorFile) and path.format == SAFETENSORS:
        return path
    return open_tensor_file(path.path if isinstance(path, TensorFile) else path, formats=(SAFETENSORS,))


def read_safetensors(path: str | Path | TensorFile) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor and the string metadata of a safetensors file (through the gate)."""
    from safetensors import safe_open

    gated = gated_safetensors(path)
    with held(gated) as name:
        try:
            with safe_open(name, framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
        except Exception as e:  # SafetensorError and friends
            raise unreadable(gated.path, e) from None

