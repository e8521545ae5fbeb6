"""Asynchronous dump writer: captured hidden states to surgeon dump shards, off the forward path.

``submit`` copies the step's captures into host staging buffers (pinned when CUDA is available,
reused across steps) and returns; a background thread writes each step (or, with
``shard_tokens``, each group of steps) as one shard through :func:`surgeon.capture.dumps.write_dump`,
which writes a temporary name and renames it, so a reader never sees a partial shard.

Memory is bounded: there are at most ``max_queue + 1`` staging sets (``max_queue`` waiting and
one being written). When every set is in use, ``submit`` blocks until the writer frees one
(backpressure); nothing grows without bound. No busy-wait: every wait is on a condition.

Shards are named ``shard-{index:06d}.safetensors`` in write order, so a sorted directory listing
is the dump order; no manifest. Indices continue after any shards already in ``out_dir``.

An error in the writer thread is re-raised (as itself) on the next ``submit``, ``flush`` or
``close``; after that the writer stays failed and keeps refusing, so no step is silently lost.
"""

from __future__ import annotations

import re
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from surgeon.capture import dumps as _dumps
from surgeon.core.errors import BadInput
from surgeon.core.points import Point

SHARD_RE = re.compile(r"shard-([0-9]{6,})\.safetensors")


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


def list_shards(out_dir: str | Path) -> list[Path]:
    """The complete shards of a dump directory, in write order (temporary names excluded)."""
    d = Path(out_dir)
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := SHARD_RE.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def _shard_number(path: Path) -> int:
    """The number in a shard's name; ``path`` comes from list_shards, which kept only names SHARD_RE matches."""
    match = SHARD_RE.fullmatch(path.name)
    assert match is not None
    return int(match.group(1))


class _Staging:
    """One step's host copy: a flat buffer per capture slot (grown, never shrunk) and the ids."""

    __slots__ = ("bufs", "ids", "views", "ids_view", "names", "points", "event", "tokens")

    def __init__(self) -> None:
        self.bufs: list[torch.Tensor] = []
        self.ids = torch.empty(0, dtype=torch.int64)
        self.views: list[torch.Tensor] = []
        self.ids_view = self.ids
        self.names: list[str] = []
        self.points: list[Point] = []
        self.event = None
        self.tokens = 0


