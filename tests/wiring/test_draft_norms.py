"""EAGLE 3.1 norm flags: check-draft against how each engine reads them, from the real engine
sources (the installed vLLM and SGLang, and fetched releases), and a before/after where a changed
engine file changes the answer."""

import json

import pytest

from surgeon.core.spec import load_spec
from surgeon.engines.facts.draft_norms import read_norms
from surgeon.engines.source.locate import locate_engine
from surgeon.wiring.draft import check_draft
from surgeon.wiring.norms import norm_lines, render_lines
from tests.conftest import installed_engine, norms_spec, release_engine, vllm_models_copy

IDS = {"eagle_aux_hidden_state_layer_ids": [2, 4, 6], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}


def spec(tmp_path, norms=""):
    return load_spec(norms_spec(tmp_path, norms, captures="last: final_norm"))


def draft(tmp_path, **config):
    d = tmp_path / "draft"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], **IDS, **config}))
    return d


def kinds(report):
    return {(f.kind, f.detail.split(":")[0]) for f in report.findings if f.severity == "error"}


def errors(lines):
    return [d for sev, _, d in lines if sev == "error"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_installed_engines_read_norm_before_fc(tmp_path, engine):
    installed_engine(engine)
    s = spec(tmp_path, "norm_before_fc: true")
    r = check_draft(s, draft(tmp_path, norm_before_fc=True), engine)
    assert r.ok, r.findings
    line = next(f.detail for f in r.findings if f.kind == "norm" and f.detail.startswith("norm_before_fc"))
    assert "llama_eagle3.py:" in line and "reads config.norm_before_fc" in line


def test_sglang_never_reads_norm_before_residual(tmp_path):
    installed_engine("sglang")
    s = spec(tmp_path, "norm_before_residual: true")
    r = check_draft(s, draft(tmp_path, norm_before_residual=True), "sglang")
    assert ("norm_ignored", "norm_before_residual") in kinds(r)
    assert "sglang/srt/models/llama_eagle3.py never reads norm_before_residual" in " ".join(f.detail for f in r.findings)
    assert check_draft(s, draft(tmp_path, norm_before_residual=True), "vllm").ok


def test_vllm_deepseek_eagle3_drops_norm_before_fc():
    # vLLM 0.33.0 deepseek_eagle3.py reads fc_norm and norm_output but never norm_before_fc
    loc = locate_engine("vllm", release_engine("vllm", "0.33.0"))
    reading = read_norms(loc, {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "norm_before_fc": True})
    assert reading.model_file == "vllm/model_executor/models/deepseek_eagle3.py"
    assert "norm_before_fc" not in reading.reads and {"fc_norm", "norm_output"} <= set(reading.reads)
    assert reading.effective("norm_before_fc", {"norm_before_fc": True})[0] is False
    llama = read_norms(loc, {"architectures": ["LlamaForCausalLMEagle3"]})
    assert [r.key for r in llama.reads["norm_before_fc"]] == ["eagle_config.norm_before_fc", "config.norm_before_fc"]


def test_speculators_config_without_norm_before_residual_is_inverted_on_vllm(tmp_path):
    # speculators defaults norm_before_residual to False; vLLM's algos.py copies it with default True
    installed_engine("vllm")
    d = draft(tmp_path, speculators_model_type="eagle3", architectures=["Eagle3Speculator"])
    r = check_draft(spec(tmp_path), d, "speculators")
    bad = [f.detail for f in r.findings if f.kind == "norm_mismatch"]
    assert bad and bad[0].startswith("norm_before_residual") and "algos.py:" in bad[0] and "absent so True" in bad[0]
    r = check_draft(spec(tmp_path), draft(tmp_path, speculators_model_type="eagle3", norm_before_residual=False), "vllm")
    assert not any(f.kind.startswith("norm_") and f.severity == "error" for f in r.findings)


def test_vllm_peagle_translation_drops_fc_norm(tmp_path):
    lines = norm_lines(spec(tmp_path, "fc_norm: true"), "vllm",
                       {"speculators_model_type": "peagle", "fc_norm": True, "norm_before_residual": False})
    assert any("does not copy fc_norm" in e for e in errors(lines)), lines


def test_old_releases_ignore_the_flags(tmp_path):
    s = spec(tmp_path, "norm_output: true")
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "norm_output": True}
    assert errors(norm_lines(s, "vllm", cfg, release_engine("vllm", "0.33.0"))) == []
    assert any("never reads norm_output" in e for e in errors(norm_lines(s, "vllm", cfg, release_engine("vllm", "0.11.0"))))
    assert any("never reads norm_output" in e for e in errors(norm_lines(s, "sglang", cfg, release_engine("sglang", "0.5.5"))))


def test_spec_and_config_disagree(tmp_path):
    lines = norm_lines(spec(tmp_path, "fc_norm: true"), "vllm", {"fc_norm": False})
    assert any(k == "norm_config" for _, k, _ in lines)


