"""A small symbolic interpreter for capture setters, over libcst trees.

A setter such as SGLang's ``set_eagle3_layers_to_capture`` or vLLM's ``set_aux_hidden_state_layers``
is *run* on symbolic values instead of being pattern-matched: the explicit ids are a
:class:`Seq` (``[val + 1 for val in layer_ids]`` shifts it, ``tuple(sorted(set(x)))`` marks it
sorted and de-duplicated), the layer count is ``L`` (:class:`Lin`), ``self`` is an :class:`Obj`
whose attributes are resolved from the ``__init__`` assignments of its class hierarchy (so
``self.model`` is the class the constructor builds, in whichever file), and calls are followed
into the called method. What the run leaves behind are :class:`Store` effects (ids written to an
attribute of some object) and :class:`FlagMark` effects (a per-layer flag set for each id).

Where the outcome depends on something the source cannot decide, the run *forks*: a condition on
the ids (``layer_ids[0] == 1``) becomes a branch of the id rule; a runtime condition or an
attribute with several possible classes is explored both ways and the probe compares the
outcomes. Assumption: one pipeline rank (``is_first_rank``/``is_last_rank`` are true,
``world_size`` is 1), which is what the capture indices are defined for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence, Union

import libcst as cst
import libcst.matchers as m

from surgeon.core.idrules import DefaultTerm, FirstIdEquals, MaxIdEquals
from surgeon.engines.source import ClassKey, CstFunction, SourceIndex, code, key_str


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Const:
    value: Any


@dataclass(frozen=True)
class Lin:
    """``L * mul // div + add``, ``L`` the model's number of decoder layers."""

    mul: int
    div: int
    add: int

    @classmethod
    def of(cls, v: "Value") -> "Lin | None":
        if isinstance(v, Lin):
            return v
        if isinstance(v, Const) and isinstance(v.value, int) and not isinstance(v.value, bool):
            return Lin(0, 1, v.value)
        return None

    def term(self) -> DefaultTerm:
        return DefaultTerm(self.mul, self.div, self.add)

    def shifted(self, k: int) -> "Lin":
        return Lin(self.mul, self.div, self.add + k)


L = Lin(1, 1, 0)


@dataclass(frozen=True)
class Seq:
    """A list of ids: the explicit ids shifted by ``offset`` (``terms is None``), or a literal list
    of terms in ``L`` (a default list)."""

    terms: tuple[Lin, ...] | None
    offset: int = 0
    sorted: bool = False
    dedup: bool = False

    @property
    def explicit(self) -> bool:
        return self.terms is None

    def shifted(self, k: int) -> "Seq":
        if self.terms is None:
            return replace(self, offset=self.offset + k)
        return replace(self, terms=tuple(t.shifted(k) for t in self.terms))


@dataclass(frozen=True)
class Elem:
    """An element of ``seq`` plus ``offset`` (a comprehension or loop variable)."""

    seq: Seq
    offset: int = 0


@dataclass(frozen=True)
class IdItem:
    """``ids[index]`` of the explicit ids shifted by ``offset``."""

    index: int
    offset: int


@dataclass(frozen=True)
class IdMax:
    offset: int


@dataclass(frozen=True)
class Pred:
    cond: FirstIdEquals | MaxIdEquals
    negated: bool = False


@dataclass(frozen=True)
class Obj:
    cls: ClassKey
    path: str  # how it was reached, e.g. "self.model" (identity within one run)


@dataclass(frozen=True)
class ClassRef:
    cls: ClassKey


@dataclass(frozen=True)
class ModuleRef:
    path: str


@dataclass(frozen=True)
class Bound:
    obj: Obj | None
    owner: ClassKey
    name: str


@dataclass(frozen=True)
class Super:
    obj: Obj
    after: ClassKey


@dataclass(frozen=True)
class LayerItem:
    """``holder.layers[index]``."""

    holder: Obj
    index: "Value"


@dataclass(frozen=True)
class PPGroup:
    """The pipeline-parallel group, modelled as a single rank."""


@dataclass(frozen=True)
class Tup:
    items: tuple["Value", ...]


@dataclass(frozen=True)
class Builtin:
    name: str


@dataclass(frozen=True)
class External:
    """A name bound to something outside the package (or a function we do not follow)."""

    name: str


@dataclass(frozen=True)
class Unknown:
    why: str


Value = Union[Const, Lin, Seq, Elem, IdItem, IdMax, Pred, Obj, ClassRef, ModuleRef, Bound, Super,
              LayerItem, PPGroup, Tup, Builtin, External, Unknown]

_BUILTINS = {"list", "tuple", "sorted", "set", "len", "hasattr", "getattr", "setattr", "isinstance",
             "max", "min", "super", "int", "print", "any", "all", "range", "enumerate", "zip",
             "iter", "next", "callable", "type", "frozenset", "reversed", "str", "bool"}


# ---------------------------------------------------------------------------------------------
# Effects and outcomes
# ---------------------------------------------------------------------------------------------
class Site:
    """Where an effect happened; the line is resolved only when asked for."""

    def __init__(self, fn: CstFunction | None, node: cst.CSTNode | None) -> None:
        self.fn, self.node = fn, node

    @property
    def line(self) -> int:
        return self.fn.line(self.node) if self.fn is not None and self.node is not None else 0


@dataclass(frozen=True)
class Store:
    """``holder.attr = value`` executed by the setter."""

    holder: Obj
    attr: str
    value: Value
    site: Site = field(compare=False)
    where: str = ""

    @property
    def line(self) -> int:
        return self.site.line


@dataclass(frozen=True)
class FlagMark:
    """``holder.layers[i].flag = True`` for each ``i`` in ``seq``."""

    holder: Obj
    flag: str
    seq: Value
    site: Site = field(compare=False)
    where: str = ""
    filtered: bool = False  # only ids inside the layer range are marked

    @property
    def line(self) -> int:
        return self.site.line


@dataclass(frozen=True)
class Lost:
    """The ids went into a call the probe could not follow."""

    what: str
    site: Site = field(compare=False)
    where: str = ""

    @property
    def line(self) -> int:
        return self.site.line


