"""How the trainers read the EAGLE 3.1 norm flags, from their real source, never imported.

SpecForge (``specforge`` on PyPI, a pure-Python wheel): its draft classes are registered with
``@register_draft`` in ``specforge/modeling/draft/*.py`` under the name a draft config's
``architectures[0]`` carries; that class's file is read like an engine's draft model file
(:func:`surgeon.engines.facts.draft_norms.flag_reads`: each read followed to its use by
:mod:`surgeon.engines.facts.norm_flow`). One meaning is read besides: SpecForge's EAGLE-3 training
loop (``specforge/algorithms/eagle3/model.py``) takes its logits from one method of the draft
(``compute_logits``) and the state it feeds to the next step from another (``backbone``); a
``norm_output`` used only in the logits method selects the norm before ``lm_head``, not the
normed state fed back that speculators and vLLM mean by it. SpecForge 0.2.0 (PyPI, 2026-08; the
same files as GitHub sgl-project/SpecForge@a6b6b02) does so: its EAGLE 3.1 support (PR #568,
2026-05-27: "draft model output norm, fc norm on target hidden states") reads ``fc_norm`` and
``norm_output`` only, and PR #879 ("Fix eagle3/eagle3.1 hidden states normalisation", merged
2026-09-15, after 0.2.0) says of it: with ``norm_output`` false neither lm_head's input nor the next
state is normed, "neither of eagle3 nor eagle3.1"; with it true, the EAGLE-3 state.

speculators (``speculators`` on PyPI): the defaults of ``Eagle3SpeculatorConfig``
(``speculators/models/eagle3/config.py``, pydantic ``Field(default=...)``) are what a draft
config that leaves a flag unset was trained with, where its ``Eagle3DraftModel``
(``models/eagle3/core.py``, ``config.<flag>`` loads followed by norm_flow, into the first-layer
classes of ``model_definitions.py`` for ``norm_before_residual``) uses the flag.

Sources are found, in order: ``root`` when given, ``.engines/<dist>-*/<package>`` (put there by
scripts/fetch-engines) under this repository, then an installed package (``find_spec``, which
runs nothing). ``python -m surgeon.engines.facts.trainer_norms specforge|speculators DIR`` confirms the
cited table below against a checkout and prints what the analysis reads there.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from surgeon.core.errors import BadInput
from surgeon.core.spec import NORM_FLAGS
from surgeon.engines.facts.draft_norms import FlagRead, NormReading, model_reads, parse_module, parse_source
from surgeon.engines.facts.norm_flow import FlagUse, ValueFlow
from surgeon.engines.source.locate import tool_packages
from surgeon.engines.source.reading import dist_version, read_source

REPO_ROOT = Path(__file__).resolve().parents[3]
DRAFT_DIR = "modeling/draft"
LOOP_FILE = "algorithms/eagle3/model.py"
SPECULATORS_CONFIG = "models/eagle3/config.py"
SPECULATORS_CLASS = "Eagle3SpeculatorConfig"
SPECULATORS_MODEL = "models/eagle3/core.py"  # Eagle3DraftModel: reads config.<flag>
SPECULATORS_LAYERS = "models/eagle3/model_definitions.py"  # the first-layer classes core.py passes flags to
DEFAULT_ARCH = "LlamaForCausalLMEagle3"

# SpecForge 0.2.0 (PyPI wheel) = github sgl-project/SpecForge@a6b6b0230009d15ec2a97a57384e6f53f0f96946
# (2026-08-08; both files below identical): (path under specforge/, line, the exact text, stripped).
SPECFORGE_COMMIT = "a6b6b0230009d15ec2a97a57384e6f53f0f96946"
SPECFORGE_TABLE = [
    ("modeling/draft/llama3_eagle.py", 1625, "residual = hidden_states"),  # before hidden_norm: no norm_before_residual
    ("modeling/draft/llama3_eagle.py", 1627, "hidden_states = self.hidden_norm(hidden_states)"),
    ("modeling/draft/llama3_eagle.py", 1653, "@register_draft"),
    ("modeling/draft/llama3_eagle.py", 1654, "class LlamaForCausalLMEagle3(Eagle3DraftModel):"),
    ("modeling/draft/llama3_eagle.py", 1679, 'if getattr(config, "fc_norm", False):'),
    ("modeling/draft/llama3_eagle.py", 1690, 'self.norm_output = getattr(config, "norm_output", True)'),
    ("modeling/draft/llama3_eagle.py", 1764, "if self.fc_norm is not None:"),
    ("modeling/draft/llama3_eagle.py", 1772, "def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:"),
    ("modeling/draft/llama3_eagle.py", 1773, "if self.norm_output:"),
    ("algorithms/eagle3/model.py", 386, "hidden_states_out = self.draft_model.backbone("),
    ("algorithms/eagle3/model.py", 397, "hidden_states = hidden_states_out"),
    ("algorithms/eagle3/model.py", 400, "logits = self.draft_model.compute_logits(hidden_states)"),
]
# what the analysis answers there, per flag: (state, the use's file:line under specforge/)
SPECFORGE_ANSWERS = {"norm_before_residual": ("not_read", None), "norm_before_fc": ("not_read", None),
                     "fc_norm": ("used", "modeling/draft/llama3_eagle.py:1764"),
                     "norm_output": ("used", "modeling/draft/llama3_eagle.py:1773")}
# speculators 0.9.0 (PyPI wheel), speculators/models/eagle3/config.py: each flag's Field(default=False)
SPECULATORS_TABLE = [(SPECULATORS_CONFIG, 43, "norm_before_residual: bool = Field("),
                     (SPECULATORS_CONFIG, 44, "default=False,"),
                     (SPECULATORS_CONFIG, 58, "norm_before_fc: bool = Field("),
                     (SPECULATORS_CONFIG, 59, "default=False,"),
                     (SPECULATORS_CONFIG, 66, "fc_norm: bool = Field("),
                     (SPECULATORS_CONFIG, 67, "default=False,"),
                     (SPECULATORS_CONFIG, 76, "norm_output: bool = Field("),
                     (SPECULATORS_CONFIG, 77, "default=False,"),
                     (SPECULATORS_MODEL, 88, "norm_before_residual=self.config.norm_before_residual,"),
                     (SPECULATORS_MODEL, 122, "if config.norm_before_fc:"),
                     (SPECULATORS_MODEL, 131, "if config.fc_norm:"),
                     (SPECULATORS_MODEL, 236, "if self.input_norm is not None:"),
                     (SPECULATORS_MODEL, 238, "if self.fc_norm is not None:"),
                     (SPECULATORS_MODEL, 302, "if self.config.norm_output:"),
                     (SPECULATORS_LAYERS, 80, "if self.norm_before_residual:")]
# where speculators 0.9.0's Eagle3DraftModel uses each flag (under speculators/)
SPECULATORS_ANSWERS = {"norm_before_residual": f"{SPECULATORS_LAYERS}:80", "norm_before_fc": f"{SPECULATORS_MODEL}:236",
                       "fc_norm": f"{SPECULATORS_MODEL}:238", "norm_output": f"{SPECULATORS_MODEL}:302"}


@dataclass(frozen=True)
class Source:
    """A trainer's package directory (``.../specforge``) and its version."""

    dist: str
    package: Path
    version: str

    def rel(self, path: str) -> str:
        return f"{self.package.name}/{path}"


