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
    Fork,
    Frame,
    FuncRef,
    IdMax,
    L,
    LayerItem,
    Lost,
    Made,
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
from surgeon.engines.source.index import ClassKey, CstFunction, code, key_str


class CallBinder(InterpBase):
    """Calls: follows methods into their bodies, binds arguments, models the builtins."""

    def call_method(self, obj: Obj, name: str, args: Sequence[Value], kwargs: dict[str, Value] | None = None) -> Value:
        target = self.load_attr(obj, name)
        return self.call_value(target, list(args), dict(kwargs or {}), f"{obj.path}.{name}", None, "")

    def run(self, owner: ClassKey, name: str, self_obj: Obj | None, args: list[Value], kwargs: dict[str, Value],
            on: ClassKey | None = None) -> Value:
        hooked = self.hooks.call_method(self, owner, name, self_obj, args, kwargs)
        if hooked is not None:
            return hooked
        fn = self.index.function(owner, name)
        if fn is None:
            return Unknown(f"cannot read {key_str(owner)}.{name}")
        frame = Frame(fn=fn, owner=owner, path=fn.path, self_obj=self_obj)
        return self._execute(frame, args, kwargs, on)

    def run_function(self, ref: FuncRef, args: list[Value], kwargs: dict[str, Value]) -> Value:
        """A module-level function of the package, followed into its body (a factory that returns
        the class or object a constructor builds). Conditions of its own body are explored here, not
        as forks of the whole run: paths that raise are dropped (the object exists, so they did not
        build it), and paths that return different things leave the result undecided."""
        fn = self.function_of(ref)
        if fn is None:
            return Unknown(f"cannot read function {ref.name} ({ref.path})")
        where = f"{ref.name} ({ref.path}:{fn.line(fn.node)})"
        notes, skipped = list(self.notes), self.skipped
        try:
            returned, forks = self._factory_paths(fn, args, kwargs)
        finally:
            self.notes[:] = notes  # what the factory's body left unread is said by its result
            unfollowed, self.skipped = self.skipped > skipped, skipped
        distinct = list(dict.fromkeys(returned))
        if unfollowed:
            return Unknown(f"result of {where}, whose loops the probe does not follow")
        if len(distinct) == 1:
            return distinct[0]
        if not distinct:
            return Unknown(f"result of {where}, which raises on every path")
        labels = "; ".join(str(self.labels.get(k, k[-1])) for k in forks)
        return Unknown(f"result of {where}, which depends on {labels}")

    FACTORY_PATHS = 16

    def _factory_paths(self, fn: CstFunction, args: list[Value], kwargs: dict[str, Value]) -> tuple[list[Value], list]:
        """What ``fn`` returns on each path through the conditions of its own body (those that
        raise left out), and the conditions it forked on."""
        pending: list[dict] = [{}]
        returned: list[Value] = []
        forks: list = []
        while pending and len(returned) + len(pending) <= self.FACTORY_PATHS:
            local, saved = pending.pop(), self.assumptions
            self.assumptions = {**saved, **local}
            try:
                returned.append(self._execute(Frame(fn=fn, owner=None, path=fn.path, self_obj=None), list(args),
                                              dict(kwargs), None))
            except Raised:
                pass
            except Fork as f:
                if f.key[:2] != ("cond", fn.label):
                    raise
                forks.append(f.key)
                pending.extend({**local, f.key: o} for o in reversed(f.options))
            finally:
                self.assumptions = saved
        if pending:  # too many paths: undecided
            returned.append(Unknown(f"more than {self.FACTORY_PATHS} paths"))
        return returned, list(dict.fromkeys(forks))

    def _execute(self, frame: Frame, args: list[Value], kwargs: dict[str, Value], on: ClassKey | None) -> Value:
        assert frame.fn is not None  # every caller builds the frame of a function it has read
        if self.depth >= self.MAX_DEPTH:
            return Unknown("call depth exceeded")
        self._bind(frame, frame.fn.node.params, frame.self_obj, args, kwargs, on)
        self.depth += 1
        try:
            self.exec_block(frame.fn.node.body, frame)
        except Returned as r:
            return r.value
        finally:
            self.depth -= 1
        return Const(None)

    def _bind(self, frame: Frame, params: cst.Parameters, self_obj: Obj | None, args: list[Value],
              kwargs: dict[str, Value], on: ClassKey | None = None) -> None:
        positional = [*params.posonly_params, *params.params]
        decorators = {code(d.decorator) for d in frame.fn.node.decorators} if frame.fn else set()
        args = list(args)
        if positional and frame.owner is not None and "staticmethod" not in decorators:  # owner None: a module function
            first = positional.pop(0)
            frame.locals[first.name.value] = _receiver(self_obj, on, "classmethod" in decorators)
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
        if isinstance(func, ClassRef):
            starred = any(a.star for a in node.args)
            args_, kwargs_ = self._arguments(node, frame)
            return self.construct(func, args_, kwargs_, starred, f"{frame.path}:{self.line(frame)}")
        args, kwargs = self._arguments(node, frame)
        if isinstance(func, Builtin):
            return self.call_builtin(func.name, node, args, kwargs, frame)
        if isinstance(func, (External, FuncRef, Unknown)) and m.matches(node.func, m.Name("get_pp_group")):
            return PPGroup()
        return self.call_value(func, args, kwargs, code(node.func), frame, frame.fn.label if frame.fn else "?")

    def _arguments(self, node: cst.Call, frame: Frame) -> tuple[list[Value], dict[str, Value]]:
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
        return args, kwargs

    def construct(self, cls: ClassRef, args: list[Value], kwargs: dict[str, Value], starred: bool, where: str) -> Obj:
        """``Cls(...)``: an object that remembers the call, so its constructor reads the arguments
        the call passed (a composite choosing its part's inner model) instead of the defaults."""
        made = Made(tuple(args), tuple(kwargs.items()), starred, where)
        return Obj(cls.cls, f"{cls.cls[1]}()", made=made, assumed=cls.assumed)

    def call_value(self, func: Value, args: list[Value], kwargs: dict[str, Value], text: str, frame: Frame | None,
                   where: str) -> Value:
        if isinstance(func, Bound):
            return self.run(func.owner, func.name, func.obj, args, kwargs, func.on)
        if isinstance(func, ClassRef):
            return self.construct(func, args, kwargs, False, f"{frame.path}:{self.line(frame)}" if frame else "?")
        if isinstance(func, FuncRef):
            hooked = self.hooks.call_function(self, func.name, args, kwargs)
            if hooked is not None:
                return hooked
            if self.constructing:  # a factory building what a constructor assigns
                return self.run_function(func, args, kwargs)
            func = External(func.name)  # elsewhere as before: a function the setter's run does not enter
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
        if name == "type" and len(args) == 1 and not kwargs and isinstance(first, Obj):
            return ClassRef(first.cls, assumed=first.assumed)  # type(self): the object's concrete class
        return Unknown(f"{name}(...)")


def _receiver(self_obj: Obj | None, on: ClassKey | None, classmethod: bool) -> Value:
    """A method's first parameter: the object, or for a classmethod its class (the concrete class
    it was called on, so ``cls.model_cls`` reads a subclass's class attribute)."""
    if classmethod:
        cls = self_obj.cls if self_obj is not None else on
        if cls is not None:
            return ClassRef(cls, assumed=self_obj.assumed if self_obj is not None else None)
        return Unknown("no cls")
    return self_obj if self_obj is not None else Unknown("no self")
