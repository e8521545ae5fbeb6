"""What an engine probe finds out: typed, executable descriptions of a model class's capture setter.

A probe reads an engine's installed source (never importing it) and, for each model class that
can capture auxiliary hidden states, builds a :class:`ClassConvention`. The convention is data
(``surgeon conventions --json`` prints it through its output model) and code: :meth:`ClassConvention.capture`
replays the setter's logic on a list of ids, so callers can feed ids through exactly what the
installed engine would do instead of trusting a table.

Positions are residual-stream positions: ``0`` is ``embed`` (the state entering layer 0),
``k + 1`` is ``layer_out[k]``. Both engines' capture indices turn out to be stream positions
(SGLang captures at the *entry* of layer ``c``, which is stream position ``c``; vLLM captures
``idx + 1`` *after* layer ``idx``), but which positions are reachable differs, which is why the
capture site is recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from surgeon.core.runnerfacts import RunnerModel

Engine = Literal["sglang", "vllm"]
CaptureSite = Literal["entry", "exit"]
CapturedValue = Literal["residual_stream", "layer_output_without_residual", "unknown"]
# Where a capture site sits relative to the decoder-layer loop: before it (index start_layer, the
# embedding on the first rank), in it before the layer call (indices start..end-1), in it after the
# layer call (indices start+1..end), after it (index end_layer, the last layer's output).
SiteWhere = Literal["before_loop", "loop_entry", "loop_exit", "after_loop"]
EvidenceRole = Literal["setter", "default", "loop", "capture_site", "runner"]


@dataclass(frozen=True)
class SiteRecord:
    """One capture site as read in the engine source: where it is, which indices it can see and
    what expression it appends. ``first_index_fails``: why the expression cannot be evaluated at
    the first index the site sees (``hidden_states + residual`` while ``residual`` is still None
    before layer 0), with the line that sets it None; None when it evaluates there."""

    where: SiteWhere
    path: str
    line: int
    expression: str
    value: CapturedValue
    first_index_fails: str | None = None
    verified: bool = True
    unverified_reason: str | None = None  # what was not read, when not verified

    def covers(self, position: int, num_layers: int) -> bool:
        lo, hi = {"before_loop": (0, 0), "loop_entry": (0, num_layers - 1),
                  "loop_exit": (1, num_layers), "after_loop": (num_layers, num_layers)}[self.where]
        return lo <= position <= hi

    def first_index(self, num_layers: int) -> int:
        return {"before_loop": 0, "loop_entry": 0, "loop_exit": 1, "after_loop": num_layers}[self.where]

    def describe(self, num_layers: int | None = None) -> str:
        span = {"before_loop": "index 0 (before the loop)", "loop_entry": "indices start..end-1 (at each layer's entry)",
                "loop_exit": "indices start+1..end (after each layer)", "after_loop": "index L (after the loop)"}[self.where]
        return f"{self.path}:{self.line}: {span}: {self.expression}"


@dataclass(frozen=True)
class Evidence:
    """A source line an answer rests on: the setter, the default, the loop, a capture site, the
    model runner's call (filled by :mod:`surgeon.engines.probes.runner` where it reads one)."""

    role: EvidenceRole
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.role}: {self.path}:{self.line}: {self.what}"


@dataclass(frozen=True)
class DefaultTerm:
    """One entry of a default id list, as a function of the layer count ``L``:
    ``L * mul // div + add`` (``2`` is (0, 1, 2); ``L // 2`` is (1, 2, 0); ``L - 3`` is (1, 1, -3))."""

    mul: int
    div: int
    add: int

    def evaluate(self, num_layers: int) -> int:
        return num_layers * self.mul // self.div + self.add

    def __str__(self) -> str:
        if self.mul == 0:
            return str(self.add)
        base = "L" if self.mul == 1 else f"{self.mul}*L"
        if self.div != 1:
            base = f"{base}//{self.div}"
        if self.add:
            base = f"{base}{'+' if self.add > 0 else '-'}{abs(self.add)}"
        return base


@dataclass(frozen=True)
class FirstIdEquals:
    """Condition of a branch: the first explicit id equals ``value`` (deepseek_v2.py's rule)."""

    value: int

    def holds(self, ids: Sequence[int], num_layers: int | None = None) -> bool:
        return len(ids) > 0 and ids[0] == self.value

    def __str__(self) -> str:
        return f"ids[0] == {self.value}"


@dataclass(frozen=True)
class MaxIdEquals:
    """Condition of a branch: the largest explicit id equals ``term`` evaluated at the layer count
    (gpt_oss.py's ``if layer_ids and max(layer_ids) == num_layers``). Needs ``num_layers``."""

    term: DefaultTerm

    def holds(self, ids: Sequence[int], num_layers: int | None = None) -> bool:
        if num_layers is None:
            raise ValueError(f"the condition {self} needs the layer count")
        return len(ids) > 0 and max(ids) == self.term.evaluate(num_layers)

    def __str__(self) -> str:
        return f"max(ids) == {self.term}"


