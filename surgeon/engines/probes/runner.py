"""Read an engine's model runner: which ids reach the model's capture setter.

The runner files (vLLM ``v1/worker/**``, SGLang ``srt/model_executor/**`` and ``srt/speculative/**``)
are parsed with ``ast``, never imported. Every call of the capture setter
(``set_aux_hidden_state_layers``; ``set_eagle3_layers_to_capture``/``set_dflash_layers_to_capture``)
is classified by what its argument is, read from the source:

* no argument, ``None``, or a call of one of the model's own ``get_*`` methods: the model's default;
* a local variable: its assignments in the enclosing function, and a helper it is computed by (a
  method of the same class, a function of the same module or one imported from the engine): each
  ``getattr(cfg, "key")``, ``x.get("key")``/``x["key"]`` and ``[i + c for i in ...]`` there is an
  :class:`IdSource` (key, offset, file:line, the enclosing conditions verbatim);
* a parameter of the enclosing function: passed in; the callers found are named, not followed.

Anything else is "unknown" with the expression, and the model says it is not verified.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from surgeon.core.runnerfacts import IdSource, RunnerCall, RunnerModel, summarise
from surgeon.engines.source.reading import SOURCE_ERRORS, read_source

SETTERS = {"vllm": ("set_aux_hidden_state_layers",),
           "sglang": ("set_eagle3_layers_to_capture", "set_dflash_layers_to_capture")}
# Where the runners and their helpers live (a call found nowhere here is reported, not assumed).
RUNNER_DIRS = {"vllm": ("v1/worker", "v1/spec_decode", "worker", "spec_decode"),
               "sglang": ("srt/model_executor", "srt/speculative", "srt/managers")}
PACKAGE = {"vllm": "vllm", "sglang": "sglang"}


@dataclass
class _Module:
    path: str
    tree: ast.Module
    parents: dict[ast.AST, ast.AST]


@dataclass
class _Site:
    """One setter call as found: its module, enclosing function, node and reading."""

    mod: _Module
    fn: ast.FunctionDef | ast.AsyncFunctionDef
    node: ast.Call
    call: RunnerCall


class RunnerReader:
    def __init__(self, engine: str, root: Path) -> None:
        self.engine = engine
        self.root = Path(root)
        self._modules: dict[str, _Module | None] = {}
        self._texts: dict[str, str | None] = {}
        self._files: list[str] | None = None

    # -- files -------------------------------------------------------------------------------
    def runner_files(self) -> list[str]:
        if self._files is not None:
            return self._files
        out: list[str] = []
        for d in RUNNER_DIRS[self.engine]:
            base = self.root / d
            if base.is_dir():
                out += sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*.py"))
        self._files = out
        return out

    def text(self, rel: str) -> str | None:
        """The source of runner file ``rel`` (None: absent, or not a regular file of a sane size:
        a FIFO there is refused at once by :func:`read_source`, never waited on)."""
        if rel not in self._texts:
            try:
                self._texts[rel] = read_source(self.root / rel)
            except SOURCE_ERRORS:
                self._texts[rel] = None
        return self._texts[rel]

    def module(self, rel: str) -> _Module | None:
        if rel not in self._modules:
            text = self.text(rel)
            try:
                tree = ast.parse(text) if text is not None else None
            except (SyntaxError, ValueError):
                tree = None
            if tree is None:
                self._modules[rel] = None
                return None
            parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
            self._modules[rel] = _Module(rel, tree, parents)
        return self._modules[rel]

    # -- the model ---------------------------------------------------------------------------
    def read(self, version: str) -> RunnerModel:
        setters = SETTERS[self.engine]
        files = self.runner_files()
        calls: list[RunnerCall] = []
        sites: list[_Site] = []
        for rel in files:
            text = self.text(rel)
            if text is None or not any(s in text for s in setters):
                continue
            mod = self.module(rel)
            if mod is None:
                continue
            for node in ast.walk(mod.tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in setters and _enclosing(mod, node) is not None):
                    fn = _enclosing(mod, node)
                    assert fn is not None
                    if fn.name in setters:  # a wrapper forwarding its own argument is a model, not the runner
                        continue
                    calls.append(self._call(mod, fn, node))
                    sites.append(_Site(mod, fn, node, calls[-1]))
        calls.sort(key=lambda c: (c.path, c.line))
        return summarise(self.engine, version, tuple(files), tuple(calls), setters, graph_default_first(sites))

    def _call(self, mod: _Module, fn: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call) -> RunnerCall:
        assert isinstance(call.func, ast.Attribute)
        base: dict[str, Any] = dict(path=mod.path, line=call.lineno, function=_qualname(mod, fn), setter=call.func.attr)
        arg = call.args[0] if call.args else next((k.value for k in call.keywords), None)
        if arg is None or (isinstance(arg, ast.Constant) and arg.value is None):
            return RunnerCall(**base, passes="default", detail="called without ids: the model's setter uses its own default")
        getter = _model_getter(arg)
        if getter is not None:
            return RunnerCall(**base, passes="default", default_method=getter,
                              detail=f"passes {ast.unparse(arg)}: the model's default, whatever the draft config says")
        if isinstance(arg, ast.Name):
            return self._name_arg(mod, fn, arg.id, base)
        sources = self._expr_sources(mod, fn, arg, {})
        if sources:
            return RunnerCall(**base, passes="draft_ids", sources=tuple(sources))
        return RunnerCall(**base, passes="unknown", detail=f"passes {ast.unparse(arg)}, an expression not modelled")

    def _name_arg(self, mod: _Module, fn: ast.FunctionDef | ast.AsyncFunctionDef, name: str, base: dict[str, Any]) -> RunnerCall:
        params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
        values = _assigned(fn, name)
        if not values and name in params:
            followed = self._follow_callers(fn.name, name, base)
            if followed is not None:
                return followed
            callers = self._callers(fn.name, name)
            seen = "; ".join(callers) if callers else "no caller found in the runner files"
            return RunnerCall(**base, passes="passed_in",
                              detail=f"ids come in as parameter {name!r} of {fn.name} ({seen}); "
                                     "which draft-config key fills it was not read")
        default_method = None
        sources: list[IdSource] = []
        for value in values:
            getter = _model_getter(value)
            if getter is not None:
                default_method = getter
                continue
            if isinstance(value, ast.Constant) and value.value is None:
                continue
            found = self._value_sources(mod, fn, value)
            if found is None:
                return RunnerCall(**base, passes="unknown",
                                  detail=f"{name} = {ast.unparse(value)} (line {value.lineno}) is not modelled")
            sources += found
        if sources:
            return RunnerCall(**base, passes="draft_ids", default_method=default_method, sources=tuple(sources),
                              detail=None if default_method else "without ids in the config the setter gets None "
                                                                 "(the model's setter default)")
        if default_method is not None:
            return RunnerCall(**base, passes="default", default_method=default_method,
                              detail=f"{name} is only ever the model's {default_method}()")
        return RunnerCall(**base, passes="unknown", detail=f"{name} has no assignment the reader can follow")

    def _value_sources(self, mod: _Module, fn: ast.FunctionDef | ast.AsyncFunctionDef,
                       value: ast.expr) -> list[IdSource] | None:
        """Sources of one assigned value: a helper call (read), or an expression over config reads."""
        if isinstance(value, ast.Call):
            helper = self._helper(mod, fn, value.func)
            if helper is not None:
                hmod, hfn = helper
                found: list[IdSource] = []
                for ret in _returned_names(hfn):
                    for v in _assigned(hfn, ret):
                        found += self._expr_sources(hmod, hfn, v, {})
                return found or None
        found = self._expr_sources(mod, fn, value, {})
        return found or None

    def _expr_sources(self, mod: _Module, fn: ast.AST, expr: ast.expr, env: dict[str, str]) -> list[IdSource]:
        got = _config_key(expr, _key_env(fn))
        if got is None:
            return []
        key, offset = got
        return [IdSource(key, offset, mod.path, expr.lineno, _conditions(mod, expr, fn))]

    def _helper(self, mod: _Module, fn: ast.AST, func: ast.expr) -> tuple[_Module, ast.FunctionDef] | None:
        """The function a call resolves to: ``self.m`` in the enclosing class, a module-level
        function, or one imported ``from <engine>.x import name``."""
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            cls = mod.parents.get(fn)
            if isinstance(cls, ast.ClassDef):
                for item in cls.body:
                    if isinstance(item, ast.FunctionDef) and item.name == func.attr:
                        return mod, item
            return None
        if not isinstance(func, ast.Name):
            return None
        for item in mod.tree.body:
            if isinstance(item, ast.FunctionDef) and item.name == func.id:
                return mod, item
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ImportFrom) and node.module and any(a.name == func.id for a in node.names):
                parts = node.module.split(".")
                if parts[0] != PACKAGE[self.engine]:
                    continue
                other = self.module("/".join(parts[1:]) + ".py")
                if other is not None:
                    for item in other.tree.body:
                        if isinstance(item, ast.FunctionDef) and item.name == func.id:
                            return other, item
        return None

    def _callers(self, function: str, param: str) -> list[str]:
        return [f"{mod.path}:{call.lineno} passes {ast.unparse(value)}"
                for mod, call, value in self._caller_values(function, param)]

    def _caller_values(self, function: str, param: str) -> list[tuple[_Module, ast.Call, ast.expr]]:
        """Every call of ``function`` in the runner files with ``param=`` given: (module, call, value)."""
        out: list[tuple[_Module, ast.Call, ast.expr]] = []
        for rel in self.runner_files():
            if function not in (self.text(rel) or ""):
                continue
            mod = self.module(rel)
            if mod is None:
                continue
            for node in ast.walk(mod.tree):
                if isinstance(node, ast.Call) and _callee(node.func) == function:
                    out += [(mod, node, kw.value) for kw in node.keywords if kw.arg == param]
        return out

    # -- ids handed down through an attribute of the runner ------------------------------------
    def _follow_callers(self, function: str, param: str, base: dict[str, Any]) -> RunnerCall | None:
        """The ids a parameter receives where every caller passes ``self.A.B`` and ``self.A`` is the
        result of a helper of the engine (SGLang 0.5.23: ``self.spec_aux_config``, built by
        ``resolve_spec_aux_hidden_state_config``): each assignment to ``.B`` in the helper's module,
        read like a runner's own. None where any step is not of that shape (reported as passed in)."""
        sites = self._caller_values(function, param)
        sources: list[IdSource] = []
        via: list[str] = []
        gets_none = False
        for mod, call, value in sites:
            chain = _self_attr_pair(value)
            built = self._built_by(mod, call, chain[0]) if chain else []
            if chain is None or not built:
                return None
            for hmod, hfn in built:
                assigned = _attr_assignments(hmod, chain[1])
                if not assigned:
                    return None
                for efn, v in assigned:
                    if isinstance(v, ast.Constant) and v.value is None:
                        gets_none = True
                        continue
                    src = _assignment_source(hmod, efn, v)
                    if src is None:
                        return RunnerCall(**base, passes="unknown",
                                          detail=f"{hmod.path}:{v.lineno}: .{chain[1]} = {ast.unparse(v)} is not modelled "
                                                 f"(the ids reach {function} from {mod.path}:{call.lineno})")
                    sources.append(src)
                via.append(f"{mod.path}:{call.lineno} passes self.{chain[0]}.{chain[1]}, set in {hmod.path} "
                           f"(built by {hfn.name}, {hmod.path}:{hfn.lineno})")
        if not any(s.origin == "draft_config" for s in sources):
            return None
        detail = "read through " + "; ".join(via) + (
            "; where the config has none the setter gets None (the model's setter default)" if gets_none else "")
        return RunnerCall(**base, passes="draft_ids", sources=tuple(sources), detail=detail)

    def _built_by(self, mod: _Module, call: ast.Call, attr: str) -> list[tuple[_Module, ast.FunctionDef]]:
        """The engine helpers whose results are assigned to ``self.<attr>`` in the class holding
        ``call``; empty where any such assignment is not a call of a helper the reader resolves."""
        cls = _enclosing_class(mod, call)
        if cls is None:
            return []
        out = []
        for node in ast.walk(cls):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            if not any(_self_attr_pair(t, depth=1) == (attr, "") for t in targets):
                continue
            value = getattr(node, "value", None)
            fn = _enclosing(mod, node)
            helper = self._helper(mod, fn, value.func) if isinstance(value, ast.Call) and fn is not None else None
            if helper is None:
                return []
            out.append(helper)
        return out


