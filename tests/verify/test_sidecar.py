"""The capture sidecar (issue 35, item 2): the files a native route writes are labelled from the
record ``surgeon plan`` puts beside them, by match, verify, audit and export alike, with no flag;
``--slots sglang:ALGO:IDS`` labels a stack by the installed SGLang class's setter for the algorithm.

The connector-shaped files are made here with safetensors (a file format, not engine code) from
the states of a real tiny HF model, and checked against surgeon's own reference of that model."""

import json
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from surgeon.capture.sidecar import SIDECAR, CaptureSidecar, find_sidecar, read_sidecar, write_sidecar
from surgeon.core.errors import BadInput
from surgeon.core.points import layer_out
from surgeon.core.spec import load_spec
from surgeon.verify.subjects import read_subject
from tests.conftest import FIELD_LAYERS
from tests.conftest import cli_run as run

L = FIELD_LAYERS
POINTS = (layer_out(1), layer_out(3), layer_out(5), layer_out(7))  # vLLM ids 2, 4, 6, 8: ascending
NAMES = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def llama(field_target, tmp_path_factory):
    """The tiny random Llama's reference (surgeon's own HF path, tests/conftest.py) and a spec of
    what vLLM's native route can capture of it (no final norm)."""
    ref, ref_file, _ = field_target
    spec = tmp_path_factory.mktemp("native") / "llama.yaml"
    spec.write_text(textwrap.dedent(f"""\
        spec: 1
        name: tiny-llama-native
        target: {{architecture: LlamaForCausalLM, num_layers: {L}, hidden_size: 64}}
        captures: {{a: 'layer_out[1]', b: 'layer_out[3]', c: 'layer_out[5]', d: 'layer_out[7]'}}
        draft: {{kind: eagle3, fc_input: [a, b, c], fc_in_features: 192}}
        dumps: {{slots: [a, b, c, d]}}
        """))
    return ref, ref_file, spec


def sidecar(points=POINTS, names=NAMES, **kw) -> CaptureSidecar:
    base = CaptureSidecar("tiny-llama-native", "vllm", "0.32.0", "native", "extract_hidden_states", "LlamaForCausalLM",
                          L, tuple(p.position for p in points), tuple(map(str, points)), tuple(names))
    return replace(base, **kw)


def route_dir(d: Path, ref, points=POINTS, side: CaptureSidecar | None = None, files=1) -> Path:
    """What the connector writes: ``{request}.safetensors`` with hidden_states [T, n, H] and token_ids
    [T], plus the sidecar plan writes (``side``; the right one by default)."""
    d.mkdir(parents=True, exist_ok=True)
    hs = torch.stack([ref.states[p] for p in points], dim=1).contiguous()
    for i in range(files):
        save_file({"hidden_states": hs, "token_ids": ref.input_ids}, str(d / f"req-{i}.safetensors"))
    write_sidecar(d, side or sidecar())
    return d


def slots_of(r: dict) -> list[tuple]:
    return [(s["name"], s["declared"], s["matched"], s["verdict"]) for s in r["slots"]]


# -- the file itself ------------------------------------------------------------------------------------
def test_write_is_atomic_idempotent_and_refuses_another_sidecar(tmp_path):
    one = sidecar()
    path = write_sidecar(tmp_path, one)
    before = path.read_bytes()
    assert write_sidecar(tmp_path, one) == path and path.read_bytes() == before  # the same one: nothing changes
    assert read_sidecar(path) == one and find_sidecar(tmp_path / "req-0.safetensors") == one
    assert json.loads(before)["surgeon.kind"] == "capture-sidecar"
    other = sidecar(release="0.33.0")
    with pytest.raises(BadInput, match=r"already holds another capture sidecar \(.*0\.32\.0.*\), not this one \(.*0\.33\.0"):
        write_sidecar(tmp_path, other)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [SIDECAR]  # no temporary file left
    with pytest.raises(BadInput, match="layer_out\\[9\\]"):  # what is written must read back
        write_sidecar(tmp_path / "x", sidecar(points=(layer_out(9),), names=("a",)))


