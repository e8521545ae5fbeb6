"""`surgeon dump-info` and `surgeon export` on TensorRT-LLM SaveHiddenStates and Model Optimizer
collect_hidden_states dumps, written by the writers of tests/conftest.py as each source writes them
(states of a real tiny model): the producer the keys allow, each slot's point as --slots labels it,
and the trainer files and manifest export writes from them."""

import json
import os
from pathlib import Path

import jsonschema
import pytest
import torch
from safetensors.torch import load_file

from surgeon.core.points import FINAL_NORM, layer_out, parse_point
from tests.conftest import FIELD_IDS as IDS
from tests.conftest import FIELD_LAYERS as L
from tests.conftest import cli_run as run
from tests.conftest import trtllm_record, write_modelopt_hf, write_modelopt_trtllm, write_modelopt_vllm, write_trtllm

T = len(IDS)


def on_schema(verb, data):
    """``data`` (a --json output) checked against the schema ``surgeon schema --output VERB`` prints."""
    schema = json.loads(run("schema", "--output", verb).stdout)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in jsonschema.Draft202012Validator(schema).iter_errors(data)]
    assert not errors, errors[:5]
    return data


def info(f, *args, code=0):
    return on_schema("dump-info", json.loads(run("dump-info", f, *args, "--json", code=code).stdout))


def points(report):
    return [c["point"] for c in report["captures"]]


def one_line_refusal(res, *needles):
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and all(n in lines[0] for n in needles), res.stderr


# -- dump-info ------------------------------------------------------------------------------------------
def test_dump_info_on_a_trtllm_dump_labels_only_what_the_layout_fixes_until_slots_name_the_ids(tmp_path, field_target):
    ref, _, spec = field_target
    f = tmp_path / "data_1.pt"
    torch.save([trtllm_record(ref, {1, 3, 5}), trtllm_record(ref, {1, 3, 5}, record_id=2)], f)
    bare = info(f)
    assert (bare["layout"], bare["labelled"], bare["producer"]["detected"], bare["producer"]["given"]) == \
        ("trtllm", False, ["trtllm"], None)
    assert points(bare) == [None, None, None, "final_norm"]  # -1's column: the layout says so, no ids needed
    assert [c["name"] for c in bare["captures"]][-1] == "hidden_state"
    assert all(c["shape"] == [T, 64] and c["dtype"] == "float32" for c in bare["captures"])
    assert bare["records"] == [{"index": i, "id": f"id {i + 1}", "tokens": T, "input_ids": True, "loss_mask": None}
                               for i in range(2)]
    assert bare["tokens"] == T and bare["hidden_size"] == 64 and bare["num_layers"] is None
    assert any("does not record eagle3_layers_to_capture" in n and "--slots trtllm:IDS" in n for n in bare["notes"])
    text = run("dump-info", f).stdout
    assert "not recorded" in text and "2 record(s)" in text
    labelled = info(f, "--slots", "trtllm:5,3,1", "--spec", spec)
    assert labelled["labelled"] and labelled["producer"]["given"] == "trtllm:5,3,1" and labelled["num_layers"] == L
    assert points(labelled) == ["layer_out[1]", "layer_out[3]", "layer_out[5]", "final_norm"]


def test_dump_info_reads_a_vllm_backend_dump_as_hf_one_layer_later_than_as_vllm(tmp_path, field_target):
    ref, _, spec = field_target
    f = write_modelopt_vllm(tmp_path / "c1.pt", ref, [2, 4, 6])
    bare = info(f)
    assert (bare["layout"], bare["producer"]["detected"], points(bare)) == \
        ("modelopt", ["modelopt-hf", "modelopt-vllm"], [None] * 4)
    assert any("does not record --aux-layers" in n and "cannot tell which wrote it" in n
               and "--slots modelopt-hf:IDS or modelopt-vllm:IDS" in n for n in bare["notes"])
    assert bare["records"] == [{"index": 0, "id": "conversation c1", "tokens": T, "input_ids": True, "loss_mask": T}]
    as_vllm = points(info(f, "--slots", "modelopt-vllm:2,4,6", "--spec", spec))
    as_hf = points(info(f, "--slots", "modelopt-hf:2,4,6", "--spec", spec))
    assert as_vllm == ["layer_out[1]", "layer_out[3]", "layer_out[5]", f"layer_out[{L - 1}]"]
    assert as_hf == ["layer_out[2]", "layer_out[4]", "layer_out[6]", "final_norm"]
    assert [parse_point(p, L).index + 1 for p in as_vllm[:3]] == [parse_point(p, L).index for p in as_hf[:3]]


