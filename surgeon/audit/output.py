"""The audit's parts of ``surgeon audit --json``, as typed models: each slot's aggregate, exact
identification, the identity profile and the flagged files. The top-level output
(:class:`surgeon.commands.outputs.audit.AuditOutput`) is made of them; they live here, in the audit
layer, because the audit itself needs their serialized form: the HTML report
(:mod:`surgeon.audit.html`) and the profile's digest, which a resume state records
(:meth:`surgeon.audit.profile.Profile.digest`).

Each model reads its fields from the attributes of the same name (pydantic ``from_attributes``):
a :class:`~surgeon.audit.aggregate.SlotAggregate`, an :class:`~surgeon.audit.exact.ExactReport`, a
:class:`~surgeon.audit.profile.Profile`; the annotated types below turn an attribute into its JSON
form where the two differ. ``dump(Model, obj)`` is that JSON form.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field

from surgeon.core.shapes import Closed, Finite, Point, Real, Seconds


def _most_first(value: Any) -> Any:
    return dict(sorted(value.items(), key=lambda kv: -kv[1])) if isinstance(value, dict) else value


def _rungs(value: Any) -> Any:
    return [r[0] if isinstance(r, tuple) else r for r in value] if isinstance(value, (list, tuple)) else value


#: Counts by key (a Counter), the largest first.
MostFirst = Annotated[dict[str, int], BeforeValidator(_most_first)]
#: A profile's ladder ((rung, its points), ...), as its rungs.
Rungs = Annotated[list[int], BeforeValidator(_rungs)]


class AuditFinding(Closed):
    kind: str = Field(description="structure, unreadable, nonfinite, zero, constant, repeated, stale, identity, exact; "
                                  "error: the file's audit hit an error no check foresaw (exit 1)")
    slot: str | None
    detail: str


class AuditOutlier(Closed):
    path: str
    findings: list[AuditFinding]


class AuditSlot(Closed):
    name: str
    declared: Point | None
    files: int
    norm_mean: Finite = Field(description="mean over files of the slot's mean per-token L2 norm")
    norm_min: Finite
    norm_max: Finite
    log_norm_median_mean: Finite = Field(description="the identity statistic (median log per-token norm), "
                                                           "its mean over files")
    log_norm_median_std: Finite
    identity: MostFirst = Field(description="nearest point of the profile (or the verdict) -> files")
    verdicts: dict[str, int] = Field(description="the statistics' identity verdicts: ok, mismatch, no_match, "
                                                 "unresolved, not_run -> files (every key, 0 included)")
    exact: dict[str, int] = Field(description="on the files identified exactly: matched point (or verdict) -> files")
    exact_verdicts: dict[str, int] = Field(description="exact identification's verdicts: ok, mismatch, no_match, "
                                                       "undecided, unlabelled -> files (every key, 0 included)")
    undecided: int = Field(description="files whose identity neither the statistics (unresolved, or not_run without "
                                       "a finding of the slot's own) nor exact identification decided")


class AuditPointProfile(Closed):
    point: Point
    centre: Real
    spread: Real
    tol: Real


class AuditProfile(Closed):
    source: str
    prompts: int
    tokens: int
    ladder: Rungs = Field(description="the rungs of sample lengths judged each against its own profile: rung n "
                                      "holds samples of n to 2n-1 rows (the last, longer ones too); [] : one "
                                      "profile for every length")
    points: list[AuditPointProfile]


class AuditExact(Closed):
    model: str | None = Field(description="the HF model folder run on each file's own tokens; null: no --reference hf:")
    files: int = Field(description="files identified exactly (this run's and the resume state's)")
    budget: int | None = Field(description="--exact N; null: auto (see rule)")
    rule: str = Field(description="the budget's rule in words")
    params: int | None = Field(description="the target's parameter count (its safetensors headers); null: not read")
    undecided_files: int = Field(description="files the statistics left undecided: the escalation's candidates")
    escalated: int = Field(description="of those, the files selected for exact identification")
    spot_checked: int = Field(description="other files selected, evenly spaced, as a spot check")
    found: int = Field(description="files identified exactly with a slot not its declared point")
    seconds: Seconds = Field(description="wall time of this run's exact identification")


def dump(model: type[BaseModel], obj: Any, mode: str = "json") -> dict[str, Any]:
    """``obj`` (its attributes, or a dict's keys) in ``model``'s form, as a dict."""
    return model.model_validate(obj, from_attributes=True).model_dump(mode=mode)
