"""Where a norm flag's value goes after an engine's draft model file reads it.

A read (``getattr(config, "fc_norm", False)``) is not proof that the forward depends on the flag:
the value may land in ``self.x`` that nothing reads, or in a branch that only sets an attribute
nothing reads. So the value is followed, in the one file, with libcst's scope, parent, context and
position metadata:

* through expressions that keep it (``bool(x)``, ``x or y``, ``not x``, ``x is None``, the default
  of an enclosing read);
* through assignments: a local name (its references, by libcst's scope analysis), an attribute
  (``self.x = ...``: every load of ``.x`` in the file; ``self.x`` only in the owning class's
  in-file family), a parameter (the value passed to a function or class of the same file:
  ``LlamaDecoderLayer(..., flag=...)`` follows into ``__init__``), a return (into the calls of
  the function in the file);
* an ``if`` whose arms only set attributes of ``self`` (module construction:
  ``if flag: self.fc_norm = ModuleList(...) else: self.fc_norm = None``) passes the dependence to
  what it sets, which is followed in turn: a norm built and never applied is no use.

A use is where the value changes the computation: the test of an ``if`` (or ``while``) whose arms
do more than set attributes, the test of a conditional expression, or the value called (a module
or method applied). A use under ``if TYPE_CHECKING`` (or a constant false test), or in an arm that
runs only when ``use_aux_hidden_state`` is false (EAGLE-1 style drafts), is dead for an EAGLE-3
draft and does not count. Where the value reaches code this does not follow (passed to a function
of another module, stored in a container, returned to callers the file does not show) it escapes:
the answer is unverified there, with the file:line. Nothing is imported from the engine.

An attribute loaded on another object (``self.model.norm_before_fc`` in the CausalLM wrapper) is
taken to be the one stored (matched by name in the file), since the object's class is not typed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import libcst as cst
import libcst.matchers as m
from libcst.metadata import (
    ExpressionContext,
    ExpressionContextProvider,
    MetadataWrapper,
    ParentNodeProvider,
    PositionProvider,
    ScopeProvider,
)

from surgeon.engines.source.cstwalk import children

UseState = Literal["used", "unused", "unverified"]
# expressions whose value carries the flag's value on (a truth test of the flag is the flag)
_KEEPS = (cst.BooleanOperation, cst.UnaryOperation, cst.Comparison, cst.ComparisonTarget, cst.BinaryOperation,
          cst.Attribute, cst.Subscript, cst.SubscriptElement, cst.Index)
_TRANSPARENT_CALLS = {"bool", "int", "float"}
_AUX = m.Name("use_aux_hidden_state") | m.Attribute(attr=m.Name("use_aux_hidden_state"))
_SELF_ATTR = m.Attribute(value=m.Name("self"))
# a statement of module construction: it only sets attributes of self (or does nothing)
_SETS_SELF = m.SimpleStatementLine(body=[m.Assign(targets=[m.AtLeastN(m.AssignTarget(target=_SELF_ATTR), n=1)])
                                         | m.AnnAssign(target=_SELF_ATTR, value=m.DoNotCare()) | m.Pass()])


@dataclass(frozen=True)
class FlagUse:
    """What the engine does with one read's value."""

    state: UseState
    at: str | None  # used: the use (file:line); unverified: where the value escapes; unused: None
    how: str  # the path from the read to ``at``, or what was followed and found unused


@dataclass(frozen=True)
class _Site:
    line: int
    where: str
    how: str


