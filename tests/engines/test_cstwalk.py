"""cstwalk: StatementLines gives every node the lines libcst's PositionProvider gives it, at a fraction of the
cost: checked node by node on real engine files and on the statement shapes that could misalign
the two trees (semicolons, one-line suites, decorators, async, match, try/except*, nested defs)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from surgeon.engines.source.cstwalk import StatementLines
from surgeon.engines.source.index import CstFunction, SourceIndex
from tests.conftest import installed_engine, release_engine


def _both(fn: CstFunction) -> tuple[dict, dict]:
    lines = StatementLines(fn._all, fn._parent, fn.ast_node)
    assert lines.ok, f"{fn.label}: the libcst and ast statements do not line up"
    positions = MetadataWrapper(fn.module, unsafe_skip_copy=True).resolve(PositionProvider)
    slow = {n: (p.start.line + fn.offset, p.end.line + fn.offset) for n, p in positions.items()}
    return {n: lines.span(n) for n in fn._all}, slow


def _functions(index: SourceIndex, paths: list[str]):
    for path in paths:
        for ci in index.classes_in([path]):
            for name in ci.functions:
                fn = index.function(ci.key, name)
                if fn is not None:
                    yield fn


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("which", ["vllm-0.33.0", "sglang-installed"])
def test_every_node_of_real_engine_methods(which: str) -> None:
    if which == "sglang-installed":
        root, package, models = installed_engine("sglang").root, "sglang", "srt/models"
        paths = ["srt/models/deepseek_v2.py", "srt/models/llama.py"]
    else:
        root, package, models = release_engine("vllm", "0.33.0"), "vllm", "model_executor/models"
        paths = ["model_executor/models/deepseek_v2.py", "model_executor/models/qwen3_next.py"]
    index = SourceIndex(Path(root), package, models)
    nodes = 0
    for fn in _functions(index, paths):
        fast, slow = _both(fn)
        for node in fn._all:
            assert fast[node] == slow[node], f"{fn.label}: {type(node).__name__} {fast[node]} != {slow[node]}"
        nodes += len(fn._all)
    assert nodes > 10000  # the files were read, and their methods are big


TRICKY = '''
class C:
    @decorator(
        arg=1,
    )
    async def forward(self, x, *, y=None):  # a comment
        a = 1; b = (
            2 +
            3)
        if a: return b
        elif b:
            pass
        else:
            del a, b
        for i in range(3): x += i
        else: x = "\\
            two lines"
        async with ctx() as c, other() as d:
            x = [
                z for z in c
                if z
            ]
        while x:
            break
        try:
            raise ValueError(
                "message")
        except* ValueError as e:
            x = lambda q: (
                q)
        else:
            pass
        finally:
            x = None
        match x:
            case [1, *rest]:
                y = rest
            case {"k": v} if v:
                y = v
            case _:
                y = None

        def inner(q):
            """doc
            string"""
            global G
            return q

        class Inner:
            value: int = (
                1)
        assert x, (
            "why")
        return await inner(x) if x else (
            None)
'''


def test_tricky_statement_shapes() -> None:
    module = cst.parse_module(TRICKY)
    klass = module.body[0]
    assert isinstance(klass, cst.ClassDef)
    fdef = klass.body.body[0]
    assert isinstance(fdef, cst.FunctionDef)
    tree = ast.parse(TRICKY).body[0]
    assert isinstance(tree, ast.ClassDef) and isinstance(tree.body[0], ast.AsyncFunctionDef)
    fn = CstFunction(("m.py", "C"), "m.py", "forward", module, fdef, 0, tree.body[0])
    fast, slow = _both(fn)
    assert fast == {n: slow[n] for n in fn._all}
    assert len(fast) > 150


def test_misaligned_trees_are_said_not_guessed() -> None:
    """An ast tree that is not the same source's: `ok` is false and nothing is placed by it."""
    source = textwrap.dedent("""
        def f(x):
            a = 1
            return a
    """)
    module = cst.parse_module(source)
    fdef = module.body[0]
    assert isinstance(fdef, cst.FunctionDef)
    other = ast.parse("def f(x):\n    return x\n").body[0]
    assert isinstance(other, ast.FunctionDef)
    fn = CstFunction(("m.py", "f"), "m.py", "f", module, fdef, 0, other)
    assert not StatementLines(fn._all, fn._parent, other).ok
    assert fn.line(fdef.body.body[0]) == 3  # the fallback: PositionProvider over the snippet


@pytest.mark.engine
@pytest.mark.slow
def test_children_in_libcst_visit_order_on_real_files() -> None:
    """children() is libcst's own `children`, node for node and in order, over whole real files
    (the anatomy's walks, and so every "first statement that ..." answer, depend on that order)."""
    from surgeon.engines.source.cstwalk import children, family

    files = [installed_engine("sglang").root / "srt/models/deepseek_v2.py",
             release_engine("vllm", "0.33.0") / "model_executor/models/qwen3_next.py"]
    nodes = 0
    for f in files:
        module = cst.parse_module(f.read_bytes())
        parents: dict = {}
        kids: dict = {}
        family(module, parents, kids)
        stack: list[cst.CSTNode] = [module]
        while stack:
            node = stack.pop()
            theirs = list(node.children)
            ours = children(node)
            assert len(ours) == len(theirs) and all(a is b for a, b in zip(ours, theirs)), type(node).__name__
            assert kids[id(node)][1] == ours and all(parents[c] is node for c in ours)
            stack.extend(theirs)
            nodes += 1
    assert nodes > 50000
