"""Setters that capture through Hugging Face's ``OutputRecorder`` (vLLM's Transformers backend).

vLLM's ``--model-impl transformers`` classes (``model_executor/models/transformers/``, 0.20 on) do
not run a decoder-layer loop of their own: the HF model runs it. Their setter turns each id into a
forward hook on one HF decoder layer, found by name::

    for layer in layers:
        layer_name = self._layer_names[layer - 1]
        self.model._can_record_outputs[f"aux_hidden_state_{layer}"] = OutputRecorder(
            target_class, layer_name=layer_name)

and the name table is filled while the model's modules are walked, from the children of the
``nn.ModuleList`` that has ``num_hidden_layers`` entries (``self._layer_names[int(child_name)] =
...``). So id ``j`` records the output of decoder layer ``j - c`` (``c`` read from the subscript),
an id whose key is not in the table (``-1`` for id 0) is a ``KeyError`` in the setter, and the
outputs come back in the order the recorders were registered: the order of the ids.

Everything here is read from the setter and the class hierarchy by the names the code carries
(the ``OutputRecorder`` call and its ``layer_name=`` keyword, the subscripted attribute, the loop
over ``named_children()``, the ``num_hidden_layers`` guard), never from a file or class name.
What the probe cannot see from the engine's source is said: the table is filled by LENGTH, so any
other module list of that length (a vision tower of the same depth) overwrites names; the order of
the recorded outputs is transformers' (read from its ``capture_outputs`` when its source is at
hand).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from surgeon.core.idrules import Evidence, SiteRecord
from surgeon.engines.source.index import ClassKey, CstFunction, FuncInfo, SourceIndex, code
from surgeon.engines.source.reading import SOURCE_ERRORS, read_source

RECORDER = "OutputRecorder"
_RECORDER_CALL = m.Call(func=m.Name(RECORDER) | m.Attribute(attr=m.Name(RECORDER)))
# A multimodal model's HF module holds a vision tower beside the text decoder (vLLM's interface).
_MULTIMODAL = "SupportsMultiModal"


class RecorderUnreadable(Exception):
    """The setter records through OutputRecorder in a shape this reader does not know."""


def records_outputs(index: SourceIndex, owner: ClassKey, fi: FuncInfo) -> bool:
    """The setter body (of ``owner``) registers an HF ``OutputRecorder``: a cheap text test."""
    return f"{RECORDER}(" in index.function_text(owner, fi)


@dataclass
class RecorderReading:
    """What the setter's recorder loop says, with the lines it rests on."""

    path: str
    table: str  # the attribute subscripted for the layer's name (``_layer_names``)
    shift: int  # id j records table key j - shift
    key_line: int  # the subscript's line
    recorder_line: int
    expression: str  # the subscript as written
    filled: tuple[str, int] | None = None  # where the table is filled from a layer list
    guard: str | None = None  # the length test that picks that list
    notes: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    evidence: list[Evidence] = field(default_factory=list)

    @property
    def offset(self) -> int:
        """Stream position minus id: id j records layer j - shift's output, position j - shift + 1."""
        return 1 - self.shift

    def sites(self) -> tuple[SiteRecord, ...]:
        """Stream positions 1..L (each layer's output, recorded by its hook), and why position 0
        (the embedding, table key -1) cannot be captured."""
        missing = -self.shift  # the key id (shift - 1), position 0, looks up
        filled = f" ({self.filled[0]}:{self.filled[1]})" if self.filled else ""
        return (
            SiteRecord("before_loop", self.path, self.key_line, f"`{self.expression}`", "residual_stream",
                       first_index_fails=(f"key {missing} is not in self.{self.table}, which names the decoder "
                                          f"layers 0..L-1{filled}: a KeyError in the setter")),
            SiteRecord("loop_exit", self.path, self.recorder_line,
                       f"the output of decoder layer `{self.expression}`, recorded by an HF {RECORDER} hook",
                       "residual_stream",
                       verified=not self.unverified, unverified_reason="; ".join(self.unverified) or None),
        )


