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
