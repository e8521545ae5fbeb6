"""What an engine's model runner hands the model's capture setter: the draft config's ids (through
which key, with which offset), or only the model's own default.

The model class's setter (:mod:`surgeon.core.idrules`) says what ids *mean*; the runner says which
ids *arrive*. vLLM 0.11's runner, for one, calls ``set_aux_hidden_state_layers`` with the model's
default whatever the draft config says, so a draft trained on other layers cannot be served there.
Filled by :mod:`surgeon.engines.probes.runner` from the engine's runner source, each call with its file:line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# draft_ids: the call passes ids read from the draft config (``sources``), the model's default
# only when the config has none; default: the call always passes the model's default (or no ids);
# passed_in: the ids come from the caller of the function that holds the call, not read further;
# unknown: the argument is an expression the reader does not model.
Passes = Literal["draft_ids", "default", "passed_in", "unknown"]


@dataclass(frozen=True)
class IdSource:
    """One place the runner reads ids from: ``key`` in the draft's config.json (``a.b`` is key
    ``b`` of the dict at ``a``), ``offset`` added to every id, at ``path:line``, under ``when``
    (the enclosing conditions in the source, verbatim; None: unconditional). ``origin`` is
    ``"draft_config"``, or ``"engine"`` where the ids come from the engine's own state (a server
    flag such as SGLang's ``--return-aux-hidden-state-layer-ids``), ``key`` then being the
    expression read, verbatim."""

    key: str
    offset: int
    path: str
    line: int
    when: str | None = None
    origin: Literal["draft_config", "engine"] = "draft_config"


@dataclass(frozen=True)
class RunnerCall:
    """One call of the capture setter in the runner."""

    path: str  # relative to the engine root
    line: int
    function: str  # the function or method holding the call
    setter: str
    passes: Passes
    default_method: str | None = None  # the model method whose default is used (always, or as fallback)
    sources: tuple[IdSource, ...] = ()
    detail: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class RunnerModel:
    """Every setter call found in the runner files of one engine release, and what they add up to."""

    engine: str
    version: str
    files: tuple[str, ...]  # runner files read (relative to the engine root)
    calls: tuple[RunnerCall, ...]
    verified: bool
    reason: str | None = None  # why not verified, or what the calls add up to
    # Read where one call sets the model's default while a device-graph runner is built (and captures
    # its graphs), before another call hands the model the draft's ids (SGLang 0.5.5): graph replays
    # then capture the default's states, eager passes the draft's. The order as read, with file:line.
    graph_default: str | None = None

    @property
    def ignores_draft_ids(self) -> bool:
        """Verified that every call passes only the model's default: the draft's ids never arrive."""
        return self.verified and bool(self.calls) and all(c.passes == "default" for c in self.calls)

    def for_kind(self, kind: str) -> RunnerModel:
        """This reading over the setter calls a ``kind`` draft's ids go through: SGLang's
        ``set_eagle3_layers_to_capture`` for ``eagle3``, whatever its DFlash setter is handed. A
        kind no setter is named for gets every call (vLLM's one ``set_aux_hidden_state_layers``)."""
        named = {c.setter for c in self.calls if kind.lower() in c.setter.lower()}
        if not named:
            return self
        calls = tuple(c for c in self.calls if c.setter in named)
        return summarise(self.engine, self.version, self.files, calls, tuple(sorted(named)), self.graph_default)


def summarise(engine: str, version: str, files: tuple[str, ...], calls: tuple[RunnerCall, ...],
              setters: tuple[str, ...], graph_default: str | None = None) -> RunnerModel:
    """Whether the calls found add up to one verified answer, and why not."""
    if not calls:
        return RunnerModel(engine, version, files, calls, False,
                           f"no call of {'/'.join(setters)} found in {len(files)} runner file(s): not verified")
    open_ = [c for c in calls if c.passes in ("passed_in", "unknown")]
    if open_:
        why = "; ".join(f"{c.where}: {c.detail}" for c in open_)
        return RunnerModel(engine, version, files, calls, False, f"not verified: {why}")
    kinds = {c.passes for c in calls}
    if kinds == {"default"}:
        where = ", ".join(f"{c.where} ({c.default_method or 'no ids'})" for c in calls)
        return RunnerModel(engine, version, files, calls, True,
                           f"the runner ignores the draft's ids: {where} always pass the model's default")
    if kinds == {"draft_ids"}:
        return RunnerModel(engine, version, files, calls, True, "the runner passes the draft config's ids")
    both = ", ".join(f"{c.where} ({c.passes})" for c in calls)
    if graph_default is not None:
        return RunnerModel(engine, version, files, calls, False, f"not verified: {graph_default}", graph_default)
    return RunnerModel(engine, version, files, calls, False,
                       f"not verified: some calls pass the draft's ids and some the default ({both}); "
                       "which one the model keeps depends on their order at runtime, which is not modelled")
