"""`render` and `lint` of a DFlash draft for SGLang: ids from the installed source, the same
layer-output ids vLLM's dflash_config reads, and refusals with the reason where not proven."""

from __future__ import annotations

import textwrap

import pytest

from surgeon.core.errors import BadInput, Unverified
from surgeon.core.spec import load_spec
from surgeon.wiring.lint import lint_spec
from surgeon.wiring.render import explain, render
from tests.conftest import cli_run, release_engine


def _spec(tmp_path, points=("layer_out[1]", "layer_out[3]", "layer_out[5]"), arch="LlamaForCausalLM", extra="",
          tail=""):
    """A tiny DFlash spec; ``extra`` goes inside ``target``, ``tail`` after the spec (e.g. pins)."""
    f = tmp_path / "s.yaml"
    f.write_text(textwrap.dedent(f"""\
        spec: 1
        name: tiny
        target: {{architecture: {arch}, num_layers: 8, hidden_size: 64{extra}}}
        captures:
          low: {points[0]}
          mid: {points[1]}
          high: {points[2]}
          last: final_norm
        draft: {{kind: dflash, fc_input: [low, mid, high], fc_in_features: 192}}
        """) + tail)
    return load_spec(f)


def test_sglang_dflash_ids_are_layer_outputs_like_vllm(tmp_path):
    spec = _spec(tmp_path)
    r = render(spec, "sglang")
    assert r.ids == [1, 3, 5] and r.verified
    assert r.draft_config == {"dflash_config": {"target_layer_ids": [1, 3, 5]}}
    assert [c.captured for c in r.captures] == ["layer_out[1]", "layer_out[3]", "layer_out[5]"]
    assert r.launch_flags[:2] == ["--speculative-algorithm", "DFLASH"]
    assert any(e.startswith("setter: srt/models/llama.py:") for e in r.evidence)
    assert any("set_dflash_layers_to_capture(dflash_target_layer_ids)" in e for e in r.evidence)
    # both engines read the same dflash_config.target_layer_ids for the same points
    assert render(spec, "vllm").draft_config == r.draft_config


def test_sglang_dflash_refuses_what_the_runner_range_check_refuses(tmp_path):
    with pytest.raises(BadInput, match=r"dflash_utils\.py:\d+: raises when val < 0"):
        render(_spec(tmp_path, points=("embed", "layer_out[3]", "layer_out[5]")), "sglang")


def test_sglang_dflash_refuses_an_unclassified_setter_with_its_reason(tmp_path):
    with pytest.raises(BadInput, match=r"BeamForCausalLM \(srt/models/beam\.py:\d+\).*raises"):
        render(_spec(tmp_path), "sglang", model_class="BeamForCausalLM")


def test_sglang_dflash_refuses_a_release_without_the_setter(tmp_path):
    with pytest.raises(BadInput, match="has no class 'LlamaForCausalLM' with set_dflash_layers_to_capture"):
        render(_spec(tmp_path), "sglang", engine_root=str(release_engine("sglang", "0.5.5")))


def test_sglang_dflash_refuses_a_target_the_runner_rewrites(tmp_path):
    with pytest.raises(BadInput, match=r"muse_glimmer.*spec_aux_hidden_state\.py:\d+"):
        render(_spec(tmp_path, extra=", model_type: muse_glimmer"), "sglang")


def test_lint_checks_sglang_dflash_ids(tmp_path):
    res = lint_spec(_spec(tmp_path), engines=["sglang"])
    assert res.ok
    assert any("dflash_config.target_layer_ids [1, 3, 5]" in c for c in res.checked)
    assert not any("not modelled" in c for c in res.checked)
    bad = lint_spec(_spec(tmp_path, points=("embed", "layer_out[3]", "layer_out[5]")), engines=["sglang"])
    assert not bad.ok and any("sglang: DFlash" in i.message and "val < 0" in i.message for i in bad.issues)


@pytest.mark.parametrize("engines", [[], ["sglang"]])
def test_lint_errs_on_a_dflash_wiring_sglang_cannot_serve_whatever_was_asked(tmp_path, engines):
    # layer_out[7] at L=8: the capture at the entry of layer 8 never happens
    res = lint_spec(_spec(tmp_path, points=("layer_out[1]", "layer_out[3]", "layer_out[7]")), engines=engines)
    errors = [i for i in res.issues if i.severity == "error" and i.message.startswith("sglang: DFlash")]
    assert not res.ok and errors and "has no id for layer_out[7]" in errors[0].message
    muse = lint_spec(_spec(tmp_path, extra=", model_type: muse_glimmer"), engines=engines)
    assert any(i.severity == "error" and "muse_glimmer" in i.message for i in muse.issues)


def test_lint_errs_on_an_unverified_dflash_runner_as_render_refuses_it(engine_copy, tmp_path):
    root = engine_copy("sglang", tmp_path / "site")  # model files only: the runner is not read
    spec = _spec(tmp_path)
    with pytest.raises(Unverified, match="runner unverified for DFlash"):
        render(spec, "sglang", engine_root=str(root))
    for strict in (False, True):  # render refuses it, so lint errs with or without --strict
        res = lint_spec(spec, engines=["sglang"], roots={"sglang": str(root)}, strict=strict)
        runner = [i for i in res.issues if "runner unverified for DFlash" in i.message]
        assert not res.ok and runner and runner[0].severity == "error"


