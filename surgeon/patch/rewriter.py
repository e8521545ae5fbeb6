"""libcst rewriter: insert capture-hook calls into an engine's decoder-model forward.

:func:`rewrite` is a pure function from source bytes to new source bytes. It inserts, into the
method that holds the decoder-layer loop, calls of a generated hooks module::

    begin_step(self, num_tokens)                          first statement of the method
    capture_position(self, 0, hidden_states, residual)    before the loop (only if 0 requested)
    capture_position(self, <idx> + 1, hidden_states, residual)
                                                          after the layer call in the loop body
    capture_final(self, hidden_states)                    after the final-norm assignment

plus one ``import <hooks_module>`` after the last top-level import. The capture before the loop is
guarded by ``if <first layer of the loop> == 0:`` (a later pipeline rank enters with
``layer_out[start - 1]``, not the embedding). Index-less loops (``for layer in self.layers[a:b]``)
get an iteration counter (``_surgeon_layer``, from the slice start). SGLang 0.5.23 layer-boundary
models keep the residual in ``forward_batch.residual_stream`` (``hidden_states`` after a layer may
be an OwedOutput handle); there the stream is read as
``residual_batch.snapshot(hidden_states, forward_batch)`` (residual None), only under
``if <pos> in {requested}:`` because a snapshot costs kernels and, under TP, a collective. Every other byte of the file
round-trips (libcst keeps formatting). Inserted code is built from libcst nodes; names and
expressions from recipes are parsed as expressions and restricted to names, attributes,
subscripts and integers, never formatted into source text.

It refuses (:class:`PatchApplicationError`, naming the file and the anchor) when an anchor
matches zero or several places, when the loop variable is not the global layer index, when the
residual stream cannot be read as a local, or when the method runs decoder layers through a
second path (a ``self.layers[a:b]`` slice handed to something else, the list handed to another
call, a layer called outside the loop) that would skip captures, unless ``guard_bypass``: then a
``bypass_guard(self, first, last, "file:line")`` call goes right before each such statement, in its
block; at runtime it raises when a requested ``layer_out[k]`` with ``first <= k < last`` would run
there (SGLang two-batch overlap: ``self.layers[normal_end_layer : self.end_layer]`` gives
``normal_end_layer, self.end_layer``; the whole list ``0, len(self.layers)``; unreadable bounds
``0, <hooks>.NUM_LAYERS``). Bounds are re-read only when they are names, attributes, subscripts,
non-negative integers, sums or ``len(...)``; the check is on host ints (graph safe).

Recipes (``patches/*.yaml``) are data: per engine and model file/class they override what the
generic recognizer would pick. Without a recipe the generic one (:data:`GENERIC`) applies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import libcst as cst
import libcst.matchers as m
import yaml
from libcst.metadata import MetadataWrapper, PositionProvider
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from surgeon.core.errors import BadInput

__all__ = [
    "PatchApplicationError", "Recipe", "RewriteResult", "GENERIC", "rewrite",
    "load_recipes", "find_recipe", "PATCHES_DIR", "parse", "check", "Checker", "COUNTER",
]

PATCHES_DIR = Path(__file__).resolve().parents[2] / "patches"
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class PatchApplicationError(BadInput):
    """The rewriter refuses to patch: ``relpath`` and ``anchor`` say where, ``reason`` why
    (a BadInput: the CLI reports it as one line, exit 2)."""

    def __init__(self, relpath: str, anchor: str, reason: str):
        self.relpath, self.anchor, self.reason = relpath, anchor, reason
        super().__init__(f"{relpath}: {anchor}: {reason}")


# ---------------------------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------------------------
_SAFE_EXPR_NODES = (
    cst.Name, cst.Attribute, cst.Subscript, cst.SubscriptElement, cst.Index, cst.Integer,
    cst.UnaryOperation, cst.Minus, cst.Dot, cst.LeftSquareBracket, cst.RightSquareBracket,
)


def _safe_expression(text: str) -> cst.BaseExpression:
    """Parse a recipe expression; only names, attributes, subscripts and integers."""
    try:
        expr = cst.parse_expression(text)
    except cst.ParserSyntaxError as exc:
        raise ValueError(f"not a Python expression: {text!r}") from exc

    class _Check(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if not isinstance(node, _SAFE_EXPR_NODES) and not isinstance(
                node, (cst.SimpleWhitespace, cst.ParenthesizedWhitespace, cst.LeftParen, cst.RightParen, cst.Comma)
            ):
                raise ValueError(
                    f"recipe expression {text!r} may use only names, attributes, subscripts and "
                    f"integers (found {type(node).__name__})"
                )
            return True

    expr.visit(_Check())
    return expr


class Recipe(BaseModel):
    """Where the decoder loop is and how to read the stream, for one engine model file/class.

    Fields left ``None`` fall back to the generic recognizer."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(min_length=1)
    engine: Literal["sglang", "vllm"] | None = None
    file: str | None = Field(default=None, description="model file relative to the engine package, e.g. srt/models/llama.py; None: any file")
    class_name: str | None = Field(default=None, description="decoder model class; None: any class")
    method: str = Field(default="forward", description="method holding the decoder-layer loop")
    layers_attr: str = Field(default="layers", description="attribute of self holding the decoder layers")
    index: str | None = Field(default=None, description="global layer index expression inside the loop; None: the loop variable")
    residual: str | None = Field(default=None, description="expression of the separately carried residual; 'none': the layer returns the sum; None: auto")
    num_tokens: str | None = Field(default=None, description="expression for begin_step's token count; None: positions.shape[-1] or input_ids.shape[0]")
    final_norm: list[str] = Field(
        default_factory=lambda: ["norm", "final_layernorm", "ln_f", "final_norm", "norm_f", "model_norm"],
        description="attributes of self that are the final norm; the final-norm anchor is the one assignment after the loop that uses one",
    )
    refuse: str | None = Field(default=None, description="always refuse, with this reason")
    notes: str | None = None

    @field_validator("layers_attr", "method")
    @classmethod
    def _ident(cls, v: str) -> str:
        if not _IDENT.fullmatch(v):
            raise ValueError(f"not an identifier: {v!r}")
        return v

    @field_validator("final_norm")
    @classmethod
    def _idents(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _IDENT.fullmatch(name):
                raise ValueError(f"not an identifier: {name!r}")
        return v

    @field_validator("index", "num_tokens")
    @classmethod
    def _expr(cls, v: str | None) -> str | None:
        if v is not None:
            _safe_expression(v)
        return v

    @field_validator("residual")
    @classmethod
    def _residual(cls, v: str | None) -> str | None:
        if v is not None and v != "none":
            _safe_expression(v)
        return v

    def matches(self, engine: str | None, relpath: str, class_name: str | None) -> bool:
        if self.engine is not None and engine is not None and self.engine != engine:
            return False
        if self.file is not None and not (relpath == self.file or relpath.endswith("/" + self.file)):
            return False
        if self.class_name is not None and class_name is not None and self.class_name != class_name:
            return False
        return True


GENERIC = Recipe(name="generic")


def load_recipes(directory: Path | str = PATCHES_DIR) -> list[Recipe]:
    """Every ``*.yaml`` recipe in ``directory`` (each file: one mapping or a list of mappings)."""
    recipes: list[Recipe] = []
    for path in sorted(Path(directory).glob("*.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        items = data if isinstance(data, list) else [data]
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise ValueError(f"{path}: recipe {i} is not a mapping")
            try:
                recipes.append(Recipe.model_validate(item))
            except ValidationError as exc:
                raise ValueError(f"{path}: recipe {i}: {exc}") from exc
    return recipes


def find_recipe(recipes: Sequence[Recipe], *, engine: str | None, relpath: str,
                class_name: str | None) -> Recipe:
    """The most specific matching recipe (file and class named beat file only), else GENERIC."""
    best: tuple[int, Recipe] | None = None
    for r in recipes:
        if not r.matches(engine, relpath, class_name):
            continue
        score = (r.file is not None) * 2 + (r.class_name is not None) + (r.engine is not None)
        if best is None or score > best[0]:
            best = (score, r)
    return best[1] if best else GENERIC


# ---------------------------------------------------------------------------------------------
# Result
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RewriteResult:
    new_bytes: bytes
    anchors: list[str] = field(default_factory=list)  # "Class.method:what@line" per insertion
    inserted: int = 0  # statements inserted (the import included)


# ---------------------------------------------------------------------------------------------
# Analysis helpers
# ---------------------------------------------------------------------------------------------
def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _is_self_attr(node: cst.CSTNode, attr: str) -> bool:
    return m.matches(node, m.Attribute(value=m.Name("self"), attr=m.Name(attr)))


# id(node) -> (node, children): filled by _Rewriter.index in one visit (libcst's `children`
# property visits the node each time it is read); the node is kept to make a reused id harmless
_CHILDREN: dict[int, tuple[cst.CSTNode, list[cst.CSTNode]]] = {}


def _kids(n: cst.CSTNode) -> list[cst.CSTNode]:
    entry = _CHILDREN.get(id(n))
    if entry is not None and entry[0] is n:
        return entry[1]
    return list(n.children)


def _walk(node: cst.CSTNode, *, into_defs: bool = False):
    """Pre-order walk, not entering nested function/class definitions or lambdas."""
    stack = [node]
    first = True
    while stack:
        n = stack.pop()
        if not first and not into_defs and isinstance(n, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            continue
        first = False
        yield n
        stack.extend(reversed(_kids(n)))


class _Family(cst.CSTVisitor):
    """Parents and children of every node under one top-level statement, in one visit."""

    def __init__(self, parents: dict, children: dict):
        self.parents, self.children, self.stack = parents, children, []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self.stack:
            parent = self.stack[-1]
            self.parents[node] = parent
            self.children[id(parent)][1].append(node)
        self.children[id(node)] = (node, [])
        self.stack.append(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        self.stack.pop()


def _mentions_self_attr(node: cst.CSTNode, attr: str) -> bool:
    return any(_is_self_attr(n, attr) for n in _walk(node))


def _assigned_names(target: cst.BaseExpression) -> list[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        out: list[str] = []
        for el in target.elements:
            out += _assigned_names(el.value)
        return out
    if isinstance(target, cst.StarredElement):
        return _assigned_names(target.value)
    return []


def _stmt_assigns(stmt: cst.CSTNode) -> list[tuple[list[str], cst.BaseExpression | None]]:
    out = []
    for n in _walk(stmt):
        if isinstance(n, cst.Assign):
            for t in n.targets:
                out.append((_assigned_names(t.target), n.value))
        elif isinstance(n, cst.AnnAssign):
            out.append((_assigned_names(n.target), n.value))
        elif isinstance(n, cst.AugAssign):
            out.append((_assigned_names(n.target), n.value))
    return out


def _names_in(expr: cst.BaseExpression) -> set[str]:
    return {n.value for n in _walk(expr) if isinstance(n, cst.Name) and n.value != "self"}


@dataclass
class _Loop:
    node: cst.For
    index: cst.BaseExpression | None
    call_stmt: cst.SimpleStatementLine | None
    problem: str | None = None
    # global index of the first layer the loop runs (None: unknown)
    start: cst.BaseExpression | None = None
    # the loop has no index variable: the rewriter counts iterations in COUNTER from `start`
    counter: bool = False


COUNTER = "_surgeon_layer"  # the iteration counter inserted into index-less loops
_ZERO = cst.Integer("0")


def _is_zero(expr: cst.BaseExpression | None) -> bool:
    return isinstance(expr, cst.Integer) and expr.value == "0"


class _Rewriter:
    def __init__(self, source: bytes | cst.Module, relpath: str, class_name: str | None, recipe: Recipe,
                 source_bytes: bytes | None = None, *, prefilter: bool = True):
        self.relpath = relpath
        self.recipe = recipe
        self.class_name = class_name
        if isinstance(source, cst.Module):
            module = source
            self.source = source_bytes
        else:
            module = parse(source, relpath)
            self.source = source
        self.module = module
        # Metadata for the whole module costs more than parsing it; positions and parents are
        # resolved per top-level statement on demand (positions offset by the code before it).
        self.pos: dict[cst.CSTNode, object] = {}
        self.parents: dict[cst.CSTNode, cst.CSTNode] = {}
        self._offsets: dict[cst.CSTNode, int] = {}
        self._indexed: set[int] = set()
        self.children: dict[int, tuple[cst.CSTNode, list[cst.CSTNode]]] = {}
        self._lines: dict[int, int] | None = None
        self._ast_fns: dict[int, object] = {}  # id(libcst method) -> its stdlib ast node
        # without a class name, methods whose stdlib ast shows no loop over self.<layers> are not
        # indexed at all (coverage._loops_over is a superset of the loops recognised here)
        self.prefilter = prefilter
        self._cands: list | None = None

    def index(self, top: cst.CSTNode) -> None:
        if id(top) in self._indexed:
            return
        self._indexed.add(id(top))
        body = list(self.module.body)
        i = next(k for k, s in enumerate(body) if s is top)
        submodule = cst.Module(body=[top], default_indent=self.module.default_indent,
                               default_newline=self.module.default_newline)
        offset = None
        if self.source is not None and i > 0:
            # the statement's own text is (nearly always) unique in the file: count the lines
            # before it there instead of generating the code of everything above it
            text = submodule.code.encode(self.module.encoding)
            at = self.source.find(text)
            if at >= 0 and self.source.find(text, at + 1) < 0:
                offset = self.source.count(b"\n", 0, at)
        if offset is None:
            prefix = self.module.with_changes(body=body[:i], footer=[]).code
            offset = prefix.count("\n") if body[:i] or self.module.header else 0
        sub = MetadataWrapper(submodule, unsafe_skip_copy=True)
        for node, rng in sub.resolve(PositionProvider).items():
            self.pos[node] = rng
            self._offsets[node] = offset
        top.visit(_Family(self.parents, self.children))
        _CHILDREN.update(self.children)
        self.parents[top] = self.module

    def _ast_lines(self) -> dict[int, int]:
        """id(libcst node) -> first line (decorators included) of every top-level class and of its
        methods, from the stdlib parser (top-level classes and class-body defs correspond one to
        one in both trees); {} when the source is not at hand or the trees disagree."""
        if self._lines is not None:
            return self._lines
        self._lines = {}
        if self.source is None:
            return self._lines
        import ast

        def first(node) -> int:
            return min([node.lineno] + [d.lineno for d in node.decorator_list])
        try:
            tree = ast.parse(self.source)
        except (SyntaxError, ValueError):
            return self._lines
        ccls = [c for c in self.module.body if isinstance(c, cst.ClassDef)]
        acls = [c for c in tree.body if isinstance(c, ast.ClassDef)]
        if [c.name.value for c in ccls] != [c.name for c in acls]:
            return self._lines
        lines = {}
        for c, a in zip(ccls, acls):
            lines[id(c)] = first(a)
            if not isinstance(c.body, cst.IndentedBlock):
                continue
            cf = [f for f in c.body.body if isinstance(f, cst.FunctionDef)]
            af = [f for f in a.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if [f.name.value for f in cf] != [f.name for f in af]:
                return self._lines
            lines.update((id(f), first(g)) for f, g in zip(cf, af))
            self._ast_fns.update((id(f), g) for f, g in zip(cf, af))
        self._lines = lines
        return lines

    def index_method(self, cls: cst.ClassDef, fn: cst.FunctionDef) -> None:
        """Positions and parents of one method only (far less than its class), placed by the
        stdlib parser's line of the method; the whole class where that is not at hand."""
        if id(fn) in self._indexed or id(cls) in self._indexed:
            return
        start = self._ast_lines().get(id(fn))
        if start is None:
            self.index(cls)
            return
        self._indexed.add(id(fn))
        sub = MetadataWrapper(cst.Module(body=[fn], default_indent=self.module.default_indent,
                                         default_newline=self.module.default_newline), unsafe_skip_copy=True)
        positions = sub.resolve(PositionProvider)
        offset = start - positions[fn].start.line  # type: ignore[attr-defined]
        for node, rng in positions.items():
            self.pos[node] = rng
            self._offsets[node] = offset
        fn.visit(_Family(self.parents, self.children))
        _CHILDREN.update(self.children)
        self.parents[fn] = cls.body

    def line(self, node: cst.CSTNode) -> int:
        if node not in self.pos and isinstance(node, cst.ClassDef) and id(node) in self._ast_lines():
            return self._ast_lines()[id(node)]
        return self.pos[node].start.line + self._offsets[node]  # type: ignore[attr-defined]

    def end_line(self, node: cst.CSTNode) -> int:
        return self.pos[node].end.line + self._offsets[node]  # type: ignore[attr-defined]

    def refuse(self, anchor: str, reason: str) -> PatchApplicationError:
        return PatchApplicationError(self.relpath, anchor, reason)

    # -- locating -------------------------------------------------------------------------
    def _layers_loops(self, fn: cst.FunctionDef) -> list[_Loop]:
        attr = self.recipe.layers_attr
        loops = []
        for n in _walk(fn.body):
            if isinstance(n, cst.For) and (_mentions_self_attr(n.iter, attr) or self._loop_calls_layer(n)):
                lp = self._analyze_loop(n)
                if lp is not None:
                    loops.append(lp)
        return loops

    def _loop_calls_layer(self, loop: cst.For) -> bool:
        # `for i in range(...)`: body calls/assigns self.layers[i]
        if not isinstance(loop.target, cst.Name):
            return False
        idx = loop.target.value
        attr = self.recipe.layers_attr
        for n in _walk(loop.body):
            if m.matches(n, m.Subscript(value=m.Attribute(value=m.Name("self"), attr=m.Name(attr)),
                                        slice=[m.SubscriptElement(m.Index(m.Name(idx)))])):
                return True
        return False

    def _analyze_loop(self, loop: cst.For) -> _Loop | None:
        attr = self.recipe.layers_attr
        layer_sub = m.Subscript(value=m.Attribute(value=m.Name("self"), attr=m.Name(attr)))
        index: cst.BaseExpression | None = None
        start: cst.BaseExpression | None = None
        counter = False
        callee_names: set[str] = set()
        direct_index: str | None = None
        problem = None
        it, tgt = loop.iter, loop.target
        if m.matches(it, m.Call(func=m.Name("range"))) and isinstance(tgt, cst.Name):
            direct_index = tgt.value
            index = cst.Name(tgt.value)
            if not self._loop_calls_layer(loop):
                return None
            rargs = it.args  # type: ignore[attr-defined]
            if len(rargs) == 1 and rargs[0].keyword is None and rargs[0].star == "":
                start = _ZERO
            elif len(rargs) == 2 and all(a.keyword is None and a.star == "" for a in rargs):
                start = rargs[0].value
        elif m.matches(it, m.Call(func=m.Name("enumerate"))) and m.matches(
                tgt, m.Tuple(elements=[m.Element(m.Name()), m.Element(m.Name())])):
            assert isinstance(it, cst.Call) and isinstance(tgt, cst.Tuple)
            seq = it.args[0].value
            if not _mentions_self_attr(seq, attr):
                return None
            idx_name = tgt.elements[0].value.value  # type: ignore[attr-defined]
            callee_names.add(tgt.elements[1].value.value)  # type: ignore[attr-defined]
            start = next((a.value for a in it.args[1:] if a.keyword is None or a.keyword.value == "start"), None)
            seq_start: cst.BaseExpression | None
            offset_index: cst.BaseExpression | None = None
            if _is_self_attr(seq, attr):
                seq_start = None
            elif m.matches(seq, m.Call(func=m.Name("islice"))) and len(seq.args) >= 3 and _is_self_attr(seq.args[0].value, attr):  # type: ignore[attr-defined]
                seq_start = seq.args[1].value  # type: ignore[attr-defined]
            elif m.matches(seq, layer_sub) and len(seq.slice) == 1 and isinstance(seq.slice[0].slice, cst.Slice):  # type: ignore[attr-defined]
                seq_start = seq.slice[0].slice.lower  # type: ignore[attr-defined]
            else:
                seq_start = cst.Name("?")  # unknown shape
                problem = f"enumerate over {_code(seq)}: cannot tell whether the index is the global layer index"
            if problem is None:
                same = (seq_start is None and start is None) or (
                    seq_start is not None and start is not None and _code(seq_start) == _code(start)) or (
                    seq_start is None and start is not None and _code(start) == "0") or (
                    start is None and seq_start is not None and _code(seq_start) == "0")
                if not same and start is None and seq_start is not None:
                    # enumerate counts from 0 over a slice from seq_start: global = seq_start + idx
                    base = seq_start
                    if not isinstance(base, (cst.Name, cst.Attribute, cst.Subscript, cst.Integer)):
                        base = base.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
                    offset_index = cst.BinaryOperation(base, cst.Add(), cst.Name(idx_name))
                    start = seq_start
                elif same:
                    start = start or seq_start or _ZERO
                elif not same:
                    problem = (f"enumerate start {_code(start) if start else '0'} differs from the slice start "
                               f"{_code(seq_start) if seq_start else '0'}: the loop index is not the global layer index")
            index = offset_index or cst.Name(idx_name)
        elif m.matches(it, m.Call(func=m.Name("islice"))) and it.args and m.matches(  # type: ignore[attr-defined]
                it.args[0].value, m.Call(func=m.Name("enumerate"), args=[m.Arg(m.Attribute(value=m.Name("self"), attr=m.Name(attr)))])  # type: ignore[attr-defined]
        ) and m.matches(tgt, m.Tuple(elements=[m.Element(m.Name()), m.Element(m.Name())])):
            # `for idx, layer in islice(enumerate(self.layers), a, b)`: idx counts the full list
            assert isinstance(tgt, cst.Tuple)
            index = cst.Name(tgt.elements[0].value.value)  # type: ignore[attr-defined]
            callee_names.add(tgt.elements[1].value.value)  # type: ignore[attr-defined]
            if len(it.args) == 3 and all(a.keyword is None and a.star == "" for a in it.args):  # type: ignore[attr-defined]
                start = it.args[1].value  # type: ignore[attr-defined]
        elif _mentions_self_attr(it, attr) and isinstance(tgt, cst.Name):
            # `for layer in self.layers` / `self.layers[a:b]` / `islice(self.layers, a, b)`: no index
            # variable, but the iteration count from the slice start is the global index (the
            # rewriter counts iterations itself; `continue`/`break` are refused below)
            callee_names.add(tgt.value)
            start = self._sequence_start(it)
            if start is None:
                problem = (f"`for {tgt.value} in {_code(it)}` has no layer index variable and the "
                           "sequence is not self.{attr}, a slice of it or an islice of it")
            else:
                counter = True
                index = cst.Name(COUNTER)
        else:
            return None
        if problem is None and index is not None and not counter:
            for n in _walk(loop.body):
                if isinstance(n, cst.SimpleStatementLine) and any(
                        _code(index) in names or any(nm in names for nm in _names_in(index))
                        for names, _ in _stmt_assigns(n)):
                    problem = (f"the loop body reassigns the layer index (`{_code(n).strip()}`): "
                               "a recipe must give the global index expression")
                    break
        if self.recipe.index is not None:
            index, problem, counter = _safe_expression(self.recipe.index), None, False
        # locals bound to self.layers[i] inside the body
        if direct_index is not None:
            for n in _walk(loop.body):
                for names, value in _stmt_assigns(n) if isinstance(n, cst.SimpleStatementLine) else []:
                    if value is not None and m.matches(value, m.Subscript(
                            value=m.Attribute(value=m.Name("self"), attr=m.Name(attr)),
                            slice=[m.SubscriptElement(m.Index(m.Name(direct_index)))])) and len(names) == 1:
                        callee_names.add(names[0])
        calls = []
        for n in _walk(loop.body):
            if not isinstance(n, cst.Call):
                continue
            f = n.func
            if m.matches(f, m.Attribute(attr=m.Name("forward"))):  # `layer.forward(...)`
                f = f.value  # type: ignore[attr-defined]
            if isinstance(f, cst.Name) and f.value in callee_names:
                calls.append(n)
            elif direct_index is not None and m.matches(f, m.Subscript(
                    value=m.Attribute(value=m.Name("self"), attr=m.Name(attr)),
                    slice=[m.SubscriptElement(m.Index(m.Name(direct_index)))])):
                calls.append(n)
        call_stmt = None
        if problem is None:
            stmts = [self._enclosing_stmt(c) for c in calls]
            if not calls or (len(calls) > 1 and not self._exclusive(stmts)):
                problem = (f"{'no' if not calls else len(calls)} decoder-layer calls in the loop body "
                           "(need exactly one, or one per branch of an if/else)")
            else:
                stmt = stmts[0]
                if not isinstance(stmt, cst.SimpleStatementLine) or not isinstance(self.parents.get(stmt), (cst.IndentedBlock,)):
                    problem = "the decoder-layer call is not a statement of its own in an indented block"
                else:
                    call_stmt = stmt
        if problem is None and call_stmt is not None:
            # what is captured is `hidden_states`: the layer's output must be (re)bound to it
            call_line = self.line(call_stmt)
            if not any("hidden_states" in names and self.line(n) >= call_line
                       for n in _walk(loop.body) if isinstance(n, cst.SimpleStatementLine)
                       for names, _ in _stmt_assigns(n)):
                problem = ("the decoder-layer output is not assigned to `hidden_states` "
                           f"(`{_code(call_stmt).strip().splitlines()[0]}`): the stream is carried "
                           "in another variable")
        if problem is None:
            # the capture goes at the end of the iteration: the state entering the next layer
            # (after anything the body adds to the stream, e.g. Qwen3-VL's deepstack embeds)
            # `continue`/`break` whose innermost loop is this one; `return`/`yield` anywhere in the
            # body, nested loops included (`_walk` skips nested defs and lambdas, whose own are fine)
            for n in _walk(loop.body):
                if (isinstance(n, (cst.Continue, cst.Break)) and self._innermost_loop(n) is loop
                        or isinstance(n, (cst.Return, cst.Yield))):
                    problem = (f"the loop body has `{_code(n).strip().splitlines()[0]}`: an iteration "
                               "can end before the end-of-iteration capture")
                    break
            if not isinstance(loop.body, cst.IndentedBlock):
                problem = "the loop body is on one line"
        return _Loop(loop, index, call_stmt, problem, start, counter)

    def _sequence_start(self, seq: cst.BaseExpression) -> cst.BaseExpression | None:
        """Global index of the first element of ``seq`` when it is self.<layers>, a step-less
        slice of it, or ``islice(self.<layers>, [a,] b)``; else None."""
        attr = self.recipe.layers_attr
        if _is_self_attr(seq, attr):
            return _ZERO
        if (isinstance(seq, cst.Subscript) and _is_self_attr(seq.value, attr) and len(seq.slice) == 1
                and isinstance(seq.slice[0].slice, cst.Slice) and seq.slice[0].slice.step is None):
            return seq.slice[0].slice.lower or _ZERO
        if (m.matches(seq, m.Call(func=m.Name("islice"))) and seq.args  # type: ignore[attr-defined]
                and _is_self_attr(seq.args[0].value, attr)  # type: ignore[attr-defined]
                and all(a.keyword is None and a.star == "" for a in seq.args)):  # type: ignore[attr-defined]
            if len(seq.args) == 2:  # type: ignore[attr-defined]
                return _ZERO
            if len(seq.args) == 3:  # type: ignore[attr-defined]
                return seq.args[1].value  # type: ignore[attr-defined]
        return None

    def _innermost_loop(self, node: cst.CSTNode) -> cst.CSTNode | None:
        n = node
        while n in self.parents:
            n = self.parents[n]
            if isinstance(n, (cst.For, cst.While)):
                return n
        return None

    def _enclosing_stmt(self, node: cst.CSTNode) -> cst.CSTNode:
        n = node
        while not isinstance(n, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            n = self.parents[n]
        return n

    def _candidates(self) -> list[tuple[cst.ClassDef, cst.FunctionDef, list[_Loop]]]:
        if self._cands is None:
            self._cands = self._find_candidates()
        return self._cands

    def _find_candidates(self) -> list[tuple[cst.ClassDef, cst.FunctionDef, list[_Loop]]]:
        out = []
        for cls in self.module.body:
            if not isinstance(cls, cst.ClassDef):
                continue
            if self.class_name is not None and cls.name.value != self.class_name:
                continue
            if self.recipe.class_name is not None and cls.name.value != self.recipe.class_name:
                continue
            for fn in cls.body.body:
                if isinstance(fn, cst.FunctionDef) and fn.name.value == self.recipe.method:
                    if self.class_name is None and self.prefilter and self._ast_lines():
                        from surgeon.patch.coverage import _loops_over

                        tree = self._ast_fns.get(id(fn))
                        if tree is not None and not _loops_over(tree, self.recipe.layers_attr):  # type: ignore[arg-type]
                            continue
                    self.index_method(cls, fn)
                    loops = self._layers_loops(fn)
                    if loops or self.class_name is not None:
                        out.append((cls, fn, loops))
        return out

    # -- planning -------------------------------------------------------------------------
    def plan(self, positions: set[int], capture_final: bool, hooks: cst.BaseExpression, *,
             guard_bypass: bool = False, aux_return: bool = False):
        _CHILDREN.update(self.children)
        try:
            return self._plan(positions, capture_final, hooks, guard_bypass, aux_return)
        finally:
            _CHILDREN.clear()  # it holds the nodes: keep no module alive

    def _plan(self, positions: set[int], capture_final: bool, hooks: cst.BaseExpression,
              guard_bypass: bool = False, aux_return: bool = False):
        rc = self.recipe
        cands = self._candidates()
        want = self.class_name or rc.class_name
        anchor0 = f"{want or '<any class>'}.{rc.method}"
        if not cands:
            raise self.refuse(anchor0, f"no class{f' {want}' if want else ''} with a `{rc.method}` method "
                              f"looping over self.{rc.layers_attr}")
        if len(cands) > 1:
            names = ", ".join(f"{c.name.value}@{self.line(c)}" for c, _, _ in cands)
            raise self.refuse(anchor0, f"several classes loop over self.{rc.layers_attr} in `{rc.method}`: {names}; name one")
        cls, fn, loops = cands[0]
        owner = f"{cls.name.value}.{fn.name.value}"
        if rc.refuse:
            raise self.refuse(owner, f"recipe {rc.name!r} refuses: {rc.refuse}")
        if not loops:
            raise self.refuse(f"{owner}:loop", f"no loop over self.{rc.layers_attr}")
        if len(loops) > 1:
            raise self.refuse(f"{owner}:loop", "several decoder-layer loops at lines "
                              + ", ".join(str(self.line(lp.node)) for lp in loops))
        lp = loops[0]
        loop_anchor = f"{owner}:loop@{self.line(lp.node)}"
        if lp.problem:
            raise self.refuse(loop_anchor, lp.problem)
        bypasses = self._bypasses(fn, lp, owner)
        if bypasses and not guard_bypass:
            b = bypasses[0]
            raise self.refuse(f"{owner}:bypass@{b.line}",
                              f"{b.what} (`{b.text}`): layers run there would not be captured "
                              "(`surgeon apply --guard-bypass` patches it with a runtime guard that raises "
                              "when that path would run a captured layer)")

        before: dict[cst.CSTNode, list[cst.BaseStatement]] = {}
        after: dict[cst.CSTNode, list[cst.BaseStatement]] = {}
        anchors: list[str] = []

        def call(fname: str, *args: cst.BaseExpression) -> cst.SimpleStatementLine:
            return cst.SimpleStatementLine([cst.Expr(cst.Call(
                func=cst.Attribute(value=hooks, attr=cst.Name(fname)),
                args=[cst.Arg(cst.Name("self"))] + [cst.Arg(a) for a in args],
            ))])

        # how to read the residual stream at a layer boundary
        reader = self._reader(fn, lp, loop_anchor)

        # begin_step
        num = self._num_tokens(fn, owner)
        body = fn.body
        if not isinstance(body, cst.IndentedBlock):
            raise self.refuse(owner, "method body is on one line")
        first = 0
        if body.body and m.matches(body.body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())])):
            first = 1
        if first >= len(body.body):
            raise self.refuse(owner, "method has no statements")
        before.setdefault(body.body[first], []).append(call("begin_step", num))
        anchors.append(f"{owner}:begin_step@{self.line(body.body[first])}")

        if (0 in positions or lp.counter) and not isinstance(self.parents.get(lp.node), cst.IndentedBlock):
            raise self.refuse(loop_anchor, "the loop is not a statement of an indented block")
        if 0 in positions:
            # the stream before the loop is the embedding only where the loop starts at layer 0
            # (a later pipeline rank enters with layer_out[start - 1])
            if lp.start is None:
                raise self.refuse(loop_anchor, "cannot tell the first layer the loop runs: the state "
                                  "before the loop is the embedding only when it is layer 0")
            stmt = call("capture_position", cst.Integer("0"), *reader.args(before_loop=True))
            if not _is_zero(lp.start):
                stmt = _if(cst.Comparison(lp.start, [cst.ComparisonTarget(cst.Equal(), cst.Integer("0"))]), stmt)
            before.setdefault(lp.node, []).append(stmt)
            anchors.append(f"{owner}:embed@{self.line(lp.node)}")
        later = sorted(p for p in positions if p >= 1)
        if later:
            assert lp.call_stmt is not None and lp.index is not None
            last = lp.node.body.body[-1]  # type: ignore[attr-defined]
            if lp.counter:
                assert lp.start is not None
                # COUNTER is the index of the layer the iteration runs until its end, then one more
                before.setdefault(lp.node, []).append(cst.SimpleStatementLine([cst.Assign(
                    [cst.AssignTarget(cst.Name(COUNTER))], lp.start)]))
                after.setdefault(last, []).append(cst.SimpleStatementLine([cst.AugAssign(
                    cst.Name(COUNTER), cst.AddAssign(), cst.Integer("1"))]))
                pos_expr: cst.BaseExpression = cst.Name(COUNTER)
                anchors.append(f"{owner}:counter@{self.line(lp.node)}")
            else:
                pos_expr = cst.BinaryOperation(lp.index, cst.Add(), cst.Integer("1"))
            stmt = call("capture_position", pos_expr, *reader.args(before_loop=False))
            if reader.costly:
                # reading the stream costs kernels (and a collective under TP): only where asked
                stmt = _if(cst.Comparison(pos_expr, [cst.ComparisonTarget(cst.In(), cst.Set(
                    [cst.Element(cst.Integer(str(p))) for p in later]))]), stmt)
            after.setdefault(last, []).append(stmt)
            anchors.append(f"{owner}:layer_out@{self.line(last)}")
        if capture_final:
            for stmt, name in self._final_norm(fn, lp, owner):
                after.setdefault(stmt, []).append(call("capture_final", cst.Name(name)))
                anchors.append(f"{owner}:final_norm@{self.line(stmt)}")
        if aux_return:
            # hand the fc-ordered captures to the engine's draft path: where the method returns its
            # aux list, the list becomes the hooks' fc buffer (only when the engine asked for aux)
            rets = [n for n in _walk(fn.body) if isinstance(n, cst.Return) and n.value is not None
                    and any(isinstance(x, cst.Tuple) and any(m.matches(e.value, m.Name(AUX_NAME)) for e in x.elements)
                            for x in _walk(n.value))]  # `return h, aux` (also inside `... if aux else h`)
            if not rets:
                raise self.refuse(f"{owner}:aux", f"no `return` of `{AUX_NAME}`: this forward hands no aux "
                                  "hidden states to the engine's draft path (use --mode dump)")
            for ret in rets:
                stmt = self._enclosing_stmt(ret)
                if not isinstance(self.parents.get(stmt), cst.IndentedBlock):
                    raise self.refuse(f"{owner}:aux@{self.line(ret)}", "the aux return is not a statement of an indented block")
                swap = cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(AUX_NAME))], cst.List([
                    cst.Element(cst.Call(func=cst.Attribute(value=hooks, attr=cst.Name("aux_hidden_states")),
                                         args=[cst.Arg(cst.Name("self"))]))]))])
                before.setdefault(stmt, []).append(_if(cst.Name(AUX_NAME), swap))
                anchors.append(f"{owner}:aux@{self.line(ret)}")
        for b in bypasses:
            # bypass_guard(self, first, last, where): raises when a requested layer_out[k] with
            # first <= k < last would run through this path (host ints only: graph safe)
            if b.first is None:
                first, last = cst.Integer("0"), cst.Attribute(value=hooks, attr=cst.Name("NUM_LAYERS"))
            else:
                first, last = b.first, b.last
            where = re.sub(r"[^A-Za-z0-9_./:+-]", "_", f"{self.relpath}:{b.line}")
            before.setdefault(b.stmt, []).append(call("bypass_guard", first, last, cst.SimpleString(repr(where))))
            anchors.append(f"{owner}:bypass_guard@{b.line}")

        return before, after, anchors

    def _bypasses(self, fn: cst.FunctionDef, lp: _Loop, owner: str) -> list["_Bypass"]:
        """Places outside the capture loop that run decoder layers: a slice of self.<layers>, the
        layers handed to another call, a layer called directly or through a local bound to
        ``self.<layers>[i]`` (e.g. sglang's two-batch-overlap ``model_forward_stages``)."""
        attr = self.recipe.layers_attr
        layer_sub = m.Subscript(value=m.Attribute(value=m.Name("self"), attr=m.Name(attr)))
        inside = set(_walk(lp.node))
        outside = [n for n in _walk(fn.body) if n not in inside]
        # locals bound to one layer outside the loop: `layer = self.layers[0]`
        single: dict[str, cst.BaseExpression] = {}
        for n in outside:
            if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.targets[0].target, cst.Name) \
                    and m.matches(n.value, layer_sub) and len(n.value.slice) == 1 \
                    and isinstance(n.value.slice[0].slice, cst.Index):  # type: ignore[attr-defined]
                single[n.targets[0].target.value] = n.value.slice[0].slice.value  # type: ignore[attr-defined]
        found: list[_Bypass] = []
        for n in outside:
            what = None
            first: cst.BaseExpression | None = None
            last: cst.BaseExpression | None = None
            if m.matches(n, layer_sub) and any(isinstance(e.slice, cst.Slice) for e in n.slice):  # type: ignore[attr-defined]
                what = "runs a slice of the decoder layers outside the capture loop"
                sl = n.slice[0].slice if len(n.slice) == 1 else None  # type: ignore[attr-defined]
                if isinstance(sl, cst.Slice) and sl.step is None:
                    first = sl.lower or cst.Integer("0")
                    last = sl.upper or _len_of(attr)
            elif isinstance(n, cst.Call) and any(_is_self_attr(a.value, attr) for a in n.args) and not m.matches(
                    n.func, m.Name("len") | m.Name("isinstance") | m.Name("getattr") | m.Name("hasattr")):
                what = "hands the decoder layers to another call outside the capture loop"
                first, last = cst.Integer("0"), _len_of(attr)
            elif isinstance(n, cst.Call) and m.matches(n.func, layer_sub):
                what = "calls a decoder layer outside the capture loop"
                sl = n.func.slice[0].slice if len(n.func.slice) == 1 else None  # type: ignore[attr-defined]
                if isinstance(sl, cst.Index):
                    first, last = sl.value, _plus_one(sl.value)
            elif isinstance(n, cst.Call) and (
                    (isinstance(n.func, cst.Name) and n.func.value in single)
                    or (m.matches(n.func, m.Attribute(value=m.Name(), attr=m.Name("forward")))
                        and n.func.value.value in single)):  # type: ignore[attr-defined]
                what = "calls a decoder layer outside the capture loop"
                idx = single[n.func.value if isinstance(n.func, cst.Name) else n.func.value.value]  # type: ignore[attr-defined]
                if isinstance(idx, cst.Integer) or m.matches(idx, m.Attribute(value=m.Name("self"), attr=m.Name())):
                    # a constant or an attribute of self: the same value where the layer is called
                    first, last = idx, _plus_one(idx)
            if what is None:
                continue
            stmt = self._enclosing_stmt(n)
            if first is not None and not (_bound_ok(first) and _bound_ok(last) and not self._in_comprehension(n, stmt)):
                first = last = None
            text = _code(stmt).strip().splitlines()[0]
            found.append(_Bypass(n, stmt, self.line(n), what, text, first, last))
            if not isinstance(self.parents.get(stmt), cst.IndentedBlock):
                raise self.refuse(f"{owner}:bypass@{self.line(n)}",
                                  f"{what} (`{text}`): layers run there would not be captured, and the "
                                  "statement is not in an indented block to put a guard before it")
        return found

    def _in_comprehension(self, node: cst.CSTNode, stmt: cst.CSTNode) -> bool:
        n = node
        while n is not stmt and n in self.parents:
            if isinstance(n, (cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)):
                return True
            n = self.parents[n]
        return False

    def _reader(self, fn: cst.FunctionDef, lp: _Loop, loop_anchor: str) -> "_Reader":
        rc = self.recipe
        if rc.residual == "none":
            return _Reader(cst.Name("None"), True)
        if rc.residual is not None:
            return _Reader(_safe_expression(rc.residual), True)
        stream = self._stream_reader(fn, lp, loop_anchor)
        if stream is not None:
            return stream
        residual, before = self._residual(fn, lp, loop_anchor)
        return _Reader(residual, before)

    def _batch_alias(self) -> str | None:
        """The name this module binds to sglang's per-batch residual-stream accessors
        (``from sglang.srt.layers.layer_boundary.residual import batch as residual_batch``)."""
        for stmt in self.module.body:
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for imp in stmt.body:
                if (isinstance(imp, cst.ImportFrom) and imp.module is not None and not imp.relative
                        and _code(imp.module) == _SGLANG_RESIDUAL_PKG and not isinstance(imp.names, cst.ImportStar)):
                    for alias in imp.names:
                        if m.matches(alias.name, m.Name("batch")):
                            return alias.asname.name.value if alias.asname else "batch"  # type: ignore[union-attr]
        return None

    def _stream_reader(self, fn: cst.FunctionDef, lp: _Loop, loop_anchor: str) -> "_Reader | None":
        """SGLang (0.5.23) layer-boundary models keep the residual in ``forward_batch.residual_stream``
        (a ResidualStream: the written residual plus the last layer's pending contribution, which
        may still owe its all-reduce; ``hidden_states`` is then an opaque OwedOutput handle). The
        stream value at a boundary is ``residual_batch.snapshot(hidden_states, forward_batch)``:
        the completed contribution plus the residual, on a copy, leaving the engine's own
        completion and fusions as they are (the engine reads its own end-of-stack capture so,
        e.g. nemotron_h.py NemotronHModel.forward)."""
        alias = self._batch_alias()
        if alias is None:
            return None
        uses = any(isinstance(n, cst.Name) and n.value == alias for n in _walk(fn.body))
        params = {p.name.value: p for p in fn.params.params + fn.params.kwonly_params + fn.params.posonly_params}
        if not uses:
            if self._local_residual(fn):
                return None  # the method carries its own residual (a tower that does not use the stream)
            if any(isinstance(n, cst.Name) and n.value == "forward_batch" for n in _walk(lp.node)):
                raise self.refuse(loop_anchor, f"the module uses sglang's layer-boundary residual stream "
                                  f"({alias}) and the layers get forward_batch, but this method never touches "
                                  "the stream: cannot tell whether hidden_states after a layer is the full stream")
            return None
        if "forward_batch" not in params:
            raise self.refuse(loop_anchor, f"the method uses {alias} but has no `forward_batch` parameter "
                              "owning the residual stream")
        if self._local_residual(fn):
            raise self.refuse(loop_anchor, f"the method uses both a local `residual` and {alias}: "
                              "cannot tell which carries the stream")
        for n in _walk(lp.node.body):
            if isinstance(n, cst.Arg) and m.matches(n.keyword, m.Name("post_residual_addition")) and not m.matches(
                    n.value, m.Name("None")):
                raise self.refuse(loop_anchor, "a layer call passes post_residual_addition "
                                  f"(`{_code(self._enclosing_stmt(n)).strip().splitlines()[0]}`): the next layer "
                                  "adds it to the stream after the end-of-iteration capture, so the stream "
                                  "there is not layer_out[k]")
        for mod in _MULTI_STREAM_MODULES:
            if mod in self._imported_modules():
                raise self.refuse(loop_anchor, f"the module imports {mod}: its residual stream is not one "
                                  "hidden state that HF output_hidden_states holds")
        return _Reader(None, True, alias=alias)

    def _imported_modules(self) -> set[str]:
        out = set()
        for stmt in self.module.body:
            if isinstance(stmt, cst.SimpleStatementLine):
                for imp in stmt.body:
                    if isinstance(imp, cst.ImportFrom) and imp.module is not None:
                        base = _code(imp.module)
                        out.add(base)
                        if not isinstance(imp.names, cst.ImportStar):
                            out.update(f"{base}.{_code(a.name)}" for a in imp.names)
                    elif isinstance(imp, cst.Import):
                        out.update(_code(a.name) for a in imp.names)
        return out

    def _local_residual(self, fn: cst.FunctionDef) -> bool:
        params = {p.name.value for p in fn.params.params + fn.params.kwonly_params + fn.params.posonly_params}
        if "residual" in params:
            return True
        return any(names and "residual" in names for n in _walk(fn.body)
                   if isinstance(n, cst.SimpleStatementLine) for names, _ in _stmt_assigns(n))

    def _residual(self, fn: cst.FunctionDef, lp: _Loop, loop_anchor: str) -> tuple[cst.BaseExpression, bool]:
        loop_line = self.line(lp.node)
        assigned_lines = []
        params = {p.name.value for p in fn.params.params + fn.params.kwonly_params + fn.params.posonly_params}
        for n in _walk(fn.body):
            if isinstance(n, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
                targets = n.targets if isinstance(n, cst.Assign) else [n]
                for t in targets:
                    if "residual" in _assigned_names(t.target):
                        assigned_lines.append(self.line(n))
        if assigned_lines or "residual" in params:
            return cst.Name("residual"), ("residual" in params or min(assigned_lines) < loop_line)
        skip = {id(n.keyword) for n in _walk(fn.body) if isinstance(n, cst.Arg) and n.keyword is not None}
        skip |= {id(n.attr) for n in _walk(fn.body) if isinstance(n, cst.Attribute)}
        others = sorted({n.value for n in _walk(fn.body) if isinstance(n, cst.Name) and id(n) not in skip
                         and "residual" in n.value.lower()})
        if others:
            raise self.refuse(loop_anchor, f"the residual stream is not a local variable (the method uses "
                              f"{', '.join(others)}): hidden_states after a layer is not layer_out[k]; "
                              f"a recipe must say how to read the residual")
        return cst.Name("None"), True

    def _num_tokens(self, fn: cst.FunctionDef, owner: str) -> cst.BaseExpression:
        if self.recipe.num_tokens is not None:
            return _safe_expression(self.recipe.num_tokens)
        params = [p.name.value for p in fn.params.params + fn.params.kwonly_params + fn.params.posonly_params]
        if "positions" in params:  # [T] or [3, T] (M-RoPE): the last dim is the token count
            return cst.parse_expression("positions.shape[-1]")
        if "input_ids" in params:
            return cst.parse_expression("input_ids.shape[0]")
        raise self.refuse(f"{owner}:begin_step", "no `positions` or `input_ids` parameter to count tokens; "
                          "a recipe must give num_tokens")

    def _final_norm(self, fn: cst.FunctionDef, lp: _Loop, owner: str) -> list[tuple[cst.CSTNode, str]]:
        end = self.end_line(lp.node)
        hits = []
        for n in _walk(fn.body):
            if not isinstance(n, cst.SimpleStatementLine) or self.line(n) <= end:
                continue
            for small in n.body:
                if not isinstance(small, (cst.Assign, cst.AnnAssign)) or small.value is None:
                    continue
                if not any(_mentions_self_attr(small.value, a) for a in self.recipe.final_norm):
                    continue
                tgt = small.targets[0].target if isinstance(small, cst.Assign) else small.target
                names = _assigned_names(tgt)
                if names and names[0] != "_" and isinstance(self.parents.get(n), cst.IndentedBlock):
                    hits.append((n, names[0]))
        anchor = f"{owner}:final_norm"
        if not hits:
            raise self.refuse(anchor, "no assignment from self." + "/".join(self.recipe.final_norm) + " after the loop")
        if len(hits) > 1 and not self._exclusive([h[0] for h in hits]):
            raise self.refuse(anchor, "several final-norm assignments at lines " + ", ".join(str(self.line(h[0])) for h in hits))
        return hits

    def _exclusive(self, stmts: list[cst.CSTNode]) -> bool:
        """All statements sit in different branches of one if/elif/else chain."""
        def branch_path(s: cst.CSTNode) -> list[tuple[cst.CSTNode, int]]:
            path, n = [], s
            while n in self.parents:
                p = self.parents[n]
                if isinstance(p, cst.If):
                    path.append((p, 0 if n is p.body else 1))
                elif isinstance(p, cst.Else):
                    path.append((p, 1))
                n = p
            return path
        paths = [branch_path(s) for s in stmts]
        for i in range(len(stmts)):
            for j in range(i + 1, len(stmts)):
                # exclusive when some If is an ancestor of both, via different branches
                pi = {id(k): b for k, b in paths[i]}
                if not any(id(k) in pi and pi[id(k)] != b for k, b in paths[j]):
                    return False
        return True


_SGLANG_RESIDUAL_PKG = "sglang.srt.layers.layer_boundary.residual"
# residual representations whose stream is not the one hidden state HF reports
_MULTI_STREAM_MODULES = tuple(f"{_SGLANG_RESIDUAL_PKG}.{m_}" for m_ in ("attn_bank", "mhc", "ihc"))


@dataclass(frozen=True)
class _Reader:
    """How capture_position reads the stream: ``hidden_states`` plus ``residual`` (a local, or
    None), or, with ``alias``, sglang's ``<alias>.snapshot(hidden_states, forward_batch)``."""

    residual: cst.BaseExpression | None
    before_loop: bool  # the residual expression is bound before the loop
    alias: str | None = None

    @property
    def costly(self) -> bool:
        return self.alias is not None

    def args(self, *, before_loop: bool) -> tuple[cst.BaseExpression, cst.BaseExpression]:
        if self.alias is not None:
            snap = cst.Call(func=cst.Attribute(cst.Name(self.alias), cst.Name("snapshot")),
                            args=[cst.Arg(cst.Name("hidden_states")), cst.Arg(cst.Name("forward_batch"))])
            return snap, cst.Name("None")
        res = self.residual if self.residual is not None and (self.before_loop or not before_loop) else cst.Name("None")
        return cst.Name("hidden_states"), res


@dataclass(frozen=True)
class _Bypass:
    """A path outside the capture loop that runs decoder layers ``first`` to ``last - 1``
    (expressions evaluated where the guard is placed; None: not readable)."""

    node: cst.CSTNode
    stmt: cst.CSTNode  # the statement the guard goes before
    line: int
    what: str
    text: str
    first: cst.BaseExpression | None
    last: cst.BaseExpression | None


_BOUND_NODES = (cst.Name, cst.Attribute, cst.Subscript, cst.SubscriptElement, cst.Index, cst.Integer, cst.Call,
                cst.Arg, cst.BinaryOperation, cst.Add, cst.Dot, cst.LeftSquareBracket, cst.RightSquareBracket,
                cst.SimpleWhitespace, cst.ParenthesizedWhitespace, cst.LeftParen, cst.RightParen, cst.Comma,
                cst.TrailingWhitespace, cst.Newline, cst.EmptyLine)


def _plus_one(expr: cst.BaseExpression) -> cst.BaseExpression:
    if isinstance(expr, cst.Integer):
        return cst.Integer(str(int(expr.evaluated_value) + 1))
    return cst.BinaryOperation(expr, cst.Add(), cst.Integer("1"))


def _len_of(attr: str) -> cst.Call:
    return cst.Call(func=cst.Name("len"), args=[cst.Arg(cst.Attribute(value=cst.Name("self"), attr=cst.Name(attr)))])


def _bound_ok(expr: cst.BaseExpression | None) -> bool:
    """A slice bound read again by the guard: names, attributes, subscripts, non-negative
    integers, sums and ``len(...)`` only (no side effects, no negative index)."""
    if expr is None:
        return False
    for n in _walk(expr):
        if not isinstance(n, _BOUND_NODES):
            return False
        if isinstance(n, cst.Call) and not (m.matches(n.func, m.Name("len")) and len(n.args) == 1):
            return False
    return True


AUX_NAME = "aux_hidden_states"  # the list both engines' decoder forwards return to the draft path


def _if(test: cst.BaseExpression, stmt: cst.BaseStatement) -> cst.If:
    return cst.If(test=test, body=cst.IndentedBlock([stmt]))


class _Insert(cst.CSTTransformer):
    def __init__(self, before, after, import_after: cst.CSTNode | None, import_stmt: cst.BaseStatement):
        self.before, self.after = before, after
        self.import_after, self.import_stmt = import_after, import_stmt

    def _splice(self, original_body, updated_body):
        out = []
        for o, u in zip(original_body, updated_body):
            out += self.before.get(o, [])
            out.append(u)
            out += self.after.get(o, [])
            if o is self.import_after:
                out.append(self.import_stmt)
        return out

    def leave_IndentedBlock(self, original_node, updated_node):
        return updated_node.with_changes(body=self._splice(original_node.body, updated_node.body))

    def leave_Module(self, original_node, updated_node):
        return updated_node.with_changes(body=self._splice(original_node.body, updated_node.body))


def _hooks_expr(name: str) -> cst.BaseExpression:
    parts = name.split(".")
    expr: cst.BaseExpression = cst.Name(parts[0])
    for p in parts[1:]:
        expr = cst.Attribute(value=expr, attr=cst.Name(p))
    return expr


def parse(source_bytes: bytes, relpath: str) -> cst.Module:
    """libcst module of ``source_bytes`` (PatchApplicationError when it does not parse)."""
    try:
        return cst.parse_module(source_bytes)
    except cst.ParserSyntaxError as exc:
        raise PatchApplicationError(relpath, "module", f"does not parse: {exc}") from exc


class Checker:
    """What :func:`rewrite` would insert for one class of an already parsed module, for several
    position sets, without generating code (the class is indexed once).
    :meth:`check` returns the anchors (the import excluded) or raises rewrite's PatchApplicationError."""

    def __init__(self, module: cst.Module, *, relpath: str, class_name: str | None,
                 recipe: Recipe | None = None, source_bytes: bytes | None = None):
        self._rw = _Rewriter(module, relpath, class_name, recipe or GENERIC, source_bytes)

    def check(self, positions: set[int], capture_final: bool, *, guard_bypass: bool = False) -> list[str]:
        if any(p < 0 for p in positions):
            raise ValueError(f"positions are >= 0, got {sorted(positions)}")
        return self._rw.plan(set(positions), capture_final, _hooks_expr("_surgeon_hooks"),
                             guard_bypass=guard_bypass)[2]


def check(module: cst.Module, *, relpath: str, class_name: str | None, positions: set[int],
          capture_final: bool, recipe: Recipe | None = None, source_bytes: bytes | None = None,
          guard_bypass: bool = False) -> list[str]:
    """One :class:`Checker` check."""
    return Checker(module, relpath=relpath, class_name=class_name, recipe=recipe,
                   source_bytes=source_bytes).check(positions, capture_final, guard_bypass=guard_bypass)


def _stmt_code(module: cst.Module, stmt: cst.CSTNode) -> bytes:
    """The bytes a top-level statement occupies in ``module``'s code (its leading lines included)."""
    return cst.Module(body=[stmt], default_indent=module.default_indent,
                      default_newline=module.default_newline).code.encode(module.encoding)


_CODING = re.compile(rb"^[ \t\f]*#.*?coding[:=]")
_NEWLINE = re.compile(rb"\r\n?|\n")


def _line_starts(source: bytes) -> list[int]:
    """Byte offset of the start of each line (1-based line k starts at [k - 1]), and the end."""
    out = [0]
    for line in source.splitlines(keepends=True):
        out.append(out[-1] + len(line))
    return out


def _first_indent(source: bytes) -> tuple[int, str] | None:
    """Line and text of the first INDENT token (libcst takes it as the module's default_indent,
    and stores a block's indent only where it differs); None when there is none or the tokenizer
    stops."""
    import io
    import tokenize

    try:
        for tok in tokenize.tokenize(io.BytesIO(source).readline):
            if tok.type == tokenize.INDENT:
                return tok.start[0], tok.string
    except (tokenize.TokenError, SyntaxError):
        return None
    return None


def _class_spans(source: bytes, class_name: str | None, recipe: Recipe) -> list[tuple[int, int]] | None:
    """Line spans of the top-level imports and the class(es) the rewrite can touch (what
    :func:`reduce_to_spans` keeps); None where there is no class to keep or the stdlib parser
    fails (then the whole file is parsed)."""
    import ast

    from surgeon.patch.coverage import _loops_over, _span

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    spans = [_span(st) for st in tree.body if isinstance(st, (ast.Import, ast.ImportFrom))]
    kept = 0
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        if class_name is not None:
            keep = cls.name == class_name
        else:
            keep = any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == recipe.method
                       and _loops_over(f, recipe.layers_attr) for f in cls.body)  # type: ignore[arg-type]
        if keep:
            spans.append(_span(cls))
            kept += 1
    return spans if kept else None


