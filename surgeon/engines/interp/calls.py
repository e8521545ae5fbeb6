"""Call binding for the capture-setter interpreter: methods followed into their bodies, arguments
bound to parameters, builtins modelled on symbolic values, and calls that cannot be followed.

A call that passes the ids somewhere the probe cannot read into is recorded as :class:`Lost`, so a
setter that hands its ids to a library function is reported instead of silently misread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import libcst as cst
import libcst.matchers as m

from surgeon.engines.interp.base import InterpBase
from surgeon.engines.interp.values import (
    Bound,
    Builtin,
    ClassRef,
    Const,
    External,
    Frame,
    IdMax,
    L,
    LayerItem,
    Lost,
    Obj,
    PPGroup,
    Raised,
    Returned,
    Seq,
    Site,
    Super,
    Tup,
    Unknown,
    Value,
    carries_ids,
    describe,
)
from surgeon.engines.source.index import ClassKey, code, key_str


class CallBinder(InterpBase):
    """Calls: follows methods into their bodies, binds arguments, models the builtins."""

    def call_method(self, obj: Obj, name: str, args: Sequence[Value], kwargs: dict[str, Value] | None = None) -> Value:
        target = self.load_attr(obj, name)
        return self.call_value(target, list(args), dict(kwargs or {}), f"{obj.path}.{name}", None, "")

    def run(self, owner: ClassKey, name: str, self_obj: Obj | None, args: list[Value], kwargs: dict[str, Value]) -> Value:
        hooked = self.hooks.call_method(self, owner, name, self_obj, args, kwargs)
        if hooked is not None:
            return hooked
        fn = self.index.function(owner, name)
        if fn is None:
            return Unknown(f"cannot read {key_str(owner)}.{name}")
        if self.depth >= self.MAX_DEPTH:
            return Unknown("call depth exceeded")
        frame = Frame(fn=fn, owner=owner, path=fn.path, self_obj=self_obj)
        self._bind(frame, fn.node.params, self_obj, args, kwargs)
        self.depth += 1
        try:
            self.exec_block(fn.node.body, frame)
        except Returned as r:
            return r.value
        finally:
            self.depth -= 1
        return Const(None)

    def _bind(self, frame: Frame, params: cst.Parameters, self_obj: Obj | None, args: list[Value],
              kwargs: dict[str, Value]) -> None:
        positional = [*params.posonly_params, *params.params]
        decorators = {code(d.decorator) for d in frame.fn.node.decorators} if frame.fn else set()
        args = list(args)
        if positional and "staticmethod" not in decorators:
            first = positional.pop(0)
            frame.locals[first.name.value] = self_obj if self_obj is not None else Unknown("no self")
        for p in positional:
            pname = p.name.value
            if args:
                frame.locals[pname] = args.pop(0)
            elif pname in kwargs:
                frame.locals[pname] = kwargs.pop(pname)
            elif p.default is not None:
                frame.locals[pname] = self.eval(p.default, Frame(None, None, frame.path, None))
            else:
                frame.locals[pname] = Unknown(f"argument {pname} not given")
        if isinstance(params.star_arg, cst.Param):
            frame.locals[params.star_arg.name.value] = Tup(tuple(args))
        for p in params.kwonly_params:
            pname = p.name.value
            if pname in kwargs:
                frame.locals[pname] = kwargs.pop(pname)
            elif p.default is not None:
                frame.locals[pname] = self.eval(p.default, Frame(None, None, frame.path, None))
            else:
                frame.locals[pname] = Unknown(f"argument {pname} not given")
        if params.star_kwarg is not None:
            frame.locals[params.star_kwarg.name.value] = Unknown("**kwargs")

    def eval_call(self, node: cst.Call, frame: Frame) -> Value:
        func = self.eval(node.func, frame)
        args: list[Value] = []
        kwargs: dict[str, Value] = {}
        for a in node.args:
            if a.star:
                args.append(Unknown("*args"))
                continue
            v = self.eval(a.value, frame)
            if a.keyword is not None:
                kwargs[a.keyword.value] = v
            else:
                args.append(v)
        if isinstance(func, Builtin):
            return self.call_builtin(func.name, node, args, kwargs, frame)
        if isinstance(func, (External, Unknown)) and m.matches(node.func, m.Name("get_pp_group")):
            return PPGroup()
        return self.call_value(func, args, kwargs, code(node.func), frame, frame.fn.label if frame.fn else "?")

    def call_value(self, func: Value, args: list[Value], kwargs: dict[str, Value], text: str, frame: Frame | None,
                   where: str) -> Value:
        if isinstance(func, Bound):
            return self.run(func.owner, func.name, func.obj, args, kwargs)
        if isinstance(func, ClassRef):
            return Obj(func.cls, f"{func.cls[1]}()")
        if isinstance(func, (External, Unknown)):
            name = func.name if isinstance(func, External) else text.split(".")[-1]
            hooked = self.hooks.call_function(self, name, args, kwargs)
            if hooked is not None:
                return hooked
        if any(carries_ids(v) for v in [*args, *kwargs.values()]):
            self.effects.append(Lost(f"passes ids to {text}, which the probe cannot follow ({describe(func)})",
                                     Site(frame.fn, frame.stmt) if frame else Site(None, None), where))
        if isinstance(func, Unknown) and not func.why.startswith("name "):
            return Unknown(f"result of {text}, {func.why}" if not func.why.startswith("result of") else func.why)
        return Unknown(f"result of {text}")

    def call_builtin(self, name: str, node: cst.Call, args: list[Value], kwargs: dict[str, Value], frame: Frame) -> Value:
        first = args[0] if args else None
        if name in ("list", "tuple", "iter", "reversed") and len(args) == 1:
            if isinstance(first, Seq):
                return first if name != "reversed" else Unknown("reversed ids")
            return first if isinstance(first, Tup) else Unknown(f"{name}(...)")
        if name == "sorted" and len(args) == 1 and not kwargs:
            return replace(first, sorted=True) if isinstance(first, Seq) else Unknown("sorted(...)")
        if name in ("set", "frozenset") and len(args) == 1:
            return replace(first, dedup=True) if isinstance(first, Seq) else Unknown("set(...)")
        if name == "len" and len(node.args) == 1:
            if m.matches(node.args[0].value, m.Attribute(attr=m.Name("layers"))):
                return L
            return Unknown("len(...)")
        if name == "max" and len(args) == 1 and isinstance(first, Seq) and first.explicit:
            return IdMax(first.offset)
        if name == "hasattr" and len(args) == 2 and isinstance(args[1], Const):
            if isinstance(first, Obj):
                return Const(bool(self.has_attr(first, args[1].value)))
            if isinstance(first, Const) and first.value is None:
                return Const(False)
            return first if isinstance(first, Unknown) else Unknown("hasattr")
        if name == "getattr" and len(args) >= 2 and isinstance(args[1], Const):
            if isinstance(first, Obj):
                if self.has_attr(first, args[1].value):
                    return self.load_attr(first, args[1].value)
                if len(args) == 3:
                    return args[2]
                raise Raised(f"AttributeError: {first.cls[1]} has no {args[1].value} (line {self.line(frame)})")
            if isinstance(first, LayerItem):
                return Unknown("per-layer attribute")
            return first if isinstance(first, Unknown) else Unknown("getattr")
        if name == "setattr" and len(args) == 3 and isinstance(args[1], Const):
            recv = self.eval_receiver(node.args[0].value, frame)
            self.store(recv, args[1].value, args[2], frame)
            return Const(None)
        if name == "isinstance" and len(args) == 2 and isinstance(first, Obj):
            classes = args[1].items if isinstance(args[1], Tup) else (args[1],)
            refs = [c for c in classes if isinstance(c, ClassRef)]
            if len(refs) == len(classes):
                mro = self.index.mro(first.cls)
                return Const(any(c.cls in mro for c in refs))
            return Unknown("isinstance against a class outside the package")
        if name == "super":
            if frame.self_obj is not None and frame.owner is not None:
                return Super(frame.self_obj, frame.owner)
            return Unknown("super()")
        if name == "print":
            return Const(None)
        return Unknown(f"{name}(...)")
