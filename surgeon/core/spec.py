"""Spec format v1: the reviewed YAML that says, in physical terms, what a draft reads.

Loading is two phases, both located (``file:line:col``):

1. shape and types, by the pydantic models below (``extra="forbid"``, strict types), with a
   did-you-mean for unknown keys;
2. meaning: points parse and exist in the target, names are identifiers, fc width matches,
   dump slots can hold their points truthfully.

YAML is read with PyYAML's safe loader (a subclass that also refuses duplicate keys, which
``safe_load`` would silently collapse, and anchors/aliases, which have no place in a reviewed
spec). Nothing is ever executed or constructed beyond plain scalars, lists and mappings.
"""

from __future__ import annotations

import difflib
import hashlib
import keyword
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from surgeon.core.conventions import DUMP_LAYOUTS, NotExpressible, OffsetError, parse_offset
from surgeon.core.errors import BadInput
from surgeon.core.points import Point, PointError, parse_point

SPEC_VERSION = 1
MAX_SPEC_BYTES = 1 << 20
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # used with fullmatch: no trailing newline
_SPEC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Issue:
    """One problem, with where it is (1-based line and column; 0 when unknown)."""

    file: str
    line: int
    col: int
    message: str
    path: str = ""  # dotted key path, e.g. "captures.low"
    severity: str = "error"  # or "warning"

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}" if self.line else self.file
        key = f"{self.path}: " if self.path else ""
        tag = "" if self.severity == "error" else f"{self.severity}: "
        return f"{where}: {tag}{key}{self.message}"


class SpecError(BadInput):
    """Bad input: one or more located issues. The CLI prints each on its own line, exit 2."""

    def __init__(self, issues: list[Issue]):
        assert issues
        self.issues = issues
        super().__init__(str(issues[0]))

    def report_lines(self) -> list[str]:
        return [str(issue) for issue in self.issues]


# ---------------------------------------------------------------------------------------------
# Shape: pydantic models (also the JSON Schema printed by `surgeon schema`)
# ---------------------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


PointText = str


class Target(_Model):
    """The target (verifier) model the draft reads hidden states from."""

    architecture: str = Field(min_length=1, description="HF architecture / engine model class, e.g. DeepseekV3ForCausalLM")
    num_layers: int = Field(ge=1, description="num_hidden_layers: decoder layers are 0..num_layers-1")
    hidden_size: int = Field(ge=1, description="width of one captured hidden state")
    model_type: str | None = Field(default=None, description="HF config model_type, informational")


class DraftNorms(_Model):
    """The EAGLE 3.1 norm flags the draft was trained with (speculators' names; unset: not declared,
    so not checked). ``surgeon check-draft`` compares them with the draft's config and with what
    each engine reads."""

    norm_before_residual: bool | None = Field(
        default=None, description="the first layer's hidden_norm is applied before the residual is taken")
    norm_before_fc: bool | None = Field(
        default=None, description="one RMSNorm (input_norm) over the concatenated fc input")
    fc_norm: bool | None = Field(
        default=None, description="one RMSNorm per fc slot (fc_norm.{i}), before concatenation")
    norm_output: bool | None = Field(
        default=None, description="the draft passes its post-norm state (not the pre-norm one) to its next step")


NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


class Draft(_Model):
    """The draft model and the order its fc layer consumes captures in."""

    kind: Literal["eagle3", "dflash", "mtp"]
    fc_input: list[str] = Field(min_length=1, description="capture names, in the order the draft's fc concatenates them")
    fc_in_features: int | None = Field(
        default=None, ge=1, description="fc weight's input width; must be len(fc_input) * hidden_size"
    )
    norms: DraftNorms | None = Field(default=None, description="eagle3 only: the norm flags the draft was trained with")
    mtp_input: PointText | None = Field(
        default=None,
        description="mtp only: the target state the MTP/NextN head was trained on: final_norm (after the final "
                    "norm) or layer_out[L-1] (the last layer's output, before it)",
    )


