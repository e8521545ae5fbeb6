"""SGLang DFlash: what ``dflash_config.target_layer_ids`` captures, read from the installed source.

Two readings, both from the release's files and never imported:

* the model class: its ``set_dflash_layers_to_capture`` is run symbolically by the same
  classifier as the EAGLE-3 setter (:class:`surgeon.engines.probes.classify.Classifier` with another
  :class:`EntryPoint`), so the id rule (``[val + 1 for val in layer_ids]`` in llama.py), where the
  ids are stored and the capture loop that reads them all come from that class's source;
* the runner: how the draft config's ids reach that setter. The call
  ``model.set_dflash_layers_to_capture(dflash_target_layer_ids)``, the assignment of that field from
  ``resolve_target_layer_ids`` (``dflash_utils.py``: the draft's ``target_layer_ids`` unchanged,
  else a built default), and every other rewrite of the list on the way (the Muse ``+1`` for some
  target/draft pairs), each with file:line. A step whose shape is not the one read here makes the
  answer unverified, with the reason; nothing is assumed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from surgeon.core.idrules import ClassConvention
from surgeon.engines.probes import sglang as probe_sglang
from surgeon.engines.probes.capture import CaptureAnalyzer
from surgeon.engines.probes.classify import Classifier, Target
from surgeon.engines.source.index import ClassKey, SourceIndex
from surgeon.engines.source.reading import SOURCE_ERRORS, read_source

SETTER = probe_sglang.DFLASH_SETTER
FIELD = "dflash_target_layer_ids"
RESOLVE = "resolve_target_layer_ids"
BUILDER = "build_target_layer_ids"  # resolve's default when the draft config names no ids
RUNNER_DIRS = ("srt/model_executor", "srt/speculative")


def _find_key(index: SourceIndex, model_class: str) -> tuple[ClassKey | None, list[str]]:
    """The class an architecture or class name means among the files that mention the DFlash
    setter (SGLang's ``EntryClass`` registration first), and those files."""
    files, names = index.prefilter((SETTER,))
    registered = probe_sglang.exported(index, files)
    if model_class in registered:
        return registered[model_class], files
    found = [ci.key for ci in index.classes_in(files) if ci.name == model_class and ci.name in names]
    return (found[0] if len(found) == 1 else None), files


def dflash_unreadable(cc: ClassConvention | None, model_class: str, path_prefix: str = "") -> str | None:
    """Why :func:`classify_dflash`'s answer ``cc`` for ``model_class`` gives no DFlash convention
    (no such class reaches the setter; the setter was not read to the end), or None where it does:
    the one wording render, check-draft, plan and ``--slots sglang:DFLASH`` give."""
    if cc is None:
        return f"has no class {model_class!r} with {SETTER}"
    if cc.status != "classified":
        return (f"{cc.class_name} ({path_prefix}{cc.path}:{cc.line}): the probe cannot tell what its DFlash ids "
                f"mean: {cc.reason}")
    return None


def classify_dflash(root: str | Path, model_class: str) -> ClassConvention | None:
    """The DFlash convention of ``model_class`` in the SGLang package at ``root`` (None: no class of
    that name reaches ``set_dflash_layers_to_capture``). Status "unclassified" carries the reason."""
    from surgeon.engines.source.locate import locate_engine

    location = locate_engine("sglang", root)
    index = SourceIndex(location.root, "sglang", location.models_dirs)
    key, _files = _find_key(index, model_class)
    if key is None or index.find_function(key, SETTER) is None:
        return None
    found = index.find_function(key, SETTER)
    assert found is not None
    classifier = Classifier("sglang", index, probe_sglang.hooks(index), CaptureAnalyzer(index), None)
    target = Target(key, probe_sglang.DFLASH_ENTRY, defines=found[0] == key)
    # The classifier's deliberate refusals (Unclassifiable, too many paths) come back as an
    # "unclassified" convention with the reason; anything else it raises is a bug in surgeon, left
    # to surface as an internal error rather than be shown to the user as a fault of their spec.
    return classifier.classify(target)


# ---------------------------------------------------------------------------------------------
# the runner
# ---------------------------------------------------------------------------------------------
@dataclass
class DFlashRunner:
    """How the draft config's DFlash ids reach the setter, as read."""

    verified: bool
    reason: str | None = None  # why not verified
    key: str = "dflash_config.target_layer_ids"
    evidence: list[str] = field(default_factory=list)  # "path:line: what"
    conditional: list[str] = field(default_factory=list)  # rewrites that apply only to some pairs
    conditional_literals: set[str] = field(default_factory=set)  # the strings those rewrites test for
    range_check: str | None = None  # "path:line: test" of the runner's refusal of ids outside [0, L)
    parsed_at: str | None = None  # "path:line" where parse_dflash_draft_config reads target_layer_ids
    fallback_key: str | None = None  # the top-level key it reads when dflash_config has no target_layer_ids
    default_at: str | None = None  # "path:line" of the default builder's return (no ids in the draft config)


def _parse(root: Path, rel: str) -> ast.Module | None:
    try:
        return ast.parse(read_source(root / rel))
    except (*SOURCE_ERRORS, SyntaxError, ValueError):
        return None


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def _calls_named(fn: ast.AST, name: str) -> list[ast.Call]:
    out = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Call):
            f = n.func
            if (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name):
                out.append(n)
    return out


