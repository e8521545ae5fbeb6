"""What the command functions return when the library has no result object of its own.

Every result has ``to_json()`` and may have ``exit_code`` (0 when absent): the command's verdict
on its report, which the CLI exits with after rendering. ``--json`` prints
:func:`json_output`: ``{"format": N, **result.to_json()}``, where N is the output's format number
(:data:`FORMATS`) and the shape is the JSON Schema ``surgeon schema --output NAME`` prints
(:mod:`surgeon.commands.outputs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgeon.core.errors import BadInput


def exit_code_of(result: object) -> int:
    """The exit status a command's result asks for: 0 unless the result says otherwise."""
    return int(getattr(result, "exit_code", 0))


#: The format number of every ``--json`` output, by CLI verb. A number changes when a key is
#: removed or renamed or changes its type or meaning; adding a key keeps it. Scripts check it.
FORMATS: dict[str, int] = {
    "lint": 1, "explain": 1, "render": 1, "check-draft": 1, "review": 1, "conventions": 1,
    "match": 1, "verify": 1, "dump-info": 2, "export": 1, "check-hooks": 1,
    "apply": 1, "revert": 1, "status": 1, "diff": 1, "coverage": 1, "demo": 1, "doctor": 1,
    "infer-wiring": 1,
    "accept": 1,
    "audit": 2,  # 2: ok is false where identity is undecided (exit 4), not only on a finding
}


def json_output(command: str, result: Any) -> dict:
    """What ``surgeon COMMAND --json`` prints: the result's JSON under its format number."""
    return {"format": FORMATS[command], **result.to_json()}


@dataclass
class GeneratedText:
    """Text a command generated: printed by the caller, or already written to ``written``."""

    text: str
    written: str | None = None  # the new file it was written to; None: the caller prints it

    def to_json(self) -> dict:
        return {"text": self.text, "written": self.written}


def write_new_file(text: str, output: str | None) -> GeneratedText:
    """Write ``text`` to the new file ``output`` (never overwriting one), or hand it back to print."""
    if output is None:
        return GeneratedText(text)
    try:
        with open(output, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise BadInput(f"{output} exists; not overwritten") from None
    except OSError as e:
        raise BadInput(f"{output}: {e.strerror or e}") from None
    return GeneratedText(text, written=output)


@dataclass
class SchemaResult:
    schema: dict

    def to_json(self) -> dict:
        return self.schema


@dataclass
class LintReport:
    """Every linted spec; invalid specs are bad input (exit 2), warnings are not."""

    results: list[Any]  # surgeon.wiring.lint.LintResult, in argument order

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 2

    def to_json(self) -> dict:
        return {"ok": self.ok, "specs": [r.to_json() for r in self.results]}


@dataclass
class RenderReport:
    rendering: Any  # surgeon.wiring.render.Rendering
    pinned: dict | None = None  # the engines.<engine> values written into the spec (--pin)

    def to_json(self) -> dict:
        return self.rendering.to_json()


@dataclass
class DraftVerdict:
    """A draft checked against a spec: a draft the engine would feed wrongly is a mismatch."""

    report: Any  # surgeon.wiring.draft.DraftReport

    @property
    def ok(self) -> bool:
        return bool(self.report.ok)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 3

    def to_json(self) -> dict:
        return self.report.to_json()


@dataclass
class ReviewReport:
    review: Any  # surgeon.wiring.review.Review

    @property
    def markdown(self) -> str:
        return self.review.markdown

    def to_json(self) -> dict:
        return {**self.review.data, "markdown": self.review.markdown}


@dataclass
class ReferenceWritten:
    output: str
    points: int
    tokens: int
    num_layers: int
    hidden_size: int

    def to_json(self) -> dict:
        return {"output": self.output, "points": self.points, "tokens": self.tokens,
                "num_layers": self.num_layers, "hidden_size": self.hidden_size}


@dataclass
class FingerprintWritten:
    output: str
    points: int
    tokens: int
    dim: int
    seed: int

    def to_json(self) -> dict:
        return {"output": self.output, "points": self.points, "tokens": self.tokens, "dim": self.dim, "seed": self.seed}


@dataclass
class Verification:
    """A subject checked against its spec: any slot that is not what the spec declares is a mismatch."""

    result: Any  # surgeon.verify.harness.HarnessResult

    @property
    def ok(self) -> bool:
        return bool(self.result.ok)

    @property
    def exit_code(self) -> int:
        """0 every declared slot as declared, 3 one is not, 4 undecided (none wrong, one the reference
        cannot tell apart)."""
        return int(self.result.exit_code)

    def to_json(self) -> dict:
        return self.result.to_json()


_DUMP_KEYS = ("surgeon.kind", "surgeon.format", "spec.name", "spec.sha256", "engine", "engine.version", "model",
              "num_layers", "hidden_size", "tokens", "dtype")


def _number(text: str | None) -> int | None:
    """A count from the dump's (string-only) safetensors metadata; None when absent or not a number."""
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


@dataclass
class DumpInfo:
    file: str
    meta: dict  # the dump's metadata, without its captures list (safetensors metadata: all strings)
    captures: list[dict]  # name, point (None: not recorded), shape, dtype per capture
    layout: str = "surgeon"  # surgeon | trtllm | modelopt
    producer: dict | None = None  # a field dump's: detected (candidates), why, given (--slots)
    records: list[dict] = field(default_factory=list)  # per sequence: index, id, tokens, input_ids, loss_mask
    notes: list[str] = field(default_factory=list)

    @property
    def labelled(self) -> bool:
        return all(c["point"] is not None for c in self.captures)

    def to_json(self) -> dict:
        m = self.meta
        text = lambda k: m.get(k) or None  # an empty field is "not recorded"
        return {"file": self.file, "dump_format": _number(m.get("surgeon.format")),
                "spec": {"name": text("spec.name"), "sha256": text("spec.sha256")},
                "engine": text("engine"), "engine_version": text("engine.version"), "model": text("model"),
                "num_layers": _number(m.get("num_layers")), "hidden_size": _number(m.get("hidden_size")),
                "tokens": _number(m.get("tokens")), "dtype": text("dtype"), "captures": self.captures,
                "other_metadata": {k: v for k, v in m.items() if k not in _DUMP_KEYS},
                "layout": self.layout, "labelled": self.labelled, "producer": self.producer, "records": self.records,
                "notes": self.notes}


@dataclass
class Exported:
    layout: str
    out_dir: str
    written: list[Path]
    manifest: Path | None = None  # surgeon-export.json: each written slot's point and source

    def to_json(self) -> dict:
        return {"layout": self.layout, "written": [str(p) for p in self.written],
                "manifest": str(self.manifest) if self.manifest is not None else None}


@dataclass
class HookCheck:
    """Graph-safety findings in hook files: any finding is a mismatch with the contract."""

    files: int
    findings: list[Any]  # surgeon.capture.graphsafe.Finding

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 3

    def to_json(self) -> dict:
        return {"ok": self.ok, "findings": [x.to_json() for x in self.findings]}


@dataclass
class EngineRevert:
    engine: str
    engine_root: str
    reverted: list[str]
    restored: list[str]
    warnings: list[str]
    recovered: str | None

    def to_json(self) -> dict:
        return {"engine": self.engine, "engine_root": self.engine_root, "reverted": self.reverted,
                "restored": self.restored, "warnings": self.warnings, "recovered": self.recovered}


@dataclass
class RevertReport:
    reverted: list[EngineRevert] = field(default_factory=list)  # empty: --all with nothing applied

    def to_json(self) -> dict:
        return {"reverted": [r.to_json() for r in self.reverted]}


@dataclass
class EnginePatch:
    """One applied patch and the engine holding it."""

    engine: str
    engine_root: Path
    patch: Any  # surgeon.patch.manifest.PatchStatus


@dataclass
class StatusReport:
    """Every applied patch; a drifted or missing file is a mismatch with what was applied."""

    patches: list[EnginePatch]
    # files carrying a patch marker no manifest records: (engine, surgeon.patch.manifest.Unrecorded)
    unrecorded: list[tuple[str, Any]] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)  # interrupted transactions finished or rolled back
    pending: list[str] = field(default_factory=list)  # interrupted transactions left (read-only root)

    @property
    def ok(self) -> bool:
        return all(p.patch.state == "applied" for p in self.patches) and not self.unrecorded and not self.pending

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 3

    def to_json(self) -> dict:
        return {"ok": self.ok, "patches": [_patch_json(p) for p in self.patches],
                "unrecorded": [{"engine": e, "relpath": u.relpath, "patch": u.marker.name,
                                "spec_sha256": u.marker.spec_sha256, "manifest_id": u.marker.manifest_id,
                                "original_sha256": u.marker.original_sha256, "restorable": u.restorable,
                                "advice": u.advice()} for e, u in self.unrecorded],
                "recovered": self.recovered, "pending": self.pending}


