"""Names over positions: a file whose tensors carry names is read by those names, in whatever order
it stores them (safetensors sorts its keys; a dict keeps the order it was built in); order is used
only where the layout defines one (a stack, a list, SpecForge's aux columns). Every relabelling is
named as what it is, and a slot the reference cannot tell apart is undecided, never ok or wrong.

The target is the suite's tiny 8-layer llama (``field_target``: spec captures low = layer_out[1],
mid = layer_out[3], high = layer_out[5], last = final_norm), its reference made by transformers."""

from __future__ import annotations

import json
import textwrap
from itertools import permutations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from surgeon.core.errors import UNDECIDED, BadInput
from surgeon.core.points import layer_out
from surgeon.core.spec import load_spec
from surgeon.verify.harness import match
from tests.conftest import cli_run as run

NAMES = ("low", "mid", "high", "last")  # sorted by safetensors: high, last, low, mid
PERMS = list(permutations(range(4)))
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _points(spec):
    return [spec.captures[n] for n in NAMES]


def _write(tmp_path, fmt: str, tensors: dict[str, torch.Tensor], ids: torch.Tensor, tag: str):
    """``tensors`` stored under their names, in the dict's order, as ``fmt`` stores them."""
    if fmt == "safetensors":
        f = tmp_path / f"{tag}.safetensors"
        save_file({**{k: v.contiguous() for k, v in tensors.items()}, "input_ids": ids}, str(f))
    else:
        f = tmp_path / f"{tag}.pt"
        torch.save({**tensors, "input_ids": ids}, f)
    return f


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@SETTINGS
@given(order=st.sampled_from(PERMS))
def test_a_correctly_named_file_verifies_ok_whatever_its_stored_order(tmp_path, field_target, fmt, order):
    ref, ref_file, spec_file = field_target
    spec = load_spec(spec_file)
    stored = {NAMES[i]: ref.states[spec.captures[NAMES[i]]] for i in order}
    f = _write(tmp_path, fmt, stored, ref.input_ids, "".join(map(str, order)))
    r = match(f, str(ref_file), spec=spec)
    assert [(s.name, s.verdict) for s in r.report.slots] == [(n, "ok") for n in NAMES], r.headline
    assert r.verdict == "ok" and r.report.diagnosis == []


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@SETTINGS
@given(perm=st.sampled_from(PERMS[1:]))
def test_every_relabelling_of_a_named_file_is_named(tmp_path, field_target, fmt, perm):
    """Key NAMES[i] holds the state of NAMES[perm[i]]: each wrong slot is a mismatch naming the point
    it really holds, the right ones stay ok, and the diagnosis covers every wrong slot."""
    ref, ref_file, spec_file = field_target
    spec = load_spec(spec_file)
    pts = _points(spec)
    stored = {NAMES[i]: ref.states[pts[perm[i]]] for i in range(4)}
    f = _write(tmp_path, fmt, stored, ref.input_ids, "p" + "".join(map(str, perm)))
    r = match(f, str(ref_file), spec=spec)
    by_name = {s.name: s for s in r.report.slots}
    for i, n in enumerate(NAMES):
        s = by_name[n]
        assert s.matched == pts[perm[i]]
        assert s.verdict == ("ok" if perm[i] == i else "mismatch")
    wrong = [NAMES[i] for i in range(4) if perm[i] != i]
    text = " ".join(d.detail for d in r.report.diagnosis)
    assert all(repr(n) in text for n in wrong), text
    assert r.verdict == "mismatch" and r.headline.startswith("mismatch:")


def test_a_surgeon_dump_is_read_by_its_capture_names(tmp_path, field_target):
    from surgeon.capture.dumps import write_dump

    ref, ref_file, spec_file = field_target
    spec = load_spec(spec_file)
    order = ["last", "high", "low", "mid"]  # a dump whose slots are stored in another order than the spec's
    caps = [(n, spec.captures[n], ref.states[spec.captures[n]]) for n in order]
    f = write_dump(tmp_path / "d.safetensors", caps, input_ids=ref.input_ids, num_layers=8, spec=spec)
    r = json.loads(run("verify", spec_file, "--subject", f, "--reference", ref_file, "--json").stdout)
    assert [(s["name"], s["verdict"]) for s in r["slots"]] == [(n, "ok") for n in NAMES]


