"""Spec v1's optional draft.norms (EAGLE 3.1 flags) and draft.mtp_input: old specs load unchanged,
new fields load, and every bad value is one located line."""

import textwrap

import pytest

from surgeon.core.points import FINAL_NORM, layer_out
from surgeon.core.spec import SpecError, json_schema, load_spec

BASE = textwrap.dedent("""\
    spec: 1
    name: t
    target: {architecture: DeepseekV3ForCausalLM, num_layers: 61, hidden_size: 7168}
    captures:
      low: layer_out[2]
      mid: layer_out[30]
      high: layer_out[58]
      last: final_norm
    """)
EAGLE = BASE + "draft: {kind: eagle3, fc_input: [low, mid, high], NORMS}\n"
MTP = BASE + "draft: {kind: mtp, fc_input: [last], MTP}\n"


def load(tmp_path, text):
    f = tmp_path / "s.yaml"
    f.write_text(text)
    return load_spec(f)


def bad(tmp_path, text, at, *needles):
    """The one-line message points at line 9 (the draft), at the column where ``at`` starts."""
    with pytest.raises(SpecError) as e:
        load(tmp_path, text)
    rendered = str(e.value.issues[0])
    col = text.splitlines()[8].index(at) + 1
    assert "\n" not in rendered
    assert rendered.startswith(f"{tmp_path / 's.yaml'}:9:{col}: "), rendered
    for n in needles:
        assert n in rendered, rendered


def test_specs_without_the_fields_load_unchanged(tmp_path):
    spec = load(tmp_path, EAGLE.replace(", NORMS", ""))
    assert spec.model.draft.norms is None and spec.model.draft.mtp_input is None and spec.mtp_input is None


def test_norm_flags_load(tmp_path):
    spec = load(tmp_path, EAGLE.replace("NORMS", "norms: {norm_before_fc: true, norm_output: true}"))
    norms = spec.model.draft.norms
    assert (norms.norm_before_fc, norms.norm_output, norms.fc_norm, norms.norm_before_residual) == (True, True, None, None)


def test_norm_flag_must_be_a_bool(tmp_path):
    bad(tmp_path, EAGLE.replace("NORMS", "norms: {fc_norm: 1}"), "1}", "draft.norms.fc_norm", "boolean")


def test_unknown_norm_flag(tmp_path):
    bad(tmp_path, EAGLE.replace("NORMS", "norms: {fc_nrom: true}"), "fc_nrom", "fc_nrom", "did you mean 'fc_norm'")


def test_norm_before_fc_and_fc_norm_are_exclusive(tmp_path):
    bad(tmp_path, EAGLE.replace("NORMS", "norms: {norm_before_fc: true, fc_norm: true}"), "true}", "exclusive")


def test_norms_only_for_eagle3(tmp_path):
    bad(tmp_path, MTP.replace("MTP", "norms: {fc_norm: true}"), "{fc_norm", "draft.norms", "mtp draft has none")


@pytest.mark.parametrize("text, want", [("final_norm", FINAL_NORM), ("layer_out[60]", layer_out(60))])
def test_mtp_input_loads(tmp_path, text, want):
    assert load(tmp_path, MTP.replace("MTP", f"mtp_input: '{text}'")).mtp_input == want


def test_mtp_input_must_be_the_last_state(tmp_path):
    bad(tmp_path, MTP.replace("MTP", "mtp_input: 'layer_out[30]'"), "'layer_out", "final_norm or layer_out[60]")


def test_mtp_input_bad_point(tmp_path):
    bad(tmp_path, MTP.replace("MTP", "mtp_input: 'layer_out[99]'"), "'layer_out", "draft.mtp_input")


def test_mtp_input_only_for_mtp(tmp_path):
    bad(tmp_path, EAGLE.replace("NORMS", "mtp_input: final_norm"), "final_norm", "for an mtp draft")


def test_schema_documents_the_fields():
    schema = json_schema()
    draft = schema["$defs"]["Draft"]["properties"]
    assert "norms" in draft and "mtp_input" in draft
    assert set(schema["$defs"]["DraftNorms"]["properties"]) == {"norm_before_residual", "norm_before_fc", "fc_norm",
                                                                "norm_output"}
