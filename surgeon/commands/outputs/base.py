"""The top of every ``--json`` output: a closed object with its ``format`` number. The value types
the models share are in :mod:`surgeon.core.shapes`."""

from __future__ import annotations

from pydantic import Field

from surgeon.core.shapes import Closed


class _Output(Closed):
    format: int = Field(description="format number of this output; changes when a key is removed, renamed or retyped")
