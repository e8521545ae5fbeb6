"""Constructor-chosen inner models (issue 34, item 1): the class a constructor builds as the model
that holds the ids, chosen by a class attribute read through the object's concrete class, by the
arguments of the call that built the object, by a factory function, or by a parameter's default,
on the real engine files (installed, .engines/ releases, and edited copies of the installed ones).

The engine itself builds a registered class with fixed keywords (SGLang 0.5.23
model_loader/loader.py:309 ``model_class(**kwargs)`` with config, quant_config and optional
sparse-head/draft keys; vLLM 0.32 model_loader/utils.py:95 ``model_class(vllm_config=..., prefix=...)``),
so a constructor default the engine does not pass holds for the class itself; a default that a
``*args``/``**kwargs`` the probe cannot expand may override is marked as assumed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from surgeon.engines.interp import Interp, Obj, Outcome, Raised, Seq, Store, explore
from surgeon.engines.probes import sglang as sglang_probe
from surgeon.engines.probes import vllm as vllm_probe
from surgeon.engines.probes.capture import CaptureAnalyzer
from surgeon.engines.probes.classify import Classifier
from surgeon.engines.source.index import ClassKey, SourceIndex
from surgeon.engines.source.locate import layout_of, locate_engine
from tests.conftest import release_engine

pytestmark = pytest.mark.engine

TEXT = "srt/models/qwen3_5_text.py"
QWEN3_5 = "srt/models/qwen3_5.py"
QWEN3_VL = "srt/models/qwen3_vl.py"


class _Engine:
    """One engine root read as the probe reads it, for questions about single classes."""

    def __init__(self, engine: str, root: Path | None = None) -> None:
        loc = locate_engine(engine, root)
        self.index = SourceIndex(loc.root, layout_of(engine).package, loc.models_dirs)
        self.mod = sglang_probe if engine == "sglang" else vllm_probe
        self.hooks = self.mod.hooks(self.index)
        self.classifier = Classifier(engine, self.index, self.hooks, CaptureAnalyzer(self.index),  # type: ignore[arg-type]
                                     self.mod.extra_notes(self.index))

    def classify(self, path: str, name: str):
        target = next(t for t in self.mod.select(self.index, only={path})[0] if t.key[1] == name)
        return self.classifier.classify(target)

    def holders(self, key: ClassKey, setter: str) -> set[tuple[ClassKey, str | None]]:
        """(class, assumption) of every object the setter stores explicit ids into, on every path."""
        def once(assumptions: dict) -> Outcome:
            it = Interp(self.index, self.hooks, assumptions)
            try:
                it.call_method(Obj(key, "self"), setter, [Seq(None)])
            except Raised:
                pass
            return Outcome(it.effects, None, None, it.notes, it.labels)

        return {(e.holder.cls, e.holder.assumed) for _, out in explore(once) for e in out.effects
                if isinstance(e, Store) and isinstance(e.value, Seq)}


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path.name} no longer contains {old!r}: update this test"
    path.write_text(text.replace(old, new, 1))


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.fixture(scope="module")
def sg() -> _Engine:
    return _Engine("sglang")


@pytest.fixture
def sg_copy(engine_copy, tmp_path):
    """A writable copy of the installed SGLang's model files: (package root, models dir)."""
    root = engine_copy("sglang", tmp_path)
    return root, root / layout_of("sglang").models_dir


# -- class attributes ----------------------------------------------------------------------------
def test_a_class_attribute_is_read_through_the_concrete_class(sg):
    """qwen3_5_text.py:49 Qwen3_5ForCausalLM builds ``self.model = self.body_cls(...)`` (line 75);
    its subclass Qwen3_5MoeForCausalLM (line 293) sets body_cls to qwen3_5.py's MoE class and
    does not touch the constructor: the subclass's ids go to the MoE class."""
    dense = sg.classify(TEXT, "Qwen3_5ForCausalLM")
    moe = sg.classify(TEXT, "Qwen3_5MoeForCausalLM")
    assert dense.status == moe.status == "classified"
    assert "a Qwen3_5ForCausalLM (srt/models/qwen3_5.py)" in (dense.reason or "")
    assert "a Qwen3_5MoeForCausalLM (srt/models/qwen3_5.py)" in (moe.reason or "")
    assert dense.verified and moe.verified


