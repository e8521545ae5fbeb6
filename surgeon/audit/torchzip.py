"""A ``torch.save`` zip as ``torch.load`` reads it, for the structure pass: its records through
torch's own zip reader, and its tensors as meta tensors from its ``data.pkl`` alone, what
``torch.load(map_location="meta", weights_only=True)`` gives, without that loader's per-file cost.

``torch.load``'s weights-only unpickler is written in Python: about 0.3 ms a file alone, and more
than a millisecond a file measured inside an audit, where the 25 MB read before each file has
evicted it from the CPU's caches (``benchmarks/audit.py``; a third of the audit's time besides the
read and the norms). :meth:`TorchZip.meta_load` runs the C unpickler instead, on a pickle it has
checked first, so that it builds only what the weights-only loader would build, the same way:

* every opcode is one of those ``torch.save`` writes for a dict of plain tensors, numbers,
  strings and lists (:data:`OPCODES`, a subset of the weights-only loader's): no ``BUILD``,
  ``NEWOBJ``, ``INST``/``OBJ`` or extension codes, nothing that sets an attribute of an object;
  and items are set on dicts and appended to lists only (:func:`_plain` follows the stack);
* :meth:`_HeadUnpickler.find_class` resolves exactly the globals ``torch.save`` writes for plain
  tensors (``torch._utils._rebuild_tensor_v2``, ``collections.OrderedDict`` called without
  arguments for their empty hook dicts, the typed storage classes of the float and integer
  dtypes) to stand-ins of this module, fresh for each call, and refuses every other name: no
  function of the file's choosing ever runs (the "restricting globals" pattern of the
  :mod:`pickle` documentation);
* :meth:`_HeadUnpickler.persistent_load` takes only torch's ``("storage", type, key, location,
  numel)`` ids with a key of decimal digits, one size and one dtype a key, and makes an empty meta
  storage of that size, its ``_checkpoint_offset`` the data offset of the record ``data/<key>``
  as torch's own zip reader finds it (``torch.load`` on the meta device computes it from the
  layout of torch's writer, wrong for a zip another tool rewrote; on the CPU it reads that record).

Every record (``data.pkl``, ``byteorder``, ``data/<key>``) is looked up by torch's reader, never by
Python's :mod:`zipfile`: the two disagree on a zip with two entries of one name, names that differ
in case, or a NUL in a name, and the audit must read the bytes training will load. Whatever this
module does not take (a pickle over :data:`MAX_PICKLE_BYTES`, another opcode or global, a top level
that is no dict of str keys, a stand-in left in the result, a TorchScript archive) makes
:meth:`TorchZip.meta_load` return None, and the caller uses ``torch.load(..., weights_only=True)``,
whose verdict then stands; so does a zip that fails a check ``torch.load`` makes of its records
before it unpickles (:meth:`TorchZip._checked`). Two differences from ``torch.load`` on the meta
device are kept, both where its CPU load, what training runs, agrees with this module: tensors
that share a storage in the file share one meta storage here (it gives each its own; every dtype,
shape, stride, offset, storage size and record offset is the same), and a zip of torch's format
1 whose first storage key is not ``0`` is read (its meta path asserts that key, its CPU path does
not).
"""

from __future__ import annotations

import functools
import io
import pickle
import pickletools
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from surgeon.capture.tensorfiles import TensorFile

MAX_PICKLE_BYTES = 1 << 20  # a sample's data.pkl is a few hundred bytes; more is left to torch.load

MAX_WALK = 100_000  # values of the result looked through for a stand-in; more is left to torch.load

# torch's typed storage classes (``torch.<Name>Storage``) and the dtype each holds
_STORAGES = {"BFloat16Storage": "bfloat16", "HalfStorage": "float16", "FloatStorage": "float32",
             "DoubleStorage": "float64", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
             "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool"}


class _Refused(Exception):
    """The pickle holds something this module does not build: left to ``torch.load``."""


class _StandIn:
    """What :meth:`_HeadUnpickler.find_class` hands the pickle: an object of this module, made for
    that one reference, that refuses to be given state."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise _Refused("state set on a stand-in")


class _StorageType(_StandIn):
    """A ``torch.<Name>Storage`` global: only its dtype is used; called, it refuses."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _Refused("a storage class called")


class _Storage(_StandIn):
    """A storage the pickle names: an empty meta storage, its dtype and its element count."""

    __slots__ = ("dtype", "numel", "untyped")

    def __init__(self, dtype: Any, numel: int, untyped: Any) -> None:
        self.dtype, self.numel, self.untyped = dtype, numel, untyped


class _EmptyOrderedDict(_StandIn):
    """``collections.OrderedDict``, called as ``torch.save`` writes it for a tensor's hooks: with no
    arguments (anything else, an iterable of the file's choosing, is refused)."""

    __slots__ = ()

    def __call__(self) -> Any:
        return OrderedDict()


