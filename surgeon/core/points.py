"""Physical capture points: the vocabulary of a spec.

``L`` is the target's ``num_hidden_layers``; decoder layers are ``0..L-1``.

=================  =======================================================================
``embed``          residual stream entering layer 0 (embedding output, after any scaling)
``layer_out[k]``   residual stream after decoder layer ``k`` (``hidden_states + residual``
                   where the engine carries the residual separately); for ``k = L-1`` it is
                   *before* the final norm
``layer_in[k]``    alias of ``layer_out[k-1]`` (``embed`` for ``k = 0``), normalised on parse
``final_norm``     output of the final norm, the input of the LM head
``layer_delta[k]`` layer ``k``'s own output without the residual added: a state people capture
                   by mistake; only the verification harness names it, specs refuse it
=================  =======================================================================

A residual-stream *position* numbers the states a capture can see: ``0`` is ``embed`` and
``k + 1`` is ``layer_out[k]``. Engine capture indices are positions (see ``surgeon.core.conventions``).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Literal, cast

from surgeon.core.errors import BadInput

PointKind = Literal["embed", "layer_out", "final_norm", "layer_delta"]

_POINT_RE = re.compile(  # ASCII digits only (\d would take '１'), used with fullmatch
    r"(?P<kind>embed|final_norm|layer_out|layer_in|layer_delta)(?:\[[ \t]*(?P<index>[+-]?[0-9]+)[ \t]*\])?"
)
_SPELLINGS = ["embed", "final_norm", "layer_out[k]", "layer_in[k]"]


class PointError(BadInput, ValueError):
    """A point that does not parse or does not exist in the model. ``column`` is the 0-based
    offset of the offending part within the text, for located messages."""

    def __init__(self, message: str, column: int = 0):
        super().__init__(message)
        self.message = message
        self.column = column


@dataclass(frozen=True)
class Point:
    kind: PointKind
    index: int | None = None

    def __post_init__(self) -> None:
        indexed = self.kind in ("layer_out", "layer_delta")
        if indexed != (self.index is not None):
            raise ValueError(f"point kind {self.kind!r} {'needs' if indexed else 'takes no'} an index")

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}[{self.index}]"

    # -- positions ----------------------------------------------------------------------
    @property
    def position(self) -> int | None:
        """Residual-stream position (``embed`` 0, ``layer_out[k]`` k+1); ``None`` for points
        that are not on the residual stream (``final_norm``, ``layer_delta[k]``)."""
        if self.kind == "embed":
            return 0
        if self.kind == "layer_out" and self.index is not None:  # always indexed (__post_init__)
            return self.index + 1
        return None

    @classmethod
    def at_position(cls, position: int) -> Point:
        if position < 0:
            raise ValueError(f"no residual-stream position {position}")
        return EMBED if position == 0 else cls("layer_out", position - 1)

    def depth(self, num_layers: int) -> float:
        """Where the point sits in the forward pass, for ordering and plots: embed 0,
        layer_out[k] k+1, layer_delta[k] just before layer_out[k], final_norm L+1."""
        if self.kind == "final_norm":
            return num_layers + 1
        if self.kind == "layer_delta" and self.index is not None:  # always indexed (__post_init__)
            return self.index + 0.5
        position = self.position
        assert position is not None  # embed and layer_out, the kinds left, are on the residual stream
        return float(position)

    def check_range(self, num_layers: int) -> None:
        if self.index is not None and not 0 <= self.index < num_layers:
            raise PointError(_out_of_range(self.kind, self.index, num_layers))


EMBED = Point("embed")
FINAL_NORM = Point("final_norm")


def layer_out(k: int) -> Point:
    return Point("layer_out", k)


def all_points(num_layers: int, *, with_deltas: bool = False) -> list[Point]:
    """Every capturable point of an ``L``-layer model in forward order."""
    points = [EMBED]
    for k in range(num_layers):
        if with_deltas:
            points.append(Point("layer_delta", k))
        points.append(layer_out(k))
    points.append(FINAL_NORM)
    return points


def _out_of_range(kind: str, index: int, num_layers: int) -> str:
    return (
        f"{kind}[{index}] is out of range: the model has {num_layers} layers, "
        f"so {kind}[0]..{kind}[{num_layers - 1}]"
    )


def parse_point(text: object, num_layers: int | None = None, *, allow_delta: bool = False) -> Point:
    """Parse a point as written in a spec. ``layer_in[k]`` is normalised to ``layer_out[k-1]``
    (``embed`` for ``k = 0``). With ``num_layers``, indices are range-checked.

    Negative indices are refused: ``-1`` means ``embed`` in SGLang's ids and the last layer in
    Python, and that ambiguity is the bug this tool exists to remove.
    """
    if not isinstance(text, str):
        raise PointError(
            f"a point is a string such as 'layer_out[2]', not {type(text).__name__} {text!r}"
        )
    raw = text
    text = text.strip()
    m = _POINT_RE.fullmatch(text)
    if m is None:
        kinds = ["embed", "final_norm", "layer_out", "layer_in"]
        hint = difflib.get_close_matches(re.sub(r"\[.*", "", text), kinds, n=1, cutoff=0.5)
        suggestion = f"; did you mean '{hint[0]}{'[k]' if hint[0].startswith('layer') else ''}'?" if hint else ""
        raise PointError(
            f"unknown point {raw!r}: expected one of {', '.join(_SPELLINGS)}{suggestion}", 0
        )
    kind, index_text = m.group("kind"), m.group("index")
    if kind in ("embed", "final_norm"):
        if index_text is not None:
            raise PointError(f"{kind} takes no index (got {raw!r})", m.start("index"))
        return EMBED if kind == "embed" else FINAL_NORM
    if kind == "layer_delta" and not allow_delta:
        raise PointError(
            "layer_delta[k] (a layer's output without the residual) is a diagnosis, not a "
            "capture point: specs capture the residual stream (layer_out[k])",
            0,
        )
    if index_text is None:
        raise PointError(f"{kind} needs a layer index, e.g. '{kind}[2]'", len(text))
    index = int(index_text)
    column = raw.index(index_text)
    if index < 0:
        last = f"layer_out[{num_layers - 1}]" if num_layers else "layer_out[L-1]"
        raise PointError(
            f"negative layer index in {text!r}: -1 means the embedding in SGLang ids but the "
            f"last layer in Python; write 'embed' or '{last}'",
            column,
        )
    if kind == "layer_in":
        if num_layers is not None and index >= num_layers:
            raise PointError(_out_of_range("layer_in", index, num_layers), column)
        return EMBED if index == 0 else layer_out(index - 1)
    point = Point(cast(PointKind, kind), index)  # _POINT_RE's kind group only matches PointKind spellings
    if num_layers is not None and index >= num_layers:
        raise PointError(_out_of_range(kind, index, num_layers), column)
    return point