# -- the order of a default and the draft's ids ---------------------------------------------------
def graph_default_first(sites: list[_Site]) -> str | None:
    """Where a device-graph runner's constructor sets the model's default and then captures its
    graphs (``self.capture()`` after the call, in its ``__init__``), and the class holding the
    draft-ids call builds that runner through one of its methods *before* that call, in the same
    function (SGLang 0.5.5: ``ModelRunner.initialize`` calls ``init_device_graphs()`` at
    model_runner.py:479, which builds ``CudaGraphRunner``, then passes the draft's ids at :509): the
    order as read, with file:line; None where the source does not show that order."""
    for g in (s for s in sites if s.call.passes == "default" and s.fn.name == "__init__"):
        gcls = _enclosing_class(g.mod, g.fn)
        capture = next((x for x in _self_calls(g.fn, "capture") if x.lineno > g.node.lineno), None)
        if gcls is None or capture is None:
            continue
        for d in (s for s in sites if s.call.passes == "draft_ids"):
            dcls = _enclosing_class(d.mod, d.fn)
            builder = next((m for m in (dcls.body if dcls else []) if isinstance(m, ast.FunctionDef)
                            and any(isinstance(x, ast.Name) and x.id == gcls.name for x in ast.walk(m))), None)
            before = sorted(x.lineno for x in (_self_calls(d.fn, builder.name) if builder is not None else [])
                            if x.lineno < d.node.lineno)
            if dcls is None or builder is None or not before:
                continue
            return (f"{g.call.where}: {gcls.name}.__init__ sets the model's default, then captures its graphs "
                    f"({g.mod.path}:{capture.lineno}: self.capture()); {dcls.name}.{d.fn.name} builds it through "
                    f"self.{builder.name}() ({d.mod.path}:{before[0]}) before it passes the draft's ids ({d.call.where}): "
                    "graph replays capture the default's states and eager passes the draft's, so unless graphs are "
                    "off (--disable-cuda-graph) a wiring other than the model's default is served inconsistently")
    return None