def reduce_to_spans(source: bytes, spans: list[tuple[int, int]]) -> tuple[bytes, str] | None:
    """``source`` with every line outside ``spans`` (1-based, inclusive line ranges) emptied, its
    line ending kept: the same line numbers, far less for libcst to parse, and the same default
    indent (the first indented block, which libcst reads it from, is kept, or stood in for by
    ``if 1:`` / ``<indent>pass`` on its two emptied lines); an encoding cookie is kept. Returns the
    bytes and that indent; None where that is not exact: a BOM, or the tokenizer fails (then
    the whole file is to be parsed). Shared by :func:`rewrite` and ``surgeon coverage``."""
    import codecs

    if source.startswith(codecs.BOM_UTF8):
        return None
    # an encoding cookie (a comment line among the first two) is kept: libcst reads it
    cookies = [i for i, x in enumerate(source.split(b"\n", 2)[:2], 1) if _CODING.match(x)]
    first = _first_indent(source)
    if first is None:
        return None
    lines = source.splitlines(keepends=True)
    keep_line = bytearray(len(lines) + 2)
    for a, b in spans:
        keep_line[a:b + 1] = b"\x01" * (b + 1 - a)
    for i in cookies:
        keep_line[i] = 1
    out = [line if keep_line[i] else line[len(line.rstrip(b"\r\n")):] for i, line in enumerate(lines, 1)]
    at, indent = first
    if not keep_line[at]:
        # the block is in an emptied top-level statement (so is the line before it): every kept
        # line before it is a whole statement without a block
        if at < 2 or keep_line[at - 1]:
            return None
        out[at - 2] = b"if 1:" + out[at - 2]
        out[at - 1] = indent.encode() + b"pass" + out[at - 1]
    return b"".join(out), indent


