"""The wiring harness end to end through the CLI: readers of every layout, token alignment,
match / verify / fingerprint, the heatmap, the pytest plugin, and the case that started the project
on a real (tiny, random) HF DeepSeek-V3-style model."""

import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from surgeon.core.points import EMBED, FINAL_NORM, layer_out
from surgeon.run.tinymodels import make_tiny_model
from surgeon.verify.reference import capture_reference, save_reference
from surgeon.verify.subjects import read_subject
from tests.conftest import cli_run as run

IDS = list(range(3, 35))


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """A 61-layer DeepSeek-V3-style model (the Kimi-K2.5 family), tiny and random, and its reference."""
    d = tmp_path_factory.mktemp("kimi")
    model = make_tiny_model("deepseek_v3", d / "model", num_layers=61, seed=1)
    ref = capture_reference(model, IDS)
    ref_file = d / "ref.safetensors"
    save_reference(ref, ref_file)
    return model, ref, ref_file


def kimi_spec(tmp_path, points, name="kimi.yaml"):
    f = tmp_path / name
    a, b, c, d = points
    f.write_text(textwrap.dedent(f"""\
        spec: 1
        name: kimi-scaled
        target: {{architecture: DeepseekV3ForCausalLM, num_layers: 61, hidden_size: 64}}
        captures: {{a: '{a}', b: '{b}', c: '{c}', d: '{d}'}}
        draft: {{kind: eagle3, fc_input: [a, b, c], fc_in_features: 192}}
        dumps: {{slots: [a, b, c, d]}}
        """))
    return f


def specforge_dump(path, ref, aux_points, hidden_point, dtype=torch.bfloat16):
    aux = torch.cat([ref.states[p] for p in aux_points], dim=-1)[None].to(dtype)
    torch.save({"input_ids": ref.input_ids[None], "loss_mask": torch.ones(1, len(IDS)),
                "aux_hidden_state": aux, "hidden_state": ref.states[hidden_point][None].to(dtype)}, path)
    return path


# -- the case that started the project ------------------------------------------------------------
def test_the_kimi_case_is_named_and_corrected(tmp_path, kimi):
    model, ref, ref_file = kimi
    dump = specforge_dump(tmp_path / "sample0.ckpt", ref, [layer_out(2), layer_out(30), layer_out(58)], FINAL_NORM)
    wrong = kimi_spec(tmp_path, ["embed", "layer_out[2]", "layer_out[30]", "final_norm"], "wrong.yaml")
    r = json.loads(run("verify", wrong, "--subject", dump, "--reference", ref_file, "--json", code=3).stdout)
    got = {s["name"]: (s["declared"], s["matched"], s["verdict"]) for s in r["slots"]}
    assert got == {"a": ("embed", "layer_out[2]", "mismatch"), "b": ("layer_out[2]", "layer_out[30]", "mismatch"),
                   "c": ("layer_out[30]", "layer_out[58]", "mismatch"), "d": ("final_norm", "final_norm", "ok")}
    assert [d["kind"] for d in r["diagnosis"]] == ["labels_shifted"]  # one explanation covers a, b and c
    assert r["suggested"]["captures"] == {"a": "layer_out[2]", "b": "layer_out[30]", "c": "layer_out[58]", "d": "final_norm"}
    assert r["suggested"]["engine_ids"]["vllm"] == [3, 31, 59]
    assert r["suggested"]["engine_ids"]["sglang"] == [3, 31, 59]  # from the installed deepseek_v2.py probe

    right = kimi_spec(tmp_path, ["layer_out[2]", "layer_out[30]", "layer_out[58]", "final_norm"], "right.yaml")
    out = run("verify", right, "--subject", dump, "--reference", ref_file).output
    assert "wiring verified" in out