def _self_calls(fn: ast.AST, name: str) -> list[ast.Call]:
    """The calls ``self.<name>(...)`` in ``fn``."""
    return [x for x in ast.walk(fn) if isinstance(x, ast.Call) and isinstance(x.func, ast.Attribute)
            and isinstance(x.func.value, ast.Name) and x.func.value.id == "self" and x.func.attr == name]


def _enclosing_class(mod: _Module, node: ast.AST) -> ast.ClassDef | None:
    cur = mod.parents.get(node)
    while cur is not None and not isinstance(cur, ast.ClassDef):
        cur = mod.parents.get(cur)
    return cur


# -- ast helpers -------------------------------------------------------------------------------
def _enclosing(mod: _Module, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    cur = mod.parents.get(node)
    while cur is not None and not isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)):
        cur = mod.parents.get(cur)
    return cur


def _qualname(mod: _Module, fn: ast.AST) -> str:
    names = []
    cur: ast.AST | None = fn
    while cur is not None:
        if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(cur.name)
        cur = mod.parents.get(cur)
    return ".".join(reversed(names))


def _callee(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _model_getter(expr: ast.expr) -> str | None:
    """``<something>.model.get_x()`` / ``eagle3_model.get_x()`` with no arguments: a model's own
    default getter (``get_eagle3_aux_hidden_state_layers``, ``get_eagle3_default_...``)."""
    if (isinstance(expr, ast.Call) and not expr.args and not expr.keywords and isinstance(expr.func, ast.Attribute)
            and expr.func.attr.startswith("get_") and "layers" in expr.func.attr
            and not (isinstance(expr.func.value, ast.Name) and expr.func.value.id == "self")):
        return expr.func.attr
    return None


def _assigned(fn: ast.AST, name: str) -> list[ast.expr]:
    """Values assigned to a local ``name`` in ``fn``, in source order."""
    out: list[ast.expr] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            out.append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name and node.value:
            out.append(node.value)
    return sorted(out, key=lambda v: (v.lineno, v.col_offset))


def _returned_names(fn: ast.FunctionDef) -> list[str]:
    names: list[str] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Return) and node.value is not None:
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Name) and sub.id not in names and _assigned(fn, sub.id):
                    names.append(sub.id)
    return names


