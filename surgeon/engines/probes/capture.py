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
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from surgeon.core.idrules import Bypass, CapturedValue, CaptureSite, SiteRecord, SiteWhere
from surgeon.engines.source.anatomy import (
    STREAM_SNAPSHOT_CALLS,
    LayerLoop,
    assigned_names,
    hands_layers_on,
    index_offset,
    layer_loops,
    split_layer_calls,
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
    return _bind_call([p for p in h.params if p != "self"], call)


def _guarded_value(fn: CstFunction, body: cst.CSTNode, test: cst.CSTNode) -> cst.BaseExpression | None:
    """What the block a capture test guards collects: ``aux.append(v)`` / ``aux.capture(v)``, or
    ``d[<the tested index>] = v`` (a dict keyed by layer index)."""
    collects = m.Call(func=m.Attribute(attr=m.Name(m.MatchIfTrue(lambda v: v in ("append", "capture")))))
    appended = fn.findall_of(cst.Call, collects, within=body)
    if appended:
        return appended[0].args[0].value if appended[0].args else None
    if not isinstance(test, cst.Comparison):
        return None
    tested = code(test.left)
    key = m.Index(m.MatchIfTrue(lambda e: code(e) == tested))
    keyed = m.Assign(targets=[m.AssignTarget(m.Subscript(value=m.Name(), slice=[m.SubscriptElement(key)]))])
    stores = fn.findall_of(cst.Assign, keyed, within=body)
    return stores[0].value if stores else None


def _same_value_root(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``residual`` of ``residual.clone()`` (methods that return the same values)."""
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _SAME_VALUE:
        expr = expr.func.value
    return expr


def _guards_store(fn: CstFunction, node: cst.CSTNode, helpers: dict[str, _Helper]) -> bool:
    """``node`` (a capture test, or a helper call) collects something: a helper call does; a test
    does when the block it guards appends or stores under the tested index."""
    if isinstance(node, cst.Call):
        return _called_method(node) in helpers
    for anc in fn.ancestors(node):
        if isinstance(anc, cst.If) and (anc.test is node or fn.inside(node, anc.test)):
            return _guarded_value(fn, anc.body, node) is not None
    return False


def _keyword_of(fn: CstFunction, cmp: cst.CSTNode, call: cst.Call) -> str | None:
    """``kw`` when ``cmp`` is handed straight to ``call`` as ``kw=<cmp>``."""
    parent = fn.parent(cmp)
    if isinstance(parent, cst.Arg) and parent.keyword is not None and fn.parent(parent) is call:
        return parent.keyword.value
    return None


def _called_method(call: cst.Call) -> str:
    """``name`` of a ``<x>.name(...)`` call; "" when the callee is not an attribute (no helper or
    method has that name, so lookups by it simply miss)."""
    return call.func.attr.value if isinstance(call.func, cst.Attribute) else ""


# -- the stream held by a name: bindings live at a node, fused add-norms --------------------------
def _exclusive(fn: CstFunction, a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """``a`` and ``b`` sit on different sides of one ``if``/``else`` (never both run)."""
    for anc in fn.ancestors(a):
        if isinstance(anc, cst.If) and fn.inside(b, anc) and not fn.inside(b, anc.test):
            if fn.inside(a, anc.body) != fn.inside(b, anc.body):
                return True
    return False


def _certain(fn: CstFunction, a: cst.CSTNode, node: cst.CSTNode) -> bool:
    """``a`` runs on every path that reaches ``node``: each ``if``/``for`` around it is around ``node`` too."""
    return all(fn.inside(node, anc) for anc in fn.ancestors(a) if isinstance(anc, (cst.If, cst.For, cst.While)))


def _binds(a: cst.Assign, name: str) -> bool:
    return any(name in assigned_names(t.target) for t in a.targets)


def live_bindings(fn: CstFunction, name: str, node: cst.CSTNode) -> list[cst.Assign]:
    """The assignments of ``name`` whose value may reach ``node`` (:func:`reaching`)."""
    return reaching(fn, name, node)[0]


def reaching(fn: CstFunction, name: str, node: cst.CSTNode) -> tuple[list[cst.Assign], bool]:
    """(assignments of ``name`` whose value may reach ``node``, closed): the last one before it, and
    the ones before that while the later ones are alternatives that do not run on every path.
    ``closed``: every path binds it (one runs whenever ``node`` does, or an ``if`` binds it in every
    branch); False: the value from before them (a parameter) may reach ``node`` too."""
    cands = [a for a in fn.findall_of(cst.Assign, m.Assign()) if fn.order(a) < fn.order(node)
             and not fn.inside(node, a) and _binds(a, name) and not _exclusive(fn, a, node)]
    group: list[cst.Assign] = []
    for a in reversed(cands):
        group.append(a)
        if _certain(fn, a, node) or _every_branch(fn, group, node):
            return group, True
    return group, False


def _every_branch(fn: CstFunction, group: list[cst.Assign], node: cst.CSTNode) -> bool:
    return any(isinstance(anc, cst.If) and _certain(fn, anc, node) and not fn.inside(node, anc)
               and _branch_binds(fn, anc, group) for a in group for anc in fn.ancestors(a))


def _branch_binds(fn: CstFunction, block: cst.CSTNode, group: list[cst.Assign]) -> bool:
    """Every path through ``block`` (an ``if`` with its ``elif``/``else``, or one branch) runs one of ``group``."""
    if isinstance(block, cst.If):
        return _branch_binds(fn, block.body, group) and block.orelse is not None and _branch_binds(fn, block.orelse, group)
    if isinstance(block, cst.Else):
        block = block.body

    def direct(n: cst.CSTNode) -> bool:  # not under a compound statement inside ``block``
        return not any(isinstance(x, (cst.If, cst.For, cst.While, cst.Try)) and fn.inside(x, block) for x in fn.ancestors(n))

    if any(fn.inside(a, block) and direct(a) for a in group):
        return True
    return any(direct(i) and _branch_binds(fn, i, group) for i in fn.findall_of(cst.If, m.If(), within=block))


def _norm_ref(expr: cst.BaseExpression) -> bool:
    """``self.<...norm...>`` (``self.norm``, ``self.input_layernorm.weight``): a norm module of the model."""
    attrs: list[str] = []
    while isinstance(expr, cst.Attribute):
        attrs.append(expr.attr.value)
        expr = expr.value
    return m.matches(expr, m.Name("self")) and any("norm" in a.lower() for a in attrs)


def fused_add_norm(call: cst.BaseExpression | None, hidden: str, residual: str) -> bool:
    """A call handed the hidden and residual names and a norm module (the callee, or an argument such
    as its weight): vLLM's fused add-norm, which returns ``(norm(hidden + residual), hidden + residual)``."""
    if not isinstance(call, cst.Call):
        return False
    args = [a.value for a in call.args]
    named = {a.value for a in args if isinstance(a, cst.Name)}
    return {hidden, residual} <= named and (_norm_ref(call.func) or any(_norm_ref(a) for a in args))


def _pair_names(target: cst.BaseExpression) -> list[str | None]:
    if isinstance(target, (cst.Tuple, cst.List)):
        return [e.value.value if isinstance(e.value, cst.Name) else None for e in target.elements]
    return [target.value] if isinstance(target, cst.Name) else []


class CaptureAnalyzer:
    def __init__(self, index: SourceIndex) -> None:
        self.index = index
        self._cache: dict[tuple, CaptureResult] = {}
        self._layer_loops: dict[tuple[ClassKey, str], list[LayerLoop]] = {}
        self.layer_keywords = LayerKeywords(index)
        self.surroundings = LoopSurroundings(index)
        self.steps = StreamSteps(index, self.layer_keywords)
        self.returned = ReturnedCaptures(index, self.layer_keywords)

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
        return methods_of(self.index, holder)

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
            self._surround(fn, holder, attr, helpers, [node for _, node in found], result, (heads, tails))
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

    def _surround(self, fn: CstFunction, holder: ClassKey, attr: str, helpers: dict[str, _Helper],
                  loop_nodes: list[cst.For], result: CaptureResult, notes: tuple[list[str], list[str]]) -> None:
        """The captures before / after the loops of ``fn`` (in ``fn``, and where ``fn`` is a helper,
        around its call in the methods that call it), and the paths that bypass the loops."""
        h, t, around = self.surroundings.captures(fn, attr, helpers, loop_nodes)
        notes[0].extend(h)
        notes[1].extend(t)
        result.sites.extend(self._around_sites(fn, holder, helpers, loop_nodes[0], around))
        for caller, (h, t, around) in self.surroundings.in_callers(holder, fn, attr, helpers):
            notes[0].extend(x for x in h if x not in notes[0])
            notes[1].extend(x for x in t if x not in notes[1])
            result.sites.extend(s for s in self._around_sites(caller, holder, helpers, None, around) if s not in result.sites)
        collectors = set().union(*(self.surroundings.collectors(fn, lp, helpers) for lp in loop_nodes))
        result.bypasses.extend(self.surroundings.bypasses(fn, holder, attr, loop_nodes, collectors, self.layer_loops(fn)))

    def _around_sites(self, fn: CstFunction, holder: ClassKey, helpers: dict[str, _Helper], loop: cst.For | None,
                      around: list[tuple[SiteWhere, cst.CSTNode]]) -> list[SiteRecord]:
        """Site records of the captures before / after the loop: what they append, and whether it
        evaluates at index 0 (a residual still None there)."""
        call = next((ll.call for ll in self.layer_loops(fn) if ll.node is loop), None) if loop is not None else None
        names = _residual_names(fn, call, loop) if call is not None and loop is not None else (set(), {"residual"}, None)
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
                    text = f"`{code(expr)}`" + ev[2].removeprefix(f"appends {code(expr)}")
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
        loop, idx = ll.node, ll.index_var
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
            return self._loop_events(fn, ll, holder, helpers, idx, member, flag_tests, helper_calls)
        except _LoopProblem as e:
            return LoopCapture(fn, loop, None, "unknown", "", problem=str(e), no_capture=True)

    def _loop_events(self, fn: CstFunction, ll: LayerLoop, holder: ClassKey, helpers: dict[str, _Helper], idx: str,
                     member: list[cst.Comparison], flag_tests: list[cst.CSTNode],
                     helper_calls: list[cst.Call]) -> LoopCapture | None:
        loop, call = ll.node, ll.call
        residual = _residual_names(fn, call, loop)
        events: list[_Event] = []
        problems: list[str] = []
        stages = split_layer_calls(loop, "layers", ll.layer_vars, fn.findall)

        def place(node: cst.CSTNode) -> str:
            if fn.inside(node, call):
                return "in-layer"
            if fn.order(node) < fn.order(call):
                return "before"
            return "between" if stages and fn.order(node) < fn.order(stages[-1]) else "after"

        for cmp in member:
            k = index_offset(cmp.left, idx)
            if k is None:
                problems.append(f"captures under index `{code(cmp.left)}`, not a fixed offset of the loop index {idx}")
                continue
            kw = _keyword_of(fn, cmp, call)
            returned = self.returned.event(fn, ll, holder, kw, k, cmp, self._value_kind) if kw else None
            if returned is not None:
                events.append(returned)
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
        if event.where == "between":  # between the stages of a split layer call
            problem = self.steps.stage_problem(fn, holder, stages, event.node, residual[1])
            if problem:
                return LoopCapture(fn, loop, None, event.value, event.how, problem=problem)
            event.where = "before"
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
        text = f"`{code(expr)}`" + how.removeprefix(f"appends {code(expr)}") if expr is not None else how
        return _Event(where, k, value, how, node, text, fails)

    def _consumer(self, fn: CstFunction, test: cst.CSTNode, call: cst.Call | None, holder: ClassKey,
                  names: tuple[set[str], set[str], bool | None]
                  ) -> tuple[str, CapturedValue, str, cst.BaseExpression | None] | None:
        """What a capture test guards: (kind, value, how). kind is "in-layer" for a collector
        handed to the layer call, else "inline"."""
        for anc in fn.ancestors(test):
            if isinstance(anc, cst.If) and (anc.test is test or fn.inside(test, anc.test)):
                value = _guarded_value(fn, anc.body, test)
                if value is None:
                    return None
                value = _origin(fn, value, anc.body)
                snapshots = _snapshot_names(fn, anc.body)
                root = _same_value_root(value)
                streams = (self.steps.stream_names(fn, anc, holder, {root.value}) if isinstance(root, cst.Name)
                           and root.value in names[1] | {"residual"} else {})
                how = f"appends {code(value)}" + "".join(f" ({why})" for why in streams.values())
                return "inline", self._value_kind(value, {}, names, fn, snapshots | set(streams)), how, value
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

    def layer_classes(self, holder: ClassKey) -> list[ClassKey]:
        """The decoder-layer classes the holder builds ``self.layers`` from (none when not read)."""
        return self._layer_classes(holder, "")

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

    def captures(self, fn: CstFunction, attr: str, helpers: dict[str, _Helper], loops: Sequence[cst.CSTNode],
                 span: tuple[int, int] | None = None, keep: Callable[[cst.CSTNode], bool] | None = None,
                 ) -> tuple[list[str], list[str], list[tuple[SiteWhere, cst.CSTNode]]]:
        """Captures before ``loops`` (index start) and after them (index end) in ``fn``; ``span``:
        the (first, last) order they are before / after instead; ``keep``: which tests count."""
        first, last = span or (min(fn.order(lp) for lp in loops), max(fn.end(lp) for lp in loops))
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
            if in_loop(node) or (keep is not None and not keep(node)):
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

    def in_callers(self, holder: ClassKey, owner: CstFunction, attr: str, helpers: dict[str, _Helper],
                   ) -> list[tuple[CstFunction, tuple[list[str], list[str], list[tuple[SiteWhere, cst.CSTNode]]]]]:
        """Where the loop owner is a helper (``forward`` calls ``self._run_layers(...)``, then
        ``self._collapse(...)``, which stores the last layer's output when ``self.end_layer in
        self.<attr>``): the captures around each call of it, in the caller and in the methods the
        caller calls before / after it (those with no layer loop). Only tests that guard a store count."""
        out = []
        by_name = {fi.name: k for k, fi in reversed(methods_of(self.index, holder))}  # the most derived wins
        for caller, call in _calls_of(self.index, holder, owner.name):
            span = (caller.order(call), caller.end(call))

            def keep(node: cst.CSTNode, f: CstFunction = caller) -> bool:
                return _guards_store(f, node, helpers)

            out.append((caller, self.captures(caller, attr, helpers, [call], keep=keep)))
            for c in caller.findall_of(cst.Call, m.Call(func=m.Attribute(value=m.Name("self")))):
                name = _called_method(c)
                if name in (owner.name, caller.name, *helpers) or name not in by_name or span[0] <= caller.order(c) <= span[1]:
                    continue
                sib = self.index.function(by_name[name], name)
                if sib is None or f"self.{attr}" not in code(sib.node) or layer_loops(sib.node, "layers", sib.findall):
                    continue
                at = (-1, -1) if caller.order(c) > span[1] else (1 << 30, 1 << 30)

                def keep_sib(node: cst.CSTNode, f: CstFunction = sib) -> bool:
                    return _guards_store(f, node, helpers)

                out.append((sib, self.captures(sib, attr, helpers, [], span=at, keep=keep_sib)))
        return out

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


def _bind_call(params: Sequence[str], call: cst.Call) -> dict[str, cst.BaseExpression]:
    """Parameter name -> the argument ``call`` hands it (positional in order, then keywords)."""
    bound: dict[str, cst.BaseExpression] = {}
    for i, arg in enumerate(call.args):
        if arg.keyword is not None:
            bound[arg.keyword.value] = arg.value
        elif i < len(params) and not arg.star:
            bound[params[i]] = arg.value
    return bound


def _params(fn: CstFunction) -> list[str]:
    return [p.name.value for p in fn.node.params.params if p.name.value != "self"]


def _is_none_test(test: cst.BaseExpression, name: str) -> bool:
    return m.matches(test, m.Comparison(left=m.Name(name), comparisons=[m.ComparisonTarget(m.Is(), m.Name("None"))]))


class StreamSteps:
    """What a residual name holds where a capture reads it: the residual stream after a fused
    add-norm (``h, r = self.norm(h, r)``: ``r`` is ``h + r``), or after a layer stage that only runs
    the layer's input norm (``h, r = layer.forward_input_norm(h, r)``, read in the layer class:
    each of its returns is a fused add-norm of its inputs, or the hidden state itself when it is
    handed no residual)."""

    def __init__(self, index: SourceIndex, keywords: LayerKeywords) -> None:
        self.index = index
        self.keywords = keywords

    def stream_names(self, fn: CstFunction, node: cst.CSTNode, holder: ClassKey, residual: AbstractSet[str]) -> dict[str, str]:
        """Residual names that hold the residual stream at ``node``, each with how that was read."""
        out: dict[str, str] = {}
        for r in residual or {"residual"}:
            group, closed = reaching(fn, r, node)
            whys = [self._binding(fn, a, r, holder) for a in group]
            if closed and all(w is not None for w in whys):
                out[r] = "; ".join(dict.fromkeys(w for w in whys if w))
        return out

    def stage_problem(self, fn: CstFunction, holder: ClassKey, stages: list[cst.Call], node: cst.CSTNode,
                      residual: AbstractSet[str]) -> str | None:
        """Why a capture between the stages of a split layer call is not at the layer's entry (None:
        every stage before it only runs the input norm)."""
        for s in (s for s in stages if fn.order(s) < fn.order(node)):
            a = fn.parent(s)
            names = _pair_names(a.targets[0].target) if isinstance(a, cst.Assign) else []
            r = next((n for n in names if n and (n in residual or "residual" in n)), None)
            if r is None or not isinstance(a, cst.Assign) or self._stage(fn, a, s, r, holder) is None:
                return (f"captures between the layer stages {code(stages[0].func)}(...) and {code(stages[-1].func)}(...) "
                        f"({fn.path}:{fn.line(s)}): {code(s.func)} was not read as running only the layer's input "
                        f"norm, so which stream position the capture sees is not known")
        return None

    def _binding(self, fn: CstFunction, a: cst.Assign, r: str, holder: ClassKey) -> str | None:
        names = _pair_names(a.targets[0].target)
        if r not in names or not isinstance(a.value, cst.Call):
            return None
        if any(fused_add_norm(a.value, h, r) for h in names if h and h != r):
            return f"`{r}` after the fused add-norm {code(a.value.func)}(...) ({fn.path}:{fn.line(a)}) is hidden + residual"
        return self._stage(fn, a, a.value, r, holder)

    def _stage(self, fn: CstFunction, a: cst.Assign, call: cst.Call, r: str, holder: ClassKey) -> str | None:
        if not (isinstance(call.func, cst.Attribute) and call.func.attr.value.startswith("forward_")):
            return None
        method, names = call.func.attr.value, _pair_names(a.targets[0].target)
        reads: list[str] = []
        for layer in self.keywords.layer_classes(holder):
            found = self.index.find_function(layer, method)
            lf = self.index.function(found[0], method) if found is not None else None
            why = self._input_norm_step(lf, call, names, r) if lf is not None else None
            if why is None:
                return None
            reads.append(why)
        if not reads:
            return None
        return (f"`{r}` after {code(call.func)}(...) ({fn.path}:{fn.line(a)}), which only runs the layer's input norm: "
                + "; ".join(dict.fromkeys(reads)))

    def _input_norm_step(self, lf: CstFunction, call: cst.Call, names: list[str | None], r: str) -> str | None:
        bound = _bind_call(_params(lf), call)
        r_param = next((p for p, v in bound.items() if m.matches(v, m.Name(r))), None)
        h_param = next((p for p, v in bound.items() if isinstance(v, cst.Name) and v.value in names and v.value != r), None)
        returns = lf.findall_of(cst.Return, m.Return())
        if r_param is None or h_param is None or not returns:
            return None
        reads: list[str] = []
        for ret in returns:
            if fused_add_norm(ret.value, h_param, r_param):
                reads.append(f"{lf.path}:{lf.line(ret)} returns a fused add-norm")
                continue
            got = _pair_names(ret.value) if ret.value is not None else []
            j = names.index(r)
            var = got[j] if j < len(got) else None
            group, closed = reaching(lf, var, ret) if var else ([], False)
            whys = [self._step_binding(lf, b, h_param, r_param) for b in group]
            if not closed or any(w is None for w in whys):
                return None  # a path returns the residual it was handed, or something not read
            reads.extend(w for w in whys if w)
        return "; ".join(dict.fromkeys(reads))

    @staticmethod
    def _step_binding(lf: CstFunction, b: cst.Assign, h: str, r: str) -> str | None:
        if m.matches(b.value, m.Name(h)) and any(isinstance(anc, cst.If) and _is_none_test(anc.test, r)
                                                 and lf.inside(b, anc.body) for anc in lf.ancestors(b)):
            return (f"{lf.path}:{lf.line(b)}: `{code(b.targets[0].target)} = {h}` when {r} is None (the stream is the hidden "
                    f"state alone)")
        if fused_add_norm(b.value, h, r):
            return f"{lf.path}:{lf.line(b)}: fused add-norm"
        return None


def _self_module_call(call: cst.Call) -> bool:
    """``self.attn(...)``, ``self.ffn.forward_unfinalized(...)``: the layer's own compute (a norm is not)."""
    e = call.func
    while isinstance(e, cst.Attribute):
        e = e.value
    return m.matches(e, m.Name("self")) and not _norm_ref(call.func)


def _value_names(fn: CstFunction, expr: cst.BaseExpression) -> set[str]:
    """Local names ``expr`` reads (not called functions, attribute or keyword names, ``self``)."""
    out: set[str] = set()
    for n in fn.findall_of(cst.Name, m.Name(), within=expr):
        parent = fn.parent(n)
        skip = ((isinstance(parent, cst.Attribute) and parent.attr is n) or (isinstance(parent, cst.Arg) and parent.keyword is n)
                or (isinstance(parent, cst.Call) and parent.func is n) or n.value == "self")
        if not skip:
            out.add(n.value)
    return out


def inputs_only(fn: CstFunction, a: cst.Assign) -> str | None:
    """None when what ``a`` assigns is computed from ``fn``'s inputs alone (its bindings traced back,
    no call of the layer's own modules on the way); else the call that computes it, with its line."""
    todo: list[tuple[cst.BaseExpression, cst.CSTNode]] = [(a.value, a)]
    seen: set[str] = set()
    while todo:
        expr, at = todo.pop()
        for call in fn.findall_of(cst.Call, m.Call(), within=expr):
            if _self_module_call(call):
                return f"{fn.path}:{fn.line(at)}: `{code(call.func)}(...)`"
        for name in _value_names(fn, expr) - seen:
            seen.add(name)
            todo.extend((b.value, b) for b in live_bindings(fn, name, at))
    return None


@dataclass
class _Returned:
    """What a layer's forward does with a capture flag: ``if <kw>: <var> = <expr>`` and
    ``return ..., <var>`` (element ``position``)."""

    fn: CstFunction
    var: str
    position: int
    assigns: list[cst.Assign]
    late: str | None  # why a value is not computed from the layer's inputs alone
    none_guard: tuple[str, cst.If] | None  # every assignment sits under ``if <param> is None: ... else``


class ReturnedCaptures:
    """A capture flag handed straight to the layer call (``layer(..., capture_x=idx in self.<attr>)``)
    whose forward returns the captured value (``if capture_x: v = ...`` and ``return ..., v``), which
    the loop stores under the layer index (``d[idx] = v``) or appends. The stream position is the
    layer's entry when the value is computed from the layer's inputs alone (nothing of the layer's
    own compute on the way); the first layer sees nothing when the value is only set where a
    parameter (the residual) is not None and the first layer is handed None."""

    def __init__(self, index: SourceIndex, keywords: LayerKeywords) -> None:
        self.index = index
        self.keywords = keywords

    def read(self, holder: ClassKey, kw: str) -> list[_Returned] | None:
        layers = self.keywords.layer_classes(holder)
        reads = [self._layer(k, kw) for k in layers]
        if not layers or any(r is None for r in reads):
            return None
        return [r for r in reads if r is not None]

    def _layer(self, layer: ClassKey, kw: str) -> _Returned | None:
        found = self.index.find_function(layer, "forward")
        lf = self.index.function(found[0], "forward") if found is not None else None
        if lf is None or kw not in _params(lf) and kw not in {p.name.value for p in lf.node.params.kwonly_params}:
            return None
        assigns = [a for i in lf.findall_of(cst.If, m.If(test=m.Name(kw)))
                   for a in lf.findall_of(cst.Assign, m.Assign(targets=[m.AssignTarget(m.Name())]), within=i.body)]
        names = {cst.ensure_type(a.targets[0].target, cst.Name).value for a in assigns}
        returns = lf.findall_of(cst.Return, m.Return())
        if len(names) != 1 or not returns:
            return None
        var = names.pop()
        positions = {(_pair_names(r.value) if r.value is not None else []).index(var)
                     if var in (_pair_names(r.value) if r.value is not None else []) else -1 for r in returns}
        if len(positions) != 1 or -1 in positions:
            return None
        late = next((why for a in assigns if (why := inputs_only(lf, a)) is not None), None)
        return _Returned(lf, var, positions.pop(), assigns, late, self._none_guard(lf, assigns))

    @staticmethod
    def _none_guard(lf: CstFunction, assigns: list[cst.Assign]) -> tuple[str, cst.If] | None:
        guards: list[tuple[str, cst.If]] = []
        for a in assigns:
            g = next(((p, anc) for anc in lf.ancestors(a) if isinstance(anc, cst.If) and not lf.inside(a, anc.body)
                      for p in _params(lf) if _is_none_test(anc.test, p)), None)
            if g is None:
                return None
            guards.append(g)
        return guards[0] if len({p for p, _ in guards}) == 1 else None

    def event(self, fn: CstFunction, ll: LayerLoop, holder: ClassKey, kw: str, k: int, cmp: cst.Comparison,
              value_kind: Callable[..., CapturedValue]) -> _Event | None:
        """The capture event of ``cmp`` (``<idx + k> in self.<attr>`` handed to the layer as ``kw``);
        None when the layers do not return a flagged value (another reading applies)."""
        reads = self.read(holder, kw)
        if reads is None:
            return None
        position = {r.position for r in reads}
        parent = fn.parent(ll.call)
        targets = _pair_names(parent.targets[0].target) if isinstance(parent, cst.Assign) else []
        w = targets[reads[0].position] if len(position) == 1 and reads[0].position < len(targets) else None
        if w is None:
            raise _LoopProblem(f"the layer returns the `{kw}` capture as element {reads[0].position} of its result, "
                               f"which {fn.path}:{fn.line(ll.call)} does not bind to one name")
        store = self._store(fn, ll.node, w)
        if store is None:
            raise _LoopProblem(f"`{w}`, what the layer returns for `{kw}`, is never stored in {fn.label}")
        node, key = store
        if key is not None and ll.index_var is not None and index_offset(key, ll.index_var) != k:
            raise _LoopProblem(f"tests `{code(cmp.left)}` but stores the capture under `{code(key)}` ({fn.path}:{fn.line(node)})")
        late = [r.late for r in reads if r.late]
        if late:
            raise _LoopProblem(f"what the layer returns for `{kw}` is computed by its own modules ({'; '.join(late)}): "
                               f"which stream position it holds was not read")
        return self._event(fn, ll, holder, kw, k, cmp, reads, node, value_kind)

    def _event(self, fn: CstFunction, ll: LayerLoop, holder: ClassKey, kw: str, k: int, cmp: cst.Comparison,
               reads: list[_Returned], store: cst.CSTNode, value_kind: Callable[..., CapturedValue]) -> _Event:
        exprs = [(r, a) for r in reads for a in r.assigns]
        values = {value_kind(a.value, {}, (set(), {r.none_guard[0]} if r.none_guard else set(), None), r.fn)
                  for r, a in exprs}
        value: CapturedValue = values.pop() if len(values) == 1 else "unknown"
        lines = ", ".join(f"{r.fn.path}:{r.fn.line(a)}" for r, a in exprs)
        text = " / ".join(dict.fromkeys(f"`{code(a.value)}`" for _, a in exprs))
        layers = ", ".join(sorted({r.fn.owner[1] for r in reads}))
        unverified = None if value != "unknown" else (
            f"{lines}: {layers}.forward returns {text} for `{kw}`, computed from the layer's inputs (the stream "
            f"entering it), not read to the residual stream")
        fails, unread = self._first_fails(fn, ll, holder, reads)
        unverified = "; ".join(x for x in (unverified, unread) if x) or None
        store_text = code(store.targets[0].target) + f" = {reads[0].var}" if isinstance(store, cst.Assign) else code(store)
        expression = (f"{text} returned by {layers}.forward when `{kw}` ({lines}), stored by `{store_text}` "
                      f"({fn.path}:{fn.line(store)})")
        how = (f"hands `{kw}` to {layers}, whose forward returns {text} computed from its inputs (the stream "
               f"entering the layer)")
        return _Event("in-layer", k, value, how, cmp, expression, fails, unverified)

    def _first_fails(self, fn: CstFunction, ll: LayerLoop, holder: ClassKey,
                     reads: list[_Returned]) -> tuple[str | None, str | None]:
        """(why the first layer stores nothing, what about it was not read)."""
        guards = {r.none_guard[0] for r in reads if r.none_guard is not None}
        r0 = reads[0]
        if len(guards) != 1 or r0.none_guard is None or any(r.none_guard is None for r in reads):
            return None, None
        param, guard = r0.none_guard
        head = (f"{r0.fn.owner[1]}.forward sets `{r0.var}` only when `{param}` is not None ({r0.fn.path}:"
                f"{r0.fn.line(guard)}: its `{param} is None` branch never does)")
        arg = _bind_call(_params(r0.fn), ll.call).get(param)
        src = self._none_source(fn, arg.value, ll.node, holder) if isinstance(arg, cst.Name) else None
        if src is None:
            return None, f"{head}; whether the first layer is handed `{param}` None was not read"
        return f"{head}, and the first layer is handed None ({src}), so nothing is stored for it", None

    def _none_source(self, fn: CstFunction, name: str, before: cst.CSTNode, holder: ClassKey) -> str | None:
        found = _none_binding(fn, name, before)
        if found is not None or name not in _params(fn):
            return found
        for cf, c in _calls_of(self.index, holder, fn.name):  # the loop owner is a helper: where its caller sets it
            arg = _bind_call(_params(fn), c).get(name)
            found = _none_binding(cf, arg.value, c) if isinstance(arg, cst.Name) else None
            if found is not None:
                return found
        return None

    @staticmethod
    def _store(fn: CstFunction, loop: cst.For, w: str) -> tuple[cst.CSTNode, cst.BaseExpression | None] | None:
        keyed = m.Assign(targets=[m.AssignTarget(m.Subscript(value=m.Name()))], value=m.Name(w))
        for a in fn.findall_of(cst.Assign, keyed, within=loop.body):
            el = cst.ensure_type(a.targets[0].target, cst.Subscript).slice[0].slice
            if isinstance(el, cst.Index):
                return a, el.value
        appends = m.Call(func=m.Attribute(attr=m.Name("append")), args=[m.Arg(m.Name(w))])
        found = fn.findall_of(cst.Call, appends, within=loop.body)
        return (found[0], None) if found else None


def _none_binding(fn: CstFunction, name: str, before: cst.CSTNode) -> str | None:
    """``path:line: `r = None``` (or ``a, r = x, None``) when ``name`` is None where ``before`` runs."""
    for a in live_bindings(fn, name, before):
        target = a.targets[0].target
        names = _pair_names(target)
        value = a.value
        vals = [e.value for e in value.elements] if isinstance(value, cst.Tuple) and len(names) > 1 else [value]
        if len(vals) == len(names) and m.matches(vals[names.index(name)], m.Name("None")):
            return f"{fn.path}:{fn.line(a)}: `{code(target)} = {code(value)}`"
    return None


def _calls_of(index: SourceIndex, holder: ClassKey, name: str) -> list[tuple[CstFunction, cst.Call]]:
    """Each ``self.<name>(...)`` call in the holder's other methods, with the method it is in."""
    out: list[tuple[CstFunction, cst.Call]] = []
    for owner, fi in methods_of(index, holder):
        if fi.name == name or f"self.{name}(" not in index.function_text(owner, fi):
            continue
        cf = index.function(owner, fi.name)
        calls = cf.findall_of(cst.Call, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(name)))) if cf else []
        out.extend((cf, c) for c in calls if cf is not None)
    return out


def methods_of(index: SourceIndex, holder: ClassKey) -> list[tuple[ClassKey, FuncInfo]]:
    """The methods an instance of ``holder`` runs: the most derived definition of each name, and a
    base's definition too when the override calls ``super().<name>(...)``."""
    chained: dict[str, bool] = {}  # name -> the last included definition calls super()
    out: list[tuple[ClassKey, FuncInfo]] = []
    for k in index.mro(holder):
        info = index.class_info(k)
        if info is None:
            continue
        for name, fi in info.functions.items():
            if name in chained and not chained[name]:
                continue
            out.append((k, fi))
            chained[name] = f"super().{name}(" in index.function_text(k, fi)
    return out