@dataclass(frozen=True)
class Branch:
    """``offset`` is added to every explicit id when ``condition`` holds (``None``: always)."""

    offset: int
    condition: FirstIdEquals | MaxIdEquals | None = None


@dataclass(frozen=True)
class IdRule:
    """How the setter turns explicit ids into capture indices: the first branch whose condition
    holds applies. An unconditional ``+1`` is ``IdRule((Branch(1),))``."""

    branches: tuple[Branch, ...]

    def apply(self, ids: Sequence[int], num_layers: int | None = None) -> list[int]:
        for branch in self.branches:
            if branch.condition is None or branch.condition.holds(ids, num_layers):
                return [i + branch.offset for i in ids]
        raise AssertionError("an IdRule must end with an unconditional branch")

    @property
    def name(self) -> str:
        """Stable name used in specs (``engines.<e>.offset``) and reports: ``+1``, ``+0``, or
        ``+1 if ids[0] == 1 else +0``."""
        parts = []
        for branch in self.branches:
            text = f"{branch.offset:+d}"
            if branch.condition is not None:
                text = f"{text} if {branch.condition} else"
            parts.append(text)
        return " ".join(parts)

    @property
    def conditional(self) -> bool:
        return any(b.condition is not None for b in self.branches)


@dataclass(frozen=True)
class Bypass:
    """A path that runs decoder layers without the capture check: captures requested for
    layers on it silently do not happen."""

    line: int
    description: str
    # Layers (global indices, as a function of the model's config) that can take the path, in
    # words, e.g. "layers >= config.first_k_dense_replace when forward_batch.can_run_tbo".
    layers: str
    # File of ``line`` (relative to the engine root): the bypass may live in another file than the
    # class it affects (an inherited or delegated model). None: the class's own file.
    path: str | None = None


