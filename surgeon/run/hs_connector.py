"""surgeon's CPU subclass of vLLM's ``ExampleHiddenStatesConnector`` (loaded by vLLM, never by surgeon).

:mod:`surgeon.run.extract_runner` names this module in ``kv_transfer_config.kv_connector_module_path``
and :data:`CONNECTOR` in ``kv_connector``; vLLM's ``KVConnectorFactory.get_connector_class``
imports the module and takes the class by that name. The class is the installed stock connector
(``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``) with one
method overridden, and only where the hidden-states cache lives on the CPU:

* ``_submit_async_write`` (called from the worker's ``get_finished`` for each request finished the
  step before) copies the request's rows into pinned host memory (``torch.empty_like(...,
  pin_memory=True)``), which raises on a machine without an accelerator and kills the engine; and it
  records a copy event whose ``query()`` the stock ``get_finished`` then calls, a method vLLM's CPU
  event placeholder (``vllm/v1/worker/cpu/shm.py``, ``_EventPlaceholder``) does not have. Here the
  rows are read with the stock module's own ``extract_from_kv_cache``, cloned (no pinning), written
  at once by the stock ``_write_tensors`` (which releases the request's ``.lock``), and the request is
  recorded with an event that is already complete. The file is whole when the engine step returns.

The names used from the installed class are checked when this module is imported and when the
connector is built; one that is gone raises :class:`ConnectorDrift` naming it and the installed
file, so the engine start stops rather than running a stock path this override no longer covers.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _stock

__all__ = ["CONNECTOR", "ConnectorDrift", "SurgeonHiddenStatesConnector"]

CONNECTOR = "SurgeonHiddenStatesConnector"
STOCK_CLASS = "ExampleHiddenStatesConnector"
#: what the override calls or replaces, by name: module functions, class methods (with their
#: parameters), dataclass fields of the pending save, and instance state set by the stock __init__
STOCK_FUNCTIONS = ("extract_from_kv_cache",)
STOCK_METHODS = {"_submit_async_write": ("self", "pending"), "_write_tensors": ("tensors", "event", "filename", "lock_fd"),
                 "get_finished": ("self", "finished_req_ids")}
PENDING_FIELDS = ("req_id", "filename", "token_ids", "block_ids")
STOCK_STATE = ("_is_tp_rank_zero", "_kv_cache", "_block_size", "_lock_fds", "use_lock", "_req_copy_events")


class ConnectorDrift(RuntimeError):
    """The installed stock connector no longer has what surgeon's CPU override relies on."""


def _drift(what: str) -> ConnectorDrift:
    return ConnectorDrift(f"{_stock.__file__}: {what}: surgeon's {CONNECTOR} overrides {STOCK_CLASS}."
                          "_submit_async_write for the CPU by these names, and no longer applies to this vLLM")


def stock_problems() -> list[str]:
    """What the override needs from the installed module and class but does not find there."""
    out = [f"no function {name}" for name in STOCK_FUNCTIONS if not callable(getattr(_stock, name, None))]
    cls = getattr(_stock, STOCK_CLASS, None)
    if cls is None:
        return out + [f"no class {STOCK_CLASS}"]
    for name, params in STOCK_METHODS.items():
        fn = cls.__dict__.get(name)
        fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
        if not callable(fn):
            out.append(f"{STOCK_CLASS} defines no method {name}")
        elif tuple(inspect.signature(fn).parameters) != params:
            out.append(f"{STOCK_CLASS}.{name} takes ({', '.join(inspect.signature(fn).parameters)}), "
                       f"not ({', '.join(params)})")
    pending = getattr(_stock, "PendingSave", None)
    have = {f.name for f in dataclasses.fields(pending)} if dataclasses.is_dataclass(pending) else set()
    out += [f"PendingSave has no field {name}" for name in PENDING_FIELDS if name not in have]
    return out


if _problems := stock_problems():
    raise _drift("; ".join(_problems))


class _DoneEvent:
    """A copy event that is already complete: the rows were copied and written synchronously."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class SurgeonHiddenStatesConnector(_stock.ExampleHiddenStatesConnector):
    """The stock connector, writing each request's file synchronously and unpinned on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        missing = [name for name in STOCK_STATE if not hasattr(self, name)]
        if missing:
            raise _drift(f"{STOCK_CLASS}.__init__ sets no {', '.join(missing)}")

    def _submit_async_write(self, pending: Any) -> None:
        cache = self._kv_cache
        if cache is None or cache.device.type != "cpu":
            super()._submit_async_write(pending)  # an accelerator: the stock path is right
            return
        if not self._is_tp_rank_zero:
            return
        tensors = {"hidden_states": self._rows(cache, pending), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        self._write_tensors(tensors, _DoneEvent(), pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _DoneEvent()

    def _rows(self, cache: torch.Tensor, pending: Any) -> torch.Tensor:
        """The request's rows of the hidden-states cache, in its block order, as a plain CPU copy."""
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()
        return _stock.extract_from_kv_cache(cache, slots, int(pending.token_ids.shape[0])).clone()