class _RebuildTensor(_StandIn):
    """``torch._utils._rebuild_tensor_v2`` of a plain tensor, on the meta device: a view of the
    storage, nothing allocated, nothing read."""

    __slots__ = ()

    def __call__(self, storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                 backward_hooks: Any, metadata: Any = None) -> Any:
        import torch

        if not isinstance(storage, _Storage) or not _ints(size) or not _ints(stride) or len(size) != len(stride) \
                or not _ints((storage_offset,)) or requires_grad is not False or backward_hooks or metadata:
            raise _Refused("not a plain tensor")
        t = torch.empty((0,), dtype=storage.dtype, device="meta")
        return t.set_(storage.untyped, storage_offset, tuple(size), tuple(stride))


def _ints(xs: Any) -> bool:
    return isinstance(xs, tuple) and all(type(x) is int and x >= 0 for x in xs)


class _HeadUnpickler(pickle.Unpickler):
    """The C unpickler, restricted to what ``torch.save`` writes for a dict of plain tensors."""

    def __init__(self, data: bytes, reader: Any) -> None:
        super().__init__(io.BytesIO(data))
        self._reader = reader  # torch's zip reader: where each storage's record starts
        self._storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _RebuildTensor()
        if module == "collections" and name == "OrderedDict":
            return _EmptyOrderedDict()
        if module == "torch" and name in _STORAGES:
            return _StorageType(getattr(torch, _STORAGES[name]))
        raise _Refused(f"global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        import torch

        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[2], str) and pid[2].isascii() and pid[2].isdigit() and type(pid[4]) is int
                and pid[4] >= 0):
            raise _Refused("not a storage id")
        key, dtype, numel = pid[2], pid[1].dtype, pid[4]
        if key in self._storages:
            seen = self._storages[key]
            if (seen.dtype, seen.numel) != (dtype, numel):
                raise _Refused("one storage of two dtypes or sizes")
            return seen
        untyped = torch.UntypedStorage(numel * torch.empty((), dtype=dtype).element_size(), device="meta")
        untyped._checkpoint_offset = self._reader.get_record_offset(f"data/{key}")  # torch's reader: its record
        self._storages[key] = _Storage(dtype, numel, untyped)
        return self._storages[key]


# what torch.save (pickle protocol 2) writes for a dict of tensors, numbers, strings and lists, by
# opcode byte, each with what follows it: a fixed number of bytes, or ("len", n): an n-byte
# little-endian length and that many bytes; ("lines", 2): two lines (GLOBAL)
_ARGS: dict[int, Any] = {
    0x80: 1, 0x2E: 0, 0x28: 0, 0x63: ("lines", 2), 0x52: 0, 0x51: 0, 0x7D: 0, 0x5D: 0, 0x29: 0, 0x74: 0, 0x85: 0,
    0x86: 0, 0x87: 0, 0x61: 0, 0x65: 0, 0x73: 0, 0x75: 0, 0x4E: 0, 0x88: 0, 0x89: 0, 0x4A: 4, 0x4B: 1, 0x4D: 2,
    0x8A: ("len", 1), 0x47: 8, 0x58: ("len", 4), 0x68: 1, 0x6A: 4, 0x71: 1, 0x72: 4}
OPCODES = frozenset(op.name for op in pickletools.opcodes if ord(op.code) in _ARGS)  # their names
_ATOMS = frozenset(b"N\x88\x89JKM\x8aGX")  # NONE NEWTRUE NEWFALSE BININT BININT1 BININT2 LONG1 BINFLOAT BINUNICODE
_EMPTY = {0x7D: "dict", 0x5D: "list", 0x29: "tuple"}
_GLOBALS = {b"torch._utils\n_rebuild_tensor_v2": "rebuild", b"collections\nOrderedDict": "ordered_dict"}
_TARGETS = {0x73: ("dict", 2), 0x61: ("list", 1)}  # SETITEM, APPEND: the container under what they pop


def _ops(data: bytes) -> Any:
    """(opcode, argument bytes) of each opcode, those of :data:`OPCODES` only (ValueError on any
    other, or on a pickle cut short); faster than :func:`pickletools.genops`, which this mirrors."""
    at, n = 0, len(data)
    while at < n:
        op = data[at]
        how = _ARGS.get(op)
        if how is None:
            raise ValueError(f"opcode {op:#x}")
        at += 1
        if type(how) is int:
            arg, at = data[at:at + how], at + how
        elif how[0] == "len":
            size = int.from_bytes(data[at:at + how[1]], "little")
            arg, at = data[at + how[1]:at + how[1] + size], at + how[1] + size
        else:
            first = data.index(b"\n", at)
            end = data.index(b"\n", first + 1)
            arg, at = data[at:end], end + 1
        if at > n:
            raise ValueError("cut short")
        yield op, arg
        if op == 0x2E:  # STOP
            return
    raise ValueError("no STOP")