def test_order_defined_layouts_keep_their_order(tmp_path, field_target):
    """A stack or SpecForge's aux columns have an order: the spec's dump slots label them in it."""
    ref, ref_file, spec_file = field_target
    spec = load_spec(spec_file)
    pts = _points(spec)
    stack = tmp_path / "hs_0.safetensors"
    save_file({"token_ids": ref.input_ids,
               "hidden_states": torch.stack([ref.states[p] for p in pts], dim=1).contiguous()}, str(stack))
    r = match(stack, str(ref_file), spec=spec)
    assert [s.verdict for s in r.report.slots] == ["ok"] * 4
    ckpt = tmp_path / "data_0.ckpt"
    torch.save({"input_ids": ref.input_ids[None], "loss_mask": torch.ones(1, ref.input_ids.numel()),
                "aux_hidden_state": torch.cat([ref.states[p] for p in [pts[1], pts[0], pts[2]]], -1)[None],
                "hidden_state": ref.states[pts[3]][None]}, ckpt)
    r = match(ckpt, str(ref_file), spec=spec)
    assert [(s.name, s.verdict, str(s.matched)) for s in r.report.slots][:2] == [
        ("low", "mismatch", "layer_out[3]"), ("mid", "mismatch", "layer_out[1]")]
    assert any(d.kind == "swap" or "swapped" in d.detail for d in r.report.diagnosis)


def test_slots_pick_keys_by_name_and_refuse_positions(tmp_path, field_target):
    ref, ref_file, spec_file = field_target
    spec = load_spec(spec_file)
    stored = {f"aux{i}": ref.states[p] for i, p in enumerate(_points(spec))}
    f = _write(tmp_path, "safetensors", stored, ref.input_ids, "keys")
    out = run("verify", spec_file, "--subject", f, "--reference", ref_file, code=2).stderr
    assert "aux0, aux1, aux2, aux3" in out and "--slots NAME=KEY" in out and "Traceback" not in out
    out = run("verify", spec_file, "--subject", f, "--reference", ref_file, "--slots", "low,mid,high,last",
              code=2).stderr  # names by position: refused with the reason
    assert "not by position" in out
    r = json.loads(run("verify", spec_file, "--subject", f, "--reference", ref_file, "--slots",
                       "mid=aux1,last=aux3,low=aux0,high=aux2", "--json").stdout)
    assert [(s["name"], s["verdict"]) for s in r["slots"]] == [("mid", "ok"), ("last", "ok"), ("low", "ok"), ("high", "ok")]
    r = json.loads(run("match", f, "--reference", ref_file, "--slots", "aux2=layer_out[5],aux0", "--json").stdout)
    assert [(s["name"], s["declared"], s["verdict"]) for s in r["slots"]] == [
        ("aux2", "layer_out[5]", "ok"), ("aux0", None, "unlabelled")]
    run("match", f, "--reference", ref_file, "--slots", "a=aux1,b=aux1", code=2)  # one key twice
    run("match", f, "--reference", ref_file, "--slots", "aux1=nowhere", code=2)


def test_a_named_file_missing_a_dump_slot_is_refused_not_shifted(tmp_path, field_target):
    ref, ref_file, spec_file = field_target
    spec = load_spec(spec_file)
    stored = {n: ref.states[spec.captures[n]] for n in ("low", "mid", "high")}
    stored["extra"] = ref.states[spec.captures["last"]]
    f = _write(tmp_path, "pt", stored, ref.input_ids, "missing")
    with pytest.raises(BadInput, match="no tensor named 'last'"):
        match(f, str(ref_file), spec=spec)


