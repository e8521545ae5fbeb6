"""Evaluate a small pure function of a tool's source (integer arithmetic, sets, comprehensions)
from its ``ast``, without importing or executing the tool.

Model Optimizer's id presets (``default_eagle_aux_layer_ids``, ``build_target_layer_ids``) are such
functions; evaluating the parsed body for a layer count answers what the release computes, where a
hand-copied formula could drift. Anything outside the small language below raises
:class:`NotPure` (one line, naming the construct and its line): the caller then says the answer
was not read, never guesses.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any


class NotPure(ValueError):
    """The function uses something this evaluator does not model."""


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
_EXTERNALS = " externals"  # env key (not an identifier) of the caller's values for outside reads
_LOGGERS = frozenset({"logger", "log", "_logger"})


class _Return(Exception):
    def __init__(self, value: Any):
        self.value = value


def call_function(fn: ast.FunctionDef, *args: Any, externals: dict[str, Any] | None = None) -> Any:
    """``fn(*args)`` evaluated from its parsed body (positional parameters only). ``externals``:
    the value of each outside read the caller decides, keyed by its source text (an environment
    variable such as ``envs.VLLM_PP_LAYER_PARTITION`` taken as unset); any other outside read is
    :class:`NotPure`. A statement that only calls ``logger.<level>(...)`` is skipped (logging)."""
    params = [a.arg for a in fn.args.args]
    if len(params) != len(args):
        raise NotPure(f"{fn.name} takes {len(params)} arguments, got {len(args)}")
    env: dict[str, Any] = dict(zip(params, args))
    env[_EXTERNALS] = dict(externals or {})
    try:
        _run(fn.body, env)
    except _Return as r:
        return r.value
    raise NotPure(f"{fn.name} ends without a return")


def _is_log_call(stmt: ast.stmt) -> bool:
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) and call.func.value.id in _LOGGERS)


def _run(body: list[ast.stmt], env: dict[str, Any]) -> None:
    for stmt in body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) or _is_log_call(stmt):
            continue  # docstring, logging
        if isinstance(stmt, ast.Return):
            raise _Return(None if stmt.value is None else _eval(stmt.value, env))
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            env[stmt.targets[0].id] = _eval(stmt.value, env)
        elif isinstance(stmt, ast.AugAssign) and type(stmt.op) in _BINOPS:
            _augassign(stmt, env)
        elif isinstance(stmt, ast.For) and isinstance(stmt.target, ast.Name) and not stmt.orelse:
            for item in list(_eval(stmt.iter, env)):
                env[stmt.target.id] = item
                _run(stmt.body, env)
        elif isinstance(stmt, ast.If):
            _run(stmt.body if _eval(stmt.test, env) else stmt.orelse, env)
        elif isinstance(stmt, ast.Raise):
            raise NotPure(f"line {stmt.lineno}: the function raises for these arguments")
        else:
            raise NotPure(f"line {stmt.lineno}: {type(stmt).__name__} is not modelled")


def _augassign(stmt: ast.AugAssign, env: dict[str, Any]) -> None:
    op = _BINOPS[type(stmt.op)]
    value = _eval(stmt.value, env)
    target = stmt.target
    if isinstance(target, ast.Name):
        env[target.id] = op(_eval(target, env), value)
    elif isinstance(target, ast.Subscript) and not isinstance(target.slice, ast.Slice):
        container, key = _eval(target.value, env), _eval(target.slice, env)
        if not isinstance(container, list):
            raise NotPure(f"line {stmt.lineno}: item assignment to a {type(container).__name__} is not modelled")
        container[key] = op(container[key], value)
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
        return container[lo:hi]
    return container[_eval(sl, env)]


def _comprehension(node: ast.ListComp | ast.SetComp | ast.GeneratorExp, env: dict[str, Any]) -> list[Any]:
    if len(node.generators) != 1:
        raise NotPure(f"line {node.lineno}: nested comprehensions are not modelled")
    gen = node.generators[0]
    if not isinstance(gen.target, ast.Name) or gen.is_async:
        raise NotPure(f"line {node.lineno}: comprehension target is not a name")
    out = []
    for item in _eval(gen.iter, env):
        inner = {**env, gen.target.id: item}
        if all(_eval(cond, inner) for cond in gen.ifs):
            out.append(_eval(node.elt, inner))
    return out


def _eval(node: ast.expr, env: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float | str | bool | type(None)):
        return node.value
    externals = env[_EXTERNALS]
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
        return _BINOPS[type(node.op)](_eval(node.left, env), _eval(node.right, env))
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
        return _CMPOPS[type(node.ops[0])](_eval(node.left, env), _eval(node.comparators[0], env))
    if isinstance(node, ast.IfExp):
        return _eval(node.body if _eval(node.test, env) else node.orelse, env)
    if isinstance(node, ast.Set | ast.List | ast.Tuple):
        items = [_eval(e, env) for e in node.elts]
        return set(items) if isinstance(node, ast.Set) else tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp):
        items = _comprehension(node, env)
        return set(items) if isinstance(node, ast.SetComp) else items
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _BUILTINS and not node.keywords:
        return _BUILTINS[node.func.id](*[_eval(a, env) for a in node.args])
    raise NotPure(f"line {getattr(node, 'lineno', 0)}: {ast.unparse(node)} is not modelled")