@pytest.mark.parametrize("text, where, what", [
    ('{"surgeon.kind": "capture-sidecar",\n  "spec": 3', "2:12", "Expecting ','"),
    (None, None, "'num_layers' is not an integer"),
    (None, None, "unknown key 'extra'"),
    (None, None, "point 'layer_out[8]'"),
])
def test_a_malformed_sidecar_is_one_line_with_its_place(tmp_path, text, where, what):
    good = json.loads(write_sidecar(tmp_path / "g", sidecar()).read_text())
    if text is None:
        if "num_layers" in what:
            good["num_layers"] = "6"
        elif "extra" in what:
            good["extra"] = 1
        else:
            good["points"][3] = "layer_out[8]"
        text = json.dumps(good, indent=2)
        key = "num_layers" if "num_layers" in what else "extra" if "extra" in what else "points"
        line = next(i for i, ln in enumerate(text.splitlines(), 1) if f'"{key}"' in ln)
        where = f"{line}:3"
    (tmp_path / SIDECAR).write_text(text)
    with pytest.raises(BadInput) as e:
        read_sidecar(tmp_path / SIDECAR)
    assert str(e.value).startswith(f"{tmp_path / SIDECAR}:{where}: ") and what in str(e.value)
    assert "\n" not in str(e.value)


# -- match and verify, no flags -----------------------------------------------------------------------
def test_verify_and_match_label_each_slot_from_the_sidecar(tmp_path, llama):
    ref, ref_file, spec = llama
    f = route_dir(tmp_path / "out", ref) / "req-0.safetensors"
    r = json.loads(run("verify", spec, "--subject", f, "--reference", ref_file, "--json").stdout)
    assert slots_of(r) == [(n, str(p), str(p), "ok") for n, p in zip(NAMES, POINTS)]
    assert any(SIDECAR in n and "extract_hidden_states" in n for n in r["notes"])
    r = json.loads(run("match", f, "--reference", ref_file, "--json").stdout)  # no spec: the sidecar alone
    assert slots_of(r) == [(n, str(p), str(p), "ok") for n, p in zip(NAMES, POINTS)]
    sub = read_subject(f)
    assert sub.names == list(NAMES) and [d for _, d, _ in sub.slots] == list(POINTS)


def test_a_sidecar_with_swapped_points_makes_verify_name_each_true_layer(tmp_path, llama):
    ref, ref_file, spec = llama
    swapped = (POINTS[1], POINTS[0], POINTS[2], POINTS[3])
    f = route_dir(tmp_path / "out", ref, side=sidecar(points=swapped)) / "req-0.safetensors"
    r = json.loads(run("match", f, "--reference", ref_file, "--json", code=3).stdout)
    assert slots_of(r)[:2] == [("a", "layer_out[3]", "layer_out[1]", "mismatch"),
                               ("b", "layer_out[1]", "layer_out[3]", "mismatch")]
    assert [s["verdict"] for s in r["slots"][2:]] == ["ok", "ok"]
    r = json.loads(run("verify", spec, "--subject", f, "--reference", ref_file, "--json", code=3).stdout)
    matched = {s["matched"] for s in r["slots"] if s["verdict"] == "mismatch"}
    assert matched == {"layer_out[1]", "layer_out[3]"}


def test_a_sidecar_that_does_not_describe_the_file_is_refused(tmp_path, llama):
    ref, ref_file, spec = llama
    three = route_dir(tmp_path / "rows", ref, side=sidecar(points=POINTS[:3], names=NAMES[:3])) / "req-0.safetensors"
    res = run("verify", spec, "--subject", three, "--reference", ref_file, code=2)
    assert f"{three.parent / SIDECAR}: records 3 rows" in res.output and str(three) in res.output
    deep = sidecar(num_layers=61, model_class="DeepseekV3ForCausalLM")
    other = route_dir(tmp_path / "layers", ref, side=deep) / "req-0.safetensors"
    res = run("verify", spec, "--subject", other, "--reference", ref_file, code=2)
    assert "records a 61-layer target" in res.output and "the spec's has 8" in res.output
    bad = route_dir(tmp_path / "json", ref)
    (bad / SIDECAR).write_text('{"surgeon.kind": "capture-sidecar", "spec": }')
    res = run("match", bad / "req-0.safetensors", "--reference", ref_file, code=2)
    col = len('{"surgeon.kind": "capture-sidecar", "spec": ') + 1  # where the value is missing
    assert f"{bad / SIDECAR}:1:{col}: invalid JSON" in res.output and len(res.output.strip().splitlines()) == 1
    out = tmp_path / "export"
    run("export", bad, "--spec", spec, "--layout", "speculators", "-o", out, code=2)
    assert not out.exists()  # nothing written