def _runner_files(root: Path) -> list[str]:
    out: list[str] = []
    for d in RUNNER_DIRS:
        if (root / d).is_dir():
            out += sorted(p.relative_to(root).as_posix() for p in (root / d).rglob("*.py"))
    return out


def read_dflash_runner(root: str | Path) -> DFlashRunner:
    """Follow the DFlash ids from the setter call back to the draft config key, in the SGLang
    package at ``root``."""
    root = Path(root)
    run = DFlashRunner(verified=False)
    trees = {}
    for rel in _runner_files(root):
        try:
            text = read_source(root / rel)
        except SOURCE_ERRORS:
            continue
        if SETTER in text or FIELD in text or RESOLVE in text:
            tree = _parse(root, rel)
            if tree is not None:
                trees[rel] = tree
    why = (_setter_calls(trees, run) or _field_assignments(trees, run) or _resolve_method(trees, run)
           or _parsed_key(trees, run))
    if why:
        run.reason = why
        return run
    run.verified = True
    return run


def _setter_calls(trees: dict[str, ast.Module], run: DFlashRunner) -> str | None:
    calls = [(rel, c) for rel, tree in trees.items() for fn in _functions(tree) if fn.name != SETTER
             for c in _calls_named(fn, SETTER)]
    if not calls:
        return f"no call of {SETTER} found in {', '.join(RUNNER_DIRS)}"
    for rel, c in calls:
        arg = c.args[0] if c.args else None
        name = arg.id if isinstance(arg, ast.Name) else arg.attr if isinstance(arg, ast.Attribute) else None
        if name != FIELD:
            return f"{rel}:{c.lineno}: {SETTER} is passed {ast.unparse(arg) if arg else 'nothing'}, not the {FIELD} read here"
        run.evidence.append(f"runner: {rel}:{c.lineno}: {ast.unparse(c)}")
    return None


def _field_assignments(trees: dict[str, ast.Module], run: DFlashRunner) -> str | None:
    """Each ``<config>.dflash_target_layer_ids = <name>``: in the function that resolves a draft's ids,
    every assignment of that name is a draft-config read or a rewrite this reading knows."""
    draft_paths = 0
    for rel, tree in trees.items():
        for fn in _functions(tree):
            for node in ast.walk(fn):
                if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                        and isinstance(node.targets[0], ast.Attribute) and node.targets[0].attr == FIELD):
                    continue
                if not _calls_named(fn, RESOLVE):
                    test = _without_draft(fn, node)
                    if test is None:
                        return f"{rel}:{node.lineno}: {FIELD} is set from {ast.unparse(node.value)}, a path not modelled"
                    run.evidence.append(f"runner: {rel}:{node.lineno}: {ast.unparse(node)} only without a draft "
                                        f"(in {fn.name}, {test})")
                    continue
                if not isinstance(node.value, ast.Name):
                    return f"{rel}:{node.lineno}: {FIELD} is set from {ast.unparse(node.value)}, not modelled"
                why = _name_sources(rel, tree, fn, node.value.id, run)
                if why:
                    return why
                run.evidence.append(f"runner: {rel}:{node.lineno}: {ast.unparse(node)}")
                draft_paths += 1
    return None if draft_paths else f"no assignment of {FIELD} from {RESOLVE} found"