def _version(package: Path, dist: str) -> str:
    found = dist_version(package.parent, dist)
    if found is not None:
        return found
    for f in (package.parent / "version.txt", package / "version.txt"):
        if f.is_file():
            return read_source(f).strip() or "checkout"
    return "checkout"


def open_trainer(dist: str, root: str | Path | None = None) -> Source | None:
    """``dist``'s source (specforge or speculators), or None when none is on this machine. A
    ``root`` that is not one is bad input."""
    marker = f"{DRAFT_DIR}/llama3_eagle.py" if dist == "specforge" else SPECULATORS_CONFIG
    if root is not None:
        p = Path(root)
        package = p / dist if (p / dist).is_dir() else p
        if not (package / marker).is_file():
            raise BadInput(f"{root}: no {dist}/{marker} there: not a {dist} source")
        return Source(dist, package.resolve(), _version(package, dist))
    for package in tool_packages(REPO_ROOT / ".engines", dist, dist):
        if (package / marker).is_file():
            return Source(dist, package.resolve(), _version(package, dist))
    return None


def _module(src: Source, path: str) -> ast.Module:
    return parse_source(src.package / path, src.rel(path))


def _registered(cls: ast.ClassDef) -> str | None:
    """The name ``@register_draft`` registers ``cls`` under (its name, or ``name=``); None: not registered."""
    for d in cls.decorator_list:
        fn = d.func if isinstance(d, ast.Call) else d
        if isinstance(fn, ast.Name) and fn.id == "register_draft":
            names = [k.value.value for k in getattr(d, "keywords", []) if k.arg == "name"
                     and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)]
            return names[0] if names else cls.name
    return None


