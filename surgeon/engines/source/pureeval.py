"""Evaluate a small pure function of a tool's source (integer arithmetic, sets, comprehensions)
from its ``ast``, without importing or executing the tool.

Model Optimizer's id presets (``default_eagle_aux_layer_ids``, ``build_target_layer_ids``) are such
functions; evaluating the parsed body for a layer count answers what the release computes, where a
hand-copied formula could drift. Anything outside the small language below raises
:class:`NotPure` (one line, naming the construct and its line): the caller then says the answer
was not read, never guesses.

A body that fails for the arguments (an index out of range, a division by zero, a type error) is
:class:`NotPure` too, with the error and its line, so no caller sees a traceback. A work budget
keeps a changed engine file from hanging or exhausting memory: at most :data:`MAX_WORK` units per
call (one per node evaluated or statement run, one per element of every sequence built or
iterated) and :data:`MAX_ITEMS` elements in any one sequence, checked before it is built.
"""

from __future__ import annotations

import ast
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_WORK = 1_000_000  # units per call: a node evaluated, a statement run, an element built or iterated
MAX_ITEMS = 100_000  # elements of one sequence (list, tuple, str, set, range iterated)
MAX_INT_BITS = 4_096  # an integer result larger than this is refused (a loop squaring a number)
_SEQUENCES = (list, tuple, str, set, frozenset, dict, range)


class NotPure(ValueError):
    """The function uses something this evaluator does not model, or fails for the arguments."""


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
    ast.Div: operator.truediv, ast.Mod: operator.mod,
}
_CMPOPS: dict[type, Callable[[Any, Any], bool]] = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Eq: operator.eq,
    ast.NotEq: operator.ne, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_, ast.IsNot: operator.is_not,
}
_BUILTINS: dict[str, Callable[..., Any]] = {
    "min": min, "max": max, "sorted": sorted, "set": set, "list": list, "tuple": tuple, "round": round,
    "range": range, "len": len, "int": int, "abs": abs, "sum": sum,
}
_WORK = " work"  # env key (not an identifier) of the call's :class:`_Work`, shared by every scope
_LAZY = frozenset({"len", "range"})  # builtins that neither iterate nor build: a huge range is refused where iterated
_LOGGERS = frozenset({"logger", "log", "_logger"})


@dataclass(frozen=True)
class Evaluation:
    """What a call returned, and the ``return`` statement it executed (to cite its line)."""

    value: Any
    returned: ast.Return


class _Return(Exception):
    def __init__(self, value: Any, stmt: ast.Return):
        self.value = value
        self.stmt = stmt


class _Work:
    """One call's outside values and what it has spent so far."""

    def __init__(self, externals: dict[str, Any]):
        self.externals = externals
        self.spent = 0
        self.line = 0  # the statement being run, for an error's message

    def charge(self, units: int, node: ast.AST) -> None:
        self.spent += units
        if self.spent > MAX_WORK:
            raise NotPure(f"line {getattr(node, 'lineno', self.line)}: over the work budget of {MAX_WORK:,} "
                          "(nodes evaluated plus elements built): stopped, not evaluated to the end")

    def sized(self, value: Any, node: ast.AST) -> Any:
        """``value`` after checking and charging its length when it is a sequence."""
        if isinstance(value, _SEQUENCES):
            try:
                n = len(value)
            except OverflowError:  # a range longer than sys.maxsize
                n = sys.maxsize
            if n > MAX_ITEMS:
                raise NotPure(f"line {getattr(node, 'lineno', self.line)}: {_src(node)} has {n:,} elements, "
                              f"over the {MAX_ITEMS:,} this evaluator builds or iterates")
            self.charge(n, node)
        return value


def _src(node: ast.AST, width: int = 60) -> str:
    text = ast.unparse(node)
    return text if len(text) <= width else text[:width - 3] + "..."


def call_function(fn: ast.FunctionDef, *args: Any, externals: dict[str, Any] | None = None) -> Any:
    """``fn(*args)`` evaluated from its parsed body (positional parameters only). ``externals``:
    the value of each outside read the caller decides, keyed by its source text (an environment
    variable such as ``envs.VLLM_PP_LAYER_PARTITION`` taken as unset); any other outside read is
    :class:`NotPure`. A statement that only calls ``logger.<level>(...)`` is skipped (logging)."""
    return evaluate_function(fn, *args, externals=externals).value