def _is_none_test(node: ast.expr) -> bool:
    """``spec_algorithm.is_none()`` (or ``<x>.spec_algorithm.is_none()``): no draft runs."""
    if not (isinstance(node, ast.Call) and not node.args and not node.keywords
            and isinstance(node.func, ast.Attribute) and node.func.attr == "is_none"):
        return False
    owner = node.func.value
    return (isinstance(owner, ast.Name) and owner.id == "spec_algorithm") or (
        isinstance(owner, ast.Attribute) and owner.attr == "spec_algorithm")


def _operands(test: ast.expr, op: type) -> list[ast.expr]:
    return list(test.values) if isinstance(test, ast.BoolOp) and isinstance(test.op, op) else [test]


def _without_draft(fn: ast.FunctionDef, target: ast.AST) -> str | None:
    """How ``target`` runs only when no draft does, or None: it sits in the body of an ``if`` whose
    test is (a conjunct) ``spec_algorithm.is_none()``, or after a statement of ``fn`` that returns
    when (a disjunct) ``not spec_algorithm.is_none()``."""
    for node in ast.walk(fn):
        if (isinstance(node, ast.If) and any(_is_none_test(t) for t in _operands(node.test, ast.And))
                and any(target is n for stmt in node.body for n in ast.walk(stmt))):
            return f"under `if {ast.unparse(node.test)}` (line {node.lineno})"
    for stmt in fn.body:
        if any(target is n for n in ast.walk(stmt)):
            return None
        if (isinstance(stmt, ast.If) and not stmt.orelse and isinstance(stmt.body[-1], ast.Return)
                and any(isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) and _is_none_test(t.operand)
                        for t in _operands(stmt.test, ast.Or))):
            return f"after `if {ast.unparse(stmt.test)}: return` (line {stmt.lineno})"
    return None


def _mutations(fn: ast.FunctionDef, name: str) -> list[ast.AST]:
    """Every way ``fn`` changes or rebinds ``name`` other than a plain ``name = <value>``: augmented or
    annotated assignment, unpacking, a loop or ``with`` target, ``del``, item or attribute stores, and
    any method call on it (``name.append(...)``): none of these is modelled."""
    plain = {id(t) for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    out: list[ast.AST] = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store | ast.Del) and id(n) not in plain:
            out.append(n)
        elif (isinstance(n, ast.Subscript | ast.Attribute) and isinstance(n.ctx, ast.Store | ast.Del)
              and isinstance(n.value, ast.Name) and n.value.id == name):
            out.append(n)
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
              and n.func.value.id == name):
            out.append(n)
    return out


def _statement_of(fn: ast.FunctionDef, node: ast.AST) -> ast.AST:
    """The innermost statement of ``fn`` that holds ``node`` (ast.walk visits outer ones first)."""
    found: ast.AST = node
    for stmt in ast.walk(fn):
        if isinstance(stmt, ast.stmt) and any(node is n for n in ast.walk(stmt)):
            found = stmt
    return found


def _mutation_reason(rel: str, fn: ast.FunctionDef, name: str) -> str | None:
    changed = _mutations(fn, name)
    if not changed:
        return None
    stmt = _statement_of(fn, changed[0])
    text = ast.unparse(stmt).splitlines()[0]
    return f"{rel}:{getattr(changed[0], 'lineno', fn.lineno)}: {text} changes {name} in a way not modelled"


def _name_sources(rel: str, tree: ast.Module, fn: ast.FunctionDef, name: str, run: DFlashRunner) -> str | None:
    why = _mutation_reason(rel, fn, name)
    if why:
        return why
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            continue
        value = node.value
        where = f"{rel}:{node.lineno}"
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == RESOLVE:
            run.evidence.append(f"runner: {where}: {name} = ...{RESOLVE}(...)")
            continue
        if _under_dspark(fn, node):
            run.evidence.append(f"runner: {where}: {ast.unparse(node)} only for DSpark (is_dspark)")
            continue
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            why = _helper_rewrite(rel, tree, value, name, where, run)
            if why:
                return why
            continue
        return f"{where}: {ast.unparse(node)} is not modelled"
    return None


def _under_dspark(fn: ast.FunctionDef, target: ast.AST) -> bool:
    """``target`` sits in the body of an ``if`` one of whose conjuncts calls ``<x>.is_dspark()``."""
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and any(
                isinstance(t, ast.Call) and isinstance(t.func, ast.Attribute) and t.func.attr == "is_dspark"
                for t in _operands(node.test, ast.And)):
            if any(target is n for stmt in node.body for n in ast.walk(stmt)):
                return True
    return False