def test_the_hf_reference_runs_on_the_subjects_input_ids(tmp_path, kimi):
    model, ref, _ = kimi
    dump = specforge_dump(tmp_path / "s.ckpt", ref, [layer_out(2), layer_out(30), layer_out(58)], FINAL_NORM, dtype=torch.float32)
    right = kimi_spec(tmp_path, ["layer_out[2]", "layer_out[30]", "layer_out[58]", "final_norm"])
    run("verify", right, "--subject", dump, "--reference", f"hf:{model}")


def test_fingerprint_reference_and_heatmap(tmp_path, kimi):
    _, ref, ref_file = kimi
    fp = tmp_path / "kimi.fp.safetensors"
    run("fingerprint", ref_file, "-o", fp)
    assert fp.stat().st_size < ref_file.stat().st_size / 4
    dump = specforge_dump(tmp_path / "s.ckpt", ref, [layer_out(2), layer_out(30), layer_out(58)], FINAL_NORM)
    png = tmp_path / "heat.png"
    r = json.loads(run("match", dump, "--reference", fp, "--json", "--plot", png).stdout)
    assert [s["matched"] for s in r["slots"]] == ["layer_out[2]", "layer_out[30]", "layer_out[58]", "final_norm"]
    assert [s["verdict"] for s in r["slots"]] == ["unlabelled"] * 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- readers -------------------------------------------------------------------------------------------
def test_a_connector_stack_declares_nothing_it_does_not_record(tmp_path, kimi):
    """hidden_states [T, n, H] + token_ids: vLLM's hidden-state connector and speculators' files.
    Neither records the ids, so no slot is declared (the last is whatever the last id named);
    --slots vllm:IDS labels them by vLLM's ids, ascending, as the connector stacks them."""
    _, ref, ref_file = kimi
    points = (layer_out(1), layer_out(29), layer_out(57), layer_out(60))
    hs = torch.stack([ref.states[p] for p in points], dim=1)
    f = tmp_path / "hs_0.safetensors"
    save_file({"token_ids": ref.input_ids, "hidden_states": hs.contiguous()}, str(f))
    s = read_subject(f, num_layers=61)
    assert s.layout == "vllm-connector" and [d for _, d, _ in s.slots] == [None] * 4
    r = json.loads(run("match", f, "--reference", ref_file, "--json").stdout)
    assert [x["matched"] for x in r["slots"]] == [str(p) for p in points] and r["verdict"] == "identified"
    spec = kimi_spec(tmp_path, ["layer_out[0]", "layer_out[29]", "layer_out[57]", "layer_out[60]"])
    r = json.loads(run("verify", spec, "--subject", f, "--reference", ref_file, "--json", code=3).stdout)
    assert [x["verdict"] for x in r["slots"]] == ["mismatch", "ok", "ok", "ok"]  # the spec, in the stack's order
    r = json.loads(run("verify", spec, "--subject", f, "--reference", ref_file, "--slots", "vllm:2,30,58,61",
                       "--json", code=3).stdout)  # the ids vLLM was given label the slots: id j = layer_out[j-1]
    assert [x["declared"] for x in r["slots"]] == [str(p) for p in points]
    assert [x["verdict"] for x in r["slots"]] == ["ok"] * 4 and r["missing"] == ["a: layer_out[0]"]
    r = json.loads(run("match", f, "--reference", ref_file, "--spec", spec, "--slots", "vllm:61,2,30,58",
                       "--json", code=3).stdout)
    assert [x["verdict"] for x in r["slots"]] == ["ok"] * 4  # the connector stacks ascending ids
    run("match", f, "--reference", ref_file, "--spec", spec, "--slots", "vllm:2,30,58", code=2)
    run("match", f, "--reference", ref_file, "--spec", spec, "--slots", "vllm:2,30,58,62", code=2)
    run("match", f, "--reference", ref_file, "--slots", "trtllm:1,2,3", code=2)