class DumpWriter:
    """Write captured hidden states as surgeon dump shards, asynchronously.

    ``submit(captures, input_ids)``: ``captures`` is a list of ``(name, Point, tensor[T, H])``
    in slot order, each name and point as the spec declares it. Use as a context manager, or call
    ``close()``; ``flush()`` waits until everything submitted is on disk.
    """

    def __init__(self, out_dir: str | Path, *, spec, engine: str = "", engine_version: str = "", model: str = "",
                 max_queue: int = 4, shard_tokens: int | None = None):
        if spec is None:
            raise ValueError("DumpWriter needs the spec the captures follow")
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if shard_tokens is not None and shard_tokens < 1:
            raise ValueError("shard_tokens must be >= 1 (or None: one shard per submit)")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.engine, self.engine_version, self.model = engine, engine_version, model
        self.max_queue = max_queue
        self.shard_tokens = shard_tokens
        self._pin = torch.cuda.is_available()
        existing = list_shards(self.out_dir)
        self._next_index = _shard_number(existing[-1]) + 1 if existing else 0

        self._cond = threading.Condition()
        self._free: list[_Staging] = []  # staging sets not in use
        self._allocated = 0  # staging sets ever made (<= max_queue + 1)
        self._queue: deque = deque()  # _Staging or ("flush", token)
        self._in_use = 0
        self.peak_in_use = 0  # most staging sets live at once (for tests and reports)
        self.shards: list[Path] = []  # written, in order
        self.tokens_written = 0
        self._submitted = 0  # items put on the queue (steps and flush markers)
        self._done = 0  # items the thread finished
        self._error: BaseException | None = None
        self._closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="surgeon-dump-writer", daemon=True)
        self._thread.start()

    # -- caller side --------------------------------------------------------------------------
    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _check(self, captures: Sequence[tuple[str, Point, torch.Tensor]], T: int) -> None:
        if not captures:
            raise ValueError("submit needs at least one capture")
        H = self.spec.hidden_size
        seen = set()
        for name, point, t in captures:
            want = self.spec.captures.get(name)
            if want is None:
                raise BadInput(f"capture {name!r} is not in spec {self.spec.name} (captures: {', '.join(self.spec.captures)})")
            if point != want:
                raise BadInput(f"capture {name!r} is {want} in spec {self.spec.name}, but was submitted as {point}")
            if name in seen:
                raise BadInput(f"capture {name!r} submitted twice in one step")
            seen.add(name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != T or t.shape[1] != H:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise BadInput(f"capture {name!r} has shape {shape}, expected [{T}, {H}] ({T} input ids, hidden {H})")

    def _acquire(self) -> _Staging:
        with self._cond:
            while True:
                self._raise_error()
                if self._free:
                    st = self._free.pop()
                    break
                if self._allocated < self.max_queue + 1:
                    self._allocated += 1
                    st = _Staging()
                    break
                self._cond.wait()  # backpressure: the writer frees a set when a shard is written
            self._in_use += 1
            self.peak_in_use = max(self.peak_in_use, self._in_use)
            return st

    def _release(self, st: _Staging) -> None:
        with self._cond:
            st.views, st.ids_view, st.event = [], st.ids, None
            self._free.append(st)
            self._in_use -= 1
            self._cond.notify_all()

    def _stage(self, st: _Staging, captures, ids: torch.Tensor) -> None:
        T = ids.numel()
        while len(st.bufs) < len(captures):
            st.bufs.append(torch.empty(0))
        views = []
        on_cuda = False
        for i, (_, _, t) in enumerate(captures):
            need = t.numel()
            buf = st.bufs[i]
            if buf.dtype != t.dtype or buf.numel() < need:
                buf = torch.empty(need, dtype=t.dtype, pin_memory=self._pin)
                st.bufs[i] = buf
            view = buf[:need].view(t.shape)
            view.copy_(t.detach(), non_blocking=t.is_cuda)
            on_cuda |= t.is_cuda
            views.append(view)
        if st.ids.numel() < T:
            st.ids = torch.empty(T, dtype=torch.int64, pin_memory=self._pin)
        st.ids_view = st.ids[:T]
        st.ids_view.copy_(ids.detach().reshape(-1), non_blocking=ids.is_cuda)
        on_cuda |= ids.is_cuda
        if on_cuda:
            ev = torch.cuda.Event()
            ev.record()
            st.event = ev
        st.views = views
        st.names = [n for n, _, _ in captures]
        st.points = [p for _, p, _ in captures]
        st.tokens = T

    def submit(self, captures: Sequence[tuple[str, Point, torch.Tensor]], input_ids) -> None:
        """Stage one step's captures and queue them for writing; blocks while the queue is full."""
        if self._closed or self._closing:
            raise RuntimeError("DumpWriter is closed")
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.dtype.is_floating_point:
            raise BadInput(f"input_ids must be integer [T] (or [1, T]), got {ids.dtype} {tuple(ids.shape)}")
        captures = list(captures)
        self._check(captures, ids.numel())
        st = self._acquire()
        try:
            self._stage(st, captures, ids)
        except BaseException:
            self._release(st)
            raise
        with self._cond:
            self._queue.append(st)
            self._submitted += 1
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until everything submitted is written (a partial ``shard_tokens`` group included)."""
        with self._cond:
            self._raise_error()
            if self._closed:
                return
            self._queue.append("flush")
            self._submitted += 1
            target = self._submitted
            self._cond.notify_all()
            while self._done < target and self._error is None:
                self._cond.wait()
            self._raise_error()

    def close(self) -> None:
        """Write what is queued, stop the thread, re-raise a writer error. Idempotent."""
        if self._closed:
            self._raise_error()
            return
        with self._cond:
            self._closing = True
            self._queue.append("flush")
            self._queue.append("stop")
            self._cond.notify_all()
        self._thread.join()
        self._closed = True
        self._raise_error()

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # already failing: stop cleanly, do not mask the exception in flight
            try:
                self.close()
            except BaseException:
                pass

    # -- writer thread ------------------------------------------------------------------------
    def _write(self, names, points, tensors, ids) -> None:
        path = self.out_dir / shard_name(self._next_index)
        _dumps.write_dump(path, list(zip(names, points, tensors)), input_ids=ids, num_layers=self.spec.num_layers,
                          spec=self.spec, engine=self.engine, engine_version=self.engine_version, model=self.model)
        self._next_index += 1
        self.tokens_written += int(ids.numel())
        self.shards.append(path)

    def _run(self) -> None:
        group: list[tuple[list[str], list[Point], list[torch.Tensor], torch.Tensor]] = []  # shard_tokens only
        group_tokens = 0

        def write_group() -> None:
            nonlocal group, group_tokens
            if group:
                g, group, group_tokens = group, [], 0
                names, points = g[0][0], g[0][1]
                tensors = [torch.cat([item[2][i] for item in g]) for i in range(len(names))]
                self._write(names, points, tensors, torch.cat([item[3] for item in g]))

        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                item = self._queue.popleft()
            if item == "stop":
                return
            try:
                if self._error is None:
                    if item == "flush":
                        write_group()
                    elif self.shard_tokens is None:
                        if item.event is not None:
                            item.event.synchronize()
                        self._write(item.names, item.points, item.views, item.ids_view)
                    else:
                        if item.event is not None:
                            item.event.synchronize()
                        if group and (group[0][0] != item.names or group[0][1] != item.points):
                            write_group()  # a shard holds one set of captures
                        group.append((item.names, item.points, [v.clone() for v in item.views], item.ids_view.clone()))
                        group_tokens += item.tokens
                        if group_tokens >= self.shard_tokens:
                            write_group()
            except BaseException as e:  # surfaced on the caller's next call
                with self._cond:
                    self._error = e
                    group, group_tokens = [], 0
            finally:
                if isinstance(item, _Staging):
                    self._release(item)
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()
