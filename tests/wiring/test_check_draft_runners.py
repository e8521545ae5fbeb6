"""check-draft on vLLM reads the draft config as each of its model runners does (V1 and V2, as the
runner probe found their reads in the release), through vLLM's speculators translation, and with
eagle_config.use_aux_hidden_state tested for truthiness where the engine's source does."""

from __future__ import annotations

import json

import pytest

from surgeon.commands.outputs import json_output
from surgeon.core.errors import BadInput
from surgeon.core.runnerfacts import IdSource, RunnerCall, RunnerModel
from surgeon.core.spec import load_spec
from surgeon.engines.probes.vllm_runners import getter, runner_served
from surgeon.wiring.draft import check_draft
from tests.conftest import norms_spec, release_engine, tiny_spec

DEFAULT = ("layer_out[1]", "layer_out[3]", "layer_out[4]")  # vLLM's default (2, L//2, L-3) for 8 layers
SPECULATORS = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
               "transformer_layer_config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1},
               "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": None},
                                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]}}


def _draft(tmp_path, config):
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def _kinds(report, severity="error"):
    return [f.kind for f in report.findings if f.severity == severity]


@pytest.mark.parametrize("release", [None, "0.33.0"])
def test_v2_runner_never_reads_eagle_config_ids(tmp_path, release):
    root = None if release is None else release_engine("vllm", release)
    spec = load_spec(tiny_spec(tmp_path))
    r = check_draft(spec, _draft(tmp_path, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}}),
                    "vllm", engine_root=root)
    v1, v2 = (next(s for s in r.runners if s.runner == f"model runner {n}") for n in ("V1", "V2"))
    assert v1.captured == ["layer_out[1]", "layer_out[3]", "layer_out[5]"] and v1.key.startswith("eagle_config.")
    assert v2.ids is None and v2.captured == list(DEFAULT)
    assert r.ids_used == [2, 4, 6] and not r.ok  # ids_used/captured stay V1's
    served = next(f.detail for f in r.findings if f.kind == "runner_served")
    assert "model runner V2" in served and "vllm/config/vllm.py:" in served and "use_v2_model_runner" in served
    assert "eagle3_utils.py:" in served and "runners_differ" in _kinds(r)
    assert json_output("check-draft", r)["runners"][0]["call"].startswith("vllm/v1/worker/")


def test_v2_runner_reads_top_level_target_layer_ids(tmp_path):
    spec = load_spec(tiny_spec(tmp_path, points=DEFAULT))
    r = check_draft(spec, _draft(tmp_path, {"target_layer_ids": [0, 1, 2]}), "vllm")
    v2 = next(s for s in r.runners if s.runner == "model runner V2")
    assert v2.ids == [1, 2, 3] and v2.key == "target_layer_ids (+1)" and "eagle3_utils.py:" in (v2.read_at or "")
    assert v2.captured == ["layer_out[0]", "layer_out[1]", "layer_out[2]"]
    assert not r.ok and "runner_served" in _kinds(r)


def test_runners_agree_on_top_level_ids(tmp_path):
    spec = load_spec(tiny_spec(tmp_path))
    r = check_draft(spec, _draft(tmp_path, {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}), "speculators")
    assert len(r.runners) == 2 and r.ok
    assert all(s.captured == ["layer_out[1]", "layer_out[3]", "layer_out[5]"] for s in r.runners)


def test_a_runner_call_no_rule_matches_is_a_warning_not_verified(tmp_path):
    call = RunnerCall("v1/worker/other_runner.py", 7, "Other.setup", "set_aux_hidden_state_layers", "draft_ids",
                      sources=(IdSource("aux_ids", 0, "v1/worker/other_runner.py", 5),))
    runner = RunnerModel("vllm", "9.9", ("v1/worker/other_runner.py",), (call,), True)
    served, lines = runner_served(runner, None, {}, getter({}, tmp_path / "config.json"))
    assert served == [] and lines[0][:2] == ("warning", "runner_unmodelled")
    assert "vllm/v1/worker/other_runner.py:7" in lines[0][2] and "not verified" in lines[0][2]


def test_speculators_config_drops_a_top_level_eagle_config(tmp_path):
    spec = load_spec(tiny_spec(tmp_path))
    cfg = {**SPECULATORS, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}}
    r = check_draft(spec, _draft(tmp_path, cfg), "vllm")
    assert r.ids_used is None and r.captured == list(DEFAULT) and not r.ok
    assert "speculators_dropped" in _kinds(r, "warning")


