"""How a command reports progress without knowing who watches: the CLI passes a rich display,
a library caller passes nothing (:data:`QUIET`).

The commands decide what is slow (probing an engine's source, running an HF model, rewriting a
model file, identifying slots); the caller decides how it looks. Displays are opened one at a time,
never nested, because a terminal shows one live display at once. A display shows the time elapsed
in its step, live on a terminal; where nothing can be redrawn (a log), a long run such as the demo
prints a line every :data:`HEARTBEAT_S` seconds from a :class:`Heartbeat`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

Update = Callable[[int, int], None]  # (done, total)


class Progress(Protocol):
    def bar(self, label: str) -> contextlib.AbstractContextManager[Update]:
        """A display for a task that may know its size: the context yields ``update(done, total)``."""
        ...

    def spinner(self, label: str) -> contextlib.AbstractContextManager[None]:
        """A display for a task of unknown size."""
        ...


class _Quiet:
    """Shows nothing: the default for library callers and tests."""

    @contextlib.contextmanager
    def bar(self, label: str) -> Iterator[Update]:
        yield lambda done, total: None

    def spinner(self, label: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


QUIET: Progress = _Quiet()

HEARTBEAT_S = 10.0  # seconds between two "still working" lines where a display cannot redraw


class Heartbeat:
    """Calls ``beat(label, elapsed_s)`` every ``every_s`` seconds while a step runs (from a daemon
    thread), for displays that cannot redraw. :meth:`step` starts timing a new step; :meth:`close`
    stops (also as a context manager)."""

    def __init__(self, beat: Callable[[str, float], None], every_s: float = HEARTBEAT_S):
        self._beat, self._every = beat, every_s
        self._label: str | None = None
        self._started = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="surgeon-heartbeat", daemon=True)
        self._thread.start()

    def step(self, label: str | None) -> None:
        """Time the step ``label`` from now (None: no step running, nothing to beat)."""
        with self._lock:
            self._label, self._started = label, time.perf_counter()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            with self._lock:
                label, elapsed = self._label, time.perf_counter() - self._started
            if label is not None and not self._stop.is_set():
                self._beat(label, elapsed)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_engines(engines: Iterable[str], roots: Mapping[str, str | None], progress: Progress) -> None:
    """Probe each engine's source once, with a progress bar, before a command reads it: the probe
    is cached, so the library calls that follow find it done instead of probing silently."""
    from surgeon.engines.view import open_engine

    for engine in engines:
        with progress.bar(f"probing {engine} source") as update:
            open_engine(engine, roots.get(engine), progress=update)
