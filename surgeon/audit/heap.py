"""The memory of a process that audits file after file: its C heap (glibc's malloc; left as it
is elsewhere) and its Python garbage collector.

An audited file allocates a few MB of arrays (its norms, hashed columns and sampled rows, and
numpy's temporaries on them) and frees them at its end. glibc's defaults give that memory back to
the OS whenever the free space at the top of the heap passes a threshold it sets to twice the
largest block it recently freed, so the next file faults every page in again and the kernel zeroes
each one: 250 page faults a file, and two thirds of the time of the per-channel statistics,
measured in-loop on ``benchmarks/audit.py``'s set (:func:`keep_freed` cut them to 40).

Python's collector, for its part, walked every object of the process (torch's and numpy's modules,
the profile) in each full collection that a file's garbage triggered: 8.6% of the samples of a
profile of the audit loop (``perf``), 2.3% once they are frozen (:func:`settle_owned`, :func:`settled`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
KEEP_BYTES = 64 << 20  # free heap kept for the next file: well above one file's arrays (a few MB)
MMAP_BYTES = 32 << 20  # blocks this large or larger are mapped, and unmapped when freed (glibc's own ceiling)


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_freed() -> bool:
    """Keep up to :data:`KEEP_BYTES` of freed heap in this process (blocks under :data:`MMAP_BYTES`
    from the heap), so that file after file reuses the same pages: fixed thresholds, where glibc's
    adapt. Memory stays bounded: by the largest file's arrays, plus at most that. Whether it was set."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))


_OWNED: list[bool] = []  # settle_owned() ran in this process


def settle_owned(*, collect: bool = True) -> None:
    """Once in a process the audit owns (a pool worker, a Ray worker), before its first file:
    :func:`keep_freed`, and every object alive now (the imported modules, the context and its
    profile) moved out of the collector's sight (``gc.freeze``), so that a file's garbage costs a
    walk of its own objects only; garbage in cycles collected first, unless the caller did so
    before forking this process (``collect=False``: a walk here would copy every page the parent
    shares with it). The objects go back to the collector at exit, for the interpreter's last
    collection (an extension that checks for leaks then, as nanobind's do, would report each one)."""
    import atexit
    import gc

    if _OWNED:
        return
    _OWNED.append(True)
    keep_freed()
    if collect:
        gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


_RUNS: list[int] = [0, 0]  # inline runs under way in this process; whether their freeze is theirs (1)
_RUNS_LOCK = threading.Lock()


@contextlib.contextmanager
def settled() -> Iterator[None]:
    """The same for an audit run in the caller's own process (one worker: the driver audits), for
    the run only: the objects frozen are handed back to the collector when the last run under way
    ends (the caller's objects that die meanwhile are collected then), and a freeze the caller made
    before is left as it is. The heap thresholds stay: the caller keeps at most
    :data:`KEEP_BYTES` of freed heap."""
    import gc

    keep_freed()
    counted = False
    try:  # counted, and frozen, inside the try: an interrupt during the freeze still reaches the finally
        with _RUNS_LOCK:
            _RUNS[0] += 1
            counted = True
            if _RUNS[0] == 1:
                _RUNS[1] = int(gc.get_freeze_count() == 0)
                if _RUNS[1]:
                    gc.collect()
                    gc.freeze()
        yield
    finally:
        with _RUNS_LOCK:
            _RUNS[0] -= counted
            if counted and _RUNS[0] == 0 and _RUNS[1]:
                gc.unfreeze()


def trim() -> None:
    """Give freed heap back to the OS now (``malloc_trim``)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
