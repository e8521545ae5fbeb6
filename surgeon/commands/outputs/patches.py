"""The ``--json`` output models of patches: apply, revert, status, doctor, diff, coverage."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from surgeon.commands.outputs.base import _Closed, _Output


class SpecRef(_Closed):
    name: str
    sha256: str


class ApplyOutput(_Output):
    patch: str
    engine: str
    engine_version: str
    engine_root: str
    model_file: str
    loop_class: str | None
    hooks_file: str
    hooks_module: str
    mode: Literal["dump", "aux"]
    max_tokens: int
    recipe: str
    anchors: list[str]
    spec: SpecRef
    dry_run: bool
    changed: bool | None = Field(description="null on a dry run")
    files_written: list[str]
    replaced: list[str]
    recovered: str | None
    diff: str | None = Field(None, description="present with --diff")


class EngineRevert(_Closed):
    engine: str
    engine_root: str
    reverted: list[str]
    restored: list[str]
    warnings: list[str]
    recovered: str | None


class RevertOutput(_Output):
    reverted: list[EngineRevert]


class PatchedFile(_Closed):
    relpath: str
    state: str
    created: bool
    sha256_before: str
    sha256_after: str


class AppliedPatch(_Closed):
    engine: str
    engine_root: str
    name: str
    state: str = Field(description="applied, drifted or missing")
    spec: SpecRef
    engine_version: str
    created: str
    files: list[PatchedFile]


class StatusOutput(_Output):
    ok: bool = Field(description="every patched file is as applied (exit 3 otherwise)")
    patches: list[AppliedPatch]
    # being added next to this (issue 14): patched files no manifest records, interrupted transactions
    unrecorded: list[dict[str, Any]] | None = None
    recovered: list[str] | None = None
    pending: list[str] | None = None


class DoctorFinding(_Closed):
    path: str
    problem: str
    action: str | None
    fixed: bool
    repairable: bool


class DoctorEngine(_Closed):
    engine: str
    engine_root: str
    repair: bool
    healthy: bool
    findings: list[DoctorFinding]


class DoctorOutput(_Output):
    ok: bool = Field(description="nothing is left unfixed (exit 3 otherwise)")
    healthy: bool
    engines: list[DoctorEngine]


class DiffFile(_Closed):
    relpath: str
    created: bool
    state: str


class PatchDiff(_Closed):
    engine: str
    name: str
    state: str
    files: list[DiffFile]
    diff: str


class DiffOutput(_Output):
    patches: list[PatchDiff]


class ClassCoverage(_Closed):
    path: str
    class_name: str
    method: str
    line: int
    decoder: bool
    layers: bool
    embed: bool
    final_norm: bool
    reason: str | None
    embed_reason: str | None
    final_norm_reason: str | None
    recipe: str | None
    native: list[str]
    with_guard: bool
    patchable: bool
    patchable_with_guard: bool


class CoverageFigures(_Closed):
    patchable: int
    total: int
    fraction: float
    patchable_with_guard: int
    fraction_with_guard: float


class UnparsedFile(_Closed):
    path: str
    reason: str


class EngineCoverage(_Closed):
    engine: str
    version: str
    root: str
    files: int
    files_parsed: int
    seconds: float
    probe_error: str | None
    unparsed: list[UnparsedFile]
    decoder: CoverageFigures
    all: CoverageFigures
    native: int
    final_norm: int
    classes: list[ClassCoverage]
    # being added next to this (issue 14): the platform, per-directory counts, non-decoder classes apart
    platform: str | None = None
    trees: list[dict[str, Any]] | None = None
    non_decoder: dict[str, Any] | None = None
    decoder_failures: list[str] | None = None


class CoverageOutput(_Output):
    seconds: float
    engines: list[EngineCoverage]
