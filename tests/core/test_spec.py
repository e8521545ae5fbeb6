"""Spec v1: the shape is a contract, and every bad input is one located line."""

import json
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from surgeon.core.points import FINAL_NORM, layer_out
from surgeon.core.spec import SpecError, json_schema, load_spec

SPECS = sorted(Path(__file__).resolve().parents[2].joinpath("specs").glob("*.yaml"))

GOOD = textwrap.dedent("""\
    spec: 1
    name: kimi-k2.5-eagle3
    target: {architecture: DeepseekV3ForCausalLM, num_layers: 61, hidden_size: 7168}
    captures:            # ordered: name -> physical point
      low: layer_out[2]
      mid: layer_out[30]
      high: layer_out[58]
      last: final_norm
    draft: {kind: eagle3, fc_input: [low, mid, high], fc_in_features: 21504}
    """)


def load(tmp_path, text):
    f = tmp_path / "s.yaml"
    f.write_text(text)
    return load_spec(f)


def bad(tmp_path, text, line, col, *needles):
    with pytest.raises(SpecError) as e:
        load(tmp_path, text)
    issue = e.value.issues[0]
    rendered = str(issue)
    assert "\n" not in rendered
    assert rendered.startswith(f"{tmp_path / 's.yaml'}:{line}:{col}: "), rendered
    for n in needles:
        assert n in rendered, rendered
    return e.value


def test_the_issue_example_is_the_contract(tmp_path):
    s = load(tmp_path, GOOD)
    assert list(s.captures) == ["low", "mid", "high", "last"]
    assert s.fc_points == [layer_out(2), layer_out(30), layer_out(58)]
    assert s.captures["last"] == FINAL_NORM
    assert len(s.sha256) == 64


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_example_specs_load(path):
    s = load_spec(path)
    assert s.model.draft is not None


def test_layer_in_is_normalised(tmp_path):
    s = load(tmp_path, GOOD.replace("layer_out[2]", "layer_in[3]").replace("mid: layer_out[30]", "mid: layer_in[0]")
             .replace("[low, mid, high]", "[mid, low, high]"))
    assert str(s.captures["low"]) == "layer_out[2]" and str(s.captures["mid"]) == "embed"


# -- every bad-input path, with its location ---------------------------------------------------------
def test_bad_yaml(tmp_path):
    bad(tmp_path, "spec: 1\ncaptures: {low: [\n", 3, 1, "YAML")


def test_tab_indentation(tmp_path):
    bad(tmp_path, "spec: 1\n\tname: x\n", 2, 1, "YAML")


def test_empty_file(tmp_path):
    bad(tmp_path, "# nothing\n", 1, 1, "empty spec")


def test_not_a_mapping(tmp_path):
    bad(tmp_path, "- a\n- b\n", 1, 1, "mapping")


def test_wrong_types(tmp_path):
    bad(tmp_path, GOOD.replace("num_layers: 61", 'num_layers: "61"'), 3, 59, "target.num_layers", "integer")


def test_bool_is_not_an_int(tmp_path):
    bad(tmp_path, GOOD.replace("hidden_size: 7168", "hidden_size: true"), 3, 76, "target.hidden_size")


def test_unknown_key_with_did_you_mean(tmp_path):
    bad(tmp_path, GOOD.replace("draft:", "darft:"), 9, 1, "unknown key 'darft'", "did you mean 'draft'")


def test_unknown_nested_key(tmp_path):
    bad(tmp_path, GOOD.replace("num_layers", "num_layer"), 3, 47, "target.num_layer", "did you mean 'num_layers'")


def test_missing_key(tmp_path):
    bad(tmp_path, GOOD.replace("name: kimi-k2.5-eagle3\n", ""), 1, 1, "missing required key 'name'")


def test_unsupported_version(tmp_path):
    bad(tmp_path, GOOD.replace("spec: 1", "spec: 2"), 1, 7, "unsupported spec version 2")


def test_negative_layer(tmp_path):
    e = bad(tmp_path, GOOD.replace("layer_out[2]", "layer_out[-1]"), 5, 18, "captures.low", "embed", "layer_out[60]")
    assert len(e.issues) == 1


def test_out_of_range_layer(tmp_path):
    bad(tmp_path, GOOD.replace("layer_out[58]", "layer_out[61]"), 7, 19, "captures.high", "layer_out[60]")


def test_quoted_point_column(tmp_path):
    bad(tmp_path, GOOD.replace("low: layer_out[2]", 'low: "layer_out[-2]"'), 5, 19, "negative")


def test_duplicate_capture_names(tmp_path):
    bad(tmp_path, GOOD.replace("  mid: layer_out[30]", "  low: layer_out[30]"), 6, 3, "duplicate key 'low'", "line 5")


def test_duplicate_points(tmp_path):
    bad(tmp_path, GOOD.replace("layer_out[30]", "layer_out[2]"), 6, 8, "captures.mid", "already captured as 'low'")


@pytest.mark.parametrize("name", ["2low", "low-1", "class", "'lo w'"])
def test_non_identifier_names(tmp_path, name):
    text = GOOD.replace("  low: layer_out[2]", f"  {name}: layer_out[2]").replace("[low, mid", "[mid")
    bad(tmp_path, text, 5, 3, "not an identifier")


def test_fc_width(tmp_path):
    bad(tmp_path, GOOD.replace("21504", "14336"), 9, 67, "fc_in_features is 14336", "3 fc inputs x hidden_size 7168 = 21504")


def test_fc_input_unknown_name(tmp_path):
    bad(tmp_path, GOOD.replace("[low, mid, high]", "[low, mdi, high]"), 9, 39, "draft.fc_input[1]", "did you mean 'mid'")


