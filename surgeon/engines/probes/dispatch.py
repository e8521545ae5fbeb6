"""Which (file, class) a registry entry really runs on one platform, read from the package's
``__init__.py`` (never imported).

vLLM 0.33 moved architectures into ``vllm/models/<family>/<platform>/model.py``; a registry
entry such as ``("vllm.models.deepseek_v32", "GlmMoeDsaForCausalLM")`` names a package whose
``__init__.py`` picks the class per platform::

    if current_platform.is_cuda():
        from .nvidia.model import DeepseekV32ForCausalLM as GlmMoeDsaForCausalLM
    elif current_platform.is_rocm():
        ...
    else:
        from vllm.model_executor.models.deepseek_v2 import GlmMoeDsaForCausalLM

or defers the choice to a module ``__getattr__(name)``. :class:`DispatchResolver` runs the module's
top-level statements (and, for a name they do not bind, its ``__getattr__`` with ``name`` bound)
under one platform: ``if`` conditions are evaluated three-valued (:func:`evaluate`), imports bind
names, ``raise`` ends a path, ``return`` ends a loader. What ``current_platform.is_cuda()`` or
``current_platform.device_type`` mean is read from the release's ``platforms/`` package
(:class:`PlatformModel`): the method bodies in ``interface.py`` and each platform class's
attributes. ``TYPE_CHECKING`` is False at run time. A condition that cannot be evaluated forks:
both sides are followed, and an answer with more than one candidate is *ambiguous*; it lists the
candidates and says why (never picks one silently).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from surgeon.engines.source.index import SourceIndex, source_segment

PLATFORMS = ("cuda", "rocm", "cpu", "xpu", "tpu")
DEFAULT_PLATFORM = "cuda"
# platform name -> the file of ``platforms/`` that defines its Platform class
_PLATFORM_FILES = {"cuda": "cuda.py", "rocm": "rocm.py", "cpu": "cpu.py", "xpu": "xpu.py", "tpu": "tpu.py"}


class Unknown:
    """A value the evaluator cannot know; ``why`` says what was not evaluable."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return f"Unknown({self.why!r})"


@dataclass(frozen=True)
class EnumMember:
    """``PlatformEnum.CUDA`` as a value."""

    enum: str
    member: str


# ---------------------------------------------------------------------------------------------
# What a platform is, read from the release's platforms/ package
# ---------------------------------------------------------------------------------------------
@dataclass
class PlatformModel:
    """One platform as the release defines it: the attributes of its Platform class (``_enum``,
    ``device_type``...) and the ``Platform`` methods whose body is one ``return`` expression."""

    name: str
    attrs: dict[str, object] = field(default_factory=dict)
    methods: dict[str, ast.expr] = field(default_factory=dict)
    source: str = ""  # "platforms/cuda.py", or why nothing was read

    @classmethod
    def read(cls, index: SourceIndex, name: str) -> PlatformModel:
        model = cls(name)
        pdir = "platforms"
        interface = _parse(index, f"{pdir}/interface.py")
        if interface is not None:
            for node in interface.body:
                if isinstance(node, ast.ClassDef) and node.name == "Platform":
                    for item in node.body:
                        if (isinstance(item, ast.FunctionDef) and len(item.args.args) == 1
                                and not item.args.kwonlyargs):
                            ret = _single_return(item)
                            if ret is not None:
                                model.methods[item.name] = ret
        fname = _PLATFORM_FILES.get(name)
        tree = _parse(index, f"{pdir}/{fname}") if fname else None
        if tree is None:
            model.source = f"no {pdir}/{fname or name + '.py'} in this release"
            return model
        model.source = f"{pdir}/{fname}"
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    target, value = _assign_parts(item)
                    if target is None or value is None or target in model.attrs:
                        continue
                    v = _literal(value)
                    if not isinstance(v, Unknown):
                        model.attrs[target] = v
        return model


def _parse(index: SourceIndex, path: str) -> ast.Module | None:
    mod = index.module(path)  # parsed once per index, whichever platform asks
    return mod.tree if mod is not None else None


def _single_return(fn: ast.FunctionDef) -> ast.expr | None:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
        return body[0].value
    return None


def _assign_parts(item: ast.stmt) -> tuple[str | None, ast.expr | None]:
    if isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name):
        return item.targets[0].id, item.value
    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
        return item.target.id, item.value
    return None, None


def _literal(node: ast.expr) -> object:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return EnumMember(node.value.id, node.attr)
    return Unknown(ast.unparse(node))


