"""The ``--json`` output models of the audit of a training set: audit."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from surgeon.commands.outputs.base import Point, _Closed, _Output


class AuditFinding(_Closed):
    kind: str = Field(description="structure, unreadable, nonfinite, zero, constant, repeated, stale, identity, exact; "
                                  "error: the file's audit hit an error no check foresaw (exit 1)")
    slot: str | None
    detail: str


class AuditOutlier(_Closed):
    path: str
    findings: list[AuditFinding]


class AuditSlot(_Closed):
    name: str
    declared: Point | None
    files: int
    norm_mean: float | None = Field(description="mean over files of the slot's mean per-token L2 norm")
    norm_min: float | None
    norm_max: float | None
    log_norm_median_mean: float | None = Field(description="the identity statistic (median log per-token norm), "
                                                           "its mean over files")
    log_norm_median_std: float | None
    identity: dict[str, int] = Field(description="nearest point of the profile (or the verdict) -> files")
    verdicts: dict[str, int] = Field(description="the statistics' identity verdicts: ok, mismatch, no_match, "
                                                 "unresolved, not_run -> files (every key, 0 included)")
    exact: dict[str, int] = Field(description="on the files identified exactly: matched point (or verdict) -> files")
    exact_verdicts: dict[str, int] = Field(description="exact identification's verdicts: ok, mismatch, no_match, "
                                                       "undecided, unlabelled -> files (every key, 0 included)")
    undecided: int = Field(description="files whose identity neither the statistics (unresolved, or not_run without "
                                       "a finding of the slot's own) nor exact identification decided")


class AuditPointProfile(_Closed):
    point: Point
    centre: float
    spread: float
    tol: float


class AuditProfile(_Closed):
    source: str
    prompts: int
    tokens: int
    ladder: list[int] = Field(description="the rungs of sample lengths judged each against its own profile: rung n "
                                          "holds samples of n to 2n-1 rows (the last, longer ones too); [] : one "
                                          "profile for every length")
    points: list[AuditPointProfile]


class AuditExact(_Closed):
    model: str | None = Field(description="the HF model folder run on each file's own tokens; null: no --reference hf:")
    files: int = Field(description="files identified exactly (this run's and the resume state's)")
    budget: int | None = Field(description="--exact N; null: auto (see rule)")
    rule: str = Field(description="the budget's rule in words")
    params: int | None = Field(description="the target's parameter count (its safetensors headers); null: not read")
    undecided_files: int = Field(description="files the statistics left undecided: the escalation's candidates")
    escalated: int = Field(description="of those, the files selected for exact identification")
    spot_checked: int = Field(description="other files selected, evenly spaced, as a spot check")
    found: int = Field(description="files identified exactly with a slot not its declared point")
    seconds: float = Field(description="wall time of this run's exact identification")


class AuditOutput(_Output):
    ok: bool = Field(description="no file has a finding and every slot's identity is decided for most of its files "
                                 "(exit 3 on a finding, else 4 when undecided; 1 where a file's audit hit an error)")
    verdict: Literal["ok", "flagged", "undecided", "error"] = Field(
        description="flagged: a file has a finding (exit 3); undecided: none has, but the identity of most files of a "
                    "slot is undecided (exit 4); error: a file's audit hit an error no check foresaw (exit 1)")
    headline: str = Field(description="the report's first line: the verdict and, where undecided, what the run cannot see")
    undecided: list[str] = Field(description="the slots whose identity is undecided for most of their files")
    cannot_see: list[str] = Field(description="where a slot is undecided: the faults only the identity pass finds, "
                                              "which this run cannot see; else []")
    root: str
    spec: str
    files: int
    resumed: int = Field(description="files whose results came from the resume state")
    flagged: int
    findings: dict[str, int] = Field(description="finding kind -> files with it")
    layouts: dict[str, int]
    seconds: float
    bytes: int
    files_per_s: float | None
    mb_per_s: float | None
    workers: int
    backend: str
    structure_only: bool
    slots: list[AuditSlot]
    exact: AuditExact
    profile: AuditProfile | None
    outliers: list[AuditOutlier] = Field(description="flagged files in path order (the first 1000)")
    outliers_listed: int
    notes: list[str]
    report: str | None = Field(description="the HTML report written, if any")
