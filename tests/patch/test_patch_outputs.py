"""The ``--json`` outputs of apply, status, diff, revert, doctor and coverage, read by their output
models from the results' attributes: every field of every (nested) model is read from the result,
none silently left at its default, and the keys are the ones the commands always printed."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
from pydantic import BaseModel

from surgeon import commands
from surgeon.commands.outputs import json_output, output_of, output_schema
from surgeon.patch.coverage import ClassCoverage, CoverageReport, EngineCoverage, Unparsed

REPO = Path(__file__).resolve().parents[2]
LLAMA_SPEC = str(REPO / "specs/llama-3.1-8b-eagle3.yaml")
LLAMA = "model_executor/models/llama.py"
HOOKS = "model_executor/models/_surgeon_hooks_llama_3_1_8b_eagle3.py"


def unread(model: BaseModel, where: str = "") -> list[str]:
    """The fields of ``model`` and of the models in it that took their default, not an attribute."""
    out = [f"{where}.{n}" for n in type(model).model_fields if n not in model.model_fields_set]
    for n in type(model).model_fields:
        value = getattr(model, n)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                out += unread(item, f"{where}.{n}")
    return out


def printed(verb: str, result) -> dict:
    """What ``surgeon VERB --json`` prints for ``result``, checked against VERB's schema."""
    assert unread(output_of(verb, result)) == [], verb
    data = json_output(verb, result)
    jsonschema.validate(data, output_schema(verb))
    return data


@pytest.mark.engine
def test_patch_outputs_read_every_field_from_the_results(engine_copy):
    root = engine_copy("vllm")
    dry = printed("apply", commands.apply(spec=LLAMA_SPEC, engine="vllm", engine_root=str(root), dry_run=True))
    assert dry["dry_run"] is True and dry["changed"] is None and dry["files_written"] == [] and dry["diff"].startswith("---")
    applied = printed("apply", commands.apply(spec=LLAMA_SPEC, engine="vllm", engine_root=str(root)))
    assert "diff" not in applied  # printed only with --diff (or a dry run)
    assert applied["engine_root"] == str(root) and applied["changed"] is True and applied["recovered"] is None
    assert sorted(applied["files_written"]) == sorted([LLAMA, HOOKS]) and applied["replaced"] == []
    assert applied["spec"] == {"name": "llama-3.1-8b-eagle3", "sha256": dry["spec"]["sha256"]}

    status = printed("status", commands.status(engine="vllm", engine_root=str(root)))
    assert status["ok"] is True and (status["unrecorded"], status["recovered"], status["pending"]) == ([], [], [])
    patch = status["patches"][0]
    assert patch["engine_root"] == str(root) and patch["spec"] == applied["spec"] and patch["state"] == "applied"
    assert {f["relpath"]: f["created"] for f in patch["files"]} == {LLAMA: False, HOOKS: True}
    diff = printed("diff", commands.diff(engine="vllm", engine_root=str(root)))
    assert {f["relpath"]: f["created"] for f in diff["patches"][0]["files"]} == {LLAMA: False, HOOKS: True}
    assert printed("doctor", commands.doctor(engine="vllm", engine_root=str(root))) == {
        "format": 1, "ok": True, "healthy": True,
        "engines": [{"engine": "vllm", "engine_root": str(root), "repair": False, "healthy": True, "findings": []}]}

    (root / LLAMA).write_text((root / LLAMA).read_text() + "\n# hand edit\n")
    reverted = printed("revert", commands.revert(engine="vllm", engine_root=str(root), force=True))
    assert reverted["reverted"][0]["engine_root"] == str(root) and reverted["reverted"][0]["warnings"]
    report = commands.status(engine="vllm", engine_root=str(root))
    lost = printed("status", report)["unrecorded"]
    _, u = report.unrecorded[0]  # still an (engine, Unrecorded) pair for the text renderer
    assert lost == [{"engine": "vllm", "relpath": LLAMA, "patch": "llama-3.1-8b-eagle3", "spec_sha256": applied["spec"]["sha256"],
                     "manifest_id": u.marker.manifest_id, "original_sha256": u.marker.original_sha256,
                     "restorable": True, "advice": u.advice()}]
    doctor = printed("doctor", commands.doctor(engine="vllm", engine_root=str(root)))
    assert doctor["ok"] is False and doctor["engines"][0]["findings"][0]["path"]


def test_coverage_output_counts_and_rounds():
    classes = [ClassCoverage("m/a.py", "A", "forward", 3, True, True, True, True, native=("AForCausalLM",)),
               ClassCoverage("m/b.py", "B", "forward", 5, True, False, False, False, reason="x: bypass", with_guard=True),
               ClassCoverage("m/c.py", "C", "forward", 7, True, False, False, True, reason="x: no"),
               ClassCoverage("m/v.py", "Vision", "forward", 9, False, True, True, False)]
    ec = EngineCoverage("vllm", "0.1", "/r", 4, 4, classes, seconds=1.23456, unparsed=[Unparsed("m/z.py", "line 1: bad")],
                        platform="cuda", trees=[{"dir": "m", "files": 5}])
    out = printed("coverage", CoverageReport([ec], seconds=2.00049))
    assert out["seconds"] == 2.0 and out["format"] == 1
    e = out["engines"][0]
    assert e["seconds"] == 1.235 and e["unparsed"] == [{"path": "m/z.py", "reason": "line 1: bad"}]
    assert e["decoder"] == {"patchable": 1, "total": 3, "fraction": 0.3333, "patchable_with_guard": 2,
                            "fraction_with_guard": 0.6667}
    assert e["all"] == {"patchable": 2, "total": 4, "fraction": 0.5, "patchable_with_guard": 3, "fraction_with_guard": 0.75}
    assert e["non_decoder"] == {"total": 1, "patchable": 1, "classes": ["m/v.py:9 Vision"]}
    assert e["decoder_failures"] == ["m/b.py:5 B", "m/c.py:7 C"] and (e["native"], e["final_norm"]) == (1, 2)
    assert e["trees"] == [{"dir": "m", "files": 5}] and e["platform"] == "cuda"
    assert e["classes"][0]["native"] == ["AForCausalLM"] and e["classes"][0]["patchable"] is True
    assert e["classes"][1]["patchable"] is False and e["classes"][1]["patchable_with_guard"] is True
    empty = printed("coverage", CoverageReport([EngineCoverage("sglang", "0", "/r", 0, 0)]))["engines"][0]
    assert empty["decoder"]["fraction"] == 1.0 and empty["all"]["fraction_with_guard"] == 1.0
