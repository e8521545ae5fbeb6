"""The capture planner: which hook calls go where in a decoder model's forward.

:class:`CapturePlanner` reads the class's decoder-loop anatomy (:mod:`surgeon.engines.source.anatomy`)
under a recipe and decides, for a set of stream positions, the statements to insert before and
after which nodes, or refuses (:class:`~surgeon.patch.recipes.PatchApplicationError`). It writes
no code: :mod:`surgeon.patch.rewriter` inserts the planned statements, and :class:`Checker`
(patch coverage) only asks whether a plan exists. The plan is built from libcst nodes; recipe
expressions are parsed and restricted (:func:`~surgeon.patch.recipes.safe_expression`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from surgeon.core.errors import SurgeonError, unreadable
from surgeon.engines.source.anatomy import (
    COUNTER,
    AnatomyRefusal,
    ClassAnatomy,
    LoopBypass,
    ModuleIndex,
    StreamReader,
    layers_loops,
    loops_over_ast,
    walk,
)
from surgeon.patch.recipes import (
    GENERIC,
    PatchApplicationError,
    Recipe,
    parse,
    safe_expression,
)

__all__ = ["AUX_NAME", "COUNTER", "CapturePlanner", "Checker", "Plan", "check", "hooks_expr"]

AUX_NAME = "aux_hidden_states"  # the list both engines' decoder forwards return to the draft path


def hooks_expr(name: str) -> cst.BaseExpression:
    """``a.b.c`` as an attribute chain (the name was checked to be a dotted module name)."""
    parts = name.split(".")
    expr: cst.BaseExpression = cst.Name(parts[0])
    for p in parts[1:]:
        expr = cst.Attribute(value=expr, attr=cst.Name(p))
    return expr


def _if(test: cst.BaseExpression, stmt: cst.BaseStatement) -> cst.If:
    return cst.If(test=test, body=cst.IndentedBlock([stmt]))


def _is_zero(expr: cst.BaseExpression | None) -> bool:
    return isinstance(expr, cst.Integer) and expr.value == "0"


@dataclass
class Plan:
    """Statements to insert before / after nodes of the method, and one anchor per insertion
    (``Class.method:what@line``)."""

    hooks: cst.BaseExpression
    before: dict[cst.CSTNode, list[cst.BaseStatement]] = field(default_factory=dict)
    after: dict[cst.CSTNode, list[cst.BaseStatement]] = field(default_factory=dict)
    anchors: list[str] = field(default_factory=list)

    def call(self, fname: str, *args: cst.BaseExpression) -> cst.SimpleStatementLine:
        """``<hooks>.<fname>(self, *args)`` as a statement."""
        return cst.SimpleStatementLine([cst.Expr(cst.Call(
            func=cst.Attribute(value=self.hooks, attr=cst.Name(fname)),
            args=[cst.Arg(cst.Name("self"))] + [cst.Arg(a) for a in args],
        ))])

    def add_before(self, node: cst.CSTNode, stmt: cst.BaseStatement) -> None:
        self.before.setdefault(node, []).append(stmt)

    def add_after(self, node: cst.CSTNode, stmt: cst.BaseStatement) -> None:
        self.after.setdefault(node, []).append(stmt)


def _shape0(expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """``x`` of ``x.shape[0]`` / ``x.size(0)``, else None."""
    if (isinstance(expr, cst.Subscript) and len(expr.slice) == 1 and isinstance(expr.slice[0].slice, cst.Index)
            and _is_zero(expr.slice[0].slice.value) and m.matches(expr.value, m.Attribute(attr=m.Name("shape")))):
        return cst.ensure_type(expr.value, cst.Attribute).value
    if (isinstance(expr, cst.Call) and m.matches(expr.func, m.Attribute(attr=m.Name("size")))
            and len(expr.args) == 1 and _is_zero(expr.args[0].value)):
        return cst.ensure_type(expr.func, cst.Attribute).value
    return None


@dataclass(frozen=True)
class SplitStream:
    """The method tests whether the residual stream holds fewer rows than the step has tokens (a
    sequence-parallel rank's shard: the stream is split across ranks after a layer) and gathers it:
    ``<stream>.shape[0] != <tokens>`` at ``line``, gathered by ``gather(x, *extra)[:tokens]`` read
    from ``gather_line``. ``gather`` None: the split is there but the planner cannot read the gather."""

    line: int
    test: str
    tokens: cst.BaseExpression
    gather: cst.BaseExpression | None = None
    extra: tuple[cst.Arg, ...] = ()
    gather_line: int = 0

    def wrap(self, x: cst.BaseExpression) -> cst.BaseExpression:
        """``(x if x is None or x.shape[0] == tokens else gather(x, ...)[:tokens])``: host ints decide, so it is
        graph-safe; every tensor-parallel rank takes the same branch (the same shapes)."""
        assert self.gather is not None
        gathered = cst.Subscript(
            value=cst.Call(func=self.gather, args=[cst.Arg(x), *self.extra]),
            slice=[cst.SubscriptElement(cst.Slice(lower=None, upper=self.tokens))])
        rows = cst.Subscript(value=cst.Attribute(value=x, attr=cst.Name("shape")),
                             slice=[cst.SubscriptElement(cst.Index(cst.Integer("0")))])
        test = cst.BooleanOperation(
            cst.Comparison(x, [cst.ComparisonTarget(cst.Is(), cst.Name("None"))]), cst.Or(),
            cst.Comparison(rows, [cst.ComparisonTarget(cst.Equal(), self.tokens)]))
        return cst.IfExp(test=test, body=x, orelse=gathered,
                         lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def split_stream(idx: ModuleIndex, fn: cst.FunctionDef, streams: tuple[str, ...] = ("hidden_states", "residual")
                 ) -> SplitStream | None:
    """Where ``fn`` tests that a stream variable holds fewer rows than there are tokens, and how it
    gathers the rows back: an ``if`` whose test has ``<stream>.shape[0] != <tokens>`` and whose body
    assigns ``v = F(x, ...)`` then ``v = v[:<tokens>]``; ``F`` is the method's own gather."""
    code = cst.Module([]).code_for_node
    for node in walk(fn.body):
        if not isinstance(node, cst.If):
            continue
        for cmp in (c for c in walk(node.test) if isinstance(c, cst.Comparison)):
            if len(cmp.comparisons) != 1 or not isinstance(cmp.comparisons[0].operator, cst.NotEqual):
                continue
            sides = (cmp.left, cmp.comparisons[0].comparator)
            for mine, other in (sides, sides[::-1]):
                held = _shape0(mine)
                if not (isinstance(held, cst.Name) and held.value in streams) or _shape0(other) is None:
                    continue
                found = SplitStream(idx.line(node), code(cmp), other)
                return _with_gather(idx, node, found) or found
    return None


def _with_gather(idx: ModuleIndex, node: cst.If, found: SplitStream) -> SplitStream | None:
    code = cst.Module([]).code_for_node
    tokens = code(found.tokens)
    calls: dict[str, cst.Call] = {}
    for stmt in walk(node.body):
        if not (isinstance(stmt, cst.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0].target, cst.Name)):
            continue
        name = stmt.targets[0].target.value
        value = stmt.value
        if isinstance(value, cst.Call) and value.args and value.args[0].keyword is None:
            calls[name] = value
        elif (name in calls and isinstance(value, cst.Subscript) and m.matches(value.value, m.Name(name))
              and len(value.slice) == 1 and isinstance(value.slice[0].slice, cst.Slice)
              and value.slice[0].slice.lower is None and value.slice[0].slice.upper is not None
              and code(value.slice[0].slice.upper) == tokens):
            call = calls[name]
            return SplitStream(found.line, found.test, found.tokens, call.func, tuple(call.args[1:]), idx.line(call))
    return None