def test_no_norm_lines_for_a_plain_draft(tmp_path):
    installed_engine("vllm")
    r = check_draft(spec(tmp_path), draft(tmp_path), "vllm")
    assert r.ok and not any(f.kind.startswith("norm") for f in r.findings)


def test_render_lines_say_where_each_flag_is_read(tmp_path):
    s = spec(tmp_path, "norm_before_fc: true, norm_output: true")
    v = render_lines(s, "vllm", release_engine("vllm", "0.33.0"))
    assert len(v) == 2 and all(": used at vllm/model_executor/models/llama_eagle3.py:" in line for line in v)
    assert "llama_eagle3.py:252" in v[1] and ": used at vllm/model_executor/models/llama_eagle3.py:286 (" in v[1]
    old = render_lines(s, "vllm", release_engine("vllm", "0.11.0"))
    assert all("NOT SERVED" in line for line in old)


def test_a_changed_engine_file_changes_the_answer(tmp_path):
    """Before: a copy of vLLM 0.33.0's llama_eagle3.py reads norm_output. After: the same file
    with that read removed (as in releases that dropped it) -> an error naming the file."""
    root, (model,) = vllm_models_copy(tmp_path, "llama_eagle3.py")
    s = spec(tmp_path, "norm_output: true")
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "norm_output": True}
    assert errors(norm_lines(s, "vllm", cfg, root)) == []
    text = model.read_text()
    assert 'getattr(self.config, "norm_output", False)' in text
    model.write_text(text.replace('getattr(self.config, "norm_output", False)', "False"))
    after = errors(norm_lines(s, "vllm", cfg, root))
    assert len(after) == 1 and "llama_eagle3.py never reads norm_output" in after[0]


def test_unparsable_engine_file_is_one_line(tmp_path):
    from surgeon.core.errors import BadInput

    root = tmp_path / "sglang"
    models = root / "srt" / "models"
    models.mkdir(parents=True)
    (models / "llama_eagle3.py").write_text("class X(:\nEntryClass = [LlamaForCausalLMEagle3]\n")
    with pytest.raises(BadInput) as e:
        read_norms(locate_engine("sglang", root), {"architectures": ["LlamaForCausalLMEagle3"]})
    assert "\n" not in str(e.value) and "llama_eagle3.py:1:" in str(e.value)


def test_render_writes_the_flags_and_cites_the_engine(tmp_path):
    from surgeon.wiring.render import render

    installed_engine("vllm")
    installed_engine("sglang")
    s = spec(tmp_path, "norm_before_fc: true")
    r = render(s, "vllm")
    assert r.draft_config["norm_before_fc"] is True
    assert any(n.startswith("vllm: norm flag norm_before_fc = True: used at vllm/model_executor/models/llama_eagle3.py:")
               for n in r.notes)
    assert render(s, "sglang").draft_config["norm_before_fc"] is True


def test_render_refuses_an_engine_that_ignores_a_declared_flag(tmp_path):
    from surgeon.core.errors import BadInput
    from surgeon.wiring.render import render

    installed_engine("sglang")
    with pytest.raises(BadInput) as e:
        render(spec(tmp_path, "norm_before_residual: true"), "sglang")
    assert "\n" not in str(e.value) and "never reads norm_before_residual" in str(e.value)


def test_explain_notes_each_engine(tmp_path):
    from surgeon.wiring.render import explain

    installed_engine("vllm")
    installed_engine("sglang")
    notes = explain(spec(tmp_path, "norm_before_residual: true")).notes
    assert any(n.startswith("vllm: norm flag norm_before_residual = True: used at ") for n in notes)
    assert any(n.startswith("sglang: norm flag norm_before_residual = True: NOT SERVED") for n in notes)


def _weights(d, *names):
    import torch
    from safetensors.torch import save_file

    save_file({n: torch.zeros(4) for n in names}, str(d / "model.safetensors"))


def test_trained_norm_weights_without_the_flag(tmp_path):
    installed_engine("vllm")
    d = draft(tmp_path)
    _weights(d, "fc.weight", "input_norm.weight")
    r = check_draft(spec(tmp_path), d, "vllm")
    bad = [f.detail for f in r.findings if f.kind == "norm_weights" and f.severity == "error"]
    assert bad and bad[0].startswith("model.safetensors:input_norm.weight is a trained norm_before_fc norm")
    d2 = tmp_path / "d2"
    d2.mkdir()
    (d2 / "config.json").write_text((d / "config.json").read_text())
    _weights(d2, "fc.weight", "input_norm.weight")
    assert not any(f.kind == "norm_weights" for f in check_draft(spec(tmp_path, "norm_before_fc: true"), d2, "vllm").findings)


def test_declared_flag_without_its_weights_is_a_warning(tmp_path):
    installed_engine("vllm")
    d = draft(tmp_path, fc_norm=True)
    _weights(d, "fc.weight")
    r = check_draft(spec(tmp_path, "fc_norm: true"), d, "vllm")
    assert [f.severity for f in r.findings if f.kind == "norm_weights"] == ["warning"]
