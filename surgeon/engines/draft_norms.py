"""How an engine reads a draft's EAGLE 3.1 norm flags, read from its source.

The flags (speculators' names: ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``,
``norm_output``) change the draft's forward; an engine that does not read one builds the model as
if it were unset, and serves a draft trained with it wrong, silently. So the answer is read from
the engine's draft model file: every ``getattr(<config>, "<flag>", default)`` and
``<dict>.get("<flag>", default)`` is a read, with its file:line, the key it reads (the top-level
config or ``eagle_config``) and its default. vLLM turns a speculators-format config into its own
through the function ``register_speculator(<type>)`` registers
(``transformers_utils/configs/speculators/algos.py``); the flags that function copies, and the
defaults it gives them, are read the same way.

Nothing is imported from the engine; a file that cannot be parsed is refused in one line.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgeon.core.errors import BadInput
from surgeon.core.spec import NORM_FLAGS
from surgeon.engines.locate import EngineLocation

# Other names an engine reads for a flag (SGLang's legacy ``use_aux_norm`` enables ``fc_norm``).
ALIASES = {"use_aux_norm": "fc_norm"}
SPECULATORS_ALGOS = "transformers_utils/configs/speculators/algos.py"
VLLM_REGISTRY = "model_executor/models/registry.py"
_NO_DEFAULT = object()


@dataclass(frozen=True)
class FlagRead:
    """One place the engine's source reads a flag."""

    flag: str  # the flag it sets (an alias's target)
    key: str  # what it reads: "config.<name>" or "eagle_config.<name>"
    path: str  # relative to the engine package
    line: int
    default: Any = None  # the value when the key is absent (None: no default written)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class NormReading:
    """An engine's reads of the norm flags for one draft model file."""

    engine: str
    version: str
    model_file: str | None  # relative to the engine package; None: no file found for the class
    model_class: str | None
    reads: dict[str, list[FlagRead]] = field(default_factory=dict)  # flag -> reads, in source order
    # vLLM, speculators-format configs only: flag -> the algos.py read that copies it (absent: dropped)
    translation: dict[str, FlagRead] | None = None
    translation_where: str | None = None

    def effective(self, flag: str, config: dict) -> tuple[bool, str]:
        """The value the engine builds the draft with, given the draft's config.json, and why."""
        source, prefix = config, ""
        if self.translation is not None:  # vLLM rewrites a speculators config into its own first
            t = self.translation.get(flag)
            if t is None:
                return False, f"{self.translation_where} does not copy {flag} from a speculators config"
            source = {flag: config.get(flag, t.default)}
            prefix = f"{t.where}: copies {flag}" + ("" if flag in config else f", absent so {t.default}") + "; "
        nested = source.get("eagle_config")
        eagle_config = nested if isinstance(nested, dict) else {}
        reads = self.reads.get(flag, [])
        if not reads:
            return False, f"{prefix}{self.model_file or 'no draft model file'} never reads {flag}"
        for r in reads:
            scope, _, name = r.key.partition(".")
            holder = eagle_config if scope == "eagle_config" else source
            if holder.get(name) is not None:
                return bool(holder[name]), f"{prefix}{r.where}: reads {r.key}"
        r = reads[-1]
        return bool(r.default), f"{prefix}{r.where}: {r.key} absent, default {r.default}"


def _literal(node: ast.AST | None) -> Any:
    if node is None:
        return _NO_DEFAULT
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return _NO_DEFAULT


def _read_of(call: ast.Call, path: str) -> FlagRead | None:
    """A flag read in ``call``: ``getattr(obj, "flag", d)`` or ``obj.get("flag", d)``."""
    if isinstance(call.func, ast.Name) and call.func.id == "getattr" and len(call.args) >= 2:
        name_node, default_node, scope = call.args[1], call.args[2] if len(call.args) > 2 else None, "config"
    elif isinstance(call.func, ast.Attribute) and call.func.attr == "get" and call.args:
        name_node, default_node = call.args[0], call.args[1] if len(call.args) > 1 else None
        owner = call.func.value
        scope = "eagle_config" if isinstance(owner, ast.Name) and owner.id == "eagle_config" else "config"
    else:
        return None
    if not isinstance(name_node, ast.Constant) or not isinstance(name_node.value, str):
        return None
    name = name_node.value
    flag = ALIASES.get(name, name)
    if flag not in NORM_FLAGS:
        return None
    default = _literal(default_node)
    if isinstance(default_node, ast.Call):  # a nested read is the fallback: its default counts
        inner = _read_of(default_node, path)
        default = inner.default if inner is not None else None
    return FlagRead(flag, f"{scope}.{name}", path, call.lineno, None if default is _NO_DEFAULT else default)