def parse_reduced(source: bytes, spans: list[tuple[int, int]] | None) -> tuple[cst.Module, bytes] | None:
    """libcst module of ``source`` reduced to ``spans`` and the reduced bytes, or None where the
    reduction is not exact or does not parse as the whole file would (then parse the whole)."""
    reduced = reduce_to_spans(source, spans) if spans is not None else None
    if reduced is None:
        return None
    text, indent = reduced
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError:
        return None
    return (module, text) if module.default_indent == indent else None


def _strip_trailing_blank(text: bytes) -> bytes:
    lines = text.splitlines(keepends=True)
    while lines and not lines[-1].strip():
        lines.pop()
    return b"".join(lines)


def rewrite(source_bytes: bytes, *, relpath: str, class_name: str | None, positions: set[int],
            capture_final: bool, hooks_module: str = "_surgeon_hooks",
            recipe: Recipe | None = None, guard_bypass: bool = False, aux_return: bool = False) -> RewriteResult:
    """Insert capture-hook calls into the decoder model's forward; see the module docstring.

    ``guard_bypass``: where the method runs decoder layers outside the capture loop (SGLang's
    two-batch overlap), insert ``bypass_guard(self, first, last, "file:line")`` before that
    statement instead of refusing: at runtime it raises when a requested ``layer_out[k]`` with
    ``first <= k < last`` would run there (all requested layers when the bounds are not readable).

    ``aux_return`` (aux mode): before each ``return`` of ``aux_hidden_states`` insert
    ``if aux_hidden_states: aux_hidden_states = [<hooks>.aux_hidden_states(self)]``, so that when
    the engine asked for aux states (an EAGLE-3 draft is configured) its draft path receives the
    spec's fc input, in fc order, as one ``[T, n_fc * H]`` tensor (the engines concatenate the list).

    Speed: libcst parses only the top-level imports and the class(es) concerned (the other lines
    emptied, line numbers kept; the stdlib ``ast`` finds them); positions and parents are resolved
    for the one method only; the insertions transform that method alone, and only the code of its
    class and of the hooks import is generated and spliced into the original bytes at their lines.
    Where any step of that is not exact, the whole file is parsed and generated: the same bytes."""
    if not _DOTTED.fullmatch(hooks_module) or any(p in ("self", "None", "True", "False") for p in hooks_module.split(".")):
        raise ValueError(f"hooks_module must be a dotted module name, not {hooks_module!r}")
    if any(p < 0 for p in positions):
        raise ValueError(f"positions are >= 0, got {sorted(positions)}")
    recipe = recipe or GENERIC
    reduced = parse_reduced(source_bytes, _class_spans(source_bytes, class_name, recipe))
    if reduced is not None:
        module, text = reduced
        new = _rewrite(module, text, source_bytes, relpath=relpath, class_name=class_name, positions=positions,
                       capture_final=capture_final, hooks_module=hooks_module, recipe=recipe,
                       guard_bypass=guard_bypass, aux_return=aux_return)
        if new is not None:
            return new
    return _rewrite(parse(source_bytes, relpath), source_bytes, source_bytes, relpath=relpath, class_name=class_name,
                    positions=positions, capture_final=capture_final, hooks_module=hooks_module, recipe=recipe,
                    guard_bypass=guard_bypass, aux_return=aux_return)  # type: ignore[return-value]