def test_dump_info_tells_the_backend_where_the_keys_fix_it(tmp_path, field_target):
    ref, _, spec = field_target
    trt = info(write_modelopt_trtllm(tmp_path / "3.pt", ref, [1, 3, 5]))
    assert trt["producer"]["detected"] == ["modelopt-trtllm"] and "no loss_mask" in trt["producer"]["why"]
    assert trt["records"][0]["loss_mask"] is None
    assert points(info(tmp_path / "3.pt", "--slots", "modelopt-trtllm:1,3,5", "--spec", spec)) == \
        ["layer_out[1]", "layer_out[3]", "layer_out[5]", "final_norm"]
    res = run("dump-info", tmp_path / "3.pt", "--slots", "modelopt-hf:1,3,5", "--spec", spec, code=2)
    one_line_refusal(res, "3.pt", "modelopt-hf", "no loss_mask")
    empty = info(write_modelopt_vllm(tmp_path / "none.pt", ref, []))
    assert empty["producer"]["detected"] == ["modelopt-vllm"] and [c["name"] for c in empty["captures"]] == ["hidden_states"]


@pytest.mark.parametrize("case, needles", [
    ("no_spec", ["pass --spec"]),
    ("not_a_field_dump", ["neither a surgeon dump nor"]),
    ("unsafe_pickle", ["weights_only=True"]),
    ("slots_on_surgeon_dump", ["surgeon dump declares"]),
    ("bad_ids", ["outside [0, 8)"]),
    # degenerate shapes: refused before the aux columns are split by H (H = 0 divided by zero)
    ("trtllm_hidden_0", ["hidden_state has shape [5, 0]", "hidden size of 0"]),
    ("modelopt_hidden_0", ["hidden_states has shape [5, 0]", "hidden size of 0"]),
    ("trtllm_tokens_0", ["hidden_state has shape [0, 4]", "0 tokens"]),
    ("modelopt_tokens_0", ["hidden_states has shape [0, 4]", "0 tokens"]),
    ("aux_width_0", ["aux_hidden_states of shape (5, 0)", "n >= 1"]),
    ("aux_not_n_h", ["aux_hidden_states of shape (5, 6)", "[5, n*4]"]),
    ("ids_count", ["input_ids holds 3 ids for 5 tokens"]),
])
def test_dump_info_bad_input_is_one_line_exit_2(tmp_path, field_target, case, needles):
    from surgeon.capture.dumps import write_dump

    ref, _, spec = field_target
    f = tmp_path / "x.pt"
    args = []
    if case == "no_spec":
        write_modelopt_hf(f, ref, [1, 3, 5])
        args = ["--slots", "modelopt-hf:1,3,5"]
    elif case == "not_a_field_dump":
        torch.save({"weights": torch.zeros(3)}, f)
    elif case == "unsafe_pickle":
        torch.save({"hidden_states": torch.zeros(2, 2), "conversation_id": Exception("not a tensor")}, f)
    elif case == "slots_on_surgeon_dump":
        f = write_dump(tmp_path / "d.safetensors", [("last", FINAL_NORM, ref.states[FINAL_NORM])],
                       input_ids=ref.input_ids, num_layers=L)
        args = ["--slots", "trtllm:1"]
    elif case == "bad_ids":
        write_modelopt_vllm(f, ref, [1, 3, 5])
        args = ["--slots", "modelopt-vllm:1,3,8", "--spec", spec]
    elif case in DEGENERATE:
        torch.save(DEGENERATE[case](), f)
    one_line_refusal(run("dump-info", f, *args, code=2), str(f.name), *needles)


