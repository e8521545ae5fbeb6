"""check-draft on a DFlash draft reads the config as each engine's DFlash path does: SGLang's
``dflash_config.target_layer_ids`` (else top-level ``target_layer_ids``) through the target class's
``set_dflash_layers_to_capture`` (never ``eagle_config``), SpecForge's the same ids through SGLang's
setter, and vLLM's speculators translation of ``aux_hidden_state_layer_ids``; what is not modelled is a
warning (not verified), never the EAGLE-3 reading."""

from __future__ import annotations

import json

import pytest

from surgeon.core.spec import load_spec
from surgeon.wiring.draft import check_draft
from tests.conftest import tiny_spec

SGLANG_DEFAULT = ("layer_out[1]", "layer_out[3]", "layer_out[4]")  # SGLang's EAGLE-3 default for 8 layers
ZLAB_012 = ["layer_out[0]", "layer_out[1]", "layer_out[2]"]  # dflash ids [0, 1, 2]: output of layers 0, 1, 2


def _spec(tmp_path, points=SGLANG_DEFAULT):
    return load_spec(tiny_spec(tmp_path, points=points, kind="dflash", architecture="Qwen3ForCausalLM"))


def _draft(tmp_path, config, name="draft"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def _zlab(ids=None, **more):
    dflash = {"mask_token_id": 0} | ({} if ids is None else {"target_layer_ids": ids})
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1,
            "block_size": 4, "dflash_config": dflash} | more


def _kinds(report, severity="error"):
    return [f.kind for f in report.findings if f.severity == severity]


def _detail(report, kind):
    return " ".join(f.detail for f in report.findings if f.kind == kind)


@pytest.mark.parametrize("engine", ["sglang", "specforge"])
def test_dflash_target_layer_ids_are_read_not_the_eagle3_default(tmp_path, engine):
    r = check_draft(_spec(tmp_path), _draft(tmp_path, _zlab([0, 1, 2])), engine)
    assert r.ids_used == [0, 1, 2] and r.captured == ZLAB_012
    assert not r.ok and "slot" in _kinds(r) and "missing_ids" not in _kinds(r, "warning")
    assert "DFlash" in r.config_rule
    assert "set_dflash_layers_to_capture (sglang/srt/models/qwen3.py:" in _detail(r, "dflash_setter")
    if engine == "sglang":
        assert "srt/speculative/dflash_utils.py:" in _detail(r, "dflash_runner")
    else:
        assert "model_providers.py:238" in _detail(r, "dflash_trainer")


@pytest.mark.parametrize("engine", ["sglang", "specforge"])
def test_dflash_ids_that_match_the_spec_pass(tmp_path, engine):
    r = check_draft(_spec(tmp_path, ("layer_out[0]", "layer_out[1]", "layer_out[2]")),
                    _draft(tmp_path, _zlab([0, 1, 2])), engine)
    assert r.ok and r.captured == ZLAB_012


def test_sglang_dflash_never_reads_eagle_config(tmp_path):
    spec = _spec(tmp_path, ("layer_out[1]", "layer_out[3]", "layer_out[5]"))
    cfg = _zlab([0, 1, 2], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5]})
    r = check_draft(spec, _draft(tmp_path, cfg), "sglang")
    assert r.ids_used == [0, 1, 2] and r.captured == ZLAB_012 and not r.ok
    assert "spec_aux_hidden_state.py:" in _detail(r, "ignored_ids")


def test_sglang_dflash_reads_the_top_level_target_layer_ids_fallback(tmp_path):
    cfg = _zlab(None, target_layer_ids=[0, 1, 2])
    r = check_draft(_spec(tmp_path), _draft(tmp_path, cfg), "sglang")
    assert r.ids_used == [0, 1, 2] and r.captured == ZLAB_012 and not r.ok


def test_sglang_dflash_default_is_an_error_it_is_not_verified_to_be_the_spec(tmp_path):
    """No ids: SGLang builds its own default from the layer counts (build_target_layer_ids), which
    surgeon does not evaluate; passing would claim a wiring nobody checked (8 layers, 1 draft layer:
    SGLang serves layer_out[4])."""
    r = check_draft(_spec(tmp_path), _draft(tmp_path, _zlab(None)), "sglang")
    assert r.ids_used is None and r.captured == [] and not r.ok
    missing = _detail(r, "missing_ids")
    assert "not verified" in missing and "dflash_utils.py:" in missing and "missing_ids" in _kinds(r)


