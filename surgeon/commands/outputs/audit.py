"""The ``--json`` output models of the audit of a training set: audit. Its parts (slots, exact
identification, profile, flagged files) are the audit layer's own models
(:mod:`surgeon.audit.output`), re-exported here."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from surgeon.audit.output import (
    AuditExact,
    AuditFinding,
    AuditOutlier,
    AuditPointProfile,
    AuditProfile,
    AuditSlot,
    Seconds,
)
from surgeon.commands.outputs.base import _Output
from surgeon.core.shapes import Finite

__all__ = ["AuditExact", "AuditFinding", "AuditOutlier", "AuditOutput", "AuditPointProfile", "AuditProfile",
           "AuditSlot"]


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
    seconds: Seconds
    bytes: int
    files_per_s: Finite
    mb_per_s: Finite
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
