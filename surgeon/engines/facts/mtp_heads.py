"""Whether an engine has an MTP / NextN head for a target architecture, and which class it is,
read from the function that turns the target's config into its MTP draft's config.

vLLM: ``SpeculativeConfig.hf_config_override`` (``config/speculative.py``); SGLang:
``ModelConfig._config_draft_model`` (``srt/configs/model_config.py``). Each ``if`` there names
targets by architecture (``architectures[0] == "X"``, ``in [...]``) or by ``model_type``; its body
names the head (``"architectures": ["Y"]``, ``architectures[0] = "Y"``) or renames ``model_type``
to one a later ``if`` maps to a head. A target that no ``if`` names has no MTP head in that
release: vLLM then treats ``--speculative-config method=mtp`` as a draft model of the target's own
class, SGLang's NEXTN loads the target class as the draft. Where an ``if`` test is not read to
strings (a name not resolved, an ``isinstance`` of a config whose ``model_type`` is not read), a
target it might name is not decided, and the answer says which line. A negated test (``!=``,
``not in``, ``not (...)``) names its target for the ``else`` branch, not the body; a target such a
test sends to its body without naming it (``arch != "Other"``) is undecided where that body
builds a head.

A target's ``model_type`` (what vLLM's tests compare) is read from transformers'
``modeling_auto.py`` mapping tables (the ``model_type -> class`` names), not imported.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from surgeon.engines.facts.draft_norms import parse_source
from surgeon.engines.source.booltest import condition_values
from surgeon.engines.source.locate import EngineLocation

# engine -> (file under the package, function) that rewrites a target config into its MTP draft's
HEAD_SITES = {"vllm": ("config/speculative.py", "hf_config_override"),
              "sglang": ("srt/configs/model_config.py", "_config_draft_model")}


@dataclass
class MtpHead:
    """``found``: True (an ``if`` names the target), False (none does), None (not decided)."""

    architecture: str
    found: bool | None
    heads: list[str] = field(default_factory=list)  # the head class(es) the matching branch builds
    evidence: list[str] = field(default_factory=list)  # file:line what
    reason: str | None = None  # why found is None


@lru_cache(maxsize=4)
def _transformers_types() -> dict[str, frozenset[str]]:
    """class name -> the model_types transformers maps to it (modeling_auto.py's *_MAPPING_NAMES)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return {}
    file = Path(spec.origin).parent / "models" / "auto" / "modeling_auto.py"
    if not file.is_file():
        return {}
    out: dict[str, set[str]] = {}
    for node in ast.walk(parse_source(file, "transformers/models/auto/modeling_auto.py")):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args
                and any(isinstance(t, ast.Name) and t.id.endswith("_MAPPING_NAMES") for t in node.targets)):
            continue
        for pair in getattr(node.value.args[0], "elts", []):
            if isinstance(pair, ast.Tuple) and len(pair.elts) == 2 and isinstance(pair.elts[0], ast.Constant):
                for cls in _strings(pair.elts[1]) or ():
                    out.setdefault(cls, set()).add(str(pair.elts[0].value))
    return {k: frozenset(v) for k, v in out.items()}


def model_types(architecture: str) -> frozenset[str]:
    """The ``model_type`` values a checkpoint of ``architecture`` carries, per transformers."""
    return _transformers_types().get(architecture, frozenset())


def _strings(node: ast.AST) -> list[str] | None:
    """A string constant or a literal tuple/list/set of them; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        out = []
        for e in node.elts:
            if isinstance(e, ast.Starred):
                return None
            s = _strings(e)
            if s is None:
                return None
            out += s
        return out
    return None


class _Site:
    """The rewrite function's file: module-level string tuples and imported names it resolves."""

    def __init__(self, loc: EngineLocation, rel_file: str):
        self.loc = loc
        self.rel = f"{loc.layout.package}/{rel_file}"
        self.tree = parse_source(loc.root / rel_file, self.rel)
        self.consts = {t.id: s for n in self.tree.body if isinstance(n, ast.Assign)
                       for t in n.targets if isinstance(t, ast.Name) and (s := _strings(n.value)) is not None}

    def imported_config_type(self, fn: ast.FunctionDef, name: str) -> str | None:
        """``model_type = "..."`` of the config class ``name`` imported in ``fn`` or the module."""
        for n in [*ast.walk(fn), *self.tree.body]:
            if isinstance(n, ast.ImportFrom) and n.module and any(a.name == name for a in n.names):
                file = self.loc.root.parent / (n.module.replace(".", "/") + ".py")
                if not file.is_file():
                    return None
                for c in ast.walk(parse_source(file, n.module)):
                    if isinstance(c, ast.ClassDef) and c.name == name:
                        for s in c.body:
                            if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "model_type"
                                                                 for t in s.targets):
                                v = _strings(s.value)
                                return v[0] if v else None
        return None