# ---------------------------------------------------------------------------------------------
# Three-valued evaluation of a condition
# ---------------------------------------------------------------------------------------------
@dataclass
class Scope:
    """What names mean while evaluating: the platform (bound to the local name of
    ``vllm.platforms.current_platform``), ``TYPE_CHECKING``'s local name, and plain values
    (``name`` inside ``__getattr__``, ``__all__``)."""

    platform: PlatformModel
    platform_names: set[str] = field(default_factory=set)
    type_checking_names: set[str] = field(default_factory=lambda: {"TYPE_CHECKING"})
    values: dict[str, object] = field(default_factory=dict)


def evaluate(node: ast.expr, scope: Scope) -> object:
    """The value of ``node`` under ``scope``, or :class:`Unknown`. ``and``/``or``/``not`` follow
    three-valued logic: ``False and ?`` is False, ``True or ?`` is True, otherwise unknown."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in scope.type_checking_names:
            return False
        if node.id in scope.values:
            return scope.values[node.id]
        return Unknown(node.id)
    if isinstance(node, ast.BoolOp):
        return _bool_op(node, scope)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        v = evaluate(node.operand, scope)
        return v if isinstance(v, Unknown) else not v
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        return _compare(node, scope)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [evaluate(e, scope) for e in node.elts]
        bad = [i for i in items if isinstance(i, Unknown)]
        return bad[0] if bad else tuple(items)
    if isinstance(node, ast.Attribute):
        return _attribute(node, scope)
    if isinstance(node, ast.Call) and not node.args and not node.keywords and isinstance(node.func, ast.Attribute):
        owner = node.func.value
        if isinstance(owner, ast.Name) and owner.id in scope.platform_names:
            body = scope.platform.methods.get(node.func.attr)
            if body is None:
                return Unknown(f"{ast.unparse(node)} (not a one-line Platform method in platforms/interface.py)")
            inner = Scope(scope.platform, {"self"}, set(), {})
            v = evaluate(body, inner)
            return Unknown(f"{ast.unparse(node)}") if isinstance(v, Unknown) else v
    return Unknown(ast.unparse(node))


def _bool_op(node: ast.BoolOp, scope: Scope) -> object:
    is_and = isinstance(node.op, ast.And)
    unknown: Unknown | None = None
    for value in node.values:
        v = evaluate(value, scope)
        if isinstance(v, Unknown):
            unknown = unknown or v
        elif bool(v) != is_and:  # a False in `and`, a True in `or` decides
            return bool(v)
    return unknown if unknown is not None else is_and


def _compare(node: ast.Compare, scope: Scope) -> object:
    left = evaluate(node.left, scope)
    right = evaluate(node.comparators[0], scope)
    for v in (left, right):
        if isinstance(v, Unknown):
            return v
    op = node.ops[0]
    try:
        if isinstance(op, ast.Eq):
            return left == right
        if isinstance(op, ast.NotEq):
            return left != right
        if isinstance(op, ast.In):
            return left in right  # type: ignore[operator]
        if isinstance(op, ast.NotIn):
            return left not in right  # type: ignore[operator]
        if isinstance(op, ast.Is):
            return left is right
        if isinstance(op, ast.IsNot):
            return left is not right
    except TypeError:
        pass
    return Unknown(ast.unparse(node))


def _attribute(node: ast.Attribute, scope: Scope) -> object:
    owner = node.value
    if isinstance(owner, ast.Name):
        if owner.id in scope.platform_names:
            if node.attr in scope.platform.attrs:
                return scope.platform.attrs[node.attr]
            return Unknown(f"{ast.unparse(node)} (no such attribute read from {scope.platform.source})")
        if owner.id[:1].isupper():  # PlatformEnum.CUDA
            return EnumMember(owner.id, node.attr)
    return Unknown(ast.unparse(node))


# ---------------------------------------------------------------------------------------------
# Running a module's top level (and its __getattr__) under one platform
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ref:
    """What a name is bound to: ``attr`` of module ``module`` (``attr`` None: the module itself),
    or a class defined in ``path`` (``module`` None). ``line`` is the binding statement's line in
    ``where`` (the file whose statement decides)."""

    module: str | None
    attr: str | None
    where: str
    line: int
    text: str


@dataclass(frozen=True)
class Candidate:
    """One (file, class) the entry may run, and the import that decides it."""

    path: str | None  # None: not found in the package (external or missing)
    class_name: str
    line: int  # the ``class`` line, 0 when unknown
    evidence: str  # "vllm/models/deepseek_v32/__init__.py:19 from .nvidia.model import ..."
    assumptions: tuple[str, ...] = ()  # unevaluable conditions taken on the way here
    problem: str | None = None  # why this path gives no class (raises, not found)

    def label(self) -> str:
        if self.path is None:
            return f"nothing ({self.problem})"
        return f"{self.path}:{self.line} {self.class_name}"


@dataclass(frozen=True)
class Resolution:
    """Where ``module``.``name`` leads on ``platform``."""

    module: str
    name: str
    platform: str
    candidates: tuple[Candidate, ...]

    @property
    def verified(self) -> bool:
        return len(self.candidates) == 1 and not self.candidates[0].assumptions and self.candidates[0].path is not None

    @property
    def target(self) -> tuple[str, str] | None:
        if not self.verified:
            return None
        c = self.candidates[0]
        return (c.path, c.class_name) if c.path is not None else None

    @property
    def reason(self) -> str | None:
        """Why the answer is not verified (None when it is)."""
        if self.verified:
            return None
        if len(self.candidates) == 1:
            c = self.candidates[0]
            return c.problem or f"depends on {', '.join(c.assumptions)}"
        conds = sorted({a for c in self.candidates for a in c.assumptions})
        return (f"{len(self.candidates)} candidates: {'; '.join(c.label() for c in self.candidates)}"
                + (f" (not evaluable: {', '.join(conds)})" if conds else ""))


@dataclass
class _Path:
    bindings: dict[str, Ref]
    assumptions: tuple[str, ...] = ()
    ended: str | None = None  # "raise: ..." or "return"
    returned: Ref | None = None


_MAX_PATHS = 64


class DispatchResolver:
    """Resolves registry entries of one release, per platform (caches modules' runs)."""

    def __init__(self, index: SourceIndex) -> None:
        self.index = index
        self._platforms: dict[str, PlatformModel] = {}
        self._runs: dict[tuple[str, str], list[_Path]] = {}

    def platform(self, name: str) -> PlatformModel:
        if name not in self._platforms:
            self._platforms[name] = PlatformModel.read(self.index, name)
        return self._platforms[name]

    def resolve(self, module: str, name: str, platform: str) -> Resolution:
        """``name`` of the dotted ``module`` (``vllm.models.deepseek_v32``) on ``platform``."""
        cands = list(dict.fromkeys(self._follow(module, name, platform, (), 0, f"{module}.{name}")))
        return Resolution(module, name, platform, tuple(cands))

    # -- following a binding ------------------------------------------------------------------
    def _follow(self, module: str, name: str, platform: str, assumptions: tuple[str, ...], depth: int,
                evidence: str) -> Iterator[Candidate]:
        path = self.index.path_of(module)
        if path is None:
            yield Candidate(None, name, 0, evidence, assumptions, f"module {module} is not in the package's model directories")
            return
        if depth > 12:
            yield Candidate(None, name, 0, evidence, assumptions, f"import chain too deep at {module}")
            return
        line = self._class_line(path, name)
        if line:
            yield Candidate(path, name, line, evidence if depth else f"{path}:{line} class {name}", assumptions)
            return
        for p in self._bindings_of(path, name, platform):
            more = assumptions + tuple(a for a in p.assumptions if a not in assumptions)
            ref = p.returned if p.ended == "return" else p.bindings.get(name)
            if p.ended and p.ended.startswith("raise"):
                yield Candidate(None, name, 0, evidence, more, f"{path}: {p.ended[len('raise: '):]}")
                continue
            if ref is None:
                why = (f"{path} does not bind {name} on {platform}" if p.ended != "return"
                       else f"{path}: __getattr__ returns nothing the probe can follow")
                yield Candidate(None, name, 0, evidence, more, why)
                continue
            yield from self._follow_ref(ref, platform, more, depth)

    def _follow_ref(self, ref: Ref, platform: str, assumptions: tuple[str, ...], depth: int) -> Iterator[Candidate]:
        evidence = f"{ref.where}:{ref.line} {ref.text}"
        if ref.module is None and ref.attr is None:
            yield Candidate(None, "", 0, evidence, assumptions, f"{ref.text} is not a class")
            return
        if ref.module is None:  # a class defined in the module itself
            mod = self.index.module(ref.where)
            line = mod.classes[ref.attr].line if mod is not None and ref.attr in mod.classes else ref.line
            yield Candidate(ref.where, ref.attr or "", line, evidence, assumptions)
            return
        if ref.attr is None:
            yield Candidate(None, ref.module, 0, evidence, assumptions, f"{ref.module} is a module, not a class")
            return
        # ``from pkg import sub`` binds the submodule when the package does not define ``sub``
        if self.index.path_of(f"{ref.module}.{ref.attr}") is not None and not self._binds(ref.module, ref.attr):
            yield Candidate(None, ref.attr, 0, evidence, assumptions, f"{ref.module}.{ref.attr} is a module, not a class")
            return
        for c in self._follow(ref.module, ref.attr, platform, assumptions, depth + 1, evidence):
            # keep the import nearest to the registry as the evidence that decides
            yield Candidate(c.path, c.class_name, c.line, evidence if depth == 0 else c.evidence,
                            c.assumptions, c.problem)

    def _binds(self, module: str, name: str) -> bool:
        path = self.index.path_of(module)
        mod = self.index.module(path) if path else None
        return mod is not None and (name in mod.classes or name in mod.imports or name in mod.assigns)

    def _class_line(self, path: str, name: str) -> int:
        """The line of a top-level ``class name`` in ``path`` (0: none). A text search first: the
        file is parsed only when the name is bound some other way (an import, an alias)."""
        text = self.index.text(path) or ""
        found = re.search(rf"^class[ \t]+{re.escape(name)}\b", text, re.M)
        if found is None:
            return 0
        mod = self.index.parsed(path)  # already parsed: confirm with ast; else a column-0 header is one
        if mod is None:
            return text.count("\n", 0, found.start()) + 1
        node = next((n for n in mod.tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
        return node.lineno if node is not None else 0

    # -- running a module ---------------------------------------------------------------------
    def _bindings_of(self, path: str, name: str, platform: str) -> list[_Path]:
        """The paths through ``path``'s top level; for those that leave ``name`` unbound, through
        its ``__getattr__(name)``."""
        key = (path, platform)
        if key not in self._runs:
            self._runs[key] = self._run_module(path, platform)
        out: list[_Path] = []
        for p in self._runs[key]:
            if p.ended or name in p.bindings or "__getattr__" not in p.bindings:
                out.append(p)
                continue
            out.extend(self._run_getattr(path, p, name, platform))
        return out

    def _scope(self, path: str, platform: str, bindings: dict[str, Ref]) -> Scope:
        scope = Scope(self.platform(platform))
        for local, ref in bindings.items():
            if ref.module == "vllm.platforms" and ref.attr == "current_platform":
                scope.platform_names.add(local)
            if ref.module == "typing" and ref.attr == "TYPE_CHECKING":
                scope.type_checking_names.add(local)
        return scope

    def _run_module(self, path: str, platform: str) -> list[_Path]:
        mod = self.index.module(path)
        if mod is None:
            return [_Path({}, (), f"raise: {path} does not parse")]
        runner = _Runner(self, path, platform, mod.dotted, path.endswith("__init__.py"))
        return runner.block(mod.tree.body, [_Path({})])

    def _run_getattr(self, path: str, start: _Path, name: str, platform: str) -> list[_Path]:
        mod = self.index.module(path)
        fn = next((n for n in mod.tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"), None) if mod else None
        if mod is None or fn is None or not fn.args.args:
            return [start]
        runner = _Runner(self, path, platform, mod.dotted, path.endswith("__init__.py"))
        runner.values = {fn.args.args[0].arg: name}
        if "__all__" in start.bindings:
            for node in mod.tree.body:  # the module's last top-level ``__all__ = [...]``
                target, value = _assign_parts(node)
                if target == "__all__" and value is not None:
                    runner.values["__all__"] = evaluate(value, Scope(self.platform(platform)))
        paths = runner.block(fn.body, [_Path(dict(start.bindings), start.assumptions)])
        for p in paths:
            if p.ended is None:
                p.ended = f"raise: __getattr__ of {path} falls through without returning {name}"
        return paths


class _Runner:
    """Runs a statement list on a set of paths (forking on unevaluable conditions)."""

    def __init__(self, resolver: DispatchResolver, path: str, platform: str, dotted: str, is_package: bool) -> None:
        self.resolver = resolver
        self.path = path
        self.platform = platform
        parts = dotted.split(".")
        self.package_parts = parts if is_package else parts[:-1]
        self.values: dict[str, object] = {}
        self.all_value: object = Unknown("__all__")
        mod = resolver.index.module(path)
        self.lines = mod.lines if mod is not None else []

    def block(self, body: list[ast.stmt], paths: list[_Path]) -> list[_Path]:
        for stmt in body:
            live = [p for p in paths if p.ended is None]
            done = [p for p in paths if p.ended is not None]
            if not live:
                break
            paths = done + [q for p in live for q in self.stmt(stmt, p)]
            if len(paths) > _MAX_PATHS:
                paths = paths[:_MAX_PATHS]
        return paths

    def stmt(self, node: ast.stmt, p: _Path) -> list[_Path]:
        if isinstance(node, ast.ImportFrom):
            self._import_from(node, p)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                target = alias.name if alias.asname else alias.name.split(".")[0]
                p.bindings[local] = Ref(target, None, self.path, node.lineno, self._seg(node))
        elif isinstance(node, ast.ClassDef):
            p.bindings[node.name] = Ref(None, node.name, self.path, node.lineno, f"class {node.name}")
        elif isinstance(node, ast.FunctionDef):
            p.bindings[node.name] = Ref(None, None, self.path, node.lineno, f"def {node.name}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            self._assign(node, p)
        elif isinstance(node, ast.If):
            return self._if(node, p)
        elif isinstance(node, ast.Raise):
            p.ended = f"raise: {self._seg(node)} ({self.path}:{node.lineno})"
        elif isinstance(node, ast.Return):
            p.ended = "return"
            p.returned = self._value_ref(node.value, p, node.lineno) if node.value is not None else None
        elif isinstance(node, ast.Try):
            # the body is what runs when its imports succeed; the handlers are the fallback
            body = self.block(node.body, [_Path(dict(p.bindings), p.assumptions)])
            return body + self.block(node.orelse, [])
        return [p]

    def _seg(self, node: ast.AST) -> str:
        return " ".join(source_segment(self.lines, node).split())

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package_parts[: len(self.package_parts) - (node.level - 1)]
        return ".".join([*base, *(node.module.split(".") if node.module else [])])

    def _import_from(self, node: ast.ImportFrom, p: _Path) -> None:
        module = self._absolute(node)
        for alias in node.names:
            if alias.name == "*":
                continue
            p.bindings[alias.asname or alias.name] = Ref(module, alias.name, self.path, node.lineno, self._seg(node))

    def _assign(self, node: ast.Assign | ast.AnnAssign, p: _Path) -> None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        value = node.value
        for t in targets:
            if not isinstance(t, ast.Name) or value is None:
                continue
            if t.id == "__all__":
                v = evaluate(value, Scope(self.resolver.platform(self.platform)))
                self.all_value = v
                p.bindings[t.id] = Ref(None, None, self.path, node.lineno, "__all__")
                continue
            ref = self._value_ref(value, p, node.lineno)
            if ref is not None:
                p.bindings[t.id] = ref
            else:
                p.bindings.pop(t.id, None)

    def _if(self, node: ast.If, p: _Path) -> list[_Path]:
        scope = self.resolver._scope(self.path, self.platform, p.bindings)
        scope.values.update(self.values)
        if "__all__" in p.bindings and "__all__" not in scope.values:
            scope.values["__all__"] = self.all_value
        v = evaluate(node.test, scope)
        if isinstance(v, Unknown):
            cond = f"{self.path}:{node.lineno} `{self._seg(node.test)}`"
            yes = _Path(dict(p.bindings), p.assumptions + (cond,))
            no = _Path(dict(p.bindings), p.assumptions + (f"not {cond}",))
            return self.block(node.body, [yes]) + self.block(node.orelse, [no])
        return self.block(node.body if v else node.orelse, [p])

    def _value_ref(self, value: ast.expr, p: _Path, line: int) -> Ref | None:
        """What an expression names: a bound name, ``module.attr``, ``getattr(module, name)``,
        ``{"A": A, ...}[name]``."""
        text = self._seg(value)
        if isinstance(value, ast.Name):
            return p.bindings.get(value.id)
        if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
            base = p.bindings.get(value.value.id)
            if base is not None and base.module is not None:
                module = base.module if base.attr is None else f"{base.module}.{base.attr}"
                return Ref(module, value.attr, self.path, line, text)
            return None
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "getattr"
                and len(value.args) == 2 and isinstance(value.args[0], ast.Name)):
            attr = evaluate(value.args[1], Scope(self.resolver.platform(self.platform), values=self.values))
            base = p.bindings.get(value.args[0].id)
            if isinstance(attr, str) and base is not None and base.module is not None:
                module = base.module if base.attr is None else f"{base.module}.{base.attr}"
                return Ref(module, attr, self.path, line, text)
            return None
        if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Dict):
            key = evaluate(value.slice, Scope(self.resolver.platform(self.platform), values=self.values))
            for k, v in zip(value.value.keys, value.value.values):
                if isinstance(k, ast.Constant) and k.value == key:
                    inner = v
                    while isinstance(inner, ast.Tuple) and len(inner.elts) == 1:
                        inner = inner.elts[0]
                    return self._value_ref(inner, p, line)
        return None