def _key_env(fn: ast.AST) -> dict[str, str]:
    """Local names bound to a sub-dict of the config: ``x = getattr(cfg, "eagle_config", None)`` ->
    ``{"x": "eagle_config"}``; a loop ``for n in ("a", "b")`` with ``getattr(cfg, n)`` -> ``"{a,b}"``."""
    loops: dict[str, str] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, (ast.Tuple, ast.List)):
            consts = [e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if consts and len(consts) == len(node.iter.elts):
                loops[node.target.id] = "{" + ",".join(consts) + "}"
    env: dict[str, str] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            key = _getattr_key(node.value, loops)
            if key is not None:
                env[node.targets[0].id] = key
    return env


def _getattr_key(expr: ast.expr, loops: dict[str, str]) -> str | None:
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "getattr" and len(expr.args) >= 2:
        arg = expr.args[1]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name) and arg.id in loops:
            return loops[arg.id]
    return None


def _config_key(expr: ast.expr, env: dict[str, str]) -> tuple[str, int] | None:
    """(config key, offset) of an expression that reads ids from the draft config, else None."""
    if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.Or):
        return _config_key(expr.values[0], env)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ("list", "tuple") and expr.args:
        return _config_key(expr.args[0], env)
    key = _getattr_key(expr, {})
    if key is not None:
        return key, 0
    sub: tuple[ast.expr, ast.expr] | None = None
    if isinstance(expr, ast.Subscript):
        sub = (expr.value, expr.slice)
    elif (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "get" and expr.args):
        sub = (expr.func.value, expr.args[0])
    if sub is not None:
        holder, item = sub
        if isinstance(item, ast.Constant) and isinstance(item.value, str):
            if isinstance(holder, ast.Name) and holder.id in env:
                return f"{env[holder.id]}.{item.value}", 0
            inner = _getattr_key(holder, {})
            if inner is not None:
                return f"{inner}.{item.value}", 0
        return None
    if isinstance(expr, (ast.ListComp, ast.GeneratorExp)) and len(expr.generators) == 1:
        gen = expr.generators[0]
        inner_key = _config_key(gen.iter, env)
        elt = expr.elt
        if inner_key is not None and isinstance(gen.target, ast.Name):
            if isinstance(elt, ast.Name) and elt.id == gen.target.id:
                return inner_key
            if (isinstance(elt, ast.BinOp) and isinstance(elt.left, ast.Name) and elt.left.id == gen.target.id
                    and isinstance(elt.right, ast.Constant) and isinstance(elt.right.value, int)):
                sign = 1 if isinstance(elt.op, ast.Add) else -1 if isinstance(elt.op, ast.Sub) else None
                if sign is not None:
                    return inner_key[0], inner_key[1] + sign * elt.right.value
    if isinstance(expr, ast.Name) and expr.id in env:
        return env[expr.id], 0
    return None


