"""The hook another engine reader (the model runner's) uses to refuse a wiring: render exits with
BadInput naming its reason, lint reports it as an error; nothing is refused without one."""

from __future__ import annotations

from pathlib import Path

import pytest

from surgeon.core.errors import BadInput
from surgeon.core.spec import load_spec
from surgeon.wiring import evidence
from surgeon.wiring.lint import lint_spec
from surgeon.wiring.render import render

KIMI = Path(__file__).resolve().parents[2] / "specs/kimi-k2.5-eagle3.yaml"


def test_an_extra_refusal_stops_render_and_lint(monkeypatch):
    spec = load_spec(KIMI)
    assert render(spec, "vllm").ids == [3, 31, 59]
    seen = []

    def runner(cc, positions, num_layers):
        seen.append((cc.class_name, list(positions), num_layers))
        return "gpu_model_runner.py:1: the runner ignores the draft's ids"

    monkeypatch.setattr(evidence, "EXTRA_REFUSALS", [runner])
    with pytest.raises(BadInput, match="gpu_model_runner.py:1: the runner ignores"):
        render(spec, "vllm")
    assert seen[0] == ("DeepseekV3ForCausalLM", [3, 31, 59], 61)
    result = lint_spec(spec, engines=["vllm"])
    assert not result.ok and any("runner ignores" in i.message for i in result.issues)


def test_explain_says_an_extra_refusal(monkeypatch):
    from surgeon.wiring.render import explain

    spec = load_spec(KIMI)
    monkeypatch.setattr(evidence, "EXTRA_REFUSALS", [lambda cc, p, n: "runner.py:7: not served"])
    notes = explain(spec).notes
    assert "vllm: cannot serve this wiring: runner.py:7: not served" in notes
