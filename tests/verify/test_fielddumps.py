"""TensorRT-LLM SaveHiddenStates and Model Optimizer collect_hidden_states dumps as subjects.

Each file is built the way the cited source builds it, by the writers in tests/conftest.py (lines
cited at each), with the engine's own states stood in for by a real reference of a tiny model.
"""

import json

import pytest
import torch

from surgeon.core.errors import BadInput
from surgeon.core.points import EMBED, FINAL_NORM, layer_out
from surgeon.engines.facts.field_tables import MODELOPT_HF
from surgeon.engines.facts.modelopt import open_modelopt
from surgeon.verify.subjects import read_subject
from tests.conftest import (
    FIELD_IDS,
    FIELD_LAYERS,
    trtllm_record,
    write_modelopt_hf,
    write_modelopt_trtllm,
    write_modelopt_vllm,
    write_trtllm,
)
from tests.conftest import cli_run as run

L = FIELD_LAYERS
IDS = FIELD_IDS


@pytest.fixture
def tiny(field_target):
    return field_target


def verify_json(tiny, subject, slots, code=0):
    _, ref_file, spec = tiny
    r = json.loads(run("verify", spec, "--subject", subject, "--reference", ref_file, "--slots", slots, "--json",
                       code=code).stdout)
    return r, [(s["name"], s["declared"], s["matched"], s["verdict"]) for s in r["slots"]]


# -- TensorRT-LLM --------------------------------------------------------------------------------------
def test_trtllm_dump_slots_are_named_by_its_layers_to_capture(tmp_path, tiny):
    ref = tiny[0]
    f = write_trtllm(tmp_path / "data_1.pt", ref, {5, 1, 3})
    s = read_subject(f, num_layers=L)  # the layout alone fixes the last slot: -1, post-norm
    assert s.layout == "trtllm" and s.names[-1] == "hidden_state"
    assert [d for _, d, _ in s.slots] == [None, None, None, FINAL_NORM]
    assert any("trtllm:IDS" in n for n in s.notes) and torch.equal(s.input_ids, ref.input_ids)
    r, got = verify_json(tiny, f, "trtllm:5,1,3")  # the spec's slots found at the points the ids give
    assert got == [("low", "layer_out[1]", "layer_out[1]", "ok"), ("mid", "layer_out[3]", "layer_out[3]", "ok"),
                   ("high", "layer_out[5]", "layer_out[5]", "ok"), ("last", "final_norm", "final_norm", "ok")]
    assert any("save_hidden_state.py:41-49" in n for n in r["notes"])
    assert any("not verified against a source on this machine" in n for n in r["notes"])


