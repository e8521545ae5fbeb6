"""condition_values reads an engine's branch test as and/or/not over its leaves: with every leaf
decided it is Python's own value; with leaves free, the set of values over all of theirs."""

from __future__ import annotations

import ast
import itertools

from hypothesis import given
from hypothesis import strategies as st

from surgeon.engines.source.booltest import MOST_FREE, condition_values, leaves

NAMES = ("a", "b", "c", "d")

formulas = st.recursive(
    st.sampled_from(NAMES),
    lambda inner: st.one_of(
        st.builds(lambda x: f"not ({x})", inner),
        st.builds(lambda xs, op: "(" + f" {op} ".join(xs) + ")", st.lists(inner, min_size=2, max_size=3),
                  st.sampled_from(["and", "or"]))),
    max_leaves=8)


@given(formulas, st.dictionaries(st.sampled_from(NAMES), st.booleans()))
def test_the_values_are_pythons_over_every_free_leaf(text, fixed):
    test = ast.parse(text, mode="eval").body
    got = condition_values(test, lambda n: fixed.get(n.id) if isinstance(n, ast.Name) else None)
    free = [n for n in NAMES if n not in fixed]
    want = {bool(eval(text, {}, {**fixed, **dict(zip(free, vals))}))  # noqa: S307 - the test's own formula
            for vals in itertools.product([False, True], repeat=len(free))}
    assert got == want


def test_leaves_and_too_many_free_leaves_are_not_read():
    test = ast.parse('arch == "X" or not (self.flag and get_pp_group().is_first_rank)', mode="eval").body
    assert [ast.unparse(n) for n in leaves(test)] == ["arch == 'X'", "self.flag", "get_pp_group().is_first_rank"]
    wide = ast.parse(" or ".join(f"x{i}" for i in range(MOST_FREE + 1)), mode="eval").body
    assert condition_values(wide, lambda n: None) is None
    assert condition_values(wide, lambda n: True if ast.unparse(n) == "x0" else None) == {True}