def test_slots_given_with_a_sidecar_must_agree_with_it(tmp_path, llama):
    ref, ref_file, spec = llama
    f = route_dir(tmp_path / "out", ref) / "req-0.safetensors"
    run("verify", spec, "--subject", f, "--reference", ref_file, "--slots", "vllm:2,4,6,8")  # the ids handed: agrees
    run("match", f, "--reference", ref_file, "--slots", "a,b,c,d")
    res = run("verify", spec, "--subject", f, "--reference", ref_file, "--slots", "vllm:2,4,6,7", code=2)
    assert "--slots vllm:2,4,6,7 labels its rows" in res.output and SIDECAR in res.output
    res = run("match", f, "--reference", ref_file, "--slots", "a,b=layer_out[5],c,d", code=2)
    assert "row 1 as b=layer_out[5]" in res.output and "b=layer_out[3]" in res.output


# -- export and audit, no flags -------------------------------------------------------------------------
def test_export_reads_a_route_directory_by_its_sidecar(tmp_path, llama):
    ref, _, spec = llama
    d = route_dir(tmp_path / "out", ref, files=2)
    out = tmp_path / "spec"
    run("export", d, "--spec", spec, "--layout", "speculators", "-o", out)
    manifest = json.loads((out / "surgeon-export.json").read_text())
    assert [f["source"] for f in manifest["files"]] == [str(d / "req-0.safetensors"), str(d / "req-1.safetensors")]
    from safetensors.torch import load_file
    got = load_file(str(out / manifest["files"][0]["file"]))
    want = torch.stack([ref.states[p] for p in POINTS], dim=1)  # fc ascending, then layer_out[L-1]: as captured
    assert torch.equal(got["hidden_states"], want) and torch.equal(got["token_ids"], ref.input_ids)
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file({"hidden_states": want.contiguous(), "token_ids": ref.input_ids}, str(bare / "req-0.safetensors"))
    res = run("export", bare / "req-0.safetensors", "--spec", spec, "--layout", "speculators", "-o", tmp_path / "o2",
              code=2)
    assert "does not record which points its rows hold" in res.output


def test_audit_declares_the_rows_from_the_sidecar(tmp_path, llama):
    ref, ref_file, spec = llama
    order = (POINTS[3], POINTS[0], POINTS[1], POINTS[2])  # a stack ordered unlike the spec's ascending depth
    names = ("d", "a", "b", "c")
    d = route_dir(tmp_path / "out", ref, points=order, side=sidecar(points=order, names=names))
    r = json.loads(run("audit", d, "--spec", spec, "--structure-only", "--json").stdout)
    assert r["verdict"] == "ok"  # named by the spec's ascending depth instead, row 0 (layer_out[5]) would be "a"
    assert [(s["name"], s["declared"]) for s in r["slots"]] == [(n, str(p)) for n, p in zip(names, order)]
    r = json.loads(run("audit", d, "--spec", spec, "--reference", ref_file, "--workers", "1", "--json").stdout)
    assert {s["name"]: (s["declared"], s["identity"], s["verdicts"]["ok"]) for s in r["slots"]} == {
        n: (str(p), {str(p): 1}, 1) for n, p in zip(names, order)}  # the values: each row is the sidecar's point
    wrong = route_dir(tmp_path / "wrong", ref, side=sidecar(points=(POINTS[1], POINTS[0], POINTS[2], POINTS[3])))
    r = json.loads(run("audit", wrong, "--spec", spec, "--structure-only", "--json", code=3).stdout)
    details = [x["detail"] for o in r["outliers"] for x in o["findings"]]
    assert "slot a is layer_out[3] in its capture sidecar, the spec declares layer_out[1]" in details
    short = route_dir(tmp_path / "short", ref, side=sidecar(points=POINTS[:3], names=NAMES[:3]))
    r = json.loads(run("audit", short, "--spec", spec, "--structure-only", "--json", code=3).stdout)
    [finding] = [x for o in r["outliers"] for x in o["findings"]]
    assert finding["kind"] == "unreadable" and "records 3 rows" in finding["detail"]