# -- undecided ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flat_target(tmp_path_factory):
    """A tiny llama whose residual branches are scaled to 1e-4: consecutive layers' outputs differ by
    ~1e-4 relative, so no reference on it can tell layer_out[k] from layer_out[k+1]."""
    from surgeon.run.tinymodels import make_tiny_model
    from surgeon.verify.reference import capture_reference, save_reference

    d = tmp_path_factory.mktemp("flat")
    model = make_tiny_model("llama", d / "model", num_layers=6, seed=5, residual_scale=1e-4)
    ref = capture_reference(model, list(range(5, 37)))
    ref_file = d / "ref.safetensors"
    save_reference(ref, ref_file)
    spec = d / "spec.yaml"
    spec.write_text(textwrap.dedent("""\
        spec: 1
        name: flat
        target: {architecture: LlamaForCausalLM, num_layers: 6, hidden_size: 64}
        captures: {low: 'layer_out[1]', mid: 'layer_out[2]', high: 'layer_out[3]', last: final_norm}
        draft: {kind: eagle3, fc_input: [low, mid, high], fc_in_features: 192}
        """))
    return ref, ref_file, spec


def test_points_that_do_not_separate_are_undecided_never_ok(tmp_path, flat_target):
    ref, ref_file, spec_file = flat_target
    spec = load_spec(spec_file)
    # off by one layer, captured in bf16 (rounding ~0.3%, the layers ~0.007% apart): the wrong
    # state, which the reference cannot tell from the right one (an fp32 copy would match exactly)
    stored = {n: ref.states[spec.captures[n]].bfloat16() for n in NAMES}
    stored["mid"] = ref.states[spec.captures["high"]].bfloat16()
    f = _write(tmp_path, "safetensors", stored, ref.input_ids, "flat")
    res = run("verify", spec_file, "--subject", f, "--reference", ref_file, "--json", code=UNDECIDED)
    r = json.loads(res.stdout)
    assert r["verdict"] == "undecided" and not r["ok"]
    verdicts = {s["name"]: s["verdict"] for s in r["slots"]}
    assert verdicts["mid"] == "undecided" and "ok" not in {verdicts["low"], verdicts["mid"], verdicts["high"]}
    assert verdicts["last"] == "ok"  # the final norm separates from every layer
    text = run("verify", spec_file, "--subject", f, "--reference", ref_file, code=UNDECIDED).stdout
    assert text.splitlines()[0].startswith("undecided:")
    assert run("match", f, "--reference", ref_file, code=UNDECIDED).stdout.startswith("undecided:")


def test_dump_info_says_not_recorded_for_a_connector_stack(tmp_path, field_target):
    from surgeon.commands.outputs import DumpInfoOutput

    ref, ref_file, spec_file = field_target
    spec = load_spec(spec_file)
    stack = tmp_path / "req-0.safetensors"
    save_file({"token_ids": ref.input_ids,
               "hidden_states": torch.stack([ref.states[p] for p in _points(spec)[:3]], dim=1).contiguous()}, str(stack))
    res = run("dump-info", stack)
    assert "not recorded" in res.stdout and "hidden_states stack" in res.stdout
    info = json.loads(run("dump-info", stack, "--json").stdout)
    DumpInfoOutput.model_validate(info)
    assert info["layout"] == "vllm-connector" and not info["labelled"]
    assert [c["point"] for c in info["captures"]] == [None] * 3
    info = json.loads(run("dump-info", stack, "--slots", "vllm:2,4,6", "--spec", spec_file, "--json").stdout)
    assert [c["point"] for c in info["captures"]] == ["layer_out[1]", "layer_out[3]", "layer_out[5]"] and info["labelled"]
    run("dump-info", stack, "--slots", "vllm:2,4,6", code=2)  # labelling by ids needs the layer count


def test_keys_that_name_points_declare_them(tmp_path, field_target):
    """A dict keyed by point names records its points: the spec's captures are found by point, and
    a key naming the wrong point is a mismatch named as such."""
    ref, ref_file, spec_file = field_target
    spec = load_spec(spec_file)
    stored = {str(p): ref.states[p] for p in _points(spec)}
    f = _write(tmp_path, "pt", stored, ref.input_ids, "points")
    r = match(f, str(ref_file), spec=spec)
    assert [(s.name, s.verdict) for s in r.report.slots] == [(n, "ok") for n in NAMES]
    stored["layer_out[3]"] = ref.states[_points(spec)[2]].clone()  # holds layer_out[5]
    f = _write(tmp_path, "safetensors", stored, ref.input_ids, "points-wrong")
    r = match(f, str(ref_file))
    wrong = {s.name: (s.declared, s.matched, s.verdict) for s in r.report.slots}["layer_out[3]"]
    assert (str(wrong[0]), str(wrong[1]), wrong[2]) == ("layer_out[3]", "layer_out[5]", "mismatch")


