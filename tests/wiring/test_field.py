"""`surgeon explain` and `surgeon lint` with the rest of the field: TensorRT-LLM and Model
Optimizer's hf, trtllm and vllm collection backends, with their ids and evidence; and the hazard
that one --aux-layers list captures one layer earlier through Model Optimizer's vllm backend
(compute_hidden_states_vllm.py:178,262 hand the ids to vLLM unchanged; vLLM id j is layer_out[j-1]
in the installed release, read by the probe)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from surgeon.cli import main
from surgeon.core.conventions import EngineConvention, NotExpressible, builtin_convention
from surgeon.core.points import layer_out
from surgeon.core.spec import load_spec
from surgeon.engines.facts.modelopt import open_modelopt
from surgeon.engines.view import open_engine
from surgeon.wiring.field import FIELD_COLUMNS, explain_field, hazards, modelopt_vllm_ids
from surgeon.wiring.lint import lint_spec
from surgeon.wiring.render import explain

pytestmark = pytest.mark.engine
SPECS = Path(__file__).resolve().parents[2] / "specs"
KIMI = SPECS / "kimi-k2.5-eagle3.yaml"
FILE_LINE = re.compile(r"[\w/.-]+\.py:\d+")


def test_explain_kimi_has_trtllm_and_model_optimizer_rows_with_their_ids():
    ex = explain(load_spec(KIMI))
    ids = {r.name: r.ids for r in ex.rows}
    for name, k in (("low", 2), ("mid", 30), ("high", 58)):
        assert ids[name]["trtllm"] == k and ids[name]["modelopt-hf"] == k and ids[name]["modelopt-trtllm"] == k
        assert ids[name]["modelopt-vllm"] == k + 1 == ids[name]["vllm"]
    assert ids["last"]["trtllm"] == -1 and ids["last"]["modelopt-hf"] == 60
    assert str(ids["last"]["modelopt-vllm"]).startswith("not expressible")
    for c in FIELD_COLUMNS:
        assert c in ex.conventions and ex.fc_lists[c].ok
        assert ex.fc_lists[c].captures == ["layer_out[2]", "layer_out[30]", "layer_out[58]"]
    assert ex.fc_lists["modelopt-vllm"].ids == [3, 31, 59]
    assert "not verified against a source on this machine" in ex.conventions["trtllm"]
    evidence = [n for n in ex.notes if n.startswith(("trtllm: evidence", "modelopt: evidence"))]
    assert any("eagle3.py:139" in n for n in evidence) and any("compute_hidden_states_vllm.py:262" in n for n in evidence)
    assert any("hf_eagle.py:63" in n for n in evidence)  # probed from the fetched wheel
    assert all(FILE_LINE.search(n) or "line not recorded" in n for n in evidence)


def test_explain_cli_text_and_json_show_the_columns():
    runner = CliRunner()
    res = runner.invoke(main, ["explain", str(KIMI), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["rows"][0]["ids"]["trtllm"] == 2 and data["rows"][0]["ids"]["modelopt-vllm"] == 3
    assert data["fc_lists"]["modelopt-hf"]["ids"] == [2, 30, 58]
    res = runner.invoke(main, ["explain", str(KIMI)], env={"COLUMNS": "220"})
    assert res.exit_code == 0, res.output
    assert "modelopt-trtllm" in res.output and "trtllm          [2, 30, 58]" in res.output


def test_the_vllm_backend_hazard_names_the_layers_and_the_fix():
    ex = explain(load_spec(KIMI))
    (fc,) = [n for n in ex.notes if n.startswith("modelopt: hazard: --aux-layers 2,30,58")]
    assert "layer_out[1], layer_out[29], layer_out[57] through its vllm backend" in fc
    assert "pass --aux-layers 3,31,59" in fc and "compute_hidden_states_vllm.py:178,262" in fc
    (dflash,) = [n for n in ex.notes if "--aux-layers dflash = [1, 15, 30, 44, 58]" in n]
    assert "layer_out[0], layer_out[14], layer_out[29], layer_out[43], layer_out[57] through its vllm" in dflash
    assert any("layer_out[60] through vllm" in n and "final_norm through hf" in n for n in ex.notes)


def test_no_fc_hazard_when_the_engine_reads_ids_as_layer_outputs():
    """The hazard is computed from the convention the ids reach, not printed for every spec: through
    a convention where id k is layer_out[k] (SGLang's llama setter, +1 then entry capture) the
    hf and vllm-backend lists agree."""
    spec = load_spec(SPECS / "llama-3.1-8b-eagle3.yaml")
    sglang = EngineConvention(builtin_convention("sglang", "LlamaForCausalLM"), "built-in")
    assert not any(h.startswith("modelopt: hazard: --aux-layers 1,15,28") for h in hazards(spec, sglang, None))
    vllm = open_engine("vllm").convention("LlamaForCausalLM")
    assert any(h.startswith("modelopt: hazard: --aux-layers 1,15,28") for h in hazards(spec, vllm, None))


def test_modelopt_vllm_refuses_the_last_layer_as_an_aux_id():
    """vLLM id 61 would be layer_out[60], but the vllm script refuses --aux-layers outside [0, L)
    (it appends L itself as the last slot)."""
    vllm = open_engine("vllm").convention("DeepseekV3ForCausalLM")
    with pytest.raises(NotExpressible, match=r"outside \[0, 61\)"):
        modelopt_vllm_ids(vllm, [layer_out(2), layer_out(60)], 61)
    assert modelopt_vllm_ids(vllm, [layer_out(2), layer_out(59)], 61) == [3, 60]


def test_without_the_modelopt_source_explain_says_so(monkeypatch):
    import surgeon.wiring.field as field

    monkeypatch.setattr(field, "open_modelopt", lambda root=None: None)
    answer = explain_field(load_spec(KIMI), open_engine("vllm").convention("DeepseekV3ForCausalLM"))
    assert any("source is not on this machine" in n for n in answer.notes)
    assert answer.ids["low"]["modelopt-hf"] == 2  # the backend table still answers
    assert open_modelopt() is not None  # the real lookup finds the fetched wheel


def test_lint_lists_the_model_optimizer_hazards_as_checked_lines():
    result = lint_spec(load_spec(KIMI))
    assert result.ok
    assert any(c.startswith("modelopt: hazard: --aux-layers 2,30,58") for c in result.checked)
    assert not any("modelopt" in i.message for i in result.issues)


def test_a_small_model_gets_no_invented_defaults(tmp_path):
    """TensorRT-LLM raises for 2 to 5 layers (eagle3.py:133-135), and Model Optimizer's DFlash
    preset raises for fewer target than draft layers: both are said, not computed."""
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text("spec: 1\nname: tiny4\ntarget: {architecture: LlamaForCausalLM, num_layers: 4, hidden_size: 64}\n"
                         "captures: {b: 'layer_out[1]', c: 'layer_out[2]'}\n"
                         "draft: {kind: eagle3, fc_input: [b, c], fc_in_features: 128}\n")
    ex = explain(load_spec(spec_file))
    assert any(n.startswith("trtllm: default when no ids are given: none: Eagle3SpecMetadata raises") for n in ex.notes)
    assert any(n.startswith("modelopt: dflash preset not evaluated for L=4") and "raises" in n for n in ex.notes)
    assert ex.fc_lists["modelopt-vllm"].ids == [2, 3] and ex.fc_lists["modelopt-hf"].ids == [1, 2]


def test_each_evaluated_preset_cites_the_return_that_produced_it():
    """The values explain prints for Model Optimizer's presets name the ``return`` the evaluator
    executed, checked against the fetched wheel's own line."""
    source = open_modelopt()
    assert source is not None
    notes = [n for n in explain(load_spec(KIMI)).notes if "(returned at " in n]
    assert len(notes) == 2  # the eagle default and the dflash preset's hazard
    for n in notes:
        path, line = re.search(r"\(returned at ([\w/.]+\.py):(\d+):", n).groups()
        text = (source.root.parent / path).read_text(encoding="utf-8").splitlines()[int(line) - 1]
        assert text.strip().startswith("return ")