def test_speculators_config_reads_transformer_layer_config_ids(tmp_path):
    spec = load_spec(tiny_spec(tmp_path, points=DEFAULT))
    cfg = json.loads(json.dumps(SPECULATORS))
    cfg["transformer_layer_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    r = check_draft(spec, _draft(tmp_path, cfg), "speculators")
    assert r.ids_used == [1, 2, 3] and r.captured == ["layer_out[0]", "layer_out[1]", "layer_out[2]"] and not r.ok
    assert r.ids_found["vllm_config.eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    said = next(f.detail for f in r.findings if f.kind == "speculators_config")
    assert "algos.py:" in said and "transformer_layer_config" in said


@pytest.mark.parametrize("engine", ["vllm", "speculators", "sglang"])
@pytest.mark.parametrize("value", [False, 0])
def test_use_aux_hidden_state_falsy_turns_the_capture_off(tmp_path, engine, value):
    spec = load_spec(tiny_spec(tmp_path))
    cfg = {"eagle_aux_hidden_state_layer_ids": [2, 4, 6],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": value}}
    r = check_draft(spec, _draft(tmp_path, cfg), engine)
    assert "aux_disabled" in _kinds(r)
    detail = next(f.detail for f in r.findings if f.kind == "aux_disabled")
    assert ("llm_base_proposer.py:" if engine != "sglang" else "attention_backend_setup.py:") in detail


def test_use_aux_hidden_state_not_a_boolean(tmp_path):
    spec = load_spec(tiny_spec(tmp_path))
    cfg = {"eagle_aux_hidden_state_layer_ids": [2, 4, 6],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": "false"}}
    r = check_draft(spec, _draft(tmp_path, cfg), "vllm")  # vLLM tests truthiness: "false" is on
    assert "aux_switch_type" in _kinds(r, "warning") and "aux_disabled" not in _kinds(r)
    with pytest.raises(BadInput, match="use_aux_hidden_state must be true or false"):
        check_draft(spec, tmp_path / "draft", "specforge")


@pytest.mark.parametrize("release", [None, "0.33.0"])
def test_target_architecture_in_an_eagle3_config_is_renamed_as_vllm_does(tmp_path, release):
    # SafeAILab's EAGLE-3 drafts name the target's class; vLLM's EAGLEConfig looks up Eagle3LlamaForCausalLM
    root = None if release is None else release_engine("vllm", release)
    spec = load_spec(norms_spec(tmp_path, "norm_before_fc: true"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "norm_before_fc": True,
           "eagle_aux_hidden_state_layer_ids": [2, 4, 6]}
    r = check_draft(spec, _draft(tmp_path, cfg), "vllm", engine_root=root)
    flag = next(n for n in r.norms if n.flag == "norm_before_fc")
    assert flag.state == "used" and "llama_eagle3.py" in (flag.used_at or "") and r.ok


@pytest.mark.parametrize("engine, config, kind", [("vllm", {}, "error"), ("speculators", {}, "error"),
                                                  ("sglang", {}, "error"), ("sglang", {"bias": True}, "info")])
def test_an_fc_bias_the_engine_never_loads_is_an_error(tmp_path, engine, config, kind):
    """vLLM builds the EAGLE-3 fc without a bias and its loader drops unexpected biases; SGLang builds
    one only where config.json says bias: true (and skips weights it has no parameter for)."""
    import torch
    from safetensors.torch import save_file

    spec = load_spec(tiny_spec(tmp_path, points=DEFAULT))
    d = _draft(tmp_path, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]},
                          "eagle_aux_hidden_state_layer_ids": [2, 4, 5], **config})
    save_file({"fc.weight": torch.zeros(64, 192), "fc.bias": torch.zeros(64)}, str(d / "model.safetensors"))
    r = check_draft(spec, d, engine)
    got = [f for f in r.findings if f.kind == "fc_bias"]
    assert [f.severity for f in got] == [kind], r.findings
    if kind == "error":
        assert "llama_eagle3.py:" in got[0].detail and ("utils.py:" in got[0].detail) == (engine != "sglang")
    (d / "model.safetensors").unlink()
    save_file({"fc.weight": torch.zeros(64, 192)}, str(d / "model.safetensors"))
    assert not [f for f in check_draft(spec, d, engine).findings if f.kind == "fc_bias"]


def test_the_fc_is_read_from_the_files_each_engines_loader_picks(tmp_path):
    """The fc checked is the one each engine loads: vLLM takes any consolidated*.safetensors as the
    "mistral" format (those files alone, default_loader.py); SGLang the files
    model.safetensors.index.json names (filter_duplicate_safetensors_files), or of exactly
    consolidated.safetensors and model.safetensors the latter."""
    import torch
    from safetensors.torch import save_file

    spec = load_spec(tiny_spec(tmp_path, points=DEFAULT))
    d = _draft(tmp_path, {"eagle_aux_hidden_state_layer_ids": [2, 4, 5],
                          "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}})
    save_file({"fc.weight": torch.zeros(64, 256)}, str(d / "consolidated.safetensors"))
    save_file({"fc.weight": torch.zeros(64, 192)}, str(d / "model.safetensors"))
    assert check_draft(spec, d, "sglang").fc_weight["file"] == "model.safetensors"
    assert check_draft(spec, d, "vllm").fc_weight["file"] == "consolidated.safetensors"
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": "model-00001-of-00001.safetensors"}}))
    r = check_draft(spec, d, "sglang")
    assert r.fc_weight == {"file": "model-00001-of-00001.safetensors", "tensor": "fc.weight", "shape": [64, 192]}
    assert "fc_shape" not in _kinds(r)
    r = check_draft(spec, d, "vllm")  # consolidated: its 4-slot fc is what vLLM loads
    assert r.fc_weight["file"] == "consolidated.safetensors" and "fc_shape" in _kinds(r)
    (d / "consolidated.safetensors").unlink()
    assert check_draft(spec, d, "vllm").fc_weight["file"] == "model-00001-of-00001.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": "model-2.safetensors"}}))
    with pytest.raises(BadInput, match=r"index\.json: names model-2\.safetensors, not a file of the draft folder"):
        check_draft(spec, d, "sglang")
    (d / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(BadInput, match=r"model\.safetensors\.index\.json:1:\d+: invalid JSON"):
        check_draft(spec, d, "vllm")