def test_trtllm_with_minus_one_listed_keeps_the_post_norm_column_in_aux(tmp_path, tiny):
    f = write_trtllm(tmp_path / "d.pt", tiny[0], {-1, 2, 6}, last_hidden_in_save=True, aux_key="hidden_state_features")
    r, got = verify_json(tiny, f, "trtllm:-1,2,6", code=3)  # true labels, but not the spec's layers 1, 3, 5
    assert r["missing"] == ["low: layer_out[1]", "mid: layer_out[3]", "high: layer_out[5]"]
    assert r["verdict"] == "mismatch" and r["headline"].startswith("mismatch: the spec's low: layer_out[1]")
    assert [(n, d, v) for n, d, _, v in got] == [
        ("hidden_state_features[0]", "layer_out[2]", "ok"), ("hidden_state_features[1]", "layer_out[6]", "ok"),
        ("hidden_state_features[2]", "final_norm", "ok"), ("hidden_state", "final_norm", "ok")]
    s = read_subject(write_trtllm(tmp_path / "dflt.pt", tiny[0], {1, L // 2 - 1, L - 4}), slots=["trtllm:default"],
                     num_layers=L)
    assert [d for _, d, _ in s.slots] == [layer_out(1), layer_out(3), layer_out(4), FINAL_NORM]


# -- Model Optimizer -----------------------------------------------------------------------------------
def test_modelopt_hf_backend(tmp_path, tiny):
    f = write_modelopt_hf(tmp_path / "7.pt", tiny[0], [1, 3, 5])
    r, got = verify_json(tiny, f, "modelopt-hf:5,3,1")  # common.py sorts and de-duplicates
    assert [(n, d, v) for n, d, _, v in got] == [
        ("low", "layer_out[1]", "ok"), ("mid", "layer_out[3]", "ok"), ("high", "layer_out[5]", "ok"),
        ("last", "final_norm", "ok")]
    assert any("compute_hidden_states_hf.py:187" in n for n in r["notes"])
    assert any(f"loss_mask: {len(IDS)} of {len(IDS)}" in n for n in r["notes"])
    # id L-1 reads hidden_states[L], the final norm's output (the hf backend cannot give layer_out[L-1])
    f2 = write_modelopt_hf(tmp_path / "8.pt", tiny[0], [2, L - 1])
    _, got = verify_json(tiny, f2, f"modelopt-hf:2,{L - 1}", code=3)  # not the spec's layers: a mismatch
    assert [d for _, d, _, _ in got] == ["layer_out[2]", "final_norm", "final_norm"]


def test_modelopt_vllm_backend_labels_the_same_list_one_layer_earlier_than_hf(tmp_path, tiny):
    f = write_modelopt_vllm(tmp_path / "c1.pt", tiny[0], [1, 3, 5])
    vllm = read_subject(f, slots=["modelopt-vllm:1,3,5"], num_layers=L)
    hf = read_subject(f, slots=["modelopt-hf:1,3,5"], num_layers=L)
    assert [d for _, d, _ in vllm.slots] == [layer_out(0), layer_out(2), layer_out(4), layer_out(L - 1)]
    assert [d for _, d, _ in hf.slots] == [layer_out(1), layer_out(3), layer_out(5), FINAL_NORM]
    assert any("one layer earlier than hf" in n for n in vllm.notes)
    r, got = verify_json(tiny, f, "modelopt-vllm:1,3,5", code=3)  # what the vllm backend really dumped: all ok,
    assert len(r["missing"]) == 4  # and none of it the spec's points: the wiring differs
    assert [(d, m, v) for _, d, m, v in got] == [("layer_out[0]", "layer_out[0]", "ok"),
                                                 ("layer_out[2]", "layer_out[2]", "ok"),
                                                 ("layer_out[4]", "layer_out[4]", "ok"),
                                                 (f"layer_out[{L - 1}]", f"layer_out[{L - 1}]", "ok")]
    _, got = verify_json(tiny, f, "modelopt-hf:1,3,5", code=3)  # read as if hf had written it: every slot off
    assert [v for *_, v in got] == ["mismatch"] * 4


def test_modelopt_trtllm_backend_and_an_unlabelled_dump(tmp_path, tiny):
    f = write_modelopt_trtllm(tmp_path / "3.pt", tiny[0], [1, 3, 5])
    _, got = verify_json(tiny, f, "modelopt-trtllm:1,3,5")
    assert [(d, v) for _, d, _, v in got] == [("layer_out[1]", "ok"), ("layer_out[3]", "ok"), ("layer_out[5]", "ok"),
                                               ("final_norm", "ok")]
    r = json.loads(run("match", f, "--reference", tiny[1], "--json").stdout)  # no ids: identified, not labelled
    assert [s["verdict"] for s in r["slots"]] == ["unlabelled"] * 4
    assert [s["matched"] for s in r["slots"]] == ["layer_out[1]", "layer_out[3]", "layer_out[5]", "final_norm"]
    assert any("pass --slots modelopt-trtllm:IDS" in n for n in r["notes"])  # its keys rule out hf and vllm
    assert any("written by its trtllm backend: it has no loss_mask" in n for n in r["notes"])


def test_modelopt_presets_come_from_its_source(tmp_path, tiny):
    source = open_modelopt()
    f = tmp_path / "p.pt"
    if source is None:  # no Model Optimizer source here: the preset is refused, never guessed
        write_modelopt_hf(f, tiny[0], [1, 3, 5])
        with pytest.raises(BadInput, match="needs the Model Optimizer source"):
            read_subject(f, slots=["modelopt-hf:eagle"], num_layers=L)
        return
    eagle = source.eagle_default(L)
    write_modelopt_hf(f, tiny[0], eagle)
    s = read_subject(f, slots=["modelopt-hf:eagle"], num_layers=L)
    assert [d for _, d, _ in s.slots][:-1] == MODELOPT_HF.decode(eagle, L)
    assert any(source.origin in n for n in s.notes)


# -- bad input: one line, exit 2 ----------------------------------------------------------------------
@pytest.mark.parametrize("case, needle", [
    ("extra_key", "unexpected keys ['extra']"),
    ("record_extra_key", "unexpected keys ['step']"),
    ("wrong_count", "the ids do not fit"),
    ("out_of_range", "outside [0, 8)"),
    ("vllm_eagle", "does not take 'eagle'"),
    ("wrong_family", "modelopt-trtllm:IDS"),
    ("on_specforge", "names a modelopt-hf dump"),
    ("short_loss_mask", "loss_mask has 3 entries"),
    ("two_directives", "give it alone"),
])
def test_bad_field_dumps(tmp_path, tiny, case, needle):
    ref, ref_file, spec = tiny
    f = tmp_path / "bad.pt"
    slots = "modelopt-hf:1,3,5"
    extra: list[str] = []
    if case == "extra_key":
        write_modelopt_hf(f, ref, [1, 3, 5])
        torch.save({**torch.load(f, weights_only=True), "extra": torch.zeros(1)}, f)
    elif case == "record_extra_key":
        torch.save([{**trtllm_record(ref, {1, 3}), "step": 4}], f)
        slots = "trtllm:1,3"
    elif case == "wrong_count":
        write_modelopt_hf(f, ref, [1, 3, 5])
        slots = "modelopt-hf:1,3"
    elif case == "out_of_range":
        write_modelopt_vllm(f, ref, [1, 3, 5])
        slots = "modelopt-vllm:1,3,8"
    elif case == "vllm_eagle":
        write_modelopt_vllm(f, ref, [1, 3, 5])
        slots = "modelopt-vllm:eagle"
    elif case == "wrong_family":
        write_modelopt_trtllm(f, ref, [1, 3, 5])
        slots = "trtllm:1,3,5"
    elif case == "on_specforge":
        torch.save({"input_ids": ref.input_ids[None], "aux_hidden_state": ref.states[EMBED][None],
                    "hidden_state": ref.states[FINAL_NORM][None]}, f)
    elif case == "short_loss_mask":
        write_modelopt_hf(f, ref, [1, 3, 5])
        torch.save({**torch.load(f, weights_only=True), "loss_mask": torch.ones(3, dtype=torch.long)}, f)
    elif case == "two_directives":
        write_modelopt_hf(f, ref, [1, 3, 5])
        extra = ["--slots", "modelopt-vllm:1,3,5"]
    res = run("verify", spec, "--subject", f, "--reference", ref_file, "--slots", slots, *extra, code=2)
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_labelling_by_ids_needs_the_layer_count(tmp_path, tiny):
    f = write_modelopt_hf(tmp_path / "n.pt", tiny[0], [1, 3, 5])
    res = run("match", f, "--reference", tiny[1], "--slots", "modelopt-hf:1,3,5", code=2)
    assert "pass --spec" in res.stderr


def test_a_vllm_dump_without_aux_ids_and_a_trtllm_file_of_several_records(tmp_path, tiny):
    ref = tiny[0]
    f = write_modelopt_vllm(tmp_path / "none.pt", ref, [])  # :303 aux_hidden_states = torch.empty(0)
    s = read_subject(f, num_layers=L)
    assert s.names == ["hidden_states"] and s.layout == "modelopt"
    several = tmp_path / "data_2.pt"  # write_interval 2: two records in one torch.save (:63, :69)
    torch.save([trtllm_record(ref, {2, 4}), {**trtllm_record(ref, {2, 4}), "id": 2}], several)
    s = read_subject(several, slots=["trtllm:2,4"], num_layers=L)
    assert [d for _, d, _ in s.slots] == [layer_out(2), layer_out(4), FINAL_NORM]
    assert any("record 1 of 2 (id 1)" in n for n in s.notes)