class EnginePin(_Model):
    """What a deployment on one engine relies on (checked against the installed source)."""

    version: str | None = Field(
        default=None, description="PEP 440 range the pins were checked on, e.g. '==0.5.23' or '>=0.5.20,<0.6'"
    )
    model_file: str | None = Field(
        default=None, description="model file relative to the engine package, e.g. srt/models/deepseek_v2.py"
    )
    model_class: str | None = Field(default=None, description="engine model class, e.g. DeepseekV3ForCausalLM")
    ids: list[int] | None = Field(
        default=None, description="the exact ids the deployment passes (eagle_aux_hidden_state_layer_ids)"
    )
    offset: str | None = Field(
        default=None,
        description="how the engine turns ids into capture indices for this class: '+1', '+0', or '+1 if ids[0] == 1 else +0'",
    )


class Engines(_Model):
    sglang: EnginePin | None = None
    vllm: EnginePin | None = None


class Dumps(_Model):
    """Training dumps of these captures."""

    layout: Literal["surgeon", "specforge", "speculators"] = "surgeon"
    slots: list[str] | None = Field(
        default=None, description="capture names in dump slot order (default: every capture, in order)"
    )


class SpecModel(_Model):
    """surgeon spec v1."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, title="surgeon spec v1")

    spec: Literal[1] = Field(description="spec format version")
    name: str = Field(description="spec name: letters, digits, '.', '_', '-'")
    description: str | None = None
    target: Target
    captures: dict[str, PointText] = Field(
        min_length=1,
        description="ordered: capture name -> physical point (embed, layer_out[k], layer_in[k], final_norm)",
        json_schema_extra={
            "propertyNames": {"pattern": f"^{_IDENT.pattern}$"},
            "additionalProperties": {"type": "string", "pattern": r"^\s*(embed|final_norm|layer_(out|in)\[\s*\d+\s*\])\s*$"},
        },
    )
    draft: Draft | None = None
    engines: Engines | None = None
    dumps: Dumps | None = None


_SECTION_MODELS: dict[tuple, type[_Model]] = {
    (): SpecModel, ("target",): Target, ("draft",): Draft, ("draft", "norms"): DraftNorms, ("engines",): Engines,
    ("engines", "sglang"): EnginePin, ("engines", "vllm"): EnginePin, ("dumps",): Dumps,
}


def json_schema() -> dict:
    schema = SpecModel.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://surgeon.invalid/spec-v1.json"
    return schema


# ---------------------------------------------------------------------------------------------
# YAML with locations
# ---------------------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """The safe loader, refusing duplicate keys and anchors/aliases."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.MarkedYAMLError(
                None, None, "YAML aliases are not allowed in a spec: write each value out", event.start_mark
            )
        event = self.peek_event()
        if getattr(event, "anchor", None):
            raise yaml.MarkedYAMLError(
                None, None, "YAML anchors are not allowed in a spec: write each value out", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                # the unhashable key is the user's mistake, not a failure while handling one
                raise yaml.MarkedYAMLError(None, None, "a mapping key must be a plain scalar", key_node.start_mark) from None
            if key in seen:
                raise yaml.MarkedYAMLError(
                    None, None,
                    f"duplicate key {key!r} (first at line {seen[key].line + 1}); YAML would silently keep the last one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 reads `yes`, `no`, `on`, `off` as booleans (a capture named `on` would become True);
# only true/false are booleans here. Timestamps, merges and the like stay strings too.
# Integers are decimal only: YAML 1.1 would read `032` as 26 (octal), `1:01` as 61 (base 60),
# `0x13` and `1_0` too; such text stays a string here, and the typed check refuses it. No field
# of a spec is a float, so floats stay strings as well.
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT = re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$")
_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag == "tag:yaml.org,2002:null"]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _ch in "tTfF":
    _Loader.yaml_implicit_resolvers.setdefault(_ch, []).append(("tag:yaml.org,2002:bool", _BOOL))
for _ch in "-+0123456789":
    _Loader.yaml_implicit_resolvers.setdefault(_ch, []).append(("tag:yaml.org,2002:int", _INT))


@dataclass
class _Located:
    data: Any
    marks: dict[tuple, tuple[int, int]]  # path -> (line, col) of the value, 1-based
    key_marks: dict[tuple, tuple[int, int]]  # path -> (line, col) of the key
    quoted: set[tuple]


def _index(node: yaml.Node, path: tuple, out: _Located, depth: int = 0) -> None:
    if depth > 32:
        raise yaml.MarkedYAMLError(None, None, "nesting deeper than 32 levels", node.start_mark)
    out.marks[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.ScalarNode) and node.style in ("'", '"'):
        out.quoted.add(path)
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            out.key_marks[path + (key,)] = (k.start_mark.line + 1, k.start_mark.column + 1)
            _index(v, path + (key,), out, depth + 1)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _index(v, path + (i,), out, depth + 1)


def _reader_error(e: yaml.reader.ReaderError, text: str, file: str) -> SpecError:
    """A character YAML refuses (control characters): located from its offset."""
    line = text.count("\n", 0, e.position) + 1
    col = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
    return SpecError([Issue(file, line, col, f"YAML: character {e.character!r} is not allowed in YAML text")])


def _parse_yaml(text: str, file: str) -> _Located:
    try:
        loader = _Loader(text)
    except yaml.reader.ReaderError as e:
        raise _reader_error(e, text, file) from None
    try:
        node = loader.get_single_node()
        if node is None:
            raise SpecError([Issue(file, 1, 1, "empty spec: expected a mapping with 'spec: 1'")])
        out = _Located(None, {}, {}, set())
        _index(node, (), out)
        out.data = loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        msg = " ".join(x for x in (e.context, e.problem) if x) or "invalid YAML"
        raise SpecError([Issue(file, line, col, f"YAML: {msg}")]) from None
    except yaml.reader.ReaderError as e:
        raise _reader_error(e, text, file) from None
    except yaml.YAMLError as e:
        raise SpecError([Issue(file, 1, 1, f"YAML: {' '.join(str(e).split())}")]) from None
    except RecursionError:
        raise SpecError([Issue(file, 1, 1, "YAML nested too deeply")]) from None
    finally:
        loader.dispose()
    return out


# ---------------------------------------------------------------------------------------------
# The loaded spec
# ---------------------------------------------------------------------------------------------
@dataclass
class Spec:
    model: SpecModel
    file: str
    sha256: str
    captures: dict[str, Point]  # normalised, in spec order
    _loc: _Located = field(repr=False)

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def num_layers(self) -> int:
        return self.model.target.num_layers

    @property
    def hidden_size(self) -> int:
        return self.model.target.hidden_size

    @property
    def fc_names(self) -> list[str]:
        return list(self.model.draft.fc_input) if self.model.draft else []

    @property
    def fc_points(self) -> list[Point]:
        return [self.captures[n] for n in self.fc_names]

    @property
    def mtp_input(self) -> Point | None:
        """The state an MTP draft was trained on (``draft.mtp_input``), or None when undeclared."""
        d = self.model.draft
        return parse_point(d.mtp_input, self.num_layers) if d is not None and d.mtp_input is not None else None

    @property
    def dump_slots(self) -> list[str]:
        if self.model.dumps and self.model.dumps.slots is not None:
            return list(self.model.dumps.slots)
        return list(self.captures)

    def slot_order(self, layout: str) -> tuple[list[str], str]:
        """The spec's capture names in the order a ``layout`` file holds its slots, and how that
        order was found: the spec's ``dumps.slots`` where stated; SpecForge's own order (its
        ``aux_hidden_state`` in fc order, then ``hidden_state``, the final norm's output); a
        ``hidden_states`` stack's ascending depth (vLLM ids, ascending); else the captures' order."""
        if self.model.dumps and self.model.dumps.slots is not None:
            return list(self.model.dumps.slots), "the order the spec's dumps.slots states"
        L = self.num_layers
        if layout == "specforge" and self.fc_names:
            final = [n for n, p in self.captures.items() if p.kind == "final_norm" and n not in self.fc_names]
            return self.fc_names + final[:1], "SpecForge's own: aux_hidden_state in fc order, then hidden_state (final_norm)"
        if layout in ("vllm-connector", "speculators"):
            order = sorted(self.captures, key=lambda n: self.captures[n].depth(L))
            return order, "a hidden_states stack's: ascending depth, as vLLM's ascending ids stack them"
        return list(self.captures), "the order of the spec's captures"

    def pin(self, engine: str):
        return getattr(self.model.engines, engine) if self.model.engines else None

    def issue(self, path: tuple, message: str, *, key: bool = False, severity: str = "error") -> Issue:
        i = _issue(self.file, self._loc, path, message, key=key)
        return i if severity == "error" else Issue(i.file, i.line, i.col, i.message, i.path, severity)


def _dotted(path: tuple) -> str:
    out = ""
    for p in path:
        if isinstance(p, str) and re.fullmatch(r"[A-Za-z0-9_\-]+", p):
            out += f".{p}" if out else p
        else:  # an int index, or a key that would break a one-line message: show it quoted
            out += f"[{p!r}]" if not isinstance(p, int) else f"[{p}]"
    return out


def _issue(file: str, loc: _Located, path: tuple, message: str, *, key: bool = False, column: int = 0) -> Issue:
    marks = loc.key_marks if key else loc.marks
    # the index is keyed by the YAML text of mapping keys; a key YAML typed (12, true) arrives here typed
    if path not in marks and any(not isinstance(p, str) for p in path):
        alt = tuple(str(p).lower() if isinstance(p, bool) else str(p) if not isinstance(p, str) else p for p in path)
        if alt in marks:
            path = alt
    probe = tuple(path)
    while probe not in marks and probe:
        probe = probe[:-1]
    line, col = marks.get(probe) or loc.marks.get(probe) or (1, 1)
    if column and probe == tuple(path):
        col += column + (1 if probe in loc.quoted else 0)
    return Issue(file, line, col, message, _dotted(path))


def _pydantic_issues(err: ValidationError, file: str, loc: _Located) -> list[Issue]:
    issues = []
    for e in err.errors():
        path = tuple(e["loc"])
        kind = e["type"]
        if path and path[-1] == "[key]":  # a mapping key of the wrong type: point at the key
            issues.append(_issue(file, loc, path[:-1], f"a key must be a string, not {e.get('input')!r}", key=True))
            continue
        if kind == "extra_forbidden":
            section = path[:-1]
            model = _SECTION_MODELS.get(section)
            allowed = list(model.model_fields) if model else []
            hint = difflib.get_close_matches(str(path[-1]), allowed, n=1)
            msg = f"unknown key {path[-1]!r}" + (f"; did you mean {hint[0]!r}?" if hint else f" (allowed: {', '.join(allowed)})")
            issues.append(_issue(file, loc, path, msg, key=True))
        elif kind == "missing":
            issues.append(_issue(file, loc, path[:-1], f"missing required key {path[-1]!r}"))
        elif kind == "literal_error" and path == ("spec",):
            issues.append(_issue(
                file, loc, path, f"unsupported spec version {e.get('input')!r}: this surgeon reads 'spec: {SPEC_VERSION}'"
            ))
        else:
            got = e.get("input")
            shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
            issues.append(_issue(file, loc, path, f"{e['msg'][0].lower()}{e['msg'][1:]} (got {shown})"))
    # an unknown key usually explains a missing one (a typo): report it first
    return sorted(issues, key=lambda i: (not i.message.startswith("unknown key"), i.line, i.col))


def read_regular_file(path: Path, limit: int) -> bytes:
    """Read a regular file of at most ``limit`` bytes (through :mod:`surgeon.core.safefile`: opened
    without blocking and checked on the descriptor, so a FIFO swapped in after a check never hangs
    the read, and /dev/zero is never read). ``FileNotFoundError`` when absent; ``ValueError`` (the
    reason without the path) for a directory, device, FIFO, a larger file or one that cannot be read."""
    from surgeon.core.safefile import UnsafeFile, read_bytes

    try:
        return read_bytes(path, limit=limit, what="it")
    except UnsafeFile as e:
        raise ValueError(str(e).removeprefix(f"{path}: ")) from None


_SPEC_KEY = re.compile(rb"^spec[ \t]*:", re.M)


def is_spec_file(path: str | Path) -> bool:
    """Whether ``path`` is meant as a surgeon spec: a top-level ``spec:`` key (the version every
    spec starts with), looked for in the text, so that a spec too broken to parse still counts.
    A file that cannot be read counts too (linting it reports why). Used to pick the specs among
    a repository's YAML files (the pre-commit hooks)."""
    try:
        raw = read_regular_file(Path(path), MAX_SPEC_BYTES)
    except (OSError, ValueError):
        return True
    return _SPEC_KEY.search(raw) is not None


def load_spec(path: str | Path, *, text: str | None = None) -> Spec:
    """Load and validate a spec. Raises SpecError (bad input) with located issues."""
    file = str(path)
    if text is None:
        p = Path(path)
        try:
            raw = read_regular_file(p, MAX_SPEC_BYTES)
        except ValueError as e:
            raise SpecError([Issue(file, 0, 0, str(e))]) from None
        except OSError as e:
            raise SpecError([Issue(file, 0, 0, f"cannot read: {e.strerror or e}")]) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            raise SpecError([Issue(file, line, 1, "not UTF-8 text")]) from None
    else:
        raw = text.encode("utf-8")
    if "\x00" in text:
        raise SpecError([Issue(file, 1, 1, "NUL byte in spec; not a text file")])
    loc = _parse_yaml(text, file)
    if not isinstance(loc.data, dict):
        raise SpecError([Issue(file, 1, 1, f"a spec is a mapping with 'spec: 1', not {type(loc.data).__name__}")])
    version = loc.data.get("spec")
    if "spec" in loc.data and (type(version) is not int or version != SPEC_VERSION):
        raise SpecError([
            _issue(file, loc, ("spec",), f"unsupported spec version {version!r}: this surgeon reads 'spec: {SPEC_VERSION}'")
        ])
    try:
        model = SpecModel.model_validate(loc.data)
    except ValidationError as e:
        raise SpecError(_pydantic_issues(e, file, loc)) from None
    spec = Spec(model, file, hashlib.sha256(raw).hexdigest(), {}, loc)
    issues = _check_meaning(spec)
    if issues:
        raise SpecError(issues)
    return spec


def _check_meaning(spec: Spec) -> list[Issue]:
    m, L, loc = spec.model, spec.model.target.num_layers, spec._loc
    issues: list[Issue] = []

    def add(path: tuple, msg: str, **kw) -> None:
        issues.append(_issue(spec.file, loc, path, msg, **kw))

    if not _SPEC_NAME.fullmatch(m.name):
        add(("name",), f"spec name {m.name!r} must be letters, digits, '.', '_' or '-', starting with a letter or digit")

    seen_points: dict[Point, str] = {}
    for name, text in m.captures.items():
        if not _IDENT.fullmatch(name) or keyword.iskeyword(name):
            add(("captures", name),
                f"capture name {name!r} is not an identifier (letters, digits, '_'; not a Python keyword)", key=True)
            continue
        try:
            point = parse_point(text, L)
        except PointError as e:
            issues.append(_issue(spec.file, loc, ("captures", name), e.message, column=e.column))
            continue
        if point in seen_points:
            add(("captures", name), f"{point} is already captured as {seen_points[point]!r}; one name per point")
            continue
        seen_points[point] = name
        spec.captures[name] = point

    def check_names(section: tuple, names: list[str], what: str) -> bool:
        ok = True
        dup: set[str] = set()
        for i, n in enumerate(names):
            if n not in m.captures:
                hint = difflib.get_close_matches(n, list(m.captures), n=1)
                suggestion = f"; did you mean {hint[0]!r}?" if hint else f" (captures: {', '.join(m.captures)})"
                add(section + (i,), f"{what} names {n!r}, which is not a capture" + suggestion)
                ok = False
            elif n in dup:
                add(section + (i,), f"{what} lists {n!r} twice")
                ok = False
            dup.add(n)
        return ok and all(n in spec.captures for n in names)

    if m.draft is not None:
        fc_ok = check_names(("draft", "fc_input"), m.draft.fc_input, "fc_input")
        want = len(m.draft.fc_input) * m.target.hidden_size
        if m.draft.fc_in_features is not None and m.draft.fc_in_features != want:
            add(("draft", "fc_in_features"),
                f"fc_in_features is {m.draft.fc_in_features}, but {len(m.draft.fc_input)} fc inputs x hidden_size "
                f"{m.target.hidden_size} = {want}")
        if fc_ok and m.draft.kind in ("eagle3", "dflash"):
            for i, n in enumerate(m.draft.fc_input):
                p = spec.captures[n]
                if p.position is None:
                    add(("draft", "fc_input", i),
                        f"{n!r} is {p}: an fc input must be a residual-stream state (embed or layer_out[k]); "
                        "engines capture final_norm as the returned hidden state, not an aux input")

    if m.draft is not None:
        _check_draft_extras(spec, m.draft, add)

    if m.dumps is not None:
        slots = spec.dump_slots
        if check_names(("dumps", "slots"), slots, "dumps.slots"):
            layout = DUMP_LAYOUTS[m.dumps.layout]
            try:
                layout.slots(slots, [spec.captures[n] for n in slots], L)
            except NotExpressible as e:
                where = ("dumps", "slots") if m.dumps.slots is not None else ("dumps", "layout")
                add(where, f"a {layout.name} dump cannot hold these slots truthfully: {e}")

    if m.engines is not None:
        _check_pin_syntax(m.engines, add)
    return issues


def _check_draft_extras(spec: Spec, draft: Draft, add: Callable[[tuple, str], None]) -> None:
    """The norm flags and the MTP input point: each only for the kind that has it, and the MTP
    input one of the two states an MTP head can read."""
    L = spec.num_layers
    if draft.norms is not None:
        if draft.kind != "eagle3":
            add(("draft", "norms"), f"norms are EAGLE-3 draft flags; a {draft.kind} draft has none")
        elif draft.norms.norm_before_fc and draft.norms.fc_norm:
            add(("draft", "norms", "fc_norm"), "norm_before_fc and fc_norm are exclusive (speculators refuses both)")
    if draft.mtp_input is None:
        return
    if draft.kind != "mtp":
        add(("draft", "mtp_input"), f"mtp_input is for an mtp draft; this draft is {draft.kind}")
        return
    try:
        point = parse_point(draft.mtp_input, L)
    except PointError as e:
        add(("draft", "mtp_input"), e.message)
        return
    if str(point) not in ("final_norm", f"layer_out[{L - 1}]"):
        add(("draft", "mtp_input"), f"an MTP head reads final_norm or layer_out[{L - 1}] (the last layer's output, "
            f"before the final norm), not {point}")


def _check_pin_syntax(engines: Engines, add: Callable[[tuple, str], None]) -> None:
    """The pins' own well-formedness (a version range, an offset rule, a relative model file), which
    needs no engine; whether they still hold for the installed engine is wiring.pins' check."""
    for engine in ("sglang", "vllm"):
        pin: EnginePin | None = getattr(engines, engine)
        if pin is None:
            continue
        if pin.version is not None:
            try:
                SpecifierSet(pin.version)
            except InvalidSpecifier:
                add(("engines", engine, "version"),
                    f"{pin.version!r} is not a PEP 440 version range (e.g. '==0.5.23' or '>=0.5.20,<0.6')")
        if pin.offset is not None:
            try:
                parse_offset(pin.offset)
            except OffsetError as e:
                add(("engines", engine, "offset"), str(e))
        if pin.model_file is not None and (pin.model_file.startswith("/") or ".." in Path(pin.model_file).parts):
            add(("engines", engine, "model_file"), "model_file must be relative to the engine package and stay inside it")


def sweep_spec_text(name: str, architecture: str, num_layers: int, hidden_size: int) -> str:
    """A spec capturing every residual-stream point and the final norm, in forward order: applied
    to an engine, its dumps are a reference where HF cannot run the model."""
    captures = {"embed": "embed", **{f"layer_out_{k}": f"layer_out[{k}]" for k in range(num_layers)}, "final_norm": "final_norm"}
    doc = {"spec": 1, "name": name,
           "target": {"architecture": architecture, "num_layers": num_layers, "hidden_size": hidden_size},
           "captures": captures, "dumps": {"layout": "surgeon"}}
    text = ("# Sweep: every capturable point, in forward order. Its dumps serve as a reference\n"
            "# (surgeon match --reference DUMP) where HF cannot run the model.\n"
            + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=4096))
    load_spec(f"<sweep {name}>", text=text)  # refuse to hand out a spec that does not load
    return text
