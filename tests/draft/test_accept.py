"""`surgeon accept` on the synthetic target: the seed case scaled down (a draft trained on three
layer outputs whose spec labels are shifted by one slot), a draft whose config states no ids, and
bad input. Every --json output is checked against `surgeon schema --output accept`."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
from click.testing import CliRunner

from surgeon.cli import main
from surgeon.core.errors import UNDECIDED

pytestmark = pytest.mark.slow

TRUE_SPEC = """spec: 1
name: synthetic-true
target: {architecture: LlamaForCausalLM, num_layers: 4, hidden_size: 64, model_type: llama}
captures:
  a: layer_out[1]
  b: layer_out[2]
  c: layer_out[3]
draft: {kind: eagle3, fc_input: [a, b, c], fc_in_features: 192}
"""
LABELLED_SPEC = TRUE_SPEC.replace("synthetic-true", "synthetic-labels").replace(
    "a: layer_out[1]\n  b: layer_out[2]\n  c: layer_out[3]", "a: embed\n  b: layer_out[1]\n  c: layer_out[2]")


def run(*args, code=None):
    """``accept ... --json``; ``code`` None: 0 or 4, as its verdict says (these tiny prompts often saturate
    position-1 acceptance, which then cannot tell neighbouring wirings apart)."""
    res = CliRunner().invoke(main, ["accept", *map(str, args), "--json"])
    if code is None:
        assert res.exit_code in (0, UNDECIDED), res.output
        assert (res.exit_code == UNDECIDED) == (json.loads(res.stdout)["verdict"] == "undecided"), res.output
    else:
        assert res.exit_code == code, res.output
    data = json.loads(res.stdout)
    schema = json.loads(CliRunner().invoke(main, ["schema", "--output", "accept"]).stdout)
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(data)]
    assert not errors, errors[:3]
    return data


@pytest.fixture
def specs(tmp_path):
    (tmp_path / "true.yaml").write_text(TRUE_SPEC)
    (tmp_path / "labels.yaml").write_text(LABELLED_SPEC)
    return tmp_path / "true.yaml", tmp_path / "labels.yaml"


def rows(data):
    return {w["name"]: w for w in data["wirings"]}


def test_the_miswired_deployment_shows_the_drop(specs, synthetic_target, seed_draft):
    true_spec, labelled = specs
    data = run(true_spec, seed_draft, "--target", f"hf:{synthetic_target}", "--length", "36")
    by = rows(data)
    spec, shifted = by["spec"], by["labels shifted +1"]
    assert shifted["points"] == ["embed", "layer_out[1]", "layer_out[2]"]
    assert spec["per_position"][0] >= 0.95
    assert spec["per_position"][0] - shifted["per_position"][0] >= 0.05
    assert spec["expected_accepted"] - shifted["expected_accepted"] >= 0.3
    # the engines, from the draft config's SpecForge ids [1, 2, 3]
    # vLLM reads id k as layer_out[k-1]: every slot one layer early: a drop
    assert by["vllm serves"]["points"] == ["layer_out[0]", "layer_out[1]", "layer_out[2]"]
    assert spec["expected_accepted"] - by["vllm serves"]["expected_accepted"] >= 0.05  # measured 3.00 vs 2.88
    assert by["sglang serves"]["not_servable"]  # SGLang's llama.py cannot capture the last layer's output
    assert data["n_prompts"] == 32 and "seed 0" in data["prompts"]
    # deployed by its labels, the draft is below a 95% floor: exit 3
    low = run(labelled, seed_draft, "--target", f"hf:{synthetic_target}", "--length", "36", "--min", "0.95", code=3)
    assert not low["ok"] and rows(low)["spec"]["per_position"][0] < 0.95


def test_a_draft_whose_config_has_no_ids_is_reported(specs, synthetic_target, seed_draft, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(seed_draft, bare)
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["eagle_config"]
    (bare / "config.json").write_text(json.dumps(cfg))
    prompts = tmp_path / "p.txt"
    prompts.write_text("# two prompts\n1 2 3 4 5 6 7 8 9 10 11 12\n[20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]\n")
    data = run(specs[0], bare, "--target", f"hf:{synthetic_target}", "--length", "30", "--prompts", prompts)
    assert data["n_prompts"] == 2 and data["prompts"].startswith("file ")
    assert all(v is None for v in data["draft_info"]["stated_ids"].values())
    assert any("states no aux layer ids" in n for n in data["notes"])
    served = [w for w in data["wirings"] if w["name"].endswith("serves")]
    assert served and all("no ids" in w["why"] for w in served)


def test_bad_input_is_exit_2(specs, synthetic_target, seed_draft, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 x\n")
    res = CliRunner().invoke(main, ["accept", str(specs[0]), str(seed_draft), "--target", f"hf:{synthetic_target}",
                                    "--prompts", str(bad)])
    assert res.exit_code == 2 and f"{bad}:1:1" in res.output
    res = CliRunner().invoke(main, ["accept", str(specs[0]), str(seed_draft), "--target", str(tmp_path / "none")])
    assert res.exit_code == 2
    res = CliRunner().invoke(main, ["accept", str(specs[0]), str(tmp_path), "--target", f"hf:{synthetic_target}"])
    assert res.exit_code == 2 and "no config.json" in res.output
