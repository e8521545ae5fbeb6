"""The top of every ``--json`` output: a closed object with its ``format`` number. The value types
the models share are in :mod:`surgeon.core.shapes`; here, the one rule every number printed obeys:
it is finite (JSON has no NaN or Infinity; Python's ``json`` would print them bare)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from surgeon.core.shapes import Closed


def non_finite(data: Any, where: str = "") -> str | None:
    """The dotted path of the first number in ``data`` (a model's JSON dump) that is not finite,
    or None: the check every ``--json`` output passes before it is printed (a field typed
    ``dict[str, Any]`` is not covered by its model's types). This is the rule, and the one that
    says where; ``allow_nan=False`` in ``cli_render.emit_json`` only asserts it afterwards."""
    if isinstance(data, float):
        return None if math.isfinite(data) else (where or "(top)")
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found = non_finite(value, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


class _Output(Closed):
    format: int = Field(description="format number of this output; changes when a key is removed, renamed or retyped")
