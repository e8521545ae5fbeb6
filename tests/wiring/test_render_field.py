"""`surgeon render` for the cited-table targets (trtllm, modelopt-hf|trtllm|vllm, zlab) and the
DFlash ids of the trainer configs (specforge, speculators): each convention checked against its
cited table, and the same points compared across targets where the answers differ."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from surgeon.commands.outputs import RenderOutput
from surgeon.core.conventions import HF
from surgeon.core.errors import BadInput
from surgeon.core.points import FINAL_NORM, layer_out, parse_point
from surgeon.core.spec import load_spec
from surgeon.engines.dflash_trainers import SPECFORGE, SPECULATORS, TABLES, ZLAB, ZLAB_CONV
from surgeon.engines.field_tables import TRTLLM, TRTLLM_CONV, check_against_source
from surgeon.wiring.render import RENDER_TARGETS, explain, render
from tests.conftest import cli_run

KIMI = Path(__file__).resolve().parents[2] / "specs" / "kimi-k2.5-eagle3.yaml"


def _spec(tmp_path, points=("layer_out[1]", "layer_out[3]", "layer_out[5]"), kind="dflash", fc="[low, mid, high]"):
    """A tiny 8-layer Llama spec; ``fc`` may name ``last`` (final_norm)."""
    f = tmp_path / "s.yaml"
    n = len(fc.strip("[]").split(","))
    f.write_text(textwrap.dedent(f"""\
        spec: 1
        name: tiny
        target: {{architecture: LlamaForCausalLM, num_layers: 8, hidden_size: 64}}
        captures:
          low: {points[0]}
          mid: {points[1]}
          high: {points[2]}
          last: final_norm
        draft: {{kind: {kind}, fc_input: {fc}, fc_in_features: {64 * n}}}
        """))
    return load_spec(f)


# -- TensorRT-LLM ---------------------------------------------------------------------------------
def test_trtllm_renders_the_kimi_layer_outputs_as_eagle_decoding_config():
    spec = load_spec(KIMI)
    r = render(spec, "trtllm")
    assert r.ids == [2, 30, 58] and r.verified
    cfg = r.draft_config["speculative_config"]
    assert cfg["eagle3_layers_to_capture"] == [2, 30, 58] and cfg["decoding_type"] == "Eagle"
    # every key written is a field the cited source declares
    assert "eagle3_layers_to_capture" in TRTLLM["fields"].needle and "speculative_model_dir" in TRTLLM["model_dir"].needle
    assert "eagle3_one_model=True" in TRTLLM["one_model_only"].needle and cfg["eagle3_one_model"] is True
    assert r.launch_flags == ["--extra_llm_api_options", "<OPTIONS>.yaml"]
    assert any("not read from an installed source" in n for n in r.notes)
    assert str(TRTLLM["one_model_sorts"]) in r.evidence and str(TRTLLM["fields"]) in r.evidence
    # the same points: SGLang and vLLM name them one higher, TensorRT-LLM by the layer itself
    assert render(spec, "vllm").ids == [3, 31, 59] and render(spec, "sglang").ids == [3, 31, 59]


@pytest.mark.parametrize(("points", "fc", "kind", "why"), [
    (("embed", "layer_out[3]", "layer_out[5]"), "[low, mid, high]", "eagle3", "nothing captures before layer 0"),
    (("layer_out[5]", "layer_out[1]", "layer_out[3]"), "[low, mid, high]", "eagle3", "ascending layer order"),
    (("layer_out[1]", "layer_out[3]", "layer_out[5]"), "[low, mid, high]", "dflash", "DFlash path .* not modelled"),
])
def test_trtllm_refuses_what_it_cannot_express(tmp_path, points, fc, kind, why):
    with pytest.raises(BadInput, match=why):
        render(_spec(tmp_path, points, kind, fc), "trtllm")


def test_trtllm_sorted_set_and_minus_one_are_the_cited_table():
    """What the refusals rest on: the ids are sorted (eagle3.py), -1 is the post-norm state."""
    assert "sorted(list(self.layers_to_capture))" in TRTLLM["sorted"].needle
    assert "Eagle3OneModelSpecMetadata" in TRTLLM["one_model_sorts"].needle and "-1 stays" in TRTLLM["one_model_sorts"].says
    assert TRTLLM_CONV.to_point(-1, 8) == FINAL_NORM and TRTLLM_CONV.encode([layer_out(1), layer_out(7)], 8) == [1, 7]


def test_trtllm_refusal_is_one_line_exit_2(tmp_path):
    spec = _spec(tmp_path, ("embed", "layer_out[3]", "layer_out[5]"), "eagle3")
    err = cli_run("render", spec.file, "--engine", "trtllm", code=2).stderr
    assert err.count("\n") == 1 and "cannot render for trtllm" in err


# -- Model Optimizer's collection backends ---------------------------------------------------------
def test_modelopt_targets_render_the_lists_explain_shows():
    spec = load_spec(KIMI)
    ex = explain(spec)
    got = {t: render(spec, t) for t in ("modelopt-hf", "modelopt-trtllm", "modelopt-vllm")}
    for t, r in got.items():
        assert r.ids == ex.fc_lists[t].ids and r.launch_flags == ["--aux-layers", ",".join(map(str, r.ids))]
    # one list, two meanings: through vLLM the same points need ids one higher (the hazard explain lints)
    assert got["modelopt-hf"].ids == got["modelopt-trtllm"].ids == [2, 30, 58]
    assert got["modelopt-vllm"].ids == [3, 31, 59]
    assert any("hazard" in n for n in got["modelopt-vllm"].notes)
    last = {t: (r.dump or {}).get("hidden_states") for t, r in got.items()}
    assert last == {"modelopt-hf": "final_norm", "modelopt-trtllm": "final_norm", "modelopt-vllm": "layer_out[60]"}


# -- DFlash: z-lab, SpecForge, speculators ---------------------------------------------------------
def test_zlab_ids_are_the_cited_hidden_states_offset(tmp_path):
    """dflash/model.py:43-44 reads hidden_states[layer_id + 1]: the convention is HF's index minus 1."""
    assert ZLAB["offset"].needle == "offset = 1" and "hidden_states[layer_id + offset]" in ZLAB["read"].needle
    for p in ("embed", "layer_out[0]", "layer_out[6]", "final_norm"):
        point = parse_point(p)
        assert HF.to_point(ZLAB_CONV.to_id(point, 8) + 1, 8) == point
    r = render(_spec(tmp_path), "zlab")
    assert r.draft_config == {"dflash_config": {"target_layer_ids": [1, 3, 5]}} and r.launch_flags == []
    # a list, not a set: z-lab keeps the order
    assert render(_spec(tmp_path, ("layer_out[5]", "layer_out[1]", "layer_out[3]")), "zlab").ids == [5, 1, 3]


