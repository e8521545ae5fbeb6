"""Where and what a model captures: the decoder-layer loop that reads the capture list.

Given the class that holds the ids (the *holder*, found by running the setter) and the attribute
they were stored in, this module finds the methods of the holder's hierarchy whose layer loop
tests that attribute, and reads off:

* the **capture site**: a capture before the layer call (or handed to the layer and taken at its
  entry) under index ``i`` is the state *entering* layer ``i`` (``entry``); one after the call
  under index ``i + 1`` is the state *leaving* layer ``i`` (``exit``). Both are stream position
  ``index``; any other pairing is refused;
* the **captured value**: ``hidden_states + residual`` (or an engine API documented to take the
  residual stream) is the residual stream; ``hidden_states`` alone where the loop carries the
  residual separately is the layer's output without it;
* captures before the loop (index 0) and after it (index ``L``);
* **bypasses**: other calls in the same method that run decoder layers (``self.layers[a:b]``
  handed to a helper, another loop) without the capture test.

Everything is read with libcst matchers on the parsed methods; nothing is keyed on file or class
names.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from surgeon.core.idrules import Bypass, CapturedValue, CaptureSite, SiteRecord, SiteWhere
from surgeon.engines.source.anatomy import (
    STREAM_SNAPSHOT_CALLS,
    LayerLoop,
    hands_layers_on,
    index_offset,
    layer_loops,
)
from surgeon.engines.source.follow import HelperFollower
from surgeon.engines.source.index import ClassKey, CstFunction, FuncInfo, SourceIndex, code, key_str

_SELF_LAYERS = m.Attribute(value=m.Name("self"), attr=m.Name("layers"))

# SGLang's layer-boundary API (sglang/srt/layers/layer_boundary/stage.py): a decoder layer hands
# ``capture=`` / ``capture_gathered=`` to its attention boundary's ``prepare``, which captures the
# updated residual stream (hidden + residual) at the layer's entry, before the input norm.
BOUNDARY_PREPARE = "prepare"
BOUNDARY_CAPTURE_KWARGS = ("capture", "capture_gathered")
_BOUNDARY_RECEIVER = re.compile(r"(^|_)attn_boundary$")


@dataclass
class LoopCapture:
    fn: CstFunction
    loop: cst.For
    site: CaptureSite | None
    value: CapturedValue
    how: str
    problem: str | None = None
    no_capture: bool = False
    site_record: SiteRecord | None = None  # the capture site read (None with a problem)

    @property
    def owner(self) -> str:  # "path:Class.method"
        return self.fn.label

    @property
    def line(self) -> int:
        return self.fn.line(self.loop)


@dataclass
class CaptureResult:
    site: CaptureSite | None = None
    value: CapturedValue = "unknown"
    loop_owner: str | None = None
    tail: bool = False
    head: bool = False
    bypasses: list[Bypass] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problem: str | None = None  # why the capture cannot be described
    no_capture: bool = False  # the problem is that nothing captures (a finding, not a probe gap)
    sites: list[SiteRecord] = field(default_factory=list)  # every capture site read, with file:line
    loop_line: tuple[str, int] | None = None  # (path, line) of the loop_owner's capture loop


@dataclass
class _Event:
    """One capture test in a layer loop: where it sits relative to the layer call, its index
    offset, what it appends, and whether that evaluates at the first index."""

    where: str  # "before", "after", "in-layer"
    k: int
    value: CapturedValue
    how: str
    node: cst.CSTNode
    expression: str
    first_fails: str | None = None
    unverified: str | None = None


@dataclass
class _Helper:
    """A method such as vLLM's ``_maybe_add_hidden_state(aux, layer_idx, hidden, residual)``:
    ``if layer_idx in self.<attr>: aux.append(value)``."""

    owner: ClassKey
    name: str
    params: list[str]
    index_param: str
    value: cst.BaseExpression


class _LoopProblem(Exception):
    pass


def _assigns_self_layers(node: ast.Assign | ast.AnnAssign) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    flat: list[ast.expr] = []
    for t in targets:
        flat.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
    return any(isinstance(t, ast.Attribute) and t.attr == "layers" and isinstance(t.value, ast.Name) and t.value.id == "self"
               for t in flat)


def _bare(text: str) -> str:
    """``( a and b )`` -> ``a and b`` (code() keeps a parenthesised test's brackets and spaces)."""
    text = text.replace("( ", "(").replace(" )", ")")
    while text.startswith("(") and text.endswith(")") and _balanced(text[1:-1]):
        text = text[1:-1]
    return text


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if depth < 0:
            return False
    return depth == 0


def _member_of(attr: str) -> m.Comparison:
    """``<x> in self.<attr>``."""
    container = m.Attribute(value=m.Name("self"), attr=m.Name(attr))
    return m.Comparison(comparisons=[m.ComparisonTarget(operator=m.In(), comparator=container)])


def _flag_tests(fn: CstFunction, body: cst.CSTNode, flags: Sequence[str], layer_vars: frozenset[str]) -> list[cst.CSTNode]:
    if not flags:
        return []
    flag = m.SimpleString(value=m.MatchIfTrue(lambda s: s.strip("'\"") in flags))
    is_layer = m.Name(value=m.MatchIfTrue(lambda v: v in layer_vars))
    getattr_flag = m.Call(func=m.Name("getattr"), args=[m.Arg(value=is_layer), m.Arg(value=flag), m.ZeroOrMore()])
    found = fn.findall(getattr_flag, within=body)
    found += fn.findall(m.Attribute(value=is_layer, attr=m.Name(value=m.MatchIfTrue(lambda v: v in flags))), within=body)
    return found



def _residual_names(fn: CstFunction, call: cst.Call, loop: cst.For) -> tuple[set[str], set[str], bool | None]:
    """(hidden names, residual names, separate) from the layer call's assignment. ``separate``:
    the stream is ``hidden + residual`` (after the loop something consumes the two together,
    the final ``norm(hidden, residual)``); False when the final norm reads ``hidden`` alone (the
    layers return the whole stream in ``hidden``); None when the source does not say."""
    parent = fn.parent(call)
    hidden: set[str] = set()
    residual: set[str] = set()
    if isinstance(parent, cst.Assign):
        target = parent.targets[0].target
        if isinstance(target, cst.Name):
            hidden.add(target.value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            names = [e.value.value for e in target.elements if isinstance(e.value, cst.Name)]
            for n in names:
                (residual if "residual" in n else hidden).add(n)
    separate: bool | None = None
    if residual and hidden:
        after = fn.end(loop)
        used = [{a.value.value for a in c.args if isinstance(a.value, cst.Name)}
                for c in fn.findall_of(cst.Call, m.Call()) if fn.order(c) > after]
        if any(u & hidden and u & residual for u in used):
            separate = True
        elif any(u & hidden for u in used):
            separate = False
    elif hidden:
        separate = False
    return hidden, residual, separate



def _origin(fn: CstFunction, value: cst.BaseExpression, body: cst.CSTNode) -> cst.BaseExpression:
    """Look through a local bound in ``body`` (``v = h + r; v = gather(v); aux.append(v)``): the
    one assignment that does not read ``v`` itself is where the value comes from."""
    if not isinstance(value, cst.Name):
        return value
    binds = m.Assign(targets=[m.AssignTarget(target=m.Name(value.value))])
    origins = [a.value for a in fn.findall_of(cst.Assign, binds, within=body)
               if not fn.findall(m.Name(value.value), within=a.value)]
    return origins[0] if len(origins) == 1 else value


def _ifexp_target(ifexp: cst.IfExp, call: cst.Call | None, fn: CstFunction) -> tuple[str, str] | None:
    parent = fn.parent(ifexp)
    if isinstance(parent, cst.Arg) and parent.keyword is not None:
        owner_call = fn.parent(parent)
        if call is not None and owner_call is call:
            return "in-layer", parent.keyword.value
        return None
    if isinstance(parent, cst.Assign) and isinstance(parent.targets[0].target, cst.Name) and call is not None:
        var = parent.targets[0].target.value
        for arg in call.args:
            if arg.keyword is not None and m.matches(arg.value, m.Name(var)):
                return "in-layer", arg.keyword.value
    return None


def _unguarded_residual(expr: cst.BaseExpression, subst: dict[str, cst.BaseExpression],
                        residual: set[str]) -> str | None:
    """The residual name ``expr`` adds without a None guard (``hidden_states + residual``), or None
    (a conditional expression is a guard: ``h + r if r is not None else h``)."""
    if isinstance(expr, cst.Name) and expr.value in subst:
        return _unguarded_residual(subst[expr.value], {}, residual)
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
        for o in (expr.left, expr.right):
            o = subst.get(o.value, o) if isinstance(o, cst.Name) else o
            while isinstance(o, cst.Call) and isinstance(o.func, cst.Attribute) and o.func.attr.value in _SAME_VALUE:
                o = o.func.value  # ``residual.to(dtype)`` is still the residual
            if isinstance(o, cst.Name) and o.value in residual:
                return o.value
            inner = _unguarded_residual(o, {}, residual)
            if inner is not None:
                return inner
        return None
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _SAME_VALUE:
        return _unguarded_residual(expr.func.value, subst, residual)
    return None


_SAME_VALUE = ("to", "clone", "contiguous", "float")  # methods that return the same values


def _first_index_fails(fn: CstFunction, expr: cst.BaseExpression, subst: dict[str, cst.BaseExpression],
                       names: tuple[set[str], set[str], bool | None], before: cst.CSTNode) -> str | None:
    """Why ``expr`` raises at the first index a site before/at the entry of the loop sees: it adds
    a residual that ``fn`` sets to None before ``before`` (the first pipeline rank's path)."""
    _hidden, residual, _separate = names
    residual = residual | {"residual"}
    name = _unguarded_residual(expr, subst, residual)
    if name is None:
        return None
    for anc in fn.ancestors(expr):  # a statement-level guard: ``if residual is not None: aux.append(h + r)``
        if isinstance(anc, (cst.If, cst.IfExp)) and re.search(rf"\b{re.escape(name)}\s+is\s+(not\s+)?None\b",
                                                             code(anc.test)):
            return None
    none = m.Assign(targets=[m.AssignTarget(target=m.Name(name))], value=m.Name("None"))
    sets = [a for a in fn.findall_of(cst.Assign, none) if fn.order(a) < fn.order(before)]
    if not sets:
        return None
    return (f"`{name}` is None before layer 0 ({fn.path}:{fn.line(sets[0])}: `{name} = None`, on the rank that "
            f"runs layer 0) and the sum is not guarded, so the first forward raises TypeError")


def _snapshot_names(fn: CstFunction, body: cst.CSTNode) -> set[str]:
    """Names bound from a stream-snapshot API inside ``body``."""
    out: set[str] = set()
    snapshot_call = m.Call(func=m.Attribute(attr=m.Name(m.MatchIfTrue(lambda v: v in STREAM_SNAPSHOT_CALLS))))
    for a in fn.findall_of(cst.Assign, m.Assign(value=snapshot_call), within=body):
        t = a.targets[0].target
        if isinstance(t, cst.Name):
            out.add(t.value)
        elif isinstance(t, cst.Tuple) and t.elements and isinstance(t.elements[-1].value, cst.Name):
            out.add(t.elements[-1].value.value)
    return out



def _bind_helper(h: _Helper, call: cst.Call) -> dict[str, cst.BaseExpression]:
    bound: dict[str, cst.BaseExpression] = {}
    params = [p for p in h.params if p != "self"]
    for i, arg in enumerate(call.args):
        if arg.keyword is not None:
            bound[arg.keyword.value] = arg.value
        elif i < len(params) and not arg.star:
            bound[params[i]] = arg.value
    return bound


def _called_method(call: cst.Call) -> str:
    """``name`` of a ``<x>.name(...)`` call; "" when the callee is not an attribute (no helper or
    method has that name, so lookups by it simply miss)."""
    return call.func.attr.value if isinstance(call.func, cst.Attribute) else ""


class CaptureAnalyzer:
    def __init__(self, index: SourceIndex) -> None:
        self.index = index
        self._cache: dict[tuple, CaptureResult] = {}
        self._layer_loops: dict[tuple[ClassKey, str], list[LayerLoop]] = {}
        self.layer_keywords = LayerKeywords(index)
        self.surroundings = LoopSurroundings(index)

    # -- public ------------------------------------------------------------------------------
    def analyze(self, holder: ClassKey, attr: str, flags: Sequence[str] = ()) -> CaptureResult:
        key = (holder, attr, tuple(sorted(flags)))
        if key not in self._cache:
            self._cache[key] = self._analyze(holder, attr, tuple(sorted(flags)))
        return self._cache[key]

    def layer_loops(self, fn: CstFunction) -> list[LayerLoop]:
        """The anatomy's layer loops of one method (:func:`surgeon.engines.source.anatomy.layer_loops`),
        read once per (file, class, method) in a probe run: several holders share a base's
        ``forward``, and one holder is analysed for each capture attribute and flag set."""
        key = (fn.owner, fn.name)
        if key not in self._layer_loops:
            self._layer_loops[key] = layer_loops(fn.node, "layers", fn.findall)
        return self._layer_loops[key]

    # -- internals ---------------------------------------------------------------------------
    def _methods(self, holder: ClassKey) -> list[tuple[ClassKey, FuncInfo]]:
        """The methods an instance of ``holder`` runs: the most derived definition of each name,
        and a base's definition too when the override calls ``super().<name>(...)``."""
        chained: dict[str, bool] = {}  # name -> the last included definition calls super()
        out: list[tuple[ClassKey, FuncInfo]] = []
        for k in self.index.mro(holder):
            info = self.index.class_info(k)
            if info is None:
                continue
            for name, fi in info.functions.items():
                if name in chained and not chained[name]:
                    continue
                out.append((k, fi))
                chained[name] = f"super().{name}(" in self.index.function_text(k, fi)
        return out

    def _helpers(self, holder: ClassKey, attr: str) -> dict[str, _Helper]:
        helpers: dict[str, _Helper] = {}
        for owner, fi in self._methods(holder):
            name = fi.name
            text = self.index.function_text(owner, fi)
            if f"self.{attr}" not in text or ".append(" not in text:
                continue
            fn = self.index.function(owner, name)
            if fn is None or fn.findall(m.For()):
                continue  # a helper tests one index; a method with a loop is a loop owner
            params = [p.name.value for p in fn.node.params.params]
            for test in fn.findall_of(cst.If, m.If(test=_member_of(attr))):
                left = cst.ensure_type(test.test, cst.Comparison).left
                if not isinstance(left, cst.Name) or left.value not in params:
                    continue
                appended = fn.findall_of(cst.Call, m.Call(func=m.Attribute(attr=m.Name("append"))), within=test.body)
                if len(appended) != 1:
                    continue
                value = appended[0].args[0].value
                # ``value = expr; aux.append(value)``: look through one local assignment.
                if isinstance(value, cst.Name):
                    binds = m.Assign(targets=[m.AssignTarget(target=m.Name(value.value))])
                    for a in fn.findall_of(cst.Assign, binds, within=test.body):
                        value = a.value
                helpers[name] = _Helper(owner, name, params, left.value, value)
        return helpers

    def _analyze(self, holder: ClassKey, attr: str, flags: tuple[str, ...]) -> CaptureResult:
        helpers = self._helpers(holder, attr)
        loops: list[LoopCapture] = []
        result = CaptureResult()
        heads: list[str] = []
        tails: list[str] = []
        readers: list[str] = []  # methods that test the capture list or flags at all
        reads = re.compile(rf"\bin\s+self\.{re.escape(attr)}\b" + "".join(f"|{re.escape(f)}" for f in flags)
                           + "".join(rf"|self\.{re.escape(h)}\(" for h in helpers))
        for owner, fi in self._methods(holder):
            name = fi.name
            if name in helpers:
                continue
            text = self.index.function_text(owner, fi)
            mentioned = (f"self.{attr}" in text or any(f in text for f in flags)
                         or any(f"self.{h}(" in text for h in helpers))
            if not mentioned:
                continue
            fn = self.index.function(owner, name)
            if fn is None:
                continue
            found = self._loops_in(fn, holder, attr, flags, helpers)
            if not found:
                if reads.search(text) and not re.search(rf"for\s+\w+\s+in\s+self\.{re.escape(attr)}\b", text):
                    readers.append(f"{owner[0]}:{owner[1]}.{name}")
                continue
            loops.extend(lc for lc, _ in found)
            loop_nodes = [node for _, node in found]
            h, t, around = self.surroundings.captures(fn, attr, helpers, loop_nodes)
            heads += h
            tails += t
            result.sites.extend(self._around_sites(fn, holder, helpers, found[0][1], around))
            collectors = set().union(*(self.surroundings.collectors(fn, lp, helpers) for lp in loop_nodes))
            result.bypasses.extend(self.surroundings.bypasses(fn, holder, attr, loop_nodes, collectors,
                                                              self.layer_loops(fn)))
        if not loops and readers:
            result.problem = (f"{', '.join(readers)} test{'s' if len(readers) == 1 else ''} self.{attr} outside a "
                              f"decoder-layer loop the probe recognises")
            return result
        if not loops:
            result.problem = (f"no method of {holder[1]} ({holder[0]}) or its bases runs the decoder layers "
                              f"with a test on self.{attr}" + (f" or the per-layer flag {', '.join(flags)}" if flags else "")
                              + ": the stored ids are never read")
            result.no_capture = True
            return result
        bad = [lc for lc in loops if lc.problem]
        if bad:
            result.problem = "; ".join(f"{lc.owner}:{lc.line}: {lc.problem}" for lc in bad)
            result.no_capture = all(lc.no_capture for lc in bad)
            return result
        for lc in loops:
            if lc.site_record is not None and lc.site_record not in result.sites:
                result.sites.append(lc.site_record)
        kinds = {(lc.site, lc.value) for lc in loops}
        if len({s for s, _ in kinds}) > 1:
            result.problem = "layer loops disagree on the capture site: " + "; ".join(
                f"{lc.owner}:{lc.line} {lc.site}" for lc in loops)
            return result
        result.site = loops[0].site
        values = {v for _, v in kinds}
        result.value = values.pop() if len(values) == 1 else "unknown"
        if len(kinds) > 1:
            result.notes.append("layer loops disagree on the captured value: " + "; ".join(
                f"{lc.owner}:{lc.line} {lc.value}" for lc in loops))
        owners = sorted({lc.owner for lc in loops})
        result.loop_owner = owners[0]
        first = next(lc for lc in loops if lc.owner == owners[0])
        result.loop_line = (first.fn.path, first.line)
        if len(owners) > 1:
            result.notes.append(f"also captured in {', '.join(owners[1:])}")
        result.notes.extend(sorted({lc.how for lc in loops}))
        result.head = bool(heads)
        result.tail = bool(tails)
        result.notes.extend(heads + tails)
        # With the sites recorded, an index no site reaches (here 0) is refused per answer by
        # ClassConvention.refusal; without them the exit convention would claim index 0.
        if result.site == "exit" and not result.head and not result.sites:
            result.problem = ("captures after each layer but nothing before the loop: index 0 (the embedding) "
                              "is never captured, which the exit convention assumes")
        return result

    def _around_sites(self, fn: CstFunction, holder: ClassKey, helpers: dict[str, _Helper], loop: cst.For,
                      around: list[tuple[SiteWhere, cst.CSTNode]]) -> list[SiteRecord]:
        """Site records of the captures before / after the loop: what they append, and whether it
        evaluates at index 0 (a residual still None there)."""
        call = next((ll.call for ll in self.layer_loops(fn) if ll.node is loop), None)
        names = _residual_names(fn, call, loop) if call is not None else (set(), {"residual"}, None)
        out: list[SiteRecord] = []
        for where, node in around:
            expr: cst.BaseExpression | None = None
            subst: dict[str, cst.BaseExpression] = {}
            value: CapturedValue = "unknown"
            text = ""
            if isinstance(node, cst.Call) and _called_method(node) in helpers:
                h = helpers[_called_method(node)]
                subst = _bind_helper(h, node)
                expr = h.value
                value = self._value_kind(expr, subst, names, fn)
                text = f"`{code(expr)}` in {h.name} ({key_str(h.owner)})"
            else:
                ev = self._consumer(fn, node, None, holder, names)
                if ev is not None and ev[3] is not None:
                    expr, value = ev[3], ev[1]
                    text = f"`{code(expr)}`"
            if expr is None:
                out.append(SiteRecord(where, fn.path, fn.line(node), f"`{code(node)}`", "unknown", None, False,
                                      f"{fn.path}:{fn.line(node)}: what is appended there was not read"))
                continue
            fails = _first_index_fails(fn, expr, subst, names, node) if where == "before_loop" else None
            unverified = None if value != "unknown" else f"{fn.path}:{fn.line(node)}: {text} was not read to a value"
            out.append(SiteRecord(where, fn.path, fn.line(node), text, value, fails, unverified is None, unverified))
        return out

    # -- loops -------------------------------------------------------------------------------
    def _loops_in(self, fn: CstFunction, holder: ClassKey, attr: str, flags: tuple[str, ...],
                  helpers: dict[str, _Helper]) -> list[tuple[LoopCapture, cst.For]]:
        out = []
        for ll in self.layer_loops(fn):  # a loop whose body runs no layer (over the ids: a setter) is not one
            lc = self._loop(fn, ll, holder, attr, flags, helpers)
            if lc is not None:
                out.append((lc, ll.node))
        return out

    def _loop(self, fn: CstFunction, ll: LayerLoop, holder: ClassKey, attr: str, flags: tuple[str, ...],
              helpers: dict[str, _Helper]) -> LoopCapture | None:
        """What the capture tests in one layer loop capture (None: the loop tests nothing)."""
        loop, idx, call = ll.node, ll.index_var, ll.call
        member = fn.findall_of(cst.Comparison, _member_of(attr), within=loop.body)
        flag_tests = _flag_tests(fn, loop.body, flags, ll.layer_vars)
        self_calls = fn.findall_of(cst.Call, m.Call(func=m.Attribute(value=m.Name("self"))), within=loop.body)
        helper_calls = [c for c in self_calls if _called_method(c) in helpers]
        if not (member or flag_tests or helper_calls):
            return None
        if idx is None:
            return LoopCapture(fn, loop, None, "unknown", "",
                               problem=f"cannot tell the layer index of `for {code(loop.target)} in ...`")
        try:
            return self._loop_events(fn, loop, holder, attr, flags, helpers, idx, call, member, flag_tests, helper_calls)
        except _LoopProblem as e:
            return LoopCapture(fn, loop, None, "unknown", "", problem=str(e), no_capture=True)

    def _loop_events(self, fn: CstFunction, loop: cst.For, holder: ClassKey, attr: str, flags: tuple[str, ...],
                     helpers: dict[str, _Helper], idx: str, call: cst.Call, member: list[cst.Comparison],
                     flag_tests: list[cst.CSTNode], helper_calls: list[cst.Call]) -> LoopCapture | None:
        residual = _residual_names(fn, call, loop)
        events: list[_Event] = []
        problems: list[str] = []

        def place(node: cst.CSTNode) -> str:
            if fn.inside(node, call):
                return "in-layer"
            return "before" if fn.order(node) < fn.order(call) else "after"

        for cmp in member:
            k = index_offset(cmp.left, idx)
            if k is None:
                problems.append(f"captures under index `{code(cmp.left)}`, not a fixed offset of the loop index {idx}")
                continue
            ev = self._consumer(fn, cmp, call, holder, residual)
            if ev is None:
                continue
            events.append(self._event(fn, loop, cmp, k, ev, place(cmp), residual))
        for test in flag_tests:
            ev = self._consumer(fn, test, call, holder, residual)
            if ev is None:
                continue
            kind, value, how, expr = ev
            events.append(self._event(fn, loop, test, 0, (kind, value, how + " (per-layer flag)", expr), place(test),
                                      residual))
        for hc in helper_calls:
            h = helpers[_called_method(hc)]
            bound = _bind_helper(h, hc)
            if h.index_param not in bound:
                continue
            k = index_offset(bound[h.index_param], idx)
            if k is None:
                problems.append(f"{h.name} called with index `{code(bound[h.index_param])}`")
                continue
            value = self._value_kind(h.value, bound, residual, fn)
            fails = _first_index_fails(fn, h.value, bound, residual, loop)
            events.append(_Event(place(hc), k, value, f"{h.name} ({key_str(h.owner)})", hc,
                                 f"`{code(h.value)}` in {h.name} ({key_str(h.owner)})", fails))
        if problems and not events:
            return LoopCapture(fn, loop, None, "unknown", "", problem="; ".join(problems))
        if not events:
            return None
        if len(events) > 1:
            return LoopCapture(fn, loop, None, "unknown", "", problem=f"{len(events)} captures per layer: "
                               + "; ".join(f"{e.where} ({e.how})" for e in events))
        event = events[0]
        kind, k, value, how = event.where, event.k, event.value, event.how
        if kind in ("before", "in-layer"):
            site: CaptureSite | None = "entry" if k == 0 else None
        else:
            site = "exit" if k == 1 else None
        if site is None:
            return LoopCapture(fn, loop, None, value, how, problem=(
                f"captures {kind} the layer call under index {idx}{k:+d}: index and stream position differ"))
        if event.first_fails and site == "exit":
            event.first_fails = None  # after a layer call the layer has set the residual
        unverified = event.unverified or (None if value != "unknown" else
                                       f"what {fn.path}:{fn.line(event.node)} captures ({how}) was not read to a value")
        record = SiteRecord("loop_entry" if site == "entry" else "loop_exit", fn.path, fn.line(event.node), event.expression,
                            value, event.first_fails, unverified is None, unverified)
        return LoopCapture(fn, loop, site, value, how, site_record=record)

    @staticmethod
    def _event(fn: CstFunction, loop: cst.For, node: cst.CSTNode, k: int,
               ev: tuple[str, CapturedValue, str, cst.BaseExpression | None], where: str,
               residual: tuple[set[str], set[str], bool | None]) -> _Event:
        kind, value, how, expr = ev
        if kind == "in-layer":
            return _Event("in-layer", k, value, how, node, how)
        fails = _first_index_fails(fn, expr, {}, residual, loop) if expr is not None else None
        return _Event(where, k, value, how, node, f"`{code(expr)}`" if expr is not None else how, fails)

    def _consumer(self, fn: CstFunction, test: cst.CSTNode, call: cst.Call | None, holder: ClassKey,
                  names: tuple[set[str], set[str], bool | None]
                  ) -> tuple[str, CapturedValue, str, cst.BaseExpression | None] | None:
        """What a capture test guards: (kind, value, how). kind is "in-layer" for a collector
        handed to the layer call, else "inline"."""
        for anc in fn.ancestors(test):
            if isinstance(anc, cst.If) and (anc.test is test or fn.inside(test, anc.test)):
                collects = m.Call(func=m.Attribute(attr=m.Name(m.MatchIfTrue(lambda v: v in ("append", "capture")))))
                appended = fn.findall_of(cst.Call, collects, within=anc.body)
                if not appended:
                    return None
                value = appended[0].args[0].value if appended[0].args else None
                if value is None:
                    return None
                value = _origin(fn, value, anc.body)
                snapshots = _snapshot_names(fn, anc.body)
                return "inline", self._value_kind(value, {}, names, fn, snapshots), f"appends {code(value)}", value
            if isinstance(anc, cst.IfExp):
                target = _ifexp_target(anc, call, fn)
                if target is None:
                    return None
                kind, kw = target
                if kind == "in-layer" and call is not None:
                    captured, how, problem = self.layer_keywords.read(holder, kw)
                    if problem:
                        raise _LoopProblem(problem)
                    return "in-layer", captured, how, None
                return None
        return None

    def _value_kind(self, expr: cst.BaseExpression, subst: dict[str, cst.BaseExpression],
                    names: tuple[set[str], set[str], bool | None], fn: CstFunction,
                    snapshots: AbstractSet[str] = frozenset()) -> CapturedValue:
        hidden, residual, separate = names

        def resolve(e: cst.BaseExpression) -> cst.BaseExpression:
            # helper parameter -> the caller's argument (one step: the argument is in the caller's scope)
            return subst.get(e.value, e) if isinstance(e, cst.Name) else e

        if isinstance(expr, cst.Name) and expr.value in subst:  # a helper parameter: the caller's expression
            return self._value_kind(subst[expr.value], {}, names, fn, snapshots)
        if isinstance(expr, cst.IfExp) and isinstance(expr.test, cst.Comparison) and len(expr.test.comparisons) == 1:
            op = expr.test.comparisons[0].operator
            subject = resolve(expr.test.left)
            if m.matches(expr.test.comparisons[0].comparator, m.Name("None")):
                is_none = m.matches(subject, m.Name("None"))
                # in the loop the residual is live, so ``r is not None`` holds unless r is literally None
                take_body = (not is_none) if isinstance(op, cst.IsNot) else is_none
                return self._value_kind(expr.body if take_body else expr.orelse, subst, names, fn, snapshots)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
            operands = [resolve(expr.left), resolve(expr.right)]
            if any(isinstance(o, cst.Name) and o.value in residual for o in operands):
                return "residual_stream"
            return "unknown"
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
            if expr.func.attr.value in STREAM_SNAPSHOT_CALLS:
                return "residual_stream"
            if expr.func.attr.value in ("to", "clone", "contiguous", "float"):
                return self._value_kind(expr.func.value, subst, names, fn, snapshots)
        if isinstance(expr, cst.Name):
            if expr.value in snapshots:
                return "residual_stream"
            if expr.value in hidden:
                if separate is True:
                    return "layer_output_without_residual"
                if separate is None:
                    return "unknown"
                body = code(fn.node)
                if "residual_batch" in body or "residual_stream" in body:
                    return "unknown"  # the residual lives in the forward batch; a raw handle may be partial
                return "residual_stream"
        return "unknown"


class LayerKeywords:
    """What the decoder layers do with a capture keyword handed to them (the layer classes the
    holder builds, their forwards, their attention boundary, or a helper object from another
    engine module that they hand it to: :mod:`surgeon.engines.source.follow`)."""

    def __init__(self, index: SourceIndex) -> None:
        self.index = index
        self.follower = HelperFollower(index)

    def read(self, holder: ClassKey, kw: str) -> tuple[CapturedValue, str, str | None]:
        """What the layers do with a capture keyword: (value, how, problem)."""
        layers = self._layer_classes(holder, kw)
        if not layers:
            return "unknown", f"hands `{kw}` to a layer class the probe cannot find", None
        names = ", ".join(sorted(k[1] for k in layers))
        ignore = [k for k in layers if not self._forward_takes(k, kw)]
        if ignore:
            return "unknown", "", (f"hands `{kw}` to the layer call, but {', '.join(sorted(k[1] for k in ignore))} "
                                   f"never read{'s' if len(ignore) == 1 else ''} it (its forward takes no such argument"
                                   f" and does not look it up in **kwargs): captures on those layers silently do not happen")
        bad = [k for k in layers if not self._boundary_capture(k, kw)]
        followed = {k: self.follower.follow(k, kw) for k in bad}
        if bad and all(f is not None and f.verified for f in followed.values()):
            reads = "; ".join(dict.fromkeys(f.how for f in followed.values() if f is not None))
            return "residual_stream", f"hands `{kw}` to {names}: {reads}", None
        unread = [f for f in followed.values() if f is not None and not f.verified]
        if unread:
            return "unknown", (f"hands `{kw}` to {names}: " + "; ".join(dict.fromkeys(f"{f.how}: unverified: {f.reason}"
                                                                                         for f in unread))), None
        if bad:
            return "unknown", (f"hands `{kw}` to {names}; {', '.join(sorted(k[1] for k in bad))} does not pass it to "
                               f"its attention boundary's {BOUNDARY_PREPARE}()"), None
        return "residual_stream", (f"hands `{kw}` to {names}, whose attention boundary captures the residual "
                                   f"stream at the layer entry"), None

    def _layer_classes(self, holder: ClassKey, kw: str) -> list[ClassKey]:
        """Decoder-layer classes the holder builds ``self.layers`` from: the classes *called* in the
        constructor statements that assign ``self.layers``, following local helpers passed along
        (``make_layers(n, get_layer)``), locals (``layer_class = self.decoder_layer_types[t]``),
        class-level tables and constructor parameters (their default, or what a subclass passes
        through ``super().__init__(...)``). Falls back to every class named in the constructors
        whose forward takes ``kw``."""
        mro = self.index.mro(holder)
        seeds: list[tuple[str, str]] = []
        for k in mro:
            info = self.index.class_info(k)
            if info is None or "__init__" not in info.functions:
                continue
            text = self.index.function_text(k, info.functions["__init__"])
            ctors = ["__init__", *(n for n in info.functions if n != "__init__" and f"self.{n}(" in text)]
            for ctor in ctors:
                fn = info.functions[ctor].node
                stmts = [n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign)) and _assigns_self_layers(n)]
                if stmts:
                    seeds.extend(self._called_classes(k, fn, stmts, mro))
        precise = bool(seeds)
        if not precise:  # no ``self.layers = ...`` found: every class the constructors name
            for k in mro:
                info = self.index.class_info(k)
                if info is not None and "__init__" in info.functions:
                    seeds.extend((k[0], n.id) for n in ast.walk(info.functions["__init__"].node) if isinstance(n, ast.Name))
        found_classes: list[ClassKey] = []
        seen: set = set()
        queue = list(seeds)
        while queue:
            path, name = queue.pop(0)
            if (path, name) in seen:
                continue
            seen.add((path, name))
            r = self.index.resolve(path, name)
            if isinstance(r, tuple):
                if r in found_classes or self.index.find_function(r, "forward") is None:
                    continue
                if precise or self._forward_takes(r, kw):
                    found_classes.append(r)
            elif r is None:
                mod = self.index.module(path)
                if mod is not None and name in mod.assigns:  # a module-level table of layer classes
                    queue.extend((path, n.id) for n in ast.walk(mod.assigns[name]) if isinstance(n, ast.Name))
        return found_classes

    def _called_classes(self, owner: ClassKey, ctor: ast.FunctionDef | ast.AsyncFunctionDef, stmts: Sequence[ast.AST],
                        mro: list[ClassKey]) -> list[tuple[str, str]]:
        """(module, name) pairs that may name the class called to build each layer."""
        nested = {n.name: n for n in ast.walk(ctor) if isinstance(n, ast.FunctionDef) and n is not ctor}
        local_assigns: dict[str, list[ast.expr]] = {}
        for n in ast.walk(ctor):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        local_assigns.setdefault(t.id, []).append(n.value)
        args = ctor.args
        defaults = {a.arg: d for a, d in zip(args.args[len(args.args) - len(args.defaults):], args.defaults)}
        defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
        out: list[tuple[str, str]] = []
        todo: list[ast.AST] = list(stmts)
        done: set[int] = set()
        expanding: set[tuple[str, str]] = set()

        def value_names(expr: ast.AST, path: str) -> list[tuple[str, str]]:
            """Names a value expression may evaluate to (``a or b``: ``a`` when it names something)."""
            if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.Or):
                for v in expr.values:
                    named = value_names(v, path)
                    if any(isinstance(self.index.resolve(p, n), tuple) for p, n in named):
                        return named
                return []
            if isinstance(expr, ast.Name):
                return name_values(expr.id, path)
            if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
                found = self.index.find_class_assign(mro[0], expr.attr)  # e.g. decoder_layer_types = TABLE
                return value_names(found[1], found[0][0]) if found is not None else []
            got: list[tuple[str, str]] = []
            for child in ast.iter_child_nodes(expr):
                got.extend(value_names(child, path))
            return got

        def name_values(name: str, path: str) -> list[tuple[str, str]]:
            if path == owner[0]:
                if name in local_assigns and ("local", name) not in expanding:
                    expanding.add(("local", name))  # ``x = x or Default``: the inner x is the parameter
                    try:
                        return [x for v in local_assigns[name] for x in value_names(v, path)]
                    finally:
                        expanding.discard(("local", name))
                if name in defaults and ("param", name) not in expanding:
                    passed = self._passed_up(owner, name, mro)
                    expanding.add(("param", name))
                    try:
                        if passed is not None:
                            return value_names(passed[1], passed[0])
                        return value_names(defaults[name], path)
                    finally:
                        expanding.discard(("param", name))
            return [(path, name)]

        while todo:
            node = todo.pop()
            if id(node) in done:
                continue
            done.add(id(node))
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and sub.id in nested:
                    todo.append(nested[sub.id])  # a local helper handed to make_layers(...)
                if isinstance(sub, ast.Call) and isinstance(sub.func, (ast.Name, ast.Attribute)):
                    other_method = isinstance(sub.func, ast.Attribute) and not (
                        isinstance(sub.func.value, ast.Name) and sub.func.value.id == "self")
                    if other_method:
                        continue  # ``X.stage_facts(...)`` and other method calls do not build a layer
                    out.extend(value_names(sub.func, owner[0]))
        return out

    def _passed_up(self, owner: ClassKey, param: str, mro: list[ClassKey]) -> tuple[str, ast.expr] | None:
        """What a subclass (before ``owner`` in the MRO) passes as ``param`` to ``super().__init__``."""
        if owner not in mro:
            return None
        for k in reversed(mro[: mro.index(owner)]):  # the nearest subclass first
            info = self.index.class_info(k)
            if info is None or "__init__" not in info.functions:
                continue
            init = info.functions["__init__"].node
            for n in ast.walk(init):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "__init__":
                    for kwd in n.keywords:
                        if kwd.arg != param:
                            continue
                        if isinstance(kwd.value, ast.Name):  # handed on from the subclass's own parameter
                            a = init.args
                            defaults = {x.arg: d for x, d in zip(a.args[len(a.args) - len(a.defaults):], a.defaults)}
                            defaults.update({x.arg: d for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
                            if kwd.value.id in defaults:
                                return self._passed_up(k, kwd.value.id, mro) or (k[0], defaults[kwd.value.id])
                        return k[0], kwd.value
        return None

    def _forwards(self, key: ClassKey) -> list[tuple[ClassKey, FuncInfo]]:
        """Owners of the ``forward`` definitions a call runs: the most derived one, and the next
        along the MRO while a definition hands ``**kwargs`` on to ``super().forward(...)``."""
        out: list[tuple[ClassKey, FuncInfo]] = []
        after: ClassKey | None = None
        while True:
            found = self.index.find_function(key, "forward", after=after)
            if found is None:
                return out
            out.append(found)
            args = found[1].node.args
            text = self.index.function_text(found[0], found[1])
            if args.kwarg is None or not re.search(rf"super\(\)\.forward\([^)]*\*\*{args.kwarg.arg}\b", text, re.DOTALL):
                return out
            after = found[0]

    def _forward_takes(self, key: ClassKey, kw: str) -> bool:
        for owner, fi in self._forwards(key):
            args = fi.node.args
            if kw in {a.arg for a in [*args.args, *args.kwonlyargs, *args.posonlyargs]}:
                return True
            if args.kwarg is not None:
                text = self.index.function_text(owner, fi)
                if re.search(rf"""{args.kwarg.arg}\s*(\.get\(|\[)\s*['"]{re.escape(kw)}['"]""", text):
                    return True
        return False

    def _boundary_capture(self, layer: ClassKey, kw: str) -> bool:
        for owner, _ in self._forwards(layer):
            fn = self.index.function(owner, "forward")
            if fn is None:
                continue
            kwargs_name = fn.node.params.star_kwarg.name.value if isinstance(fn.node.params.star_kwarg, cst.Param) else None
            passes_kw = m.OneOf(
                m.Name(kw),
                m.Call(func=m.Attribute(value=m.Name(kwargs_name or "\0"), attr=m.Name("get")),
                       args=[m.Arg(value=m.SimpleString(m.MatchIfTrue(lambda s: s.strip("'\"") == kw))), m.ZeroOrMore()]),
            )
            receiver = m.Attribute(attr=m.Name(m.MatchRegex(_BOUNDARY_RECEIVER)))
            capture_kw = m.Name(m.MatchIfTrue(lambda v: v in BOUNDARY_CAPTURE_KWARGS))
            prepare = m.Call(
                func=m.Attribute(value=receiver, attr=m.Name(BOUNDARY_PREPARE)),
                args=[m.ZeroOrMore(), m.Arg(keyword=capture_kw, value=passes_kw), m.ZeroOrMore()],
            )
            if fn.findall(prepare):
                return True
        return False


class LoopSurroundings:
    """Around the capture loops of a method: captures before / after them (index 0, index L) and
    the other paths that run decoder layers without the capture test (bypasses)."""

    def __init__(self, index: SourceIndex) -> None:
        self.index = index

    def captures(self, fn: CstFunction, attr: str, helpers: dict[str, _Helper],
                 loops: list[cst.For]) -> tuple[list[str], list[str], list[tuple[SiteWhere, cst.CSTNode]]]:
        first = min(fn.order(lp) for lp in loops)
        last = max(fn.end(lp) for lp in loops)
        heads: dict[str, list[int]] = {}  # used as ordered sets
        tails: dict[str, list[int]] = {}
        nodes: list[tuple[SiteWhere, cst.CSTNode]] = []

        def in_loop(node: cst.CSTNode) -> bool:
            return any(fn.inside(node, lp) for lp in loops)

        probes: list[tuple[cst.CSTNode, cst.BaseExpression, str]] = []
        for cmp in fn.findall_of(cst.Comparison, _member_of(attr)):
            probes.append((cmp, cmp.left, f"`{code(cmp)}`"))
        for hc in fn.findall_of(cst.Call, m.Call(func=m.Attribute(value=m.Name("self")))):
            name = _called_method(hc)
            if name in helpers:
                bound = _bind_helper(helpers[name], hc)
                if helpers[name].index_param in bound:
                    index_arg = bound[helpers[name].index_param]
                    probes.append((hc, index_arg, f"{name}(..., {code(index_arg)}, ...)"))
        for node, index_expr, text in probes:
            if in_loop(node):
                continue
            which = self._boundary_index(index_expr, fn)
            # (no line numbers here: resolving positions for a whole forward costs more than it tells)
            if fn.order(node) < first and which == "start":
                heads.setdefault(f"index 0 (the embedding) is captured before the loop by {text} in {fn.label}", [])
                nodes.append(("before_loop", node))
            elif fn.order(node) > last and which == "end":
                tails.setdefault(f"index L (the last layer's output, before the final norm) is captured after the "
                                 f"loop by {text} in {fn.label}", [])
                nodes.append(("after_loop", node))
        return list(heads), list(tails), nodes

    @staticmethod
    def _boundary_index(expr: cst.BaseExpression, fn: CstFunction) -> str | None:
        if m.matches(expr, m.OneOf(m.Integer("0"), m.Attribute(value=m.Name("self"), attr=m.Name("start_layer")))):
            return "start"
        end = m.OneOf(
            m.Attribute(value=m.Name("self"), attr=m.Name("end_layer")),
            m.Attribute(attr=m.Name("num_hidden_layers")),
            m.Call(func=m.Name("len"), args=[m.Arg(value=_SELF_LAYERS)]),
        )
        if m.matches(expr, end):
            return "end"
        if isinstance(expr, cst.Name):  # a local bound to one of those
            for a in fn.findall_of(cst.Assign, m.Assign(targets=[m.AssignTarget(target=m.Name(expr.value))])):
                if m.matches(a.value, end):
                    return "end"
        return None

    @staticmethod
    def collectors(fn: CstFunction, loop: cst.For, helpers: dict[str, _Helper]) -> set[str]:
        """Names of the capture collectors a loop fills (``aux.append(...)``, ``aux.capture``
        handed to a layer, a helper's list argument)."""

        def root(e: cst.BaseExpression) -> str | None:
            while isinstance(e, (cst.Attribute, cst.Subscript)):
                e = e.value
            return e.value if isinstance(e, cst.Name) else None

        roots: list[str | None] = []
        fills = m.Call(func=m.Attribute(attr=m.Name(m.MatchIfTrue(lambda v: v in ("append", "capture", "extend")))))
        for c in fn.findall_of(cst.Call, fills, within=loop.body):
            roots.append(root(cst.ensure_type(c.func, cst.Attribute).value))
        for e in fn.findall_of(cst.IfExp, m.IfExp(), within=loop.body):
            roots.append(root(e.body))
        for c in fn.findall_of(cst.Call, m.Call(func=m.Attribute(value=m.Name("self"))), within=loop.body):
            if _called_method(c) in helpers and c.args:
                roots.append(root(c.args[0].value))
        return {r for r in roots if r is not None}

    def bypasses(self, fn: CstFunction, holder: ClassKey, attr: str, loops: list[cst.For], collectors: set[str],
                 layer_loops: list[LayerLoop]) -> list[Bypass]:
        """Paths in ``fn`` that run decoder layers outside the capture ``loops`` without the
        ``self.<attr>`` test: the layer list handed to a call, and the other ``layer_loops``."""
        out: list[Bypass] = []

        def in_capture_loop(node: cst.CSTNode) -> bool:
            return node in loops or any(fn.inside(node, lp) for lp in loops)

        layers_arg: m.OneOf[m.BaseExpression] = m.OneOf(_SELF_LAYERS, m.Subscript(value=_SELF_LAYERS))
        for c in fn.findall_of(cst.Call, m.Call(args=[m.ZeroOrMore(), m.Arg(value=layers_arg), m.ZeroOrMore()])):
            if in_capture_loop(c):
                continue
            fname = code(c.func)
            if not hands_layers_on(c.func, follow_second_loops=True):
                continue  # it only looks at the list, or builds an iterable (its loop is one of layer_loops)
            if any(isinstance(a.value, cst.Name) and a.value.value in collectors for a in c.args):
                continue  # it is handed the capture collector: it captures itself
            conds = self._conditions(fn, c)
            if any(f"self.{attr}" in t for t in conds):
                continue  # only taken when nothing is to be captured
            arg = next(a for a in c.args if m.matches(a.value, layers_arg))
            arg_text = (f"{arg.keyword.value}=" if arg.keyword is not None else "") + code(arg.value)
            out.append(Bypass(
                line=fn.line(c),
                description=(f"{fname}({arg_text}, ...) in {fn.label} runs decoder layers outside the capture "
                             f"loop, without the self.{attr} test: captures requested for those layers silently do not happen"),
                layers=self._describe_layers(arg.value, conds, fn, holder),
                path=fn.path,
            ))
        for lp in (ll.node for ll in layer_loops):
            if lp in loops or in_capture_loop(lp):
                continue
            conds = self._conditions(fn, lp)
            if any(f"self.{attr}" in t for t in conds):
                continue
            out.append(Bypass(
                line=fn.line(lp),
                description=f"a second layer loop in {fn.label} runs decoder layers without the self.{attr} test",
                layers=(f"layers iterated by `for {code(lp.target)} in {code(lp.iter)}`"
                        + (f" when {' and '.join(conds)}" if conds else "")),
                path=fn.path,
            ))
        return out

    @staticmethod
    def _conditions(fn: CstFunction, node: cst.CSTNode) -> list[str]:
        """Conditions under which ``node`` runs (innermost last)."""
        conds: list[str] = []
        child = node
        for anc in fn.ancestors(node):
            if isinstance(anc, cst.If):
                test = _bare(code(anc.test))
                if child is anc.body:
                    conds.append(test)
                elif child is anc.orelse:
                    conds.append(f"not ({test})")
            elif isinstance(anc, cst.Else):
                pass
            child = anc
        # an ``else`` block is a child of Else, whose parent If sees Else as orelse
        return list(reversed(conds))

    def _describe_layers(self, arg: cst.BaseExpression, conds: list[str], fn: CstFunction, holder: ClassKey) -> str:
        if m.matches(arg, _SELF_LAYERS):
            text = "all layers"
            bounds: list[cst.Name] = []
        else:
            assert isinstance(arg, cst.Subscript)
            sl = arg.slice[0].slice
            if isinstance(sl, cst.Slice):
                lo = code(sl.lower) if sl.lower is not None else "0"
                hi = code(sl.upper) if sl.upper is not None else "L"
                text = f"layers {lo} <= i < {hi}"
                bounds = [b for b in (sl.lower, sl.upper) if isinstance(b, cst.Name)]
            else:
                text = f"layer {code(sl)}"
                bounds = []
        if conds:
            text += " when " + " and ".join(conds)
        for b in bounds:
            name = b.value
            assigns = []
            for a in fn.findall_of(cst.Assign, m.Assign()):
                targets = [t.target for t in a.targets]
                if any(m.matches(t, m.Name(name)) for t in targets):
                    when = self._conditions(fn, a)
                    value = code(a.value)
                    value += self._config_source(a.value, holder)
                    assigns.append(f"{value}" + (f" if {' and '.join(when)}" if when else " initially"))
            if assigns:
                text += f"; {name} = " + "; = ".join(assigns)
        return text

    def _config_source(self, expr: cst.BaseExpression, holder: ClassKey) -> str:
        """`` (config.x)`` when ``self.x`` is set from the config in the holder's constructor."""
        if not (isinstance(expr, cst.Attribute) and m.matches(expr.value, m.Name("self"))):
            return ""
        attr = expr.attr.value
        for k in self.index.mro(holder):
            info = self.index.class_info(k)
            if info is None or "__init__" not in info.functions:
                continue
            for node in ast.walk(info.functions["__init__"].node):
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name) and t.value.id == "self"
                    for t in node.targets
                ):
                    src = ast.unparse(node.value)
                    if "config" in src:
                        return f" (= {src})"
        return ""