def _trt(T, H, aux, ids=None):
    return [{"id": 1, "input_ids": torch.arange(T if ids is None else ids), "hidden_state": torch.zeros(T, H),
             "aux_hidden_states": torch.zeros(*aux)}]


def _mo(T, H, aux):
    return {"input_ids": torch.arange(T), "hidden_states": torch.zeros(T, H), "aux_hidden_states": torch.zeros(*aux),
            "loss_mask": torch.ones(T, dtype=torch.long)}


DEGENERATE = {"trtllm_hidden_0": lambda: _trt(5, 0, (5, 6)), "modelopt_hidden_0": lambda: _mo(5, 0, (5, 6)),
              "trtllm_tokens_0": lambda: _trt(0, 4, (0, 8)), "modelopt_tokens_0": lambda: _mo(0, 4, (0, 8)),
              "aux_width_0": lambda: _mo(5, 4, (5, 0)), "aux_not_n_h": lambda: _trt(5, 4, (5, 6)),
              "ids_count": lambda: _trt(5, 4, (5, 8), ids=3)}


# -- export ---------------------------------------------------------------------------------------------
def manifest(out):
    return json.loads((out / "surgeon-export.json").read_text())


def test_export_a_modelopt_hf_dump_to_specforge_with_its_loss_mask(tmp_path, field_target):
    ref, _, spec = field_target
    f = write_modelopt_hf(tmp_path / "7.pt", ref, [1, 3, 5])
    data = torch.load(f, weights_only=True)
    data["loss_mask"][:4] = 0  # the prompt, as Model Optimizer masks it
    torch.save(data, f)
    out = tmp_path / "sf"
    r = on_schema("export", json.loads(run("export", f, "--spec", spec, "--layout", "specforge", "-o", out, "--slots",
                                           "modelopt-hf:1,3,5", "--json").stdout))
    assert r["written"] == [str(out / "data_0.ckpt")] and r["manifest"] == str(out / "surgeon-export.json")
    ckpt = torch.load(out / "data_0.ckpt", weights_only=True)
    assert set(ckpt) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
    assert torch.equal(ckpt["input_ids"], ref.input_ids[None])
    assert torch.equal(ckpt["loss_mask"], data["loss_mask"][None]) and int(ckpt["loss_mask"].sum()) == T - 4
    want_aux = torch.cat([ref.states[layer_out(k)] for k in (1, 3, 5)], dim=-1)
    assert torch.equal(ckpt["aux_hidden_state"][0], want_aux)
    assert torch.equal(ckpt["hidden_state"][0], ref.states[FINAL_NORM])
    m = manifest(out)
    assert (m["surgeon.kind"], m["layout"], m["spec"]["name"]) == ("export", "SpecForge", "tiny")
    (entry,) = m["files"]
    assert (entry["file"], entry["source"], entry["record"], entry["loss_mask"]) == \
        ("data_0.ckpt", str(f), "conversation 7", "the dump's")
    assert entry["producer"].startswith("modelopt-hf:1,3,5")
    assert [(c["name"], c["point"], c["from"]) for c in entry["captures"]] == [
        ("hidden_state", "final_norm", "hidden_states"), ("aux_hidden_state[0]", "layer_out[1]", "aux_hidden_states[0]"),
        ("aux_hidden_state[1]", "layer_out[3]", "aux_hidden_states[1]"),
        ("aux_hidden_state[2]", "layer_out[5]", "aux_hidden_states[2]")]