@dataclass(frozen=True)
class ClassConvention:
    """What a model class's explicit ids mean on one engine version."""

    engine: Engine
    path: str  # relative to the engine root, '/'-separated, e.g. "srt/models/deepseek_v2.py"
    class_name: str
    line: int
    status: Literal["classified", "unclassified"]
    reason: str | None = None  # why unclassified, or notes
    setter: str | None = None  # e.g. "set_eagle3_layers_to_capture"
    setter_owner: str | None = None  # "path:Class" where the setter body lives (may be a base)
    id_rule: IdRule | None = None
    # Capture indices used when no ids are given; None: the engine refuses or has no default.
    default: tuple[DefaultTerm, ...] | None = None
    # True when the default list goes through id_rule like explicit ids (vLLM); False when it is
    # already capture indices (SGLang's [2, L//2, L-3]).
    default_through_rule: bool = False
    sorts: bool = False  # the setter sorts the ids
    dedups: bool = False  # the setter (or membership test) removes duplicates
    # "layer": captures are emitted in layer-loop order whatever the id order;
    # "ids": in the order the ids were given.
    emit_order: Literal["layer", "ids"] = "layer"
    capture_site: CaptureSite = "entry"
    captured_value: CapturedValue = "unknown"
    loop_owner: str | None = None  # "path:Class.method" of the decoder-layer loop
    bypasses: tuple[Bypass, ...] = ()
    # An entry-site model that also captures after its layer loop when asked for index L (the last
    # layer's output, before the final norm): index L is then reachable too.
    tail_capture: bool = False
    # On an unclassified class: the source shows it cannot capture at all (its setter always fails,
    # or nothing reads the stored ids, or its layers ignore the capture argument). A finding about
    # the engine, as opposed to a class the probe cannot read.
    no_capture: bool = False
    # On an unclassified class: it hands the ids to a language model whose class the engine picks at
    # run time from the checkpoint (vLLM init_vllm_registered_model without architectures=): decided,
    # the ids mean what they mean for that text model's class, which the reason names how to find.
    delegates: bool = False
    # The capture sites read (empty: the built-in table, or a probe that recorded none; then
    # reachability falls back to capture_site/tail_capture).
    sites: tuple[SiteRecord, ...] = ()
    # False when part of the answer rests on code the probe could not read (a captured value it
    # cannot tell, a helper in a module it could not follow); the reason says what.
    verified: bool = True
    unverified_reason: str | None = None
    evidence: tuple[Evidence, ...] = ()

    # -- the executable part -------------------------------------------------------------
    def capture_indices(self, ids: Sequence[int] | None, num_layers: int) -> list[int]:
        """Replay the setter: the capture indices the engine stores for ``ids`` (``None``: no ids
        given, so the default). Raises ValueError when the engine has no default."""
        if self.status != "classified" or self.id_rule is None:
            raise ValueError(f"{self.class_name}: convention not classified ({self.reason})")
        if ids is None:
            if self.default is None:
                raise ValueError(f"{self.class_name}: the engine has no default id list")
            raw = [t.evaluate(num_layers) for t in self.default]
            indices = self.id_rule.apply(raw, num_layers) if self.default_through_rule else raw
        else:
            indices = self.id_rule.apply(list(ids), num_layers)
        return indices

    def reachable(self, num_layers: int) -> frozenset[int]:
        """Capture indices the engine can actually capture: covered by a capture site whose
        expression evaluates there. Without recorded sites: entry captures see layers 0..L-1
        (and L when the model also captures after its loop, ``tail_capture``), exit captures see
        0 (before the loop) and 1..L (after each layer)."""
        if not self.sites:
            hi = num_layers + 1 if self.capture_site == "exit" or self.tail_capture else num_layers
            return frozenset(range(0, hi))
        return frozenset(p for p in range(0, num_layers + 1) if self.refusal(p, num_layers) is None)

    def refusal(self, position: int, num_layers: int) -> str | None:
        """Why capture index ``position`` cannot be captured (file:line of the capture site and the
        reason), or None when a site captures it."""
        if not self.sites:
            if position in self.reachable(num_layers):
                return None
            return (f"{self.path}:{self.line}: captures at the entry of a layer, so index {position} (the entry of "
                    f"layer {position}, which does not exist) is never captured" if self.capture_site == "entry"
                    else f"index {position} is past the last layer")
        covering = [s for s in self.sites if s.covers(position, num_layers)]
        if not covering:
            read = "; ".join(s.describe() for s in self.sites)
            what = f"index {position}"
            if position == num_layers:
                what += f" (layer_out[{num_layers - 1}], the last layer's output)"
            elif position == 0:
                what += " (embed)"
            if position == num_layers and any(s.where == "loop_entry" for s in self.sites):
                return (f"the loop captures at the entry of a layer, so {what}, the entry of layer {num_layers} "
                        f"(which does not exist), is never captured, and nothing captures after the loop; "
                        f"the sites read are {read}")
            return f"no capture site reaches {what}: the sites read are {read}"
        failing = [s for s in covering if s.first_index_fails and s.first_index(num_layers) == position]
        if len(failing) == len(covering):
            s = failing[0]
            return (f"{s.path}:{s.line}: {s.expression} cannot be evaluated at index {position}: "
                    f"{s.first_index_fails}")
        return None

    def site_for(self, position: int, num_layers: int) -> SiteRecord | None:
        """The capture site that captures ``position`` (None: none, or no sites recorded)."""
        for s in self.sites:
            if s.covers(position, num_layers) and not (s.first_index_fails and s.first_index(num_layers) == position):
                return s
        return None

    def unverified_for(self, positions: Sequence[int] | None = None, num_layers: int | None = None) -> str | None:
        """Why an answer about ``positions`` rests on code the probe did not read (None: it does
        not). Only the capture sites those positions use count: an unread capture after the loop
        does not make an answer about layers inside it unverified. Without positions, or without
        recorded sites: the class as a whole (``verified``)."""
        if positions is None or num_layers is None or not self.sites:
            return None if self.verified else (self.unverified_reason or "not read")
        reasons: list[str] = []
        for p in positions:
            site = self.site_for(p, num_layers)
            if site is not None and not site.verified:
                reasons.append(site.unverified_reason or f"{site.path}:{site.line}: not read")
        return "; ".join(dict.fromkeys(reasons)) or None

    def evidence_of(self, role: EvidenceRole) -> list[Evidence]:
        return [e for e in self.evidence if e.role == role]

    def capture(self, ids: Sequence[int] | None, num_layers: int) -> list[int | None]:
        """Stream positions the engine emits, in the order it emits them. An index the loop never
        reaches yields ``None`` in its place (emitted nowhere; kept so callers can name it)."""
        indices = self.capture_indices(ids, num_layers)
        if self.dedups:
            seen: dict[int, None] = {}
            for i in indices:
                seen.setdefault(i, None)
            indices = list(seen)
        if self.sorts or self.emit_order == "layer":
            indices = sorted(indices)
        ok = self.reachable(num_layers)
        return [i if i in ok else None for i in indices]


@dataclass(frozen=True)
class PlatformTarget:
    """What one registered architecture runs on one platform (read from the package's dispatch)."""

    platform: str  # "cuda", "rocm", "cpu", ...
    path: str | None  # the file of the class that runs; None when not verified or nothing runs
    class_name: str
    line: int
    evidence: str  # "file:line <the import that decides>"
    verified: bool
    reason: str | None = None  # why not verified: the candidates and the unevaluable conditions
    convention: str | None = None  # key of EngineProbe.classes when that class was probed

    def label(self) -> str:
        if not self.verified or self.path is None:
            return f"{self.platform}: unverified ({self.reason})"
        return f"{self.platform} runs {self.path}:{self.line} {self.class_name}"


