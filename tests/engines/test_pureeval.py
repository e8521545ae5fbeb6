"""The small evaluator of engine function bodies (surgeon/engines/source/pureeval.py) against Python itself.

The library never executes an engine's source; these tests may: ``eval`` of an expression string the
test built is the reference the evaluator must agree with.
"""

from __future__ import annotations

import ast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from surgeon.core.errors import BadInput
from surgeon.engines.facts.modelopt import ModeloptSource
from surgeon.engines.source import pureeval
from surgeon.engines.source.pureeval import MAX_INT_BITS, MAX_ITEMS, MAX_WORK, NotPure, call_function, evaluate_function


def _fn(src: str) -> ast.FunctionDef:
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.FunctionDef)
    return fn


def test_or_returns_the_deciding_operand_not_a_bool():
    fn = _fn("def f(n, k):\n    k = k or 5\n    return [n - 1 - i * k for i in range(2)]\n")
    assert call_function(fn, 10, 0) == [9, 4]  # k = 5, as Python computes; a bool k = True gave [9, 8]
    assert call_function(fn, 10, 2) == [9, 7]


def test_and_stops_before_an_operand_that_would_fail():
    fn = _fn("def f(xs):\n    return xs and xs[0]\n")
    assert call_function(fn, []) == []  # xs[0] is never evaluated
    assert call_function(fn, [7, 8]) == 7
    fn = _fn("def f(xs, d):\n    return d == 0 or len(xs) // d\n")
    assert call_function(fn, [1, 2, 3], 0) is True  # no ZeroDivisionError: `or` stopped at True
    assert call_function(fn, [1, 2, 3], 2) == 1


_ATOMS = st.sampled_from(["a", "b", "xs", "ys", "0", "1", "2", "[]", "[0]", "xs[0]", "ys[-1]", "len(xs)", "None"])


def _combine(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.tuples(children, st.sampled_from(["and", "or"]), children).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(children, children, children).map(lambda t: f"({t[0]} and {t[1]} or {t[2]})"),
        children.map(lambda e: f"(not {e})"),
        st.tuples(children, st.sampled_from(["+", "<", "=="]), children).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(children, children, children).map(lambda t: f"({t[0]} if {t[1]} else {t[2]})"),
    )


_EXPRS = st.recursive(_ATOMS, _combine, max_leaves=8)
_INTS = st.integers(-2, 2)
_LISTS = st.lists(st.integers(-2, 2), max_size=3)


@settings(max_examples=400, deadline=None)
@given(expr=_EXPRS, a=_INTS, b=_INTS, xs=_LISTS, ys=_LISTS)
def test_and_or_not_agree_with_python(expr, a, b, xs, ys):
    fn = _fn(f"def f(a, b, xs, ys):\n    return {expr}\n")
    env = {"a": a, "b": b, "xs": xs, "ys": ys}
    try:
        expected = eval(expr, {"__builtins__": {"len": len}}, env)  # the reference: Python itself (test only)
    except (LookupError, TypeError) as e:  # Python fails for these values: the evaluator says so, as NotPure
        with pytest.raises(NotPure, match=type(e).__name__):
            call_function(fn, a, b, xs, ys)
        return
    got = call_function(fn, a, b, xs, ys)
    assert got == expected and type(got) is type(expected), expr
    if any(expected is v for v in (xs, ys)):  # an operand is returned itself, not a copy
        assert got is expected, expr


HUGE = "1_000_000_000_000"  # 10**12 (the evaluator does not model **)


@pytest.mark.parametrize(("body", "match"), [
    ("xs = [1, 2]\n    return xs[n]", r"line 3: f fails for these arguments: IndexError: list index out of range"),
    ("return n // 0", "ZeroDivisionError"),
    ("return n + 'a'", "TypeError"),
    ("return int('x')", "ValueError"),
    ("return sorted([n, 'a'])", "TypeError"),
    ("return int(1e308 * 10)", "OverflowError"),
])
def test_an_error_of_the_body_is_one_notpure_line(body, match):
    fn = _fn(f"def f(n):\n    {body}\n")
    with pytest.raises(NotPure, match=match) as info:
        call_function(fn, 5)
    assert "\n" not in str(info.value)


def test_any_exception_inside_becomes_notpure(monkeypatch):
    """MemoryError, RecursionError or anything else a builtin raises is converted, not a traceback."""
    for exc in (MemoryError(), RecursionError("maximum recursion depth exceeded"), KeyError("k"), RuntimeError("x")):
        def boom(*_a, exc=exc):
            raise exc
        monkeypatch.setitem(pureeval._BUILTINS, "sorted", boom)
        with pytest.raises(NotPure, match=f"line 2: f fails for these arguments: {type(exc).__name__}"):
            call_function(_fn("def f(n):\n    return sorted([n])\n"), 1)