def _self_attr_pair(expr: ast.expr, depth: int = 2) -> tuple[str, str] | None:
    """``self.A.B`` -> ("A", "B"); with ``depth=1``, ``self.A`` -> ("A", "")."""
    if depth == 1:
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
            return expr.attr, ""
        return None
    if isinstance(expr, ast.Attribute):
        inner = _self_attr_pair(expr.value, depth=1)
        if inner is not None:
            return inner[0], expr.attr
    return None


def _attr_assignments(mod: _Module, attr: str) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, ast.expr]]:
    """``<name>.<attr> = value`` anywhere in a function of ``mod``: (the function, the value)."""
    out = []
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == attr
                                                and isinstance(t.value, ast.Name) for t in node.targets):
            fn = _enclosing(mod, node)
            if fn is not None:
                out.append((fn, node.value))
    return sorted(out, key=lambda x: x[1].lineno)


def _assignment_source(mod: _Module, fn: ast.FunctionDef | ast.AsyncFunctionDef, value: ast.expr) -> IdSource | None:
    """A draft-config read (as in a runner's own function), or ids read from the engine's own state
    (``features.return_aux_hidden_state_layer_ids``: an attribute chain on nothing config-like),
    with the conditions of its path, early returns included; None where neither is proven."""
    when = _path_conditions(mod, value, fn)
    got = _config_key(value, _key_env(fn))
    if got is not None:
        return IdSource(got[0], got[1], mod.path, value.lineno, when)
    read = _engine_read(fn, value)
    return None if read is None else IdSource(read, 0, mod.path, value.lineno, when, origin="engine")


