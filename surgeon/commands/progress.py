"""How a command reports progress without knowing who watches: the CLI passes a rich display,
a library caller passes nothing (:data:`QUIET`).

The commands decide what is slow (probing an engine's source, running an HF model, rewriting a
model file); the caller decides how it looks. Displays are opened one at a time, never nested,
because a terminal shows one live display at once.
"""

from __future__ import annotations

import contextlib
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


def open_engines(engines: Iterable[str], roots: Mapping[str, str | None], progress: Progress) -> None:
    """Probe each engine's source once, with a progress bar, before a command reads it: the probe
    is cached, so the library calls that follow find it done instead of probing silently."""
    from surgeon.engines.view import open_engine

    for engine in engines:
        with progress.bar(f"probing {engine} source") as update:
            open_engine(engine, roots.get(engine), progress=update)
