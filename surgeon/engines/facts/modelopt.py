"""NVIDIA Model Optimizer (``nvidia-modelopt``) read from its source, never imported.

What the library part of its wheel decides about layer ids, each with file:line:

- ``default_eagle_aux_layer_ids(num_layers)`` (the EAGLE-3 preset, ``--aux-layers eagle``) and
  ``build_target_layer_ids(num_layers, num_draft_layers)`` (the DFlash preset) are evaluated from
  their parsed bodies (:mod:`surgeon.engines.source.pureeval`) for the model's layer count; a value is
  cited by the ``return`` statement that produced it (``*_cited``: ``build_target_layer_ids``
  returns early for one draft layer), the static evidence lists every ``return`` of the body;
- how its own HF training reads an id: a forward hook on decoder layer k (EAGLE-3), or
  ``hidden_states[k + offset]`` over ``target_layer_ids`` (DFlash), both the output of layer k.

Its hidden-state collection scripts (hf, vllm, trtllm backends) live in the GitHub repository's
``examples/``, not in the wheel: they are a cited table (:mod:`surgeon.engines.facts.field_tables`).

The source is found, in order: ``root`` when given, ``.engines/nvidia-modelopt-*/modelopt``
(scripts/fetch-engines puts the wheel's Python files there) under this repository, then an
installed ``modelopt`` (located with ``find_spec``, which runs nothing). Never the working
directory: an answer does not depend on where the command is run.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from surgeon.core.errors import BadInput
from surgeon.engines.source.locate import tool_packages
from surgeon.engines.source.pureeval import NotPure, evaluate_function
from surgeon.engines.source.reading import SOURCE_ERRORS, dist_version, read_source

EAGLE_FILE = "torch/speculative/plugins/hf_eagle.py"
DFLASH_FILE = "torch/speculative/plugins/modeling_dflash.py"
DFLASH_HF_FILE = "torch/speculative/plugins/hf_dflash.py"
EAGLE_FN = "default_eagle_aux_layer_ids"
DFLASH_FN = "build_target_layer_ids"
DFLASH_DRAFT_LAYERS = 5  # examples/.../common.py:35 _DFLASH_DEFAULT_NUM_DRAFT_LAYERS (cited, see field_tables)
REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Read:
    """One fact read from the source: where, and what it says."""

    path: str  # relative to the package's parent (``modelopt/torch/...``)
    line: int
    says: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.says}"


@dataclass
class ModeloptSource:
    root: Path  # the ``modelopt`` package directory
    version: str
    functions: dict[str, tuple[ast.FunctionDef, str]] = field(default_factory=dict)  # name -> (node, path)
    reads: dict[str, Read] = field(default_factory=dict)  # eagle_default, dflash_preset, eagle_hook, dflash_offset

    @property
    def origin(self) -> str:
        return f"nvidia-modelopt {self.version} source at {self.root}"

    def evaluate(self, name: str, *args: int) -> list[int]:
        """The named preset function for these arguments, from its parsed body."""
        return self.evaluate_cited(name, *args)[0]

    def evaluate_cited(self, name: str, *args: int) -> tuple[list[int], Read]:
        """:meth:`evaluate` and the ``return`` statement of the body that produced the value."""
        if name not in self.functions:
            raise BadInput(f"modelopt {self.version}: {name} was not found in its source")
        node, path = self.functions[name]
        call = f"{name}({', '.join(map(str, args))})"
        where = f"modelopt {self.version}: {path}:{node.lineno}: {call}"
        try:
            result = evaluate_function(node, *args)  # any failure of the body is NotPure, one line
        except NotPure as e:
            raise BadInput(f"{where}: {e}") from None
        value = result.value
        if not isinstance(value, list | tuple | set) or not all(type(v) is int for v in value):
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise BadInput(f"{where}: returned {shown}, not a collection of integer layer ids")
        ret = result.returned
        return list(value), Read(path, ret.lineno, f"{call} = {list(value)}, returned by `{ast.unparse(ret)}`")

    def eagle_default(self, num_layers: int) -> list[int]:
        """``--aux-layers eagle``: 0-based layer-output ids (examples/.../common.py returns them as is)."""
        return self.eagle_default_cited(num_layers)[0]

    def eagle_default_cited(self, num_layers: int) -> tuple[list[int], Read]:
        return self.evaluate_cited(EAGLE_FN, num_layers)

    def dflash_preset(self, num_layers: int, num_draft_layers: int = DFLASH_DRAFT_LAYERS) -> list[int]:
        """``--aux-layers dflash``: common.py sorts and de-duplicates the library's list."""
        return self.dflash_preset_cited(num_layers, num_draft_layers)[0]

    def dflash_preset_cited(self, num_layers: int, num_draft_layers: int = DFLASH_DRAFT_LAYERS) -> tuple[list[int], Read]:
        ids, read = self.evaluate_cited(DFLASH_FN, num_layers, num_draft_layers)
        return sorted(set(ids)), read


