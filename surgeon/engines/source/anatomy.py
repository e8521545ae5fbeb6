"""One decoder-loop anatomy of a class: where the layer loop is and how to read the stream there.

The probe (:mod:`surgeon.engines.probes.capture`), the rewriter's planner (:mod:`surgeon.patch.planner`)
and patch coverage (:mod:`surgeon.patch.coverage`, through the planner) all need the same reading
of a model's ``forward``; before this module each recognised the loop on its own and they
disagreed (which calls merely look at the layer list, for one). Here, once per class:

* **where the loop is**: the method, the ``for`` node and its line (:class:`ClassAnatomy`);
* **how the loop variable maps to the global layer index** (:func:`read_loop`): ``range(a, b)``
  starts at ``a``; ``enumerate(self.layers[a:b])`` counts from 0, so the index is ``a + i``;
  ``islice(enumerate(self.layers), a, b)`` counts the whole list; an index-less
  ``for layer in self.layers[a:b]`` gets an iteration counter (:data:`COUNTER`) from ``a``;
  :func:`index_offset` reads a captured index as ``<loop index> + k``;
* **the layer call** and that its output is rebound to ``hidden_states``;
* **where the residual stream is readable** (:meth:`ClassAnatomy.stream_reader`,
  :meth:`ClassAnatomy.local_residual`): ``hidden_states + residual`` with a local residual, or
  SGLang 0.5.23's ``residual_batch.snapshot(hidden_states, forward_batch)``; a recipe may give
  the residual expression instead (the planner applies it before asking here);
* **which paths bypass the loop** (:meth:`ClassAnatomy.bypasses`), with one table of the calls
  that only look at the layer list (:data:`LAYER_LIST_CALLS`).

The probe (:class:`surgeon.engines.probes.capture.CaptureAnalyzer`) asks a wider question of the same
method, through the same readers: every loop whose body runs a layer (:func:`layer_loops`: its
loop variables, its layer call, the names bound to a layer), since it must see each capture test
and each path that runs layers without one, including loops the rewriter cannot instrument. Where
the two readings differ it is a parameter here, with the reason beside it: ``any_subscript`` of
:func:`layer_callee`, ``follow_second_loops`` of :func:`hands_layers_on`.

Refusals are :class:`AnatomyRefusal` (an anchor and a reason); the planner turns them into
``PatchApplicationError`` naming the file. Each part is computed on first use and kept, refusal
included, so asking again (coverage checks several position sets) costs nothing and raises the
same refusal in the same order as the first time.

The stdlib-``ast`` :func:`loops_over_ast` is a cheap superset of the loops recognised here: coverage
and the rewriter use it to skip files and classes without any loop over the layers before paying
for a libcst parse.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from surgeon.engines.source.cstwalk import StatementLines, children, family

__all__ = [
    "COUNTER",
    "LAYER_LIST_CALLS",
    "SGLANG_RESIDUAL_PKG",
    "STREAM_SNAPSHOT_CALLS",
    "AnatomyRefusal",
    "ClassAnatomy",
    "DecoderLoop",
    "Finder",
    "LayerLoop",
    "LoopBypass",
    "ModuleIndex",
    "StreamReader",
    "assigned_names",
    "ast_span",
    "code",
    "find_in",
    "hands_layers_on",
    "index_offset",
    "is_self_attr",
    "layer_callee",
    "loop_layer_call",
    "layer_loops",
    "layer_list_call_kind",
    "loop_vars",
    "loops_over_ast",
    "mentions_self_attr",
    "read_loop",
    "split_layer_calls",
    "stmt_assigns",
    "walk",
]

COUNTER = "_surgeon_layer"  # the iteration counter inserted into index-less loops
_ZERO = cst.Integer("0")

# Calls that take the decoder-layer list (or a slice of it) without running a layer. "inspects":
# they only read the list; "iterates": they build an iterable whose consumer (a loop) runs the
# layers. Whether an "iterates" call is a bypass is one question with two answers, asked through
# hands_layers_on(follow_second_loops=...): the probe reads every layer loop (layer_loops) and so
# follows the iterable to its loop; the rewriter's planner does not, so for it the call is a bypass.
LAYER_LIST_CALLS: dict[str, tuple[str, str]] = {
    "len": ("inspects", "the layer count"),
    "isinstance": ("inspects", "a type test"),
    "getattr": ("inspects", "reads an attribute of the list or of a layer"),
    "hasattr": ("inspects", "tests an attribute"),
    "setattr": ("inspects", "sets an attribute"),
    "type": ("inspects", "the list's type"),
    "id": ("inspects", "the list's identity"),
    "print": ("inspects", "debug output"),
    "enumerate": ("iterates", "pairs each layer with its index for a loop"),
    "islice": ("iterates", "a lazy slice for a loop"),
    "zip": ("iterates", "pairs layers with something else for a loop"),
    "range": ("iterates", "indices for a loop"),
    "list": ("iterates", "a copy of the list"),
    "tuple": ("iterates", "a copy of the list"),
    "iter": ("iterates", "an iterator for a loop"),
    "reversed": ("iterates", "the layers backwards for a loop"),
}

# SGLang's per-batch residual stream (0.5.23 layer-boundary models) and its multi-stream variants,
# whose stream is not the one hidden state HF's output_hidden_states holds.
SGLANG_RESIDUAL_PKG = "sglang.srt.layers.layer_boundary.residual"
MULTI_STREAM_MODULES = tuple(f"{SGLANG_RESIDUAL_PKG}.{m_}" for m_ in ("attn_bank", "mhc", "ihc"))
# Engine helpers documented to return the complete residual stream.
STREAM_SNAPSHOT_CALLS = ("snapshot", "capture_output")


class AnatomyRefusal(Exception):
    """The loop cannot be read (``anchor``: where, ``reason``: why)."""

    def __init__(self, anchor: str, reason: str):
        self.anchor, self.reason = anchor, reason
        super().__init__(f"{anchor}: {reason}")


# ---------------------------------------------------------------------------------------------
# Small readers
# ---------------------------------------------------------------------------------------------
def code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def is_self_attr(node: cst.CSTNode, attr: str) -> bool:
    return m.matches(node, m.Attribute(value=m.Name("self"), attr=m.Name(attr)))


def layer_list_call_kind(func: cst.BaseExpression) -> str | None:
    """"inspects" / "iterates" (see :data:`LAYER_LIST_CALLS`) for a call of ``func`` on the layer
    list, by the last name of ``func`` (``itertools.islice`` is ``islice``); None otherwise."""
    last = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else None
    entry = LAYER_LIST_CALLS.get(last) if last else None
    return entry[0] if entry else None


# id(node) -> (node, children): filled by ModuleIndex in one visit (libcst's `children` property
# visits the node each time it is read); the node is kept to make a reused id harmless
_CHILDREN: dict[int, tuple[cst.CSTNode, list[cst.CSTNode]]] = {}


def _kids(n: cst.CSTNode) -> list[cst.CSTNode]:
    entry = _CHILDREN.get(id(n))
    if entry is not None and entry[0] is n:
        return entry[1]
    return children(n)


_DEFS = frozenset({cst.FunctionDef, cst.ClassDef, cst.Lambda})  # concrete classes: a set lookup, not an ABC isinstance


def walk(node: cst.CSTNode, *, into_defs: bool = False) -> Iterator[cst.CSTNode]:
    """Pre-order walk, not entering nested function/class definitions or lambdas (their loops,
    returns and assignments are not the method's)."""
    stack = [node]
    first = True
    while stack:
        n = stack.pop()
        if not first and not into_defs and type(n) in _DEFS:
            continue
        first = False
        yield n
        stack.extend(reversed(_kids(n)))


def mentions_self_attr(node: cst.CSTNode, attr: str) -> bool:
    return any(is_self_attr(n, attr) for n in walk(node))


def assigned_names(target: cst.BaseExpression) -> list[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        out: list[str] = []
        for el in target.elements:
            out += assigned_names(el.value)
        return out
    if isinstance(target, cst.StarredElement):
        return assigned_names(target.value)
    return []


def stmt_assigns(stmt: cst.CSTNode) -> list[tuple[list[str], cst.BaseExpression | None]]:
    out: list[tuple[list[str], cst.BaseExpression | None]] = []
    for n in walk(stmt):
        if isinstance(n, cst.Assign):
            for t in n.targets:
                out.append((assigned_names(t.target), n.value))
        elif isinstance(n, (cst.AnnAssign, cst.AugAssign)):
            out.append((assigned_names(n.target), n.value))
    return out


def _names_in(expr: cst.BaseExpression) -> set[str]:
    return {n.value for n in walk(expr) if isinstance(n, cst.Name) and n.value != "self"}


def _param_names(fn: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in (*fn.params.params, *fn.params.kwonly_params, *fn.params.posonly_params)]


def loop_vars(loop: cst.For) -> tuple[str | None, str | None]:
    """(index variable, element variable) of ``for i in ...`` / ``for i, layer in ...``."""
    t = loop.target
    if isinstance(t, cst.Name):
        return t.value, None
    if isinstance(t, cst.Tuple) and len(t.elements) == 2:
        first, second = t.elements[0].value, t.elements[1].value
        if isinstance(first, cst.Name) and isinstance(second, cst.Name):
            return first.value, second.value
    return None, None


def layer_callee(attr: str, names: set[str], index: str | None = None, *, any_subscript: bool = False) -> m.OneOf:
    """Matcher of what a loop body calls to run a layer: a local bound to a layer (``layer(...)``,
    ``layer.forward(...)``) or ``self.<attr>[index](...)`` / ``self.<attr>[index].forward(...)``
    (any subscript with ``any_subscript``)."""
    in_names = m.Name(value=m.MatchIfTrue(lambda v: v in names))
    sub = (m.Subscript(value=m.Attribute(value=m.Name("self"), attr=m.Name(attr))) if any_subscript else
           m.Subscript(value=m.Attribute(value=m.Name("self"), attr=m.Name(attr)),
                       slice=[m.SubscriptElement(m.Index(m.Name(index or "\0")))]))
    return m.OneOf(sub, in_names, m.Attribute(value=in_names | sub, attr=m.Name("forward")))


def index_offset(expr: cst.BaseExpression, idx: str) -> int | None:
    """``k`` when ``expr`` is ``idx + k`` (``self.start_layer`` terms count as 0: one pipeline rank)."""
    if m.matches(expr, m.Name(idx)):
        return 0
    if not isinstance(expr, cst.BinaryOperation):
        return None
    start = m.Attribute(value=m.Name("self"), attr=m.Name("start_layer"))
    op, left, right = expr.operator, expr.left, expr.right
    if isinstance(op, (cst.Add, cst.Subtract)):
        if m.matches(right, start):
            return index_offset(left, idx)
        if m.matches(left, start) and isinstance(op, cst.Add):
            return index_offset(right, idx)
        if isinstance(right, cst.Integer) and not m.matches(left, m.Name(idx)):
            inner = index_offset(left, idx)
            if inner is not None:
                k = int(right.value, 0)
                return inner + (k if isinstance(op, cst.Add) else -k)
    if isinstance(right, cst.Integer) and m.matches(left, m.Name(idx)):
        k = int(right.value, 0)
        if isinstance(op, cst.Add):
            return k
        if isinstance(op, cst.Subtract):
            return -k
    if isinstance(left, cst.Integer) and m.matches(right, m.Name(idx)) and isinstance(op, cst.Add):
        return int(left.value, 0)
    return None


# ---------------------------------------------------------------------------------------------
# The stdlib-ast prefilter (a superset of read_loop's loops)
# ---------------------------------------------------------------------------------------------
def _ast_self_attr(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


def _ast_walk_no_defs(node: ast.AST) -> Iterator[ast.AST]:
    stack = list(ast.iter_child_nodes(node))
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield n
        stack.extend(ast.iter_child_nodes(n))


def loops_over_ast(fn: ast.FunctionDef | ast.AsyncFunctionDef, attr: str) -> bool:
    """Whether ``fn`` has a ``for`` over something naming ``self.<attr>`` or one whose body indexes
    ``self.<attr>`` with the loop variable: every loop :func:`read_loop` reads passes this."""
    for n in _ast_walk_no_defs(fn):
        if not isinstance(n, ast.For):
            continue
        if any(_ast_self_attr(x, attr) for x in ast.walk(n.iter)):
            return True
        if isinstance(n.target, ast.Name):
            for x in ast.walk(n):
                if isinstance(x, ast.Subscript) and _ast_self_attr(x.value, attr) and \
                        isinstance(x.slice, ast.Name) and x.slice.id == n.target.id:
                    return True
    return False


def ast_span(node: ast.stmt) -> tuple[int, int]:
    """First (decorators included) and last line of a top-level statement."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first, node.end_lineno or node.lineno


# ---------------------------------------------------------------------------------------------
# Positions and parents, resolved per top-level statement or per method
# ---------------------------------------------------------------------------------------------
class ModuleIndex:
    """Lines and parents of the nodes of a (possibly reduced) module, resolved on demand.

    Metadata for a whole module costs more than parsing it, so positions and parents are
    resolved per top-level statement (:meth:`index`) or for one method (:meth:`index_method`,
    placed by the stdlib parser's line of the method), and shifted to the file's lines."""

    def __init__(self, module: cst.Module, source: bytes | None):
        self.module, self.source = module, source
        self.pos: dict[cst.CSTNode, CodeRange] = {}
        self.parents: dict[cst.CSTNode, cst.CSTNode] = {}
        self._offsets: dict[cst.CSTNode, int] = {}
        self._indexed: set[int] = set()
        self.children: dict[int, tuple[cst.CSTNode, list[cst.CSTNode]]] = {}
        self._lines: dict[int, int] | None = None
        self.ast_fns: dict[int, ast.FunctionDef | ast.AsyncFunctionDef] = {}  # id(libcst method) -> ast
        self._methods: dict[cst.CSTNode, StatementLines] = {}  # indexed methods placed by their ast lines

    def publish_children(self) -> None:
        """Make :func:`walk` use the children this index collected (one visit, not one per read)."""
        _CHILDREN.update(self.children)

    @staticmethod
    def forget_children() -> None:
        _CHILDREN.clear()  # it holds the nodes: keep no module alive

    def _sub(self, body: list) -> cst.Module:
        return cst.Module(body=body, default_indent=self.module.default_indent,
                          default_newline=self.module.default_newline)

    def _offset_of(self, i: int, submodule: cst.Module) -> int:
        body = list(self.module.body)
        if self.source is not None and i > 0:
            # the statement's own text is (nearly always) unique in the file: count the lines
            # before it there instead of generating the code of everything above it
            text = submodule.code.encode(self.module.encoding)
            at = self.source.find(text)
            if at >= 0 and self.source.find(text, at + 1) < 0:
                return self.source.count(b"\n", 0, at)
        prefix = self.module.with_changes(body=body[:i], footer=[]).code
        return prefix.count("\n") if body[:i] or self.module.header else 0

    def index(self, top: cst.CSTNode) -> None:
        if id(top) in self._indexed:
            return
        self._indexed.add(id(top))
        i = next(k for k, s in enumerate(self.module.body) if s is top)
        submodule = self._sub([top])
        offset = self._offset_of(i, submodule)
        for node, rng in MetadataWrapper(submodule, unsafe_skip_copy=True).resolve(PositionProvider).items():
            self.pos[node] = rng
            self._offsets[node] = offset
        family(top, self.parents, self.children)
        _CHILDREN.update(self.children)
        self.parents[top] = self.module

    def ast_lines(self) -> dict[int, int]:
        """id(libcst node) -> first line (decorators included) of every top-level class and of its
        methods, from the stdlib parser (top-level classes and class-body defs correspond one to
        one in both trees); {} when the source is not at hand or the trees disagree."""
        if self._lines is not None:
            return self._lines
        self._lines = {}
        if self.source is None:
            return self._lines
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
            lines[id(c)] = ast_span(a)[0]
            if not isinstance(c.body, cst.IndentedBlock):
                continue
            cf = [f for f in c.body.body if isinstance(f, cst.FunctionDef)]
            af = [f for f in a.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if [f.name.value for f in cf] != [f.name for f in af]:
                return self._lines
            lines.update((id(f), ast_span(g)[0]) for f, g in zip(cf, af))
            self.ast_fns.update((id(f), g) for f, g in zip(cf, af))
        self._lines = lines
        return lines

    def index_method(self, cls: cst.ClassDef, fn: cst.FunctionDef) -> None:
        """Positions and parents of one method only (far less than its class); the whole class
        where the stdlib parser's line of the method is not at hand."""
        if id(fn) in self._indexed or id(cls) in self._indexed:
            return
        start = self.ast_lines().get(id(fn))
        if start is None:
            self.index(cls)
            return
        self._indexed.add(id(fn))
        family(fn, self.parents, self.children)
        _CHILDREN.update(self.children)
        self.parents[fn] = cls.body
        lines = StatementLines(list(walk(fn, into_defs=True)), self.parents, self.ast_fns[id(fn)])
        if lines.ok:
            self._methods[fn] = lines
            return
        positions = MetadataWrapper(self._sub([fn]), unsafe_skip_copy=True).resolve(PositionProvider)
        offset = start - positions[fn].start.line
        for node, rng in positions.items():
            self.pos[node] = rng
            self._offsets[node] = offset

    def _span(self, node: cst.CSTNode) -> tuple[int, int]:
        if node in self.pos:
            return self.pos[node].start.line + self._offsets[node], self.pos[node].end.line + self._offsets[node]
        n: cst.CSTNode | None = node
        while n is not None:
            if n in self._methods:
                span = self._methods[n].span(node)
                if span is not None:
                    return span
                break
            n = self.parents.get(n)
        raise KeyError(node)  # not indexed: a caller's bug, as a missing position always was

    def line(self, node: cst.CSTNode) -> int:
        if node not in self.pos and isinstance(node, cst.ClassDef) and id(node) in self.ast_lines():
            return self.ast_lines()[id(node)]
        return self._span(node)[0]

    def end_line(self, node: cst.CSTNode) -> int:
        return self._span(node)[1]

    # -- structure --------------------------------------------------------------------------
    def innermost_loop(self, node: cst.CSTNode) -> cst.CSTNode | None:
        n = node
        while n in self.parents:
            n = self.parents[n]
            if isinstance(n, (cst.For, cst.While)):
                return n
        return None

    def enclosing_stmt(self, node: cst.CSTNode) -> cst.CSTNode:
        n = node
        while not isinstance(n, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            n = self.parents[n]
        return n

    def in_block(self, stmt: cst.CSTNode) -> bool:
        """``stmt`` is a statement of an indented block (something can be inserted beside it)."""
        return isinstance(self.parents.get(stmt), cst.IndentedBlock)

    def in_comprehension(self, node: cst.CSTNode, stmt: cst.CSTNode) -> bool:
        n = node
        while n is not stmt and n in self.parents:
            if isinstance(n, (cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)):
                return True
            n = self.parents[n]
        return False

    def _branch_path(self, s: cst.CSTNode) -> list[tuple[cst.CSTNode, int]]:
        path: list[tuple[cst.CSTNode, int]] = []
        n = s
        while n in self.parents:
            p = self.parents[n]
            if isinstance(p, cst.If):
                path.append((p, 0 if n is p.body else 1))
            elif isinstance(p, cst.Else):
                path.append((p, 1))
            n = p
        return path

    def exclusive(self, stmts: list[cst.CSTNode]) -> bool:
        """All statements sit in different branches of one if/elif/else chain."""
        paths = [self._branch_path(s) for s in stmts]
        for i in range(len(stmts)):
            for j in range(i + 1, len(stmts)):
                # exclusive when some If is an ancestor of both, via different branches
                pi = {id(k): b for k, b in paths[i]}
                if not any(id(k) in pi and pi[id(k)] != b for k, b in paths[j]):
                    return False
        return True


# ---------------------------------------------------------------------------------------------
# The loop: index, layer call, what ends an iteration early
# ---------------------------------------------------------------------------------------------
@dataclass
class DecoderLoop:
    node: cst.For
    index: cst.BaseExpression | None  # the global layer index of the layer an iteration runs
    call_stmt: cst.SimpleStatementLine | None  # the statement calling the layer
    problem: str | None = None  # why the loop cannot be captured
    start: cst.BaseExpression | None = None  # global index of the first layer the loop runs
    counter: bool = False  # no index variable: iterations are counted in COUNTER from `start`


@dataclass
class _Index:
    """How a loop's variable maps to the global layer index (the first step of :func:`read_loop`)."""

    index: cst.BaseExpression | None = None
    start: cst.BaseExpression | None = None
    callee_names: set[str] | None = None
    direct_index: str | None = None  # `for i in range(...)`: self.<attr>[i] is the layer
    problem: str | None = None
    counter: bool = False


def _layers_sub(attr: str, index: str | None = None) -> m.Subscript:
    if index is None:
        return m.Subscript(value=m.Attribute(value=m.Name("self"), attr=m.Name(attr)))
    return m.Subscript(value=m.Attribute(value=m.Name("self"), attr=m.Name(attr)),
                       slice=[m.SubscriptElement(m.Index(m.Name(index)))])


def loop_indexes_layers(loop: cst.For, attr: str) -> bool:
    """``for i in ...`` whose body reads ``self.<attr>[i]``."""
    if not isinstance(loop.target, cst.Name):
        return False
    sub = _layers_sub(attr, loop.target.value)
    return any(m.matches(n, sub) for n in walk(loop.body))


def _positional(args: Sequence[cst.Arg]) -> bool:
    return all(a.keyword is None and a.star == "" for a in args)


def _range_index(loop: cst.For, attr: str) -> _Index | None:
    it, tgt = loop.iter, loop.target
    assert isinstance(it, cst.Call) and isinstance(tgt, cst.Name)
    if not loop_indexes_layers(loop, attr):
        return None
    start: cst.BaseExpression | None = None
    if len(it.args) == 1 and _positional(it.args):
        start = _ZERO
    elif len(it.args) == 2 and _positional(it.args):
        start = it.args[0].value
    return _Index(cst.Name(tgt.value), start, set(), direct_index=tgt.value)


def _enumerate_seq_start(seq: cst.BaseExpression, attr: str) -> tuple[cst.BaseExpression | None, str | None]:
    """(global index of the enumerated sequence's first layer (None: 0), problem)."""
    if is_self_attr(seq, attr):
        return None, None
    if (isinstance(seq, cst.Call) and m.matches(seq.func, m.Name("islice")) and len(seq.args) >= 3
            and is_self_attr(seq.args[0].value, attr)):
        return seq.args[1].value, None
    if (isinstance(seq, cst.Subscript) and m.matches(seq, _layers_sub(attr)) and len(seq.slice) == 1
            and isinstance(seq.slice[0].slice, cst.Slice)):
        return seq.slice[0].slice.lower, None
    return None, f"enumerate over {code(seq)}: cannot tell whether the index is the global layer index"


def _pair_names(tgt: cst.Tuple) -> tuple[str, str]:
    """The two names of a loop target that matched :data:`_PAIR` (``for idx, layer in ...``)."""
    first, second = (cst.ensure_type(e.value, cst.Name).value for e in tgt.elements)
    return first, second


def _enumerate_index(loop: cst.For, attr: str) -> _Index | None:
    it, tgt = loop.iter, loop.target
    assert isinstance(it, cst.Call) and isinstance(tgt, cst.Tuple)
    seq = it.args[0].value
    if not mentions_self_attr(seq, attr):
        return None
    idx_name, elem_name = _pair_names(tgt)
    names = {elem_name}
    start = next((a.value for a in it.args[1:] if a.keyword is None or a.keyword.value == "start"), None)
    seq_start, problem = _enumerate_seq_start(seq, attr)
    offset_index: cst.BaseExpression | None = None
    if problem is None:
        same = (seq_start is None and start is None) or (
            seq_start is not None and start is not None and code(seq_start) == code(start)) or (
            seq_start is None and start is not None and code(start) == "0") or (
            start is None and seq_start is not None and code(seq_start) == "0")
        if not same and start is None and seq_start is not None:
            # enumerate counts from 0 over a slice from seq_start: global = seq_start + idx
            base = seq_start
            if not isinstance(base, (cst.Name, cst.Attribute, cst.Subscript, cst.Integer)):
                base = base.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            offset_index = cst.BinaryOperation(base, cst.Add(), cst.Name(idx_name))
            start = seq_start
        elif same:
            start = start or seq_start or _ZERO
        else:
            problem = (f"enumerate start {code(start) if start else '0'} differs from the slice start "
                       f"{code(seq_start) if seq_start else '0'}: the loop index is not the global layer index")
    return _Index(offset_index or cst.Name(idx_name), start, names, problem=problem)


def _islice_enumerate_index(loop: cst.For) -> _Index:
    """`for idx, layer in islice(enumerate(self.layers), a, b)`: idx counts the full list."""
    it, tgt = loop.iter, loop.target
    assert isinstance(it, cst.Call) and isinstance(tgt, cst.Tuple)
    start = it.args[1].value if len(it.args) == 3 and _positional(it.args) else None
    idx_name, elem_name = _pair_names(tgt)
    return _Index(cst.Name(idx_name), start, {elem_name})


def sequence_start(seq: cst.BaseExpression, attr: str) -> cst.BaseExpression | None:
    """Global index of the first element of ``seq`` when it is self.<attr>, a step-less slice of
    it, or ``islice(self.<attr>, [a,] b)``; else None."""
    if is_self_attr(seq, attr):
        return _ZERO
    if (isinstance(seq, cst.Subscript) and is_self_attr(seq.value, attr) and len(seq.slice) == 1
            and isinstance(seq.slice[0].slice, cst.Slice) and seq.slice[0].slice.step is None):
        return seq.slice[0].slice.lower or _ZERO
    if (isinstance(seq, cst.Call) and m.matches(seq.func, m.Name("islice")) and seq.args
            and is_self_attr(seq.args[0].value, attr) and _positional(seq.args)):
        if len(seq.args) == 2:
            return _ZERO
        if len(seq.args) == 3:
            return seq.args[1].value
    return None


def _indexless(loop: cst.For, attr: str) -> _Index:
    """`for layer in self.layers` / `self.layers[a:b]` / `islice(self.layers, a, b)`: no index
    variable, but the iteration count from the slice start is the global index (the rewriter
    counts iterations itself; `continue`/`break` are refused by :func:`read_loop`)."""
    it, tgt = loop.iter, loop.target
    assert isinstance(tgt, cst.Name)
    start = sequence_start(it, attr)
    if start is None:
        return _Index(None, None, {tgt.value}, problem=(
            f"`for {tgt.value} in {code(it)}` has no layer index variable and the "
            "sequence is not self.{attr}, a slice of it or an islice of it"))
    return _Index(cst.Name(COUNTER), start, {tgt.value}, counter=True)


_PAIR = m.Tuple(elements=[m.Element(m.Name()), m.Element(m.Name())])


def _loop_index(loop: cst.For, attr: str) -> _Index | None:
    """How the loop variable maps to the global layer index; None: not a layer loop."""
    it, tgt = loop.iter, loop.target
    if m.matches(it, m.Call(func=m.Name("range"))) and isinstance(tgt, cst.Name):
        return _range_index(loop, attr)
    if m.matches(it, m.Call(func=m.Name("enumerate"))) and m.matches(tgt, _PAIR):
        return _enumerate_index(loop, attr)
    if m.matches(it, m.Call(func=m.Name("islice"), args=[m.Arg(m.Call(
            func=m.Name("enumerate"), args=[m.Arg(m.Attribute(value=m.Name("self"), attr=m.Name(attr)))])),
            m.ZeroOrMore()])) and m.matches(tgt, _PAIR):
        return _islice_enumerate_index(loop)
    if mentions_self_attr(it, attr) and isinstance(tgt, cst.Name):
        return _indexless(loop, attr)
    return None


def _reassigned_index(loop: cst.For, index: cst.BaseExpression) -> str | None:
    for n in walk(loop.body):
        if isinstance(n, cst.SimpleStatementLine) and any(
                code(index) in names or any(nm in names for nm in _names_in(index))
                for names, _ in stmt_assigns(n)):
            return (f"the loop body reassigns the layer index (`{code(n).strip()}`): "
                    "a recipe must give the global index expression")
    return None


def _layer_calls(loop: cst.For, attr: str, li: _Index) -> list[cst.Call]:
    names = set(li.callee_names or ())
    if li.direct_index is not None:  # locals bound to self.layers[i] inside the body
        sub = _layers_sub(attr, li.direct_index)
        for n in walk(loop.body):
            for targets, value in stmt_assigns(n) if isinstance(n, cst.SimpleStatementLine) else []:
                if value is not None and m.matches(value, sub) and len(targets) == 1:
                    names.add(targets[0])
    callee = layer_callee(attr, names, li.direct_index)
    return [n for n in walk(loop.body) if isinstance(n, cst.Call) and m.matches(n.func, callee)]


def _call_stmt(idx: ModuleIndex, calls: list[cst.Call]) -> tuple[cst.SimpleStatementLine | None, str | None]:
    stmts = [idx.enclosing_stmt(c) for c in calls]
    if not calls or (len(calls) > 1 and not idx.exclusive(stmts)):
        return None, (f"{'no' if not calls else len(calls)} decoder-layer calls in the loop body "
                      "(need exactly one, or one per branch of an if/else)")
    stmt = stmts[0]
    if not isinstance(stmt, cst.SimpleStatementLine) or not idx.in_block(stmt):
        return None, "the decoder-layer call is not a statement of its own in an indented block"
    return stmt, None


def _output_problem(idx: ModuleIndex, loop: cst.For, call_stmt: cst.SimpleStatementLine) -> str | None:
    """What is captured is `hidden_states`: the layer's output must be (re)bound to it."""
    call_line = idx.line(call_stmt)
    if any("hidden_states" in names and idx.line(n) >= call_line
           for n in walk(loop.body) if isinstance(n, cst.SimpleStatementLine) for names, _ in stmt_assigns(n)):
        return None
    return ("the decoder-layer output is not assigned to `hidden_states` "
            f"(`{code(call_stmt).strip().splitlines()[0]}`): the stream is carried in another variable")


def _early_exit_problem(idx: ModuleIndex, loop: cst.For) -> str | None:
    """The capture goes at the end of the iteration (the state entering the next layer, after
    anything the body adds to the stream, e.g. Qwen3-VL's deepstack embeds): `continue`/`break`
    whose innermost loop is this one, or `return`/`yield` anywhere in the body, would skip it."""
    for n in walk(loop.body):
        if (isinstance(n, (cst.Continue, cst.Break)) and idx.innermost_loop(n) is loop
                or isinstance(n, (cst.Return, cst.Yield))):
            return (f"the loop body has `{code(n).strip().splitlines()[0]}`: an iteration "
                    "can end before the end-of-iteration capture")
    if not isinstance(loop.body, cst.IndentedBlock):
        return "the loop body is on one line"
    return None


def read_loop(idx: ModuleIndex, loop: cst.For, attr: str,
              index_override: cst.BaseExpression | None = None) -> DecoderLoop | None:
    """The anatomy of one ``for`` (None when it is not a loop over the decoder layers);
    ``index_override``: a recipe's global index expression."""
    li = _loop_index(loop, attr)
    if li is None:
        return None
    index, problem, counter = li.index, li.problem, li.counter
    if problem is None and index is not None and not counter:
        problem = _reassigned_index(loop, index)
    if index_override is not None:
        index, problem, counter = index_override, None, False
    calls = _layer_calls(loop, attr, li)
    call_stmt = None
    if problem is None:
        call_stmt, problem = _call_stmt(idx, calls)
    if problem is None and call_stmt is not None:
        problem = _output_problem(idx, loop, call_stmt)
    if problem is None:
        problem = _early_exit_problem(idx, loop)
    return DecoderLoop(loop, index, call_stmt, problem, li.start, counter)


def layers_loops(idx: ModuleIndex, fn: cst.FunctionDef, attr: str,
                 index_override: cst.BaseExpression | None = None) -> list[DecoderLoop]:
    """Every loop of ``fn`` over the decoder layers (nested defs and lambdas excluded)."""
    loops = []
    for n in walk(fn.body):
        if isinstance(n, cst.For) and (mentions_self_attr(n.iter, attr) or loop_indexes_layers(n, attr)):
            lp = read_loop(idx, n, attr, index_override)
            if lp is not None:
                loops.append(lp)
    return loops


# ---------------------------------------------------------------------------------------------
# Layer loops as the probe reads them (any loop whose body runs a layer)
# ---------------------------------------------------------------------------------------------
Finder = Callable[[m.BaseMatcherNode, cst.CSTNode], list[cst.CSTNode]]


def find_in(matcher: m.BaseMatcherNode, within: cst.CSTNode) -> list[cst.CSTNode]:
    """Nodes under ``within`` (nested definitions included) matching ``matcher``, in source order:
    the default :data:`Finder`; the probe hands its flat per-function index instead (faster)."""
    return [n for n in walk(within, into_defs=True) if m.matches(n, matcher)]


@dataclass(frozen=True)
class LayerLoop:
    """A ``for`` whose body runs a decoder layer, as the probe reads it (:func:`layer_loops`)."""

    node: cst.For
    index_var: str | None  # ``i`` of ``for i in ...`` / ``for i, layer in ...``; None: index-less
    elem_var: str | None  # ``layer`` of ``for i, layer in ...``
    call: cst.Call  # the first layer call in the body
    layer_vars: frozenset[str]  # names bound to a layer in the body (the callee's locals)


def loop_layer_call(loop: cst.For, attr: str, find: Finder = find_in) -> tuple[cst.Call | None, frozenset[str]]:
    """The first layer call in ``loop``'s body and the names bound to a layer there (the element
    variable; with an index variable, locals assigned from ``self.<attr>[...]``).

    The callee is :func:`layer_callee` with ``any_subscript``: unlike :func:`read_loop`, which
    rewrites a loop and so must know that ``self.<attr>[i]`` is *this iteration's* layer, the probe
    only asks whether the body runs layers at all; what index a capture is taken under it reads
    from the capture test itself (:func:`index_offset`)."""
    idx, elem = loop_vars(loop)
    names = {elem} if elem else set()
    if idx:
        bound = m.Assign(targets=[m.AssignTarget(target=m.Name())], value=_layers_sub(attr))
        for a in find(bound, loop.body):
            target = cst.ensure_type(a, cst.Assign).targets[0].target
            names.add(cst.ensure_type(target, cst.Name).value)
    found = find(m.Call(func=layer_callee(attr, names, any_subscript=True)), loop.body)
    calls = [c for c in found if isinstance(c, cst.Call)] or split_layer_calls(loop, attr, frozenset(names), find)
    return (calls[0] if calls else None), frozenset(names)


def split_layer_calls(loop: cst.For, attr: str, names: frozenset[str], find: Finder = find_in) -> list[cst.Call]:
    """The stages of a layer run as two or more of its ``forward_*`` methods in the loop body
    (``h, r = layer.forward_input_norm(h, r)`` then ``layer.forward_after_input_norm(...)``), in
    source order; [] unless at least two different stages are called on the same layer."""
    layer: m.OneOf[m.BaseExpression] = m.OneOf(m.Name(value=m.MatchIfTrue(lambda v: v in names)),
                                               m.Subscript(value=m.Attribute(value=m.Name("self"), attr=m.Name(attr))))
    stage = m.Call(func=m.Attribute(value=layer, attr=m.Name(m.MatchRegex(r"^forward_\w+$"))))
    calls = [c for c in find(stage, loop.body) if isinstance(c, cst.Call)]
    stages = {cst.ensure_type(c.func, cst.Attribute).attr.value for c in calls}
    return calls if len(stages) >= 2 else []


def layer_loops(fn: cst.FunctionDef, attr: str, find: Finder = find_in) -> list[LayerLoop]:
    """Every ``for`` in ``fn`` (nested definitions included: a local helper's loop runs layers
    too) whose body calls a decoder layer, in source order.

    This is the probe's question, wider than :func:`layers_loops` (the loops the rewriter can
    instrument): a loop over anything (the capture ids, a zip of layers with caches) counts when
    its body runs a layer, since the probe must see every capture test and every path that runs
    layers without one."""
    out = []
    for node in find(m.For(), fn):
        assert isinstance(node, cst.For)
        call, names = loop_layer_call(node, attr, find)
        if call is not None:
            idx, elem = loop_vars(node)
            out.append(LayerLoop(node, idx, elem, call, names))
    return out


def hands_layers_on(func: cst.BaseExpression, *, follow_second_loops: bool) -> bool:
    """Whether a call of ``func`` that takes the layer list outside the capture loop may run
    layers there (a bypass).

    Calls that only look at the list (:data:`LAYER_LIST_CALLS` "inspects") never do. Those that
    build an iterable ("iterates": ``enumerate``, ``zip``...) feed a second loop: the probe reads
    every layer loop itself (:func:`layer_loops`) and reports that loop, so it follows the
    iterable (``follow_second_loops=True``) and does not count the call; the rewriter's planner
    does not follow an iterable to its consumer, so for it the call is the bypass."""
    kind = layer_list_call_kind(func)
    if kind == "inspects":
        return False
    return not (kind == "iterates" and follow_second_loops)


# ---------------------------------------------------------------------------------------------
# Bypasses
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoopBypass:
    """A path outside the capture loop that runs decoder layers ``first`` to ``last - 1``
    (expressions evaluated where a guard would be placed; None: not readable)."""

    node: cst.CSTNode
    stmt: cst.CSTNode  # the statement a guard goes before
    line: int
    what: str
    text: str
    first: cst.BaseExpression | None
    last: cst.BaseExpression | None


_BOUND_NODES = (cst.Name, cst.Attribute, cst.Subscript, cst.SubscriptElement, cst.Index, cst.Integer, cst.Call,
                cst.Arg, cst.BinaryOperation, cst.Add, cst.Dot, cst.LeftSquareBracket, cst.RightSquareBracket,
                cst.SimpleWhitespace, cst.ParenthesizedWhitespace, cst.LeftParen, cst.RightParen, cst.Comma,
                cst.TrailingWhitespace, cst.Newline, cst.EmptyLine)


def plus_one(expr: cst.BaseExpression) -> cst.BaseExpression:
    if isinstance(expr, cst.Integer):
        return cst.Integer(str(int(expr.evaluated_value) + 1))
    return cst.BinaryOperation(expr, cst.Add(), cst.Integer("1"))


def len_of(attr: str) -> cst.Call:
    return cst.Call(func=cst.Name("len"), args=[cst.Arg(cst.Attribute(value=cst.Name("self"), attr=cst.Name(attr)))])


def bound_ok(expr: cst.BaseExpression | None) -> bool:
    """A slice bound read again by a guard: names, attributes, subscripts, non-negative
    integers, sums and ``len(...)`` only (no side effects, no negative index)."""
    if expr is None:
        return False
    for n in walk(expr):
        if not isinstance(n, _BOUND_NODES):
            return False
        if isinstance(n, cst.Call) and not (m.matches(n.func, m.Name("len")) and len(n.args) == 1):
            return False
    return True


def _single_layer_locals(outside: list[cst.CSTNode], attr: str) -> dict[str, cst.BaseExpression]:
    """Locals bound to one layer outside the loop (``layer = self.layers[0]``) -> the index."""
    single: dict[str, cst.BaseExpression] = {}
    for n in outside:
        if isinstance(n, cst.Assign) and len(n.targets) == 1 and isinstance(n.targets[0].target, cst.Name) \
                and isinstance(n.value, cst.Subscript) and m.matches(n.value, _layers_sub(attr)) \
                and len(n.value.slice) == 1 and isinstance(n.value.slice[0].slice, cst.Index):
            single[n.targets[0].target.value] = n.value.slice[0].slice.value
    return single


_Found = tuple[str, "cst.BaseExpression | None", "cst.BaseExpression | None"]


def _bypass_kind(n: cst.CSTNode, attr: str, single: dict[str, cst.BaseExpression]) -> _Found | None:
    """(what, first, last) when ``n`` runs decoder layers (outside the capture loop)."""
    if isinstance(n, cst.Subscript) and m.matches(n, _layers_sub(attr)) and any(isinstance(e.slice, cst.Slice) for e in n.slice):
        sl = n.slice[0].slice if len(n.slice) == 1 else None
        if isinstance(sl, cst.Slice) and sl.step is None:
            return ("runs a slice of the decoder layers outside the capture loop",
                    sl.lower or cst.Integer("0"), sl.upper or len_of(attr))
        return "runs a slice of the decoder layers outside the capture loop", None, None
    if not isinstance(n, cst.Call):
        return None
    if any(is_self_attr(a.value, attr) for a in n.args) and hands_layers_on(n.func, follow_second_loops=False):
        return "hands the decoder layers to another call outside the capture loop", cst.Integer("0"), len_of(attr)
    if isinstance(n.func, cst.Subscript) and m.matches(n.func, _layers_sub(attr)):
        sl = n.func.slice[0].slice if len(n.func.slice) == 1 else None
        if isinstance(sl, cst.Index):
            return "calls a decoder layer outside the capture loop", sl.value, plus_one(sl.value)
        return "calls a decoder layer outside the capture loop", None, None
    f = n.func.value if isinstance(n.func, cst.Attribute) and n.func.attr.value == "forward" else n.func
    if isinstance(f, cst.Name) and f.value in single:
        idx = single[f.value]
        if isinstance(idx, cst.Integer) or m.matches(idx, m.Attribute(value=m.Name("self"), attr=m.Name())):
            # a constant or an attribute of self: the same value where the layer is called
            return "calls a decoder layer outside the capture loop", idx, plus_one(idx)
        return "calls a decoder layer outside the capture loop", None, None
    return None


# ---------------------------------------------------------------------------------------------
# The class anatomy
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamReader:
    """How the stream is read at a layer boundary: ``hidden_states`` plus ``residual`` (a local,
    or None), or, with ``alias``, sglang's ``<alias>.snapshot(hidden_states, forward_batch)``."""

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


class _Once:
    """A value computed on first use and kept, a refusal included (raised again each time)."""

    def __init__(self) -> None:
        self._got: dict[str, tuple[object, AnatomyRefusal | None]] = {}

    def get(self, key: str, compute):
        if key not in self._got:
            try:
                self._got[key] = (compute(), None)
            except AnatomyRefusal as exc:
                self._got[key] = (None, exc)
        value, refusal = self._got[key]
        if refusal is not None:
            raise refusal
        return value


class ClassAnatomy:
    """The decoder loop of one class's method and how to read the stream around it.

    ``loops`` are all the layer loops :func:`layers_loops` found (the planner refuses unless there
    is exactly one); the other parts read the first and are computed once."""

    def __init__(self, idx: ModuleIndex, cls: cst.ClassDef, fn: cst.FunctionDef, loops: list[DecoderLoop],
                 attr: str):
        self.idx, self.cls, self.fn, self.loops, self.attr = idx, cls, fn, loops, attr
        self.owner = f"{cls.name.value}.{fn.name.value}"
        self._once = _Once()

    @property
    def loop(self) -> DecoderLoop:
        return self.loops[0]

    @property
    def loop_anchor(self) -> str:
        return f"{self.owner}:loop@{self.idx.line(self.loop.node)}"

    def params(self) -> list[str]:
        return _param_names(self.fn)

    # -- bypasses ---------------------------------------------------------------------------
    def bypasses(self) -> list[LoopBypass]:
        """Places outside the capture loop that run decoder layers: a slice of self.<layers>, the
        layers handed to another call, a layer called directly or through a local bound to
        ``self.<layers>[i]`` (e.g. sglang's two-batch-overlap ``model_forward_stages``)."""
        return self._once.get("bypasses", self._find_bypasses)

    def _find_bypasses(self) -> list[LoopBypass]:
        inside = set(walk(self.loop.node))
        outside = [n for n in walk(self.fn.body) if n not in inside]
        single = _single_layer_locals(outside, self.attr)
        found: list[LoopBypass] = []
        for n in outside:
            kind = _bypass_kind(n, self.attr, single)
            if kind is None:
                continue
            what, first, last = kind
            stmt = self.idx.enclosing_stmt(n)
            if first is not None and not (bound_ok(first) and bound_ok(last) and not self.idx.in_comprehension(n, stmt)):
                first = last = None
            text = code(stmt).strip().splitlines()[0]
            found.append(LoopBypass(n, stmt, self.idx.line(n), what, text, first, last))
            if not self.idx.in_block(stmt):
                raise AnatomyRefusal(f"{self.owner}:bypass@{self.idx.line(n)}",
                                     f"{what} (`{text}`): layers run there would not be captured, and the "
                                     "statement is not in an indented block to put a guard before it")
        return found

    # -- the residual stream ----------------------------------------------------------------
    def local_residual(self) -> bool:
        """The method carries its own ``residual`` (a parameter or an assigned local)."""
        if "residual" in self.params():
            return True
        return any(names and "residual" in names for n in walk(self.fn.body)
                   if isinstance(n, cst.SimpleStatementLine) for names, _ in stmt_assigns(n))

    def _imported_modules(self) -> set[str]:
        out = set()
        for stmt in self.idx.module.body:
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for imp in stmt.body:
                if isinstance(imp, cst.ImportFrom) and imp.module is not None:
                    base = code(imp.module)
                    out.add(base)
                    if not isinstance(imp.names, cst.ImportStar):
                        out.update(f"{base}.{code(a.name)}" for a in imp.names)
                elif isinstance(imp, cst.Import):
                    out.update(code(a.name) for a in imp.names)
        return out

    def batch_alias(self) -> str | None:
        """The name this module binds to sglang's per-batch residual-stream accessors
        (``from sglang.srt.layers.layer_boundary.residual import batch as residual_batch``)."""
        for stmt in self.idx.module.body:
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for imp in stmt.body:
                if (isinstance(imp, cst.ImportFrom) and imp.module is not None and not imp.relative
                        and code(imp.module) == SGLANG_RESIDUAL_PKG and not isinstance(imp.names, cst.ImportStar)):
                    for alias in imp.names:
                        if m.matches(alias.name, m.Name("batch")):
                            if alias.asname is None:
                                return "batch"
                            return cst.ensure_type(alias.asname.name, cst.Name).value  # `as` names a Name here
        return None

    def reader(self) -> StreamReader:
        """Where the stream is readable without a recipe: sglang's per-batch stream, else the
        method's local ``residual`` (or the layer returns the sum)."""
        return self._once.get("reader", self._find_reader)

    def _find_reader(self) -> StreamReader:
        stream = self._stream_reader()
        if stream is not None:
            return stream
        return self._residual_reader()

    def _stream_reader(self) -> StreamReader | None:
        """SGLang (0.5.23) layer-boundary models keep the residual in ``forward_batch.residual_stream``
        (a ResidualStream: the written residual plus the last layer's pending contribution, which
        may still owe its all-reduce; ``hidden_states`` is then an opaque OwedOutput handle). The
        stream value at a boundary is ``residual_batch.snapshot(hidden_states, forward_batch)``:
        the completed contribution plus the residual, on a copy, leaving the engine's own
        completion and fusions as they are (the engine reads its own end-of-stack capture so,
        e.g. nemotron_h.py NemotronHModel.forward)."""
        alias = self.batch_alias()
        if alias is None:
            return None
        anchor = self.loop_anchor
        if not any(isinstance(n, cst.Name) and n.value == alias for n in walk(self.fn.body)):
            if self.local_residual():
                return None  # the method carries its own residual (a tower that does not use the stream)
            if any(isinstance(n, cst.Name) and n.value == "forward_batch" for n in walk(self.loop.node)):
                raise AnatomyRefusal(anchor, f"the module uses sglang's layer-boundary residual stream "
                                     f"({alias}) and the layers get forward_batch, but this method never touches "
                                     "the stream: cannot tell whether hidden_states after a layer is the full stream")
            return None
        if "forward_batch" not in self.params():
            raise AnatomyRefusal(anchor, f"the method uses {alias} but has no `forward_batch` parameter "
                                 "owning the residual stream")
        if self.local_residual():
            raise AnatomyRefusal(anchor, f"the method uses both a local `residual` and {alias}: "
                                 "cannot tell which carries the stream")
        self._refuse_post_residual_addition(anchor)
        for mod in MULTI_STREAM_MODULES:
            if mod in self._imported_modules():
                raise AnatomyRefusal(anchor, f"the module imports {mod}: its residual stream is not one "
                                     "hidden state that HF output_hidden_states holds")
        return StreamReader(None, True, alias=alias)

    def _refuse_post_residual_addition(self, anchor: str) -> None:
        for n in walk(self.loop.node.body):
            if isinstance(n, cst.Arg) and n.keyword is not None and n.keyword.value == "post_residual_addition" and not m.matches(
                    n.value, m.Name("None")):
                raise AnatomyRefusal(anchor, "a layer call passes post_residual_addition "
                                     f"(`{code(self.idx.enclosing_stmt(n)).strip().splitlines()[0]}`): the next "
                                     "layer adds it to the stream after the end-of-iteration capture, so the stream "
                                     "there is not layer_out[k]")

    def _residual_reader(self) -> StreamReader:
        fn = self.fn
        loop_line = self.idx.line(self.loop.node)
        params = self.params()
        assigned_lines = []
        for n in walk(fn.body):
            if isinstance(n, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
                targets = n.targets if isinstance(n, cst.Assign) else [n]
                for t in targets:
                    if "residual" in assigned_names(t.target):
                        assigned_lines.append(self.idx.line(n))
        if assigned_lines or "residual" in params:
            return StreamReader(cst.Name("residual"), "residual" in params or min(assigned_lines) < loop_line)
        skip = {id(n.keyword) for n in walk(fn.body) if isinstance(n, cst.Arg) and n.keyword is not None}
        skip |= {id(n.attr) for n in walk(fn.body) if isinstance(n, cst.Attribute)}
        others = sorted({n.value for n in walk(fn.body) if isinstance(n, cst.Name) and id(n) not in skip
                         and "residual" in n.value.lower()})
        if others:
            raise AnatomyRefusal(self.loop_anchor, f"the residual stream is not a local variable (the method uses "
                                 f"{', '.join(others)}): hidden_states after a layer is not layer_out[k]; "
                                 f"a recipe must say how to read the residual")
        return StreamReader(cst.Name("None"), True)

    # -- the final norm ---------------------------------------------------------------------
    def final_norm(self, norm_attrs: tuple[str, ...]) -> list[tuple[cst.CSTNode, str]]:
        """(statement, assigned name) of the assignment after the loop from ``self.<norm>``
        (several only in exclusive branches)."""
        return self._once.get(f"final_norm:{','.join(norm_attrs)}", lambda: self._find_final_norm(norm_attrs))

    def _find_final_norm(self, norm_attrs: tuple[str, ...]) -> list[tuple[cst.CSTNode, str]]:
        end = self.idx.end_line(self.loop.node)
        hits: list[tuple[cst.CSTNode, str]] = []
        for n in walk(self.fn.body):
            if not isinstance(n, cst.SimpleStatementLine) or self.idx.line(n) <= end:
                continue
            for small in n.body:
                if not isinstance(small, (cst.Assign, cst.AnnAssign)) or small.value is None:
                    continue
                if not any(mentions_self_attr(small.value, a) for a in norm_attrs):
                    continue
                tgt = small.targets[0].target if isinstance(small, cst.Assign) else small.target
                names = assigned_names(tgt)
                if names and names[0] != "_" and self.idx.in_block(n):
                    hits.append((n, names[0]))
        anchor = f"{self.owner}:final_norm"
        if not hits:
            raise AnatomyRefusal(anchor, "no assignment from self." + "/".join(norm_attrs) + " after the loop")
        if len(hits) > 1 and not self.idx.exclusive([h[0] for h in hits]):
            raise AnatomyRefusal(anchor, "several final-norm assignments at lines "
                                 + ", ".join(str(self.idx.line(h[0])) for h in hits))
        return hits
