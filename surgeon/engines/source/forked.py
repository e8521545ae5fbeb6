"""A list of independent work items run in two processes: this one and a forked child.

The probe classifies a few hundred classes, each independently of the others, over a source index
that took seconds to build (the files parsed, the registry read). A forked child inherits that index
as it is (copy-on-write), so the two halves start at once, where a spawned worker would parse it all
again. The child sends its results back pickled over a pipe, and one byte per finished item over
another so that the parent's progress counts both halves.

Nothing depends on the split: an item's result does not depend on which process ran it or on what
ran before it (the caches are memos), and the results come back in the items' order. Where ``fork``
does not exist, one core is all there is, the list is short, or ``SURGEON_JOBS=1`` is set, the
items run here one after the other; when the child fails in any way, the parent runs the child's
share itself, so a failed child costs time, never an answer.
"""

from __future__ import annotations

import os
import pickle
import select
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

MIN_ITEMS = 16  # below this, a fork costs more than it saves


def jobs() -> int:
    """How many processes :func:`map_forked` uses: ``SURGEON_JOBS`` (1 or 2), else 2 where the
    machine has two cores and ``fork``, else 1."""
    wanted = os.environ.get("SURGEON_JOBS", "").strip()
    n = int(wanted) if wanted.isdigit() and int(wanted) > 0 else 2
    if not hasattr(os, "fork") or (os.cpu_count() or 1) < 2:
        return 1
    return min(n, 2)


def split(weights: Sequence[int], groups: Sequence[int], head_start: int = 0) -> tuple[list[int], list[int]]:
    """Two index lists of about equal total weight, the first starting with ``head_start`` (work
    of its own); the items of one group stay together (they share parsed files, which each process
    would otherwise parse again)."""
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    mine: list[int] = []
    theirs: list[int] = []
    load = [head_start, 0]
    for members in sorted(by_group.values(), key=lambda ms: -sum(weights[i] for i in ms)):
        side = 0 if load[0] <= load[1] else 1
        (mine if side == 0 else theirs).extend(members)
        load[side] += sum(weights[i] for i in members)
    return sorted(mine), sorted(theirs)


def map_forked(items: Sequence[T], fn: Callable[[T], R], *, weights: Sequence[int], groups: Sequence[int],
               progress: Callable[[int], None] | None = None,
               child_state: Callable[[], Any] | None = None,
               alongside: Callable[[], Any] | None = None, alongside_weight: int = 0) -> tuple[list[R], Any, Any]:
    """``[fn(x) for x in items]``, the work split over this process and a forked child.
    ``progress(done)`` is called as items finish (either process). ``child_state()`` is evaluated in
    the child after its share and returned (None when no child ran). ``alongside()`` is other work
    of this process's, run while the child works (its cost in ``weights``' units:
    ``alongside_weight``); its value is the third one returned."""
    results: list[Any] = [None] * len(items)
    if jobs() < 2 or len(items) < MIN_ITEMS:
        extra = alongside() if alongside else None
        for i, x in enumerate(items):
            results[i] = fn(x)
            if progress:
                progress(i + 1)
        return results, None, extra
    mine, theirs = split(weights, groups, alongside_weight)
    child = _Child.start(items, fn, theirs, child_state)
    extra = alongside() if alongside else None
    done = 0
    for i in mine:
        results[i] = fn(items[i])
        done += 1
        if progress:
            progress(done + (child.poll() if child else 0))
    got = child.finish() if child else None
    if got is None:  # no child, or it failed: its share runs here
        state = None
        for i in theirs:
            results[i] = fn(items[i])
            done += 1
            if progress:
                progress(done)
    else:
        state, child_results = got
        for i, r in zip(theirs, child_results):
            results[i] = r
        if progress:
            progress(len(items))
    return results, state, extra


class _Child:
    def __init__(self, pid: int, data_fd: int, tick_fd: int) -> None:
        self.pid, self.data_fd, self.tick_fd = pid, data_fd, tick_fd
        self.ticks = 0

    @classmethod
    def start(cls, items: Sequence[Any], fn: Callable[[Any], Any], share: list[int],
              child_state: Callable[[], Any] | None) -> _Child | None:
        data_r, data_w = os.pipe()
        tick_r, tick_w = os.pipe()
        with warnings.catch_warnings():  # 3.12+ warns about fork beside threads (a progress bar's
            warnings.simplefilter("ignore", DeprecationWarning)  # refresher); the child touches none
            try:
                pid = os.fork()
            except OSError:
                for fd in (data_r, data_w, tick_r, tick_w):
                    os.close(fd)
                return None
        if pid == 0:  # the child: never returns
            os.close(data_r)
            os.close(tick_r)
            code = 1
            try:
                out = []
                for i in share:
                    out.append(fn(items[i]))
                    os.write(tick_w, b".")
                payload = pickle.dumps((child_state() if child_state else None, out), protocol=pickle.HIGHEST_PROTOCOL)
                with os.fdopen(data_w, "wb") as f:
                    f.write(payload)
                code = 0
            except BaseException:  # noqa: BLE001 - any failure: the parent runs this share itself
                code = 1
            finally:
                os._exit(code)
        os.close(data_w)
        os.close(tick_w)
        return cls(pid, data_r, tick_r)

    def poll(self) -> int:
        """Items the child has finished so far (without waiting)."""
        while select.select([self.tick_fd], [], [], 0)[0]:
            chunk = os.read(self.tick_fd, 4096)
            if not chunk:
                break
            self.ticks += len(chunk)
        return self.ticks

    def finish(self) -> tuple[Any, list[Any]] | None:
        """The child's (state, results), or None when it failed."""
        try:
            with os.fdopen(self.data_fd, "rb") as f:
                payload = f.read()
            _, status = os.waitpid(self.pid, 0)
            os.close(self.tick_fd)
            if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0 or not payload:
                return None
            got = pickle.loads(payload)  # our own child's bytes, over a private pipe
            return got if isinstance(got, tuple) and len(got) == 2 else None
        except (OSError, pickle.PickleError, EOFError):
            return None
