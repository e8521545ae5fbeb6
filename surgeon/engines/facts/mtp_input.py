"""Which state an engine hands its MTP / NextN head: read from the target model's source.

An MTP head (DeepSeek's ``DeepSeekMultiTokenPredictorLayer``, SGLang's ``DeepseekModelNextN``)
reads the hidden state the target model's ``forward`` returns, normalises it with its own
``hnorm`` and concatenates it with the next token's embedding. Whether that returned state is
``final_norm`` (after the target's final norm) or ``layer_out[L-1]`` (the last layer's output,
before it) is what a head trained on the other one gets wrong, silently.

The reader follows the target class (the engine's registry for vLLM, ``EntryClass`` for SGLang)
to the class its ``self.model`` is built from, and in that class's ``forward`` finds, for each
``return hidden_states`` (alone or first in a tuple; other returns are a pipeline stage's
intermediate tensors), the last assignment to it: a call of ``self.norm`` (or one that is
passed ``self.norm``) means ``final_norm``; ``hidden_states + residual`` means the pre-norm
``layer_out[L-1]``; anything else is not decided (and says so).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from surgeon.engines.facts.draft_norms import parse_source, sglang_model_file, vllm_model_file
from surgeon.engines.facts.mtp_heads import MtpHead, read_mtp_head
from surgeon.engines.source.locate import EngineLocation


@dataclass
class MtpInput:
    """What the engine returns from the target, i.e. what its MTP head reads."""

    engine: str
    version: str
    model_class: str
    state: str | None  # "final_norm", "pre_norm" (layer_out[L-1]), or None: not decided
    evidence: list[str] = field(default_factory=list)  # file:line what
    reason: str | None = None  # why state is None
    head: MtpHead | None = None  # whether (and which) MTP head the engine builds for the target

    @property
    def no_head(self) -> bool:
        """The engine builds no MTP head for this target (read, not guessed)."""
        return self.head is not None and self.head.found is False

    def point(self, num_layers: int) -> str | None:
        return {"final_norm": "final_norm", "pre_norm": f"layer_out[{num_layers - 1}]"}.get(self.state or "")


class _Classes(dict[str, ast.ClassDef]):
    """The classes a model file defines, and those it imports from the engine's other model files
    (by their local name): ``rel`` says which file each came from."""

    def __init__(self) -> None:
        super().__init__()
        self.rel: dict[str, str] = {}


def _classes(tree: ast.Module, rel: str, loc: EngineLocation | None = None, depth: int = 2) -> _Classes:
    out = _Classes()
    for n in tree.body:
        if isinstance(n, ast.ClassDef):
            out[n.name], out.rel[n.name] = n, rel
    if loc is None or depth == 0:
        return out
    for n in tree.body:  # ``from <package>.<models dir>.x import Base [as Alias]``
        if not (isinstance(n, ast.ImportFrom) and n.module and n.module.startswith(f"{loc.layout.package}.")):
            continue
        sub = n.module.split(".", 1)[1].replace(".", "/") + ".py"
        if not any(sub.startswith(f"{d}/") for d in loc.models_dirs) or not (loc.root / sub).is_file():
            continue
        other = _classes(parse_source(loc.root / sub, f"{loc.layout.package}/{sub}"), f"{loc.layout.package}/{sub}",
                         loc, depth - 1)
        for a in n.names:
            local = a.asname or a.name
            if a.name in other and local not in out:
                out[local], out.rel[local] = other[a.name], other.rel[a.name]
                for k, v in other.items():  # its bases, by the names its own file gives them
                    if k not in out:
                        out[k], out.rel[k] = v, other.rel[k]
    return out


def _method_at(classes: dict[str, ast.ClassDef], name: str, method: str) -> tuple[ast.FunctionDef | None, str]:
    """(``method`` of class ``name`` or of its first base among ``classes``, the class defining it)."""
    seen: set[str] = set()
    while name in classes and name not in seen:
        seen.add(name)
        cls = classes[name]
        for n in cls.body:
            if isinstance(n, ast.FunctionDef) and n.name == method:
                return n, name
        bases = [b.id for b in cls.bases if isinstance(b, ast.Name) and b.id in classes]
        if not bases:
            return None, name
        name = bases[0]
    return None, name


def _method(classes: dict[str, ast.ClassDef], name: str, method: str) -> ast.FunctionDef | None:
    return _method_at(classes, name, method)[0]


def _class_attr(classes: dict[str, ast.ClassDef], name: str, attr: str) -> str | None:
    """``attr = X`` in class ``name`` or its bases in the file -> X."""
    seen: set[str] = set()
    while name in classes and name not in seen:
        seen.add(name)
        for n in classes[name].body:
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and any(
                    isinstance(t, ast.Name) and t.id == attr for t in n.targets):
                return n.value.id
        bases = [b.id for b in classes[name].bases if isinstance(b, ast.Name)]
        name = bases[0] if bases else ""
    return None


def _inner_model(classes: dict[str, ast.ClassDef], cls: str) -> str | None:
    """The class ``self.model`` is built from in ``cls.__init__``: ``X(...)``, ``self.<attr>(...)``
    with a class attribute ``<attr> = X``, or ``self.<method>(...)`` whose method returns ``X(...)``."""
    init = _method(classes, cls, "__init__")
    for n in ast.walk(init) if init is not None else ():
        if not (isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and any(
                isinstance(t, ast.Attribute) and t.attr == "model" and isinstance(t.value, ast.Name)
                and t.value.id == "self" for t in n.targets)):
            continue
        func = n.value.func
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            built = _class_attr(classes, cls, func.attr)
            if built is not None:
                return built
            method = _method(classes, cls, func.attr)
            for r in ast.walk(method) if method is not None else ():
                if isinstance(r, ast.Return) and isinstance(r.value, ast.Call) and isinstance(r.value.func, ast.Name):
                    return r.value.func.id
    return None


def _is_self_norm(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "norm" and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


def _kind_of(value: ast.AST) -> str | None:
    if isinstance(value, ast.Call) and (_is_self_norm(value.func) or any(_is_self_norm(a) for a in value.args)):
        return "final_norm"
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
        return "pre_norm"
    return None


def _carries(value: ast.AST, name: str) -> bool:
    """``value`` is ``name`` re-wrapped, the same state: ``name[:n]`` (a slice of its tokens),
    ``name.split(...)`` (its first piece), ``*all_gather(name, ...)`` (the ranks' tokens joined), or
    ``torch.cat([name, ...])`` (then split back: its first piece)."""
    def is_name(n: ast.AST) -> bool:
        return isinstance(n, ast.Name) and n.id == name

    if isinstance(value, ast.Subscript) and is_name(value.value) and isinstance(value.slice, ast.Slice):
        return True
    if not isinstance(value, ast.Call):
        return False
    f = value.func
    fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if fname == "split" and isinstance(f, ast.Attribute) and is_name(f.value):
        return True
    first = value.args[0] if value.args else None
    if fname.endswith("all_gather") and first is not None and is_name(first):
        return True
    return fname == "cat" and isinstance(first, (ast.List, ast.Tuple)) and bool(first.elts) and is_name(first.elts[0])


def _assignments(fn: ast.FunctionDef, name: str) -> list[tuple[int, ast.AST]]:
    """(line, value) of each assignment to ``name`` (a tuple target's first element counts)."""
    out = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                first = t.elts[0] if isinstance(t, ast.Tuple) and t.elts else t
                if isinstance(first, ast.Name) and first.id == name:
                    out.append((n.lineno, n.value))
    return sorted(out, key=lambda x: x[0])


def _returned_states(fn: ast.FunctionDef, rel: str) -> tuple[set[str | None], list[str]]:
    """The kind of state each ``return <name>`` / ``return <name>, ...`` hands back, with evidence."""
    kinds: set[str | None] = set()
    evidence: list[str] = []
    returns: dict[tuple[int, str], list[int]] = {}
    for r in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Return)), key=lambda n: n.lineno):
        v = r.value
        first = v.elts[0] if isinstance(v, ast.Tuple) and v.elts else v
        if not isinstance(first, ast.Name) or first.id != "hidden_states":
            continue  # a pipeline stage's intermediate tensors, not the last rank's output
        before = [(line, val) for line, val in _assignments(fn, first.id) if line < r.lineno]
        if not before:
            kinds.add(None)
            continue
        while len(before) > 1 and _carries(before[-1][1], first.id):
            before.pop()  # the same state re-wrapped: what it re-wraps decides
        line, val = before[-1]
        kinds.add(_kind_of(val))
        returns.setdefault((line, ast.unparse(val)[:80]), []).append(r.lineno)
    for (line, text), at in returns.items():
        evidence.append(f"{rel}:{line}: hidden_states = {text}, returned at line {', '.join(map(str, at))}")
    return kinds, evidence