def test_lint_checks_sglang_pins_and_says_pp_is_not_checked_for_dflash(tmp_path):
    spec = _spec(tmp_path, tail='engines: {sglang: {version: "<0.0.1"}}\n')
    res = lint_spec(spec, engines=["sglang"], pp=2)
    assert not res.ok and any("outside the pinned range" in i.message for i in res.issues)
    assert "sglang: pp 2: not checked for a dflash draft (only eagle3 captures are read)" in res.checked


def test_explain_gives_the_sglang_dflash_answer_render_gives(tmp_path):
    spec = _spec(tmp_path, points=("layer_out[0]", "layer_out[2]", "layer_out[6]"))
    r = render(spec, "sglang")
    e = explain(spec)
    assert e.fc_lists["sglang"].ids == r.ids == [0, 2, 6]
    assert e.fc_lists["sglang"].captures == [c.captured for c in r.captures]
    assert [row.ids["sglang"] for row in e.rows if row.fc_slot is not None] == r.ids
    sglang = [n for n in e.notes if n.startswith("sglang:")]
    setters = {n.split("setter: ", 1)[1] for n in sglang if "evidence: setter:" in n}
    assert setters == {ev.removeprefix("setter: ") for ev in r.evidence if ev.startswith("setter: ")}
    assert any("set_dflash_layers_to_capture" in n for n in setters)
    assert not any("set_eagle3_layers_to_capture" in n or "unverified" in n for n in sglang)
    assert "set_dflash_layers_to_capture" in e.conventions["sglang"] and "unverified" not in e.conventions["sglang"]
    # a wiring render refuses, explain reports with the same reason instead of EAGLE-3's ids
    bad = _spec(tmp_path, extra=", model_type: muse_glimmer")
    with pytest.raises(BadInput, match="muse_glimmer") as refused:
        render(bad, "sglang")
    eb = explain(bad)
    assert "sglang" not in eb.fc_lists
    assert f"sglang: DFlash: {str(refused.value).removeprefix(bad.file + ': ')}" in eb.notes


def test_sglang_dflash_pins_are_checked_against_the_dflash_setter(engine_copy, tmp_path):
    """Before: a copy of SGLang whose llama.py DFlash and EAGLE-3 setters both add 1; the pin
    (ids [1, 3, 5], offset '+1') holds. After: only set_dflash_layers_to_capture edited to keep the
    ids as they are; the EAGLE-3 setter still says '+1' (a check against it would pass), but the
    pin is now wrong for DFlash, and the check says so from the DFlash setter."""
    from surgeon.engines.view import open_engine
    from surgeon.wiring.pins import check_pins

    root = engine_copy("sglang", tmp_path / "site")
    spec = _spec(tmp_path, tail="engines: {sglang: {ids: [1, 3, 5], offset: '+1'}}\n")
    issues, checked = check_pins(spec, "sglang", open_engine("sglang", str(root)))
    assert issues == [] and any("its DFlash setter" in c and "offset '+1'" in c for c in checked)
    llama = root / "srt" / "models" / "llama.py"
    text = llama.read_text()
    dflash = text.index("def set_dflash_layers_to_capture")
    old = "self.model.layers_to_capture = [val + 1 for val in layer_ids]"
    assert text.count(old) == 2 and text.index(old, dflash) > dflash
    at = text.index(old, dflash)
    llama.write_text(text[:at] + "self.model.layers_to_capture = [val for val in layer_ids]" + text[at + len(old):])
    view = open_engine("sglang", str(root))
    assert view.class_convention("LlamaForCausalLM").id_rule.name == "+1"  # the EAGLE-3 setter is unchanged
    issues, _ = check_pins(spec, "sglang", view)
    assert {i.path for i in issues} == {"engines.sglang.offset", "engines.sglang.ids"}
    offset = next(i for i in issues if i.path == "engines.sglang.offset")
    assert "its DFlash setter" in offset.message and "'+0'" in offset.message


def test_sglang_dflash_pin_values_come_from_the_dflash_answer(tmp_path):
    """`render --pin` for an SGLang DFlash draft writes the DFlash setter's rule and the ids render
    gives for dflash_config.target_layer_ids; its own pins then check clean."""
    from surgeon.wiring.pins import check_pins, pin_values

    spec = _spec(tmp_path)
    values = pin_values(spec, "sglang")
    assert values["ids"] == render(spec, "sglang").ids and values["offset"] == "+1"
    pinned = _spec(tmp_path, tail=f"engines: {{sglang: {{ids: {values['ids']}, offset: '{values['offset']}'}}}}\n")
    assert check_pins(pinned, "sglang")[0] == []


def test_a_specforge_dflash_refusal_names_specforge(tmp_path):
    """`render --engine specforge` of a DFlash spec whose ids SGLang's runner refuses (embed -> -1):
    the one-line message names specforge, and that its ids go through SGLang's convention (it was
    "cannot render for sglang", a target the user did not ask for); `--engine sglang` still says sglang."""
    spec = _spec(tmp_path, points=("embed", "layer_out[3]", "layer_out[5]"))
    with pytest.raises(BadInput) as e:
        render(spec, "specforge")
    msg = str(e.value)
    assert "cannot render for specforge: its DFlash ids go through SGLang's convention" in msg
    assert "cannot render for sglang" not in msg and "val < 0" in msg and "\n" not in msg
    res = cli_run("render", spec.file, "--engine", "specforge", code=2)
    assert "cannot render for specforge" in res.output and "SGLang's convention" in res.output
    assert len(res.output.strip().splitlines()) == 1
    with pytest.raises(BadInput, match="cannot render for sglang: DFlash ids"):
        render(spec, "sglang")
