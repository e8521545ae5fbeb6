"""The values, effects and control signals of the capture-setter interpreter (:mod:`surgeon.engines.interp`).

Kept apart from the interpreter's parts (statements, expressions, calls, attributes) so that each
part, the probes and the classifier can share one vocabulary without importing one another:
this module depends on nothing of the interpreter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

import libcst as cst

from surgeon.core.idrules import DefaultTerm, FirstIdEquals, MaxIdEquals
from surgeon.engines.source.index import ClassKey, CstFunction, code


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
    def of(cls, v: Value) -> Lin | None:
        if isinstance(v, Lin):
            return v
        if isinstance(v, Const) and isinstance(v.value, int) and not isinstance(v.value, bool):
            return Lin(0, 1, v.value)
        return None

    def term(self) -> DefaultTerm:
        return DefaultTerm(self.mul, self.div, self.add)

    def shifted(self, k: int) -> Lin:
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

    def shifted(self, k: int) -> Seq:
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
class Made:
    """The call that built an object, as the probe read it: ``Cls(*args, **kwargs)`` in the source."""

    args: tuple[Value, ...]
    kwargs: tuple[tuple[str, Value], ...]
    starred: bool  # a ``*x`` or ``**x`` argument the probe cannot expand: any parameter may be in it
    where: str  # ``path:line`` of the call


@dataclass(frozen=True)
class Obj:
    """An object of class ``cls``. ``made``: the call that built it, when the probe read one (None:
    the engine builds it, the probed class itself or a class its registry builds, with its own fixed
    arguments). ``assumed``: why its class is not certain (it rests on a constructor parameter's
    default that a caller the probe did not read may override). Neither takes part in identity."""

    cls: ClassKey
    path: str  # how it was reached, e.g. "self.model" (identity within one run)
    made: Made | None = field(default=None, compare=False)
    assumed: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ClassRef:
    cls: ClassKey
    assumed: str | None = field(default=None, compare=False)  # as Obj.assumed


@dataclass(frozen=True)
class FuncRef:
    """A module-level function of the package (``build_model`` defined in ``path``)."""

    path: str
    name: str


@dataclass(frozen=True)
class ModuleRef:
    path: str


@dataclass(frozen=True)
class Bound:
    obj: Obj | None
    owner: ClassKey
    name: str
    on: ClassKey | None = None  # the class the method was looked up on (a classmethod's ``cls``)


@dataclass(frozen=True)
class Super:
    obj: Obj
    after: ClassKey


@dataclass(frozen=True)
class LayerItem:
    """``holder.layers[index]``."""

    holder: Obj
    index: Value


@dataclass(frozen=True)
class PPGroup:
    """The pipeline-parallel group, modelled as a single rank."""


@dataclass(frozen=True)
class Tup:
    items: tuple[Value, ...]


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


Value: TypeAlias = (Const | Lin | Seq | Elem | IdItem | IdMax | Pred | Obj | ClassRef | FuncRef | ModuleRef | Bound
                    | Super | LayerItem | PPGroup | Tup | Builtin | External | Unknown)

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


Effect: TypeAlias = Store | FlagMark | Lost


@dataclass
class Outcome:
    effects: list[Effect]
    returned: Value | None
    raised: str | None
    notes: list[str]
    labels: dict  # fork key -> human-readable text


class Fork(Exception):
    """The run reached a decision it cannot make; :func:`explore` reruns it once per option."""

    def __init__(self, key: tuple, options: tuple) -> None:
        super().__init__(key)
        self.key = key
        self.options = options


class Returned(Exception):
    """A ``return`` unwinding the interpreted function's statements."""

    def __init__(self, value: Value) -> None:
        self.value = value


