"""SGLang DFlash: ``set_dflash_layers_to_capture`` classified per class by the probe's classifier,
and the runner's path from ``dflash_config.target_layer_ids`` to it, against the real installed
SGLang files (and the 0.5.5 release, which has no DFlash setter)."""

from __future__ import annotations

import shutil
from pathlib import Path

from surgeon.engines.facts.sglang_dflash import RUNNER_DIRS, SETTER, classify_dflash, read_dflash_runner
from tests.conftest import installed_engine, release_engine


def _runner_copy(engine_copy, tmp_path: Path) -> Path:
    """A copy of the installed SGLang's model files plus its runner directories."""
    root = engine_copy("sglang", tmp_path / "site")
    src = installed_engine("sglang").root
    for d in RUNNER_DIRS:
        shutil.copytree(src / d, root / d, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _edit(path: Path, old: str, new: str, after: str = "") -> None:
    """Replace the first ``old`` that follows ``after``."""
    text = path.read_text()
    start = text.index(after) if after else 0
    assert old in text[start:], f"{path.name} no longer contains {old!r}: update this test"
    path.write_text(text[:start] + text[start:].replace(old, new, 1))


def test_installed_llama_and_qwen3_dflash_ids_are_layer_outputs():
    root = installed_engine("sglang").root
    for cls, model_file in (("LlamaForCausalLM", "srt/models/llama.py"), ("Qwen3ForCausalLM", "srt/models/qwen3.py")):
        cc = classify_dflash(root, cls)
        assert cc is not None and cc.status == "classified", cc and cc.reason
        assert cc.id_rule is not None and cc.id_rule.name == "+1"  # [val + 1 for val in layer_ids]
        assert cc.capture_site == "entry" and cc.captured_value == "residual_stream"
        assert cc.default is None  # the DFlash setter requires the ids
        assert cc.setter_owner == f"{model_file}:{cls}"
        text = (root / model_file).read_text().splitlines()
        setter = [e for e in cc.evidence if e.role == "setter"]
        assert setter[0].path == model_file and f"def {SETTER}" in text[setter[0].line - 1]
        assert "[val + 1 for val in layer_ids]" in text[setter[1].line - 1]
        # id k is captured at the entry of layer k + 1: the output of layer k
        assert cc.capture([1, 3, 5], 8) == [2, 4, 6]


def test_installed_setter_that_raises_on_some_ids_is_refused_with_its_line():
    cc = classify_dflash(installed_engine("sglang").root, "BeamForCausalLM")
    assert cc is not None and cc.status == "unclassified"
    assert "raises" in (cc.reason or "") and "line" in (cc.reason or "")


def test_sglang_055_has_no_dflash_setter():
    root = release_engine("sglang", "0.5.5")
    assert SETTER not in (root / "srt/models/llama.py").read_text()
    assert classify_dflash(root, "LlamaForCausalLM") is None


def test_installed_runner_passes_target_layer_ids_unchanged():
    root = installed_engine("sglang").root
    run = read_dflash_runner(root)
    assert run.verified, run.reason
    text = "\n".join(run.evidence)
    assert f"model.{SETTER}(dflash_target_layer_ids)" in text
    assert "list(self.target_layer_ids)" in text and "'target_layer_ids'" in text
    for line in run.evidence:  # every file:line cited is in the installed file
        path, lineno = line.split(": ", 2)[1].rsplit(":", 1)[0], int(line.split(": ", 2)[1].rsplit(":", 1)[1])
        assert (root / path).is_file() and lineno <= len((root / path).read_text().splitlines())
    assert run.range_check is not None and "target_num_layers" in run.range_check
    assert any("+1" in c and "muse_glimmer" in c for c in run.conditional)  # the Muse rewrite, with its test
    assert "muse_glimmer" in run.conditional_literals


def test_an_edited_setter_changes_the_rule(engine_copy, tmp_path):
    root = engine_copy("sglang", tmp_path / "site")
    _edit(root / "srt/models/llama.py", "self.model.layers_to_capture = [val + 1 for val in layer_ids]",
          "self.model.layers_to_capture = [val for val in layer_ids]", after=f"def {SETTER}")
    cc = classify_dflash(root, "LlamaForCausalLM")
    assert cc is not None and cc.status == "classified" and cc.id_rule is not None and cc.id_rule.name == "+0"


def test_an_unmodelled_runner_step_is_unverified_with_its_line(engine_copy, tmp_path):
    root = _runner_copy(engine_copy, tmp_path)
    assert read_dflash_runner(root).verified
    _edit(root / "srt/speculative/dflash_utils.py", "        return resolved\n",
          "        return [v + 1 for v in resolved]\n", after="def resolve_target_layer_ids")
    run = read_dflash_runner(root)
    assert not run.verified and "srt/speculative/dflash_utils.py:" in (run.reason or "")
    assert "[v + 1 for v in resolved]" in (run.reason or "")


def test_a_runner_without_the_setter_call_is_unverified(engine_copy, tmp_path):
    root = engine_copy("sglang", tmp_path / "site")  # model files only: no runner read
    run = read_dflash_runner(root)
    assert not run.verified and f"no call of {SETTER}" in (run.reason or "")


def test_a_parsed_list_with_any_offset_is_unverified(engine_copy, tmp_path):
    root = _runner_copy(engine_copy, tmp_path)
    # `- 1` has no "+": a text filter took it for "no offset"
    for new in ("[int(x) - 1 for x in layer_ids]", "[int(x) for x in layer_ids if x]", "[int(y) for x in layer_ids]"):
        path = root / "srt/speculative/dflash_utils.py"
        original = path.read_text()
        _edit(path, "parsed_target_layer_ids = [int(x) for x in layer_ids]",
              f"parsed_target_layer_ids = {new}", after="def parse_dflash_draft_config")
        run = read_dflash_runner(root)
        assert not run.verified and new in (run.reason or "") and "not modelled" in (run.reason or ""), new
        path.write_text(original)
    assert read_dflash_runner(root).verified


AUX = "srt/model_executor/model_runner_components/spec_aux_hidden_state.py"
UTILS = "srt/speculative/dflash_utils.py"


def _unverified_by(root: Path, rel: str, old: str, new: str, after: str) -> str:
    """The runner's reason once ``old`` (after ``after``) in ``rel`` becomes ``new``; the file is restored."""
    path = root / rel
    original = path.read_text()
    _edit(path, old, new, after=after)
    try:
        run = read_dflash_runner(root)
    finally:
        path.write_text(original)
    assert not run.verified, f"{new!r} was read as verified"
    return run.reason or ""


def test_a_capture_only_assignment_counts_only_under_an_is_none_test(engine_copy, tmp_path):
    root = _runner_copy(engine_copy, tmp_path)
    cited = [e for e in read_dflash_runner(root).evidence if "only without a draft" in e]
    assert cited and "not spec_algorithm.is_none()" in cited[0] and ": return` (line" in cited[0]
    # is_none still called in the function, but the return no longer guards the assignment
    why = _unverified_by(root, AUX, "        return\n    layer_ids = features.return_aux_hidden_state_layer_ids",
                         "        pass\n    layer_ids = features.return_aux_hidden_state_layer_ids",
                         after="def _resolve_capture_only_aux_hidden_state")
    assert f"{AUX}:" in why and "list(layer_ids)" in why and "a path not modelled" in why


def test_an_in_place_change_of_the_traced_ids_is_unverified(engine_copy, tmp_path):
    root = _runner_copy(engine_copy, tmp_path)
    anchor = "        target_layer_ids = _map_muse_target_layer_ids("
    for change in ("target_layer_ids += [0]", "target_layer_ids.append(0)", "target_layer_ids[0] = 0",
                   "target_layer_ids: list = [0]"):
        why = _unverified_by(root, AUX, anchor, f"        {change}\n{anchor}", after="def _resolve_dflash_aux_hidden_state")
        assert f"{AUX}:" in why and change.split(":")[0].split("[0]")[0] in why and "not modelled" in why, (change, why)
    why = _unverified_by(root, UTILS, "        return resolved\n", "        resolved.reverse()\n        return resolved\n",
                         after="def resolve_target_layer_ids")
    assert "resolved.reverse()" in why and "not modelled" in why


def test_the_default_must_be_the_modules_builder_and_only_without_ids(engine_copy, tmp_path):
    root = _runner_copy(engine_copy, tmp_path)
    why = _unverified_by(root, UTILS, "return build_target_layer_ids(", "return build_other_ids(",
                         after="def resolve_target_layer_ids")
    assert "build_other_ids" in why and "not modelled" in why
    why = _unverified_by(root, UTILS, "        if self.target_layer_ids is None:\n", "        if True:\n",
                         after="def resolve_target_layer_ids")
    assert "build_target_layer_ids" in why and "not modelled" in why


def test_a_classifier_bug_is_named_as_surgeons_never_as_the_engines_refusal(monkeypatch):
    """Code the reader raises on is one unclassified class whose reason says surgeon could not read
    it (issue 34: never the end of the command), never a reason in the engine's name."""
    from surgeon.engines.probes import classify

    def broken(self, target, base):
        raise KeyError("a bug in the classifier")

    monkeypatch.setattr(classify.Classifier, "_classify", broken)
    cc = classify_dflash(installed_engine("sglang").root, "LlamaForCausalLM")
    assert cc is not None and cc.status == "unclassified"
    assert cc.reason == "unreadable: surgeon's reader cannot handle this code (KeyError: 'a bug in the classifier')"

    def refuses(self, target, base):
        raise classify.Unclassifiable("a deliberate refusal")

    monkeypatch.setattr(classify.Classifier, "_classify", refuses)
    cc = classify_dflash(installed_engine("sglang").root, "LlamaForCausalLM")
    assert cc is not None and cc.status == "unclassified" and cc.reason == "a deliberate refusal"


def test_a_rewrite_helper_counts_only_when_it_maps_the_traced_ids(engine_copy, tmp_path):
    root = _runner_copy(engine_copy, tmp_path)
    assert any("_map_muse_target_layer_ids adds +1 when uses_layer_outputs" in c for c in read_dflash_runner(root).conditional)
    why = _unverified_by(root, AUX, "            layer_ids=target_layer_ids,\n", "            layer_ids=[0],\n",
                         after="target_layer_ids = _map_muse_target_layer_ids(")
    assert "does not pass target_layer_ids" in why and f"{AUX}:" in why
    why = _unverified_by(root, AUX, "[i + 1 for i in layer_ids]", "[0 + 1 for i in layer_ids]",
                         after="def _map_muse_target_layer_ids")
    assert "[0 + 1 for i in layer_ids]" in why and "not modelled" in why
