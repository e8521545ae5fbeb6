"""MTP / NextN: the spec's draft.mtp_input against the state each engine hands its MTP head, read
from the real engine sources, and a before/after where a changed engine file changes the answer."""

import json
import shutil
import textwrap

import pytest

from surgeon.commands.outputs import json_output
from surgeon.commands.spec_commands import LintReport
from surgeon.core.errors import BadInput
from surgeon.core.spec import load_spec
from surgeon.engines.facts.mtp_heads import read_mtp_head
from surgeon.engines.facts.mtp_input import read_mtp_input
from surgeon.engines.source.locate import locate_engine
from surgeon.wiring.draft import check_draft
from surgeon.wiring.lint import lint_spec
from surgeon.wiring.mtp import mtp_lines
from surgeon.wiring.render import explain, render
from tests.conftest import installed_engine, release_engine

SPEC = textwrap.dedent("""\
    spec: 1
    name: kimi-mtp
    target: {architecture: DeepseekV3ForCausalLM, num_layers: 61, hidden_size: 7168}
    captures:
      last: final_norm
      pre: layer_out[60]
    draft: {kind: mtp, fc_input: [last]MTP}
    """)


def spec(tmp_path, mtp_input=None):
    f = tmp_path / "s.yaml"
    f.write_text(SPEC.replace("MTP", f", mtp_input: '{mtp_input}'" if mtp_input else ""))
    return load_spec(f)


@pytest.mark.parametrize("engine, release", [("vllm", None), ("sglang", None), ("vllm", "0.33.0"), ("vllm", "0.11.0"),
                                             ("sglang", "0.5.5")])
def test_engines_hand_the_mtp_head_the_final_norm(engine, release):
    root = release_engine(engine, release) if release else None
    if root is None:
        installed_engine(engine)
    ans = read_mtp_input(locate_engine(engine, root), "DeepseekV3ForCausalLM")
    assert ans.state == "final_norm" and ans.point(61) == "final_norm", ans.reason
    assert any("deepseek_v2.py:" in e and "norm" in e for e in ans.evidence)
    head = "deepseek_mtp.py" if engine == "vllm" else "deepseek_nextn.py"
    assert any(head in e and "hnorm" in e for e in ans.evidence)


def test_installed_vllm_evidence_cites_the_norm_line():
    installed_engine("vllm")
    loc = locate_engine("vllm")
    ans = read_mtp_input(loc, "DeepseekV3ForCausalLM")
    path, line = ans.evidence[0].split(":")[:2]
    assert "self.norm(" in (loc.root.parent / path).read_text().splitlines()[int(line) - 1]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_check_draft_errors_when_trained_before_the_norm(tmp_path, engine):
    installed_engine(engine)
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    bad = check_draft(spec(tmp_path, "layer_out[60]"), d, engine)
    assert not bad.ok and [f.kind for f in bad.findings if f.severity == "error"] == ["mtp_input"]
    assert "hands it final_norm" in bad.findings[0].detail
    good = check_draft(spec(tmp_path, "final_norm"), d, engine)
    assert good.ok and good.findings[0].kind == "mtp_input"
    undeclared = check_draft(spec(tmp_path), d, engine)
    assert undeclared.ok and undeclared.findings[0].kind == "mtp_undeclared"


def test_render_and_explain_say_it(tmp_path):
    installed_engine("vllm")
    installed_engine("sglang")
    with pytest.raises(BadInput) as e:
        render(spec(tmp_path, "layer_out[60]"), "vllm")
    assert "\n" not in str(e.value) and "hands it final_norm" in str(e.value)
    notes = explain(spec(tmp_path, "final_norm")).notes
    assert {n.split(":")[0] for n in notes if "MTP head" in n} == {"sglang", "vllm"}


def test_a_changed_engine_file_changes_the_answer(tmp_path):
    """Before: vLLM 0.33.0's deepseek_v2.py returns the final norm's output. After: the same file
    returning hidden_states + residual -> the pre-norm layer_out[60], and the spec that said
    final_norm is now an error."""
    src = release_engine("vllm", "0.33.0")
    root = tmp_path / "vllm"
    models = root / "model_executor" / "models"
    models.mkdir(parents=True)
    for name in ("registry.py", "deepseek_v2.py", "deepseek_mtp.py"):
        shutil.copy(src / "model_executor/models" / name, models / name)
    s = spec(tmp_path, "final_norm")
    assert [k for sev, k, _ in mtp_lines(s, "vllm", root) if sev == "error"] == []
    model = models / "deepseek_v2.py"
    text = model.read_text()
    old = "hidden_states, _ = self.norm(hidden_states, residual)"
    assert text.count(old) == 1
    model.write_text(text.replace(old, "hidden_states = hidden_states + residual"))
    assert read_mtp_input(locate_engine("vllm", root), "DeepseekV3ForCausalLM").state == "pre_norm"
    after = mtp_lines(s, "vllm", root)
    assert after[0][:2] == ("error", "mtp_input") and "hands it layer_out[60]" in after[0][2]
    linted = lint_spec(s, engines=["vllm"], roots={"vllm": str(root)})
    assert not linted.ok and [i.path for i in linted.issues] == ["draft.mtp_input"]
    assert "hands it layer_out[60]" in linted.issues[0].message and "deepseek_v2.py:" in linted.issues[0].message


