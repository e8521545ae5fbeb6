"""Exit codes by cause, round two (issue 36, item 6), found by hunting the audit, patch, engine and
draft commands as a careless user would: click's own usage errors are one line (not click's
four-line usage block); a model file that is not UTF-8 is bad input located at its byte (was
"internal error", exit 1), one with a syntax error is one located line (was libcst's five); a
recipes file that is not YAML is located bad input (was yaml's own exception); ``explain`` with a
``--model-class`` the engine does not have is exit 2, as ``render`` (was exit 0, the engine left
out); an audit ``--reference`` of a model of another width than the spec's target is exit 2 before
the audit (was exit 3, every file "unreadable"). Real engine files (a copy of the installed vLLM),
a real tiny HF model (``field_target``), real data files."""

from __future__ import annotations

from pathlib import Path

import pytest

from surgeon.core.errors import BadInput
from tests.cli.test_exit_causes import invoke, one_line

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "specs" / "demo-tiny-llama-eagle3.yaml"
LLAMA = "model_executor/models/llama.py"


# -- click's usage errors: one line, exit 2 ------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["audit", "{file}", "--spec", "{file}"], "is a file"),       # DIR a file
    (["lint", "{dir}"], "is a directory"),                         # a spec that is a folder
    (["explain", "{dir}"], "is a directory"),
    (["apply", "{dir}", "--engine", "vllm"], "is a directory"),
    (["infer-wiring", "{file}"], "is a file"),                     # DRAFT a file
    (["audit"], "Missing argument 'DIR'"),
    (["lint", str(DEMO), "--pp", "0"], "--pp"),
    (["audit", "{dir}", "--jsno"], "Did you mean '--json'"),
    (["frobnicate"], "No such command"),
    (["--bogus"], "No such option"),
])
def test_a_usage_error_is_one_line_and_exit_2(tmp_path, args, needle):
    f = tmp_path / "f.txt"
    f.write_text("x")
    res = invoke(*(a.format(file=f, dir=tmp_path) for a in args))
    one_line(res, needle, "-h` for help")
    assert res.stderr.startswith("surgeon: ") and "Usage:" not in res.output


def test_surgeon_alone_still_shows_its_help():
    res = invoke(code=2)
    assert "Usage: " in res.output and "Commands:" in res.output


# -- a model file surgeon cannot read as Python --------------------------------------------------------------
def _damaged_llama(engine_copy, damage) -> tuple[Path, int]:
    """A copy of the installed vLLM whose llama.py passes through ``damage(text) -> bytes``;
    returns the root and the line of ``class LlamaModel(`` (where each damage is put)."""
    root = engine_copy("vllm")
    path = root / LLAMA
    text = path.read_text(encoding="utf-8")
    line = text[:text.index("class LlamaModel(")].count("\n") + 1
    path.write_bytes(damage(text))
    return root, line


def test_a_model_file_that_is_not_utf8_is_bad_input_located_at_the_byte(engine_copy):
    root, line = _damaged_llama(
        engine_copy, lambda t: t.replace("class LlamaModel(", "class LlamaModel\xff(", 1).encode("latin-1", "replace"))
    before = (root / LLAMA).read_bytes()
    res = invoke("apply", DEMO, "--engine", "vllm", "--engine-root", root)  # was exit 1, "internal error"
    one_line(res, f"{LLAMA}:{line}:{len('class LlamaModel') + 1}:", "not utf-8 text (byte 0xff)")
    assert (root / LLAMA).read_bytes() == before and not (root / ".surgeon").exists()
    invoke("apply", DEMO, "--engine", "vllm", "--engine-root", root, "--dry-run")


def test_a_model_file_with_a_syntax_error_is_one_located_line(engine_copy):
    root, line = _damaged_llama(engine_copy, lambda t: t.replace("class LlamaModel(", "class LlamaModel((", 1).encode())
    res = invoke("apply", DEMO, "--engine", "vllm", "--engine-root", root)  # was libcst's five lines
    one_line(res, f"{LLAMA}:{line}:", "does not parse")


def test_a_recipes_file_that_is_not_yaml_is_located_bad_input(tmp_path, engine_copy):
    from surgeon.patch.apply import plan_patch
    from surgeon.patch.recipes import load_recipes

    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "a.yaml").write_text("name: ok\n")
    (recipes / "b.yaml").write_text("name: x\nfile: [unclosed\n")  # was yaml.YAMLError, not a ValueError
    with pytest.raises(ValueError, match=r"b\.yaml:3:1: not YAML"):
        load_recipes(recipes)
    with pytest.raises(BadInput, match=r"b\.yaml:3:1: not YAML"):
        plan_patch(DEMO, engine="vllm", engine_root=engine_copy("vllm"), recipes_dir=recipes)


# -- explain with a class the engine does not have ----------------------------------------------------------
def test_explain_with_a_model_class_the_engine_lacks_is_bad_input_as_in_render():
    for cmd in ("explain", "render"):
        res = invoke(cmd, DEMO, "--engine", "vllm", "--model-class", "NoSuchForCausalLM")  # explain: was exit 0
        one_line(res, "has no model class 'NoSuchForCausalLM'")
        assert res.stdout == ""
    invoke("explain", DEMO, "--engine", "vllm", "--model-class", "LlamaForCausalLM", code=0)


# -- an audit reference of another model ----------------------------------------------------------------------
@pytest.mark.slow
def test_an_audit_reference_of_another_width_is_bad_input_before_the_audit(tmp_path, field_target):
    from tests.audit.test_hostile_audit import _set

    _, ref_file, _ = field_target  # 8 layers, hidden size 64
    root, spec = _set(tmp_path)  # 8 layers, hidden size 16
    for reference in (f"hf:{ref_file.parent / 'model'}", str(ref_file)):
        res = invoke("audit", root, "--spec", spec, "--reference", reference)  # was exit 3, every file "unreadable"
        one_line(res, "--reference", "hidden size 64", "declares 16")
        assert sorted(p.name for p in root.iterdir()) == [f"hs_{i}.safetensors" for i in range(3)]  # no state file


def test_a_config_whose_weights_lack_layers_is_bad_input_not_a_reference_of_noise(tmp_path, field_target):
    """A config.json without num_hidden_layers loads with transformers' default of 32 layers, all
    but the saved ones initialised at random: reference (and fingerprint after it) exited 0 with a
    reference of noise. Now: exit 2 naming the missing tensors, nothing written."""
    import json
    import shutil

    _, ref_file, _ = field_target
    model = tmp_path / "model"
    shutil.copytree(ref_file.parent / "model", model)
    config = json.loads((model / "config.json").read_text())
    del config["num_hidden_layers"]
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "ref.safetensors"
    res = invoke("reference", model, "--input-ids", "1,2,3", "-o", out)
    one_line(res, "the weights lack", "config and weights disagree")
    assert not out.exists()