def test_export_a_vllm_backend_dump_is_what_its_backend_says_not_what_hf_would(tmp_path, field_target):
    ref, _, spec = field_target
    f = write_modelopt_vllm(tmp_path / "c1.pt", ref, [2, 4, 6])  # vLLM ids 2,4,6 = layer_out[1],[3],[5]
    out = tmp_path / "sp"
    run("export", f, "--spec", spec, "--layout", "speculators", "-o", out, "--slots", "modelopt-vllm:2,4,6")
    hs = load_file(str(out / "hs_0.safetensors"))
    assert torch.equal(hs["token_ids"], ref.input_ids)
    for i, k in enumerate((1, 3, 5, L - 1)):
        assert torch.equal(hs["hidden_states"][:, i], ref.states[layer_out(k)])
    assert [c["point"] for c in manifest(out)["files"][0]["captures"]] == \
        ["layer_out[1]", "layer_out[3]", "layer_out[5]", f"layer_out[{L - 1}]"]
    # SpecForge needs the final norm's output, which the vllm backend does not dump: refused, nothing written
    sf = tmp_path / "sf"
    one_line_refusal(run("export", f, "--spec", spec, "--layout", "specforge", "-o", sf, "--slots",
                         "modelopt-vllm:2,4,6", code=2), "c1.pt", "final_norm")
    assert not sf.exists()
    # read as if hf had written it, every slot is one layer later: the spec's layer_out[1] is not there
    sp2 = tmp_path / "sp2"
    one_line_refusal(run("export", f, "--spec", spec, "--layout", "speculators", "-o", sp2, "--slots",
                         "modelopt-hf:2,4,6", code=2), "c1.pt", "no layer_out[1]")
    assert not sp2.exists()


def test_export_every_record_of_a_trtllm_folder(tmp_path, field_target):
    ref, _, spec = field_target
    d = tmp_path / "trt"
    d.mkdir()
    torch.save([trtllm_record(ref, {1, 3, 5}), trtllm_record(ref, {1, 3, 5}, record_id=2)], d / "data_1.pt")
    write_trtllm(d / "data_2.pt", ref, {1, 3, 5})
    out = tmp_path / "sf"
    r = json.loads(run("export", d, "--spec", spec, "--layout", "specforge", "-o", out, "--slots", "trtllm:1,3,5",
                       "--json").stdout)
    assert [p.rsplit("/", 1)[-1] for p in r["written"]] == ["data_0.ckpt", "data_1.ckpt", "data_2.ckpt"]
    files = manifest(out)["files"]
    assert [(e["source"].rsplit("/", 1)[-1], e["record"], e["loss_mask"]) for e in files] == [
        ("data_1.pt", "id 1", "ones (the dump has none)"), ("data_1.pt", "id 2", "ones (the dump has none)"),
        ("data_2.pt", "id 1", "ones (the dump has none)")]
    for e in files:
        ckpt = torch.load(out / e["file"], weights_only=True)
        assert torch.equal(ckpt["hidden_state"][0], ref.states[FINAL_NORM])
        assert torch.equal(ckpt["aux_hidden_state"][0], torch.cat([ref.states[layer_out(k)] for k in (1, 3, 5)], -1))
        assert torch.equal(ckpt["loss_mask"], torch.ones(1, T, dtype=torch.long))