def _engine_read(fn: ast.AST, value: ast.expr) -> str | None:
    if isinstance(value, ast.IfExp) and isinstance(value.orelse, ast.Constant) and value.orelse.value is None:
        return _engine_read(fn, value.body)
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("list", "tuple") and value.args:
        return _engine_read(fn, value.args[0])
    if isinstance(value, ast.Name):
        assigned = _assigned(fn, value.id)
        return _engine_read(fn, assigned[0]) if len(assigned) == 1 else None
    if isinstance(value, ast.Attribute):
        text = ast.unparse(value)
        root: ast.expr = value
        while isinstance(root, ast.Attribute):
            root = root.value
        origin = ast.unparse(_assigned(fn, root.id)[0]) if isinstance(root, ast.Name) and len(_assigned(fn, root.id)) == 1 else ""
        if not any(w in (text + " " + origin).lower() for w in ("config", "draft", "self")):
            return text + (f" (from {origin})" if origin else "")
    return None


def _path_conditions(mod: _Module, node: ast.AST, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The enclosing ``if`` tests of ``node`` in ``fn`` and the early returns before it
    (``if T: return`` at the top of ``fn``'s body reads as ``not (T)``)."""
    top: ast.AST = node
    while mod.parents.get(top) is not fn and mod.parents.get(top) is not None:
        top = mod.parents[top]
    guards = []
    for stmt in fn.body:
        if stmt is top:
            break
        if (isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1
                and isinstance(stmt.body[0], ast.Return)):
            guards.append(f"not ({ast.unparse(stmt.test)})")
    inner = _conditions(mod, node, fn)
    return " and ".join([*guards, *([inner] if inner else [])]) or None


def _conditions(mod: _Module, node: ast.AST, stop: ast.AST) -> str | None:
    """The tests of the ``if`` statements enclosing ``node`` inside ``stop``, outermost first."""
    tests: list[str] = []
    child, cur = node, mod.parents.get(node)
    while cur is not None and cur is not stop:
        if isinstance(cur, ast.If):
            text = ast.unparse(cur.test)
            tests.append(text if child in cur.body else f"not ({text})")
        child, cur = cur, mod.parents.get(cur)
    return " and ".join(reversed(tests)) or None


def read_runner(engine: str, root: str | Path, version: str = "unknown") -> RunnerModel:
    """The runner model of the engine package at ``root`` (the ``vllm``/``sglang`` directory)."""
    return RunnerReader(engine, Path(root)).read(version)
