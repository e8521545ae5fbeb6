"""The ``--json`` output models of patches: apply (a plugin built by ``--deliver plugin`` included),
revert, status, doctor, diff, coverage.

Each model reads the attributes of the command's result (``surgeon.patch.apply.ApplyOutcome``, the
reports of :mod:`surgeon.commands.patch_commands`, ``surgeon.patch.coverage.CoverageReport``) and the
objects nested in it, by its field names."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from surgeon.commands.outputs.base import _Output
from surgeon.core.shapes import Closed, Fraction, PathText, Seconds


class SpecRef(Closed):
    name: str
    sha256: str


class CarriedModuleOut(Closed):
    module: str = Field(description="the engine module the plugin replaces at engine start")
    relpath: str = Field(description="its file under the engine root")
    file: str = Field(description="the rewritten copy's file name inside the package")
    sha256: str = Field(description="sha256 of the engine's pristine file, checked at every engine start")
    carried_sha256: str
    loop_class: str | None


class PluginOutput(Closed):
    out: PathText = Field(description="the plugin's folder (put it on PYTHONPATH, or pip install it)")
    package: str
    entry_point: str | None = Field(description="group:name of the vllm.general_plugins entry point")
    engine: str
    engine_version: str = Field(description="the release the plugin was built for and refuses any other")
    engine_root: PathText = Field(description="read only: the plugin never writes it")
    version_pin: str | None = Field(description="the spec's engine version pin, checked at engine start")
    spec: SpecRef
    mode: str
    max_tokens: int
    modules: list[CarriedModuleOut]
    hooks_module: str
    architectures: list[str]
    anchors: list[str]
    files: list[str] = Field(description="every file written, relative to out")
    replaced: bool = Field(description="a previous build of the same plugin in out was replaced")
    activate: str
    install: str
    uninstall: str


class ApplyOutput(_Output):
    patch: str
    engine: str
    engine_version: str
    engine_root: PathText
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
    plugin: PluginOutput | None = Field(None, description="present with --deliver plugin: the plugin built (the other "
                                                          "keys describe the patch it carries; nothing was written "
                                                          "under the engine root, so dry_run is true)")

    @model_serializer(mode="wrap")
    def _diff_only_when_asked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The ``diff`` key is printed only when there is a diff (--diff or --dry-run)."""
        data = handler(self)
        if self.plugin is None:
            data.pop("plugin", None)
        if self.diff is None:
            data.pop("diff", None)
        return data


class EngineRevert(Closed):
    engine: str
    engine_root: str
    reverted: list[str]
    restored: list[str]
    warnings: list[str]
    recovered: str | None


class RevertOutput(_Output):
    reverted: list[EngineRevert]


class PatchedFile(Closed):
    relpath: str
    state: str
    created: bool
    sha256_before: str
    sha256_after: str


class AppliedPatch(Closed):
    engine: str
    engine_root: PathText
    name: str
    state: str = Field(description="applied, drifted or missing")
    spec: SpecRef
    engine_version: str
    created: str
    files: list[PatchedFile]


class UnrecordedFile(Closed):
    engine: str
    relpath: str
    patch: str = Field(description="the patch its marker names")
    spec_sha256: str
    manifest_id: str
    original_sha256: str
    restorable: bool = Field(description="the stored original its marker names is there (surgeon doctor --repair)")
    advice: str


class StatusOutput(_Output):
    ok: bool = Field(description="every patched file is as applied (exit 3 otherwise)")
    patches: list[AppliedPatch]
    # patched files no manifest records, interrupted transactions: keys added after format 1 was
    # fixed, so optional in the schema (older outputs still validate); this release always prints them
    unrecorded: list[UnrecordedFile] | None = None
    recovered: list[str] | None = None
    pending: list[str] | None = None


class DoctorFinding(Closed):
    path: str
    problem: str
    action: str | None
    fixed: bool
    repairable: bool


class DoctorEngine(Closed):
    engine: str
    engine_root: PathText
    repair: bool
    healthy: bool
    findings: list[DoctorFinding]


class DoctorOutput(_Output):
    ok: bool = Field(description="nothing is left unfixed (exit 3 otherwise)")
    healthy: bool
    engines: list[DoctorEngine]


class DiffFile(Closed):
    relpath: str
    created: bool
    state: str


class PatchDiff(Closed):
    engine: str
    name: str
    state: str
    files: list[DiffFile]
    diff: str


class DiffOutput(_Output):
    patches: list[PatchDiff]


class ClassCoverage(Closed):
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


class CoverageFigures(Closed):
    patchable: int
    total: int
    fraction: Fraction
    patchable_with_guard: int
    fraction_with_guard: Fraction


class NonDecoderClasses(Closed):
    total: int
    patchable: int
    classes: list[str] = Field(description="PATH:LINE CLASS of each")


class UnparsedFile(Closed):
    path: str
    reason: str


class EngineCoverage(Closed):
    engine: str
    version: str
    root: str
    files: int
    files_parsed: int
    seconds: Seconds
    probe_error: str | None
    unparsed: list[UnparsedFile]
    decoder: CoverageFigures
    all: CoverageFigures
    native: int
    final_norm: int
    classes: list[ClassCoverage]
    # the platform, per-directory counts, non-decoder classes apart: keys added after format 1 was
    # fixed, so optional in the schema (older outputs still validate); this release always prints them
    platform: str | None = None
    trees: list[dict[str, Any]] | None = None
    non_decoder: NonDecoderClasses | None = None
    decoder_failures: list[str] | None = None


class CoverageOutput(_Output):
    seconds: Seconds
    engines: list[EngineCoverage]