@pytest.mark.parametrize("case, needles", [
    ("unlabelled", ["does not record which layers", "--slots modelopt-hf:IDS or modelopt-vllm:IDS"]),
    ("unlabelled_trtllm", ["--slots trtllm:IDS"]),
    ("wrong_count", ["the ids do not fit"]),
    ("not_a_field_dump", ["neither a surgeon dump nor"]),
    ("slots_on_surgeon_dump", ["surgeon dump declares"]),
    ("wrong_hidden", ["hidden size 32"]),
    ("second_file_bad", ["b.pt", "the ids do not fit"]),
    ("hidden_0", ["hidden_states has shape [5, 0]"]),
])
def test_export_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, field_target, case, needles):
    from surgeon.capture.dumps import write_dump

    ref, _, spec = field_target
    f = tmp_path / "a.pt"
    files = [f]
    slots = ["--slots", "modelopt-hf:1,3,5"]
    if case == "unlabelled":
        write_modelopt_hf(f, ref, [1, 3, 5])
        slots = []
    elif case == "unlabelled_trtllm":
        write_trtllm(f, ref, {1, 3, 5})
        slots = []
    elif case == "wrong_count":
        write_modelopt_hf(f, ref, [1, 3])
    elif case == "not_a_field_dump":
        torch.save([torch.zeros(3, 2)], f)
    elif case == "slots_on_surgeon_dump":
        f = write_dump(tmp_path / "d.safetensors", [("last", FINAL_NORM, ref.states[FINAL_NORM])],
                       input_ids=ref.input_ids, num_layers=L)
        files = [f]
    elif case == "wrong_hidden":
        torch.save({"input_ids": ref.input_ids, "hidden_states": torch.zeros(T, 32),
                    "aux_hidden_states": torch.zeros(T, 96), "loss_mask": torch.ones(T, dtype=torch.long)}, f)
    elif case == "second_file_bad":  # a good first file is not written when the second cannot fill the layout
        write_modelopt_hf(f, ref, [1, 3, 5])
        files = [f, write_modelopt_hf(tmp_path / "b.pt", ref, [1, 3])]
    elif case == "hidden_0":
        torch.save(DEGENERATE["modelopt_hidden_0"](), f)
    out = tmp_path / "out"
    res = run("export", *files, "--spec", spec, "--layout", "specforge", "-o", out, *slots, code=2)
    one_line_refusal(res, *needles)
    assert not out.exists()


def _fp16_copy(src, dst, key):
    data = torch.load(src, weights_only=True)
    data[key] = data[key].half()
    torch.save(data, dst)
    return dst


def test_export_refuses_captures_of_differing_dtype_before_writing_anything(tmp_path, field_target):
    ref, _, spec = field_target
    d = tmp_path / "mo"
    d.mkdir()
    write_modelopt_vllm(d / "a.pt", ref, [2, 4, 6])  # a good file first: it must not be written either
    _fp16_copy(d / "a.pt", d / "b.pt", "hidden_states")
    out = tmp_path / "out"
    res = run("export", d, "--spec", spec, "--layout", "speculators", "-o", out, "--slots", "modelopt-vllm:2,4,6", code=2)
    one_line_refusal(res, "b.pt", "differ in dtype", "float16", "float32")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["mo"]  # no staging folder left
    # SpecForge concatenates the aux captures only: an fp16 aux among fp32 ones is refused alike
    _fp16_copy(write_modelopt_hf(d / "a.pt", ref, [1, 3, 5]), d / "b.pt", "aux_hidden_states")
    res = run("export", d, "--spec", spec, "--layout", "specforge", "-o", out, "--slots", "modelopt-hf:1,3,5", code=0)
    assert (out / "data_1.ckpt").exists()  # one aux tensor split into slots: they share a dtype, allowed


def test_export_refuses_surgeon_dumps_of_differing_dtype_before_writing_anything(tmp_path, field_target):
    from surgeon.capture.dumps import write_dump

    ref, _, spec = field_target
    caps = [("low", layer_out(1)), ("mid", layer_out(3)), ("high", layer_out(5)), ("out", layer_out(L - 1))]
    good = write_dump(tmp_path / "a.safetensors", [(n, p, ref.states[p]) for n, p in caps],
                      input_ids=ref.input_ids, num_layers=L)
    bad = write_dump(tmp_path / "b.safetensors", [(n, p, ref.states[p].half() if n == "mid" else ref.states[p])
                                                  for n, p in caps], input_ids=ref.input_ids, num_layers=L)
    out = tmp_path / "deep" / "out"
    res = run("export", good, bad, "--spec", spec, "--layout", "speculators", "-o", out, code=2)
    one_line_refusal(res, "b.safetensors", "differ in dtype", "float16, float32")
    assert not (tmp_path / "deep").exists()  # not even the parent it would have made
    out.mkdir(parents=True)  # an existing folder is left as it was
    run("export", good, bad, "--spec", spec, "--layout", "speculators", "-o", out, code=2)
    assert list(out.iterdir()) == []


