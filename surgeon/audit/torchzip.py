"""The tensors of a ``torch.save`` zip as meta tensors, from its ``data.pkl`` alone, for the
structure pass: what ``torch.load(map_location="meta", weights_only=True)`` gives, without its
per-file cost.

``torch.load`` parses the zip again (the gate parsed it already) and runs its weights-only
unpickler, written in Python: about 0.3 ms a file alone, and more than a millisecond a file
measured inside an audit, where the 25 MB read before each file has evicted it from the CPU's
caches (``benchmarks/audit.py``; a third of the audit's time besides the read and the norms).
Here the C unpickler reads the pickle, and it may build nothing but what this module hands it:

* :meth:`_HeadUnpickler.find_class` resolves exactly the globals ``torch.save`` writes for plain
  tensors (``torch._utils._rebuild_tensor_v2``, ``collections.OrderedDict`` for their empty hook
  dicts, the typed storage classes of the float and integer dtypes) to this module's own inert
  stand-ins, and refuses every other name: no function of the file's choosing ever runs
  (the "restricting globals" pattern of the :mod:`pickle` documentation);
* :meth:`_HeadUnpickler.persistent_load` takes only torch's ``("storage", type, key, location,
  numel)`` ids, and makes an empty meta storage of that size, its ``_checkpoint_offset`` the data
  offset of the zip record ``data/<key>`` as the gate read it (what ``torch.load`` records on the
  meta device).

Whatever it does not take (another global, a pickle over :data:`MAX_PICKLE_BYTES`, a compressed
``data.pkl``, a storage that is no record of the zip, a top level that is no dict of those) makes
:func:`meta_load` return None, and the caller uses ``torch.load(..., weights_only=True)``, whose
verdict then stands. Nothing is ever loaded by this module that the weights-only loader would
refuse.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from surgeon.capture.tensorfiles import TensorFile

MAX_PICKLE_BYTES = 1 << 20  # a sample's data.pkl is a few hundred bytes; more is left to torch.load

# torch's typed storage classes (``torch.<Name>Storage``) and the dtype each holds
_STORAGES = {"BFloat16Storage": "bfloat16", "HalfStorage": "float16", "FloatStorage": "float32",
             "DoubleStorage": "float64", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
             "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool"}


class _Refused(Exception):
    """The pickle holds something this module does not build: left to ``torch.load``."""


class _StorageType:
    """The stand-in of a ``torch.<Name>Storage`` global: only its dtype is used."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _Refused("a storage class called")


class _Storage:
    """A storage the pickle names: an empty meta storage and its dtype."""

    __slots__ = ("dtype", "untyped")

    def __init__(self, dtype: str, untyped: Any) -> None:
        self.dtype, self.untyped = dtype, untyped


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, metadata: Any = None) -> Any:
    """``torch._utils._rebuild_tensor_v2`` of a plain tensor, on the meta device: a view of the
    storage, nothing allocated, nothing read."""
    import torch

    if not isinstance(storage, _Storage) or not _ints(size) or not _ints(stride) or len(size) != len(stride) \
            or not _ints((storage_offset,)) or requires_grad is not False or backward_hooks or metadata:
        raise _Refused("not a plain tensor")
    t = torch.empty((0,), dtype=getattr(torch, storage.dtype), device="meta")
    return t.set_(storage.untyped, storage_offset, tuple(size), tuple(stride))


def _ints(xs: Any) -> bool:
    return isinstance(xs, tuple) and all(type(x) is int and x >= 0 for x in xs)


class _HeadUnpickler(pickle.Unpickler):
    """The C unpickler, restricted to what ``torch.save`` writes for a dict of plain tensors."""

    def __init__(self, data: bytes, offsets: dict[str, int]) -> None:
        super().__init__(io.BytesIO(data))
        self._offsets = offsets  # storage key -> data offset of its zip record
        self._storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and name in _STORAGES:
            return _StorageType(_STORAGES[name])
        raise _Refused(f"global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        import torch

        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)
                and isinstance(pid[2], str) and type(pid[4]) is int and pid[4] >= 0):
            raise _Refused("not a storage id")
        key, dtype = pid[2], pid[1].dtype
        if key in self._storages:
            if self._storages[key].dtype != dtype:
                raise _Refused("one storage of two dtypes")
            return self._storages[key]
        if key not in self._offsets:
            raise _Refused(f"storage {key} is no record of the zip")
        untyped = torch.UntypedStorage(pid[4] * torch.empty((), dtype=getattr(torch, dtype)).element_size(),
                                       device="meta")
        untyped._checkpoint_offset = self._offsets[key]
        self._storages[key] = _Storage(dtype, untyped)
        return self._storages[key]


def meta_load(gated: TensorFile) -> dict[str, Any] | None:
    """The top-level dict of a ``torch.save`` zip (``gated``, through the gate), its tensors on the
    meta device as ``torch.load(map_location="meta", weights_only=True)`` gives them; None for a
    file this module does not read (see the module's docstring)."""
    pkl = [(n, r) for n, r in gated.records.items() if n == "data.pkl" or n.endswith("/data.pkl")]
    if len(pkl) != 1:
        return None
    name, (start, size, how) = pkl[0]
    if how != zipfile.ZIP_STORED or size > MAX_PICKLE_BYTES:
        return None
    folder = name[:-len("data.pkl")]
    offsets = {n[len(folder) + 5:]: r[0] for n, r in gated.records.items() if n.startswith(folder + "data/")}
    with open(gated.path, "rb", buffering=0) as f:
        f.seek(start)
        data = f.read(size)
    if len(data) != size:
        return None
    try:
        out = _HeadUnpickler(data, offsets).load()
    except (_Refused, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, RuntimeError, MemoryError, RecursionError):
        return None
    if not isinstance(out, dict) or not all(isinstance(k, str) for k in out) \
            or any(isinstance(v, (_Storage, _StorageType)) for v in out.values()):
        return None
    return dict(out)