@dataclass(frozen=True)
class ArchDispatch:
    """A registry entry that names a package dispatching per platform (vLLM ``vllm.models.<family>``):
    what runs on the probe's platform and on the others, and whether they differ."""

    architecture: str
    module: str  # the registry's module, e.g. "vllm.models.deepseek_v32"
    platform: str  # the probe's platform (``targets[0]``)
    targets: tuple[PlatformTarget, ...]
    disagree: str | None = None  # a sentence when platforms run other classes or capture otherwise

    @property
    def here(self) -> PlatformTarget:
        return self.targets[0]

    def text(self) -> str:
        out = f"{self.architecture}: " + "; ".join(t.label() for t in self.targets)
        return out + (f": {self.disagree}" if self.disagree else "")


@dataclass
class EngineProbe:
    """Everything one probe run found in one engine root."""

    engine: Engine
    version: str  # "unknown" when no metadata could be read
    root: str
    classes: dict[str, ClassConvention] = field(default_factory=dict)
    files_scanned: int = 0
    # Keys of ``classes`` whose own body defines the capture interface (SGLang: the setter; vLLM:
    # SupportsEagle3/EagleModelMixin in the bases, a setter/default override, or the attribute),
    # as opposed to classes that only inherit it.
    defining: set[str] = field(default_factory=set)
    # Architecture name (config.json ``architectures``) -> key of ``classes``, from the engine's
    # registry (SGLang ``EntryClass``, vLLM ``registry.py``), for registered classes probed here.
    architectures: dict[str, str] = field(default_factory=dict)
    # What the engine's model runner hands the setter (surgeon.engines.probes.runner); None: not read.
    runner: RunnerModel | None = None
    # The platform the answers hold for ("cuda", "rocm", "cpu"; "all" where the engine does not
    # dispatch per platform), and the registered architectures whose class depends on it.
    platform: str = "all"
    dispatch: dict[str, ArchDispatch] = field(default_factory=dict)
    # Every registered architecture the probe found no capture interface for -> "path:line Class"
    # of the class the registry names: why such a class cannot be rendered is then located.
    registered: dict[str, str] = field(default_factory=dict)
    # Model files the probe's reader could not handle (a construct it raised on): path -> why. Their
    # classes are not answered; every other file's are.
    unreadable: dict[str, str] = field(default_factory=dict)

    def get(self, class_name: str) -> ClassConvention | None:
        """The convention of a class by key (its name), else by registered architecture name. An
        architecture dispatched per platform is what runs on this probe's platform (None when that
        is not verified or not a capture class), never a same-named class elsewhere."""
        routed = self.dispatch.get(class_name)
        if routed is not None:
            here = routed.here
            return self.classes.get(here.convention) if here.verified and here.convention else None
        found = self.classes.get(class_name)
        if found is None and class_name in self.architectures:
            found = self.classes.get(self.architectures[class_name])
        return found

    @property
    def classified(self) -> list[ClassConvention]:
        return [c for c in self.classes.values() if c.status == "classified"]

    @property
    def unclassified(self) -> list[ClassConvention]:
        return [c for c in self.classes.values() if c.status == "unclassified"]

    def coverage(self) -> dict[str, dict[str, int]]:
        """Counts per group: every probed class, and the classes whose own body defines the
        capture interface (``defining``). ``no_capture`` classes (the source shows they cannot
        capture) and ``delegates`` classes (the ids go to a text model the checkpoint picks) are
        decided, not gaps."""
        def count(classes: list[ClassConvention]) -> dict[str, int]:
            return {"total": len(classes),
                    "classified": sum(c.status == "classified" for c in classes),
                    "no_capture": sum(c.status != "classified" and c.no_capture for c in classes),
                    "delegates": sum(c.status != "classified" and c.delegates and not c.no_capture for c in classes),
                    "unclassified": sum(c.status != "classified" and not c.no_capture and not c.delegates
                                        for c in classes)}
        defining = [self.classes[k] for k in sorted(self.defining) if k in self.classes]
        out = {"all classes": count(list(self.classes.values())), "defining classes": count(defining)}
        # per models directory, where the release has more than one (vLLM 0.32+: models/<family>/...)
        dirs = sorted({c.path.split("/models/")[0] + "/models" if "/models/" in c.path else c.path.split("/")[0]
                       for c in self.classes.values()})
        if len(dirs) > 1:
            for d in dirs:
                out[f"defining classes in {d}/"] = count([c for c in defining if c.path.startswith(d + "/")])
        return out