# -- --slots sglang:ALGO:IDS on the installed SGLang ---------------------------------------------------
def deepseek(tmp_path):
    """The 61-layer DeepSeek-V3-style spec of the harness tests (the Kimi-K2.5 family)."""
    from tests.verify.test_harness import kimi_spec

    return load_spec(kimi_spec(tmp_path, ["layer_out[2]", "layer_out[30]", "layer_out[58]", "layer_out[60]"]))


def stack(tmp_path, n) -> Path:
    f = tmp_path / "aux.safetensors"
    save_file({"hidden_states": torch.randn(4, n, 64), "token_ids": torch.arange(4)}, str(f))
    return f


def test_sglang_deepseek_v2_same_ids_different_layers_under_eagle3_and_dflash(tmp_path):
    """deepseek_v2.py: EAGLE3's setter adds 1 only when the first id is 1, DFlash's always."""
    spec, f = deepseek(tmp_path), stack(tmp_path, 3)
    eagle = read_subject(f, slots=["sglang:EAGLE3:2,30,58"], spec=spec)
    dflash = read_subject(f, slots=["sglang:dflash:58,2,30"], spec=spec)
    assert [d for _, d, _ in eagle.slots] == [layer_out(1), layer_out(29), layer_out(57)]
    assert [d for _, d, _ in dflash.slots] == [layer_out(2), layer_out(30), layer_out(58)]  # ascending, as emitted
    assert "srt/models/deepseek_v2.py" in eagle.notes[-1] and "ascending layer order" in eagle.notes[-1]
    assert "set_dflash_layers_to_capture" in dflash.notes[-1] and "spec_aux_hidden_state.py" in dflash.notes[-1]


def test_sglang_llama_eagle3_labels_and_verifies(tmp_path, llama):
    ref, ref_file, spec = llama
    f = tmp_path / "sg.safetensors"
    hs = torch.stack([ref.states[layer_out(k)] for k in (1, 3, 5)], dim=1).contiguous()
    save_file({"hidden_states": hs, "token_ids": ref.input_ids}, str(f))
    r = json.loads(run("verify", spec, "--subject", f, "--reference", ref_file, "--slots", "sglang:eagle3:5,1,3",
                       "--json", code=3).stdout)  # id k = layer_out[k] on llama.py; d (layer_out[7]) is not there
    assert [(s["declared"], s["verdict"]) for s in r["slots"]] == [(f"layer_out[{k}]", "ok") for k in (1, 3, 5)]
    assert r["missing"] == ["d: layer_out[7]"]


def test_sglang_refuses_what_it_does_not_read(tmp_path):
    spec, f = deepseek(tmp_path), stack(tmp_path, 3)
    with pytest.raises(BadInput, match=r"set_dspark_layers_to_capture.*attention_backend_setup\.py:\d+"):
        read_subject(f, slots=["sglang:DSPARK:2,30,58"], spec=spec)
    with pytest.raises(BadInput, match="ALGO one of EAGLE3, DFLASH, DSPARK"):
        read_subject(f, slots=["sglang:MEDUSA:2,30,58"], spec=spec)
    with pytest.raises(BadInput, match="needs the target"):
        read_subject(f, slots=["sglang:EAGLE3:2,30,58"])
    with pytest.raises(BadInput, match="3 slots, but --slots sglang:EAGLE3:2,30 names 2 ids"):
        read_subject(f, slots=["sglang:EAGLE3:2,30"], spec=spec)