def test_zlab_renders_embed_with_the_engines_hazard_and_refuses_the_last_layer(tmp_path):
    r = render(_spec(tmp_path, ("embed", "layer_out[3]", "layer_out[5]")), "zlab")
    assert r.ids == [-1, 3, 5] and [c["captured"] for c in r.captures][0] == "embed"
    assert any("hazard: id -1" in n for n in r.notes)
    with pytest.raises(BadInput, match="final norm's output"):
        render(_spec(tmp_path, ("layer_out[1]", "layer_out[3]", "layer_out[7]")), "zlab")
    with pytest.raises(BadInput, match="DFlash drafts only"):
        render(_spec(tmp_path, kind="eagle3"), "zlab")


def test_specforge_dflash_ids_are_sglangs(tmp_path):
    """SpecForge captures DFlash through SGLang's set_dflash_layers_to_capture (capture.py:99)."""
    assert SPECFORGE["setter"].needle == '"dflash": "set_dflash_layers_to_capture",'
    spec = _spec(tmp_path, ("layer_out[0]", "layer_out[2]", "layer_out[6]"))
    r = render(spec, "specforge")
    assert r.ids == render(spec, "sglang").ids == [0, 2, 6]
    assert r.draft_config == {"dflash_config": {"target_layer_ids": [0, 2, 6]}}
    assert str(SPECFORGE["key"]) in r.evidence and any("set_dflash_layers_to_capture" in e for e in r.evidence)
    assert r.launch_flags[0] == "scripts/prepare_hidden_states.py"
    # SGLang's runner decides, not SpecForge's EAGLE rule: embed is refused with SGLang's reason
    with pytest.raises(BadInput, match="val < 0"):
        render(_spec(tmp_path, ("embed", "layer_out[3]", "layer_out[5]")), "specforge")


