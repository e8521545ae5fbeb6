"""`surgeon upgrade-check` on real engine releases (read, never imported): vLLM 0.33.0 -> 0.34.0 and
SGLang 0.5.14 -> the installed 0.5.23 (the release pairs of issue 34), and SGLang 0.5.5 -> 0.5.14
for a deployed draft that the upgrade serves differently. Each expectation below was hand-read in
the releases' source first (``diff -r`` of the model and runner files); the comments name the
lines on both sides. Classes other helpers are teaching the probe now (vLLM 0.34's MiniMax M3,
DeepSeek V4.1, Transformers backend) and the total count of changes are not asserted.

Hand-read, vLLM 0.33.0 -> 0.34.0:
* model_executor/models/llama.py is byte-identical; qwen3.py (a compute_logits_local method),
  qwen2.py (a sliding-window assert moved into the decoder layer) and deepseek_v2.py (fused shared
  experts per layer) change nothing the capture reads; interfaces.py's EagleModelMixin
  (_maybe_add_hidden_state, the +0 setter, the (2, L//2, L-3) default) is unchanged. So
  LlamaForCausalLM, Qwen3ForCausalLM and DeepseekV3ForCausalLM keep their meaning, and every
  spec in specs/ renders the same ids, served the same.
* The runner: v1/worker/gpu_model_runner.py (model runner V1) is gone in 0.34.0. Its setter call
  (0.33.0 v1/worker/gpu_model_runner.py:5188, GPUModelRunner._setup_eagle3_aux_hidden_state_outputs)
  and its read of eagle_config.eagle_aux_hidden_state_layer_ids (0.33.0 :5219) go with it. Model
  runner V2's call in v1/worker/gpu/spec_decode/eagle/eagle3_utils.py only moved (0.33.0 :40 ->
  0.34.0 :30; reads :119-145 -> :109-135, the same keys): not a change.
* model_executor/models/aria.py (AriaTextModel, 0.33.0 :262) is gone; model_executor/models/ricursive.py
  (RicursiveForCausalLM, 0.34.0 :356, SupportsEagle3) is new.

Hand-read, SGLang 0.5.14 -> 0.5.23:
* srt/models/llama.py LlamaModel.forward: 0.5.14 captures `hidden_states + residual` at the loop's
  entry (:408; residual is None before layer 0, :398), 0.5.23 hands `capture_output` to the decoder
  layer (:487-493, the call at :487), captured at its attention boundary. The setter is unchanged
  (0.5.14 :812-824, 0.5.23 :929-941: +1, default [2, L//2, L-3]).
* Qwen3ForCausalLM: 0.5.14 runs the loop inherited from srt/models/qwen2.py Qwen2Model.forward
  (capture at :370), 0.5.23 its own Qwen3Model.forward in srt/models/qwen3.py (:524-533, capture_output).
* DeepseekV3ForCausalLM: the setter keeps `+1 if ids[0] == 1 else +0` (0.5.14 deepseek_v2.py:2811-2814,
  0.5.23 :3470-3473); the capture site moves (0.5.14 :2502 -> 0.5.23 :3194), and what the layer
  communicator captures is read to the residual stream in 0.5.23 (unverified in 0.5.14).
* GptOssForCausalLM: 0.5.14's setter adds 1 to every id (gpt_oss.py:1285); 0.5.23's keeps ids whose
  max is L and adds 1 otherwise (:1349-1352), and captures index L after the loop (:732-735).
* The runner: 0.5.14's ModelRunner.init_aux_hidden_state_capture (model_runner.py:1009) passes an
  attribute the runner reader does not follow; 0.5.23 reads
  eagle_config["eagle_aux_hidden_state_layer_ids"] (spec_aux_hidden_state.py:192) and hands it on
  (attention_backend_setup.py:61).

Hand-read, SGLang 0.5.5 -> 0.5.14 (the deployed draft served differently): deepseek_v2.py's setter
adds 1 to every id in 0.5.5 (:3834) and only when the first id is 1 in 0.5.14 (:2811-2814). Kimi-K2.5's
draft deployed with 0.5.5's ids [2, 30, 58] (capture indices 3, 31, 59) now captures indices 2, 30,
58: layer_out[1], layer_out[29], layer_out[57]. No spec in specs/ is served differently between
the two pairs of issue 34 (hand-read above), so this third pair is the example.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from surgeon.cli import main
from surgeon.engines.source import releases
from surgeon.engines.source.locate import locate_engine

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ROOT / ".engines"
SPECS = sorted(str(p) for p in (ROOT / "specs").glob("*.yaml"))
KIMI = str(ROOT / "specs" / "kimi-k2.5-eagle3.yaml")
VLLM_33, VLLM_34 = ENGINES / "vllm-0.33.0" / "vllm", ENGINES / "vllm-0.34.0" / "vllm"
SGLANG_55, SGLANG_514 = ENGINES / "sglang-0.5.5" / "sglang", ENGINES / "sglang-0.5.14" / "sglang"


def _need(*roots: Path) -> None:
    missing = [str(r) for r in roots if not r.is_dir()]
    if missing:
        pytest.skip(f"engine releases not fetched (scripts/fetch-engines): {', '.join(missing)}")


def run(*args: object, code: int) -> dict:
    res = CliRunner().invoke(main, ["upgrade-check", *map(str, args), "--json"])
    assert res.exit_code == code, (res.exit_code, res.output)
    data = json.loads(res.stdout)
    schema = json.loads(CliRunner().invoke(main, ["schema", "--output", "upgrade-check"]).stdout)
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(data)]
    assert not errors, errors[:3]
    return data


def changes(data: dict, subject: str) -> dict[str, dict]:
    """The changes reported for one class, by aspect."""
    found = [c for d in data["classes"] if d["class_name"] == subject for c in d["changes"]]
    return {c["aspect"]: c for c in found}


@pytest.fixture(scope="module")
def vllm_upgrade() -> dict:
    _need(VLLM_33, VLLM_34)
    return run(*SPECS, "--engine", "vllm", "--from", VLLM_33, "--to", VLLM_34, code=0)


@pytest.fixture(scope="module")
def sglang_upgrade() -> dict:
    _need(SGLANG_514)
    installed = locate_engine("sglang")
    assert installed.version == "0.5.23", installed.version
    return run(*SPECS, "--from", SGLANG_514, "--to", installed.root, code=0)  # the engine from both dist-infos


# -- vLLM 0.33.0 -> 0.34.0 ------------------------------------------------------------------------
def test_vllm_specs_keep_their_ids_and_are_served_the_same(vllm_upgrade):
    data = vllm_upgrade
    assert (data["before"]["version"], data["after"]["version"]) == ("0.33.0", "0.34.0")
    assert data["ok"] and data["served_differently"] == [] and data["undecided"] == []
    by_name = {s["spec"]: s for s in data["specs"]}
    assert by_name["kimi-k2.5-eagle3"]["before"] == by_name["kimi-k2.5-eagle3"]["after"] == [3, 31, 59]
    assert by_name["qwen3-8b-eagle3"]["after"] == [2, 18, 33]
    for s in data["specs"]:
        assert s["served"] == "same" and s["before"] == s["after"], s
        assert s["deployed"] == {"eagle_aux_hidden_state_layer_ids": s["before"]}
        assert s["captured_after"] == s["captured_before"] and None not in s["captured_after"]
    for cls in ("LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM"):
        assert changes(data, cls) == {}, cls


def test_vllm_runner_v1_and_its_eagle_config_read_are_gone(vllm_upgrade):
    got = {(c["aspect"], c["before"] and c["before"].split(" calls ")[0], c["after"]) for c in vllm_upgrade["runner"]}
    assert got == {("setter call", "GPUModelRunner._setup_eagle3_aux_hidden_state_outputs", None),
                   ("draft-config key", "eagle_config.eagle_aux_hidden_state_layer_ids", None)}
    by_aspect = {c["aspect"]: c for c in vllm_upgrade["runner"]}
    assert by_aspect["setter call"]["before_at"][0] == "v1/worker/gpu_model_runner.py:5188"
    assert by_aspect["draft-config key"]["before_at"] == ["v1/worker/gpu_model_runner.py:5219"]
    assert by_aspect["draft-config key"]["after_at"] == []


def test_vllm_classes_removed_and_added(vllm_upgrade):
    aria = changes(vllm_upgrade, "AriaTextModel")["class"]
    assert aria["after"] is None and aria["before_at"] == ["model_executor/models/aria.py:262"]
    ricursive = changes(vllm_upgrade, "RicursiveForCausalLM")["class"]
    assert ricursive["before"] is None and ricursive["after_at"] == ["model_executor/models/ricursive.py:356"]
    assert ricursive["after"].endswith("classified") and "unclassified" not in ricursive["after"]


# -- SGLang 0.5.14 -> 0.5.23 ----------------------------------------------------------------------
def test_sglang_specs_keep_their_ids_and_are_served_the_same(sglang_upgrade):
    data = sglang_upgrade
    assert (data["engine"], data["before"]["version"], data["after"]["version"]) == ("sglang", "0.5.14", "0.5.23")
    assert data["ok"] and data["served_differently"] == []
    for s in data["specs"]:
        assert s["served"] == "same" and s["before"] == s["after"], s
    assert {s["spec"]: s["after"] for s in data["specs"]}["kimi-k2.5-eagle3"] == [3, 31, 59]


def test_sglang_llama_capture_moves_into_the_decoder_layer(sglang_upgrade):
    got = changes(sglang_upgrade, "LlamaForCausalLM")
    assert set(got) == {"capture sites"}  # the setter's rule, default and order are unchanged
    site = got["capture sites"]
    assert site["before_at"] == ["srt/models/llama.py:408"]
    assert "`hidden_states + residual`" in site["before"] and "cannot be evaluated at its first index" in site["before"]
    (after,) = site["after_at"]
    assert after.startswith("srt/models/llama.py:") and 487 <= int(after.rsplit(":", 1)[1]) <= 493
    assert "capture_output" in site["after"] and "first index" not in site["after"]


def test_sglang_qwen3_runs_its_own_loop(sglang_upgrade):
    got = changes(sglang_upgrade, "Qwen3ForCausalLM")
    assert set(got) == {"capture sites"}
    assert got["capture sites"]["before_at"] == ["srt/models/qwen2.py:370"]
    (after,) = got["capture sites"]["after_at"]
    assert after.startswith("srt/models/qwen3.py:") and 524 <= int(after.rsplit(":", 1)[1]) <= 533


def test_sglang_deepseek_keeps_its_rule_and_its_capture_is_now_read(sglang_upgrade):
    got = changes(sglang_upgrade, "DeepseekV3ForCausalLM")
    assert "id rule" not in got and "default" not in got
    assert got["capture sites"]["before_at"] == ["srt/models/deepseek_v2.py:2502"]
    assert got["capture sites"]["after_at"] == ["srt/models/deepseek_v2.py:3194"]
    assert got["verified"]["before"].startswith("unverified") and got["verified"]["after"] == "verified"


def test_sglang_gpt_oss_id_rule_and_tail_capture(sglang_upgrade):
    got = changes(sglang_upgrade, "GptOssForCausalLM")
    rule = got["id rule"]
    assert rule["before"].endswith(": +1") and rule["after"].endswith(": +0 if max(ids) == L else +1")
    assert "srt/models/gpt_oss.py:1285" in rule["before_at"] and "srt/models/gpt_oss.py:1350" in rule["after_at"]
    assert {"srt/models/gpt_oss.py:732", "srt/models/gpt_oss.py:735"} <= set(got["capture sites"]["after_at"])
    assert "after_loop" in got["capture sites"]["after"] and "after_loop" not in got["capture sites"]["before"]


def test_sglang_runner_now_reads_eagle_config(sglang_upgrade):
    keys = [c for c in sglang_upgrade["runner"] if c["aspect"] == "draft-config key"]
    assert [(c["before"], c["after"]) for c in keys] == [(None, "eagle_config.eagle_aux_hidden_state_layer_ids")]
    assert keys[0]["after_at"] == ["srt/model_executor/model_runner_components/spec_aux_hidden_state.py:192"]
    calls = [c for c in sglang_upgrade["runner"] if c["aspect"] == "setter call"]
    assert "srt/model_executor/model_runner.py:1009" in [c["before_at"][0] for c in calls if c["before_at"]]


# -- a deployed draft served differently: SGLang 0.5.5 -> 0.5.14, Kimi-K2.5 -------------------------
def test_a_draft_the_upgrade_serves_differently_exits_3():
    _need(SGLANG_55, SGLANG_514)
    data = run(KIMI, "--engine", "sglang", "--from", SGLANG_55, "--to", SGLANG_514, code=3)
    (kimi,) = data["specs"]
    assert kimi["served"] == "differently" and data["served_differently"] == ["kimi-k2.5-eagle3"]
    assert (kimi["before"], kimi["after"]) == ([2, 30, 58], [3, 31, 59])
    assert kimi["deployed"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert kimi["captured_before"] == ["layer_out[2]", "layer_out[30]", "layer_out[58]"]
    assert kimi["captured_after"] == ["layer_out[1]", "layer_out[29]", "layer_out[57]"]
    assert any("capture layer_out[1]" in r for r in kimi["reasons"])
    rule = changes(data, "DeepseekV3ForCausalLM")["id rule"]
    assert (rule["before"], rule["after"]) == ("set_eagle3_layers_to_capture: +1",
                                               "set_eagle3_layers_to_capture: +1 if ids[0] == 1 else +0")
    assert "srt/models/deepseek_v2.py:3834" in rule["before_at"]
    assert "srt/models/deepseek_v2.py:2812" in rule["after_at"]


def test_text_output_lists_the_change_then_its_lines():
    _need(SGLANG_55, SGLANG_514)
    res = CliRunner().invoke(main, ["upgrade-check", KIMI, "--engine", "sglang", "--from", str(SGLANG_55),
                                    "--to", str(SGLANG_514)])
    assert res.exit_code == 3, res.output
    lines = res.stdout.splitlines()
    assert lines[1] == ("kimi-k2.5-eagle3 (DeepseekV3ForCausalLM): ids [2, 30, 58] -> [3, 31, 59]; "
                        "deployed config SERVED DIFFERENTLY")
    assert "DeepseekV3ForCausalLM: id rule: set_eagle3_layers_to_capture: +1 -> set_eagle3_layers_to_capture: " \
           "+1 if ids[0] == 1 else +0" in lines
    details = lines[lines.index("details:") + 1:]
    assert ("  DeepseekV3ForCausalLM: id rule: 0.5.5: srt/models/deepseek_v2.py:3822, srt/models/deepseek_v2.py:3834; "
            "0.5.14: srt/models/deepseek_v2.py:2799, srt/models/deepseek_v2.py:2812") in details


def test_the_same_release_twice_is_one_quiet_line():
    """(Between two releases a class whose capture was not read to the end leaves the verdict
    undecided, exit 4; one release read twice cannot serve anything otherwise.)"""
    _need(SGLANG_514)
    res = CliRunner().invoke(main, ["upgrade-check", KIMI, "--from", str(SGLANG_514), "--to", str(SGLANG_514)])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == [f"sglang 0.5.14 -> 0.5.14: nothing changed for 1 spec(s) or any of "
                                       f"{res.stdout.split('any of ')[1].split()[0]} classes"]


# -- releases by version, and bad input -------------------------------------------------------------
def test_a_version_resolves_from_the_fetched_cache_offline(tmp_path, monkeypatch):
    _need(VLLM_33, VLLM_34)
    (tmp_path / "vllm-0.33.0").symlink_to(ENGINES / "vllm-0.33.0", target_is_directory=True)
    assert (tmp_path / "vllm-0.33.0" / releases.STAMP).is_file()
    monkeypatch.setattr(releases, "cache_dir", lambda: tmp_path)

    def no_network(*a, **k):
        raise AssertionError("pip was asked for a release the cache holds")

    monkeypatch.setattr(releases, "download", no_network)
    data = run(KIMI, "--engine", "vllm", "--from", "0.33.0", "--to", VLLM_34, code=0)
    assert data["before"]["version"] == "0.33.0" and data["specs"][0]["served"] == "same"


def test_the_default_cache_is_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert releases.cache_dir() == tmp_path / "surgeon" / "releases"


@pytest.mark.parametrize("args, said", [
    (["--engine", "vllm", "--from", "not a version", "--to", VLLM_34], "neither an engine root"),
    (["--engine", "vllm", "--from", "/no/such/dir", "--to", VLLM_34], "neither an engine root"),
    (["--engine", "vllm", "--from", SGLANG_514, "--to", VLLM_34], "is not a vllm package directory"),
    (["--from", "0.33.0", "--to", VLLM_34], "--engine is needed"),
])
def test_bad_roots_and_versions_are_one_line_exit_2(args, said):
    res = CliRunner().invoke(main, ["upgrade-check", KIMI, *map(str, args)])
    assert res.exit_code == 2, res.output
    assert len(res.stderr.strip().splitlines()) == 1 and said in res.stderr and "Traceback" not in res.output


def test_a_version_pip_cannot_find_is_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.setattr(releases, "cache_dir", lambda: tmp_path)

    def not_found(dist, version, into, *, quiet_pip=False):
        raise releases.ReleaseError(f"pip download {dist}=={version} failed (exit 1): ERROR: No matching "
                                    f"distribution found for {dist}=={version}")

    monkeypatch.setattr(releases, "download", not_found)
    res = CliRunner().invoke(main, ["upgrade-check", KIMI, "--engine", "vllm", "--from", "99.0.0", "--to", str(VLLM_34)])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip() == ("surgeon: vllm 99.0.0: pip download vllm==99.0.0 failed (exit 1): ERROR: No matching "
                                  "distribution found for vllm==99.0.0")
    assert not (tmp_path / "vllm-99.0.0").exists()  # nothing half-unpacked is left as a release


def test_unpack_keeps_python_and_metadata_and_refuses_escaping_members(tmp_path):
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in ("x/__init__.py", "x/data.bin", "x-1.0.dist-info/METADATA", "x-1.0.dist-info/RECORD",
                     "../evil.py", "/abs.py", "x/../../escape.py"):
            zf.writestr(name, "pass\n")
    target = tmp_path / "out"
    assert releases.unpack(wheel, target) == 2
    kept = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert kept == ["x-1.0.dist-info/METADATA", "x/__init__.py"]
    assert not (tmp_path / "evil.py").exists() and not (tmp_path / "escape.py").exists()


def test_fetch_engines_loads_the_one_unpacker_by_path_before_surgeon_is_installed():
    script = ROOT / "scripts" / "fetch-engines"
    tree = ast.parse(script.read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    assert "unpack" not in defined and "zipfile" not in imported and "subprocess" not in imported
    source = (ROOT / "surgeon" / "engines" / "source" / "releases.py").read_text()
    modules = {n.module if isinstance(n, ast.ImportFrom) else a.name
               for n in ast.parse(source).body if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    assert not any(str(m).startswith("surgeon") for m in modules), modules
    listed = [line.split("#", 1)[0].split() for line in (ROOT / "scripts" / "engine-releases.txt").read_text().splitlines()]
    if not all(releases.cached(d, v, ENGINES) for d, v in (x for x in listed if x)):
        pytest.skip("a listed release is not fetched yet: the script would download it")
    # -S: no site-packages, so no surgeon to import; every listed release is fetched already: silent
    done = subprocess.run([sys.executable, "-S", str(script)], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0 and done.stdout == "", (done.stdout, done.stderr)


def test_a_verdict_resting_on_code_not_read_is_undecided_exit_4():
    """Back from 0.5.14 to 0.5.5: 0.5.5 adds 1 to 0.5.14's ids [3, 31, 59], so the deployed config
    captures other points there, but what 0.5.14's DeepSeek layers capture was not read to a value
    (deepseek_v2.py:2502, the layer communicator): whether the upgrade changes anything is undecided."""
    _need(SGLANG_55, SGLANG_514)
    data = run(KIMI, "--engine", "sglang", "--from", SGLANG_514, "--to", SGLANG_55, code=4)
    (kimi,) = data["specs"]
    assert kimi["served"] == "undecided" and data["undecided"] == ["kimi-k2.5-eagle3"] and not data["ok"]
    assert kimi["captured_after"] == ["layer_out[3]", "layer_out[31]", "layer_out[59]"]
    assert any(r.startswith("sglang 0.5.14: ") and "deepseek_v2.py:2502" in r for r in kimi["reasons"])
