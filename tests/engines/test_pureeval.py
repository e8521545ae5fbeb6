"""The small evaluator of engine function bodies (surgeon/engines/pureeval.py) against Python itself.

The library never executes an engine's source; these tests may: ``eval`` of an expression string the
test built is the reference the evaluator must agree with.
"""

from __future__ import annotations

import ast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from surgeon.engines.pureeval import NotPure, call_function


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
    except (LookupError, TypeError) as e:  # Python fails for these values: the evaluator must not answer
        with pytest.raises((NotPure, type(e))):
            call_function(fn, a, b, xs, ys)
        return
    got = call_function(fn, a, b, xs, ys)
    assert got == expected and type(got) is type(expected), expr
    if any(expected is v for v in (xs, ys)):  # an operand is returned itself, not a copy
        assert got is expected, expr
