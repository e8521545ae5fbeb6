"""Expression evaluation for the capture-setter interpreter, on symbolic values.

Arithmetic on the layer count stays linear (:class:`Lin`), comparisons against the ids become
:class:`Pred` conditions of the id rule, and a truth value the values cannot decide becomes a
fork of the run.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import TypeGuard

import libcst as cst
import libcst.matchers as m

from surgeon.core.idrules import FirstIdEquals, MaxIdEquals
from surgeon.engines.interp.base import InterpBase
from surgeon.engines.interp.values import (
    Builtin,
    ClassRef,
    Const,
    Elem,
    External,
    ForkLabel,
    Frame,
    IdItem,
    IdMax,
    L,
    LayerItem,
    Lin,
    ModuleRef,
    Obj,
    PPGroup,
    Pred,
    Seq,
    Tup,
    Unknown,
    Value,
    describe,
    known_truth,
    lin_or_const,
)
from surgeon.engines.source.index import code

_BUILTINS = {"list", "tuple", "sorted", "set", "len", "hasattr", "getattr", "setattr", "isinstance",
             "max", "min", "super", "int", "print", "any", "all", "range", "enumerate", "zip",
             "iter", "next", "callable", "type", "frozenset", "reversed", "str", "bool"}


def _layers_attribute(node: cst.BaseExpression) -> TypeGuard[cst.Attribute]:
    """``<holder>.layers``; a TypeGuard so the caller can read the holder as ``node.value``."""
    return m.matches(node, m.Attribute(attr=m.Name("layers")))


class ExpressionEvaluator(InterpBase):
    """Expressions: names, literals, arithmetic, comparisons, subscripts, comprehensions."""

    def eval_receiver(self, node: cst.BaseExpression, frame: Frame) -> Value:
        """Like eval, but ``x.layers[i]`` becomes a :class:`LayerItem` of ``x``."""
        if isinstance(node, cst.Subscript) and _layers_attribute(node.value):
            holder = self.eval(node.value.value, frame)
            if isinstance(holder, Obj) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
                return LayerItem(holder, self.eval(node.slice[0].slice.value, frame))
        return self.eval(node, frame)

    def eval(self, node: cst.BaseExpression, frame: Frame) -> Value:
        if isinstance(node, cst.Name):
            return self.lookup(node.value, frame)
        if isinstance(node, cst.Integer):
            return Const(int(node.value, 0))
        if isinstance(node, (cst.SimpleString, cst.ConcatenatedString)):
            try:
                return Const(node.evaluated_value)
            except Exception:
                return Unknown("string")
        if isinstance(node, cst.Attribute):
            return self.eval_attribute(node, frame)
        if isinstance(node, cst.Call):
            return self.eval_call(node, frame)
        if isinstance(node, cst.Subscript):
            return self.eval_subscript(node, frame)
        if isinstance(node, cst.BinaryOperation):
            return self.binop(self.eval(node.left, frame), node.operator, self.eval(node.right, frame))
        if isinstance(node, cst.UnaryOperation):
            v = self.eval(node.expression, frame)
            if isinstance(node.operator, cst.Not):
                return Const(not self.truth(v, node.expression, frame))
            if isinstance(node.operator, cst.Minus):
                lin = Lin.of(v)
                if lin is not None and lin.mul == 0:
                    return Const(-lin.add)
            return Unknown(f"operator in {code(node)}")
        if isinstance(node, cst.BooleanOperation):
            left = self.eval(node.left, frame)
            t = self.truth(left, node.left, frame)
            if isinstance(node.operator, cst.And):
                return self.eval(node.right, frame) if t else left
            return left if t else self.eval(node.right, frame)
        if isinstance(node, cst.Comparison):
            return self.eval_comparison(node, frame)
        if isinstance(node, cst.IfExp):
            if self.truth(self.eval(node.test, frame), node.test, frame):
                return self.eval(node.body, frame)
            return self.eval(node.orelse, frame)
        if isinstance(node, (cst.List, cst.Tuple, cst.Set)):
            return self.eval_literal(node, frame)
        if isinstance(node, (cst.ListComp, cst.SetComp, cst.GeneratorExp)):
            return self.eval_comprehension(node, frame)
        return Unknown(f"expression {code(node)[:60]}")

    def lookup(self, name: str, frame: Frame) -> Value:
        if name in frame.locals:
            return frame.locals[name]
        if name in ("None", "True", "False"):
            return Const({"None": None, "True": True, "False": False}[name])
        if frame.lazy and frame.fn is not None:
            found = self.lazy_local(name, frame)
            if found is not None:
                return found
        resolved = self.index.resolve(frame.path, name)
        if isinstance(resolved, tuple):
            return ClassRef(resolved)
        if isinstance(resolved, str):
            return ModuleRef(resolved)
        mod = self.index.module(frame.path)
        if mod is not None:
            function = self.module_function(frame.path, name)
            if function is not None:
                return function
            if name in mod.imports:
                return External(name)
            if name in mod.assigns:
                guard = (frame.path, name)
                if guard not in self._lazy_guard:
                    expr = self.index.expression(frame.path, mod.assigns[name])
                    if expr is not None:
                        self._lazy_guard.add(guard)
                        try:
                            return self.eval(expr, Frame(None, None, frame.path, None))
                        finally:
                            self._lazy_guard.discard(guard)
        if name in _BUILTINS:
            return Builtin(name)
        return Unknown(f"name {name}")

    def eval_attribute(self, node: cst.Attribute, frame: Frame) -> Value:
        attr = node.attr.value
        if attr == "num_hidden_layers":
            return L  # the layer count, whichever config object carries it
        if attr == "pp_group":
            return PPGroup()
        base = self.eval(node.value, frame)
        return self.get_attr(base, attr)

    def eval_subscript(self, node: cst.Subscript, frame: Frame) -> Value:
        if _layers_attribute(node.value):
            holder = self.eval(node.value.value, frame)
            if isinstance(holder, Obj) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
                return LayerItem(holder, self.eval(node.slice[0].slice.value, frame))
        base = self.eval(node.value, frame)
        if len(node.slice) != 1 or not isinstance(node.slice[0].slice, cst.Index):
            return Unknown("slice")
        index = self.eval(node.slice[0].slice.value, frame)
        if isinstance(index, Elem) and not isinstance(base, (Seq, Tup)):
            self.note(f"the ids index `{code(node.value)}` (line {self.line(frame)}), which the probe does not follow")
        if isinstance(base, Seq) and isinstance(index, Const) and isinstance(index.value, int):
            if base.explicit:
                return IdItem(index.value, base.offset)
            if base.terms is not None and -len(base.terms) <= index.value < len(base.terms):
                return base.terms[index.value]
        if isinstance(base, Tup) and isinstance(index, Const) and isinstance(index.value, int):
            if -len(base.items) <= index.value < len(base.items):
                return base.items[index.value]
        return Unknown(f"subscript {code(node)[:60]}")

    def binop(self, left: Value, op: cst.BaseBinaryOp | cst.BaseAugOp, right: Value) -> Value:
        name = type(op).__name__.replace("Assign", "")
        if isinstance(left, Elem) and isinstance(right, Const) and isinstance(right.value, int):
            if name == "Add":
                return Elem(left.seq, left.offset + right.value)
            if name == "Subtract":
                return Elem(left.seq, left.offset - right.value)
        if isinstance(right, Elem) and isinstance(left, Const) and isinstance(left.value, int) and name == "Add":
            return Elem(right.seq, right.offset + left.value)
        a, b = Lin.of(left), Lin.of(right)
        if a is not None and b is not None:
            if name == "Add" and (a.mul == 0 or b.mul == 0):
                lin, k = (a, b.add) if b.mul == 0 else (b, a.add)
                return lin_or_const(lin.shifted(k))
            if name == "Subtract" and b.mul == 0:
                return lin_or_const(a.shifted(-b.add))
            if name == "Multiply" and (a.mul == 0 or b.mul == 0):
                lin, k = (a, b.add) if b.mul == 0 else (b, a.add)
                if lin.div == 1 and lin.add == 0:
                    return lin_or_const(Lin(lin.mul * k, 1, 0))
                if lin.mul == 0:
                    return Const(lin.add * k)
            if name == "FloorDivide" and b.mul == 0 and b.add > 0:
                if a.mul == 0:
                    return Const(a.add // b.add)
                if a.div == 1 and a.add == 0:
                    return Lin(a.mul, b.add, 0)
        if isinstance(left, Const) and isinstance(right, Const):
            try:
                ops = {"Add": operator.add, "Subtract": operator.sub, "Multiply": operator.mul,
                       "FloorDivide": operator.floordiv, "Modulo": operator.mod}
                if name in ops:
                    return Const(ops[name](left.value, right.value))
            except Exception:
                pass
        return Unknown("arithmetic")

    def eval_comparison(self, node: cst.Comparison, frame: Frame) -> Value:
        left = self.eval(node.left, frame)
        result: Value = Const(True)
        for target in node.comparisons:
            right = self.eval(target.comparator, frame)
            r = self.compare(left, target.operator, right, frame)
            if isinstance(result, Const) and result.value is True:
                result = r
            elif isinstance(r, Const) and r.value is True:
                pass
            else:
                result = Const(bool(self.truth(result, node, frame) and self.truth(r, node, frame)))
            left = right
        return result

    def compare(self, left: Value, op: cst.BaseCompOp, right: Value, frame: Frame) -> Value:
        if isinstance(op, (cst.Is, cst.IsNot)):
            if isinstance(left, Unknown) or isinstance(right, Unknown):
                return Unknown("identity test")
            if isinstance(left, ClassRef) and isinstance(right, ClassRef):
                return Const((left == right) == isinstance(op, cst.Is))
            same = left == right if isinstance(left, Const) and isinstance(right, Const) else (
                False if (isinstance(left, Const) or isinstance(right, Const)) else None)
            if same is None:
                return Unknown("identity test")
            return Const(same if isinstance(op, cst.Is) else not same)
        if isinstance(op, (cst.Equal, cst.NotEqual)):
            negated = isinstance(op, cst.NotEqual)
            for a, b in ((left, right), (right, left)):
                if isinstance(a, IdItem) and a.index == 0 and isinstance(b, Const) and isinstance(b.value, int):
                    return Pred(FirstIdEquals(b.value - a.offset), negated)
                if isinstance(a, IdMax) and (lin := Lin.of(b)) is not None:
                    return Pred(MaxIdEquals(lin.shifted(-a.offset).term()), negated)
            if isinstance(left, (Const, Lin)) and isinstance(right, (Const, Lin)):
                if left == right:
                    return Const(not negated)
                if isinstance(left, Const) and isinstance(right, Const):
                    return Const((left.value == right.value) != negated)
            return Unknown("equality")
        if isinstance(op, (cst.LessThan, cst.LessThanEqual, cst.GreaterThan, cst.GreaterThanEqual)):
            if isinstance(left, Elem) or isinstance(right, Elem):
                self.note(f"ids outside a range test are skipped (line {self.line(frame)})")
                return Const(True)
            if isinstance(left, Const) and isinstance(right, Const):
                try:
                    fn = {cst.LessThan: operator.lt, cst.LessThanEqual: operator.le,
                          cst.GreaterThan: operator.gt, cst.GreaterThanEqual: operator.ge}[type(op)]
                    return Const(fn(left.value, right.value))
                except Exception:
                    return Unknown("ordering")
            return Unknown("ordering")
        if isinstance(op, (cst.In, cst.NotIn)):
            if isinstance(right, Tup) and isinstance(left, Const) and all(isinstance(i, Const) for i in right.items):
                inside = any(left == i for i in right.items)
                return Const(inside if isinstance(op, cst.In) else not inside)
            return Unknown("membership")
        return Unknown("comparison")

    def truth(self, v: Value, node: cst.CSTNode, frame: Frame) -> bool:
        if isinstance(v, Pred):
            held = self.assume(("pred", v.cond), (True, False), str(v.cond))
            return held != v.negated
        t = known_truth(v)
        if t is None:
            where = frame.fn.label if frame.fn else frame.path
            order = frame.fn.order(node) if frame.fn else 0
            t = self.assume(("cond", where, order, code(node)), (True, False), ForkLabel(node, frame.fn, where))
        return t

    def eval_literal(self, node: cst.List | cst.Tuple | cst.Set, frame: Frame) -> Value:
        items: list[Value] = []
        for el in node.elements:
            if isinstance(el, cst.StarredElement):
                return Unknown("starred element")
            items.append(self.eval(el.value, frame))
        lins = [lin for v in items if (lin := Lin.of(v)) is not None]
        if len(lins) == len(items):  # every item is a layer index
            return Seq(terms=tuple(lins), dedup=isinstance(node, cst.Set))
        return Tup(tuple(items))

    def eval_comprehension(self, node: cst.ListComp | cst.SetComp | cst.GeneratorExp, frame: Frame) -> Value:
        comp = node.for_in
        if comp.ifs or comp.inner_for_in is not None or not isinstance(comp.target, cst.Name):
            return Unknown(f"comprehension {code(node)[:60]}")
        it = self.eval(comp.iter, frame)
        if not isinstance(it, Seq):
            return Unknown(f"comprehension over {describe(it)}")
        inner = Frame(frame.fn, frame.owner, frame.path, frame.self_obj, dict(frame.locals), frame.stmt, frame.lazy)
        inner.locals[comp.target.value] = Elem(it)
        elt = self.eval(node.elt, inner)
        if isinstance(elt, Elem) and elt.seq == it:
            out = it.shifted(elt.offset)
            return replace(out, dedup=True) if isinstance(node, cst.SetComp) else out
        return Unknown(f"comprehension {code(node)[:60]}")
