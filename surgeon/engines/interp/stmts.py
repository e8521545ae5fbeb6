"""Statement execution for the capture-setter interpreter: one symbolic pass over a function body.

Branches whose condition the values cannot decide fork (through :meth:`InterpBase.truth`); loops
are followed once, over an id list; assignments to ``self.<attr>`` and to per-layer attributes are
the :class:`Store` and :class:`FlagMark` effects the probe classifies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import libcst as cst
import libcst.matchers as m

from surgeon.engines.interp.base import InterpBase
from surgeon.engines.interp.values import (
    BreakLoop,
    Const,
    Elem,
    External,
    FlagMark,
    Frame,
    LayerItem,
    Lost,
    Obj,
    Raised,
    Returned,
    Seq,
    Site,
    Store,
    Tup,
    Unknown,
    Value,
    carries_ids,
    describe,
    known_truth,
)
from surgeon.engines.source.index import code


class StatementExecutor(InterpBase):
    """Runs statements: control flow, assignments, and the stores the setter leaves behind."""

    def exec_block(self, body: cst.BaseSuite | Sequence[cst.CSTNode], frame: Frame) -> None:
        stmts = body.body if isinstance(body, cst.BaseSuite) else body  # BaseSuite: an IndentedBlock or SimpleStatementSuite
        for stmt in stmts:
            self.exec_stmt(stmt, frame)

    def exec_stmt(self, stmt: cst.CSTNode, frame: Frame) -> None:
        frame.stmt = stmt
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                self.exec_small(small, frame)
        elif isinstance(stmt, cst.If):
            taken = self.truth(self.eval(stmt.test, frame), stmt.test, frame)
            if taken:
                self.exec_block(stmt.body, frame)
            elif isinstance(stmt.orelse, cst.If):
                self.exec_stmt(stmt.orelse, frame)
            elif isinstance(stmt.orelse, cst.Else):
                self.exec_block(stmt.orelse.body, frame)
        elif isinstance(stmt, cst.For):
            self.exec_for(stmt, frame)
        elif isinstance(stmt, cst.With):
            for item in stmt.items:
                self.eval(item.item, frame)
                if item.asname is not None:
                    self.assign(item.asname.name, Unknown("context manager"), frame)
            self.exec_block(stmt.body, frame)
        elif isinstance(stmt, cst.Try):
            try:
                self.exec_block(stmt.body, frame)
            except Raised:
                if not stmt.handlers:
                    raise
                self.exec_block(stmt.handlers[0].body, frame)
            if stmt.finalbody is not None:
                self.exec_block(stmt.finalbody.body, frame)
        elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            frame.locals[stmt.name.value] = Unknown(f"local definition {stmt.name.value}")
        elif isinstance(stmt, cst.While):
            self.skipped += 1
            self.note(f"a while loop at line {self.line(frame)} was not followed")
        elif isinstance(stmt, cst.SimpleStatementSuite):
            for small in stmt.body:
                self.exec_small(small, frame)

    def exec_small(self, small: cst.BaseSmallStatement, frame: Frame) -> None:
        if isinstance(small, cst.Expr):
            self.eval(small.value, frame)
        elif isinstance(small, cst.Assign):
            value = self.eval(small.value, frame)
            for target in small.targets:
                self.assign(target.target, value, frame)
        elif isinstance(small, cst.AnnAssign):
            if small.value is not None:
                self.assign(small.target, self.eval(small.value, frame), frame)
        elif isinstance(small, cst.AugAssign):
            value = self.binop(self.eval(small.target, frame), small.operator, self.eval(small.value, frame))
            self.assign(small.target, value, frame)
        elif isinstance(small, cst.Return):
            raise Returned(self.eval(small.value, frame) if small.value is not None else Const(None))
        elif isinstance(small, cst.Raise):
            text = code(small.exc) if small.exc is not None else "re-raise"
            raise Raised(f"raises {text} (line {self.line(frame)})")
        elif isinstance(small, cst.Assert):
            held = known_truth(self.eval(small.test, frame))
            if held is False:
                names = {cast(cst.Name, n).value for n in frame.fn.findall(m.Name(), within=small.test)} if frame.fn else set()
                known = [f"{n} is {describe(frame.locals[n])}" for n in sorted(names)
                         if isinstance(frame.locals.get(n), (Obj, Unknown))]
                raise Raised(f"fails `assert {code(small.test)}` (line {self.line(frame)})"
                             + (f": {', '.join(known)}" if known else ""))
        elif isinstance(small, cst.ImportFrom):
            if not isinstance(small.names, cst.ImportStar):
                for alias in small.names:
                    local = alias.asname.name if alias.asname else alias.name
                    if isinstance(local, cst.Name):
                        frame.locals[local.value] = self.imported_binding(small, alias, frame.path)
        elif isinstance(small, cst.Import):
            for alias in small.names:
                local = alias.asname.name if alias.asname else alias.name
                frame.locals[code(local).split(".")[0]] = External(code(local))
        elif isinstance(small, cst.Break):
            raise BreakLoop()
        # Pass, Continue, Global, Nonlocal, Del: nothing to do for a single symbolic pass

    def exec_for(self, stmt: cst.For, frame: Frame) -> None:
        it = self.eval(stmt.iter, frame)
        if isinstance(it, Seq) and isinstance(stmt.target, cst.Name):
            self.assign(stmt.target, Elem(it), frame)
            try:
                self.exec_block(stmt.body, frame)
            except BreakLoop:
                pass
        else:
            self.skipped += 1
            self.note(f"a loop at line {self.line(frame)} over {code(stmt.iter)} was not followed")

    def assign(self, target: cst.BaseExpression, value: Value, frame: Frame) -> None:
        if isinstance(target, cst.Name):
            frame.locals[target.value] = value
        elif isinstance(target, cst.Attribute):
            recv = self.eval_receiver(target.value, frame)
            self.store(recv, target.attr.value, value, frame)
        elif isinstance(target, (cst.Tuple, cst.List)):
            items = value.items if isinstance(value, Tup) and len(value.items) == len(target.elements) else None
            for i, el in enumerate(target.elements):
                self.assign(el.value, items[i] if items else Unknown("unpacked value"), frame)
        # subscripts (dict entries) carry nothing the probe needs

    def store(self, recv: Value, attr: str, value: Value, frame: Frame) -> None:
        where = frame.fn.label if frame.fn else "?"
        if isinstance(recv, Obj):
            self.heap[(recv.path, attr)] = value
            if isinstance(value, (Seq, Elem, Unknown)):
                self.effects.append(Store(recv, attr, value, Site(frame.fn, frame.stmt), where))
        elif isinstance(recv, LayerItem):
            if isinstance(recv.index, Elem) and known_truth(value) is True:
                filtered = any("skipped" in n for n in self.notes)
                self.effects.append(FlagMark(recv.holder, attr, recv.index.seq.shifted(recv.index.offset),
                                             Site(frame.fn, frame.stmt), where, filtered))
            else:
                self.note(f"line {self.line(frame)}: per-layer attribute {attr} set to something the probe cannot follow")
        elif carries_ids(value):
            self.effects.append(Lost(f"stores ids into an attribute of {describe(recv)}", Site(frame.fn, frame.stmt), where))
