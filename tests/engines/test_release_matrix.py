"""The engine release matrix (issues 12 and 34): the installed engines plus the releases that
scripts/fetch-engines unpacks as sources (vLLM 0.33.0, SGLang 0.5.5, vLLM 0.11.0, vLLM 0.34.0,
SGLang 0.5.14), each probed from its own files, never imported.

The expected answers below were read by hand from each release's source, independently of the
probe; each names the lines that decide it. "refuse" means render must refuse the wiring with a
reason naming file:line (exit 2), because the engine cannot serve it: a capture expression that
raises at that index, an index no capture site reaches, a fc order the engine cannot emit, or a
runner that ignores the draft's ids.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from surgeon.cli import main
from surgeon.engines.probes.probe import probe_engine
from tests.conftest import engine_matrix, release_engine

ROOT = Path(__file__).resolve().parents[2]
REFUSE = "refuse"
FILE_LINE = re.compile(r"[\w/.-]+\.py:\d+")

# The kimi, llama and qwen3 specs of specs/, and edge variants of each: embed first, the last
# layer's output last (layer_out[L-1]), and a non-ascending fc order.
MODELS = {
    "kimi": ("DeepseekV3ForCausalLM", 61, 7168, ["layer_out[2]", "layer_out[30]", "layer_out[58]"]),
    "llama": ("LlamaForCausalLM", 32, 4096, ["layer_out[1]", "layer_out[15]", "layer_out[28]"]),
    "qwen3": ("Qwen3ForCausalLM", 36, 4096, ["layer_out[1]", "layer_out[17]", "layer_out[32]"]),
}


def variants(L: int, base: list[str]) -> dict[str, list[str]]:
    return {
        "base": base,
        "embed": ["embed", "layer_out[3]", f"layer_out[{L // 2}]"],
        "last": ["layer_out[1]", f"layer_out[{L // 2}]", f"layer_out[{L - 1}]"],
        "order": [f"layer_out[{L // 2}]", "layer_out[1]", f"layer_out[{L - 4}]"],
    }


# vLLM 0.32.0 (installed), 0.33.0 and 0.34.0 read the same way for these classes (0.34.0: the
# capture lines of llama.py, qwen2.py, qwen3.py, deepseek_v2.py and interfaces.py are those of 0.33.0;
# deepseek_v2.py:1561-1562 and 1586, interfaces.py:1653-1663):
# - llama.py / qwen2.py loops call EagleModelMixin._maybe_add_hidden_state before the loop with
#   start_layer and after layer idx with idx + 1; interfaces.py guards `residual is not None`: id 0
#   is embed, id j is layer_out[j-1], id L is layer_out[L-1]; the mixin's setter sorts (ascending
#   only).
# - deepseek_v2.py DeepseekV2Model.forward (0.32.0 and 0.33.0 alike, lines 1546-1587): captures
#   `hidden_states + residual` at the ENTRY of layer idx (unguarded: residual is None before layer
#   0, a TypeError for id 0) and `end_layer` after the loop: ids 1..L, never 0.
VLLM_CURRENT = {
    ("kimi", "base"): [3, 31, 59], ("kimi", "embed"): REFUSE, ("kimi", "last"): [2, 31, 61], ("kimi", "order"): REFUSE,
    ("llama", "base"): [2, 16, 29], ("llama", "embed"): [0, 4, 17], ("llama", "last"): [2, 17, 32],
    ("llama", "order"): REFUSE,
    ("qwen3", "base"): [2, 18, 33], ("qwen3", "embed"): [0, 4, 19], ("qwen3", "last"): [2, 19, 36],
    ("qwen3", "order"): REFUSE,
}
# vLLM 0.11.0: v1/worker/gpu_model_runner.py:2644 sets
# set_aux_hidden_state_layers(get_eagle3_aux_hidden_state_layers()): the draft's ids are ignored and
# only (2, L//2, L-3) is served; llama.py:403 captures `hidden_states + residual` at the entry of
# layer idx (no capture after the loop), so that default is layer_out[1], [L//2-1], [L-4]: the
# llama and qwen3 specs are that default; every other wiring cannot be served. deepseek_v2.py has no
# aux capture in 0.11.0.
VLLM_011 = {
    ("kimi", "base"): REFUSE, ("kimi", "embed"): REFUSE, ("kimi", "last"): REFUSE, ("kimi", "order"): REFUSE,
    ("llama", "base"): [2, 16, 29], ("llama", "embed"): REFUSE, ("llama", "last"): REFUSE, ("llama", "order"): REFUSE,
    ("qwen3", "base"): [2, 18, 33], ("qwen3", "embed"): REFUSE, ("qwen3", "last"): REFUSE, ("qwen3", "order"): REFUSE,
}
# SGLang 0.5.23 (installed): llama.py set_eagle3_layers_to_capture adds 1 (line 941); capture is at
# the entry of layer i through layers/layer_boundary (stage.py:426-434 captures the embedding when
# there is no residual yet), so -1 is embed and layer_out[L-1] has no capture index.
# deepseek_v2.py:3470-3473 adds 1 only when the first id is 1.
SGLANG_0523 = {
    ("kimi", "base"): [3, 31, 59], ("kimi", "embed"): [0, 4, 31], ("kimi", "last"): REFUSE, ("kimi", "order"): REFUSE,
    ("llama", "base"): [1, 15, 28], ("llama", "embed"): [-1, 3, 16], ("llama", "last"): REFUSE,
    ("llama", "order"): REFUSE,
    ("qwen3", "base"): [1, 17, 32], ("qwen3", "embed"): [-1, 3, 18], ("qwen3", "last"): REFUSE,
    ("qwen3", "order"): REFUSE,
}
# SGLang 0.5.5: llama.py:339-340 appends `hidden_states + residual` at the entry of layer i,
# unguarded, with residual None before layer 0 (line 329): embed raises. qwen2.py:357-359 guards it.
# deepseek_v2.py:3834 always adds 1 and DeepseekV2Model.forward appends `hidden_states + residual`
# at the entry of layer i (line 2956), unguarded, with residual None before layer 0 (line 2936):
# embed raises there too. (Only the Qwen2/Qwen3 MoE files capture through layers/communicator.py.)
SGLANG_055 = {
    ("kimi", "base"): [2, 30, 58], ("kimi", "embed"): REFUSE, ("kimi", "last"): REFUSE, ("kimi", "order"): REFUSE,
    ("llama", "base"): [1, 15, 28], ("llama", "embed"): REFUSE, ("llama", "last"): REFUSE, ("llama", "order"): REFUSE,
    ("qwen3", "base"): [1, 17, 32], ("qwen3", "embed"): [-1, 3, 18], ("qwen3", "last"): REFUSE,
    ("qwen3", "order"): REFUSE,
}
# SGLang 0.5.14: llama.py:824 and qwen2.py:665 / qwen3.py:705 add 1 to explicit ids; llama.py:407-408
# appends `hidden_states + residual` at the entry of layer i, unguarded, with residual None before
# layer 0 (line 398): embed raises; qwen2.py:369-371 guards it (-1 is embed). deepseek_v2.py:2811-2814
# adds 1 only when the first id is 1; its loop hands `captured_last_layer_outputs` to the layer at
# i in layers_to_capture (2501-2503) and layers/communicator.py:504-515 appends `residual` after
# prepare_attn, which is the embedding before layer 0: embed is id 0. No capture after any loop.
SGLANG_0514 = {
    ("kimi", "base"): [3, 31, 59], ("kimi", "embed"): [0, 4, 31], ("kimi", "last"): REFUSE, ("kimi", "order"): REFUSE,
    ("llama", "base"): [1, 15, 28], ("llama", "embed"): REFUSE, ("llama", "last"): REFUSE, ("llama", "order"): REFUSE,
    ("qwen3", "base"): [1, 17, 32], ("qwen3", "embed"): [-1, 3, 18], ("qwen3", "last"): REFUSE,
    ("qwen3", "order"): REFUSE,
}
EXPECTED = {
    "vllm-installed": VLLM_CURRENT, "vllm-0.33.0": VLLM_CURRENT, "vllm-0.11.0": VLLM_011, "vllm-0.34.0": VLLM_CURRENT,
    "sglang-installed": SGLANG_0523, "sglang-0.5.5": SGLANG_055, "sglang-0.5.14": SGLANG_0514,
}
MATRIX = {label: (engine, root) for engine, label, root in engine_matrix()}


def spec_file(tmp_path: Path, model: str, variant: str) -> Path:
    arch, L, hidden, base = MODELS[model]
    points = variants(L, base)[variant]
    f = tmp_path / f"{model}-{variant}.yaml"
    f.write_text(textwrap.dedent(f"""\
        spec: 1
        name: {model}-{variant}
        target: {{architecture: {arch}, num_layers: {L}, hidden_size: {hidden}}}
        captures:
          a: {points[0]}
          b: {points[1]}
          c: {points[2]}
          last: final_norm
        draft: {{kind: eagle3, fc_input: [a, b, c], fc_in_features: {3 * hidden}}}
        """))
    return f


def render(spec: Path, engine: str, root: Path | None, *extra: str):
    args = ["render", str(spec), "--engine", engine, "--json", *extra]
    if root is not None:
        args += ["--engine-root", str(root)]
    return CliRunner().invoke(main, args)


CASES = [(label, model, variant) for label in EXPECTED for model in MODELS for variant in ("base", "embed", "last", "order")]


@pytest.mark.parametrize(("label", "model", "variant"), CASES, ids=["-".join(c) for c in CASES])
def test_render_matches_what_the_release_source_says(tmp_path, label, model, variant):
    engine, root = MATRIX[label]
    want = EXPECTED[label][(model, variant)]
    res = render(spec_file(tmp_path, model, variant), engine, root)
    assert "Traceback" not in res.output
    if want == REFUSE:
        assert res.exit_code == 2, f"{label} {model}/{variant} should be refused, got {res.output}"
        assert FILE_LINE.search(res.output), f"the refusal names no file:line: {res.output}"
    else:
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["ids"] == want


def test_the_matrix_holds_every_fetched_release():
    labels = {label for _, label, _ in engine_matrix()}
    assert labels == set(EXPECTED), "a release was added to scripts/engine-releases.txt without expected answers here"


@pytest.mark.parametrize("label", list(EXPECTED))
def test_every_listed_class_is_decided(label):
    """Issue 34's count: >= 95% of EVERY class the probe lists (what `conventions --json` prints) is
    classified or proven unable to capture; a class that hands its ids to a language model the
    engine picks at run time counts as undecided (its delegate is not resolved). Every undecided
    class names file:line."""
    engine, root = MATRIX[label]
    probe = probe_engine(engine, root)
    listed = list(probe.classes.values())
    undecided = [cc for cc in listed if cc.status != "classified" and not cc.no_capture]
    share = 1 - len(undecided) / len(listed)
    assert share >= 0.95, f"{label}: {len(undecided)}/{len(listed)} undecided: " + "; ".join(
        f"{cc.class_name}: {cc.reason}" for cc in undecided[:8])
    for cc in undecided:
        assert cc.path and cc.line, cc
        assert FILE_LINE.search(cc.reason or "") or cc.delegates, (cc.class_name, cc.reason)


@pytest.mark.parametrize("label", list(EXPECTED))
def test_capture_setter_classes_are_decided(label):
    """>= 95% of the classes that define a capture setter are classified; classes proven unable
    to capture count as decided. Every undecided class names file:line."""
    engine, root = MATRIX[label]
    probe = probe_engine(engine, root)
    defining = [probe.classes[k] for k in probe.defining]
    assert defining, f"{label}: no class defines a capture setter"
    undecided = [cc for cc in defining if cc.status == "unclassified" and not cc.no_capture and not cc.delegates]
    share = 1 - len(undecided) / len(defining)
    assert share >= 0.95, f"{label}: {len(undecided)}/{len(defining)} undecided: " + "; ".join(
        f"{cc.class_name}: {cc.reason}" for cc in undecided[:8])
    for cc in undecided:
        assert cc.path and cc.line, cc


def test_release_sources_are_fetched():
    for label, (_, root) in MATRIX.items():
        if root is not None:
            dist, version = label.rsplit("-", 1)
            assert release_engine(dist, version) == root


# GLM-5.2 (GlmMoeDsaForCausalLM, 78 layers) on vLLM 0.33.0: vllm/models/deepseek_v32/__init__.py
# dispatches per platform. On cuda it is nvidia/model.py's DeepseekV32ForCausalLM, whose
# DeepseekV32Model.forward (lines 284-292) captures only at the entry of layers inside the loop:
# there is no capture after the last layer, so layer_out[77] (id 78) cannot be served. On cpu it is
# model_executor/models/deepseek_v2.py's GlmMoeDsaForCausalLM, which captures end_layer after the loop.
# On rocm, amd/model.py:217-223 captures at layer entry only, like nvidia.
GLM = ("GlmMoeDsaForCausalLM", 78, 6144, ["layer_out[1]", "layer_out[38]", "layer_out[77]"])


@pytest.mark.parametrize(("platform", "want"), [("cuda", REFUSE), ("rocm", REFUSE), ("cpu", [2, 39, 78])])
def test_glm_on_vllm_033_follows_the_platform_dispatch(tmp_path, monkeypatch, platform, want):
    monkeypatch.setitem(MODELS, "glm", GLM)
    engine, root = MATRIX["vllm-0.33.0"]
    res = render(spec_file(tmp_path, "glm", "base"), engine, root, "--platform", platform)
    assert "Traceback" not in res.output
    if want == REFUSE:  # amd/model.py:217-223 has no capture after the loop either
        assert res.exit_code == 2, res.output
        folder = {"cuda": "nvidia", "rocm": "amd"}[platform]
        assert f"deepseek_v32/{folder}/model.py" in res.output and FILE_LINE.search(res.output)
    else:
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout)
        assert out["ids"] == want
        assert out.get("platform") == platform
