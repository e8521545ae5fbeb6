"""Whether Ctrl-C reached this process, for the one case where the interrupt does not arrive as
:class:`KeyboardInterrupt`: a library that turns it into an error of its own (pydantic-core, while
it builds a model's validator during an import, raises ``SchemaError: ... KeyboardInterrupt``).
The command line then still says "interrupted" and exits 130, where the error alone would read as
an internal error; an error with no Ctrl-C before it is never taken for one.

:func:`watch` keeps Python's own behaviour (the handler raises KeyboardInterrupt as Python's does)
and only records the signal; where SIGINT is ignored (a background job) or someone else handles
it, nothing changes."""

from __future__ import annotations

import signal
from types import FrameType

_seen = False


def _record(signum: int, frame: FrameType | None) -> None:
    global _seen
    _seen = True
    signal.default_int_handler(signum, frame)


def watch() -> None:
    """Record Ctrl-C from now on (Python's default SIGINT handler only; not the main thread: nothing)."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _record)
    except ValueError:  # not the main thread
        pass


def seen() -> bool:
    """Whether Ctrl-C reached the process since :func:`watch`."""
    return _seen
