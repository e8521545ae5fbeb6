"""What an engine release offers besides a patched model file, read from its source: its own
hidden-state capture route (vLLM's ``extract_hidden_states`` speculative method with its KV
connector; SGLang's ``--enable-return-aux-hidden-states``) and its plugin mechanism (vLLM's
``vllm.general_plugins`` entry points; SGLang's ``SGLANG_EXTERNAL_MODEL_PACKAGE``).

Every fact carries the line of the release's source it was read from (:class:`SourceCite`); a
condition only a public thread states is marked ``read=False``. Filled by
:mod:`surgeon.engines.probes.native`; frozen data, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceCite:
    """One line of an engine release: ``path`` relative to the engine root (posix), 1-based
    ``line``, and the line itself, stripped, verbatim."""

    path: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class RouteCondition:
    """A check or a hazard of a route. ``code`` names the kind (``"mla"``, ``"pp"``, ``"draft"``,
    ``"spec_tokens"``, ``"sampling"``, ``"ids"``, ``"pin_memory"``, ``"prefix_caching"``, ...);
    ``text`` says in one line what the source does; ``thread`` names a public thread
    (``"vllm#44485"``) where only that thread says it; ``read`` is False when the condition was not
    read from this release's source. A ``text`` starting ``"undecided:"`` reports evidence that
    does not decide."""

    code: str
    text: str
    cite: SourceCite | None
    thread: str | None = None
    read: bool = True

    @property
    def undecided(self) -> bool:
        return self.text.startswith("undecided:")


@dataclass(frozen=True)
class NativeCapture:
    """The engine's own capture route in one release.

    ``switch``: vLLM: the speculative method and the KV connector names as read; SGLang: the flags.
    ``defined``: where the method / flag is defined. ``ids_read``: where the route reads the ids
    (vLLM: ``eagle_aux_hidden_state_layer_ids`` in the proposer; SGLang: where
    ``--return-aux-hidden-state-layer-ids`` is read on its way to the model's setter);
    ``id_reads``: every such read found (vLLM 0.32/0.33 have two proposers, one per model
    runner), ``ids_read`` being the first. ``algorithms``: SGLang's ``--speculative-algorithm``
    values the route accepts, read from its check. ``setters``: (algorithm, model setter called,
    where), in the order the source prefers them (SGLang's DSPARK falls back to the DFLASH setter).
    ``refusals``: checks that stop the route; ``hazards``: what endangers what it writes.
    ``writes``: what the route writes, as read. ``final_state``: whether the final norm's output
    can be written (it cannot, on either engine: the text says where that is bounded).
    ``files``: the files read (relative to the engine root)."""

    engine: str
    version: str
    available: bool
    reason: str
    switch: tuple[str, ...] = ()
    defined: SourceCite | None = None
    ids_read: SourceCite | None = None
    algorithms: tuple[str, ...] = ()
    setters: tuple[tuple[str, str, SourceCite], ...] = ()
    refusals: tuple[RouteCondition, ...] = ()
    hazards: tuple[RouteCondition, ...] = ()
    writes: tuple[str, ...] = ()
    final_state: RouteCondition | None = None
    id_reads: tuple[SourceCite, ...] = ()
    files: tuple[str, ...] = ()

    def refusal(self, code: str) -> tuple[RouteCondition, ...]:
        return tuple(r for r in self.refusals if r.code == code)

    def hazard(self, code: str) -> tuple[RouteCondition, ...]:
        return tuple(h for h in self.hazards if h.code == code)

    def setters_for(self, algorithm: str) -> tuple[tuple[str, SourceCite], ...]:
        """The model setters ``algorithm`` selects, preferred first."""
        return tuple((s, c) for a, s, c in self.setters if a.upper() == algorithm.upper())


@dataclass(frozen=True)
class PluginLoader:
    """How the release loads out-of-tree code: ``kind`` ``"entry_points"`` (vLLM) or
    ``"env_package"`` (SGLang), ``name`` the group or variable as read, ``cite`` where it is read.
    ``errors``: what happens to an error in the plugin, as read (vLLM: an import error is logged
    and skipped, an exception raised by the plugin's function stops the engine start)."""

    engine: str
    version: str
    available: bool
    kind: str
    name: str
    cite: SourceCite | None
    reason: str
    errors: str | None = None
    error_cites: tuple[SourceCite, ...] = ()


@dataclass(frozen=True)
class RouteFacts:
    native: NativeCapture
    plugin: PluginLoader
