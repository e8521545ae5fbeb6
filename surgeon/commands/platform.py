"""``--platform``: the platform an engine answer holds for.

vLLM picks some architectures' classes per platform (``vllm/models/<family>/<platform>/``); a
command that probes an engine takes ``platform`` ("cuda", the default, "rocm" or "cpu") and runs
inside :func:`surgeon.engines.view.platform_scope`, so every engine it opens, however deep in the
library, answers for that platform and says so.

A command that only reads engines (:func:`engine_command`) also runs inside one
:func:`surgeon.engines.view.engine_session`: each engine is opened once for the whole command.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from surgeon.engines.view import PLATFORM_CHOICES, engine_session, platform_scope

__all__ = ["PLATFORM_CHOICES", "engine_command", "platform_command"]

P = ParamSpec("P")
R = TypeVar("R")


def platform_command(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` with its keyword ``platform`` in effect for every engine it opens (None: the
    platform already in effect, else each engine's default)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        platform = kwargs.get("platform")
        if not isinstance(platform, str):
            return fn(*args, **kwargs)
        with platform_scope(platform):
            return fn(*args, **kwargs)

    return wrapper


def engine_command(fn: Callable[P, R]) -> Callable[P, R]:
    """:func:`platform_command` for a command that reads engines and edits none: it also opens each
    engine once (one :class:`surgeon.engines.view.EngineView` per engine for the whole command)."""
    scoped = platform_command(fn)

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with engine_session():
            return scoped(*args, **kwargs)

    return wrapper