def test_fc_input_listed_twice(tmp_path):
    bad(tmp_path, GOOD.replace("[low, mid, high]", "[low, mid, low]").replace("21504", "21504"), 9, 44, "twice")


def test_fc_input_final_norm(tmp_path):
    bad(tmp_path, GOOD.replace("[low, mid, high]", "[low, mid, last]"), 9, 44, "residual-stream")


def test_anchors_and_aliases_are_refused(tmp_path):
    text = GOOD.replace("low: layer_out[2]", "low: &a layer_out[2]").replace("mid: layer_out[30]", "mid: *a")
    bad(tmp_path, text, 5, 8, "anchors")


def test_speculators_dump_needs_pre_norm_last_slot(tmp_path):
    bad(tmp_path, GOOD + "dumps: {layout: speculators}\n", 10, 17, "dumps.layout", "before the final norm")


def test_bad_pin(tmp_path):
    bad(tmp_path, GOOD + "engines:\n  sglang: {version: 'latest', offset: '+2x'}\n", 11, 21, "engines.sglang.version", "PEP 440")


def test_pin_model_file_must_stay_inside(tmp_path):
    bad(tmp_path, GOOD + "engines:\n  vllm: {model_file: ../../etc/passwd}\n", 11, 22, "stay inside")


def test_bad_spec_name(tmp_path):
    bad(tmp_path, GOOD.replace("name: kimi-k2.5-eagle3", "name: 'kimi k2'"), 2, 7, "spec name")


def test_non_utf8(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_bytes(GOOD.encode() + b"# \xff\xfe\n")
    with pytest.raises(SpecError, match=r"s.yaml:10:1: not UTF-8"):
        load_spec(f)


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "nope.yaml")


def test_python_tags_are_refused(tmp_path):
    bad(tmp_path, "spec: !!python/object/apply:os.system ['true']\n", 1, 7, "YAML")


def test_yaml_1_1_booleans_stay_strings_in_names(tmp_path):
    # 'on'/'no' would be booleans in YAML 1.1; a capture named 'on' must stay 'on'
    s = load(tmp_path, GOOD.replace("low", "on").replace("mid", "no"))
    assert list(s.captures)[:2] == ["on", "no"] and s.fc_names[:2] == ["on", "no"]


def test_billion_laughs_is_refused_early(tmp_path):
    laughs = "a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\n"
    bad(tmp_path, laughs, 1, 4, "anchors")


def test_several_problems_are_all_reported(tmp_path):
    text = GOOD.replace("layer_out[2]", "layer_out[-1]").replace("layer_out[58]", "layer_out[99]")
    with pytest.raises(SpecError) as e:
        load(tmp_path, text)
    assert [i.path for i in e.value.issues] == ["captures.low", "captures.high"]


def test_schema_is_json_and_describes_points():
    schema = json_schema()
    json.dumps(schema)
    assert schema["title"] == "surgeon spec v1"
    assert set(schema["required"]) == {"spec", "name", "target", "captures"}
    assert "propertyNames" in schema["properties"]["captures"]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_any_text_loads_or_is_a_located_spec_error(text):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "fuzz.yaml"
        f.write_text(text, encoding="utf-8", errors="surrogatepass") if "\ud800" not in text else None
        if not f.exists():
            return
        try:
            load_spec(f)
        except SpecError as e:
            assert all(str(i).startswith(str(f)) for i in e.issues)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=12))
def test_any_yaml_document_loads_or_is_a_spec_error(doc):
    import tempfile

    import yaml

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "fuzz.yaml"
        f.write_text(yaml.safe_dump({"spec": 1, "name": "x", "target": doc, "captures": doc}))
        try:
            load_spec(f)
        except SpecError:
            pass


# -- YAML 1.1 integer traps and strictness ------------------------------------------------------------
@pytest.mark.parametrize("value", ["032", "1:01", "0x3d", "6_1", "61.0", "6.1e1"])
def test_only_decimal_integers(tmp_path, value):
    # YAML 1.1 would read 032 as 26 (octal) and 1:01 as 61 (base 60)
    bad(tmp_path, GOOD.replace("num_layers: 61", f"num_layers: {value}"), 3, 59, "target.num_layers", "integer")


@pytest.mark.parametrize("value", ["true", "1.0", "'1'"])
def test_spec_version_must_be_the_integer_1(tmp_path, value):
    bad(tmp_path, GOOD.replace("spec: 1", f"spec: {value}"), 1, 7, "unsupported spec version")


def test_names_cannot_end_in_a_newline(tmp_path):
    bad(tmp_path, GOOD.replace("name: kimi-k2.5-eagle3", 'name: "kimi\\n"'), 2, 7, "spec name")
    text = GOOD.replace("  low: layer_out[2]", '  "low\\n": layer_out[2]').replace("[low, mid", "[mid")
    bad(tmp_path, text, 5, 3, "not an identifier")


def test_unicode_digits_are_not_layer_indices(tmp_path):
    bad(tmp_path, GOOD.replace("layer_out[2]", "layer_out[\uff12]"), 5, 8, "unknown point")


def test_non_string_capture_keys_are_located_at_the_key(tmp_path):
    text = GOOD.replace("  low: layer_out[2]", "  12: layer_out[2]").replace("[low, mid", "[mid")
    bad(tmp_path, text, 5, 3, "key must be a string")


@pytest.mark.parametrize("kind", ["fifo", "dev"])
def test_special_files_are_refused_without_reading(tmp_path, kind):
    import os

    if kind == "fifo":
        f = tmp_path / "spec.yaml"
        os.mkfifo(f)
    else:
        f = Path("/dev/zero")
    with pytest.raises(SpecError, match="not a regular file"):
        load_spec(f)