def evaluate_function(fn: ast.FunctionDef, *args: Any, externals: dict[str, Any] | None = None) -> Evaluation:
    """:func:`call_function` with the ``return`` statement that produced the value."""
    params = [a.arg for a in fn.args.args]
    if len(params) != len(args):
        raise NotPure(f"{fn.name} takes {len(params)} arguments, got {len(args)}")
    env: dict[str, Any] = dict(zip(params, args))
    work = env[_WORK] = _Work(dict(externals or {}))
    try:
        _run(fn.body, env)
    except _Return as r:
        return Evaluation(r.value, r.stmt)
    except NotPure:
        raise
    except Exception as e:  # whatever the body raises for these arguments (IndexError, MemoryError, ...): one line
        why = " ".join(str(e).split())[:200]
        raise NotPure(f"line {work.line}: {fn.name} fails for these arguments: {type(e).__name__}"
                      + (f": {why}" if why else "")) from None
    raise NotPure(f"{fn.name} ends without a return")


def _is_log_call(stmt: ast.stmt) -> bool:
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) and call.func.value.id in _LOGGERS)


def _run(body: list[ast.stmt], env: dict[str, Any]) -> None:
    work: _Work = env[_WORK]
    for stmt in body:
        work.line = stmt.lineno
        work.charge(1, stmt)
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) or _is_log_call(stmt):
            continue  # docstring, logging
        if isinstance(stmt, ast.Return):
            raise _Return(None if stmt.value is None else _eval(stmt.value, env), stmt)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            env[stmt.targets[0].id] = _eval(stmt.value, env)
        elif isinstance(stmt, ast.AugAssign) and type(stmt.op) in _BINOPS:
            _augassign(stmt, env)
        elif isinstance(stmt, ast.For) and isinstance(stmt.target, ast.Name) and not stmt.orelse:
            for item in list(work.sized(_eval(stmt.iter, env), stmt.iter)):
                work.line = stmt.lineno
                env[stmt.target.id] = item
                _run(stmt.body, env)
        elif isinstance(stmt, ast.If):
            _run(stmt.body if _eval(stmt.test, env) else stmt.orelse, env)
        elif isinstance(stmt, ast.Raise):
            raise NotPure(f"line {stmt.lineno}: the function raises for these arguments")
        else:
            raise NotPure(f"line {stmt.lineno}: {type(stmt).__name__} is not modelled")


def _binop(op: type, left: Any, right: Any, node: ast.expr | ast.stmt, work: _Work) -> Any:
    """``left op right``, refusing before it is built a sequence over :data:`MAX_ITEMS` elements."""
    if op is ast.Mult:
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, list | tuple | str) and isinstance(n, int) and len(seq) * n > MAX_ITEMS:
                raise NotPure(f"line {node.lineno}: {_src(node)} would build {len(seq) * n:,} elements, "
                              f"over the {MAX_ITEMS:,} this evaluator builds")
    elif op is ast.Add and isinstance(left, list | tuple | str) and isinstance(right, list | tuple | str):
        if len(left) + len(right) > MAX_ITEMS:
            raise NotPure(f"line {node.lineno}: {_src(node)} would build {len(left) + len(right):,} elements, "
                          f"over the {MAX_ITEMS:,} this evaluator builds")
    elif op is ast.Mod and isinstance(left, str):
        raise NotPure(f"line {node.lineno}: string formatting is not modelled")
    result = work.sized(_BINOPS[op](left, right), node)
    if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
        raise NotPure(f"line {node.lineno}: {_src(node)} exceeds {MAX_INT_BITS} bits: not a layer count")
    return result


def _augassign(stmt: ast.AugAssign, env: dict[str, Any]) -> None:
    op = type(stmt.op)
    value = _eval(stmt.value, env)
    target = stmt.target
    if isinstance(target, ast.Name):
        env[target.id] = _binop(op, _eval(target, env), value, stmt, env[_WORK])
    elif isinstance(target, ast.Subscript) and not isinstance(target.slice, ast.Slice):
        container, key = _eval(target.value, env), _eval(target.slice, env)
        if not isinstance(container, list):
            raise NotPure(f"line {stmt.lineno}: item assignment to a {type(container).__name__} is not modelled")
        container[key] = _binop(op, container[key], value, stmt, env[_WORK])
    else:
        raise NotPure(f"line {stmt.lineno}: {ast.unparse(target)} += is not modelled")


