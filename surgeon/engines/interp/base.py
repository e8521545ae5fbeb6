"""The state of one symbolic run and the contract between the interpreter's parts.

:class:`~surgeon.engines.interp.Interp` is assembled from four parts, each in its own module:
statement execution (:mod:`~surgeon.engines.interp.stmts`), expression evaluation
(:mod:`~surgeon.engines.interp.exprs`), call binding (:mod:`~surgeon.engines.interp.calls`) and
attribute and name resolution (:mod:`~surgeon.engines.interp.attrs`). They recurse into one another
(an expression calls a method whose statements evaluate expressions), so each part derives from
:class:`InterpBase`, which holds the run's state (heap, effects, forks) and declares the operations
one part needs from another. The declarations keep every part type-checkable on its own without
the parts importing one another.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import libcst as cst

from surgeon.engines.interp.values import Effect, Fork, Frame, FuncRef, Obj, Value, frame_line
from surgeon.engines.source.index import ClassKey, CstFunction, SourceIndex


class Hooks:
    """Engine-specific knowledge of library functions the interpreter cannot read into
    (factories that pick a class at runtime, registries). Return ``None`` to decline."""

    def call_function(self, interp: InterpBase, name: str, args: list[Value], kwargs: dict[str, Value]) -> Value | None:
        return None

    def call_method(self, interp: InterpBase, owner: ClassKey, name: str, obj: Obj | None,
                    args: list[Value], kwargs: dict[str, Value]) -> Value | None:
        return None


class InterpBase:
    """One run of a setter under fixed ``assumptions``: what it wrote (heap, effects) and what it
    could not decide (a fork not yet in ``assumptions`` stops the run with :class:`Fork`)."""

    MAX_DEPTH = 24

    def __init__(self, index: SourceIndex, hooks: Hooks, assumptions: dict) -> None:
        self.index = index
        self.hooks = hooks
        self.assumptions = assumptions
        self.heap: dict[tuple[str, str], Value] = {}
        self.effects: list[Effect] = []
        self.notes: list[str] = []
        self.labels: dict = {}
        self.depth = 0
        self.constructing = 0  # > 0 while a constructor's assignment is read: factories are followed
        self.skipped = 0  # loops the run did not follow
        self._lazy_guard: set = set()
        # constructor assignments depend on the source only: shared by every run on this index
        self._init_cache: dict[tuple[ClassKey, str], list] = index.memo.setdefault("init_assignments", {})

    # -- forks -------------------------------------------------------------------------------
    def assume(self, key: tuple, options: tuple, label: object) -> Any:
        self.labels.setdefault(key, label)
        if key in self.assumptions:
            return self.assumptions[key]
        raise Fork(key, options)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    @staticmethod
    def line(frame: Frame) -> int:
        return frame_line(frame)

    # -- operations one part needs from another (implemented by the parts) --------------------
    def eval(self, node: cst.BaseExpression, frame: Frame) -> Value:
        raise NotImplementedError  # exprs.ExpressionEvaluator

    def eval_receiver(self, node: cst.BaseExpression, frame: Frame) -> Value:
        raise NotImplementedError  # exprs.ExpressionEvaluator

    def truth(self, v: Value, node: cst.CSTNode, frame: Frame) -> bool:
        raise NotImplementedError  # exprs.ExpressionEvaluator

    def binop(self, left: Value, op: cst.BaseBinaryOp | cst.BaseAugOp, right: Value) -> Value:
        raise NotImplementedError  # exprs.ExpressionEvaluator

    def exec_block(self, body: cst.BaseSuite | Sequence[cst.CSTNode], frame: Frame) -> None:
        raise NotImplementedError  # stmts.StatementExecutor

    def store(self, recv: Value, attr: str, value: Value, frame: Frame) -> None:
        raise NotImplementedError  # stmts.StatementExecutor

    def run(self, owner: ClassKey, name: str, self_obj: Obj | None, args: list[Value], kwargs: dict[str, Value],
            on: ClassKey | None = None) -> Value:
        raise NotImplementedError  # calls.CallBinder

    def eval_call(self, node: cst.Call, frame: Frame) -> Value:
        raise NotImplementedError  # calls.CallBinder

    def get_attr(self, base: Value, attr: str) -> Value:
        raise NotImplementedError  # attrs.AttributeResolver

    def has_attr(self, obj: Obj, attr: str) -> bool | None:
        raise NotImplementedError  # attrs.AttributeResolver

    def load_attr(self, obj: Obj, attr: str) -> Value:
        raise NotImplementedError  # attrs.AttributeResolver

    def module_function(self, path: str, name: str) -> FuncRef | None:
        raise NotImplementedError  # attrs.AttributeResolver

    def function_of(self, ref: FuncRef) -> CstFunction | None:
        raise NotImplementedError  # attrs.AttributeResolver

    def lazy_local(self, name: str, frame: Frame) -> Value | None:
        raise NotImplementedError  # attrs.AttributeResolver

    def imported_binding(self, node: cst.ImportFrom, alias: cst.ImportAlias, path: str) -> Value:
        raise NotImplementedError  # attrs.AttributeResolver
