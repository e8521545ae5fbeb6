"""The ``--json`` output models of the wiring harness: match, verify.

:class:`MatchResult` reads a :class:`surgeon.verify.harness.HarnessResult` (verify's result reports
its own ``result``): each field from the attribute of its name, the annotated types below turning
an attribute into its JSON form where the two differ."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from surgeon.commands.outputs.base import _Output
from surgeon.core.shapes import Closed, Finite, PointText


def _source_of(value: Any) -> Any:
    return value if isinstance(value, str) else value.source


#: What was read (a :class:`surgeon.verify.subjects.Subject`), printed as where it came from.
SourceText = Annotated[str, BeforeValidator(_source_of)]


class MatchedSlot(Closed):
    name: str
    declared: PointText | None
    matched: PointText | None = Field(description="the point the slot holds; null: no point fits")
    rel_err: Finite = Field(description="relative error of the best candidate; null: not finite (NaN/Inf)")
    margin: Finite = Field(description="runner-up error / best error; null when exact")
    exact: bool = Field(description="the slot equals its best candidate bit for bit")
    verdict: Literal["ok", "mismatch", "no_match", "unlabelled", "undecided"] = Field(
        description="undecided: the slot fits several points about equally, its declared point among them")


class Diagnosis(Closed):
    kind: str
    detail: str


class Suggested(Closed):
    captures: dict[str, PointText]
    engine_ids: dict[str, list[int] | str] = Field(description="engine -> ids for the corrected captures, or why none")


class MatchResult(Closed):
    """A match or verify result (the demo nests two, without a format of their own)."""

    ok: bool = Field(description="nothing wrong and nothing undecided: every declared slot is its declared point, "
                                 "the others matched one point (exit 0; 3 on a mismatch, 4 when undecided)")
    verdict: Literal["ok", "mismatch", "undecided", "identified"] = Field(
        description="mismatch: a slot is not its declared point or matches none; undecided: else, a slot the "
                    "reference cannot tell apart (exit 4); identified: every slot matched one point, none declared")
    headline: str = Field(description="the report's first line: the verdict and the slots it rests on")
    slots: list[MatchedSlot]
    diagnosis: list[Diagnosis] = Field(description="what went wrong, the explanation covering the most slots first")
    missing: list[str] = Field(default_factory=list, description="the spec's dump slots ('name: point') at points "
                                                                "no slot's record gives (a mismatch)")
    suggested: Suggested
    subject: SourceText
    layout: str
    reference: str
    alignment: str
    notes: list[str]


class MatchOutput(_Output, MatchResult):
    pass


class VerifyOutput(_Output, MatchResult):
    pass
