"""Conventions, table-driven against ../shared/REFERENCE.md, and hypothesis round trips
point -> ids -> point for every convention and every L.

The engine conventions here are the built-in tables (what REFERENCE.md read in the named
versions); tests/test_probes.py and tests/test_engine_render.py check the same behaviour on the
probes of the real installed sources.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from surgeon.core.conventions import (
    BUILTIN,
    DUMP_LAYOUTS,
    EAGLE,
    HF,
    EngineConvention,
    InvalidId,
    NotExpressible,
    builtin_convention,
)
from surgeon.core.points import EMBED, FINAL_NORM, Point, layer_out

SGLANG = EngineConvention(builtin_convention("sglang", "LlamaForCausalLM"), "built-in")
DEEPSEEK = EngineConvention(builtin_convention("sglang", "DeepseekV3ForCausalLM"), "built-in")
VLLM = EngineConvention(builtin_convention("vllm", None), "built-in")


# -- REFERENCE.md, row by row --------------------------------------------------------------------
@pytest.mark.parametrize("L", [4, 6, 32, 61])
def test_hf_table(L):
    assert HF.to_point(0, L) == EMBED
    for i in range(1, L):
        assert HF.to_point(i, L) == layer_out(i - 1)
    assert HF.to_point(L, L) == FINAL_NORM  # hs[L] is post-norm
    assert HF.to_point(-1, L) == FINAL_NORM  # hs[-1], as people write it
    with pytest.raises(NotExpressible, match="not in the output_hidden_states tuple"):
        HF.to_id(layer_out(L - 1), L)
    with pytest.raises(InvalidId):
        HF.to_point(L + 1, L)


@pytest.mark.parametrize("L", [4, 6, 32, 61])
def test_vllm_table(L):
    # id j: 0 = embed, 1..L = layer_out[j-1]; sorted and de-duplicated
    assert VLLM.decode([0], L) == [EMBED]
    assert VLLM.decode(list(range(1, L + 1)), L) == [layer_out(k) for k in range(L)]
    assert VLLM.decode([3, 1, 3], L) == [layer_out(0), layer_out(2)]
    assert VLLM.decode(None, L) == [Point.at_position(x) for x in sorted({2, L // 2, L - 3})]
    with pytest.raises(NotExpressible, match="not an aux capture"):
        VLLM.encode([FINAL_NORM], L)


@pytest.mark.parametrize("L", [4, 6, 32, 61])
def test_sglang_llama_table(L):
    # explicit id k -> capture index k + 1 -> layer_out[k]; -1 -> embed
    assert SGLANG.decode([-1], L) == [EMBED]
    assert SGLANG.decode(list(range(L - 1)), L) == [layer_out(k) for k in range(L - 1)]
    # the default is capture indices with no +1: layer_out[1], layer_out[L//2-1], layer_out[L-4]
    assert SGLANG.decode(None, L) == [layer_out(x - 1) for x in sorted({2, L // 2, L - 3})]
    # entry capture: the last layer's output is the entry of a layer that does not exist
    with pytest.raises(NotExpressible, match="entry of a layer"):
        SGLANG.encode([layer_out(L - 1)], L)
    assert SGLANG.decode([L - 1], L) == [None]


def test_deepseek_v2_first_id_rule():
    L = 61
    # +1 only when the first id is 1
    assert DEEPSEEK.decode([1, 30, 58], L) == [layer_out(1), layer_out(30), layer_out(58)]
    assert DEEPSEEK.decode([2, 30, 58], L) == [layer_out(1), layer_out(29), layer_out(57)]
    # the case that started the project: the draft wants layer_out[2], [30], [58]
    assert DEEPSEEK.encode([layer_out(2), layer_out(30), layer_out(58)], L) == [3, 31, 59]
    # the "fix" [-1, 2, 30] captures neither embed (raw -1 is never reached) nor layer 2
    assert DEEPSEEK.decode([-1, 2, 30], L) == [None, layer_out(1), layer_out(29)]
    # on llama.py the same ids mean something else again
    assert SGLANG.decode([-1, 2, 30], L) == [EMBED, layer_out(2), layer_out(30)]


def test_deepseek_v2_layer_out_0_needs_a_list_context():
    L = 61
    # capture index 1 alone: raw [1] trips the +1 rule, and the +1 branch needs first id 1 -> 2
    with pytest.raises(NotExpressible, match="no id list"):
        DEEPSEEK.encode([layer_out(0)], L)
    # with another capture, putting that one first keeps the raw branch
    ids = DEEPSEEK.encode([layer_out(0), layer_out(5)], L)
    assert ids[0] != 1 and DEEPSEEK.decode(ids, L) == [layer_out(0), layer_out(5)]
    # and with layer_out[1] present the +1 branch works
    ids = DEEPSEEK.encode([layer_out(0), layer_out(1)], L)
    assert ids[0] == 1 and DEEPSEEK.decode(ids, L) == [layer_out(0), layer_out(1)]


@pytest.mark.parametrize("L", [4, 6, 32, 61])
def test_eagle_table(L):
    assert EAGLE.to_point(0, L) == layer_out(0)
    assert EAGLE.to_id(layer_out(L - 2), L) == L - 2
    with pytest.raises(NotExpressible, match="refuses -1"):
        EAGLE.to_id(EMBED, L)
    with pytest.raises(InvalidId, match="refused by SpecForge"):
        EAGLE.to_point(-1, L)
    with pytest.raises(NotExpressible):
        EAGLE.to_id(FINAL_NORM, L)
    with pytest.raises(NotExpressible, match="does not exist"):
        EAGLE.to_id(layer_out(L - 1), L)


@given(st.integers(8, 256))  # below 8 layers the three defaults collide
def test_every_tools_default_is_the_same_three_points(L):
    eagle = EAGLE.decode(None, L)
    assert eagle == SGLANG.decode(None, L) == VLLM.decode(None, L) == DEEPSEEK.decode(None, L)
    assert eagle == [layer_out(1), layer_out(L // 2 - 1), layer_out(L - 4)]


def test_the_same_draft_config_means_different_layers_per_engine():
    # vllm-project/vllm#43671: one config.json, two engines
    L, ids = 32, [2, 15, 28]
    assert SGLANG.decode(ids, L) == [layer_out(2), layer_out(15), layer_out(28)]
    assert VLLM.decode(ids, L) == [layer_out(1), layer_out(14), layer_out(27)]


@pytest.mark.parametrize("conv", [VLLM, SGLANG, DEEPSEEK], ids=lambda c: c.name)
def test_engines_refuse_an_fc_order_they_would_reorder(conv):
    with pytest.raises(NotExpressible, match="ascending layer order"):
        conv.encode([layer_out(30), layer_out(2)], 61)
    with pytest.raises(NotExpressible, match="twice"):
        conv.encode([layer_out(2), layer_out(2)], 61)


# -- round trips -----------------------------------------------------------------------------------
@st.composite
def positions(draw, max_pos_offset):
    L = draw(st.integers(3, 160))
    hi = L - 1 + max_pos_offset  # entry capture: 0..L-1; exit: 0..L
    pos = draw(st.lists(st.integers(0, hi), min_size=1, max_size=6, unique=True))
    return L, sorted(pos)


@given(positions(0))
def test_sglang_round_trip(lp):
    L, pos = lp
    points = [Point.at_position(p) for p in pos]
    assert SGLANG.decode(SGLANG.encode(points, L), L) == points


@given(positions(0))
def test_deepseek_round_trip_or_honest_refusal(lp):
    L, pos = lp
    points = [Point.at_position(p) for p in pos]
    try:
        ids = DEEPSEEK.encode(points, L)
    except NotExpressible:
        # only the first-id rule can make a list inexpressible: capture index 1 without index 2
        assert pos == [1]
        return
    assert DEEPSEEK.decode(ids, L) == points


@given(positions(1))
def test_vllm_round_trip(lp):
    L, pos = lp
    points = [Point.at_position(p) for p in pos]
    ids = VLLM.encode(points, L)
    assert ids == pos and VLLM.decode(ids, L) == points


@given(st.integers(2, 160), st.data())
def test_hf_round_trip(L, data):
    point = data.draw(st.sampled_from([EMBED, FINAL_NORM] + [layer_out(k) for k in range(L - 1)]))
    assert HF.to_point(HF.to_id(point, L), L) == point


@given(st.integers(2, 160), st.data())
def test_eagle_round_trip(L, data):
    k = data.draw(st.integers(0, L - 2))
    assert EAGLE.to_point(EAGLE.to_id(layer_out(k), L), L) == layer_out(k)


@given(st.integers(3, 160), st.data())
def test_ids_to_points_to_ids(L, data):
    ids = sorted(data.draw(st.lists(st.integers(0, L), min_size=1, max_size=5, unique=True)))
    assert VLLM.encode(VLLM.decode(ids, L), L) == ids
    sg = sorted(data.draw(st.lists(st.integers(-1, L - 2), min_size=1, max_size=5, unique=True)))
    assert SGLANG.encode(SGLANG.decode(sg, L), L) == sg


# -- dump layouts ----------------------------------------------------------------------------------
def test_speculators_last_slot_is_pre_norm():
    L, sp = 32, DUMP_LAYOUTS["speculators"]
    names = ["a", "b", "c", "last"]
    assert sp.slots(names, [layer_out(1), layer_out(15), layer_out(28), layer_out(31)], L)[-1] == "hidden_states[:, 3]"
    with pytest.raises(NotExpressible, match="before the final norm"):
        sp.slots(names, [layer_out(1), layer_out(15), layer_out(28), FINAL_NORM], L)


def test_specforge_hidden_state_is_post_norm():
    L, sf = 61, DUMP_LAYOUTS["specforge"]
    got = sf.slots(["a", "b", "c", "d"], [layer_out(2), layer_out(30), layer_out(58), FINAL_NORM], L)
    assert got == ["aux_hidden_state[..., 0]", "aux_hidden_state[..., 1]", "aux_hidden_state[..., 2]", "hidden_state"]
    with pytest.raises(NotExpressible):
        sf.slots(["a", "b"], [EMBED, FINAL_NORM], L)


def test_builtin_table_names_its_source():
    for cc in BUILTIN.values():
        assert "built-in table read from" in cc.reason


def test_a_class_that_drops_the_residual_names_layer_deltas():
    # sgl-project/sglang#39286 (Gemma3): captures hidden_states without the residual added
    from dataclasses import replace

    conv = EngineConvention(replace(builtin_convention("sglang", None), captured_value="layer_output_without_residual"), "t")
    with pytest.raises(NotExpressible, match="without the residual"):
        conv.encode([layer_out(3)], 8)
    assert conv.decode([-1, 3], 8) == [EMBED, Point("layer_delta", 3)]


def test_offset_terms():
    from surgeon.core.conventions import OffsetError, parse_offset, parse_term

    assert str(parse_term("L//2-1")) == "L//2-1"
    with pytest.raises(OffsetError, match="divides by zero"):
        parse_offset("+1 if max(ids) == L//0 else +0")
    with pytest.raises(OffsetError):
        parse_offset("+1 if ids[0] == \uff11 else +0")
