"""The values a condition in engine source can take, from its ``and``/``or``/``not`` structure.

A branch test such as ``arch == "X" or not get_pp_group().is_first_rank`` is read as a boolean
formula over its leaves (whatever is not ``and``, ``or`` or ``not``). A caller decides each leaf it
can (True or False for the case it asks about) and leaves the others free; the answer is the set
of values the whole test takes over every value of the free leaves: ``{True}`` (always taken),
``{False}`` (never) or both (it depends on something not decided).
"""

from __future__ import annotations

import ast
from collections.abc import Callable

MOST_FREE = 10  # free leaves evaluated exhaustively (2**n runs); more: not read


def leaves(test: ast.expr) -> list[ast.expr]:
    """The leaves of ``test`` under its ``and``/``or``/``not``, in source order."""
    out: list[ast.expr] = []

    def collect(n: ast.expr) -> None:
        if isinstance(n, ast.BoolOp):
            for v in n.values:
                collect(v)
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            collect(n.operand)
        else:
            out.append(n)
    collect(test)
    return out


def condition_values(test: ast.expr, decide: Callable[[ast.expr], bool | None]) -> set[bool] | None:
    """The values ``test`` can take, each leaf ``decide``d (None: free, either value; the same
    expression twice is one leaf, with one value); None where more than :data:`MOST_FREE` leaves are
    free (not read, rather than guessed)."""
    decided: dict[str, bool | None] = {}
    for n in leaves(test):
        decided.setdefault(ast.dump(n), decide(n))
    free = [k for k, v in decided.items() if v is None]
    if len(free) > MOST_FREE:
        return None

    def value(n: ast.expr, given: dict[str, bool]) -> bool:
        if isinstance(n, ast.BoolOp):
            vals = [value(v, given) for v in n.values]
            return all(vals) if isinstance(n.op, ast.And) else any(vals)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            return not value(n.operand, given)
        key = ast.dump(n)
        d = decided[key]
        return given[key] if d is None else d
    return {value(test, {k: bool(run >> j & 1) for j, k in enumerate(free)}) for run in range(2 ** len(free))}