def test_plain_files_with_slots(tmp_path, kimi):
    _, ref, ref_file = kimi
    lst = tmp_path / "list.pt"
    torch.save([ref.states[EMBED], ref.states[layer_out(4)]], lst)
    r = json.loads(run("match", lst, "--reference", ref_file, "--slots", "x=embed,y=layer_out[5]",
                       "--input-ids", ",".join(map(str, IDS)), "--json", code=3).stdout)
    assert [(s["name"], s["verdict"]) for s in r["slots"]] == [("x", "ok"), ("y", "mismatch")]
    stacked = tmp_path / "stack.safetensors"
    save_file({"h": torch.stack([ref.states[layer_out(7)], ref.states[FINAL_NORM]]), "input_ids": ref.input_ids}, str(stacked))
    r = json.loads(run("match", stacked, "--reference", ref_file, "--slots", "p,q", "--json").stdout)
    assert [s["matched"] for s in r["slots"]] == ["layer_out[7]", "final_norm"]
    run("match", stacked, "--reference", ref_file, code=2)  # a stack needs --slots


def test_token_alignment_by_window(tmp_path, kimi):
    _, ref, ref_file = kimi
    d = {"input_ids": ref.input_ids[5:20], "a": ref.states[layer_out(10)][5:20]}
    f = tmp_path / "w.pt"
    torch.save(d, f)
    r = json.loads(run("match", f, "--reference", ref_file, "--json").stdout)
    assert r["slots"][0]["matched"] == "layer_out[10]" and "5..19" in r["alignment"]
    torch.save({"input_ids": torch.tensor([999] * 15), "a": d["a"]}, f)
    assert "do not appear" in run("match", f, "--reference", ref_file, code=2).stderr