def test_repeated_or_negative_dflash_ids_are_refused(tmp_path):
    """SGLang's DFlash fc takes one state per id listed while its target captures one per layer;
    SpecForge's capture contract refuses repeated and negative ids."""
    spec = _spec(tmp_path, ("layer_out[1]", "layer_out[2]", "layer_out[3]"))
    for engine in ("sglang", "specforge"):
        r = check_draft(spec, _draft(tmp_path, _zlab([1, 1, 2]), name=f"rep_{engine}"), engine)
        assert not r.ok and "repeat" in _detail(r, "runner"), (engine, r.findings)
    r = check_draft(_spec(tmp_path, ("embed", "layer_out[1]", "layer_out[2]")), _draft(tmp_path, _zlab([-1, 1, 2]),
                                                                                        name="neg"), "specforge")
    assert not r.ok and "capture_contract.py" in _detail(r, "runner")


def test_an_fc_bias_on_a_dflash_draft_is_checked_against_the_dflash_model(tmp_path):
    """SGLang's DFlash draft builds its fc without a bias whatever config.json says (the EAGLE-3
    file's bias: true does not apply)."""
    import torch
    from safetensors.torch import save_file

    d = _draft(tmp_path, _zlab([0, 1, 2], bias=True))
    save_file({"fc.weight": torch.zeros(64, 192), "fc.bias": torch.zeros(64)}, str(d / "model.safetensors"))
    r = check_draft(_spec(tmp_path, tuple(ZLAB_012)), d, "sglang")
    assert "fc_bias" in _kinds(r) and "srt/models/dflash.py:" in _detail(r, "fc_bias")


def test_specforge_dflash_without_ids_is_its_value_error(tmp_path):
    r = check_draft(_spec(tmp_path), _draft(tmp_path, _zlab(None)), "specforge")
    assert not r.ok and "ValueError" in _detail(r, "missing_ids")


def test_sglang_dflash_range_check_refuses_negative_ids(tmp_path):
    r = check_draft(_spec(tmp_path, ("embed", "layer_out[1]", "layer_out[2]")), _draft(tmp_path, _zlab([-1, 1, 2])),
                    "sglang")
    assert not r.ok and "raises when val < 0" in _detail(r, "runner")


SPECULATORS_DFLASH = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
                      "mask_token_id": 0,
                      "transformer_layer_config": {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1},
                      "speculators_config": {"algorithm": "dflash", "verifier": {"name_or_path": None},
                                             "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]}}


@pytest.mark.parametrize("engine", ["vllm", "speculators"])
def test_vllm_translates_speculators_dflash_aux_ids(tmp_path, engine):
    cfg = SPECULATORS_DFLASH | {"aux_hidden_state_layer_ids": [1, 2, 3]}  # vLLM aux ids: layer_out[0], [1], [2]
    r = check_draft(_spec(tmp_path), _draft(tmp_path, cfg), engine)
    assert r.ids_used == [1, 2, 3] and r.captured == ZLAB_012 and not r.ok
    assert all(s.captured == ZLAB_012 for s in r.runners)
    assert "algos.py:" in _detail(r, "speculators_config") and "minus 1" in _detail(r, "speculators_config")
    ok = check_draft(_spec(tmp_path, ZLAB_012), r.draft, engine)
    assert ok.ok


def test_a_translation_modelled_in_part_still_applies_the_eagle_copy_the_runners_read_first(tmp_path):
    """speculators' dspark: update_dspark copies aux_hidden_state_layer_ids to
    eagle_aux_hidden_state_layer_ids (both runners read it first) and writes the ids - 1 elsewhere
    than dflash_config: a warning for the step not modelled, not errors claiming vLLM's default."""
    cfg = {**SPECULATORS_DFLASH, "speculators_model_type": "dspark", "architectures": ["Qwen3DSparkModel"],
           "aux_hidden_state_layer_ids": [1, 2, 3],
           "speculators_config": {**SPECULATORS_DFLASH["speculators_config"], "algorithm": "dspark"}}
    r = check_draft(_spec(tmp_path, tuple(ZLAB_012)), _draft(tmp_path, cfg), "vllm")
    assert r.ok, [f for f in r.findings if f.severity == "error"]
    assert {s.runner: s.captured for s in r.runners} == {"model runner V1": ZLAB_012, "model runner V2": ZLAB_012}
    assert "speculators_unmodelled" in _kinds(r, "warning")