def test_a_deeply_nested_expression_is_notpure_not_a_recursion_traceback():
    fn = _fn("def f(n):\n    return n\n")
    expr: ast.expr = ast.Name("n", ast.Load(), lineno=2, col_offset=11)
    for _ in range(20_000):  # built by hand: ast.parse itself refuses nesting this deep
        expr = ast.BinOp(expr, ast.Add(), ast.Constant(1, lineno=2, col_offset=11), lineno=2, col_offset=11)
    fn.body[0] = ast.Return(expr, lineno=2, col_offset=4)
    with pytest.raises(NotPure, match="line 2: f fails for these arguments: RecursionError"):
        call_function(fn, 1)


@pytest.mark.parametrize(("body", "match"), [
    (f"for i in range({HUGE}):\n        n = n + i\n    return n", f"over the {MAX_ITEMS:,} this evaluator builds or iterates"),
    (f"return [0] * {HUGE}", "would build 1,000,000,000,000 elements"),
    (f"return {HUGE} * [0]", "would build 1,000,000,000,000 elements"),
    (f"return 'a' * {HUGE}", "would build 1,000,000,000,000 elements"),
    (f"return sum(range({HUGE}))", "has 1,000,000,000,000 elements"),
    (f"return [i for i in range({HUGE})]", "has 1,000,000,000,000 elements"),
    (f"return [0] in range({HUGE})", "has 1,000,000,000,000 elements"),  # a non-int `in` scans the range
    ("xs = [0]\n    for i in range(60):\n        xs = xs + xs\n    return xs", "would build 131,072 elements"),
    ("xs = [0]\n    for i in range(60):\n        xs += xs\n    return xs", "would build 131,072 elements"),
    ("x = 3\n    for i in range(60):\n        x = x * x\n    return x", f"exceeds {MAX_INT_BITS} bits"),
    ("return '%0900000000d' % n", "string formatting is not modelled"),
    ("t = 0\n    for i in range(99_999):\n        for j in range(99_999):\n            t = t + 1\n    return t",
     f"over the work budget of {MAX_WORK:,}"),
])
def test_the_work_budget_stops_a_body_that_would_hang_or_exhaust_memory(body, match):
    fn = _fn(f"def f(n):\n    {body}\n")
    with pytest.raises(NotPure, match=match):
        call_function(fn, 1)


def test_within_the_budget_the_answer_is_computed():
    assert call_function(_fn(f"def f(n):\n    return len(range({HUGE}))\n"), 1) == 10**12  # len builds nothing
    assert call_function(_fn(f"def f(n):\n    return n in range({HUGE})\n"), 7) is True  # an int `in` is O(1)
    fn = _fn("def f(n):\n    t = 0\n    for i in range(n):\n        t = t + i\n    return t\n")
    assert call_function(fn, 10_000) == sum(range(10_000))
    assert call_function(_fn("def f(n):\n    return len([0] * n)\n"), MAX_ITEMS) == MAX_ITEMS


def _source(body: str) -> ModeloptSource:
    fn = _fn(f"def preset(n):\n    {body}\n")
    return ModeloptSource(root=None, version="t", functions={"preset": (fn, "modelopt/p.py")})  # type: ignore[arg-type]


@pytest.mark.parametrize(("body", "match"), [
    ("return n // 2", r"modelopt/p.py:1: preset\(4\): returned 2, not a collection of integer layer ids"),
    ("return [n / 2]", "returned \\[2.0\\], not a collection of integer layer ids"),
    ("return [1, 2][n]", "IndexError: list index out of range"),
    (f"return [0] * {HUGE}", "would build"),
    ("return sorted({1, n - 1})", None),
])
def test_modelopt_evaluate_says_one_line_for_any_failure(body, match):
    src = _source(body)
    if match is None:
        assert src.evaluate("preset", 4) == [1, 3]
        return
    with pytest.raises(BadInput, match=match):
        src.evaluate("preset", 4)


def test_the_return_executed_is_recorded():
    fn = _fn("def f(n):\n    if n == 1:\n        return [n // 2]\n    return [n, n]\n")
    early, late = evaluate_function(fn, 1), evaluate_function(fn, 4)
    assert (early.value, early.returned.lineno) == ([0], 3)
    assert (late.value, late.returned.lineno) == ([4, 4], 4)