@pytest.mark.parametrize("content, needle", [
    (b"not a tensor file", "not a readable safetensors"),
    (b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93.", "weights_only"),
])
def test_bad_subject_files(tmp_path, kimi, content, needle):
    f = tmp_path / "bad.pt"
    f.write_bytes(content)
    assert needle in run("match", f, "--reference", kimi[2], code=2).stderr


def test_bad_references(tmp_path, kimi):
    f = tmp_path / "s.pt"
    torch.save([kimi[1].states[EMBED]], f)
    assert "no such file" in run("match", f, "--reference", tmp_path / "nope", code=2).stderr
    assert "needs input ids" in run("match", f, "--reference", f"hf:{kimi[0]}", code=2).stderr


# -- the pytest plugin ----------------------------------------------------------------------------------
def test_pytest_plugin_in_one_line(pytester, kimi):
    _, ref, ref_file = kimi
    specforge_dump(pytester.path / "sample.ckpt", ref, [layer_out(2), layer_out(30), layer_out(58)], FINAL_NORM)
    kimi_spec(pytester.path, ["layer_out[2]", "layer_out[30]", "layer_out[58]", "final_norm"], "right.yaml")
    kimi_spec(pytester.path, ["embed", "layer_out[2]", "layer_out[30]", "final_norm"], "wrong.yaml")
    pytester.makepyfile(test_wiring=f"""
        import pytest

        def test_right(surgeon_verify):
            surgeon_verify("right.yaml", subject="sample.ckpt", reference="{ref_file}")

        @pytest.mark.surgeon_wiring("wrong.yaml", subject="sample.ckpt", reference="{ref_file}")
        def test_wrong(surgeon_verify):
            surgeon_verify()
    """)
    res = pytester.runpytest()
    res.assert_outcomes(passed=1, failed=1)
    res.stdout.fnmatch_lines(["*a: declared embed, is layer_out?2? *"])  # [2] would be a character class


@pytest.mark.slow
def test_pytest_plugin_readme_example_from_a_tests_folder(pytester, kimi):
    """The README's one line, in a project's tests/ folder: relative paths are the rootdir's (where
    pyproject.toml is), an absolute one is taken as given, and a failure is one message."""
    _, ref, ref_file = kimi
    (pytester.path / "specs").mkdir()
    (pytester.path / "dumps").mkdir()
    (pytester.path / "tests").mkdir()
    pytester.makepyprojecttoml("[tool.pytest.ini_options]\n")
    specforge_dump(pytester.path / "dumps" / "sample0.ckpt", ref, [layer_out(2), layer_out(30), layer_out(58)], FINAL_NORM)
    (pytester.path / "specs" / "my-draft.fp.safetensors").write_bytes(Path(ref_file).read_bytes())
    kimi_spec(pytester.path / "specs", ["layer_out[2]", "layer_out[30]", "layer_out[58]", "final_norm"], "my-draft.yaml")
    kimi_spec(pytester.path / "specs", ["embed", "layer_out[2]", "layer_out[30]", "final_norm"], "wrong.yaml")
    (pytester.path / "specs" / "broken.yaml").write_text("spec: 1\nname: x\ntarget: {architecture: A, num_layers: 0}\n")
    wrong = pytester.path / "specs" / "wrong.yaml"  # an absolute path is taken as given
    (pytester.path / "tests" / "test_wiring.py").write_text(textwrap.dedent(f"""\
        def test_wiring(surgeon_verify):
            surgeon_verify("specs/my-draft.yaml", subject="dumps/sample0.ckpt", reference="specs/my-draft.fp.safetensors")

        def test_wrong(surgeon_verify):
            surgeon_verify("{wrong}", subject="dumps/sample0.ckpt", reference="{ref_file}")

        def test_broken(surgeon_verify):
            surgeon_verify("specs/broken.yaml", subject="dumps/sample0.ckpt", reference="specs/my-draft.fp.safetensors")
        """))
    res = pytester.runpytest("tests")
    res.assert_outcomes(passed=1, failed=2)
    out = res.stdout.str()
    res.stdout.fnmatch_lines(["*WiringError: wiring of *sample0.ckpt differs from the spec: mismatch: *",
                              "*a: declared embed, is layer_out?2? *"])
    res.stdout.fnmatch_lines([f"surgeon_verify: {pytester.path / 'specs' / 'broken.yaml'}:1:1: missing required key 'captures'"])
    assert "SpecError" not in out and "Traceback" not in out and "another exception occurred" not in out
    assert "pytest_plugin.py" not in out and "surgeon/core/spec.py" not in out  # no frame of surgeon's own


# -- surgeon dumps and sweeps -----------------------------------------------------------------------------
def test_dump_round_trip_info_and_match(tmp_path, kimi):
    from surgeon.capture.dumps import read_dump, write_dump
    from surgeon.core.spec import load_spec

    _, ref, ref_file = kimi
    spec = load_spec(kimi_spec(tmp_path, ["layer_out[2]", "layer_out[30]", "layer_out[58]", "final_norm"]))
    caps = [(n, spec.captures[n], ref.states[spec.captures[n]].bfloat16()) for n in spec.dump_slots]
    f = write_dump(tmp_path / "d.safetensors", caps, input_ids=ref.input_ids, num_layers=61, spec=spec,
                   engine="hf", engine_version="5", model="tiny")
    d = read_dump(f)
    assert [(n, str(p)) for n, p, _ in d.captures] == [
        ("a", "layer_out[2]"), ("b", "layer_out[30]"), ("c", "layer_out[58]"), ("d", "final_norm")
    ]
    assert all(torch.equal(t, c[2]) for (_, _, t), c in zip(d.captures, caps))
    assert d.meta["spec.sha256"] == spec.sha256 and d.meta["tokens"] == str(len(IDS))
    info = json.loads(run("dump-info", f, "--json").stdout)
    assert info["captures"][1] == {"name": "b", "point": "layer_out[30]", "shape": [len(IDS), 64], "dtype": "bfloat16"}
    r = json.loads(run("match", f, "--reference", ref_file, "--json").stdout)
    assert [s["verdict"] for s in r["slots"]] == ["ok"] * 4  # the dump declares its own points


def test_a_sweep_dump_is_a_reference(tmp_path, kimi):
    from surgeon.capture.dumps import write_dump
    from surgeon.core.spec import load_spec

    _, ref, _ = kimi
    sweep = tmp_path / "sweep.yaml"
    run("sweep-spec", "--name", "kimi-sweep", "--architecture", "DeepseekV3ForCausalLM", "--num-layers", 61,
        "--hidden-size", 64, "-o", sweep)
    run("sweep-spec", "--name", "kimi-sweep", "--architecture", "X", "--num-layers", 61, "--hidden-size", 64, "-o", sweep, code=2)
    s = load_spec(sweep)
    assert len(s.captures) == 63
    caps = [(n, p, ref.states[p]) for n, p in s.captures.items()]
    engine_ref = write_dump(tmp_path / "sweep.safetensors", caps, input_ids=ref.input_ids, num_layers=61, spec=s, engine="vllm")
    dump = specforge_dump(tmp_path / "x.ckpt", ref, [layer_out(2), layer_out(30), layer_out(58)], FINAL_NORM)
    r = json.loads(run("match", dump, "--reference", engine_ref, "--json").stdout)
    assert [x["matched"] for x in r["slots"]] == ["layer_out[2]", "layer_out[30]", "layer_out[58]", "final_norm"]


def test_sweep_spec_refuses_hostile_names():
    res = run("sweep-spec", "--name", "x\ncaptures: {}", "--architecture", "A", "--num-layers", 2, "--hidden-size", 8, code=2)
    assert "spec name" in res.stderr


def _with_header_start(write, start: bytes, pads) -> Path:
    """The first file ``write(pad)`` writes whose bytes begin with ``start``."""
    for pad in pads:
        f = write(pad)
        if f.read_bytes().startswith(start):
            return f
        f.unlink()
    pytest.fail(f"no header starting with {start!r}")


# 80 03: a protocol-3 pickle's magic (header 0x380 bytes); PK: a zip's (header 0x4b50 bytes)
@pytest.mark.parametrize("magic,near", [(b"\x80\x03", 0x380), (b"PK", 0x4B50)])
def test_a_safetensors_header_that_starts_like_a_pickle_is_still_read_as_safetensors(tmp_path, magic, near):
    """The first byte of a safetensors file is the low byte of its header length: a dump whose header
    is 0x380 bytes starts with ``80 03``, a protocol-3 pickle's magic. Found by the demo on a fresh
    clone (the work folder's path, in the dump's metadata, set the length): the dump was read as a
    plain file, slots in alphabetical order, and the spec's right wiring failed verify."""
    from surgeon.capture.dumps import write_dump

    H, T = 8, 3
    caps = [(name, layer_out(i), torch.full((T, H), float(i))) for i, name in enumerate(["low", "mid", "high", "last"])]
    ids = torch.arange(T)

    def dump(pad: int) -> Path:  # the model name's length moves the header length
        return write_dump(tmp_path / f"d{pad}.safetensors", caps, input_ids=ids, num_layers=4, model="m" * pad)

    base = int.from_bytes(dump(0).read_bytes()[:8], "little")
    f = _with_header_start(dump, magic, range(max(0, near - base - 16), near - base + 16))
    s = read_subject(f)
    assert s.layout == "surgeon"
    assert [(n, str(p)) for n, p, _ in s.slots] == [(n, f"layer_out[{i}]") for i, (n, _, _) in enumerate(caps)]
    assert all(torch.equal(t, c[2]) for (_, _, t), c in zip(s.slots, caps))

    def plain(pad: int) -> Path:  # a plain safetensors file with such a header: safetensors too
        g = tmp_path / f"plain{pad}.safetensors"
        save_file({"a": torch.zeros(T, H)}, str(g), metadata={"pad": "x" * pad})
        return g

    base = int.from_bytes(plain(0).read_bytes()[:8], "little")
    g = _with_header_start(plain, magic, range(max(0, near - base - 16), near - base + 16))
    assert read_subject(g, slots=["a=embed"]).layout == "plain"