def test_export_leaves_nothing_behind_on_an_internal_error(tmp_path, field_target, monkeypatch):
    from safetensors import torch as st

    ref, _, spec = field_target
    d = tmp_path / "mo"
    d.mkdir()
    write_modelopt_vllm(d / "a.pt", ref, [2, 4, 6])
    write_modelopt_vllm(d / "b.pt", ref, [2, 4, 6])
    real, calls = st.save_file, []

    def fail_on_second(tensors, path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(tensors, path, *a, **kw)

    monkeypatch.setattr(st, "save_file", fail_on_second)
    out = tmp_path / "out"
    res = run("export", d, "--spec", spec, "--layout", "speculators", "-o", out, "--slots", "modelopt-vllm:2,4,6", code=1)
    assert "internal error" in res.stderr and len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mo"]


@pytest.mark.parametrize("case", ["trtllm_hidden_0", "modelopt_hidden_0"])
def test_match_on_a_field_dump_of_hidden_size_0_is_one_line_exit_2(tmp_path, field_target, case):
    _, ref_file, _ = field_target
    f = tmp_path / "h0.pt"
    torch.save(DEGENERATE[case](), f)  # verify and match read a record through the same readers
    one_line_refusal(run("match", f, "--reference", ref_file, code=2), "h0.pt", "hidden size of 0")


def _spec_of(tmp_path, layers):
    f = tmp_path / f"spec{layers}.yaml"
    f.write_text(f"spec: 1\nname: tiny{layers}\ntarget: {{architecture: LlamaForCausalLM, num_layers: {layers}, "
                 "hidden_size: 64}\ncaptures: {a: 'layer_out[0]', b: 'layer_out[1]', c: 'layer_out[2]', last: final_norm}\n"
                 "draft: {kind: eagle3, fc_input: [a, b, c], fc_in_features: 192}\n")
    return f


def test_trtllm_default_ids_are_refused_for_2_to_5_layers_as_tensorrt_llm_raises(tmp_path, field_target):
    ref, _, _ = field_target
    f = write_trtllm(tmp_path / "trt.pt", ref, {1, 3, 5})  # three aux columns, as a default capture writes
    for layers in (4, 5):
        res = run("dump-info", f, "--slots", "trtllm:default", "--spec", _spec_of(tmp_path, layers), code=2)
        one_line_refusal(res, "trt.pt", "trtllm:default", f"{layers}-layer", "2 to 5 layers", "eagle3.py:136")
    # 6 layers: the source's tuple (1, 6 // 2 - 1, 6 - 4) = (1, 2, 2), kept as it is (not de-duplicated)
    six = info(f, "--slots", "trtllm:default", "--spec", _spec_of(tmp_path, 6))
    assert points(six) == ["layer_out[1]", "layer_out[2]", "layer_out[2]", "final_norm"]


def test_dump_info_top_level_fields_describe_the_first_record_as_for_a_surgeon_dump(tmp_path, field_target):
    from surgeon.capture.dumps import write_dump

    ref, _, _ = field_target
    short = {k: v[:T - 4] if k != "id" else 2 for k, v in trtllm_record(ref, {1, 3, 5}).items()}
    short["hidden_state"] = short["hidden_state"].half()
    f = tmp_path / "trt.pt"
    torch.save([trtllm_record(ref, {1, 3, 5}), short], f)
    r = info(f)
    assert (r["tokens"], r["hidden_size"], r["dtype"]) == (T, 64, "float32")  # the first record's, as its captures
    assert all(c["shape"] == [T, 64] for c in r["captures"])
    assert [x["tokens"] for x in r["records"]] == [T, T - 4]
    assert any("first record's" in n and f"{2 * T - 4} in all" in n for n in r["notes"])
    assert any("id 2 (float16,float32, hidden 64)" in n for n in r["notes"])
    assert f"2 record(s); the first: {T} tokens" in run("dump-info", f).stdout
    d = info(write_dump(tmp_path / "d.safetensors", [("last", FINAL_NORM, ref.states[FINAL_NORM])],
                        input_ids=ref.input_ids, num_layers=L))
    assert d["tokens"] == d["records"][0]["tokens"] == T == d["captures"][0]["shape"][0]
    schema = json.loads(run("schema", "--output", "dump-info").stdout)
    assert "first record" in json.dumps(schema["properties"]["tokens"])


def test_export_into_a_file_or_an_unwritable_place_is_one_line_exit_2(tmp_path, field_target):
    ref, _, spec = field_target
    f = write_modelopt_vllm(tmp_path / "c1.pt", ref, [2, 4, 6])
    slots = ["--slots", "modelopt-vllm:2,4,6"]
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = run("export", f, "--spec", spec, "--layout", "speculators", "-o", blocker / "out", *slots, code=2)
    one_line_refusal(res, "cannot create a folder")
    assert blocker.read_text() == "" and sorted(p.name for p in tmp_path.iterdir()) == ["c1.pt", "file"]


def test_export_into_an_existing_folder_on_another_disk_and_again_with_fewer_files(tmp_path, field_target):
    """An existing output folder (here a symlink to tmpfs, another filesystem where Linux has one)
    gets the files by renames inside it; exporting again with fewer units leaves no file of the first
    export behind; a folder holding files no export wrote is refused before anything is written."""
    import tempfile

    ref, _, spec = field_target
    d = tmp_path / "trt"
    d.mkdir()
    for i in range(3):
        write_trtllm(d / f"data_{i}.pt", ref, {1, 3, 5})
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    with tempfile.TemporaryDirectory(dir=shm) as other:
        link = tmp_path / "link"
        link.symlink_to(other)
        slots = ["--slots", "trtllm:1,3,5"]
        run("export", d, "--spec", spec, "--layout", "specforge", "-o", link, *slots)
        assert sorted(os.listdir(other)) == ["data_0.ckpt", "data_1.ckpt", "data_2.ckpt", "surgeon-export.json"]
        (d / "data_2.pt").unlink()
        run("export", d, "--spec", spec, "--layout", "specforge", "-o", link, *slots)
        assert sorted(os.listdir(other)) == ["data_0.ckpt", "data_1.ckpt", "surgeon-export.json"]
        assert [e["file"] for e in manifest(link)["files"]] == ["data_0.ckpt", "data_1.ckpt"]
        (Path(other) / "notes.txt").write_text("mine")
        res = run("export", d, "--spec", spec, "--layout", "specforge", "-o", link, *slots, code=2)
        one_line_refusal(res, "notes.txt", "no surgeon export wrote")
        assert sorted(os.listdir(other)) == ["data_0.ckpt", "data_1.ckpt", "notes.txt", "surgeon-export.json"]


def test_trtllm_default_for_one_layer_is_refused_as_it_differs_by_version(tmp_path, field_target):
    ref, _, _ = field_target
    f = write_trtllm(tmp_path / "trt.pt", ref, {1, 3, 5})
    one = tmp_path / "one.yaml"
    one.write_text("spec: 1\nname: one\ntarget: {architecture: LlamaForCausalLM, num_layers: 1, hidden_size: 64}\n"
                   "captures: {a: 'layer_out[0]', last: final_norm}\ndraft: {kind: eagle3, fc_input: [a], fc_in_features: 64}\n")
    res = run("dump-info", f, "--slots", "trtllm:default", "--spec", one, code=2)
    one_line_refusal(res, "trt.pt", "trtllm:default", "1-layer", "differs between TensorRT-LLM versions")