def _lint_json_ok(result) -> None:
    json_output("lint", LintReport([result]))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_lint_checks_the_mtp_input_per_engine(tmp_path, engine):
    """lint says for an MTP spec what check-draft says: an error where the engine hands the head
    another state than the spec's draft.mtp_input, a checked line (file:line) where it agrees, a
    warning where the spec does not declare it."""
    installed_engine(engine)
    bad = lint_spec(spec(tmp_path, "layer_out[60]"), engines=[engine])
    _lint_json_ok(bad)
    assert not bad.ok and [(i.severity, i.path) for i in bad.issues] == [("error", "draft.mtp_input")]
    assert bad.issues[0].message.startswith(f"{engine}: ") and "hands it final_norm" in bad.issues[0].message
    assert bad.issues[0].line == 7  # the draft line, where mtp_input is written
    good = lint_spec(spec(tmp_path, "final_norm"), engines=[engine])
    _lint_json_ok(good)
    assert good.ok and good.issues == []
    assert any(c.startswith(f"{engine} ") and "as the spec says" in c and "deepseek_v2.py:" in c for c in good.checked)
    undeclared = lint_spec(spec(tmp_path), engines=[engine])
    assert undeclared.ok and [(i.severity, i.path) for i in undeclared.issues] == [("warning", "draft")]
    assert "does not declare draft.mtp_input" in undeclared.issues[0].message


def test_undecided_engine_is_a_warning_not_a_guess(tmp_path):
    root = tmp_path / "vllm"
    models = root / "model_executor" / "models"
    models.mkdir(parents=True)
    (models / "registry.py").write_text('_M = {"DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM")}\n')
    (models / "deepseek_v2.py").write_text(textwrap.dedent("""\
        class Inner:
            def forward(self, x):
                hidden_states = mystery(x)
                return hidden_states
        class DeepseekV3ForCausalLM:
            def __init__(self):
                self.model = Inner()
        """))
    lines = mtp_lines(spec(tmp_path, "final_norm"), "vllm", root)
    assert lines[0][:2] == ("warning", "mtp_unverified") and "deepseek_v2.py:2" in lines[0][2]
    s = spec(tmp_path, "final_norm")
    linted = lint_spec(s, engines=["vllm"], roots={"vllm": str(root)})
    assert linted.ok and [i.severity for i in linted.issues] == ["warning"] and "not decided" in linted.issues[0].message
    strict = lint_spec(s, engines=["vllm"], roots={"vllm": str(root)}, strict=True)
    assert not strict.ok and [i.severity for i in strict.issues] == ["error"]


RELEASES = [("vllm", None), ("sglang", None), ("vllm", "0.11.0"), ("vllm", "0.33.0"), ("sglang", "0.5.5")]
HEAD_SITE_DEF = {"vllm": "def hf_config_override(", "sglang": "def _config_draft_model("}


def _loc(engine, release):
    return locate_engine(engine, release_engine(engine, release)) if release else installed_engine(engine)


@pytest.mark.parametrize("engine, release", RELEASES)
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_no_mtp_head_for_llama_or_qwen3(tmp_path, engine, release, arch):
    """No release maps a Llama or Qwen3 target to an MTP head: the answer says so (the function
    that maps targets to heads, file:line), not "undecided"; check-draft's lines make it an error."""
    loc = _loc(engine, release)
    head = read_mtp_head(loc, arch)
    assert head.found is False and head.heads == [], head.reason
    path, line = head.evidence[0].split(":")[:2]
    assert HEAD_SITE_DEF[engine] in (loc.root.parent / path).read_text().splitlines()[int(line) - 1]
    ans = read_mtp_input(loc, arch)
    assert ans.no_head and ans.state is None and f"has no MTP head for {arch}" in ans.reason
    s = load_spec(_write(tmp_path, SPEC.replace("DeepseekV3ForCausalLM", arch).replace("MTP", "")))
    lines = mtp_lines(s, engine, loc.root if release else None)
    assert [(sev, k) for sev, k, _ in lines] == [("error", "mtp_no_head")] and f"no MTP head for {arch}" in lines[0][2]