def test_vllm_model_cls_of_a_subclass_in_a_release():
    """vLLM 0.34.0 deepseek_v2.py:1883 DeepseekV2ForCausalLM.model_cls = DeepseekV2Model, built by
    ``self.model = self.model_cls(...)``; unlimited_ocr.py:400 overrides it with UnlimitedOCR2Model."""
    vl = _Engine("vllm", release_engine("vllm", "0.34.0"))
    cc = vl.classify("model_executor/models/unlimited_ocr.py", "UnlimitedOCR2TextForCausalLM")
    assert cc.status == "classified" and cc.verified
    assert "a UnlimitedOCR2Model (model_executor/models/unlimited_ocr.py)" in (cc.reason or "")


@pytest.mark.parametrize("spelling", ["type(self).body_cls(", "self.__class__.body_cls("])
def test_type_of_self_reads_the_subclass_class_attribute(sg_copy, spelling):
    root, models = sg_copy
    _edit(models / "qwen3_5_text.py", "self.model = self.body_cls(", f"self.model = {spelling}")
    copy = _Engine("sglang", root)
    holders = copy.holders((TEXT, "Qwen3_5MoeForCausalLM"), sglang_probe.SETTER)
    assert {cls for cls, _ in holders} == {(QWEN3_5, "Qwen3_5MoeForCausalLM")}


def test_a_classmethod_factory_reads_cls_as_the_concrete_class(sg_copy):
    """``cls`` of a classmethod called on the object is its concrete class: ``cls.body_cls``
    is the subclass's; a call with ``**kwargs`` marks nothing here (qwen3_5.py's constructor takes
    no class-valued default)."""
    root, models = sg_copy
    text = models / "qwen3_5_text.py"
    _edit(text, "self.model = self.body_cls(", "self.model = self._make_body(")
    _edit(text, "    @classmethod\n    def shared_experts_fusion_disable_reason(cls, hf_config, quant_config):",
          "    @classmethod\n    def _make_body(cls, **kwargs):\n        return cls.body_cls(**kwargs)\n\n"
          "    @classmethod\n    def shared_experts_fusion_disable_reason(cls, hf_config, quant_config):")
    copy = _Engine("sglang", root)
    assert copy.holders((TEXT, "Qwen3_5MoeForCausalLM"), sglang_probe.SETTER) == {((QWEN3_5, "Qwen3_5MoeForCausalLM"), None)}


# -- factories -----------------------------------------------------------------------------------
def test_a_module_level_factory_in_another_module_is_followed(sg_copy, sg):
    """``self.model = qwen3_5.build_text_body(...)``: a function of another module whose ``cls``
    parameter defaults to qwen3_5.py's MoE class. The call is read and does not pass it, so the
    default is what this constructor builds (no assumption). Unfollowed, the call was a result
    the probe could not read and the class unclassified."""
    root, models = sg_copy
    (models / "qwen3_5.py").write_text((models / "qwen3_5.py").read_text() + (
        "\n\ndef build_text_body(config, quant_config=None, prefix=\"\", cls=Qwen3_5MoeForCausalLM):\n"
        "    if config is None:\n"
        "        raise ValueError(\"no config\")\n"
        "    return cls(config=config, quant_config=quant_config, prefix=prefix)\n"))
    _edit(models / "qwen3_5_text.py", "self.model = self.body_cls(", "self.model = qwen3_5.build_text_body(")
    copy = _Engine("sglang", root)
    assert copy.holders((TEXT, "Qwen3_5ForCausalLM"), sglang_probe.SETTER) == {((QWEN3_5, "Qwen3_5MoeForCausalLM"), None)}
    cc = copy.classify(TEXT, "Qwen3_5ForCausalLM")
    assert cc.status == "classified" and cc.verified, cc.reason
    assert "a Qwen3_5MoeForCausalLM (srt/models/qwen3_5.py)" in (cc.reason or "")


def test_a_factory_the_probe_cannot_read_to_a_class_stays_a_gap(sg):
    """SGLang 0.5.23 mindspore.py:192 builds ``self.model`` from ``_get_arch_from_config`` (line
    32), which looks the class up in a registry imported at run time: followed, it is still no
    class, and the class stays unclassified, naming the function (never a raise of the setter)."""
    cc = sg.classify("srt/models/mindspore.py", "MindSporeForCausalLM")
    assert cc.status == "unclassified" and not cc.no_capture
    assert "_get_arch_from_config (srt/models/mindspore.py:32)" in (cc.reason or "")