def _rewrite(module: cst.Module, parsed: bytes, source_bytes: bytes, *, relpath: str, class_name: str | None,
             positions: set[int], capture_final: bool, hooks_module: str, recipe: Recipe,
             guard_bypass: bool, aux_return: bool = False) -> RewriteResult | None:
    """The rewrite of ``source_bytes`` from ``module``, the parse of ``parsed`` (the same lines,
    some emptied, or the same bytes). None when ``parsed`` is reduced and the splice is not exact."""
    full = parsed is source_bytes
    rw = _Rewriter(module, relpath, class_name, recipe, parsed)
    hooks = _hooks_expr(hooks_module)
    before, after, anchors = rw.plan(set(positions), capture_final, hooks, guard_bypass=guard_bypass,
                                     aux_return=aux_return)
    cls, fn, _ = rw._candidates()[0]

    last_import = None
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body):
            last_import = stmt
    import_stmt = cst.SimpleStatementLine([cst.Import(names=[cst.ImportAlias(name=_hooks_expr(hooks_module))])])  # type: ignore[arg-type]
    if last_import is None:
        raise PatchApplicationError(relpath, "module:import", "no top-level import to place the hooks import after")
    rw.index(last_import)
    anchors.insert(0, f"module:import@{rw.line(last_import)}")
    # every insertion is inside the method: transform it alone, then its class
    new_fn = fn.visit(_Insert(before, after, None, import_stmt))
    assert isinstance(cls.body, cst.IndentedBlock)
    new_cls = cls.with_changes(body=cls.body.with_changes(
        body=tuple(new_fn if s is fn else s for s in cls.body.body)))
    new = None
    # splice by lines: the class and the last import without their leading lines (emptied where
    # the parse was reduced), and without the class's trailing blank lines (its footer there)
    src_lines = _line_starts(source_bytes)
    edits = []
    for old_node, new_node, extra in ((cls, new_cls, b""), (last_import, last_import, None)):
        old = _stmt_code(module, old_node.with_changes(leading_lines=()))
        core = _strip_trailing_blank(old) if old_node is cls else old
        first = rw.line(old_node) - 1
        n = len(core.splitlines())
        if first + n >= len(src_lines) or source_bytes[src_lines[first]:src_lines[first + n]] != core:
            break
        if extra is None:  # the hooks import goes right after the last import
            edits.append((src_lines[first + n], src_lines[first + n], _stmt_code(module, import_stmt)))
        else:
            text = _stmt_code(module, new_node.with_changes(leading_lines=()))
            tail = old[len(core):]
            if not text.endswith(tail):
                break
            edits.append((src_lines[first], src_lines[first + n], text[:len(text) - len(tail)]))
    else:
        edits.sort()
        if edits[0][1] <= edits[1][0]:
            parts, pos = [], 0
            for a, b, text in edits:
                parts += [source_bytes[pos:a], text]
                pos = b
            parts.append(source_bytes[pos:])
            new = b"".join(parts)
    if new is None:
        if not full:
            return None
        body: list[cst.BaseStatement] = []
        for s in module.body:
            body.append(new_cls if s is cls else s)
            if s is last_import:
                body.append(import_stmt)
        new = module.with_changes(body=body).code.encode(module.encoding)
    inserted = 1 + sum(len(v) for v in before.values()) + sum(len(v) for v in after.values())
    try:
        compile(new, relpath, "exec")
    except SyntaxError as exc:  # a bug here, not in the input: never hand back broken code
        raise PatchApplicationError(relpath, "module", f"rewritten source does not compile: {exc}") from exc
    return RewriteResult(new_bytes=new, anchors=anchors, inserted=inserted)