def _write(tmp_path, text):
    f = tmp_path / "t.yaml"
    f.write_text(text)
    return f


@pytest.mark.parametrize("engine, release", RELEASES)
def test_qwen3_next_has_a_head_and_a_decided_state(engine, release):
    """Qwen3-Next has an MTP head in every release; vLLM 0.32/0.33 gather and slice the normed
    state under sequence parallelism, which is still final_norm."""
    loc = _loc(engine, release)
    ans = read_mtp_input(loc, "Qwen3NextForCausalLM")
    assert ans.head is not None and ans.head.found and ans.state == "final_norm", ans.reason
    assert ans.head.heads == (["Qwen3NextMTP"] if engine == "vllm" else ["Qwen3NextForCausalLMMTP"])
    path, line = ans.evidence[0].split(":")[:2]
    assert "norm(" in (loc.root.parent / path).read_text().splitlines()[int(line) - 1]


def test_sglang_qwen3_moe_head_reads_the_base_class_forward():
    """SGLang 0.5.23 maps Qwen3MoeForCausalLM to Qwen3MoeForCausalLMMTP; its Qwen3MoeModel inherits
    forward from qwen2_moe.py's Qwen2MoeModel, read there (0.5.5 has no such head)."""
    loc = installed_engine("sglang")
    ans = read_mtp_input(loc, "Qwen3MoeForCausalLM")
    assert ans.head is not None and ans.head.heads == ["Qwen3MoeForCausalLMMTP"] and ans.state == "final_norm", ans.reason
    path, line = ans.evidence[0].split(":")[:2]
    assert path.endswith("qwen2_moe.py") and "norm(" in (loc.root.parent / path).read_text().splitlines()[int(line) - 1]
    assert read_mtp_head(locate_engine("sglang", release_engine("sglang", "0.5.5")), "Qwen3MoeForCausalLM").found is False


def test_a_changed_mapping_gives_qwen3_a_head(tmp_path):
    """Before: vLLM 0.33.0's hf_config_override maps no qwen3 target. After: the qwen3_next test
    widened to ("qwen3_next", "qwen3") -> a Qwen3 target is renamed qwen3_next_mtp, and the later
    test maps that to Qwen3NextMTP."""
    loc, f = _speculative_copy(tmp_path)
    assert read_mtp_head(loc, "Qwen3ForCausalLM").found is False
    old = 'if hf_config.model_type == "qwen3_next":'
    assert f.read_text().count(old) == 1
    f.write_text(f.read_text().replace(old, 'if hf_config.model_type in ("qwen3_next", "qwen3"):'))
    after = read_mtp_head(loc, "Qwen3ForCausalLM")
    assert after.found is True and after.heads == ["Qwen3NextMTP"], after.reason


def test_an_unread_mapping_test_is_undecided(tmp_path):
    """A test against a name the reader cannot resolve leaves a target it does not name undecided."""
    root = tmp_path / "sglang"
    (root / "srt" / "configs").mkdir(parents=True)
    (root / "srt" / "models").mkdir(parents=True)
    (root / "srt" / "models" / "llama.py").write_text("EntryClass = LlamaForCausalLM\n")
    (root / "srt" / "configs" / "model_config.py").write_text(textwrap.dedent("""\
        from elsewhere import SOME_ARCHS
        class ModelConfig:
            def _config_draft_model(self):
                if self.is_draft_model and self.hf_config.architectures[0] in SOME_ARCHS:
                    self.hf_config.architectures[0] = "SomeMTP"
        """))
    head = read_mtp_head(locate_engine("sglang", root), "LlamaForCausalLM")
    assert head.found is None and "line 4" in head.reason


def test_lint_grades_a_missing_head_by_whether_the_engine_was_asked_for(tmp_path):
    """A Llama MTP spec: vLLM was asked for -> an error; no engine named or pinned -> each engine's
    "no MTP head" is a warning (the spec may be meant for another engine)."""
    installed_engine("vllm")
    installed_engine("sglang")
    s = load_spec(_write(tmp_path, SPEC.replace("DeepseekV3ForCausalLM", "LlamaForCausalLM").replace("MTP", "")))
    asked = lint_spec(s, engines=["vllm"])
    assert not asked.ok and [i.severity for i in asked.issues] == ["error"]
    assert asked.issues[0].message.startswith("vllm ") and "has no MTP head for LlamaForCausalLM" in asked.issues[0].message
    anyone = lint_spec(s)
    assert anyone.ok and sorted(i.message.split()[0] for i in anyone.issues if i.severity == "warning") == ["sglang", "vllm"]
    _lint_json_ok(anyone)