class Raised(Exception):
    """The interpreted code raises on this path (a ``raise``, a failed ``assert``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BreakLoop(Exception):
    """A ``break`` leaving the loop being followed."""


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
        except Fork as f:
            for option in reversed(f.options):
                pending.append({**assumptions, f.key: option})
            if len(pending) + len(leaves) > max_leaves:
                raise TooManyPaths(f"more than {max_leaves} paths") from None
            continue
        leaves.append((assumptions, outcome))
    return leaves


# ---------------------------------------------------------------------------------------------
# Frames and helpers shared by the interpreter's parts
# ---------------------------------------------------------------------------------------------
@dataclass
class Frame:
    """One function activation: its locals and the statement being executed (for lines and forks)."""

    fn: CstFunction | None
    owner: ClassKey | None
    path: str  # module for name resolution
    self_obj: Obj | None
    locals: dict[str, Value] = field(default_factory=dict)
    stmt: cst.CSTNode | None = None  # the statement being executed
    lazy: bool = False  # resolve unassigned locals from earlier assignments (attribute lookups)


def frame_line(frame: Frame) -> int:
    """The line of the statement ``frame`` is executing (0 outside a function)."""
    return frame.fn.line(frame.stmt) if frame.fn is not None and frame.stmt is not None else 0


def known_truth(v: Value) -> bool | None:
    """The truth of ``v`` when the value alone decides it, else None (the caller forks)."""
    if isinstance(v, Const):
        return bool(v.value)
    if isinstance(v, (Seq, Obj, ClassRef, FuncRef, Bound, PPGroup, Lin, LayerItem, Elem, ModuleRef, Builtin)):
        return True
    if isinstance(v, Tup):
        return bool(v.items)
    return None


class ForkLabel:
    """A fork's human-readable text, with its line resolved only when printed."""

    def __init__(self, node: cst.CSTNode, fn: CstFunction | None, where: str) -> None:
        self.node, self.fn, self.where = node, fn, where

    def __str__(self) -> str:
        line = f":{self.fn.line(self.node)}" if self.fn is not None else ""
        return f"`{code(self.node)}` ({self.where.split(':')[0]}{line})"

    def __hash__(self) -> int:
        return hash((self.where, id(self.node)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ForkLabel) and (self.where, self.node) == (other.where, other.node)

    def __lt__(self, other: object) -> bool:
        return str(self) < str(other)


def lin_or_const(v: Lin) -> Value:
    return Const(v.add) if v.mul == 0 else v


def carries_ids(v: Value) -> bool:
    return isinstance(v, (Seq, Elem)) or (isinstance(v, Tup) and any(carries_ids(i) for i in v.items))


def assuming(v: Value, why: str | None) -> Value:
    """``v`` marked as resting on ``why`` (an object or class whose choice a default decided);
    other values, and values already marked, are returned as they are."""
    if why is not None and isinstance(v, (Obj, ClassRef)) and v.assumed is None:
        return replace(v, assumed=why)
    return v


def describe(v: Value) -> str:
    if isinstance(v, Obj):
        return f"{v.cls[1]} ({v.cls[0]})"
    if isinstance(v, ClassRef):
        return f"class {v.cls[1]}"
    if isinstance(v, Unknown):
        return v.why
    if isinstance(v, External):
        return f"{v.name} (outside the model files)"
    if isinstance(v, FuncRef):
        return f"function {v.name} ({v.path})"
    return type(v).__name__



def walk_statements(body: cst.BaseSuite | Sequence[cst.CSTNode]) -> Iterator[cst.BaseSmallStatement | cst.BaseCompoundStatement]:
    """Every statement in ``body`` (small statements unpacked), not entering nested definitions."""
    stmts = body.body if isinstance(body, cst.BaseSuite) else body  # BaseSuite: an IndentedBlock or SimpleStatementSuite
    for stmt in stmts:
        if isinstance(stmt, cst.SimpleStatementLine):
            yield from stmt.body
        elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue
        elif isinstance(stmt, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):  # what a block can hold besides lines
            yield stmt
            for attr in ("body", "orelse", "finalbody"):
                child = getattr(stmt, attr, None)
                if isinstance(child, (cst.IndentedBlock, cst.SimpleStatementSuite)):
                    yield from walk_statements(child)
                elif isinstance(child, (cst.Else, cst.Finally)):
                    yield from walk_statements(child.body)
                elif isinstance(child, cst.If):
                    yield from walk_statements([child])
            for h in getattr(stmt, "handlers", ()) or ():
                yield from walk_statements(h.body)