def _passes(call: ast.Call, fn: ast.FunctionDef, name: str) -> str | None:
    """The parameter of ``fn`` that ``call`` binds to the variable ``name`` (None: not exactly one)."""
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    bound = [params[i] for i, a in enumerate(call.args) if i < len(params) and isinstance(a, ast.Name) and a.id == name]
    bound += [k.arg for k in call.keywords if k.arg is not None and isinstance(k.value, ast.Name) and k.value.id == name]
    return bound[0] if len(bound) == 1 and not any(isinstance(a, ast.Starred) for a in call.args) else None


def _helper_rewrite(rel: str, tree: ast.Module, call: ast.Call, name: str, where: str, run: DFlashRunner) -> str | None:
    """``name = helper(..., ids=name, ...)`` with a module function returning
    ``[i + c for i in ids] if <test> else ids``: a conditional offset of the traced ids."""
    assert isinstance(call.func, ast.Name)  # the caller passes a call of a bare name
    helper = call.func.id
    fns = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == helper]
    if len(fns) != 1:
        return f"{where}: the ids pass through {helper}, not found in {rel}"
    param = _passes(call, fns[0], name)
    if param is None:
        return f"{where}: {ast.unparse(call)} does not pass {name} as one of {helper}'s parameters, not modelled"
    rets = [n for n in ast.walk(fns[0]) if isinstance(n, ast.Return)]
    if len(rets) != 1 or not isinstance(rets[0].value, ast.IfExp) or _mutations(fns[0], param):
        return f"{where}: the ids pass through {helper} ({rel}:{fns[0].lineno}), whose result is not modelled"
    ret = rets[0].value
    body, other = ret.body, ret.orelse
    gen = body.generators[0] if isinstance(body, ast.ListComp) and len(body.generators) == 1 else None
    if not (gen is not None and isinstance(body, ast.ListComp) and not gen.ifs and isinstance(gen.target, ast.Name)
            and isinstance(gen.iter, ast.Name) and gen.iter.id == param
            and isinstance(body.elt, ast.BinOp) and isinstance(body.elt.op, ast.Add)
            and isinstance(body.elt.left, ast.Name) and body.elt.left.id == gen.target.id
            and isinstance(body.elt.right, ast.Constant) and isinstance(body.elt.right.value, int)
            and isinstance(other, ast.Name) and other.id == param):
        return f"{where}: {helper} ({rel}:{rets[0].lineno}) returns {ast.unparse(ret)}, not modelled"
    test = ast.unparse(ret.test)
    run.conditional_literals.update(n.value for n in ast.walk(fns[0]) if isinstance(n, ast.Constant)
                                    and isinstance(n.value, str))
    tested = {n.id for n in ast.walk(ret.test) if isinstance(n, ast.Name)}
    conds = [ast.unparse(n) for n in ast.walk(fns[0]) if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id in tested for t in n.targets)]
    offset = int(body.elt.right.value)
    run.conditional.append(f"{rel}:{rets[0].lineno}: {helper} adds {offset:+d} when {test} "
                           f"({'; '.join(' '.join(c.split()) for c in conds)})")
    return None


def _resolve_method(trees: dict[str, ast.Module], run: DFlashRunner) -> str | None:
    """``resolve_target_layer_ids`` returns the parsed ``target_layer_ids`` unchanged (or a built
    default when the draft config has none)."""
    for rel, tree in trees.items():
        for fn in _functions(tree):
            if fn.name != RESOLVE:
                continue
            rets = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
            for n in (x for x in ast.walk(fn) if isinstance(x, ast.If)):
                test = ast.unparse(n.test)
                if "< 0" in test and ">= target_num_layers" in test and any(isinstance(b, ast.Raise) for b in n.body):
                    run.range_check = f"{rel}:{n.lineno}: raises when {test}"
            for r in rets:
                text = ast.unparse(r.value)  # type: ignore[arg-type]  # value checked non-None above
                default = _default_builder(tree, fn, r)
                if default is not None:
                    run.evidence.append(f"runner: {rel}:{r.lineno}: without target_layer_ids: {text} (a default, "
                                        f"{BUILDER} at {rel}:{default})")
                    run.default_at = f"{rel}:{r.lineno}"
                    continue
                if isinstance(r.value, ast.Name) and _bound_to_list_of_field(fn, r.value.id):
                    why = _mutation_reason(rel, fn, r.value.id)
                    if why:
                        return why
                    run.evidence.append(f"runner: {rel}:{r.lineno}: returns {text} = list(self.target_layer_ids)")
                    continue
                return f"{rel}:{r.lineno}: {RESOLVE} returns {text}, not modelled"
            return None
    return f"no {RESOLVE} found in {', '.join(RUNNER_DIRS)}"


