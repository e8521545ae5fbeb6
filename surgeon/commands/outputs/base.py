"""What every output model shares: closed objects, the ``format`` field, and the value types that
turn a result's attribute into its JSON form (a path into its string, a number that is not finite
into ``null``)."""

from __future__ import annotations

import math
from pathlib import PurePath
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

Point = str  # a physical point: "embed", "layer_out[k]", "layer_delta[k]", "final_norm"


def _path_text(value: Any) -> Any:
    return str(value) if isinstance(value, PurePath) else value


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


#: A path, printed as its string.
PathText = Annotated[str, BeforeValidator(_path_text)]
#: A number, ``null`` when it is not known or not finite.
Finite = Annotated[float | None, BeforeValidator(_finite)]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Output(_Closed):
    format: int = Field(description="format number of this output; changes when a key is removed, renamed or retyped")