def read_recorder(index: SourceIndex, owner: ClassKey, setter: str, key: ClassKey) -> RecorderReading:
    """Read the recorder loop of ``owner.setter`` (for the class ``key``): raises
    :class:`RecorderUnreadable` with the reason when a piece is not the shape described above."""
    fn = index.function(owner, setter)
    if fn is None:
        raise RecorderUnreadable(f"{owner[1]}.{setter} could not be parsed")
    loop, var = _id_loop(fn)
    call = _one(fn.findall_of(cst.Call, _RECORDER_CALL, within=loop), f"{RECORDER}(...) call in the loop over the ids")
    name_arg = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "layer_name"), None)
    if name_arg is None:
        raise RecorderUnreadable(f"{fn.label}:{fn.line(call)}: {RECORDER} without layer_name= records every "
                                 "module of its class, not one layer per id")
    sub = _resolve_name(fn, loop, name_arg)
    table, shift = _table_key(sub, var)
    reading = RecorderReading(owner[0], table, shift, fn.line(sub), fn.line(call), code(sub))
    reading.evidence.append(Evidence("setter", owner[0], fn.line(sub),
                                     f"{owner[1]}.{setter}: id `{var}` names the layer `{code(sub)}`"))
    reading.evidence.append(Evidence("capture_site", owner[0], fn.line(call),
                                     f"an HF {RECORDER} hook records that layer's output"))
    registry = fn.findall_of(cst.Assign, m.Assign(targets=[m.AssignTarget(target=m.Subscript(
        value=m.Attribute(attr=m.Name("_can_record_outputs"))))]), within=loop)
    if registry:
        reading.notes.append(
            f"the recorders go into the HF model's _can_record_outputs ({owner[0]}:{fn.line(registry[0])}), which "
            "transformers keeps per model class: in one process a later call's ids keep the places of an earlier "
            "call's, and the earlier recorders stay")
    _read_table(index, key, reading)
    _read_order(index, reading)
    if any(k[1] == _MULTIMODAL for k in index.mro(key)):
        reading.unverified.append(
            f"{reading.filled[0] if reading.filled else reading.path}: self.{table} is filled from the module list "
            "with num_hidden_layers entries, picked by length: in a multimodal model a vision tower of the same "
            "depth overwrites the names, which the source cannot rule out")
    return reading


def _id_loop(fn: CstFunction) -> tuple[cst.For, str]:
    """The ``for <var> in <ids parameter>:`` loop of the setter."""
    params = [p.name.value for p in fn.node.params.params]
    if len(params) < 2:
        raise RecorderUnreadable(f"{fn.label} takes no id list")
    ids = params[1]
    loops = fn.findall_of(cst.For, m.For(iter=m.Name(ids), target=m.Name()))
    loop = _one(loops, f"loop over `{ids}`")
    assert isinstance(loop.target, cst.Name)  # the matcher's target=m.Name()
    return loop, loop.target.value


def _one(nodes: list, what: str):
    if len(nodes) != 1:
        raise RecorderUnreadable(f"the setter has {len(nodes)} {what}, not one")
    return nodes[0]


def _resolve_name(fn: CstFunction, loop: cst.For, value: cst.BaseExpression) -> cst.Subscript:
    """``layer_name=`` as a subscript: written there, or a local assigned once in the loop."""
    if isinstance(value, cst.Name):
        assigns = fn.findall_of(cst.Assign, m.Assign(targets=[m.AssignTarget(target=m.Name(value.value))]),
                                within=loop)
        value = _one(assigns, f"assignment of `{value.value}`").value
    if not (isinstance(value, cst.Subscript) and m.matches(value.value, m.Attribute(value=m.Name("self")))
            and len(value.slice) == 1 and isinstance(value.slice[0].slice, cst.Index)):
        raise RecorderUnreadable(f"{fn.label}: layer_name= is `{code(value)}`, not a lookup of self.<table>[id]")
    return value


def _table_key(sub: cst.Subscript, var: str) -> tuple[str, int]:
    """(table attribute, shift) of ``self.table[var - shift]`` (``var``, ``var + k`` too)."""
    assert isinstance(sub.value, cst.Attribute) and isinstance(sub.slice[0].slice, cst.Index)
    table = sub.value.attr.value
    key = sub.slice[0].slice.value
    if m.matches(key, m.Name(var)):
        return table, 0
    if (isinstance(key, cst.BinaryOperation) and m.matches(key.left, m.Name(var))
            and isinstance(key.right, cst.Integer)):
        if isinstance(key.operator, cst.Subtract):
            return table, int(key.right.value)
        if isinstance(key.operator, cst.Add):
            return table, -int(key.right.value)
    raise RecorderUnreadable(f"the layer is looked up as `{code(sub)}`, not by the id plus a constant")