def _locals(fn: ast.FunctionDef) -> set[str]:
    names = {a.arg for a in fn.args.args}
    for n in ast.walk(fn):
        if isinstance(n, (ast.Assign, ast.NamedExpr, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


TARGET_WORDS = frozenset({"model_type", "architectures", "architecture", "arch", "archs"})


def _about_target(e: ast.expr, names: frozenset[str]) -> bool:
    """Whether ``e`` is (an expression over) the target's model type or architecture names: an
    attribute or name of :data:`TARGET_WORDS`, or a local assigned from one (``names``)."""
    return any((isinstance(n, ast.Attribute) and n.attr in TARGET_WORDS)
               or (isinstance(n, ast.Name) and (n.id in TARGET_WORDS or n.id in names)) for n in ast.walk(e))


def _target_names(fn: ast.FunctionDef) -> frozenset[str]:
    """Locals of ``fn`` assigned from the target's model type or architectures, to a fixed point."""
    names: set[str] = set()
    while True:
        more = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and _about_target(n.value, frozenset(names))
                for t in n.targets if isinstance(t, ast.Name)} - names
        if not more:
            return frozenset(names)
        names |= more


class _Test:
    """A branch test read for one target. A comparison of a string (or a module's string tuple) with
    the target's model type or architecture (:func:`_about_target`) is decided for the target:
    ``==``/``in`` hold where it names the target, ``!=``/``not in`` where it does not; ``isinstance``
    of an imported config class is decided by its ``model_type``. Every other condition (a flag, a
    method's name, a length, a name not resolved) is free: either value may hold."""

    def __init__(self, site: _Site, fn: ast.FunctionDef, arch: str, types: frozenset[str]):
        self.site, self.fn, self.arch, self.types = site, fn, arch, types
        self.local = _locals(fn)
        self.about = _target_names(fn)
        self.named = False  # a decided atom mentions the target
        self.unread = False  # an atom's strings (or config class) were not resolved

    def _pair(self, left: ast.expr, op: ast.cmpop, right: ast.expr) -> bool | None:
        """One ``left op right`` for the target; None: free."""
        sides = []
        for operand in (left, right):
            words = _strings(operand)
            if words is None and isinstance(operand, ast.Name) and operand.id not in self.local:
                words = self.site.consts.get(operand.id)
                self.unread |= words is None
            sides.append(words)
        i = 0 if sides[0] is not None else 1 if sides[1] is not None else None
        if i is None or not _about_target((right, left)[i], self.about):
            return None  # a string compared with something else than the target's name (a method, a flag)
        words = sides[i]
        assert words is not None
        hit = self.arch in words or bool(self.types & set(words))
        if isinstance(op, (ast.In, ast.NotIn)) and isinstance((left, right)[i], ast.Constant):
            # "x" in model_type: x a substring of it; model_type in "x" (a string, not a tuple): the reverse
            hit |= any((words[0] in t) if i == 0 else (t in words[0]) for t in self.types)
        self.named |= hit
        return not hit if isinstance(op, (ast.NotEq, ast.NotIn, ast.IsNot)) else hit

    def atom(self, n: ast.expr) -> bool | None:
        """A leaf of the test's and/or/not for the target; None: free."""
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance" and len(n.args) == 2:
            cls = n.args[1]
            mt = self.site.imported_config_type(self.fn, cls.id) if isinstance(cls, ast.Name) else None
            if mt is None:
                self.unread = True
                return None
            self.named |= mt in self.types
            return mt in self.types
        if isinstance(n, ast.Compare):
            values = [self._pair(a, op, b) for a, op, b in zip([n.left, *n.comparators], n.ops, n.comparators)]
            if False in values:
                return False
            return True if all(v is True for v in values) else None
        inner = _Test(self.site, self.fn, self.arch, self.types)
        for m in ast.walk(n):
            if m is not n and isinstance(m, (ast.Compare, ast.Call)):
                inner.atom(m)
        self.named |= inner.named  # named inside a call this reader does not evaluate: not decided
        self.unread |= inner.unread
        return None

    def outcomes(self, test: ast.expr) -> set[bool]:
        """The values ``test`` can take for the target, over every value of its free conditions (both,
        and the test marked unread, where too many are free to evaluate)."""
        seen = condition_values(test, self.atom)
        if seen is None:
            self.unread = True
            return {True, False}
        return seen


def _names_target(site: _Site, fn: ast.FunctionDef, test: ast.expr, arch: str,
                  types: frozenset[str]) -> str | bool | None:
    """Where ``test`` sends ``arch`` (or one of its model ``types``): ``"body"`` or ``"else"`` where it
    names the target (``arch == "X"`` -> body, ``arch != "X"`` / ``not in`` / ``not (...)`` -> else);
    ``"unnamed"``: it sends the target to its body without naming it (``arch != "Other"``); False:
    it does not select the target; None: not read to strings, or not decided by the target."""
    mine = _Test(site, fn, arch, types)
    seen = mine.outcomes(test)
    if not mine.named:
        return None if mine.unread else "unnamed" if seen == {True} else False
    if len(seen) == 1:
        return "body" if True in seen else "else"
    other = _Test(site, fn, "\0", frozenset()).outcomes(test)  # a target no string names
    if other == {False}:
        return "body"  # naming the target opens the body (another condition may still close it)
    return "else" if other == {True} else None


def _heads_in(body: list[ast.stmt]) -> tuple[list[str], list[str]]:
    """(head classes the statements name, model_types they rename the config to)."""
    heads: list[str] = []
    renames: list[str] = []
    for n in (m for s in body for m in ast.walk(s)):
        if isinstance(n, ast.Dict):
            for k, v in zip(n.keys, n.values):
                if isinstance(k, ast.Constant) and k.value == "architectures":
                    for e in getattr(v, "elts", []):
                        branches = [e.body, e.orelse] if isinstance(e, ast.IfExp) else [e]
                        heads += [h for b in branches for h in _strings(b) or []]
        if isinstance(n, ast.Assign):
            for t in n.targets:
                base = t.value if isinstance(t, ast.Subscript) else t
                if isinstance(base, ast.Attribute) and base.attr == "architectures":
                    heads += _strings(n.value) or []
                if isinstance(t, ast.Attribute) and t.attr == "model_type":
                    renames += _strings(n.value) or []
    return heads, renames


def read_mtp_head(loc: EngineLocation, architecture: str) -> MtpHead:
    """Whether the engine at ``loc`` builds an MTP head for an ``architecture`` target, and which."""
    rel_file, name = HEAD_SITES[loc.engine]
    if not (loc.root / rel_file).is_file():
        return MtpHead(architecture, None, reason=f"{loc.layout.package}/{rel_file} is absent: where {loc.engine} "
                       "maps a target to its MTP head was not read")
    site = _Site(loc, rel_file)
    fn = next((n for n in ast.walk(site.tree) if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None:
        return MtpHead(architecture, None, reason=f"{site.rel} defines no {name}: the MTP head mapping was not read")
    types = model_types(architecture)
    ifs = sorted((n for n in ast.walk(fn) if isinstance(n, ast.If)), key=lambda n: n.lineno)
    unread, unnamed = [], []
    for i, node in enumerate(ifs):
        named = _names_target(site, fn, node.test, architecture, types)
        if named is None:
            unread.append(node.lineno)
        if not named:
            continue
        branch = node.orelse if named == "else" else node.body
        if named == "else" and (not branch or len(branch) == 1 and isinstance(branch[0], ast.If)):
            continue  # the target skips the body (an elif is read as its own test)
        heads, renames = _heads_in(branch)
        for later in ifs[i + 1:] if not heads else ():
            if renames and _names_target(site, fn, later.test, "", frozenset(renames)) == "body":
                heads += _heads_in(later.body)[0]
        if named == "unnamed" or (named == "else" and not heads):
            if heads or renames:
                unnamed.append(node.lineno)
            continue
        what = " or ".join(dict.fromkeys(heads)) or "a head whose class was not read"
        return MtpHead(architecture, True, list(dict.fromkeys(heads)),
                       [f"{site.rel}:{node.lineno}: {name} maps {architecture} to {what}"])
    typed = f" (model_type {', '.join(sorted(types))})" if types else ""
    if unread:
        return MtpHead(architecture, None, reason=f"{site.rel}: {name} names no {architecture}{typed}, but the "
                       f"tests at line {', '.join(map(str, unread))} were not read to strings")
    if unnamed:
        return MtpHead(architecture, None, reason=f"{site.rel}: {name} names no {architecture}{typed}, but the "
                       f"branch of the test at line {', '.join(map(str, unnamed))} that it takes without naming it "
                       "(!= / not in / not) renames the config or builds a head")
    if not types and any(_mentions_model_type(n.test) for n in ifs):
        return MtpHead(architecture, None, reason=f"{site.rel}: {name} selects some heads by model_type, and the "
                       f"model_type of {architecture} is not in transformers' mapping tables")
    return MtpHead(architecture, False, evidence=[
        f"{site.rel}:{fn.lineno}: {name} names no {architecture}{typed} in any of its {len(ifs)} tests"])


def _mentions_model_type(test: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "model_type" or
               isinstance(n, ast.Constant) and n.value == "model_type" for n in ast.walk(test))