def _default_builder(tree: ast.Module, fn: ast.FunctionDef, ret: ast.Return) -> int | None:
    """The line of the module's ``build_target_layer_ids`` when ``ret`` returns a call of it and sits
    under ``if self.target_layer_ids is None`` (a default only for a draft without ids), else None."""
    call = ret.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == BUILDER):
        return None
    defs = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == BUILDER]
    imported = [a for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names
                if (a.asname or a.name) == BUILDER]
    if len(defs) != 1 or imported:
        return None
    for node in ast.walk(fn):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
                and isinstance(node.test.ops[0], ast.Is) and _is_none(node.test.comparators[0])
                and ast.unparse(node.test.left) == "self.target_layer_ids"
                and any(ret is n for stmt in node.body for n in ast.walk(stmt))):
            return defs[0].lineno
    return None


def _bound_to_list_of_field(fn: ast.FunctionDef, name: str) -> bool:
    values = [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]
    return bool(values) and all(ast.unparse(v) == "list(self.target_layer_ids)" for v in values)


def _parsed_key(trees: dict[str, ast.Module], run: DFlashRunner) -> str | None:
    """``parse_dflash_draft_config`` reads ``target_layer_ids`` from the draft's ``dflash_config``
    (``[int(x) for x in ...]``: no offset) and stores it as the config's ``target_layer_ids``."""
    for rel, tree in trees.items():
        for fn in _functions(tree):
            if fn.name != "parse_dflash_draft_config":
                continue
            gets = [c for c in _calls_named(fn, "get") if c.args and isinstance(c.args[0], ast.Constant)
                    and c.args[0].value == "target_layer_ids"]
            if len(gets) != 1:
                return f"{rel}:{fn.lineno}: parse_dflash_draft_config reads target_layer_ids {len(gets)} times"
            kws = [k for c in ast.walk(fn) if isinstance(c, ast.Call) for k in c.keywords if k.arg == "target_layer_ids"]
            if len(kws) != 1 or not isinstance(kws[0].value, ast.Name):
                return f"{rel}:{fn.lineno}: how parse_dflash_draft_config stores target_layer_ids is not modelled"
            name = kws[0].value.id
            values = [n.value for n in ast.walk(fn) if isinstance(n, ast.AnnAssign | ast.Assign)
                      and n.value is not None and any(isinstance(t, ast.Name) and t.id == name
                                                      for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
            bad = [v for v in values if not (_is_none(v) or _int_copy(v))]
            if bad:
                return f"{rel}:{fn.lineno}: parse_dflash_draft_config sets {name} = {ast.unparse(bad[0])}, not modelled"
            run.evidence.append(f"runner: {rel}:{gets[0].lineno}: {ast.unparse(gets[0])} (the draft's dflash_config)")
            run.parsed_at, run.fallback_key = f"{rel}:{gets[0].lineno}", _top_level_fallback(gets[0])
            return None
    return "no parse_dflash_draft_config found"


def _top_level_fallback(get: ast.Call) -> str | None:
    """The key of ``dflash_cfg.get("target_layer_ids", _cfg_get(<config>, KEY, None))``'s default: the
    top-level config key read when ``dflash_config`` has no ``target_layer_ids`` (None: no such default)."""
    if len(get.args) != 2 or get.keywords:
        return None
    d = get.args[1]
    if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "_cfg_get" and len(d.args) == 3
            and isinstance(d.args[1], ast.Constant) and isinstance(d.args[1].value, str) and _is_none(d.args[2])):
        return None
    return d.args[1].value


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _int_copy(node: ast.expr) -> bool:
    """``[int(x) for x in <ids>]``: every id, in order, as an int, nothing added or dropped."""
    if not (isinstance(node, ast.ListComp) and len(node.generators) == 1):
        return False
    gen, elt = node.generators[0], node.elt
    return (isinstance(gen.target, ast.Name) and not gen.ifs and not gen.is_async
            and isinstance(elt, ast.Call) and isinstance(elt.func, ast.Name) and elt.func.id == "int"
            and len(elt.args) == 1 and not elt.keywords
            and isinstance(elt.args[0], ast.Name) and elt.args[0].id == gen.target.id)
