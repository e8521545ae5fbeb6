"""Turn a setter's symbolic runs and its holder's capture loop into a :class:`ClassConvention`.

Shared by both engines: an engine module says *which* classes to look at and *how* the engine
drives them (:class:`EntryPoint`); this module runs the setter with explicit ids and without ids,
checks that every runtime-dependent path agrees, assembles the id rule from the paths that
depend on the ids themselves, and describes the capture loop of the class the ids end up in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from surgeon.core.errors import SurgeonError, unreadable
from surgeon.core.idrules import Branch, ClassConvention, DefaultTerm, Engine, Evidence, IdRule
from surgeon.engines.interp import (
    Const,
    FlagMark,
    Hooks,
    Interp,
    Lin,
    Lost,
    Obj,
    Outcome,
    Raised,
    Seq,
    Store,
    TooManyPaths,
    Unknown,
    Value,
    describe,
    explore,
)
from surgeon.engines.probes.capture import CaptureAnalyzer, CaptureResult
from surgeon.engines.probes.recorder import RecorderUnreadable, read_recorder, records_outputs
from surgeon.engines.source.index import ClassKey, SourceIndex, key_str


@dataclass(frozen=True)
class EntryPoint:
    """How the engine hands ids to a class."""

    setter: str | None  # method called with the id list; None: the attribute is written directly
    attr: str | None = None  # with setter None: the attribute that holds the capture indices
    default_method: str | None = None  # method returning the default list (vLLM); None: setter(None)
    default_through_rule: bool = False


@dataclass(frozen=True)
class Target:
    key: ClassKey
    entry: EntryPoint
    defines: bool  # the class's own body defines the capture interface (the coverage denominator)


# The words an engine hook puts in the reason of a value that is a language model the engine picks
# at run time from the checkpoint (probes.vllm's init_vllm_registered_model without architectures=):
# ids lost into it make a "delegates" answer, not a gap.
RUNTIME_LANGUAGE_MODEL = "a language model whose class the registry picks at runtime"


class Unclassifiable(Exception):
    def __init__(self, message: str, no_capture: bool = False, delegates: bool = False) -> None:
        super().__init__(message)
        self.no_capture = no_capture
        self.delegates = delegates


@dataclass
class _Leaf:
    preds: tuple  # ((condition, held), ...) in the order the setter tested them
    others: dict  # runtime assumptions (labels) this path took
    holder: Obj
    attr: str
    seq: Seq
    flags: tuple  # (flag, offset) armed on the holder's layers
    where: str
    notes: list[str] = field(default_factory=list)
    store_at: tuple[str, int] | None = None  # (path, line) of the store that keeps the ids


class Classifier:
    def __init__(self, engine: Engine, index: SourceIndex, hooks: Hooks, analyzer: CaptureAnalyzer,
                 extra_notes: Callable[[ClassKey], list[str]] | None = None) -> None:
        self.engine = engine
        self.index = index
        self.hooks = hooks
        self.analyzer = analyzer
        self.extra_notes = extra_notes

    # -- runs --------------------------------------------------------------------------------
    def _run(self, key: ClassKey, method: str, args: list[Value], assumptions: dict) -> Outcome:
        it = Interp(self.index, self.hooks, assumptions)
        raised = None
        returned: Value | None = None
        try:
            returned = it.call_method(Obj(key, "self"), method, args)
        except Raised as r:
            raised = r.message
        return Outcome(it.effects, returned, raised, it.notes, it.labels)

    def _explore(self, key: ClassKey, method: str, args: list[Value]) -> list[tuple[dict, Outcome]]:
        try:
            return explore(lambda a: self._run(key, method, args, a))
        except TooManyPaths as e:
            raise Unclassifiable(f"{method} has too many runtime-dependent paths ({e})") from None

    def _leaves(self, key: ClassKey, method: str, args: list[Value], what: str) -> tuple[list[_Leaf], list[str]]:
        """Each path's final store, or raise Unclassifiable. Second value: paths that raised."""
        leaves: list[_Leaf] = []
        raised: list[str] = []
        for assumptions, out in self._explore(key, method, args):
            preds = tuple((k[1], v) for k, v in assumptions.items() if k[0] == "pred")
            others = {out.labels.get(k, str(k)): v for k, v in assumptions.items() if k[0] != "pred"}
            if out.raised:
                raised.append(out.raised + _when(others))
                continue
            stores: dict[tuple[str, str], Store] = {}
            unknown: list[Store] = []
            for e in out.effects:
                if isinstance(e, Store):
                    if isinstance(e.value, Seq):
                        stores[(e.holder.path, e.attr)] = e
                    elif isinstance(e.value, Unknown) and "layer" in e.attr:
                        unknown.append(e)
            lost = [e for e in out.effects if isinstance(e, Lost)]
            if not stores:
                if unknown:
                    u = unknown[-1]
                    raise Unclassifiable(f"{what}: {u.where} stores {describe(u.value)} into {u.holder.cls[1]}.{u.attr} "
                                         f"(line {u.line}){_when(others)}")
                if lost:
                    raise Unclassifiable(f"{what}: {lost[0].where} {lost[0].what} (line {lost[0].line}){_when(others)}",
                                         delegates=RUNTIME_LANGUAGE_MODEL in lost[0].what)
                raise Unclassifiable(f"{what}: the setter stores no id list the probe can follow"
                                     + (f" ({'; '.join(out.notes)})" if out.notes else _when(others)))
            chosen = self._capture_store(list(stores.values()))
            flags = tuple(sorted(
                (f.flag, f.seq.offset if isinstance(f.seq, Seq) else None)
                for f in out.effects if isinstance(f, FlagMark) and f.holder.path == chosen.holder.path
            ))
            # every store kept in ``stores`` holds a Seq (the isinstance test above)
            at = (chosen.site.fn.path, chosen.line) if chosen.site.fn is not None else None
            leaves.append(_Leaf(preds, others, chosen.holder, chosen.attr, cast(Seq, chosen.value), flags, chosen.where,
                                list(out.notes), at))
        return leaves, raised

    def _capture_store(self, stores: list[Store]) -> Store:
        if len(stores) == 1:
            return stores[0]
        read = [s for s in stores if self.analyzer.analyze(s.holder.cls, s.attr).site is not None]
        if len(read) == 1:
            return read[0]
        raise Unclassifiable("the setter stores ids into several places: "
                             + ", ".join(f"{s.holder.cls[1]}.{s.attr}" for s in stores))

    # -- the id rule -------------------------------------------------------------------------
    @staticmethod
    def _signature(leaf: _Leaf) -> tuple:
        return (leaf.holder.cls, leaf.attr, leaf.seq, leaf.flags)

    def _rule(self, leaves: list[_Leaf]) -> tuple[IdRule, _Leaf]:
        groups: dict[tuple, list[_Leaf]] = {}
        for leaf in leaves:
            groups.setdefault(leaf.preds, []).append(leaf)
        for group in groups.values():
            sigs = {self._signature(lf) for lf in group}
            if len(sigs) > 1:
                differ = sorted({label for lf in group for label in lf.others})
                raise Unclassifiable("what the setter stores depends on " + "; ".join(differ) + ": "
                                     + " vs ".join(_store_text(lf) for lf in group))
        heads = [g[0] for g in groups.values()]
        shape = {(lf.holder.cls, lf.attr, lf.seq.sorted, lf.seq.dedup, lf.seq.terms, tuple(f for f, _ in lf.flags))
                 for lf in heads}
        if len(shape) > 1:
            raise Unclassifiable("the setter's branches store into different places: "
                                 + " vs ".join(_store_text(lf) for lf in heads))
        if any(not lf.seq.explicit for lf in heads):
            raise Unclassifiable(f"the setter ignores explicit ids and always stores {_store_text(heads[0])}")
        branches: list[tuple[int, Branch]] = []
        fallback: Branch | None = None
        for preds, group in groups.items():
            leaf = group[0]
            held = [v for _, v in preds]
            if any(held[:-1]):
                raise Unclassifiable("the id rule nests conditions on the ids: "
                                     + ", ".join(f"{c} is {v}" for c, v in preds))
            if held and held[-1]:
                branches.append((len(preds), Branch(leaf.seq.offset, preds[-1][0])))
            else:
                fallback = Branch(leaf.seq.offset)
        if fallback is None:
            raise Unclassifiable("the id rule has no unconditional branch")
        ordered = [b for _, b in sorted(branches, key=lambda t: t[0])]
        if all(b.offset == fallback.offset for b in ordered):
            ordered = []  # the condition does not change anything
        return IdRule((*ordered, fallback)), heads[0]

    # -- a class -----------------------------------------------------------------------------
    def classify(self, target: Target) -> ClassConvention:
        key = target.key
        info = self.index.class_info(key)
        base: dict[str, Any] = dict(engine=self.engine, path=key[0], class_name=key[1], line=info.line if info else 0,
                    setter=target.entry.setter or f"(attribute {target.entry.attr})")
        try:
            return self._classify(target, base)
        except Unclassifiable as e:
            return ClassConvention(status="unclassified", reason=str(e), no_capture=e.no_capture,
                                   delegates=e.delegates, **base)
        except SurgeonError:
            raise
        except Exception as e:  # code the reader cannot handle: this class unclassified, never a crash
            return ClassConvention(status="unclassified", reason=unreadable(e), **base)

    def _classify(self, target: Target, base: dict) -> ClassConvention:
        key, entry = target.key, target.entry
        notes: list[str] = []
        evidence: list[Evidence] = []
        setter_owner = None
        if entry.setter is not None:
            found = self.index.find_function(key, entry.setter)
            if found is None:
                raise Unclassifiable(f"no {entry.setter} in the class hierarchy")
            setter_owner = key_str(found[0])
            evidence.append(Evidence("setter", found[0][0], found[1].line, f"{found[0][1]}.{entry.setter}"))
            if records_outputs(self.index, found[0], found[1]):
                return self._recorded(target, base, found[0], evidence)
            leaves, raised = self._leaves(key, entry.setter, [Seq(None)], "explicit ids")
            if raised and not leaves:
                raise Unclassifiable(f"with explicit ids the setter {raised[0]}", no_capture=True)
            if raised:
                raise Unclassifiable(f"with explicit ids the setter sometimes {raised[0]}")
            rule, leaf = self._rule(leaves)
            for lf in leaves:
                notes.extend(n for n in lf.notes if n not in notes)
        else:
            rule = IdRule((Branch(0),))
            leaf = _Leaf((), {}, Obj(key, "self"), entry.attr or "", Seq(None), (), key_str(key))
            setter_owner = key_str(key)
        holder, attr, seq = leaf.holder, leaf.attr, leaf.seq
        if leaf.store_at is not None and entry.setter is not None:
            evidence.append(Evidence("setter", leaf.store_at[0], leaf.store_at[1],
                                     f"stores the ids into {holder.cls[1]}.{attr}" + (", sorted" if seq.sorted else "")
                                     + (", de-duplicated" if seq.dedup else "")))
        if holder.cls != key:
            notes.append(f"ids stored in {holder.path}.{attr}, a {holder.cls[1]} ({holder.cls[0]})")

        default, default_notes = self._default(target, holder, attr)
        notes.extend(default_notes)

        flags = [f for f, _ in leaf.flags]
        if any(off is not None and off != seq.offset for _, off in leaf.flags):
            raise Unclassifiable("the per-layer capture flags and the stored list disagree")
        cap: CaptureResult = self.analyzer.analyze(holder.cls, attr, tuple(flags))
        if cap.problem or cap.site is None:  # the analyzer names a site whenever it reports no problem
            raise Unclassifiable(cap.problem or "the capture analysis named no capture site", no_capture=cap.no_capture)
        notes.extend(cap.notes)
        if self.extra_notes:
            notes.extend(self.extra_notes(key))
        if cap.loop_line is not None:
            evidence.append(Evidence("loop", cap.loop_line[0], cap.loop_line[1], f"decoder-layer loop of {cap.loop_owner}"))
        evidence.extend(Evidence("capture_site", s.path, s.line, f"{s.where}: {s.expression}") for s in cap.sites)
        unverified = [s.unverified_reason or f"{s.path}:{s.line}: not read" for s in cap.sites if not s.verified]
        if holder.assumed:  # the holder's class rests on a constructor default a caller may override
            unverified.insert(0, holder.assumed)
        if cap.value == "unknown" and not unverified:
            unverified.append(f"the value {cap.loop_owner} captures was not read to the residual stream or a layer output")
        return ClassConvention(
            status="classified",
            reason="; ".join(dict.fromkeys(notes)) or None,
            setter_owner=setter_owner,
            id_rule=rule,
            default=default,
            default_through_rule=entry.default_through_rule,
            sorts=seq.sorted,
            dedups=True,  # captures are taken by a membership test: each layer at most once
            emit_order="layer",
            capture_site=cap.site,
            captured_value=cap.value,
            loop_owner=cap.loop_owner,
            bypasses=tuple(cap.bypasses),
            tail_capture=bool(cap.tail and cap.site == "entry"),
            sites=tuple(cap.sites),
            verified=not unverified,
            unverified_reason="; ".join(dict.fromkeys(unverified)) or None,
            evidence=tuple(evidence),
            **base,
        )

    def _recorded(self, target: Target, base: dict, owner: ClassKey, evidence: list[Evidence]) -> ClassConvention:
        """A setter that hooks an HF ``OutputRecorder`` on one decoder layer per id
        (:mod:`surgeon.engines.probes.recorder`): no loop of the engine's own reads the ids."""
        assert target.entry.setter is not None
        try:
            rec = read_recorder(self.index, owner, target.entry.setter, target.key)
        except RecorderUnreadable as e:
            raise Unclassifiable(str(e)) from None
        default, notes = self._default(target, Obj(target.key, "self"), "")
        notes = [*rec.notes, *notes, *(self.extra_notes(target.key) if self.extra_notes else [])]
        return ClassConvention(
            status="classified",
            reason="; ".join(dict.fromkeys(notes)) or None,
            setter_owner=key_str(owner),
            id_rule=IdRule((Branch(rec.offset),)),
            default=default,
            default_through_rule=target.entry.default_through_rule,
            sorts=False,
            dedups=True,  # one recorder per id: a repeated id re-registers the same key
            emit_order="ids",
            capture_site="exit",
            captured_value="residual_stream",
            loop_owner=None,  # the decoder loop is the HF model's, not the engine's
            sites=rec.sites(),
            verified=not rec.unverified,
            unverified_reason="; ".join(rec.unverified) or None,
            evidence=(*evidence, *rec.evidence),
            **base,
        )

    def _default(self, target: Target, holder: Obj, attr: str) -> tuple[tuple[DefaultTerm, ...] | None, list[str]]:
        entry = target.entry
        key = target.key
        if entry.default_method is not None:
            found = self.index.find_function(key, entry.default_method)
            if found is None:
                return None, [f"no {entry.default_method}: no default"]
            outs = self._explore(key, entry.default_method, [])
            values: set[tuple[str, str | tuple[Lin, ...]]] = set()
            for _assumptions, out in outs:
                if out.raised:
                    values.add(("raises", out.raised))
                elif isinstance(out.returned, Seq) and out.returned.terms is not None:
                    values.add(("terms", out.returned.terms))
                else:
                    values.add(("unknown", describe(out.returned) if out.returned is not None else "nothing"))
            if len(values) != 1:
                raise Unclassifiable(f"{entry.default_method} depends on runtime conditions: {sorted(map(str, values))}")
            kind, value = values.pop()
            if kind == "terms":
                return tuple(t.term() for t in cast("tuple[Lin, ...]", value)), []  # "terms" pairs with a Seq's terms
            if kind == "raises":
                return None, [f"{entry.default_method} {value}: no default"]
            raise Unclassifiable(f"cannot read the default list from {key_str(found[0])}.{entry.default_method} ({value})")
        if entry.setter is None:
            return None, []
        found = self.index.find_function(key, entry.setter)
        assert found is not None
        args = found[1].node.args
        positional = [*args.posonlyargs, *args.args][1:]
        if not positional or len(args.defaults) < len(positional):
            return None, [f"{entry.setter} requires the ids: no default"]
        leaves, raised = self._leaves(key, entry.setter, [Const(None)], "no ids")
        if raised and not leaves:
            return None, [f"without ids the setter {raised[0]}: no default"]
        if raised:
            raise Unclassifiable(f"without ids the setter sometimes {raised[0]}")
        sigs = {self._signature(lf) for lf in leaves}
        if len(sigs) > 1:
            raise Unclassifiable("the default depends on " + "; ".join(sorted({lab for lf in leaves for lab in lf.others})))
        leaf = leaves[0]
        if (leaf.holder.cls, leaf.attr) != (holder.cls, attr):
            raise Unclassifiable(f"the default goes to {leaf.holder.cls[1]}.{leaf.attr}, explicit ids to {holder.cls[1]}.{attr}")
        if leaf.seq.terms is None:
            raise Unclassifiable("without ids the setter stores something the probe cannot read")
        return tuple(t.term() for t in leaf.seq.terms), []


def _when(others: dict) -> str:
    if not others:
        return ""
    return " when " + " and ".join(f"{k} is {v}" for k, v in others.items())


def _store_text(leaf: _Leaf) -> str:
    s = leaf.seq
    what = (f"ids{s.offset:+d}" if s.explicit else "[" + ", ".join(str(t.term()) for t in s.terms or ()) + "]")
    return f"{leaf.holder.cls[1]}.{leaf.attr} = {what}{_when(leaf.others)}"