class CapturePlanner:
    """Plans the captures for one class (``class_name``; None: the one class whose recipe method
    loops over the layers) of a parsed module. The anatomy is read once; :meth:`plan` may be
    asked for several position sets."""

    def __init__(self, source: bytes | cst.Module, relpath: str, class_name: str | None, recipe: Recipe,
                 source_bytes: bytes | None = None, *, prefilter: bool = True):
        self.relpath, self.recipe, self.class_name = relpath, recipe, class_name
        if isinstance(source, cst.Module):
            module, self.source = source, source_bytes
        else:
            module, self.source = parse(source, relpath), source
        self.module = module
        self.idx = ModuleIndex(module, self.source)
        # without a class name, methods whose stdlib ast shows no loop over self.<layers> are not
        # indexed at all (anatomy.loops_over_ast is a superset of the loops the anatomy reads)
        self.prefilter = prefilter
        self._cands: list[ClassAnatomy] | None = None

    def line(self, node: cst.CSTNode) -> int:
        return self.idx.line(node)

    def refuse(self, anchor: str, reason: str) -> PatchApplicationError:
        return PatchApplicationError(self.relpath, anchor, reason)

    # -- the class ------------------------------------------------------------------------
    def candidates(self) -> list[ClassAnatomy]:
        """The anatomy of each class whose recipe method loops over the layers (with a class name:
        that class, loops or not)."""
        if self._cands is None:
            self._cands = self._find_candidates()
        return self._cands

    def _skipped_by_prefilter(self, fn: cst.FunctionDef) -> bool:
        if self.class_name is not None or not self.prefilter or not self.idx.ast_lines():
            return False
        tree = self.idx.ast_fns.get(id(fn))
        return tree is not None and not loops_over_ast(tree, self.recipe.layers_attr)

    def _find_candidates(self) -> list[ClassAnatomy]:
        rc = self.recipe
        index_override = safe_expression(rc.index) if rc.index is not None else None
        out = []
        for cls in self.module.body:
            if not isinstance(cls, cst.ClassDef):
                continue
            if self.class_name is not None and cls.name.value != self.class_name:
                continue
            if rc.class_name is not None and cls.name.value != rc.class_name:
                continue
            for fn in cls.body.body:
                if not (isinstance(fn, cst.FunctionDef) and fn.name.value == rc.method) or self._skipped_by_prefilter(fn):
                    continue
                self.idx.index_method(cls, fn)
                loops = layers_loops(self.idx, fn, rc.layers_attr, index_override)
                if loops or self.class_name is not None:
                    out.append(ClassAnatomy(self.idx, cls, fn, loops, rc.layers_attr))
        return out

    def anatomy(self) -> ClassAnatomy:
        """The one class to patch, with exactly one decoder loop that can be captured."""
        rc = self.recipe
        cands = self.candidates()
        want = self.class_name or rc.class_name
        anchor0 = f"{want or '<any class>'}.{rc.method}"
        if not cands:
            raise self.refuse(anchor0, f"no class{f' {want}' if want else ''} with a `{rc.method}` method "
                              f"looping over self.{rc.layers_attr}")
        if len(cands) > 1:
            names = ", ".join(f"{a.cls.name.value}@{self.line(a.cls)}" for a in cands)
            raise self.refuse(anchor0, f"several classes loop over self.{rc.layers_attr} in `{rc.method}`: {names}; name one")
        a = cands[0]
        if rc.refuse:
            raise self.refuse(a.owner, f"recipe {rc.name!r} refuses: {rc.refuse}")
        if not a.loops:
            raise self.refuse(f"{a.owner}:loop", f"no loop over self.{rc.layers_attr}")
        if len(a.loops) > 1:
            raise self.refuse(f"{a.owner}:loop", "several decoder-layer loops at lines "
                              + ", ".join(str(self.line(lp.node)) for lp in a.loops))
        if a.loop.problem:
            raise self.refuse(a.loop_anchor, a.loop.problem)
        return a

    # -- planning -------------------------------------------------------------------------
    def plan(self, positions: set[int], capture_final: bool, hooks: cst.BaseExpression, *,
             guard_bypass: bool = False, aux_return: bool = False) -> Plan:
        self.idx.publish_children()
        try:
            return self._plan(positions, capture_final, hooks, guard_bypass, aux_return)
        except AnatomyRefusal as exc:
            raise self.refuse(exc.anchor, exc.reason) from None
        except SurgeonError:
            raise
        except Exception as exc:  # code the reader cannot handle: a refusal of this class, never a crash
            raise self.refuse(self.class_name or "module", unreadable(exc)) from None
        finally:
            self.idx.forget_children()

    def _plan(self, positions: set[int], capture_final: bool, hooks: cst.BaseExpression,
              guard_bypass: bool, aux_return: bool) -> Plan:
        a = self.anatomy()
        bypasses = a.bypasses()
        if bypasses and not guard_bypass:
            b = bypasses[0]
            raise self.refuse(f"{a.owner}:bypass@{b.line}",
                              f"{b.what} (`{b.text}`): layers run there would not be captured "
                              "(`surgeon apply --guard-bypass` patches it with a runtime guard that raises "
                              "when that path would run a captured layer)")
        p = Plan(hooks)
        reader = self._reader(a)
        self._plan_begin_step(a, p)
        if (0 in positions or a.loop.counter) and not self.idx.in_block(a.loop.node):
            raise self.refuse(a.loop_anchor, "the loop is not a statement of an indented block")
        if 0 in positions:
            self._plan_embed(a, p, reader)
        later = sorted(q for q in positions if q >= 1)
        if later:
            self._plan_layer_out(a, p, reader, later)
        if capture_final:
            for stmt, name in a.final_norm(tuple(self.recipe.final_norm)):
                p.add_after(stmt, p.call("capture_final", cst.Name(name)))
                p.anchors.append(f"{a.owner}:final_norm@{self.line(stmt)}")
        if aux_return:
            self._plan_aux_return(a, p)
        for b in bypasses:
            self._plan_bypass_guard(a, p, b)
        return p

    def _reader(self, a: ClassAnatomy) -> StreamReader:
        """How to read the residual stream at a layer boundary (a recipe's residual first)."""
        rc = self.recipe
        if rc.residual == "none":
            return StreamReader(cst.Name("None"), True)
        if rc.residual is not None:
            return StreamReader(safe_expression(rc.residual), True)
        return a.reader()

    def _num_tokens(self, a: ClassAnatomy) -> cst.BaseExpression:
        if self.recipe.num_tokens is not None:
            return safe_expression(self.recipe.num_tokens)
        params = a.params()
        if "positions" in params:  # [T] or [3, T] (M-RoPE): the last dim is the token count
            return cst.parse_expression("positions.shape[-1]")
        if "input_ids" in params:
            return cst.parse_expression("input_ids.shape[0]")
        raise self.refuse(f"{a.owner}:begin_step", "no `positions` or `input_ids` parameter to count tokens; "
                          "a recipe must give num_tokens")

    def _plan_begin_step(self, a: ClassAnatomy, p: Plan) -> None:
        """``begin_step(self, num_tokens)`` as the first statement (after a docstring)."""
        num = self._num_tokens(a)
        body = a.fn.body
        if not isinstance(body, cst.IndentedBlock):
            raise self.refuse(a.owner, "method body is on one line")
        first = 0
        if body.body and m.matches(body.body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())])):
            first = 1
        if first >= len(body.body):
            raise self.refuse(a.owner, "method has no statements")
        p.add_before(body.body[first], p.call("begin_step", num))
        p.anchors.append(f"{a.owner}:begin_step@{self.line(body.body[first])}")

    def _plan_embed(self, a: ClassAnatomy, p: Plan, reader: StreamReader) -> None:
        """The stream before the loop is the embedding only where the loop starts at layer 0
        (a later pipeline rank enters with layer_out[start - 1]): guarded by ``start == 0``."""
        lp = a.loop
        if lp.start is None:
            raise self.refuse(a.loop_anchor, "cannot tell the first layer the loop runs: the state "
                              "before the loop is the embedding only when it is layer 0")
        stmt: cst.BaseStatement = p.call("capture_position", cst.Integer("0"), *reader.args(before_loop=True))
        if not _is_zero(lp.start):
            stmt = _if(cst.Comparison(lp.start, [cst.ComparisonTarget(cst.Equal(), cst.Integer("0"))]), stmt)
        p.add_before(lp.node, stmt)
        p.anchors.append(f"{a.owner}:embed@{self.line(lp.node)}")

    def _plan_layer_out(self, a: ClassAnatomy, p: Plan, reader: StreamReader, later: list[int]) -> None:
        """``capture_position(self, <index> + 1, ...)`` at the end of each iteration (index-less
        loops count iterations in COUNTER, from the slice start)."""
        lp = a.loop
        assert lp.call_stmt is not None and lp.index is not None
        last = lp.node.body.body[-1]  # an IndentedBlock (the anatomy checked)
        if lp.counter:
            assert lp.start is not None
            # COUNTER is the index of the layer the iteration runs until its end, then one more
            p.add_before(lp.node, cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(COUNTER))], lp.start)]))
            p.add_after(last, cst.SimpleStatementLine([cst.AugAssign(cst.Name(COUNTER), cst.AddAssign(), cst.Integer("1"))]))
            pos_expr: cst.BaseExpression = cst.Name(COUNTER)
            p.anchors.append(f"{a.owner}:counter@{self.line(lp.node)}")
        else:
            pos_expr = cst.BinaryOperation(lp.index, cst.Add(), cst.Integer("1"))
        args: tuple[cst.BaseExpression, ...] = reader.args(before_loop=False)
        split = split_stream(self.idx, a.fn)
        if split is not None:
            if split.gather is None:
                raise self.refuse(f"{a.owner}:split@{split.line}",
                                  f"the residual stream can be split across ranks here (`{split.test}`, a sequence-"
                                  f"parallel shard) and the method's gather could not be read: a capture after the "
                                  f"layer would write one rank's rows")
            # capture the gathered stream, with the method's own gather (a collective: only where asked)
            args = tuple(x if m.matches(x, m.Name("None")) else split.wrap(x) for x in args)
            p.anchors.append(f"{a.owner}:gather@{split.gather_line}")
        stmt: cst.BaseStatement = p.call("capture_position", pos_expr, *args)
        if reader.costly or split is not None:
            # reading the stream costs kernels (and a collective under TP): only where asked
            stmt = _if(cst.Comparison(pos_expr, [cst.ComparisonTarget(cst.In(), cst.Set(
                [cst.Element(cst.Integer(str(q))) for q in later]))]), stmt)
        p.add_after(last, stmt)
        p.anchors.append(f"{a.owner}:layer_out@{self.line(last)}")

    def _plan_aux_return(self, a: ClassAnatomy, p: Plan) -> None:
        """Hand the fc-ordered captures to the engine's draft path: where the method returns its
        aux list, the list becomes the hooks' fc buffer (only when the engine asked for aux)."""
        rets = [n for n in walk(a.fn.body) if isinstance(n, cst.Return) and n.value is not None
                and any(isinstance(x, cst.Tuple) and any(m.matches(e.value, m.Name(AUX_NAME)) for e in x.elements)
                        for x in walk(n.value))]  # `return h, aux` (also inside `... if aux else h`)
        if not rets:
            raise self.refuse(f"{a.owner}:aux", f"no `return` of `{AUX_NAME}`: this forward hands no aux "
                              "hidden states to the engine's draft path (use --mode dump)")
        for ret in rets:
            stmt = self.idx.enclosing_stmt(ret)
            if not self.idx.in_block(stmt):
                raise self.refuse(f"{a.owner}:aux@{self.line(ret)}", "the aux return is not a statement of an indented block")
            swap = cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(AUX_NAME))], cst.List([
                cst.Element(cst.Call(func=cst.Attribute(value=p.hooks, attr=cst.Name("aux_hidden_states")),
                                     args=[cst.Arg(cst.Name("self"))]))]))])
            p.add_before(stmt, _if(cst.Name(AUX_NAME), swap))
            p.anchors.append(f"{a.owner}:aux@{self.line(ret)}")

    def _plan_bypass_guard(self, a: ClassAnatomy, p: Plan, b: LoopBypass) -> None:
        """``bypass_guard(self, first, last, where)``: raises when a requested layer_out[k] with
        first <= k < last would run through this path (host ints only: graph safe)."""
        first: cst.BaseExpression
        last: cst.BaseExpression
        if b.first is None:
            first, last = cst.Integer("0"), cst.Attribute(value=p.hooks, attr=cst.Name("NUM_LAYERS"))
        else:
            assert b.last is not None
            first, last = b.first, b.last
        where = re.sub(r"[^A-Za-z0-9_./:+-]", "_", f"{self.relpath}:{b.line}")
        p.add_before(b.stmt, p.call("bypass_guard", first, last, cst.SimpleString(repr(where))))
        p.anchors.append(f"{a.owner}:bypass_guard@{b.line}")


