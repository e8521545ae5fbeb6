"""Which convention applies: the installed engine's probe when there is one, else the built-in
table (and every report says which).

An :class:`EngineView` is one engine as surgeon sees it in this environment: the handle every
question about the engine goes to. A probe is cached for the process while the engine's model
files are unchanged; within an :func:`engine_session` (a command that reads engines) the view
itself is opened once, so the command neither locates the engine again nor re-reads its files'
signature per question, and all its answers rest on one reading.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from surgeon.core.conventions import BUILTIN, BUILTIN_READ_FROM, ENGINE_INSTALL, EngineConvention, builtin_class
from surgeon.core.errors import BadInput, Unverified
from surgeon.core.idrules import ClassConvention, EngineProbe
from surgeon.engines.source.locate import EngineLocation, ProbeError, locate_engine  # light: no libcst until a probe runs

SERVING_ENGINES = ("sglang", "vllm")
PLATFORM_CHOICES = ("cuda", "rocm", "cpu")

# The platform the current command asks about (``--platform``); None: each engine's default
# (vLLM: cuda; SGLang does not dispatch per platform).
_platform: ContextVar[str | None] = ContextVar("surgeon_platform", default=None)


@contextlib.contextmanager
def platform_scope(platform: str | None) -> Iterator[None]:
    """Within the block, engines are opened for ``platform`` (what a command's ``--platform``
    says); every view and answer names it."""
    token = _platform.set(platform)
    try:
        yield
    finally:
        _platform.reset(token)


def current_platform() -> str | None:
    return _platform.get()


@dataclass
class EngineView:
    engine: str
    location: EngineLocation | None
    probe: EngineProbe | None

    @property
    def platform(self) -> str:
        return self.probe.platform if self.probe is not None else (current_platform() or "cuda")

    @property
    def version(self) -> str | None:
        return self.location.version if self.location else None

    @property
    def origin(self) -> str:
        if self.probe is None:
            return f"{self.engine} not installed: built-in table read from {BUILTIN_READ_FROM[self.engine]}"
        where = f"probe of {self.engine} {self.probe.version} at {self.probe.root}, platform {self.probe.platform}"
        return where + self._cpu_hint()

    def _cpu_hint(self) -> str:
        """Answers default to cuda (where drafts are served); on a CPU build, say how to ask for
        what this installation itself runs."""
        if self.engine != "vllm" or current_platform() is not None or self.location is None or not self.location.cpu_build:
            return ""
        return (f" (the default; this installation is a CPU build, {self.location.distribution or self.engine} "
                f"{self.location.version}: --platform cpu answers for what it runs)")

    def dispatch_note(self, model_class: str | None) -> str | None:
        """Where ``model_class`` is an architecture the engine picks per platform: what runs on
        each platform and whether that differs (None otherwise)."""
        if self.probe is None or model_class is None:
            return None
        routed = self.probe.dispatch.get(model_class)
        return routed.text() if routed is not None else None

    def class_convention(self, model_class: str | None) -> ClassConvention:
        """The probed convention of ``model_class`` (BadInput when the installed engine has no such
        class, or cannot say what its ids mean). Without a probe: the built-in table's row of that
        class, and BadInput for a class the table has no row of (never another class's row)."""
        if self.probe is None:
            return self._builtin_class(model_class)
        if model_class is None:
            raise BadInput(
                f"{self.engine}: name the model class "
                f"(--model-class, engines.{self.engine}.model_class or target.architecture)"
            )
        cc = self.probe.get(model_class)
        routed = self.probe.dispatch.get(model_class)
        if cc is None and routed is not None:
            here = routed.here
            if not here.verified:
                raise Unverified(f"{self.engine} {self.probe.version} {model_class} on {here.platform}: unverified: "
                               f"which class runs is not decided by what was read: {here.reason}")
            raise BadInput(f"{self.engine} {self.probe.version} {model_class} on {here.platform} runs "
                           f"{here.path}:{here.line} {here.class_name} ({here.evidence}), which has no aux "
                           f"hidden-state capture")
        if cc is None and model_class in self.probe.registered:
            raise BadInput(f"{self.engine} {self.probe.version}: the registry maps {model_class} to "
                           f"{self.probe.registered[model_class]}, which defines no aux hidden-state capture")
        if cc is None:
            known = sorted(self.probe.classes)
            hint = difflib.get_close_matches(model_class, known, n=3)
            raise BadInput(
                f"{self.engine} {self.probe.version} has no model class {model_class!r} with aux hidden-state capture"
                + (f"; did you mean {', '.join(hint)}?" if hint
                   else f" ({len(known)} classes: see `surgeon conventions --engine {self.engine}`)")
            )
        if cc.status != "classified":
            what = ("the source shows it cannot capture aux hidden states" if cc.no_capture
                    else "it hands the ids to its language model, whose class the engine picks at run time from "
                         "the checkpoint's text config: render with --model-class set to that text model's class"
                    if cc.delegates else "the probe cannot tell what its ids mean")
            raise BadInput(f"{self.engine} {self.probe.version} {model_class} ({cc.path}:{cc.line}): {what}: {cc.reason}")
        return cc

    def _builtin_class(self, model_class: str | None) -> ClassConvention:
        """The built-in row of ``model_class``; BadInput saying how to read the engine's source where
        the table has none (advice that works from a wheel: the engine's own PyPI package)."""
        found = builtin_class(self.engine, model_class) if model_class else None
        if found is not None:
            return found
        known = sorted(c for e, c in BUILTIN if e == self.engine)
        what = f"no row for {model_class}" if model_class else "no row for an unnamed model class"
        hint = difflib.get_close_matches(model_class or "", known, n=1)
        raise BadInput(
            f"{self.engine} is not installed here, and surgeon's built-in table (read from "
            f"{BUILTIN_READ_FROM[self.engine]}) has {what}"
            + (f" (did you mean {hint[0]}?)" if hint else f" (it has {', '.join(known)})")
            + f": install the engine's source for surgeon to read, never import ({ENGINE_INSTALL[self.engine]}), "
            f"or pass --engine-root DIR"
        )

    def convention(self, model_class: str | None) -> EngineConvention:
        note = self.dispatch_note(model_class)
        origin = f"{self.origin}; {note}" if note else self.origin
        cc = self.class_convention(model_class)
        if self.probe is None:  # name the row actually used, at its file:line in the release it was read from
            origin = f"{self.engine} not installed: built-in table, {cc.path}:{cc.line} {cc.class_name} " \
                     f"as read in {BUILTIN_READ_FROM[self.engine]}"
        return EngineConvention(cc, origin)


def _signature(location: EngineLocation) -> tuple:
    """What the source looks like now (names, sizes, mtimes of the model files): a view is reused
    within a process only while this is unchanged, so an edited engine is probed again."""
    sig: list = [location.version]
    for d in location.models_dirs:  # every file, subfolders included (models/<family>/<platform>/)
        for folder, subdirs, _files in os.walk(location.root / d):
            subdirs[:] = sorted(x for x in subdirs if x != "__pycache__")
            try:
                for entry in sorted(os.scandir(folder), key=lambda e: e.name):
                    if entry.name.endswith(".py"):
                        st = entry.stat()
                        sig.append((folder, entry.name, st.st_size, st.st_mtime_ns))
            except OSError:
                pass
    return tuple(sig)


@lru_cache(maxsize=16)
def _probe_view(engine: str, location: EngineLocation, signature: tuple, platform: str | None = None) -> EngineView:
    from surgeon.engines.probes.probe import probe_engine  # libcst: only when an engine is really probed

    try:
        probe = probe_engine(engine, location.root, progress=_progress_hook.get(engine), platform=platform)
    except ProbeError as e:
        raise BadInput(f"{engine} at {location.root}: {e}") from None
    return EngineView(engine, location, probe)


def _open(engine: str, root: str | None) -> EngineView:
    try:
        location = locate_engine(engine, root)
    except ProbeError as e:
        if root is not None:
            raise BadInput(f"--engine-root {root}: {e}") from None
        return EngineView(engine, None, None)
    platform = current_platform() if engine == "vllm" else None
    return _probe_view(engine, location, _signature(location), platform)


_progress_hook: dict[str, Callable[[int, int], None]] = {}

# The engines the running command has opened, by (engine, root, platform): within a session every
# question about an engine goes to the one view opened first, instead of locating the engine and
# reading its source's signature again (a walk of every model file) for each question.
_session: ContextVar[dict[tuple, EngineView] | None] = ContextVar("surgeon_engine_session", default=None)


@contextlib.contextmanager
def engine_session() -> Iterator[None]:
    """Within the block, each engine (per root and platform) is opened once: every answer of the
    command rests on the same reading of its source. For commands that read engines, never for one
    that edits an engine's files (apply, revert, the demo), which must see the files change."""
    token = _session.set({})
    try:
        yield
    finally:
        _session.reset(token)


def open_engine(engine: str, root: str | Path | None = None, *, progress: Callable[[int, int], None] | None = None,
                platform: str | None = None) -> EngineView:
    """The view of ``engine`` at ``root`` (default: the installed package, found without
    importing it) for ``platform`` (default: the command's :func:`platform_scope`, else the
    engine's default). A bad explicit root is BadInput; a missing installation is a view without
    a probe, which uses the built-in table and says so."""
    if engine not in SERVING_ENGINES:
        raise BadInput(f"unknown engine {engine!r}; expected one of {', '.join(SERVING_ENGINES)}")
    if platform is not None:
        with platform_scope(platform):
            return open_engine(engine, root, progress=progress)
    if progress is not None:
        _progress_hook[engine] = progress
    resolved = None if root is None else str(Path(root).resolve())
    opened = _session.get()
    key = (engine, resolved, current_platform() if engine == "vllm" else None)
    if opened is not None and key in opened:
        return opened[key]
    try:
        view = _open(engine, resolved)
    finally:
        _progress_hook.pop(engine, None)
    if opened is not None:
        opened[key] = view
    return view


def model_class_for(spec, engine: str, override: str | None = None) -> str:
    """--model-class, else the spec's pin for the engine, else the target architecture."""
    if override:
        return override
    pin = spec.pin(engine)
    if pin is not None and pin.model_class:
        return pin.model_class
    return spec.model.target.architecture