def _plain(data: bytes) -> bool:
    """Whether the pickle is one ``torch.save`` writes: every opcode one of :data:`OPCODES`, and,
    following the kind of each value on the stack (the memo's too), items set only on dicts and
    appended only to lists (the C unpickler would set them on any object; the weights-only loader
    refuses that)."""
    stack: list[str] = []
    marks: list[int] = []
    memo: dict[int, str] = {}
    try:
        for op, arg in _ops(data):
            if op in _ATOMS:
                stack.append("atom")
            elif op in _EMPTY:
                stack.append(_EMPTY[op])
            elif op == 0x28:  # MARK
                marks.append(len(stack))
            elif op == 0x63:  # GLOBAL
                stack.append(_GLOBALS.get(arg, "global"))
            elif op in (0x68, 0x6A):  # BINGET, LONG_BINGET
                stack.append(memo[int.from_bytes(arg, "little")])
            elif op in (0x71, 0x72):  # BINPUT, LONG_BINPUT: slots come in order (the C unpickler's memo is an
                slot = int.from_bytes(arg, "little")  # array as long as the largest slot: 2**31 of them is 16 GB)
                if slot > len(memo):
                    return False
                memo[slot] = stack[-1]
            elif op in (0x74, 0x85, 0x86, 0x87):  # TUPLE, TUPLE1-3
                at = marks.pop() if op == 0x74 else len(stack) - (op - 0x84)
                if at < 0:
                    return False
                del stack[at:]
                stack.append("tuple")
            elif op == 0x51:  # BINPERSID
                stack[-1] = "storage"
            elif op == 0x52:  # REDUCE
                stack.pop()
                stack[-1] = {"rebuild": "tensor", "ordered_dict": "dict"}.get(stack[-1], "other")
            elif op in _TARGETS:  # SETITEM, APPEND
                kind, k = _TARGETS[op]
                del stack[len(stack) - k:]
                if stack[-1] != kind:
                    return False
            elif op in (0x75, 0x65):  # SETITEMS, APPENDS
                del stack[marks.pop():]
                if stack[-1] != ("dict" if op == 0x75 else "list"):
                    return False
        return len(stack) == 1 and not marks
    except (ValueError, IndexError, KeyError):  # cut short, an unknown opcode, an empty stack or memo slot
        return False


def _no_stand_in(out: dict[str, Any]) -> bool:
    """Whether no stand-in of this module is left anywhere in the result (where ``torch.load``
    would have put a class or a function of torch's)."""
    todo, seen = list(out.values()), 0
    while todo:
        x = todo.pop()
        seen += 1
        if seen > MAX_WALK or isinstance(x, _StandIn):
            return False
        if isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
    return True


class TorchZip:
    """A ``torch.save`` zip opened with torch's own reader (what ``torch.load`` reads)."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader

    @classmethod
    def open(cls, gated: TensorFile) -> TorchZip | None:
        """The zip (``gated``, through the gate) as torch's reader opens it; None where it cannot.
        The reader opens the file the gate read (:func:`~surgeon.capture.tensorfiles.held`): a FIFO or
        another file swapped in at its path since is BadInput, never read."""
        import torch

        from surgeon.capture.tensorfiles import held

        with held(gated) as name:  # the reader keeps its own handle on that file
            try:
                return cls(torch._C.PyTorchFileReader(name))
            except Exception:  # noqa: BLE001 - torch's reader refuses it: so will torch.load, whose error is the one said
                return None

    @functools.cached_property
    def byteorder(self) -> bytes | None:
        """The ``byteorder`` record (None: written before torch recorded it, little-endian), read once."""
        try:
            return bytes(self._reader.get_record("byteorder")) if self._reader.has_record("byteorder") else None
        except Exception:  # noqa: BLE001 - an unreadable record: no byte order torch would take
            return b""

    def _checked(self) -> bool:
        """What ``torch.load`` checks of the zip before it unpickles (torch 2.13's ``_load`` and
        ``_is_torchscript_zip``): every record inside one folder (``get_all_records`` raises
        otherwise), no ``constants.pkl`` (a TorchScript archive), a ``data.pkl``, a byte order of
        ``little`` or ``big`` and a storage alignment that is an integer, where they are recorded."""
        records = self._reader.get_all_records()
        if "constants.pkl" in records or "data.pkl" not in records:
            return False
        if self.byteorder not in (None, b"little", b"big"):
            return False
        if ".storage_alignment" in records:
            int(bytes(self._reader.get_record(".storage_alignment")))
        return True

    def meta_load(self) -> dict[str, Any] | None:
        """The top-level dict, its tensors on the meta device as ``torch.load(map_location="meta",
        weights_only=True)`` gives them (each storage's ``_checkpoint_offset`` its record's data);
        None for a file this module does not read (see the module's docstring)."""
        try:
            if not self._checked() or self._reader.get_record_size("data.pkl") > MAX_PICKLE_BYTES:
                return None
            data = bytes(self._reader.get_record("data.pkl"))
            if not _plain(data):
                return None
            out = _HeadUnpickler(data, self._reader).load()
        except Exception:  # noqa: BLE001 - _Refused, or anything the pickle or torch's reader raise: torch.load decides
            return None
        if not isinstance(out, dict) or not all(isinstance(k, str) for k in out) or not _no_stand_in(out):
            return None
        return out