def _subscript(node: ast.Subscript, env: dict[str, Any]) -> Any:
    container = _eval(node.value, env)
    if not isinstance(container, list | tuple | str):
        raise NotPure(f"line {node.lineno}: indexing a {type(container).__name__} is not modelled")
    sl = node.slice
    if isinstance(sl, ast.Slice):
        if sl.step is not None:
            raise NotPure(f"line {node.lineno}: a slice step is not modelled")
        lo = None if sl.lower is None else _eval(sl.lower, env)
        hi = None if sl.upper is None else _eval(sl.upper, env)
        return env[_WORK].sized(container[lo:hi], node)
    return container[_eval(sl, env)]


def _comprehension(node: ast.ListComp | ast.SetComp | ast.GeneratorExp, env: dict[str, Any]) -> list[Any]:
    if len(node.generators) != 1:
        raise NotPure(f"line {node.lineno}: nested comprehensions are not modelled")
    gen = node.generators[0]
    if not isinstance(gen.target, ast.Name) or gen.is_async:
        raise NotPure(f"line {node.lineno}: comprehension target is not a name")
    out = []
    for item in env[_WORK].sized(_eval(gen.iter, env), gen.iter):
        inner = {**env, gen.target.id: item}
        if all(_eval(cond, inner) for cond in gen.ifs):
            out.append(_eval(node.elt, inner))
    return out


def _eval(node: ast.expr, env: dict[str, Any]) -> Any:
    work: _Work = env[_WORK]
    work.charge(1, node)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float | str | bool | type(None)):
        return node.value
    externals = work.externals
    if isinstance(node, ast.Attribute | ast.Call) and ast.unparse(node) in externals:
        return externals[ast.unparse(node)]
    if isinstance(node, ast.NamedExpr):
        env[node.target.id] = _eval(node.value, env)
        return env[node.target.id]
    if isinstance(node, ast.Subscript):
        return _subscript(node, env)
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        raise NotPure(f"line {node.lineno}: name {node.id!r} is not a parameter or local")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _binop(type(node.op), _eval(node.left, env), _eval(node.right, env), node, work)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.Not):
        value = _eval(node.operand, env)
        return -value if isinstance(node.op, ast.USub) else not value
    if isinstance(node, ast.BoolOp):  # Python's short circuit: the deciding operand, later ones not evaluated
        stop_when = not isinstance(node.op, ast.And)  # `and` stops at a false operand, `or` at a true one
        for operand in node.values:
            value = _eval(operand, env)
            if bool(value) == stop_when:
                break
        return value
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
        left, right = _eval(node.left, env), _eval(node.comparators[0], env)
        if isinstance(right, range) and type(left) is not int and isinstance(node.ops[0], ast.In | ast.NotIn):
            work.sized(right, node.comparators[0])  # `x in range(...)` scans the range unless x is an int
        return _CMPOPS[type(node.ops[0])](left, right)
    if isinstance(node, ast.IfExp):
        return _eval(node.body if _eval(node.test, env) else node.orelse, env)
    if isinstance(node, ast.Set | ast.List | ast.Tuple):
        items = [_eval(e, env) for e in node.elts]
        return set(items) if isinstance(node, ast.Set) else tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp):
        items = _comprehension(node, env)
        return set(items) if isinstance(node, ast.SetComp) else items
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _BUILTINS and not node.keywords:
        args = [_eval(a, env) for a in node.args]
        if node.func.id in _LAZY:
            return _BUILTINS[node.func.id](*args)
        args = [work.sized(v, a) for v, a in zip(args, node.args)]  # what min/sorted/set/sum... iterate
        return work.sized(_BUILTINS[node.func.id](*args), node)
    raise NotPure(f"line {getattr(node, 'lineno', 0)}: {ast.unparse(node)} is not modelled")