def _find_function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def _eagle_hook(tree: ast.Module, path: str) -> Read | None:
    """``if layer_idx in ...eagle_aux_hidden_state_layer_ids: layer.register_forward_hook(...)``."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.ops[0], ast.In)
                and ast.unparse(node.test.comparators[0]).endswith("eagle_aux_hidden_state_layer_ids")):
            continue
        hooks = [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                 and c.func.attr == "register_forward_hook"]
        if hooks:
            return Read(path, node.lineno, f"`{ast.unparse(node.test)}`: a forward hook on decoder layer k for "
                        "each id k collects that layer's output, the output of layer k (layer_out[k])")
    return None


def _int_constants(fn: ast.FunctionDef) -> dict[str, int]:
    """Names ``fn`` binds exactly once, to an integer literal (``offset = 1``)."""
    bound: dict[str, list[ast.AST]] = {}
    for node in ast.walk(fn):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in ast.walk(target)]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.NamedExpr):
            targets = [node.target]
        elif isinstance(node, ast.For | ast.comprehension):
            targets = list(ast.walk(node.target))
        for t in targets:
            if isinstance(t, ast.Name):
                bound.setdefault(t.id, []).append(node)
    return {name: node.value.value for name, (node, *more) in bound.items()
            if not more and isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and type(node.value.value) is int}


def _over_target_ids(fn: ast.FunctionDef) -> list[tuple[str, list[ast.AST]]]:
    """(loop variable, where it is bound) of each loop or comprehension over ``...target_layer_ids``."""
    def is_ids(it: ast.expr) -> bool:
        return (isinstance(it, ast.Attribute) and it.attr == "target_layer_ids"
                or isinstance(it, ast.Name) and it.id == "target_layer_ids")
    out: list[tuple[str, list[ast.AST]]] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and is_ids(node.iter):
            out.append((node.target.id, list(node.body)))
        elif isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp) and len(node.generators) == 1:
            gen = node.generators[0]
            if isinstance(gen.target, ast.Name) and is_ids(gen.iter):
                out.append((gen.target.id, [node.elt, *gen.ifs]))
    return out


def _dflash_offset(tree: ast.Module, path: str) -> Read | None:
    """``offset = 1`` then ``hidden_states[lid + offset] for lid in self.target_layer_ids``: id k
    reads HF hidden_states[k + 1]. The index must be the loop variable over ``target_layer_ids``
    plus a name bound once to an integer; any other ``hidden_states[x + name]`` is not this read."""
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        offsets = _int_constants(fn)
        for var, scope in _over_target_ids(fn):
            for sub in (n for part in scope for n in ast.walk(part)):
                if (isinstance(sub, ast.Subscript) and ast.unparse(sub.value).endswith("hidden_states")
                        and isinstance(sub.slice, ast.BinOp) and isinstance(sub.slice.op, ast.Add)
                        and isinstance(sub.slice.left, ast.Name) and sub.slice.left.id == var
                        and isinstance(sub.slice.right, ast.Name) and sub.slice.right.id in offsets):
                    value = offsets[sub.slice.right.id]
                    return Read(path, sub.lineno, f"`{ast.unparse(sub)}` for {var} in target_layer_ids, with "
                                f"{sub.slice.right.id} = {value}: target_layer_ids k reads HF hidden_states[k + {value}]"
                                + (" (the output of layer k)" if value == 1 else ""))
    return None


def _version(package: Path) -> str:
    return dist_version(package.parent, "nvidia_modelopt") or "unknown"


def _returns(fn: ast.FunctionDef, path: str) -> Read:
    """A preset's static evidence: its one ``return``, or every one (the value's own citation,
    ``evaluate_cited``, names the one executed for given arguments)."""
    rets = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Return)), key=lambda r: r.lineno)
    if len(rets) == 1:
        return Read(path, rets[0].lineno, f"{fn.name}: {ast.unparse(rets[0])}")
    listed = "; ".join(f"{r.lineno}: `{ast.unparse(r)}`" for r in rets) or "none"
    return Read(path, fn.lineno, f"{fn.name} returns at {listed} (which one depends on the arguments)")


@lru_cache(maxsize=8)
def _read(package: Path) -> ModeloptSource:
    src = ModeloptSource(package, _version(package))
    for rel, fn_name, key in ((EAGLE_FILE, EAGLE_FN, "eagle_default"), (DFLASH_FILE, DFLASH_FN, "dflash_preset")):
        path = package / rel
        try:
            tree = ast.parse(read_source(path), filename=str(path))
        except (FileNotFoundError, *SOURCE_ERRORS):
            continue
        shown = f"modelopt/{rel}"
        node = _find_function(tree, fn_name)
        if node is not None:
            src.functions[fn_name] = (node, shown)
            src.reads[key] = _returns(node, shown)
        if key == "eagle_default":
            hook = _eagle_hook(tree, shown)
            if hook is not None:
                src.reads["eagle_hook"] = hook
    path = package / DFLASH_HF_FILE
    if path.is_file():
        found = _dflash_offset(ast.parse(read_source(path)), f"modelopt/{DFLASH_HF_FILE}")
        if found is not None:
            src.reads["dflash_offset"] = found
    return src


def candidates(root: str | Path | None = None) -> list[Path]:
    """Package directories to try, best first."""
    if root is not None:
        p = Path(root)
        return [p / "modelopt" if (p / "modelopt").is_dir() else p]
    return tool_packages(REPO_ROOT / ".engines", "nvidia-modelopt", "modelopt")  # not the working directory's


def open_modelopt(root: str | Path | None = None) -> ModeloptSource | None:
    """The Model Optimizer source, or None when none is on this machine (then answers come from
    the cited table and say so). A ``root`` that is not a Model Optimizer package is bad input."""
    for package in candidates(root):
        if (package / EAGLE_FILE).exists():
            return _read(package.resolve())
    if root is not None:
        raise BadInput(f"{root}: no modelopt/{EAGLE_FILE} there: not a Model Optimizer source")
    return None
