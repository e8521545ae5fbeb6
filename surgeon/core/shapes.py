"""What every ``--json`` output model is made of: closed objects, and the value types that turn a
result's attribute into its JSON form (a path or a point into its text, a number that is not finite
into ``null``, wall time to the millisecond). The models themselves live with the outputs
(:mod:`surgeon.commands.outputs`; the audit's parts in :mod:`surgeon.audit.output`, which the audit
serializes itself); these are shared by all of them, here in the lowest layer so every layer can
use them."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from pathlib import PurePath
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

from surgeon.core.points import Point as _PhysicalPoint

#: A physical point's name: "embed", "layer_out[k]", "layer_delta[k]", "final_norm".
Point = str


class Closed(BaseModel):
    """An object of an output: a key not declared here is an error (``additionalProperties: false``)."""

    model_config = ConfigDict(extra="forbid")


def _path_text(value: Any) -> Any:
    return str(value) if isinstance(value, PurePath) else value


def _point_text(value: Any) -> Any:
    return str(value) if isinstance(value, _PhysicalPoint) else value


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


#: A path, printed as its text.
PathText = Annotated[str, BeforeValidator(_path_text)]
#: A physical point (:class:`surgeon.core.points.Point`), printed as its name.
PointText = Annotated[str, BeforeValidator(_point_text)]
#: A number, ``null`` when it is not known or not finite.
Finite = Annotated[float | None, BeforeValidator(_finite)]


def _must_be_finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{value} is not a finite number")
    return value


#: A number that is always known and finite: a non-finite value is the producing code's bug, which
#: the output refuses (an internal error naming the field) rather than print ``NaN``.
Real = Annotated[float, AfterValidator(_must_be_finite)]
#: Seconds of wall time, to the millisecond.
Seconds = Annotated[float, AfterValidator(lambda v: round(v, 3))]
#: A fraction, to 4 decimals.
Fraction = Annotated[float, AfterValidator(lambda v: round(v, 4))]
#: Seconds per step (a dict of them), to the hundredth.
Timings = Annotated[dict[str, float], AfterValidator(lambda d: {k: round(v, 2) for k, v in d.items()})]


class Reads:
    """An attribute that is another object's, read through a dotted path: ``engine =
    Reads("plan.engine")`` on a result whose output reports its plan's engine at its own level.
    What an output model reads where the result holds the field one object down, declared in one
    line instead of a property that only forwards."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._get = operator.attrgetter(path)

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else self._get(obj)


_T = TypeVar("_T", bound=type)


def reads(path: str, names: str) -> Callable[[_T], _T]:
    """A class decorator: each of ``names`` (space-separated) becomes ``Reads(f"{path}.{name}")``,
    for a result whose output reports several fields of one object it holds under their own names."""

    def add(cls: _T) -> _T:
        for name in names.split():
            setattr(cls, name, Reads(f"{path}.{name}"))
        return cls

    return add
