"""Attribute and name resolution for the capture-setter interpreter.

``self.<attr>`` is what the constructors of the object's class hierarchy assign (a subclass's
``super().__init__(...)`` arguments included); several possible classes fork the run. Names
imported inside a function resolve to the package's classes and modules, and in a constructor an
unassigned local is read from its last assignment (lazy frames).
"""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from typing import Any

import libcst as cst
import libcst.matchers as m

from surgeon.engines.interp.base import InterpBase
from surgeon.engines.interp.values import (
    Bound,
    ClassRef,
    Const,
    External,
    Frame,
    FuncRef,
    Made,
    ModuleRef,
    Obj,
    PPGroup,
    Super,
    Unknown,
    Value,
    assuming,
    describe,
    walk_statements,
)
from surgeon.engines.source.index import ClassKey, CstFunction, code


class AttributeResolver(InterpBase):
    """Attributes of objects, classes, modules and the pipeline group; imports and lazy locals."""

    def imported_binding(self, node: cst.ImportFrom, alias: cst.ImportAlias, path: str) -> Value:
        """What ``from X import name`` inside a function binds: a class of the package if it is one."""
        dots = len(node.relative)
        module = code(node.module) if node.module is not None else ""
        if dots:
            parts = self.index.dotted_of(path).split(".")
            if not path.endswith("__init__.py"):
                parts = parts[:-1]
            parts = parts[: len(parts) - (dots - 1)]
            module = ".".join([*parts, *([module] if module else [])])
        name = code(alias.name)
        target = self.index.path_of(module)
        if target is not None:
            r = self.index.resolve(target, name)
            if isinstance(r, tuple):
                return ClassRef(r)
            if isinstance(r, str):
                return ModuleRef(r)
        sub = self.index.path_of(f"{module}.{name}")
        return ModuleRef(sub) if sub else External(name)

    def module_function(self, path: str, name: str) -> FuncRef | None:
        """``name`` at the top level of ``path`` as a function of the package: defined there, or
        imported from a package module that defines it (the import followed, re-exports included)."""
        memo = self.index.memo.setdefault("module_functions", {})
        key = (path, name)
        if key not in memo:
            memo[key] = None  # a cycle of imports finds nothing
            memo[key] = self._find_module_function(path, name)
        return memo[key]

    def _find_module_function(self, path: str, name: str) -> FuncRef | None:
        mod = self.index.module(path)
        if mod is None:
            return None
        if any(isinstance(n, ast.FunctionDef) and n.name == name for n in mod.tree.body):
            return FuncRef(path, name)
        if name in mod.imports:
            dotted, attr = mod.imports[name]
            target = self.index.path_of(dotted) if attr is not None else None
            if target is not None:
                return self.module_function(target, attr or name)
        return None

    def function_of(self, ref: FuncRef) -> CstFunction | None:
        """The module-level function ``ref`` parsed with libcst (once per index)."""
        memo = self.index.memo.setdefault("module_function_trees", {})
        if (ref.path, ref.name) not in memo:
            memo[(ref.path, ref.name)] = self._parse_module_function(ref)
        return memo[(ref.path, ref.name)]

    def _parse_module_function(self, ref: FuncRef) -> CstFunction | None:
        mod = self.index.module(ref.path)
        node = next((n for n in mod.tree.body if isinstance(n, ast.FunctionDef) and n.name == ref.name), None) if mod else None
        if mod is None or node is None:
            return None
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        try:
            module = cst.parse_module("".join(mod.lines[start - 1 : node.end_lineno or node.lineno]))
        except cst.ParserSyntaxError:
            return None
        fdef = module.body[0] if module.body else None
        if not isinstance(fdef, cst.FunctionDef):
            return None
        return CstFunction((ref.path, "<module>"), ref.path, ref.name, module, fdef, start - 1, node)

    def lazy_local(self, name: str, frame: Frame) -> Value | None:
        """The value of local ``name`` from its last assignment before ``frame.line``."""
        assert frame.fn is not None
        fn = frame.fn
        here = fn.order(frame.stmt) if frame.stmt is not None else len(fn._all)
        best: cst.Assign | None = None
        for stmt in walk_statements(fn.node.body):
            if isinstance(stmt, cst.ImportFrom) and fn.order(stmt) < here and not isinstance(stmt.names, cst.ImportStar):
                for alias in stmt.names:
                    local = alias.asname.name if alias.asname else alias.name
                    if m.matches(local, m.Name(name)):
                        return self.imported_binding(stmt, alias, frame.path)
            if isinstance(stmt, cst.Assign) and fn.order(stmt) < here:
                if any(m.matches(t.target, m.Name(name)) for t in stmt.targets):
                    best = stmt
        if best is None:
            params = frame.fn.node.params
            if any(p.name.value == name for p in [*params.params, *params.kwonly_params, *params.posonly_params]):
                return Unknown(f"constructor argument {name}")
            return None
        guard = (fn.label, name, fn.order(best))
        if guard in self._lazy_guard:
            return Unknown(f"recursive local {name}")
        self._lazy_guard.add(guard)
        saved = frame.stmt
        try:
            frame.stmt = best
            return self.eval(best.value, frame)
        finally:
            frame.stmt = saved
            self._lazy_guard.discard(guard)

    def get_attr(self, base: Value, attr: str) -> Value:
        if isinstance(base, Obj):
            if attr == "__class__":  # self.__class__: the object's concrete class
                return ClassRef(base.cls, assumed=base.assumed)
            return self.load_attr(base, attr)
        if isinstance(base, PPGroup):
            if attr in ("is_first_rank", "is_last_rank"):
                return Const(True)
            if attr == "world_size":
                return Const(1)
            if attr in ("rank", "rank_in_group"):
                return Const(0)
            return Unknown(f"pp_group.{attr}")
        if isinstance(base, Super):
            found = self.index.find_function(base.obj.cls, attr, after=base.after)
            if found is not None:
                return Bound(base.obj, found[0], attr)
            return Unknown(f"super().{attr}")
        if isinstance(base, ClassRef):
            found = self.index.find_function(base.cls, attr)
            if found is not None:
                return Bound(None, found[0], attr, on=base.cls)
            assigned = self.index.find_class_assign(base.cls, attr)  # along the MRO of base, the concrete class
            if assigned is not None:
                return assuming(self._eval_class_level(assigned[0], assigned[1]), base.assumed)
            return Unknown(f"{base.cls[1]}.{attr}")
        if isinstance(base, ModuleRef):
            resolved = self.index.resolve(base.path, attr)
            if isinstance(resolved, tuple):
                return ClassRef(resolved)
            return self.module_function(base.path, attr) or External(attr)
        return Unknown(f"attribute {attr} of {describe(base)}")

    def has_attr(self, obj: Obj, attr: str) -> bool | None:
        if (obj.path, attr) in self.heap:
            return True
        for k in self.index.mro(obj.cls):
            info = self.index.class_info(k)
            if info is None:
                continue
            if attr in info.functions or attr in info.class_assigns:
                return True
            if self._init_mentions(k, attr):
                return True
        return False

    def load_attr(self, obj: Obj, attr: str) -> Value:
        """``obj.<attr>``: what the run stored, else along the MRO of the object's concrete class (a
        method, a constructor's assignment, a class attribute). What an object resting on an assumed
        default holds rests on it too."""
        if (obj.path, attr) in self.heap:
            return self.heap[(obj.path, attr)]
        return assuming(self._load_declared(obj, attr), obj.assumed)

    def _load_declared(self, obj: Obj, attr: str) -> Value:
        for k in self.index.mro(obj.cls):
            info = self.index.class_info(k)
            if info is None:
                continue
            if attr in info.functions:
                if info.functions[attr].is_property:
                    return self.run(k, attr, obj, [], {})
                return Bound(obj, k, attr)
            candidates = self._init_assignments(k, attr)
            if candidates:
                return self._pick(obj, k, attr, candidates)
            if attr in info.class_assigns:
                value = self._eval_class_level(k, info.class_assigns[attr])
                return _repath(value, f"{obj.path}.{attr}")
        return Unknown(f"{obj.cls[1]} has no attribute {attr} the probe can see")

    def _eval_class_level(self, owner: ClassKey, node: Any) -> Value:
        expr = self.index.expression(owner[0], node)
        if expr is None:
            return Unknown("unreadable class attribute")
        return self.eval(expr, Frame(None, owner, owner[0], None))

    def _constructors(self, owner: ClassKey) -> list[str]:
        """``__init__`` and the methods it calls on ``self`` (``self._init_layers(...)``)."""
        info = self.index.class_info(owner)
        if info is None or "__init__" not in info.functions:
            return []
        text = self.index.function_text(owner, info.functions["__init__"])
        called = [n for n in info.functions if n != "__init__" and f"self.{n}(" in text]
        return ["__init__", *called]

    def _init_mentions(self, owner: ClassKey, attr: str) -> list[str]:
        """Constructor methods of ``owner`` that assign ``self.<attr>``."""
        info = self.index.class_info(owner)
        if info is None:
            return []
        pattern = re.compile(rf"self\.{re.escape(attr)}\s*(?::[^=\n]*)?=(?!=)")
        return [n for n in self._constructors(owner)
                if pattern.search(self.index.function_text(owner, info.functions[n]))]

    def _init_assignments(self, owner: ClassKey, attr: str) -> list[tuple[CstFunction, cst.BaseExpression, cst.CSTNode]]:
        key = (owner, attr)
        if key in self._init_cache:
            return self._init_cache[key]
        found: list[tuple[CstFunction, cst.BaseExpression, cst.CSTNode]] = []
        for name in self._init_mentions(owner, attr):
            fn = self.index.function(owner, name)
            if fn is None:
                continue
            target = m.Attribute(value=m.Name("self"), attr=m.Name(attr))
            for stmt in walk_statements(fn.node.body):
                if isinstance(stmt, cst.Assign) and any(m.matches(t.target, target) for t in stmt.targets):
                    found.append((fn, stmt.value, stmt))
                elif isinstance(stmt, cst.AnnAssign) and stmt.value is not None and m.matches(stmt.target, target):
                    found.append((fn, stmt.value, stmt))
                elif isinstance(stmt, cst.Assign) and any(
                    isinstance(t.target, cst.Tuple) and any(m.matches(e.value, target) for e in t.target.elements)
                    for t in stmt.targets
                ):
                    found.append((fn, cst.Name("__unpacked__"), stmt))
        self._init_cache[key] = found
        return found

    def _pick(self, obj: Obj, owner: ClassKey, attr: str, candidates: list) -> Value:
        values: list[Value] = []
        for fn, expr, stmt in candidates:
            if m.matches(expr, m.Name("__unpacked__")):
                values.append(Unknown(f"{attr} comes from tuple unpacking"))
                continue
            frame = self._constructor_frame(obj, owner, fn, stmt)
            self.constructing += 1
            try:
                v = self.eval(expr, frame)
            finally:
                self.constructing -= 1
            if isinstance(v, Const) and v.value is None:
                continue  # "not built in this configuration"; the other assignment is the class
            values.append(_repath(v, f"{obj.path}.{attr}"))
        distinct: list[Value] = []
        for v in values:
            if v not in distinct:
                distinct.append(v)
        if not distinct:
            return Const(None)
        if len(distinct) == 1:
            return distinct[0]
        labels = ", ".join(describe(v) for v in distinct)
        choice = self.assume(("attr", obj.cls, attr), tuple(range(len(distinct))),
                             f"{obj.cls[1]}.{attr} may be any of {labels}")
        return distinct[choice]

    def _constructor_frame(self, obj: Obj, owner: ClassKey, fn: CstFunction, stmt: cst.CSTNode) -> Frame:
        """A frame of ``owner.__init__`` for an object of class ``obj.cls``: arguments come from the
        call that built the object (:attr:`Obj.made`) and from a subclass's ``super().__init__(...)``;
        the others take their defaults. An object the engine builds (``made`` None: the probed
        class, or one its registry builds) gets only the engine's fixed keywords (the config, the
        quantisation config, the prefix), so its defaults hold; a default that a ``*args``/``**kwargs``
        the probe cannot expand may override is marked as assumed (:func:`assuming`)."""
        frame = Frame(fn=fn, owner=owner, path=fn.path, self_obj=obj, stmt=stmt, lazy=True)
        params = fn.node.params
        named = [*params.posonly_params, *params.params]
        frame.locals[named[0].name.value if named else "self"] = obj
        positional = [p.name.value for p in named[1:]]
        passed = self._super_init_args(obj, owner, positional)
        unread = self._unread_arguments(obj, owner)
        if owner == self._first_init(obj.cls) and obj.made is not None:
            passed.update(_call_arguments(obj.made, positional, {p.name.value for p in params.kwonly_params}))
        for p in [*named[1:], *params.kwonly_params]:
            pname = p.name.value
            if pname in passed:
                frame.locals[pname] = passed[pname]
            elif p.default is not None:
                why = (f"rests on the default of {pname} ({fn.path}:{fn.line(p)}): {unread}, "
                       "and a caller passing another class is not read") if unread else None
                frame.locals[pname] = assuming(self.eval(p.default, Frame(None, owner, fn.path, None)), why)
            else:
                frame.locals[pname] = Unknown(f"constructor argument {pname}")
        return frame

    def _first_init(self, cls: ClassKey) -> ClassKey | None:
        """The class whose ``__init__`` a call of ``cls`` runs (the first in its MRO that defines one)."""
        return next((k for k in self.index.mro(cls) if self._defines_init(k)), None)

    def _unread_arguments(self, obj: Obj, owner: ClassKey) -> str | None:
        """Why an argument reaching ``owner.__init__`` may be one the probe did not read: the call
        that built ``obj`` passes ``*x``/``**x``, or it passes arguments and a constructor between
        its class and ``owner`` forwards ``*args``/``**kwargs`` up. None: every argument was read
        (an object the engine builds forwards only the engine's fixed keywords)."""
        if obj.made is None:
            return None
        if obj.made.starred:
            return f"the call at {obj.made.where} passes *args/**kwargs"
        if not (obj.made.args or obj.made.kwargs):
            return None
        mro = self.index.mro(obj.cls)
        for k in mro[: mro.index(owner)] if owner in mro else []:
            fn = self.index.function(k, "__init__") if self._defines_init(k) else None
            call = m.Call(func=m.Attribute(attr=m.Name("__init__")), args=[m.ZeroOrMore(), m.Arg(star=m.MatchIfTrue(bool)),
                                                                          m.ZeroOrMore()])
            if fn is not None and fn.findall(call):
                return f"{k[1]}.__init__ forwards *args/**kwargs of the call at {obj.made.where}"
        return None

    def _super_init_args(self, obj: Obj, owner: ClassKey, positional: list[str]) -> dict[str, Value]:
        """Arguments the subclasses of ``owner`` (in ``obj``'s MRO) pass up through
        ``super().__init__(...)``, evaluated in their own constructors: by keyword, and by position
        (``positional``: ``owner.__init__``'s positional parameters after ``self``) from the subclass
        whose ``super().__init__`` is ``owner``'s (a class passing its own language-model class to the
        parent's constructor positionally chooses the inner model as surely as by keyword)."""
        out: dict[str, Value] = {}
        mro = self.index.mro(obj.cls)
        if owner not in mro:
            return out
        below = mro[: mro.index(owner)]
        for i, k in enumerate(below):
            calls_owner = not any(self._defines_init(x) for x in below[i + 1:])  # k's super().__init__ is owner's
            info = self.index.class_info(k)
            if info is None or "__init__" not in info.functions:
                continue
            if "__init__(" not in self.index.function_text(k, info.functions["__init__"]).split(":", 1)[-1]:
                continue
            fn = self.index.function(k, "__init__")
            if fn is None:
                continue
            call = m.Call(func=m.Attribute(value=m.OneOf(m.Call(func=m.Name("super")), m.Name()), attr=m.Name("__init__")))
            for c in fn.findall(call):
                assert isinstance(c, cst.Call)  # the matcher above matches only calls; this tells the type checker
                frame = self._constructor_frame(obj, k, fn, c) if (obj.cls, k) not in self._lazy_guard else None
                if frame is None:
                    continue
                self._lazy_guard.add((obj.cls, k))
                try:
                    for a in c.args:
                        if a.keyword is not None and a.keyword.value not in out:
                            out[a.keyword.value] = self.eval(a.value, frame)
                    by_position = [a for a in c.args if a.keyword is None]
                    explicit = not m.matches(c.func, m.Attribute(value=m.Call(func=m.Name("super"))))
                    if explicit:  # Parent.__init__(self, ...): the first argument is the object
                        by_position = by_position[1:]
                    to_owner = (m.matches(c.func, m.Attribute(value=m.Name(owner[1]))) if explicit
                                else calls_owner)  # the call that reaches owner's __init__, no other
                    if to_owner and not any(a.star for a in by_position):
                        for pname, a in zip(positional, by_position):
                            out.setdefault(pname, self.eval(a.value, frame))
                finally:
                    self._lazy_guard.discard((obj.cls, k))
        return out

    def _defines_init(self, key: ClassKey) -> bool:
        info = self.index.class_info(key)
        return info is not None and "__init__" in info.functions


def _repath(v: Value, path: str) -> Value:
    return replace(v, path=path) if isinstance(v, Obj) else v


def _call_arguments(made: Made, positional: list[str], kwonly: set[str]) -> dict[str, Value]:
    """The parameters of the constructor a call ran (``positional``: its positional parameters
    after ``self``; ``kwonly``: its keyword-only ones) bound to the call's arguments. Starred
    arguments are not expanded (the caller says so: :meth:`AttributeResolver._unread_arguments`)."""
    out: dict[str, Value] = {}
    if not made.starred:
        out.update(zip(positional, made.args))
    names = set(positional) | kwonly
    out.update((k, v) for k, v in made.kwargs if k in names)
    return out
