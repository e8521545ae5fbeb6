"""The audit reads a surgeon dump's slots by their names: a dump that stores the spec's slots in
another order is no finding (it was one: "slots named/ordered ..."), one whose names differ is."""

from __future__ import annotations

import textwrap

import torch

from surgeon.audit.structure import check_structure, read_structure
from surgeon.capture.dumps import write_dump
from surgeon.core.points import FINAL_NORM, layer_out
from surgeon.core.spec import load_spec


def _spec(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text(textwrap.dedent("""\
        spec: 1
        name: tiny
        target: {architecture: LlamaForCausalLM, num_layers: 4, hidden_size: 8}
        captures: {low: 'layer_out[0]', mid: 'layer_out[1]', last: final_norm}
        draft: {kind: eagle3, fc_input: [low, mid], fc_in_features: 16}
        """))
    return load_spec(f)


def _dump(tmp_path, spec, names, tag):
    g = torch.Generator().manual_seed(0)
    points = {"low": layer_out(0), "mid": layer_out(1), "last": FINAL_NORM, "other": layer_out(2)}
    caps = [(n, points[n], torch.randn(5, 8, generator=g)) for n in names]
    return write_dump(tmp_path / f"{tag}.safetensors", caps, input_ids=torch.arange(5), num_layers=4, spec=spec)


def test_a_dump_in_another_order_is_read_by_name(tmp_path):
    spec = _spec(tmp_path)
    assert check_structure(read_structure(_dump(tmp_path, spec, ["last", "low", "mid"], "reordered")), spec) == []
    found = check_structure(read_structure(_dump(tmp_path, spec, ["low", "mid", "other"], "renamed")), spec)
    assert len(found) == 1 and "slots named ['low', 'mid', 'other']" in found[0]


def test_a_specforge_sample_is_labelled_by_specforges_order_not_the_specs_listing(tmp_path):
    """The audit's slots of a SpecForge sample: aux in fc order, then the final norm's hidden_state,
    whatever order the spec lists its captures in (listing final_norm first made every slot wrong)."""
    from surgeon.audit.worker import _declared

    f = tmp_path / "rev.yaml"
    f.write_text(textwrap.dedent("""\
        spec: 1
        name: rev
        target: {architecture: LlamaForCausalLM, num_layers: 4, hidden_size: 8}
        captures: {last: final_norm, mid: 'layer_out[1]', low: 'layer_out[0]'}
        draft: {kind: eagle3, fc_input: [low, mid], fc_in_features: 16}
        """))
    spec = load_spec(f)
    names, points = _declared(spec, "specforge", ["aux_0", "aux_1", "hidden_state"])
    assert names == ["low", "mid", "last"] and points == [layer_out(0), layer_out(1), FINAL_NORM]
    names, points = _declared(spec, "speculators", ["s0", "s1", "s2"])
    assert names == ["low", "mid", "last"]  # a stack: ascending depth
