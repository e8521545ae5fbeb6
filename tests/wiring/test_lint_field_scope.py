"""`lint`'s Model Optimizer lines are about vLLM (its vllm backend hands the ids to vLLM), so they
appear only when vLLM is checked, and the DFlash preset's hazard only for a DFlash draft."""

from __future__ import annotations

import textwrap

from surgeon.core.spec import load_spec
from surgeon.wiring.lint import lint_spec


def _spec(tmp_path, kind: str):
    f = tmp_path / f"{kind}.yaml"
    f.write_text(textwrap.dedent(f"""\
        spec: 1
        name: tiny
        target: {{architecture: LlamaForCausalLM, num_layers: 8, hidden_size: 64}}
        captures: {{low: 'layer_out[1]', mid: 'layer_out[3]', high: 'layer_out[5]'}}
        draft: {{kind: {kind}, fc_input: [low, mid, high], fc_in_features: 192}}
        """))
    return load_spec(f)


def _modelopt(result) -> list[str]:
    return [c for c in result.checked if c.startswith("modelopt:")]


def test_modelopt_lines_only_when_vllm_is_checked(tmp_path):
    spec = _spec(tmp_path, "eagle3")
    assert _modelopt(lint_spec(spec, engines=["sglang"])) == []
    assert any(c.startswith("modelopt: hazard: --aux-layers 1,3,5 ") for c in _modelopt(lint_spec(spec, engines=["vllm"])))
    assert _modelopt(lint_spec(spec)) != []  # no engine asked for: every serving engine, vLLM among them


def test_the_dflash_preset_hazard_only_for_a_dflash_draft(tmp_path):
    eagle = _modelopt(lint_spec(_spec(tmp_path, "eagle3"), engines=["vllm"]))
    dflash = _modelopt(lint_spec(_spec(tmp_path, "dflash"), engines=["vllm"]))
    assert not any("--aux-layers dflash" in c for c in eagle)
    assert any(c.startswith("modelopt: hazard: --aux-layers dflash = ") for c in dflash)