def _patch_json(row: EnginePatch) -> dict:
    from surgeon.patch.manifest import ABSENT

    p = row.patch
    return {"engine": row.engine, "engine_root": str(row.engine_root), "name": p.name, "state": p.state,
            "spec": {"name": p.spec_name, "sha256": p.spec_sha256},
            "engine_version": p.engine_version, "created": p.created,
            "files": [{"relpath": f.relpath, "state": f.state, "created": f.sha256_before == ABSENT,
                       "sha256_before": f.sha256_before, "sha256_after": f.sha256_after} for f in p.files]}


@dataclass
class PatchDiff:
    engine: str
    patch: Any  # surgeon.patch.manifest.PatchStatus
    diff: str

    def to_json(self) -> dict:
        from surgeon.patch.manifest import ABSENT

        p = self.patch
        return {"engine": self.engine, "name": p.name, "state": p.state,
                "files": [{"relpath": f.relpath, "created": f.sha256_before == ABSENT, "state": f.state}
                          for f in p.files], "diff": self.diff}


@dataclass
class DiffReport:
    patches: list[PatchDiff]

    @property
    def text(self) -> str:
        return "".join(p.diff for p in self.patches)

    def to_json(self) -> dict:
        return {"patches": [p.to_json() for p in self.patches]}


@dataclass
class DemoReport:
    """The demo's run; it passes when the right wiring verifies, the wrong one is caught and the
    engine file comes back byte-identical. ``problem`` says what went wrong otherwise."""

    result: Any  # surgeon.run.demo.DemoResult

    @property
    def problem(self) -> str | None:
        r = self.result
        if not r.reverted_identical:
            return f"internal error: {r.engine_root / r.model_file} is not byte-identical after the revert"
        if not r.right.ok:
            return "the demo's wiring check did not come out as expected (see above): the spec's wiring failed verify"
        if r.wrong.ok:
            return "the demo's wiring check did not come out as expected (see above): the mis-wiring was not caught"
        if r.draft is not None and not r.draft.ok:
            return ("the demo's draft step did not come out as expected (see above): the trained wiring was not "
                    "named with a decided margin, or the mis-labelled deployment did not accept less")
        return None

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def exit_code(self) -> int:
        if self.ok:
            return 0
        return 1 if not self.result.reverted_identical else 3

    def to_json(self) -> dict:
        return self.result.to_json()