def specforge_model_file(src: Source, arch: str) -> str | None:
    """The file under ``specforge/`` whose ``@register_draft`` class registers ``arch``."""
    for f in sorted((src.package / DRAFT_DIR).glob("*.py")):
        rel = f"{DRAFT_DIR}/{f.name}"
        for node in _module(src, rel).body:
            if isinstance(node, ast.ClassDef) and _registered(node) == arch:
                return rel
    return None


def read_specforge(src: Source, config: dict) -> NormReading:
    """How SpecForge at ``src`` builds the draft whose config.json is ``config``."""
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else DEFAULT_ARCH
    reading = NormReading("specforge", src.version, None, arch)
    rel = specforge_model_file(src, arch)
    if rel is not None:
        reading.model_file = src.rel(rel)
        reading.reads = model_reads(src.package / rel, reading.model_file)
    return reading


def _enclosing_function(tree: ast.Module, line: int) -> ast.FunctionDef | None:
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno > best.lineno:
                best = node
    return best


def loop_methods(src: Source) -> tuple[dict[str, str], dict[str, str]]:
    """The draft methods SpecForge's EAGLE-3 loop takes its logits from, and the rest it calls
    (``self.draft_model.<name>(...)``): name -> file:line of the call."""
    logits: dict[str, str] = {}
    other: dict[str, str] = {}
    if not (src.package / LOOP_FILE).is_file():
        return logits, other
    for node in ast.walk(_module(src, LOOP_FILE)):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        fn = node.value.func
        if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Attribute) and fn.value.attr == "draft_model":
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            into = logits if any("logits" in n for n in names) else other
            into.setdefault(fn.attr, f"{src.rel(LOOP_FILE)}:{node.lineno}")
    return logits, other


def logits_only(src: Source, reading: NormReading, flag: str = "norm_output") -> str | None:
    """Where ``flag``'s use lies in a method SpecForge's loop calls only for its logits (the norm
    before ``lm_head``, not the state fed to the next step), as one line; None otherwise."""
    state, read = reading.state(flag)
    if state != "used" or read is None or read.use is None or read.use.at is None or reading.model_file is None:
        return None
    path, _, line = read.use.at.rpartition(":")
    rel = path.removeprefix(f"{src.package.name}/")
    fn = _enclosing_function(_module(src, rel), int(line))
    logits, other = loop_methods(src)
    if fn is None or fn.name not in logits or fn.name in other:
        return None
    fed = f"backbone ({other['backbone']})" if "backbone" in other else "another method"
    return (f"{read.use.at} uses {flag} in {fn.name}, which {logits[fn.name]} calls for the logits only: it "
            f"selects the norm before lm_head; the state fed to the next step comes from {fed}, never normed "
            "(SpecForge PR #879)")


def speculators_defaults(src: Source) -> dict[str, tuple[bool, str]]:
    """flag -> (its default in ``Eagle3SpeculatorConfig``, file:line): the pydantic fields
    ``flag: bool = Field(default=...)`` or ``flag: bool = <literal>``."""
    out: dict[str, tuple[bool, str]] = {}
    tree = _module(src, SPECULATORS_CONFIG)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == SPECULATORS_CLASS), None)
    if cls is None:
        raise BadInput(f"{src.rel(SPECULATORS_CONFIG)}: no class {SPECULATORS_CLASS}: not a speculators source")
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in NORM_FLAGS):
            continue
        value = node.value
        if isinstance(value, ast.Call):
            value = next((k.value for k in value.keywords if k.arg == "default"), value.args[0] if value.args else None)
        if isinstance(value, ast.Constant) and isinstance(value.value, bool):
            out[node.target.id] = (value.value, f"{src.rel(SPECULATORS_CONFIG)}:{node.lineno}")
    return out


def _flow(src: Source, path: str) -> ValueFlow:
    return ValueFlow(parse_module(src.package / path, src.rel(path)), src.rel(path))


def _into_layers(src: Source, flag: str, use: FlagUse, head: str) -> FlagUse:
    """A flag core.py passes as ``flag=`` to a layer class it does not define: followed from the
    ``flag`` parameter of every ``__init__`` in model_definitions.py that takes one (used when all
    use it; else the first that does not)."""
    if not (src.package / SPECULATORS_LAYERS).is_file():
        return use
    flow = _flow(src, SPECULATORS_LAYERS)
    params = [p for fn in (n for c in flow.classes.values() for n in c.body.body if isinstance(n, cst.FunctionDef))
              if fn.name.value == "__init__" for p in fn.params.params if p.name.value == flag]
    uses = [flow.follow_param(p) for p in params]
    if not uses:
        return use
    worst = next((u for u in uses if u.state != "used"), uses[0])
    return FlagUse(worst.state, worst.at, f"{head}; {worst.how}")


