"""Points: the spec's vocabulary. Property tests for the parser and its refusals."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from surgeon.core.points import EMBED, FINAL_NORM, Point, PointError, all_points, layer_out, parse_point


@st.composite
def model_and_point(draw, with_deltas=False):
    L = draw(st.integers(1, 200))
    return L, draw(st.sampled_from(all_points(L, with_deltas=with_deltas)))


@given(model_and_point(with_deltas=True))
def test_str_parse_round_trip(lp):
    L, point = lp
    assert parse_point(str(point), L, allow_delta=True) == point


@given(st.integers(1, 200), st.data())
def test_layer_in_is_an_alias_of_the_previous_layer_out(L, data):
    k = data.draw(st.integers(0, L - 1))
    expected = EMBED if k == 0 else layer_out(k - 1)
    assert parse_point(f"layer_in[{k}]", L) == expected


@given(st.integers(1, 200))
def test_positions_round_trip(L):
    for p in all_points(L):
        if p.position is not None:
            assert Point.at_position(p.position) == p
    assert [p.position for p in all_points(L)][:-1] == list(range(L + 1))


@given(st.integers(1, 200), st.integers(-500, -1), st.sampled_from(["layer_out", "layer_in"]))
def test_negative_indices_are_refused_naming_embed_and_the_last_layer(L, k, kind):
    with pytest.raises(PointError) as e:
        parse_point(f"{kind}[{k}]", L)
    assert "embed" in e.value.message and f"layer_out[{L - 1}]" in e.value.message


@given(st.integers(1, 100), st.integers(0, 100))
def test_out_of_range_is_refused_with_the_valid_range(L, extra):
    with pytest.raises(PointError, match=rf"0\]..layer_out\[{L - 1}\]"):
        parse_point(f"layer_out[{L + extra}]", L)


@pytest.mark.parametrize(
    "text, hint",
    [("layer_output[3]", "layer_out"), ("final", "final_norm"), ("embedding", "embed"), ("lm_head", None), ("", None)],
)
def test_unknown_points_suggest_a_spelling(text, hint):
    with pytest.raises(PointError) as e:
        parse_point(text, 8)
    assert ("did you mean" in e.value.message) == (hint is not None)
    if hint:
        assert hint in e.value.message


@pytest.mark.parametrize("text", ["embed[0]", "final_norm[3]", "layer_out", "layer_out[]", "layer_out[1.5]", "layer_out[0x2]"])
def test_malformed_indices(text):
    with pytest.raises(PointError):
        parse_point(text, 8)


def test_layer_delta_is_diagnosis_only():
    with pytest.raises(PointError, match="diagnosis"):
        parse_point("layer_delta[2]", 8)
    assert parse_point("layer_delta[2]", 8, allow_delta=True) == Point("layer_delta", 2)


@pytest.mark.parametrize("value", [3, None, ["layer_out[1]"], 2.5])
def test_non_strings_are_refused(value):
    with pytest.raises(PointError, match="is a string"):
        parse_point(value, 8)


def test_whitespace_is_tolerated():
    assert parse_point("  layer_out[ 3 ] ", 8) == layer_out(3)
    assert parse_point("final_norm", 8) == FINAL_NORM
