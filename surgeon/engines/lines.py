"""File lines of libcst nodes without libcst's position codegen over a whole function or module.

libcst's :class:`~libcst.metadata.PositionProvider` generates the code of everything it is asked
about, and through :class:`~libcst.metadata.MetadataWrapper` visits (and rebuilds) the whole tree
first: a quarter of a cold probe and of patch coverage went there, for the few lines their messages
and reports name. The stdlib ``ast`` tree of the same source, which the probe and the planner have
parsed anyway, already holds every statement's lines; :class:`StatementLines` pairs the two.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import libcst as cst
from libcst.metadata import CodeRange
from libcst.metadata.position_provider import PositionProvidingCodegenState

_STATEMENT = (cst.BaseSmallStatement, cst.BaseCompoundStatement)
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
        ours = [n for n in nodes if isinstance(n, _STATEMENT)]
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
