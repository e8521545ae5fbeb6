"""The shape of every ``--json`` output, as typed models: ``surgeon schema --output NAME`` prints
the JSON Schema generated from them, and the tests validate each command's real output against it.

One model per output (:data:`OUTPUTS`, keyed by CLI verb), each with its ``format`` number
(:data:`FORMATS`). The model is the only place an output's shape is written: :func:`json_output`
validates the command's result against it, reading the result's attributes by the model's field
names (pydantic ``from_attributes``), and prints what the model dumps; no result builds its JSON
by hand. A result that reports another object's fields names it ``reported``.

Objects are closed (``additionalProperties: false``): a key a command prints is a key documented
here, so a new key is added here with the code that prints it (the format number stays; it
changes when a key is removed, renamed or retyped).
Numbers are JSON numbers; a value that is not known or not finite is ``null``.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from surgeon.commands.outputs.audit import AuditOutput
from surgeon.commands.outputs.base import _Output, non_finite
from surgeon.commands.outputs.capture import CheckHooksOutput, DumpInfoOutput, ExportOutput
from surgeon.commands.outputs.drafts import AcceptOutput, DemoOutput, InferWiringOutput
from surgeon.commands.outputs.harness import MatchOutput, VerifyOutput
from surgeon.commands.outputs.patches import ApplyOutput, CoverageOutput, DiffOutput, DoctorOutput, RevertOutput, StatusOutput
from surgeon.commands.outputs.plan import PlanOutput
from surgeon.commands.outputs.specs import (
    CheckDraftOutput,
    ConventionsOutput,
    ExplainOutput,
    LintOutput,
    RenderOutput,
    ReviewOutput,
)
from surgeon.commands.outputs.upgrade import UpgradeCheckOutput
from surgeon.core.errors import InternalError

#: The format number of every ``--json`` output, by CLI verb. A number changes when a key is
#: removed or renamed or changes its type or meaning; adding a key keeps it. Scripts check it.
FORMATS: dict[str, int] = {
    "lint": 1, "explain": 1, "render": 1, "check-draft": 1, "review": 1, "conventions": 1,
    "match": 1, "verify": 1, "dump-info": 2, "export": 1, "check-hooks": 1,
    "apply": 1, "revert": 1, "status": 1, "diff": 1, "coverage": 1, "demo": 1, "doctor": 1,
    "infer-wiring": 1,
    "accept": 1,
    "audit": 2,  # 2: ok is false where identity is undecided (exit 4), not only on a finding
    "upgrade-check": 1,
    "plan": 1,
}

OUTPUTS: dict[str, type[_Output]] = {
    "lint": LintOutput, "explain": ExplainOutput, "render": RenderOutput, "check-draft": CheckDraftOutput,
    "review": ReviewOutput, "conventions": ConventionsOutput, "match": MatchOutput, "verify": VerifyOutput,
    "dump-info": DumpInfoOutput, "export": ExportOutput, "check-hooks": CheckHooksOutput,
    "apply": ApplyOutput, "revert": RevertOutput, "status": StatusOutput, "diff": DiffOutput,
    "coverage": CoverageOutput, "demo": DemoOutput, "doctor": DoctorOutput,
    "infer-wiring": InferWiringOutput, "accept": AcceptOutput, "audit": AuditOutput,
    "upgrade-check": UpgradeCheckOutput, "plan": PlanOutput,
}


def output_schema(name: str) -> dict:
    """The JSON Schema (draft 2020-12) of ``surgeon NAME --json``, its format number fixed."""
    from surgeon.core.errors import BadInput

    model = OUTPUTS.get(name)
    if model is None:
        raise BadInput(f"no --json output named {name!r}; one of: spec, {', '.join(OUTPUTS)}")
    schema = model.model_json_schema()
    schema["properties"]["format"]["const"] = FORMATS[name]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": f"surgeon:output/{name}/{FORMATS[name]}",
            **schema, "title": f"surgeon {name} --json, format {FORMATS[name]}"}


class _Stamped:
    """A result seen with its output's format number: what the model reads attributes from."""

    def __init__(self, source: Any, format_number: int) -> None:
        self._source, self.format = source, format_number

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)


def output_of(command: str, result: Any) -> _Output:
    """The output model of ``surgeon COMMAND --json`` filled from ``result`` (or from the object it
    names ``reported``): each field read from the attribute of its name; a missing or mistyped one
    is an internal error, never a silently different JSON."""
    source = getattr(result, "reported", result)
    try:
        return OUTPUTS[command].model_validate(_Stamped(source, FORMATS[command]), from_attributes=True)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top)"
        raise InternalError(f"the {command} result does not fill its --json model: {where}: {first['msg']} "
                            f"({e.error_count()} error(s))") from None


def json_output(command: str, result: Any) -> dict:
    """What ``surgeon COMMAND --json`` prints: the result through its output model, under its format
    number. A number that is not finite anywhere in it is an internal error, never a bare ``NaN``."""
    data = output_of(command, result).model_dump(mode="json")
    where = non_finite(data)
    if where is not None:
        raise InternalError(f"the {command} result holds a number that is not finite at {where}; "
                            "surgeon prints no NaN or Infinity")
    return data