def _speculative_copy(tmp_path):
    """vLLM 0.33.0's config/speculative.py (where it maps a target to its MTP head), copied."""
    src = release_engine("vllm", "0.33.0")
    root = tmp_path / "vllm"
    (root / "config").mkdir(parents=True)
    (root / "model_executor" / "models").mkdir(parents=True)
    shutil.copy(src / "config" / "speculative.py", root / "config" / "speculative.py")
    shutil.copy(src / "model_executor/models/registry.py", root / "model_executor/models/registry.py")
    return locate_engine("vllm", root), root / "config" / "speculative.py"


GLM_TEST = 'if hf_config.architectures[0] == "Glm4MoeForCausalLM":'


@pytest.mark.parametrize("negated", ['if hf_config.architectures[0] != "Glm4MoeForCausalLM":',
                                     'if not hf_config.architectures[0] == "Glm4MoeForCausalLM":',
                                     'if hf_config.architectures[0] not in ("Glm4MoeForCausalLM",):'])
def test_a_negated_test_does_not_name_its_target(tmp_path, negated):
    """Before: vLLM 0.33.0 maps Glm4MoeForCausalLM to Glm4MoeMTPModel, and no Llama. After the Glm4Moe test
    is negated (!=, not ==, not in), Glm4Moe takes no branch that builds a head (found False, not
    "has a head"), and a Llama target, which now takes that branch without being named, is
    undecided (not "no head", not "has a head")."""
    loc, f = _speculative_copy(tmp_path)
    before = read_mtp_head(loc, "Glm4MoeForCausalLM")
    assert before.found is True and before.heads == ["Glm4MoeMTPModel"], before.reason
    assert read_mtp_head(loc, "LlamaForCausalLM").found is False
    assert f.read_text().count(GLM_TEST) == 1
    f.write_text(f.read_text().replace(GLM_TEST, negated))
    after = read_mtp_head(loc, "Glm4MoeForCausalLM")
    assert after.found is False and after.heads == [], after.evidence
    llama = read_mtp_head(loc, "LlamaForCausalLM")
    line = f.read_text().splitlines().index("        " + negated) + 1
    assert llama.found is None and f"line {line}" in (llama.reason or ""), llama


def test_the_else_of_a_negated_test_names_its_target(tmp_path):
    """After: ``if arch != "Glm4MoeForCausalLM": pass / else: <the Glm4Moe rewrite>`` -> Glm4Moe's head is
    read from the else branch; a Llama target takes the empty body: no head."""
    loc, f = _speculative_copy(tmp_path)
    f.write_text(f.read_text().replace(GLM_TEST, GLM_TEST.replace("==", "!=") + "\n            pass\n        else:"))
    after = read_mtp_head(loc, "Glm4MoeForCausalLM")
    assert after.found is True and after.heads == ["Glm4MoeMTPModel"], after.reason
    assert read_mtp_head(loc, "LlamaForCausalLM").found is False


@pytest.mark.parametrize("guard", ['if "llama" not in hf_config.model_type:', 'if hf_config.model_type != "llama":'])
def test_a_guard_that_excludes_llama_is_not_a_llama_head(tmp_path, guard):
    """After: a guard that sends every target but Llama to a return, inserted before the rewrites
    -> Llama still has no MTP head (before this fix it counted as naming Llama: "has a head")."""
    loc, f = _speculative_copy(tmp_path)
    old = "        initial_architecture = hf_config.architectures[0]\n"
    assert f.read_text().count(old) == 1
    f.write_text(f.read_text().replace(old, f"        {guard}\n            return hf_config\n{old}"))
    head = read_mtp_head(loc, "LlamaForCausalLM")
    assert head.found is False and head.heads == [], head
    assert read_mtp_head(loc, "Glm4MoeForCausalLM").heads == ["Glm4MoeMTPModel"]


def test_a_string_compared_with_something_else_than_the_target_is_free(tmp_path):
    """Before/after on vLLM 0.33.0: the DeepSeek-V3 rename gains an unrelated string test
    (an environment switch). It says nothing about the target, so it is free: DeepSeek-V3 still has
    its head (not "no head" because "on" is not its name), and Llama still has none."""
    loc, f = _speculative_copy(tmp_path)
    old = "        if hf_config.model_type in (\n            \"deepseek_v3\","
    assert f.read_text().count(old) == 1
    before = read_mtp_head(loc, "DeepseekV3ForCausalLM")
    assert before.found is True and "DeepSeekMTPModel" in before.heads, before
    f.write_text(f.read_text().replace(old, "        if os.environ.get(\"MTP\", \"on\") == \"on\" and hf_config.model_type in (\n"
                                            "            \"deepseek_v3\","))
    after = read_mtp_head(loc, "DeepseekV3ForCausalLM")
    assert after.found is True and after.heads == before.heads, after
    assert read_mtp_head(loc, "LlamaForCausalLM").found is False