class Checker:
    """What ``rewrite`` would insert for one class of an already parsed module, for several
    position sets, without generating code (the class's anatomy is read once).
    :meth:`check` returns the anchors (the import excluded) or raises rewrite's PatchApplicationError."""

    def __init__(self, module: cst.Module, *, relpath: str, class_name: str | None,
                 recipe: Recipe | None = None, source_bytes: bytes | None = None):
        self._planner = CapturePlanner(module, relpath, class_name, recipe or GENERIC, source_bytes)

    def check(self, positions: set[int], capture_final: bool, *, guard_bypass: bool = False) -> list[str]:
        if any(p < 0 for p in positions):
            raise ValueError(f"positions are >= 0, got {sorted(positions)}")
        return self._planner.plan(set(positions), capture_final, hooks_expr("_surgeon_hooks"),
                                  guard_bypass=guard_bypass).anchors


def check(module: cst.Module, *, relpath: str, class_name: str | None, positions: set[int],
          capture_final: bool, recipe: Recipe | None = None, source_bytes: bytes | None = None,
          guard_bypass: bool = False) -> list[str]:
    """One :class:`Checker` check."""
    return Checker(module, relpath=relpath, class_name=class_name, recipe=recipe,
                   source_bytes=source_bytes).check(positions, capture_final, guard_bypass=guard_bypass)