_SPECULATORS: dict[tuple, NormReading] = {}


def read_speculators(src: Source) -> NormReading:
    """How speculators' ``Eagle3DraftModel`` (the model it trains) uses each flag: every load of
    ``config.<flag>`` or ``self.config.<flag>`` in core.py, followed to its use; kept per version
    of the two files (check-draft asks more than once)."""
    key: tuple = (str(src.package),)
    for path in (SPECULATORS_MODEL, SPECULATORS_LAYERS):
        st = (src.package / path).stat() if (src.package / path).is_file() else None
        key += (st.st_mtime_ns, st.st_size) if st is not None else (None,)
    if key not in _SPECULATORS:
        _SPECULATORS[key] = _read_speculators(src)
    return _SPECULATORS[key]


def _read_speculators(src: Source) -> NormReading:
    flow = _flow(src, SPECULATORS_MODEL)
    reading = NormReading("speculators", src.version, flow.rel, "Eagle3DraftModel")
    for flag in NORM_FLAGS:
        for node in flow.loads.get(flag, []):
            if flow.module.code_for_node(node.value) not in ("config", "self.config"):
                continue
            use = flow.follow(node)
            arg = flow.parent.get(node)
            if isinstance(arg, cst.Arg) and arg.keyword is not None and arg.keyword.value == flag:
                use = _into_layers(src, flag, use, f"{flow.site(node)} reads `{flow.code(node)}`; {flow.site(arg)} "
                                   f"passes it as `{flag}=` to a first-layer class of {src.rel(SPECULATORS_LAYERS)}")
            reading.reads.setdefault(flag, []).append(FlagRead(flag, f"config.{flag}", flow.rel, flow.line(node),
                                                               None, use))
    return reading


def confirm(src: Source, table: list[tuple[str, int, str]]) -> list[str]:
    """The cited lines of ``table`` that ``src`` does not hold as cited (empty: all confirmed)."""
    bad = []
    for path, line, text in table:
        f = src.package / path
        lines = read_source(f).splitlines() if f.is_file() else []
        got = lines[line - 1].strip() if 0 < line <= len(lines) else None
        if got != text:
            bad.append(f"{src.rel(path)}:{line}: cited {text!r}, found {got!r}")
    return bad


def check(dist: str, root: str) -> list[str]:
    """The checker's report on ``root``: what the analysis reads there, then any difference from
    the cited table and its answers (lines starting 'DIFFERS')."""
    src = open_trainer(dist, root)
    assert src is not None
    out = [f"{dist} {src.version} at {src.package}"]
    if dist == "speculators":
        defaults = speculators_defaults(src)
        out += [f"{f}: default {v} ({w})" for f, (v, w) in defaults.items()]
        out += [f"DIFFERS: {f}: no default read" for f in NORM_FLAGS if f not in defaults]
        model = read_speculators(src)
        for flag in NORM_FLAGS:
            state, read = model.state(flag)
            at = read.use.at if read is not None and read.use is not None else None
            out.append(f"{flag}: {state}" + (f" at {at}" if at else ""))
            if (state, at) != ("used", src.rel(SPECULATORS_ANSWERS[flag])):
                out.append(f"DIFFERS: {flag}: cited used at {SPECULATORS_ANSWERS[flag]}")
        out += [f"DIFFERS: {b}" for b in confirm(src, SPECULATORS_TABLE)]
        return out
    reading = read_specforge(src, {})
    for flag in NORM_FLAGS:
        state, read = reading.state(flag)
        at = read.use.at if read is not None and read.use is not None else None
        out.append(f"{flag}: {state}" + (f" at {at}" if at else ""))
        want_state, want_at = SPECFORGE_ANSWERS[flag]
        if (state, at) != (want_state, want_at and src.rel(want_at)):
            out.append(f"DIFFERS: {flag}: cited {want_state} {want_at or ''}".rstrip())
    meaning = logits_only(src, reading)
    out.append(f"norm_output: {meaning or 'not in a logits-only method'}")
    out += [] if meaning else ["DIFFERS: norm_output: cited as used only for the logits"]
    out += [f"DIFFERS: {b}" for b in confirm(src, SPECFORGE_TABLE)]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("specforge", "speculators"):
        print("usage: python -m surgeon.engines.facts.trainer_norms specforge|speculators DIR", file=sys.stderr)
        return 2
    try:
        lines = check(argv[0], argv[1])
    except BadInput as e:
        print(e, file=sys.stderr)
        return 2
    print("\n".join(lines))
    differs = any(x.startswith("DIFFERS") for x in lines)
    print("the cited table differs from this source" if differs else "the cited table is confirmed")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