def _read_table(index: SourceIndex, key: ClassKey, reading: RecorderReading) -> None:
    """Where ``self.<table>[int(name)] = ...`` fills the name table: inside a walk over a module's
    ``named_children()`` under a ``num_hidden_layers`` length test, so key k is decoder layer k."""
    target = m.Assign(targets=[m.AssignTarget(target=m.Subscript(
        value=m.Attribute(value=m.Name("self"), attr=m.Name(reading.table))))])
    for k in index.mro(key):
        info = index.class_info(k)
        for name, fi in (info.functions if info else {}).items():
            if f"self.{reading.table}[" not in index.function_text(k, fi):
                continue
            fn = index.function(k, name)
            if fn is not None and any(_reads_layer_list(fn, node, reading) for node in fn.findall_of(cst.Assign, target)):
                return
    reading.unverified.append(f"no walk over a decoder-layer list that fills self.{reading.table} was read")


def _reads_layer_list(fn: CstFunction, node: cst.Assign, reading: RecorderReading) -> bool:
    sub = node.targets[0].target
    assert isinstance(sub, cst.Subscript) and isinstance(sub.slice[0].slice, cst.Index)
    key = sub.slice[0].slice.value
    child = key.args[0].value if isinstance(key, cst.Call) and m.matches(key.func, m.Name("int")) and key.args else key
    if not isinstance(child, cst.Name):
        return False
    walk = next((a for a in fn.ancestors(node) if isinstance(a, cst.For)
                 and m.matches(a.target, m.Tuple(elements=[m.Element(m.Name(child.value)), m.Element()]))
                 and m.matches(a.iter, m.Call(func=m.Attribute(attr=m.Name("named_children"))))), None)
    guard = next((a for a in fn.ancestors(node) if isinstance(a, cst.If) and fn.inside(a, walk)
                  and "num_hidden_layers" in code(a.test)), None) if walk is not None else None
    if guard is None:
        return False
    reading.filled = (fn.path, fn.line(node))
    reading.guard = " ".join(code(guard.test).split()).removeprefix("( ").removesuffix(" )")
    reading.evidence.append(Evidence("setter", fn.path, fn.line(node),
                                     f"self.{reading.table}[k] names child k of the module list where "
                                     f"`{reading.guard}`: decoder layer k"))
    reading.notes.append(
        "a decoder layer's output is the residual stream after it (what HF's own hidden_states record, through "
        "the same hook on the decoder-layer class)")
    reading.notes.append(
        f"self.{reading.table} names the children of the module list picked by `{reading.guard}` "
        f"({fn.path}:{fn.line(guard)}): any other list of that length in the checkpoint's model would overwrite them")
    return True


# transformers' collector: the recorded outputs are gathered in the order of the model's
# ``_can_record_outputs`` (``for k in capturable_flags``), where the setter inserted them id by id.
_ORDER = re.compile(r"for\s+k\s+in\s+capturable_flags")


def _read_order(index: SourceIndex, reading: RecorderReading) -> None:
    """The recorded outputs come back in the order the recorders were registered (the ids' order):
    read from transformers' ``utils/output_capturing.py`` beside the engine, else the one installed
    here (named with its version); unverified when neither is readable."""
    found = _transformers_capture(index.package_dir)
    if found is None:
        reading.unverified.append("the order of the recorded outputs is decided by transformers' capture_outputs "
                                  "(transformers/utils/output_capturing.py), whose source is not at hand: not read")
        return
    path, line, version = found
    reading.notes.append(f"the recorded outputs come back in the order of the model's _can_record_outputs, where the "
                         f"setter registers them id by id: the ids' order (transformers {version}, "
                         f"transformers/utils/output_capturing.py:{line})")


def _transformers_capture(engine_dir: Path) -> tuple[Path, int, str] | None:
    """(file, line, version) of transformers' collector loop, beside the engine or installed here."""
    candidates = [engine_dir.parent / "transformers"]
    try:
        spec = importlib.util.find_spec("transformers")  # a top-level package: nothing is executed
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) for p in spec.submodule_search_locations]
    for pkg in candidates:
        f = pkg / "utils" / "output_capturing.py"
        try:
            text = read_source(f)  # a FIFO or device there is refused, never waited on
        except SOURCE_ERRORS:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if _ORDER.search(line):
                return f, n, _version(pkg)
    return None


def _version(pkg: Path) -> str:
    for info in sorted(pkg.parent.glob("transformers-*.dist-info")):
        return info.name.removeprefix("transformers-").removesuffix(".dist-info")
    return "(version unknown)"