def test_speculators_dflash_ids_are_vllm_aux_ids_one_above_zlab(tmp_path):
    assert "i + 1 for i in target_layer_ids" in SPECULATORS["zlab"].needle
    spec = _spec(tmp_path)
    r = render(spec, "speculators")
    zlab = render(spec, "zlab").ids
    assert r.ids == [i + 1 for i in zlab] == [2, 4, 6]  # the converter's i + 1 (converter.py:125)
    assert r.draft_config == {"aux_hidden_state_layer_ids": [2, 4, 6]}
    assert r.launch_flags == ["--target-layer-ids", "2", "4", "6"]
    assert r.dump and r.dump["slots"][-1] == "layer_out[7]"
    # vLLM's own DFlash config names the same points by output-of-layer ids (it adds 1 itself)
    assert render(spec, "vllm").draft_config == {"dflash_config": {"target_layer_ids": zlab}}
    with pytest.raises(BadInput, match="verifier's last state"):
        render(_spec(tmp_path, ("layer_out[1]", "layer_out[3]", "layer_out[7]")), "speculators")


# -- tables, CLI and output schema -----------------------------------------------------------------
def test_trainer_tables_cite_lines_and_the_checker_finds_a_moved_fact(tmp_path):
    for table in TABLES.values():
        for cite in table.values():
            assert cite.line and cite.needle and len(cite.commit) == 40
    cite = ZLAB["offset"]
    (tmp_path / "dflash").mkdir()
    (tmp_path / cite.path).write_text("\n" * (cite.line - 1) + "    offset = 1\n")
    assert check_against_source({"offset": cite}, tmp_path) == []
    (tmp_path / cite.path).write_text("    offset = 1\n")
    assert "found at line 1" in check_against_source({"offset": cite}, tmp_path)[0]


def test_cli_offers_every_render_target_and_the_json_fits_the_schema(tmp_path):
    from surgeon.cli import render as render_command

    choice = next(p for p in render_command.params if p.name == "target")
    assert tuple(choice.type.choices) == RENDER_TARGETS
    for target in ("trtllm", "modelopt-hf", "modelopt-trtllm", "modelopt-vllm"):
        RenderOutput.model_validate(json.loads(cli_run("render", KIMI, "--engine", target, "--json").output))
    for target in ("zlab", "specforge", "speculators"):
        RenderOutput.model_validate(json.loads(cli_run("render", _spec(tmp_path).file, "--engine", target, "--json").output))


@pytest.mark.parametrize("target", ["trtllm", "modelopt-hf", "modelopt-trtllm", "zlab"])
@pytest.mark.parametrize("flag", ["--engine-root", "--model-class"])
def test_table_targets_refuse_engine_flags_they_would_ignore(tmp_path, target, flag):
    """A cited-table target reads no engine: --engine-root / --model-class are refused (one line,
    exit 2), not silently ignored (trtllm and zlab ignored both, modelopt-hf|trtllm --model-class)."""
    spec = _spec(tmp_path) if target == "zlab" else load_spec(KIMI)
    value = str(tmp_path) if flag == "--engine-root" else "SomeOtherForCausalLM"
    err = cli_run("render", spec.file, "--engine", target, flag, value, code=2).stderr
    assert err.count("\n") == 1 and f"{flag} does not apply to {target}" in err
    with pytest.raises(BadInput, match=f"{flag} does not apply to {target}"):
        render(spec, target, **{flag.removeprefix("--").replace("-", "_"): value})