Effect = Union[Store, FlagMark, Lost]


@dataclass
class Outcome:
    effects: list[Effect]
    returned: Value | None
    raised: str | None
    notes: list[str]
    labels: dict  # fork key -> human-readable text


class _Fork(Exception):
    def __init__(self, key: tuple, options: tuple) -> None:
        super().__init__(key)
        self.key = key
        self.options = options


class _Return(Exception):
    def __init__(self, value: Value) -> None:
        self.value = value


class Raised(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Break(Exception):
    pass


class TooManyPaths(Exception):
    pass


def explore(run_once: Callable[[dict], Outcome], max_leaves: int = 64) -> list[tuple[dict, Outcome]]:
    """Run ``run_once`` under every combination of assumptions it forks on."""
    pending: list[dict] = [{}]
    leaves: list[tuple[dict, Outcome]] = []
    while pending:
        assumptions = pending.pop()
        try:
            outcome = run_once(assumptions)
        except _Fork as f:
            for option in reversed(f.options):
                pending.append({**assumptions, f.key: option})
            if len(pending) + len(leaves) > max_leaves:
                raise TooManyPaths(f"more than {max_leaves} paths") from None
            continue
        leaves.append((assumptions, outcome))
    return leaves


# ---------------------------------------------------------------------------------------------
# Engine hooks
# ---------------------------------------------------------------------------------------------
class Hooks:
    """Engine-specific knowledge of library functions the interpreter cannot read into
    (factories that pick a class at runtime, registries). Return ``None`` to decline."""

    def call_function(self, interp: "Interp", name: str, args: list[Value], kwargs: dict[str, Value]) -> Value | None:
        return None

    def call_method(self, interp: "Interp", owner: ClassKey, name: str, obj: Obj | None,
                    args: list[Value], kwargs: dict[str, Value]) -> Value | None:
        return None


# ---------------------------------------------------------------------------------------------
# The interpreter
# ---------------------------------------------------------------------------------------------
@dataclass
class Frame:
    fn: CstFunction | None
    owner: ClassKey | None
    path: str  # module for name resolution
    self_obj: Obj | None
    locals: dict[str, Value] = field(default_factory=dict)
    stmt: cst.CSTNode | None = None  # the statement being executed
    lazy: bool = False  # resolve unassigned locals from earlier assignments (attribute lookups)


class Interp:
    MAX_DEPTH = 24

    def __init__(self, index: SourceIndex, hooks: Hooks, assumptions: dict) -> None:
        self.index = index
        self.hooks = hooks
        self.assumptions = assumptions
        self.heap: dict[tuple[str, str], Value] = {}
        self.effects: list[Effect] = []
        self.notes: list[str] = []
        self.labels: dict = {}
        self.depth = 0
        self._lazy_guard: set = set()
        self._init_cache: dict[tuple[ClassKey, str], list] = {}

    # -- forks -------------------------------------------------------------------------------
    def assume(self, key: tuple, options: tuple, label: object) -> Any:
        self.labels.setdefault(key, label)
        if key in self.assumptions:
            return self.assumptions[key]
        raise _Fork(key, options)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # -- entry points ------------------------------------------------------------------------
    def call_method(self, obj: Obj, name: str, args: Sequence[Value], kwargs: dict[str, Value] | None = None) -> Value:
        target = self.load_attr(obj, name)
        return self.call_value(target, list(args), dict(kwargs or {}), f"{obj.path}.{name}", None, "")

    # -- functions ---------------------------------------------------------------------------
    def run(self, owner: ClassKey, name: str, self_obj: Obj | None, args: list[Value], kwargs: dict[str, Value]) -> Value:
        hooked = self.hooks.call_method(self, owner, name, self_obj, args, kwargs)
        if hooked is not None:
            return hooked
        fn = self.index.function(owner, name)
        if fn is None:
            return Unknown(f"cannot read {key_str(owner)}.{name}")
        if self.depth >= self.MAX_DEPTH:
            return Unknown("call depth exceeded")
        frame = Frame(fn=fn, owner=owner, path=fn.path, self_obj=self_obj)
        self._bind(frame, fn.node.params, self_obj, args, kwargs)
        self.depth += 1
        try:
            self.exec_block(fn.node.body, frame)
        except _Return as r:
            return r.value
        finally:
            self.depth -= 1
        return Const(None)

    def _bind(self, frame: Frame, params: cst.Parameters, self_obj: Obj | None, args: list[Value],
              kwargs: dict[str, Value]) -> None:
        positional = [*params.posonly_params, *params.params]
        decorators = {code(d.decorator) for d in frame.fn.node.decorators} if frame.fn else set()
        args = list(args)
        if positional and "staticmethod" not in decorators:
            first = positional.pop(0)
            frame.locals[first.name.value] = self_obj if self_obj is not None else Unknown("no self")
        for p in positional:
            pname = p.name.value
            if args:
                frame.locals[pname] = args.pop(0)
            elif pname in kwargs:
                frame.locals[pname] = kwargs.pop(pname)
            elif p.default is not None:
                frame.locals[pname] = self.eval(p.default, Frame(None, None, frame.path, None))
            else:
                frame.locals[pname] = Unknown(f"argument {pname} not given")
        if isinstance(params.star_arg, cst.Param):
            frame.locals[params.star_arg.name.value] = Tup(tuple(args))
        for p in params.kwonly_params:
            pname = p.name.value
            if pname in kwargs:
                frame.locals[pname] = kwargs.pop(pname)
            elif p.default is not None:
                frame.locals[pname] = self.eval(p.default, Frame(None, None, frame.path, None))
            else:
                frame.locals[pname] = Unknown(f"argument {pname} not given")
        if params.star_kwarg is not None:
            frame.locals[params.star_kwarg.name.value] = Unknown("**kwargs")

    # -- statements --------------------------------------------------------------------------
    def exec_block(self, body: cst.BaseSuite | Sequence[cst.CSTNode], frame: Frame) -> None:
        stmts = body.body if isinstance(body, (cst.IndentedBlock, cst.SimpleStatementSuite)) else body
        for stmt in stmts:
            self.exec_stmt(stmt, frame)

    def exec_stmt(self, stmt: cst.CSTNode, frame: Frame) -> None:
        frame.stmt = stmt
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                self.exec_small(small, frame)
        elif isinstance(stmt, cst.If):
            taken = self.truth(self.eval(stmt.test, frame), stmt.test, frame)
            if taken:
                self.exec_block(stmt.body, frame)
            elif isinstance(stmt.orelse, cst.If):
                self.exec_stmt(stmt.orelse, frame)
            elif isinstance(stmt.orelse, cst.Else):
                self.exec_block(stmt.orelse.body, frame)
        elif isinstance(stmt, cst.For):
            self.exec_for(stmt, frame)
        elif isinstance(stmt, cst.With):
            for item in stmt.items:
                self.eval(item.item, frame)
                if item.asname is not None:
                    self.assign(item.asname.name, Unknown("context manager"), frame)
            self.exec_block(stmt.body, frame)
        elif isinstance(stmt, cst.Try):
            try:
                self.exec_block(stmt.body, frame)
            except Raised:
                if not stmt.handlers:
                    raise
                self.exec_block(stmt.handlers[0].body, frame)
            if stmt.finalbody is not None:
                self.exec_block(stmt.finalbody.body, frame)
        elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            frame.locals[stmt.name.value] = Unknown(f"local definition {stmt.name.value}")
        elif isinstance(stmt, cst.While):
            self.note(f"a while loop at line {self.line(frame)} was not followed")
        elif isinstance(stmt, cst.SimpleStatementSuite):
            for small in stmt.body:
                self.exec_small(small, frame)

    def exec_small(self, small: cst.BaseSmallStatement, frame: Frame) -> None:
        if isinstance(small, cst.Expr):
            self.eval(small.value, frame)
        elif isinstance(small, cst.Assign):
            value = self.eval(small.value, frame)
            for target in small.targets:
                self.assign(target.target, value, frame)
        elif isinstance(small, cst.AnnAssign):
            if small.value is not None:
                self.assign(small.target, self.eval(small.value, frame), frame)
        elif isinstance(small, cst.AugAssign):
            value = self.binop(self.eval(small.target, frame), small.operator, self.eval(small.value, frame))
            self.assign(small.target, value, frame)
        elif isinstance(small, cst.Return):
            raise _Return(self.eval(small.value, frame) if small.value is not None else Const(None))
        elif isinstance(small, cst.Raise):
            text = code(small.exc) if small.exc is not None else "re-raise"
            raise Raised(f"raises {text} (line {self.line(frame)})")
        elif isinstance(small, cst.Assert):
            held = self._truth(self.eval(small.test, frame))
            if held is False:
                names = {n.value for n in frame.fn.findall(m.Name(), within=small.test)} if frame.fn else set()
                known = [f"{n} is {_describe(frame.locals[n])}" for n in sorted(names)
                         if isinstance(frame.locals.get(n), (Obj, Unknown))]
                raise Raised(f"fails `assert {code(small.test)}` (line {self.line(frame)})"
                             + (f": {', '.join(known)}" if known else ""))
        elif isinstance(small, cst.ImportFrom):
            if not isinstance(small.names, cst.ImportStar):
                for alias in small.names:
                    local = alias.asname.name if alias.asname else alias.name
                    if isinstance(local, cst.Name):
                        frame.locals[local.value] = self._imported(small, alias, frame.path)
        elif isinstance(small, cst.Import):
            for alias in small.names:
                local = alias.asname.name if alias.asname else alias.name
                frame.locals[code(local).split(".")[0]] = External(code(local))
        elif isinstance(small, cst.Break):
            raise _Break()
        # Pass, Continue, Global, Nonlocal, Del: nothing to do for a single symbolic pass

    def exec_for(self, stmt: cst.For, frame: Frame) -> None:
        it = self.eval(stmt.iter, frame)
        if isinstance(it, Seq) and isinstance(stmt.target, cst.Name):
            self.assign(stmt.target, Elem(it), frame)
            try:
                self.exec_block(stmt.body, frame)
            except _Break:
                pass
        else:
            self.note(f"a loop at line {self.line(frame)} over {code(stmt.iter)} was not followed")

    def assign(self, target: cst.BaseExpression, value: Value, frame: Frame) -> None:
        if isinstance(target, cst.Name):
            frame.locals[target.value] = value
        elif isinstance(target, cst.Attribute):
            recv = self.eval_receiver(target.value, frame)
            self.store(recv, target.attr.value, value, frame)
        elif isinstance(target, (cst.Tuple, cst.List)):
            items = value.items if isinstance(value, Tup) and len(value.items) == len(target.elements) else None
            for i, el in enumerate(target.elements):
                self.assign(el.value, items[i] if items else Unknown("unpacked value"), frame)
        # subscripts (dict entries) carry nothing the probe needs

    def store(self, recv: Value, attr: str, value: Value, frame: Frame) -> None:
        where = frame.fn.label if frame.fn else "?"
        if isinstance(recv, Obj):
            self.heap[(recv.path, attr)] = value
            if isinstance(value, (Seq, Elem, Unknown)):
                self.effects.append(Store(recv, attr, value, Site(frame.fn, frame.stmt), where))
        elif isinstance(recv, LayerItem):
            if isinstance(recv.index, Elem) and self._truth(value) is True:
                filtered = any("skipped" in n for n in self.notes)
                self.effects.append(FlagMark(recv.holder, attr, recv.index.seq.shifted(recv.index.offset),
                                             Site(frame.fn, frame.stmt), where, filtered))
            else:
                self.note(f"line {self.line(frame)}: per-layer attribute {attr} set to something the probe cannot follow")
        elif _carries_ids(value):
            self.effects.append(Lost(f"stores ids into an attribute of {_describe(recv)}", Site(frame.fn, frame.stmt), where))

    @staticmethod
    def line(frame: Frame) -> int:
        return frame.fn.line(frame.stmt) if frame.fn is not None and frame.stmt is not None else 0

    # -- expressions -------------------------------------------------------------------------
    def eval_receiver(self, node: cst.BaseExpression, frame: Frame) -> Value:
        """Like eval, but ``x.layers[i]`` becomes a :class:`LayerItem` of ``x``."""
        if isinstance(node, cst.Subscript) and m.matches(node.value, m.Attribute(attr=m.Name("layers"))):
            holder = self.eval(node.value.value, frame)  # type: ignore[attr-defined]
            if isinstance(holder, Obj) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
                return LayerItem(holder, self.eval(node.slice[0].slice.value, frame))
        return self.eval(node, frame)

    def eval(self, node: cst.BaseExpression, frame: Frame) -> Value:
        if isinstance(node, cst.Name):
            return self.lookup(node.value, frame)
        if isinstance(node, cst.Integer):
            return Const(int(node.value, 0))
        if isinstance(node, (cst.SimpleString, cst.ConcatenatedString)):
            try:
                return Const(node.evaluated_value)
            except Exception:
                return Unknown("string")
        if isinstance(node, cst.Attribute):
            return self.eval_attribute(node, frame)
        if isinstance(node, cst.Call):
            return self.eval_call(node, frame)
        if isinstance(node, cst.Subscript):
            return self.eval_subscript(node, frame)
        if isinstance(node, cst.BinaryOperation):
            return self.binop(self.eval(node.left, frame), node.operator, self.eval(node.right, frame))
        if isinstance(node, cst.UnaryOperation):
            v = self.eval(node.expression, frame)
            if isinstance(node.operator, cst.Not):
                return Const(not self.truth(v, node.expression, frame))
            if isinstance(node.operator, cst.Minus):
                lin = Lin.of(v)
                if lin is not None and lin.mul == 0:
                    return Const(-lin.add)
            return Unknown(f"operator in {code(node)}")
        if isinstance(node, cst.BooleanOperation):
            left = self.eval(node.left, frame)
            t = self.truth(left, node.left, frame)
            if isinstance(node.operator, cst.And):
                return self.eval(node.right, frame) if t else left
            return left if t else self.eval(node.right, frame)
        if isinstance(node, cst.Comparison):
            return self.eval_comparison(node, frame)
        if isinstance(node, cst.IfExp):
            if self.truth(self.eval(node.test, frame), node.test, frame):
                return self.eval(node.body, frame)
            return self.eval(node.orelse, frame)
        if isinstance(node, (cst.List, cst.Tuple, cst.Set)):
            return self.eval_literal(node, frame)
        if isinstance(node, (cst.ListComp, cst.SetComp, cst.GeneratorExp)):
            return self.eval_comprehension(node, frame)
        return Unknown(f"expression {code(node)[:60]}")

    def lookup(self, name: str, frame: Frame) -> Value:
        if name in frame.locals:
            return frame.locals[name]
        if name in ("None", "True", "False"):
            return Const({"None": None, "True": True, "False": False}[name])
        if frame.lazy and frame.fn is not None:
            found = self._lazy_local(name, frame)
            if found is not None:
                return found
        resolved = self.index.resolve(frame.path, name)
        if isinstance(resolved, tuple):
            return ClassRef(resolved)
        if isinstance(resolved, str):
            return ModuleRef(resolved)
        mod = self.index.module(frame.path)
        if mod is not None:
            if name in mod.imports:
                return External(name)
            if name in mod.assigns:
                guard = (frame.path, name)
                if guard not in self._lazy_guard:
                    expr = self.index.expression(frame.path, mod.assigns[name])
                    if expr is not None:
                        self._lazy_guard.add(guard)
                        try:
                            return self.eval(expr, Frame(None, None, frame.path, None))
                        finally:
                            self._lazy_guard.discard(guard)
        if name in _BUILTINS:
            return Builtin(name)
        return Unknown(f"name {name}")

    def _imported(self, node: cst.ImportFrom, alias: cst.ImportAlias, path: str) -> Value:
        """What ``from X import name`` inside a function binds: a class of the package if it is one."""
        dots = len(node.relative)
        module = code(node.module) if node.module is not None else ""
        if dots:
            parts = self.index.dotted_of(path).split(".")
            if not path.endswith("__init__.py"):
                parts = parts[:-1]
            parts = parts[: len(parts) - (dots - 1)]
            module = ".".join([*parts, *([module] if module else [])])
        name = code(alias.name)
        target = self.index.path_of(module)
        if target is not None:
            r = self.index.resolve(target, name)
            if isinstance(r, tuple):
                return ClassRef(r)
            if isinstance(r, str):
                return ModuleRef(r)
        sub = self.index.path_of(f"{module}.{name}")
        return ModuleRef(sub) if sub else External(name)

    def _lazy_local(self, name: str, frame: Frame) -> Value | None:
        """The value of local ``name`` from its last assignment before ``frame.line``."""
        assert frame.fn is not None
        fn = frame.fn
        here = fn.order(frame.stmt) if frame.stmt is not None else len(fn._all)
        best: cst.Assign | None = None
        for stmt in _walk_statements(fn.node.body):
            if isinstance(stmt, cst.ImportFrom) and fn.order(stmt) < here and not isinstance(stmt.names, cst.ImportStar):
                for alias in stmt.names:
                    local = alias.asname.name if alias.asname else alias.name
                    if m.matches(local, m.Name(name)):
                        return self._imported(stmt, alias, frame.path)
            if isinstance(stmt, cst.Assign) and fn.order(stmt) < here:
                if any(m.matches(t.target, m.Name(name)) for t in stmt.targets):
                    best = stmt
        if best is None:
            params = frame.fn.node.params
            if any(p.name.value == name for p in [*params.params, *params.kwonly_params, *params.posonly_params]):
                return Unknown(f"constructor argument {name}")
            return None
        guard = (fn.label, name, fn.order(best))
        if guard in self._lazy_guard:
            return Unknown(f"recursive local {name}")
        self._lazy_guard.add(guard)
        saved = frame.stmt
        try:
            frame.stmt = best
            return self.eval(best.value, frame)
        finally:
            frame.stmt = saved
            self._lazy_guard.discard(guard)

    def eval_attribute(self, node: cst.Attribute, frame: Frame) -> Value:
        attr = node.attr.value
        if attr == "num_hidden_layers":
            return L  # the layer count, whichever config object carries it
        if attr == "pp_group":
            return PPGroup()
        base = self.eval(node.value, frame)
        return self.get_attr(base, attr)

    def get_attr(self, base: Value, attr: str) -> Value:
        if isinstance(base, Obj):
            return self.load_attr(base, attr)
        if isinstance(base, PPGroup):
            if attr in ("is_first_rank", "is_last_rank"):
                return Const(True)
            if attr == "world_size":
                return Const(1)
            if attr in ("rank", "rank_in_group"):
                return Const(0)
            return Unknown(f"pp_group.{attr}")
        if isinstance(base, Super):
            found = self.index.find_function(base.obj.cls, attr, after=base.after)
            if found is not None:
                return Bound(base.obj, found[0], attr)
            return Unknown(f"super().{attr}")
        if isinstance(base, ClassRef):
            found = self.index.find_function(base.cls, attr)
            if found is not None:
                return Bound(None, found[0], attr)
            assigned = self.index.find_class_assign(base.cls, attr)
            if assigned is not None:
                return self._eval_class_level(assigned[0], assigned[1])
            return Unknown(f"{base.cls[1]}.{attr}")
        if isinstance(base, ModuleRef):
            resolved = self.index.resolve(base.path, attr)
            if isinstance(resolved, tuple):
                return ClassRef(resolved)
            return External(attr)
        return Unknown(f"attribute {attr} of {_describe(base)}")

    def has_attr(self, obj: Obj, attr: str) -> bool | None:
        if (obj.path, attr) in self.heap:
            return True
        for k in self.index.mro(obj.cls):
            info = self.index.class_info(k)
            if info is None:
                continue
            if attr in info.functions or attr in info.class_assigns:
                return True
            if self._init_mentions(k, attr):
                return True
        return False

    def load_attr(self, obj: Obj, attr: str) -> Value:
        if (obj.path, attr) in self.heap:
            return self.heap[(obj.path, attr)]
        for k in self.index.mro(obj.cls):
            info = self.index.class_info(k)
            if info is None:
                continue
            if attr in info.functions:
                if info.functions[attr].is_property:
                    return self.run(k, attr, obj, [], {})
                return Bound(obj, k, attr)
            candidates = self._init_assignments(k, attr)
            if candidates:
                return self._pick(obj, k, attr, candidates)
            if attr in info.class_assigns:
                value = self._eval_class_level(k, info.class_assigns[attr])
                return self._repath(value, f"{obj.path}.{attr}")
        return Unknown(f"{obj.cls[1]} has no attribute {attr} the probe can see")

    def _eval_class_level(self, owner: ClassKey, node: Any) -> Value:
        expr = self.index.expression(owner[0], node)
        if expr is None:
            return Unknown("unreadable class attribute")
        return self.eval(expr, Frame(None, owner, owner[0], None))

    def _constructors(self, owner: ClassKey) -> list[str]:
        """``__init__`` and the methods it calls on ``self`` (``self._init_layers(...)``)."""
        info = self.index.class_info(owner)
        if info is None or "__init__" not in info.functions:
            return []
        text = self.index.function_text(owner, info.functions["__init__"])
        called = [n for n in info.functions if n != "__init__" and f"self.{n}(" in text]
        return ["__init__", *called]

    def _init_mentions(self, owner: ClassKey, attr: str) -> list[str]:
        """Constructor methods of ``owner`` that assign ``self.<attr>``."""
        info = self.index.class_info(owner)
        if info is None:
            return []
        pattern = re.compile(rf"self\.{re.escape(attr)}\s*(?::[^=\n]*)?=(?!=)")
        return [n for n in self._constructors(owner)
                if pattern.search(self.index.function_text(owner, info.functions[n]))]

    def _init_assignments(self, owner: ClassKey, attr: str) -> list[tuple[CstFunction, cst.BaseExpression, cst.CSTNode]]:
        key = (owner, attr)
        if key in self._init_cache:
            return self._init_cache[key]
        found: list[tuple[CstFunction, cst.BaseExpression, cst.CSTNode]] = []
        for name in self._init_mentions(owner, attr):
            fn = self.index.function(owner, name)
            if fn is None:
                continue
            target = m.Attribute(value=m.Name("self"), attr=m.Name(attr))
            for stmt in _walk_statements(fn.node.body):
                if isinstance(stmt, cst.Assign) and any(m.matches(t.target, target) for t in stmt.targets):
                    found.append((fn, stmt.value, stmt))
                elif isinstance(stmt, cst.AnnAssign) and stmt.value is not None and m.matches(stmt.target, target):
                    found.append((fn, stmt.value, stmt))
                elif isinstance(stmt, cst.Assign) and any(
                    isinstance(t.target, cst.Tuple) and any(m.matches(e.value, target) for e in t.target.elements)
                    for t in stmt.targets
                ):
                    found.append((fn, cst.Name("__unpacked__"), stmt))
        self._init_cache[key] = found
        return found

    def _pick(self, obj: Obj, owner: ClassKey, attr: str, candidates: list) -> Value:
        values: list[Value] = []
        for fn, expr, stmt in candidates:
            if m.matches(expr, m.Name("__unpacked__")):
                values.append(Unknown(f"{attr} comes from tuple unpacking"))
                continue
            frame = self._constructor_frame(obj, owner, fn, stmt)
            v = self.eval(expr, frame)
            if isinstance(v, Const) and v.value is None:
                continue  # "not built in this configuration"; the other assignment is the class
            values.append(self._repath(v, f"{obj.path}.{attr}"))
        distinct: list[Value] = []
        for v in values:
            if v not in distinct:
                distinct.append(v)
        if not distinct:
            return Const(None)
        if len(distinct) == 1:
            return distinct[0]
        labels = ", ".join(_describe(v) for v in distinct)
        choice = self.assume(("attr", obj.cls, attr), tuple(range(len(distinct))),
                             f"{obj.cls[1]}.{attr} may be any of {labels}")
        return distinct[choice]

    def _constructor_frame(self, obj: Obj, owner: ClassKey, fn: CstFunction, stmt: cst.CSTNode) -> Frame:
        """A frame of ``owner.__init__`` for an object of class ``obj.cls``: arguments that a
        subclass's ``super().__init__(...)`` passes are taken from there; the others take their
        defaults (the model loader passes only the config, quantisation config and prefix)."""
        frame = Frame(fn=fn, owner=owner, path=fn.path, self_obj=obj, stmt=stmt, lazy=True)
        params = fn.node.params
        named = [*params.posonly_params, *params.params]
        frame.locals[named[0].name.value if named else "self"] = obj
        passed = self._super_init_args(obj, owner)
        for i, p in enumerate([*named[1:], *params.kwonly_params]):
            pname = p.name.value
            if pname in passed:
                frame.locals[pname] = passed[pname]
            elif p.default is not None:
                frame.locals[pname] = self.eval(p.default, Frame(None, owner, fn.path, None))
            else:
                frame.locals[pname] = Unknown(f"constructor argument {pname}")
        return frame

    def _super_init_args(self, obj: Obj, owner: ClassKey) -> dict[str, Value]:
        """Keyword arguments the subclasses of ``owner`` (in ``obj``'s MRO) pass up through
        ``super().__init__(...)``, evaluated in their own constructors."""
        out: dict[str, Value] = {}
        mro = self.index.mro(obj.cls)
        if owner not in mro:
            return out
        for k in mro[: mro.index(owner)]:
            info = self.index.class_info(k)
            if info is None or "__init__" not in info.functions:
                continue
            if "__init__(" not in self.index.function_text(k, info.functions["__init__"]).split(":", 1)[-1]:
                continue
            fn = self.index.function(k, "__init__")
            if fn is None:
                continue
            call = m.Call(func=m.Attribute(value=m.OneOf(m.Call(func=m.Name("super")), m.Name()), attr=m.Name("__init__")))
            for c in fn.findall(call):
                frame = self._constructor_frame(obj, k, fn, c) if (obj.cls, k) not in self._lazy_guard else None
                if frame is None:
                    continue
                self._lazy_guard.add((obj.cls, k))
                try:
                    for a in c.args:  # type: ignore[attr-defined]
                        if a.keyword is not None and a.keyword.value not in out:
                            out[a.keyword.value] = self.eval(a.value, frame)
                finally:
                    self._lazy_guard.discard((obj.cls, k))
        return out

    @staticmethod
    def _repath(v: Value, path: str) -> Value:
        return Obj(v.cls, path) if isinstance(v, Obj) else v

    def eval_subscript(self, node: cst.Subscript, frame: Frame) -> Value:
        if m.matches(node.value, m.Attribute(attr=m.Name("layers"))):
            holder = self.eval(node.value.value, frame)  # type: ignore[attr-defined]
            if isinstance(holder, Obj) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
                return LayerItem(holder, self.eval(node.slice[0].slice.value, frame))
        base = self.eval(node.value, frame)
        if len(node.slice) != 1 or not isinstance(node.slice[0].slice, cst.Index):
            return Unknown("slice")
        index = self.eval(node.slice[0].slice.value, frame)
        if isinstance(index, Elem) and not isinstance(base, (Seq, Tup)):
            self.note(f"the ids index `{code(node.value)}` (line {self.line(frame)}), which the probe does not follow")
        if isinstance(base, Seq) and isinstance(index, Const) and isinstance(index.value, int):
            if base.explicit:
                return IdItem(index.value, base.offset)
            if base.terms is not None and -len(base.terms) <= index.value < len(base.terms):
                return base.terms[index.value]
        if isinstance(base, Tup) and isinstance(index, Const) and isinstance(index.value, int):
            if -len(base.items) <= index.value < len(base.items):
                return base.items[index.value]
        return Unknown(f"subscript {code(node)[:60]}")

    def binop(self, left: Value, op: cst.BaseBinaryOp | cst.BaseAugOp, right: Value) -> Value:
        name = type(op).__name__.replace("Assign", "")
        if isinstance(left, Elem) and isinstance(right, Const) and isinstance(right.value, int):
            if name == "Add":
                return Elem(left.seq, left.offset + right.value)
            if name == "Subtract":
                return Elem(left.seq, left.offset - right.value)
        if isinstance(right, Elem) and isinstance(left, Const) and isinstance(left.value, int) and name == "Add":
            return Elem(right.seq, right.offset + left.value)
        a, b = Lin.of(left), Lin.of(right)
        if a is not None and b is not None:
            if name == "Add" and (a.mul == 0 or b.mul == 0):
                lin, k = (a, b.add) if b.mul == 0 else (b, a.add)
                return _lin_or_const(lin.shifted(k))
            if name == "Subtract" and b.mul == 0:
                return _lin_or_const(a.shifted(-b.add))
            if name == "Multiply" and (a.mul == 0 or b.mul == 0):
                lin, k = (a, b.add) if b.mul == 0 else (b, a.add)
                if lin.div == 1 and lin.add == 0:
                    return _lin_or_const(Lin(lin.mul * k, 1, 0))
                if lin.mul == 0:
                    return Const(lin.add * k)
            if name == "FloorDivide" and b.mul == 0 and b.add > 0:
                if a.mul == 0:
                    return Const(a.add // b.add)
                if a.div == 1 and a.add == 0:
                    return Lin(a.mul, b.add, 0)
        if isinstance(left, Const) and isinstance(right, Const):
            try:
                import operator

                ops = {"Add": operator.add, "Subtract": operator.sub, "Multiply": operator.mul,
                       "FloorDivide": operator.floordiv, "Modulo": operator.mod}
                if name in ops:
                    return Const(ops[name](left.value, right.value))
            except Exception:
                pass
        return Unknown("arithmetic")

    def eval_comparison(self, node: cst.Comparison, frame: Frame) -> Value:
        left = self.eval(node.left, frame)
        result: Value = Const(True)
        for target in node.comparisons:
            right = self.eval(target.comparator, frame)
            r = self.compare(left, target.operator, right, frame)
            if isinstance(result, Const) and result.value is True:
                result = r
            elif isinstance(r, Const) and r.value is True:
                pass
            else:
                result = Const(bool(self.truth(result, node, frame) and self.truth(r, node, frame)))
            left = right
        return result

    def compare(self, left: Value, op: cst.BaseCompOp, right: Value, frame: Frame) -> Value:
        if isinstance(op, (cst.Is, cst.IsNot)):
            if isinstance(left, Unknown) or isinstance(right, Unknown):
                return Unknown("identity test")
            if isinstance(left, ClassRef) and isinstance(right, ClassRef):
                return Const((left == right) == isinstance(op, cst.Is))
            same = left == right if isinstance(left, Const) and isinstance(right, Const) else (
                False if (isinstance(left, Const) or isinstance(right, Const)) else None)
            if same is None:
                return Unknown("identity test")
            return Const(same if isinstance(op, cst.Is) else not same)
        if isinstance(op, (cst.Equal, cst.NotEqual)):
            negated = isinstance(op, cst.NotEqual)
            for a, b in ((left, right), (right, left)):
                if isinstance(a, IdItem) and a.index == 0 and isinstance(b, Const) and isinstance(b.value, int):
                    return Pred(FirstIdEquals(b.value - a.offset), negated)
                if isinstance(a, IdMax) and Lin.of(b) is not None:
                    return Pred(MaxIdEquals(Lin.of(b).shifted(-a.offset).term()), negated)  # type: ignore[union-attr]
            if isinstance(left, (Const, Lin)) and isinstance(right, (Const, Lin)):
                if left == right:
                    return Const(not negated)
                if isinstance(left, Const) and isinstance(right, Const):
                    return Const((left.value == right.value) != negated)
            return Unknown("equality")
        if isinstance(op, (cst.LessThan, cst.LessThanEqual, cst.GreaterThan, cst.GreaterThanEqual)):
            if isinstance(left, Elem) or isinstance(right, Elem):
                self.note(f"ids outside a range test are skipped (line {self.line(frame)})")
                return Const(True)
            if isinstance(left, Const) and isinstance(right, Const):
                try:
                    import operator

                    fn = {cst.LessThan: operator.lt, cst.LessThanEqual: operator.le,
                          cst.GreaterThan: operator.gt, cst.GreaterThanEqual: operator.ge}[type(op)]
                    return Const(fn(left.value, right.value))
                except Exception:
                    return Unknown("ordering")
            return Unknown("ordering")
        if isinstance(op, (cst.In, cst.NotIn)):
            if isinstance(right, Tup) and isinstance(left, Const) and all(isinstance(i, Const) for i in right.items):
                inside = any(left == i for i in right.items)
                return Const(inside if isinstance(op, cst.In) else not inside)
            return Unknown("membership")
        return Unknown("comparison")

    def _truth(self, v: Value) -> bool | None:
        if isinstance(v, Const):
            return bool(v.value)
        if isinstance(v, (Seq, Obj, ClassRef, Bound, PPGroup, Lin, LayerItem, Elem, ModuleRef, Builtin)):
            return True
        if isinstance(v, Tup):
            return bool(v.items)
        return None

    def truth(self, v: Value, node: cst.CSTNode, frame: Frame) -> bool:
        if isinstance(v, Pred):
            held = self.assume(("pred", v.cond), (True, False), str(v.cond))
            return held != v.negated
        t = self._truth(v)
        if t is None:
            where = frame.fn.label if frame.fn else frame.path
            order = frame.fn.order(node) if frame.fn else 0
            t = self.assume(("cond", where, order, code(node)), (True, False), _Label(node, frame.fn, where))
        return t

    def eval_literal(self, node: cst.List | cst.Tuple | cst.Set, frame: Frame) -> Value:
        items: list[Value] = []
        for el in node.elements:
            if isinstance(el, cst.StarredElement):
                return Unknown("starred element")
            items.append(self.eval(el.value, frame))
        lins = [Lin.of(v) for v in items]
        if all(x is not None for x in lins):
            return Seq(terms=tuple(lins), dedup=isinstance(node, cst.Set))  # type: ignore[arg-type]
        return Tup(tuple(items))

    def eval_comprehension(self, node: cst.ListComp | cst.SetComp | cst.GeneratorExp, frame: Frame) -> Value:
        comp = node.for_in
        if comp.ifs or comp.inner_for_in is not None or not isinstance(comp.target, cst.Name):
            return Unknown(f"comprehension {code(node)[:60]}")
        it = self.eval(comp.iter, frame)
        if not isinstance(it, Seq):
            return Unknown(f"comprehension over {_describe(it)}")
        inner = Frame(frame.fn, frame.owner, frame.path, frame.self_obj, dict(frame.locals), frame.stmt, frame.lazy)
        inner.locals[comp.target.value] = Elem(it)
        elt = self.eval(node.elt, inner)
        if isinstance(elt, Elem) and elt.seq == it:
            out = it.shifted(elt.offset)
            return replace(out, dedup=True) if isinstance(node, cst.SetComp) else out
        return Unknown(f"comprehension {code(node)[:60]}")

    # -- calls -------------------------------------------------------------------------------
    def eval_call(self, node: cst.Call, frame: Frame) -> Value:
        func = self.eval(node.func, frame)
        args: list[Value] = []
        kwargs: dict[str, Value] = {}
        for a in node.args:
            if a.star:
                args.append(Unknown("*args"))
                continue
            v = self.eval(a.value, frame)
            if a.keyword is not None:
                kwargs[a.keyword.value] = v
            else:
                args.append(v)
        if isinstance(func, Builtin):
            return self.call_builtin(func.name, node, args, kwargs, frame)
        if isinstance(func, (External, Unknown)) and m.matches(node.func, m.Name("get_pp_group")):
            return PPGroup()
        return self.call_value(func, args, kwargs, code(node.func), frame, frame.fn.label if frame.fn else "?")

    def call_value(self, func: Value, args: list[Value], kwargs: dict[str, Value], text: str, frame: Frame | None, where: str) -> Value:
        if isinstance(func, Bound):
            return self.run(func.owner, func.name, func.obj, args, kwargs)
        if isinstance(func, ClassRef):
            return Obj(func.cls, f"{func.cls[1]}()")
        if isinstance(func, (External, Unknown)):
            name = func.name if isinstance(func, External) else text.split(".")[-1]
            hooked = self.hooks.call_function(self, name, args, kwargs)
            if hooked is not None:
                return hooked
        if any(_carries_ids(v) for v in [*args, *kwargs.values()]):
            self.effects.append(Lost(f"passes ids to {text}, which the probe cannot follow ({_describe(func)})",
                                     Site(frame.fn, frame.stmt) if frame else Site(None, None), where))
        if isinstance(func, Unknown) and not func.why.startswith("name "):
            return Unknown(f"result of {text}, {func.why}" if not func.why.startswith("result of") else func.why)
        return Unknown(f"result of {text}")

    def call_builtin(self, name: str, node: cst.Call, args: list[Value], kwargs: dict[str, Value], frame: Frame) -> Value:
        first = args[0] if args else None
        if name in ("list", "tuple", "iter", "reversed") and len(args) == 1:
            if isinstance(first, Seq):
                return first if name != "reversed" else Unknown("reversed ids")
            return first if isinstance(first, Tup) else Unknown(f"{name}(...)")
        if name == "sorted" and len(args) == 1 and not kwargs:
            return replace(first, sorted=True) if isinstance(first, Seq) else Unknown("sorted(...)")
        if name in ("set", "frozenset") and len(args) == 1:
            return replace(first, dedup=True) if isinstance(first, Seq) else Unknown("set(...)")
        if name == "len" and len(node.args) == 1:
            if m.matches(node.args[0].value, m.Attribute(attr=m.Name("layers"))):
                return L
            return Unknown("len(...)")
        if name == "max" and len(args) == 1 and isinstance(first, Seq) and first.explicit:
            return IdMax(first.offset)
        if name == "hasattr" and len(args) == 2 and isinstance(args[1], Const):
            if isinstance(first, Obj):
                return Const(bool(self.has_attr(first, args[1].value)))
            if isinstance(first, Const) and first.value is None:
                return Const(False)
            return first if isinstance(first, Unknown) else Unknown("hasattr")
        if name == "getattr" and len(args) >= 2 and isinstance(args[1], Const):
            if isinstance(first, Obj):
                if self.has_attr(first, args[1].value):
                    return self.load_attr(first, args[1].value)
                if len(args) == 3:
                    return args[2]
                raise Raised(f"AttributeError: {first.cls[1]} has no {args[1].value} (line {self.line(frame)})")
            if isinstance(first, LayerItem):
                return Unknown("per-layer attribute")
            return first if isinstance(first, Unknown) else Unknown("getattr")
        if name == "setattr" and len(args) == 3 and isinstance(args[1], Const):
            recv = self.eval_receiver(node.args[0].value, frame)
            self.store(recv, args[1].value, args[2], frame)
            return Const(None)
        if name == "isinstance" and len(args) == 2 and isinstance(first, Obj):
            classes = args[1].items if isinstance(args[1], Tup) else (args[1],)
            if all(isinstance(c, ClassRef) for c in classes):
                mro = self.index.mro(first.cls)
                return Const(any(c.cls in mro for c in classes))  # type: ignore[union-attr]
            return Unknown("isinstance against a class outside the package")
        if name == "super":
            if frame.self_obj is not None and frame.owner is not None:
                return Super(frame.self_obj, frame.owner)
            return Unknown("super()")
        if name == "print":
            return Const(None)
        return Unknown(f"{name}(...)")


# ---------------------------------------------------------------------------------------------
class _Label:
    """A fork's human-readable text, with its line resolved only when printed."""

    def __init__(self, node: cst.CSTNode, fn: CstFunction | None, where: str) -> None:
        self.node, self.fn, self.where = node, fn, where

    def __str__(self) -> str:
        line = f":{self.fn.line(self.node)}" if self.fn is not None else ""
        return f"`{code(self.node)}` ({self.where.split(':')[0]}{line})"

    def __hash__(self) -> int:
        return hash((self.where, id(self.node)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Label) and (self.where, self.node) == (other.where, other.node)

    def __lt__(self, other: object) -> bool:
        return str(self) < str(other)


def _lin_or_const(v: Lin) -> Value:
    return Const(v.add) if v.mul == 0 else v


def _carries_ids(v: Value) -> bool:
    return isinstance(v, (Seq, Elem)) or (isinstance(v, Tup) and any(_carries_ids(i) for i in v.items))


def _describe(v: Value) -> str:
    if isinstance(v, Obj):
        return f"{v.cls[1]} ({v.cls[0]})"
    if isinstance(v, ClassRef):
        return f"class {v.cls[1]}"
    if isinstance(v, Unknown):
        return v.why
    if isinstance(v, External):
        return f"{v.name} (outside the model files)"
    return type(v).__name__


describe = _describe


def _walk_statements(body: cst.BaseSuite | Sequence[cst.CSTNode]) -> Iterator[cst.BaseSmallStatement | cst.BaseCompoundStatement]:
    """Every statement in ``body`` (small statements unpacked), not entering nested definitions."""
    stmts = body.body if isinstance(body, (cst.IndentedBlock, cst.SimpleStatementSuite)) else body
    for stmt in stmts:
        if isinstance(stmt, cst.SimpleStatementLine):
            yield from stmt.body
        elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue
        else:
            yield stmt
            for attr in ("body", "orelse", "finalbody"):
                child = getattr(stmt, attr, None)
                if isinstance(child, (cst.IndentedBlock, cst.SimpleStatementSuite)):
                    yield from _walk_statements(child)
                elif isinstance(child, (cst.Else, cst.Finally)):
                    yield from _walk_statements(child.body)
                elif isinstance(child, cst.If):
                    yield from _walk_statements([child])
            for h in getattr(stmt, "handlers", ()) or ():
                yield from _walk_statements(h.body)

