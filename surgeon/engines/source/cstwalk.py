"""A libcst tree's children and lines, read without libcst's visitor machinery.

libcst's visitors rebuild every node they pass (``_visit_and_replace_children`` constructs and
validates a new node even when nothing changes), and :class:`~libcst.metadata.PositionProvider`
generates the code of the whole tree behind a :class:`~libcst.metadata.MetadataWrapper` visit:
together they were over a third of a cold probe and of patch coverage, spent on the parents of
nodes and the few lines that messages and reports name.

- :func:`children`: a node's children in exactly the order libcst visits them, read from the node's
  fields in the order its own ``_visit_and_replace_children`` visits them (taken once per node
  class from libcst's source), with libcst's ``children`` as the fallback.
- :class:`StatementLines`: file lines from the stdlib ``ast`` tree of the same source, which the
  probe and the planner have parsed anyway.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterator

import libcst as cst
from libcst.metadata import CodeRange
from libcst.metadata.position_provider import PositionProvidingCodegenState

_STATEMENT = (cst.BaseSmallStatement, cst.BaseCompoundStatement)
_IS_STATEMENT: dict[type, bool] = {}
_FIELD_ORDER: dict[type, tuple[str, ...] | None] = {}


def _field_order(t: type) -> tuple[str, ...] | None:
    """The fields ``t._visit_and_replace_children`` visits, in the order it visits them (the
    keyword arguments of the node it builds are evaluated in the order they are written); None
    when its source cannot be read that way."""
    if t not in _FIELD_ORDER:
        order: tuple[str, ...] | None = None
        method = getattr(t, "_visit_and_replace_children", None)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(method))) if method is not None else None
        except (OSError, TypeError, SyntaxError):
            tree = None
        if tree is not None:
            calls = sorted((n.lineno, n.col_offset, n.args[1].value) for n in ast.walk(tree)
                           if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id.startswith("visit_")
                           and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str))
            order = tuple(dict.fromkeys(name for _, _, name in calls))  # a field visited in two branches: once
        _FIELD_ORDER[t] = order
    return _FIELD_ORDER[t]


def children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """``node.children`` (the nodes libcst's visitors visit under ``node``, in their order), without
    building the copy of ``node`` that libcst builds to answer it."""
    order = _field_order(type(node))
    if order is None:
        return list(node.children)
    out: list[cst.CSTNode] = []
    for name in order:
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, cst.CSTNode))
    return out


def family(top: cst.CSTNode, parents: dict[cst.CSTNode, cst.CSTNode],
           kids: dict[int, tuple[cst.CSTNode, list[cst.CSTNode]]]) -> None:
    """Fill ``parents`` (node -> parent) and ``kids`` (id(node) -> (node, children)) for every node
    under ``top``, as a libcst visitor recording them would."""
    stack = [top]
    while stack:
        node = stack.pop()
        below = children(node)
        kids[id(node)] = (node, below)
        for child in below:
            parents[child] = node
        stack.extend(below)


def is_statement(node: cst.CSTNode) -> bool:
    t = type(node)
    hit = _IS_STATEMENT.get(t)
    if hit is None:
        hit = _IS_STATEMENT[t] = issubclass(t, _STATEMENT)
    return hit
_AST_NAME = {"Del": "Delete"}


class _Positions:
    """The provider side of libcst's position codegen state: where it records ranges."""

    def __init__(self) -> None:
        self._computed: dict[cst.CSTNode, CodeRange] = {}


class StatementLines:
    """File lines of a function's nodes without running libcst's position codegen over the whole
    function (which cost a cold probe a quarter of its time).

    The function's statements, in source order, are the same in libcst and in ``ast`` (small
    statements one by one, compound statements by their header), so a statement's lines are its
    ``ast`` node's ``lineno``/``end_lineno``. A node inside a statement is placed by libcst's own
    position codegen of that one statement: the lines from the statement's start to the node are
    the same whether the statement is generated alone or inside its file, since indentation is
    added only at the start of a line. When the two trees do not line up, ``ok`` is false and the
    caller falls back to libcst's :class:`PositionProvider`.
    """

    def __init__(self, nodes: list[cst.CSTNode], parents: dict[cst.CSTNode, cst.CSTNode],
                 fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._parent = parents
        self._stmt: dict[cst.CSTNode, tuple[int, int]] = {}
        self._inner: dict[cst.CSTNode, dict[cst.CSTNode, CodeRange]] = {}
        ours = [n for n in nodes if is_statement(n)]
        theirs = [n for n in _ast_preorder(fn) if isinstance(n, ast.stmt)]
        self.ok = len(ours) == len(theirs) and all(
            _AST_NAME.get(type(a).__name__, type(a).__name__) == type(b).__name__.removeprefix("Async")
            for a, b in zip(ours, theirs))
        if self.ok:
            for a, b in zip(ours, theirs):
                self._stmt[a] = (b.lineno, b.end_lineno or b.lineno)

    def span(self, node: cst.CSTNode) -> tuple[int, int] | None:
        if node in self._stmt:
            return self._stmt[node]
        if isinstance(node, cst.SimpleStatementLine) and node.body and node.body[0] in self._stmt:
            return self._stmt[node.body[0]][0], self._stmt[node.body[-1]][1]
        stmt = next((a for a in _ancestors(self._parent, node) if a in self._stmt), None)
        if stmt is None:
            return None
        inner = self._inner.get(stmt)
        if inner is None:
            provider = _Positions()
            state = PositionProvidingCodegenState(default_indent="    ", default_newline="\n", provider=provider)  # type: ignore[arg-type]
            stmt._codegen(state)
            inner = self._inner[stmt] = provider._computed
        base, here = inner.get(stmt), inner.get(node)
        if base is None or here is None:
            return None
        first = self._stmt[stmt][0] - base.start.line
        return here.start.line + first, here.end.line + first


def _ancestors(parents: dict[cst.CSTNode, cst.CSTNode], node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    while node in parents:
        node = parents[node]
        yield node


def _ast_preorder(node: ast.AST) -> Iterator[ast.AST]:
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(list(ast.iter_child_nodes(n))))