class ValueFlow:
    """The value flow of one parsed engine file (``rel``: its path relative to the engine root)."""

    def __init__(self, module: cst.Module, rel: str) -> None:
        self.module, self.rel = module, rel
        wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
        self.parent = wrapper.resolve(ParentNodeProvider)
        self.pos = wrapper.resolve(PositionProvider)
        self.scope = wrapper.resolve(ScopeProvider)
        self.ctx = wrapper.resolve(ExpressionContextProvider)
        self.classes = {c.name.value: c for c in module.body if isinstance(c, cst.ClassDef)}
        self.functions = {f.name.value: f for f in module.body if isinstance(f, cst.FunctionDef)}
        self.loads: dict[str, list[cst.Attribute]] = {}
        for node, ctx in self.ctx.items():
            if isinstance(node, cst.Attribute) and ctx is ExpressionContext.LOAD:
                self.loads.setdefault(node.attr.value, []).append(node)

    # -- reporting ------------------------------------------------------------------------------
    def line(self, node: cst.CSTNode) -> int:
        return self.pos[node].start.line

    def site(self, node: cst.CSTNode) -> str:
        return f"{self.rel}:{self.line(node)}"

    def code(self, node: cst.CSTNode) -> str:
        text = " ".join(self.module.code_for_node(node).split())
        return text if len(text) <= 70 else text[:67] + "..."

    def follow(self, read: cst.BaseExpression) -> FlagUse:
        """Where the value of ``read`` (a flag read: a call, or an attribute ``config.<flag>``) is
        used (the first use in the file), or why none was found."""
        state = _Walk(self)
        state.carry(read, f"{self.site(read)} reads `{self.code(read)}`")
        return self._answer(state, read)

    def follow_param(self, param: cst.Param) -> FlagUse:
        """Where the value a caller passes for ``param`` is used in its function, as :meth:`follow`."""
        state = _Walk(self)
        state._references(param, f"{self.site(param)} takes it as `{param.name.value}`")
        return self._answer(state, param)

    def _answer(self, state: _Walk, read: cst.CSTNode) -> FlagUse:
        if state.uses:
            best = min(state.uses, key=lambda s: s.line)
            return FlagUse("used", best.where, best.how)
        if state.escapes:
            best = min(state.escapes, key=lambda s: s.line)
            return FlagUse("unverified", best.where, best.how)
        dead = "; ".join(f"{s.where} {s.how}" for s in sorted(state.dead, key=lambda s: s.line))
        dead = f"; its only uses are dead code: {dead}" if dead else ""
        followed = "; ".join(state.followed) or f"`{self.code(read)}` is discarded"
        return FlagUse("unused", None, f"no use of the value found in {self.rel} (followed: {followed}){dead}")

    # -- the file's structure -------------------------------------------------------------------
    def enclosing(self, node: cst.CSTNode, kind: type) -> Any:
        cur: cst.CSTNode | None = node
        while cur is not None:
            cur = self.parent.get(cur)
            if isinstance(cur, kind):
                return cur
        return None

    def bases(self, cls: cst.ClassDef) -> list[str]:
        """``cls``'s bases that are classes of this file."""
        return [n for b in cls.bases if (n := self.code(b.value)) in self.classes]

    def family(self, cls: cst.ClassDef) -> set[str]:
        """``cls`` and every class of the file joined to it by inheritance (an attribute ``self.x``
        set in one of them may be read in another)."""
        names, todo = {cls.name.value}, [cls.name.value]
        while todo:
            name = todo.pop()
            near = set(self.bases(self.classes[name])) | {c for c, d in self.classes.items() if name in self.bases(d)}
            todo += sorted(near - names)
            names |= near
        return names

    def method(self, cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
        """``cls.name`` as Python finds it among the classes of this file (the class, then its
        in-file bases, depth first)."""
        for stmt in cls.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
                return stmt
        for base in self.bases(cls):
            found = self.method(self.classes[base], name)
            if found is not None:
                return found
        return None

    def dead(self, node: cst.CSTNode) -> str | None:
        """Why ``node`` never runs for an EAGLE-3 draft (None: it may run): under ``if
        TYPE_CHECKING:`` or a constant false test, or in the arm of a test on
        ``use_aux_hidden_state`` that runs only when it is false (EAGLE-3 drafts feed aux hidden
        states: it is true; check-draft refuses a config that sets it false)."""
        child, cur = node, self.parent.get(node)
        while cur is not None:
            if isinstance(cur, cst.If) and child in (cur.body, cur.orelse):
                test, in_body = cur.test, child is cur.body
                negated = m.matches(test, m.UnaryOperation(operator=m.Not()))
                aux = m.matches(test.expression if isinstance(test, cst.UnaryOperation) else test, _AUX)
                if in_body and (m.matches(test, m.Name("TYPE_CHECKING") | m.Attribute(attr=m.Name("TYPE_CHECKING")))
                                or self.code(test) in ("False", "0")):
                    return f"under `if {self.code(test)}` ({self.site(cur)}), which never runs"
                if aux and in_body == negated:
                    arm = "" if in_body else "the else of "
                    return (f"in {arm}`if {self.code(test)}` ({self.site(cur)}), which runs only when "
                            "use_aux_hidden_state is false: dead for EAGLE-3")
            child, cur = cur, self.parent.get(cur)
        return None


class _Walk:
    """One read's value followed through the file (a worklist over expression nodes)."""

    def __init__(self, flow: ValueFlow) -> None:
        self.f = flow
        self.uses: list[_Site] = []
        self.escapes: list[_Site] = []
        self.dead: list[_Site] = []
        self.followed: list[str] = []
        self.seen: set[Any] = set()

    def use(self, node: cst.CSTNode, how: str) -> None:
        self._site(node, how, self.uses)

    def escape(self, node: cst.CSTNode, how: str) -> None:
        self._site(node, how, self.escapes)

    def _site(self, node: cst.CSTNode, how: str, live: list[_Site]) -> None:
        dead = self.f.dead(node)
        if dead is None:
            live.append(_Site(self.f.line(node), self.f.site(node), how))
        else:
            self.dead.append(_Site(self.f.line(node), self.f.site(node), dead))

    def carry(self, expr: cst.CSTNode, how: str) -> None:
        """The value of ``expr`` carries the flag: where does it go?"""
        if id(expr) in self.seen:
            return
        self.seen.add(id(expr))
        f = self.f
        p = f.parent.get(expr)
        if isinstance(p, _KEEPS) and not (isinstance(p, cst.Attribute) and expr is p.attr):
            self.carry(p, how)
        elif isinstance(p, cst.Arg):
            self._argument(p, how)
        elif isinstance(p, (cst.If, cst.While)) and expr is p.test:
            self._branch(p, how)
        elif isinstance(p, cst.IfExp):
            if expr is p.test:
                self.use(p, f"{how}; {f.site(p)} chooses `{f.code(p)}` by it")
            else:
                self.carry(p, how)
        elif isinstance(p, cst.Call) and expr is p.func:
            self.use(p, f"{how}; {f.site(p)} calls it: `{f.code(p)}`")
        elif isinstance(p, (cst.Assign, cst.AnnAssign)) and expr is p.value:
            targets = [t.target for t in p.targets] if isinstance(p, cst.Assign) else [p.target]
            for t in targets:
                self.assigned(t, how)
        elif isinstance(p, cst.Return):
            self._returned(p, how)
        elif isinstance(p, (cst.Expr, cst.Assert)):
            self.followed.append(f"{f.site(p)} `{f.code(p)}` does not change the computation")
        elif p is not None:
            stmt = f.enclosing(expr, cst.SimpleStatementLine) or p
            self.escape(p, f"{how}; {f.site(p)}: `{f.code(stmt)}` takes it where this analysis does not follow")

    def assigned(self, target: cst.CSTNode, how: str) -> None:
        f = self.f
        here = f"{how}; {f.site(target)} stores it in `{f.code(target)}`"
        if isinstance(target, cst.Name):
            self._references(target, here)
        elif isinstance(target, cst.Attribute):
            self._attribute(target, here)
        else:
            self.escape(target, f"{here}, which this analysis does not follow")

    def _references(self, name: cst.Name | cst.Param, how: str) -> None:
        f = self.f
        node = name.name if isinstance(name, cst.Param) else name
        scope = f.scope.get(node)
        refs = [] if scope is None else [r.node for a in scope.assignments[node.value]
                                         if getattr(a, "node", None) is name for r in a.references]
        if not refs:
            self.followed.append(f"`{node.value}` ({f.site(node)}) is never read")
        for r in refs:
            if isinstance(r, cst.CSTNode):
                self.carry(r, how)

    def _attribute(self, target: cst.Attribute, how: str) -> None:
        f = self.f
        attr = target.attr.value
        owner = f.enclosing(target, cst.ClassDef)
        key = ("attr", attr, owner.name.value if owner is not None else None)
        if key in self.seen:
            return
        self.seen.add(key)
        family = f.family(owner) if owner is not None and m.matches(target.value, m.Name("self")) else None
        loads = [a for a in f.loads.get(attr, []) if self._same_object(a, family)]
        if not loads:
            self.followed.append(f"`{f.code(target)}` ({f.site(target)}) is never read")
        for a in loads:
            self.carry(a, how)

    def _same_object(self, load: cst.Attribute, family: set[str] | None) -> bool:
        """``self.x`` in a class outside the owner's family is another object's attribute."""
        if family is None or not m.matches(load.value, m.Name("self")):
            return True
        cls = self.f.enclosing(load, cst.ClassDef)
        return cls is not None and cls.name.value in family

    def _branch(self, node: cst.If | cst.While, how: str) -> None:
        """An ``if`` on the value: a use, unless its arms only set attributes of ``self`` (module
        construction: then those attributes are followed)."""
        f = self.f
        arms: list[cst.CSTNode] = list(node.body.body)
        orelse = node.orelse
        if isinstance(orelse, cst.Else):
            arms += list(orelse.body.body)
        elif orelse is not None:
            arms.append(orelse)
        if isinstance(node, cst.While) or not all(m.matches(s, _SETS_SELF) for s in arms):
            self.use(node, f"{how}; {f.site(node)} branches on it: `{f.code(node.test)}`")
            return
        here = f"{how}; {f.site(node)} `if {f.code(node.test)}` sets"
        for stmt in arms:
            for small in stmt.body:  # type: ignore[attr-defined]
                if isinstance(small, (cst.Assign, cst.AnnAssign)):
                    for t in ([t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]):
                        self.assigned(t, here)

    def _argument(self, arg: cst.Arg, how: str) -> None:
        f = self.f
        call = f.parent[arg]
        if not isinstance(call, cst.Call):
            return
        if _flag_read(call) is not None or m.matches(call.func, m.Name(m.MatchIfTrue(lambda v: v in _TRANSPARENT_CALLS))):
            self.carry(call, how)  # the default of an enclosing read, bool(x): the value goes on
            return
        fn, skip = self._callee(call)
        callee = f.code(call.func)
        if fn is None:
            self.escape(call, f"{how}; {f.site(call)} passes it to `{callee}`, which is not in {f.rel} "
                              "and was not read")
            return
        param = _parameter(fn, call, arg, skip)
        if param is None:
            self.escape(call, f"{how}; {f.site(call)} passes it to `{callee}` as an argument not matched to "
                              f"a parameter of {fn.name.value} ({f.site(fn)})")
            return
        self._references(param, f"{how}; {f.site(call)} passes it to `{callee}` as `{param.name.value}`")

    def _callee(self, call: cst.Call) -> tuple[cst.FunctionDef | None, int]:
        """The function of this file ``call`` runs, and how many leading parameters it binds
        itself (``self``)."""
        f = self.f
        func = call.func
        if isinstance(func, cst.Name):
            if func.value in f.functions:
                return f.functions[func.value], 0
            if func.value in f.classes:
                return f.method(f.classes[func.value], "__init__"), 1
            return None, 0
        owner = f.enclosing(call, cst.ClassDef)
        if owner is None or not isinstance(func, cst.Attribute):
            return None, 0
        if m.matches(func.value, m.Name("self")):
            return f.method(owner, func.attr.value), 1
        if m.matches(func.value, m.Call(func=m.Name("super"))):
            found = (f.method(f.classes[b], func.attr.value) for b in f.bases(owner))
            return next((x for x in found if x is not None), None), 1
        return None, 0

    def _returned(self, ret: cst.Return, how: str) -> None:
        f = self.f
        fn = f.enclosing(ret, cst.FunctionDef)
        name = fn.name.value if fn is not None else ""
        calls = [c for c in _calls(f.module) if m.matches(c.func, m.Name(name) | m.Attribute(attr=m.Name(name)))]
        if not calls:
            self.escape(ret, f"{how}; {f.site(ret)} returns it from {name}, whose callers are not in {f.rel}")
        for c in calls:
            self.carry(c, f"{how}; {f.site(ret)} returns it from {name}, called at {f.site(c)}")


def _parameter(fn: cst.FunctionDef, call: cst.Call, arg: cst.Arg, skip: int) -> cst.Param | None:
    params = fn.params
    if arg.keyword is not None:
        named = [*params.posonly_params, *params.params, *params.kwonly_params]
        return next((p for p in named if p.name.value == arg.keyword.value), None)
    if arg.star:
        return None
    positional = [a for a in call.args if a.keyword is None]
    if any(a.star for a in positional[:positional.index(arg)]):
        return None
    slots = [*params.posonly_params, *params.params][skip:]
    i = positional.index(arg)
    return slots[i] if i < len(slots) else None


def _calls(top: cst.CSTNode) -> Iterator[cst.Call]:
    """Every call under ``top``, in source order (pre-order, children in libcst's order)."""
    stack: list[cst.CSTNode] = [top]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Call):
            yield node
        stack.extend(reversed(children(node)))


