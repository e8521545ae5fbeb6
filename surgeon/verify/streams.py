"""Run independent work as single-threaded torch streams, one Python thread per core.

Shared by identification and streaming fingerprinting (both many short memory-bound ops).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def run_streams(tasks: list[Callable[[], None]]) -> None:
    """Run ``tasks`` on ``torch.get_num_threads()`` Python threads, each op single-threaded.

    The work here is many short memory-bound ops. With torch's own intra-op threads every op ends
    in a barrier, and on a shared 2-core machine one descheduled thread stalls them all (measured:
    the Kimi-sized identification went from 0.5 s to 1.7 s next to one busy process, 5-9 s next to
    a test run). Independent streams do not wait for each other. torch's thread count is restored.
    """
    n = min(torch.get_num_threads(), len(tasks))
    if n <= 1:
        for task in tasks:
            task()
        return
    it = iter(tasks)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while not errors:
            with lock:
                task = next(it, None)
            if task is None:
                return
            try:
                task()
            except BaseException as e:  # re-raised in the caller
                errors.append(e)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pool = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        torch.set_num_threads(before)
    if errors:
        raise errors[0]