# -- constructor arguments and assumed defaults --------------------------------------------------
def test_the_engine_built_class_keeps_its_default_verified(sg):
    """qwen3_vl.py:1320 ``language_model_cls=Qwen3LLMModel``: the loader never passes it, so the
    registered class's answer rests on nothing the probe did not read."""
    key = (QWEN3_VL, "Qwen3VLForConditionalGeneration")
    assert sg.holders(key, sglang_probe.SETTER) == {((QWEN3_VL, "Qwen3LLMModel"), None)}
    assert sg.classify(QWEN3_VL, "Qwen3VLForConditionalGeneration").verified


def test_a_composite_passing_the_inner_class_at_the_call_is_followed(sg_copy):
    """A composite building Qwen3-VL with ``language_model_cls=self.body_cls``: the call's keyword
    chooses the inner model (the MoE subclass's body_cls), never the parameter's default (what the
    probe answered when it dropped the call's arguments)."""
    root, models = sg_copy
    text = models / "qwen3_5_text.py"
    _edit(text, "from sglang.srt.models import qwen3_5\n", "from sglang.srt.models import qwen3_5, qwen3_vl\n")
    _edit(text, "self.model = self.body_cls(",
          "self.model = qwen3_vl.Qwen3VLForConditionalGeneration(language_model_cls=self.body_cls,")
    copy = _Engine("sglang", root)
    assert copy.holders((TEXT, "Qwen3_5MoeForCausalLM"), sglang_probe.SETTER) == {((QWEN3_5, "Qwen3_5MoeForCausalLM"), None)}
    assert copy.holders((TEXT, "Qwen3_5ForCausalLM"), sglang_probe.SETTER) == {((QWEN3_5, "Qwen3_5ForCausalLM"), None)}


def test_a_default_a_starred_call_may_override_is_marked_assumed(sg_copy):
    """The same composite passing ``**self.vl_kwargs``: the default Qwen3LLMModel is what the probe
    can read, but the call may pass another class, so the holder says what it rests on."""
    root, models = sg_copy
    text = models / "qwen3_5_text.py"
    _edit(text, "from sglang.srt.models import qwen3_5\n", "from sglang.srt.models import qwen3_5, qwen3_vl\n")
    _edit(text, "self.model = self.body_cls(", "self.model = qwen3_vl.Qwen3VLForConditionalGeneration(**self.vl_kwargs,")
    copy = _Engine("sglang", root)
    [(cls, assumed)] = copy.holders((TEXT, "Qwen3_5ForCausalLM"), sglang_probe.SETTER)
    line = _line_of(models / "qwen3_vl.py", "language_model_cls=Qwen3LLMModel,")
    call = _line_of(text, "qwen3_vl.Qwen3VLForConditionalGeneration(**self.vl_kwargs,")
    assert cls == (QWEN3_VL, "Qwen3LLMModel")
    assert assumed is not None
    assert assumed.startswith(f"rests on the default of language_model_cls ({QWEN3_VL}:{line})")
    assert f"the call at {TEXT}:{call} passes *args/**kwargs" in assumed
    assert "a caller passing another class is not read" in assumed


def test_a_classified_answer_resting_on_an_assumed_default_is_unverified(sg_copy):
    """The composite above, classified as a whole: whatever the ids mean, the answer names the
    default it rests on and is not verified."""
    root, models = sg_copy
    text = models / "qwen3_5_text.py"
    _edit(text, "from sglang.srt.models import qwen3_5\n", "from sglang.srt.models import qwen3_5, qwen3_vl\n")
    _edit(text, "self.model = self.body_cls(", "self.model = qwen3_vl.Qwen3VLForConditionalGeneration(**self.vl_kwargs,")
    cc = _Engine("sglang", root).classify(TEXT, "Qwen3_5ForCausalLM")
    assert cc.status == "classified", cc.reason
    assert not cc.verified
    assert (cc.unverified_reason or "").startswith(f"rests on the default of language_model_cls ({QWEN3_VL}:")