def _string(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def _flag_read(call: cst.Call) -> tuple[str, str, cst.BaseExpression | None] | None:
    """(scope, key, default node) of ``getattr(obj, "key"[, default])`` or ``obj.get("key"[, default])``;
    scope is "eagle_config" when ``obj`` is the name ``eagle_config``, else "config"."""
    args = call.args
    if m.matches(call.func, m.Name("getattr")) and len(args) >= 2:
        key, default, scope = _string(args[1].value), args[2].value if len(args) > 2 else None, "config"
    elif isinstance(call.func, cst.Attribute) and call.func.attr.value == "get" and args:
        key, default = _string(args[0].value), args[1].value if len(args) > 1 else None
        scope = "eagle_config" if m.matches(call.func.value, m.Name("eagle_config")) else "config"
    else:
        return None
    return None if key is None else (scope, key, default)


NO_DEFAULT = object()


def read_default(module: cst.Module, node: cst.BaseExpression | None) -> Any:
    """The literal default of a read (a nested read: its default); NO_DEFAULT when none is written
    or it is not a literal."""
    if node is None:
        return NO_DEFAULT
    if isinstance(node, cst.Call) and (inner := _flag_read(node)) is not None:
        return read_default(module, inner[2])
    try:
        return ast.literal_eval(module.code_for_node(node).strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return NO_DEFAULT


def key_reads(module: cst.Module, names: set[str], under: cst.CSTNode | None = None) -> list[tuple[cst.Call, str, str, Any]]:
    """Every read of a key in ``names`` under ``under`` (default: the module): (call, scope, key,
    default), in source order."""
    out = []
    for call in _calls(under if under is not None else module):
        r = _flag_read(call)
        if r is not None and r[1] in names:
            out.append((call, r[0], r[1], read_default(module, r[2])))
    return out