def parse_source(file: Path, rel: str) -> ast.Module:
    try:
        return ast.parse(file.read_text(encoding="utf-8"), filename=rel)
    except SyntaxError as e:
        raise BadInput(f"{file}:{e.lineno or 0}:{e.offset or 0}: cannot parse: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{file}: cannot read: {e}") from None


def flag_reads(tree: ast.AST, rel: str) -> dict[str, list[FlagRead]]:
    """Every norm-flag read under ``tree``, by flag, in source order."""
    out: dict[str, list[FlagRead]] = {}
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    for call in calls:
        r = _read_of(call, rel)
        if r is not None:
            out.setdefault(r.flag, []).append(r)
    return out


def vllm_model_file(loc: EngineLocation, arch: str) -> tuple[str | None, str | None]:
    """(module file, class) the vLLM registry maps ``arch`` to."""
    registry = loc.root / VLLM_REGISTRY
    if not registry.is_file():
        return None, None
    m = re.search(rf'"{re.escape(arch)}"\s*:\s*\(\s*"(\w+)"\s*,\s*"(\w+)"', registry.read_text(encoding="utf-8"))
    if m is None:
        return None, None
    for d in loc.models_dirs:
        if (loc.root / d / f"{m.group(1)}.py").is_file():
            return f"{d}/{m.group(1)}.py", m.group(2)
    return None, m.group(2)


def sglang_model_file(loc: EngineLocation, arch: str) -> tuple[str | None, str | None]:
    """The SGLang model file whose ``EntryClass`` names ``arch``."""
    pattern = re.compile(rf"^EntryClass\s*=.*\b{re.escape(arch)}\b", re.M)
    for f in sorted(loc.models_dir.glob("*.py")):
        if pattern.search(f.read_text(encoding="utf-8", errors="replace")):
            return f"{loc.layout.models_dir}/{f.name}", arch
    return None, arch


def _speculators_translation(loc: EngineLocation, algo: str) -> tuple[dict[str, FlagRead] | None, str]:
    """The flags vLLM's registered speculators function for ``algo`` copies (flag -> its read)."""
    file = loc.root / SPECULATORS_ALGOS
    rel = f"{loc.layout.package}/{SPECULATORS_ALGOS}"
    if not file.is_file():
        return None, f"{rel} is absent: this vLLM does not read speculators configs"
    for node in ast.walk(parse_source(file, rel)):
        if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Call) and d.args and _literal(d.args[0]) == algo for d in node.decorator_list):
            reads = flag_reads(node, rel)
            return {f: rs[0] for f, rs in reads.items()}, f"{rel}:{node.lineno} ({node.name})"
    return None, f"{rel} registers no speculators type {algo!r}"


def speculators_model(config: dict) -> str:
    """The architecture vLLM's speculators translation picks (algos.py's arch map, by the
    transformer layer's model_type)."""
    layer = config.get("transformer_layer_config")
    model_type = layer.get("model_type", "llama") if isinstance(layer, dict) else "llama"
    return "Eagle3Qwen3ForCausalLM" if model_type == "qwen3" else "Eagle3LlamaForCausalLM"


def read_norms(loc: EngineLocation, config: dict) -> NormReading:
    """How the engine at ``loc`` reads the norm flags of the draft whose config.json is ``config``."""
    algo = config.get("speculators_model_type")
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    reading = NormReading(loc.engine, loc.version, None, arch)
    if loc.engine == "vllm" and isinstance(algo, str):
        reading.translation, reading.translation_where = _speculators_translation(loc, algo)
        arch = speculators_model(config)
    if arch is None:
        arch = "Eagle3LlamaForCausalLM" if loc.engine == "vllm" else "LlamaForCausalLMEagle3"
    finder = vllm_model_file if loc.engine == "vllm" else sglang_model_file
    reading.model_file, reading.model_class = finder(loc, arch)
    if reading.model_file is not None:
        rel = f"{loc.layout.package}/{reading.model_file}"
        reading.reads = flag_reads(parse_source(loc.root / reading.model_file, rel), rel)
        reading.model_file = rel
    return reading