def read_mtp_input(loc: EngineLocation, architecture: str) -> MtpInput:
    """The state the engine at ``loc`` hands the MTP head of an ``architecture`` target."""
    finder = vllm_model_file if loc.engine == "vllm" else sglang_model_file
    model_file, cls = finder(loc, architecture)
    ans = MtpInput(loc.engine, loc.version, cls or architecture, None, head=read_mtp_head(loc, architecture))
    if ans.no_head:
        ans.evidence = list(ans.head.evidence) if ans.head is not None else []
        ans.reason = f"{loc.engine} {loc.version} has no MTP head for {architecture}"
        return ans
    if model_file is None or cls is None:
        ans.reason = f"{loc.engine} {loc.version} has no model file for {architecture}"
        return ans
    rel = f"{loc.layout.package}/{model_file}"
    classes = _classes(parse_source(loc.root / model_file, rel), rel, loc)
    inner = _inner_model(classes, cls)
    forward, owner = _method_at(classes, inner, "forward") if inner is not None else (None, "")
    if forward is None:
        ans.reason = f"{rel}: {cls} builds no self.model whose forward is in that file or the model files it imports"
        return ans
    rel = classes.rel.get(owner, rel)
    kinds, ans.evidence = _returned_states(forward, rel)
    if len(kinds) == 1 and None not in kinds:
        ans.state = kinds.pop()
    else:
        ans.reason = f"{rel}:{forward.lineno}: {owner}.forward ({inner}'s) returned state is not decided by what was read"
    ans.evidence += _head_evidence(loc, ans.head) if ans.head is not None else []
    return ans


def _head_evidence(loc: EngineLocation, head: MtpHead) -> list[str]:
    """Where the engine maps the target to its MTP head, and where each head class normalises the
    state it is handed (``self.hnorm(...)``); where the mapping was not read, why."""
    if head.found is None:
        return [f"whether {loc.engine} {loc.version} builds an MTP head for {head.architecture} is not decided: "
                f"{head.reason}"]
    out = list(head.evidence)
    finder = vllm_model_file if loc.engine == "vllm" else sglang_model_file
    for cls in head.heads:
        model_file, _ = finder(loc, cls)
        if model_file is None:
            continue
        rel = f"{loc.layout.package}/{model_file}"
        tree = parse_source(loc.root / model_file, rel)
        for n in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: n.lineno):
            if isinstance(n.func, ast.Attribute) and n.func.attr == "hnorm" and n.args:
                out.append(f"{rel}:{n.lineno}: the MTP head ({cls}) applies hnorm to the state it is handed")
                break
    return out