def test_a_specforge_file_is_labelled_by_its_own_semantics_not_the_specs_capture_order(tmp_path, field_target):
    """SpecForge's aux_hidden_state is the fc input in fc order and hidden_state the final norm's
    output, whatever order the spec lists its captures in."""
    ref, ref_file, _ = field_target
    spec_file = tmp_path / "rev.yaml"
    spec_file.write_text(textwrap.dedent("""\
        spec: 1
        name: rev
        target: {architecture: LlamaForCausalLM, num_layers: 8, hidden_size: 64}
        captures: {last: final_norm, high: 'layer_out[5]', low: 'layer_out[1]', mid: 'layer_out[3]'}
        draft: {kind: eagle3, fc_input: [low, mid, high], fc_in_features: 192}
        """))
    spec = load_spec(spec_file)
    ckpt = tmp_path / "data_0.ckpt"
    torch.save({"input_ids": ref.input_ids[None], "loss_mask": torch.ones(1, ref.input_ids.numel()),
                "aux_hidden_state": torch.cat([ref.states[spec.captures[n]] for n in spec.fc_names], -1)[None],
                "hidden_state": ref.states[spec.captures["last"]][None]}, ckpt)
    r = match(ckpt, str(ref_file), spec=spec)
    assert [(s.name, s.verdict) for s in r.report.slots] == [("low", "ok"), ("mid", "ok"), ("high", "ok"), ("last", "ok")]
    assert any("SpecForge's own" in n for n in r.notes)


def test_ids_that_label_a_stack_are_checked_against_the_spec(tmp_path, field_target):
    """--slots vllm:IDS says what the stack holds; verify still checks the spec: a stack whose ids
    name other layers than the spec's is a mismatch naming the spec's slots it lacks."""
    ref, ref_file, spec_file = field_target
    pts = [layer_out(2), layer_out(4), layer_out(6), layer_out(7)]
    stack = tmp_path / "hs_0.safetensors"
    save_file({"token_ids": ref.input_ids,
               "hidden_states": torch.stack([ref.states[p] for p in pts], dim=1).contiguous()}, str(stack))
    r = json.loads(run("verify", spec_file, "--subject", stack, "--reference", ref_file, "--slots", "vllm:3,5,7,8",
                       "--json", code=3).stdout)
    assert [s["verdict"] for s in r["slots"]] == ["ok"] * 4  # the labels are true ...
    assert r["missing"] == ["low: layer_out[1]", "mid: layer_out[3]", "high: layer_out[5]", "last: final_norm"]
    run("verify", spec_file, "--subject", stack, "--reference", ref_file, "--slots", "vllm:3,5,7", code=2)


@pytest.mark.parametrize("record", ['{"surgeon.kind": "export", "files": [{"file": "hs_0.safetensors", "captures": [1, 2]}]}',
                                    '{"surgeon.kind": "export", "files": {"hs_0.safetensors": 1}}',
                                    '{"surgeon.kind": "export", "files": [{"file": "hs_0.safetensors", "captures": '
                                    '[{"name": "hidden_states[:, 0]", "point": "layer_out[99]"}]}]}',
                                    '{"surgeon.kind": "export", "files": [oops]}'])
def test_a_bad_export_record_is_one_line(tmp_path, field_target, record):
    ref, ref_file, spec_file = field_target
    stack = tmp_path / "hs_0.safetensors"
    save_file({"token_ids": ref.input_ids, "hidden_states": torch.stack([ref.states[layer_out(1)]] * 2, 1)}, str(stack))
    (tmp_path / "surgeon-export.json").write_text(record)
    for args in (("match", stack, "--reference", ref_file), ("dump-info", stack)):
        err = run(*args, code=2).stderr
        assert "surgeon-export.json" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_slots_refuse_a_name_given_twice(tmp_path, field_target):
    ref, ref_file, _ = field_target
    f = _write(tmp_path, "safetensors", {"a": ref.states[layer_out(1)], "b": ref.states[layer_out(3)]},
               ref.input_ids, "twice")
    assert "given twice" in run("match", f, "--reference", ref_file, "--slots", "low=a,low=b", code=2).stderr
