"""`lint --pp`: stage placement from each release's own partition function, and whether captures of
earlier stages reach the draft, read from the real engine sources (installed and fetched releases)."""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from surgeon.cli import main
from surgeon.commands.outputs import OUTPUTS
from surgeon.commands.outputs.specs import PipelineCheck
from surgeon.core.spec import load_spec
from surgeon.engines.probes.pipeline import (
    PipelineUnread,
    check_stages,
    every_rank_capture,
    lint_pipeline,
    loop_index,
    partition,
    pipeline_answer,
)
from surgeon.engines.source.pureeval import NotPure, call_function
from surgeon.engines.view import model_class_for, open_engine
from surgeon.wiring.lint import lint_spec
from tests.conftest import installed_engine, release_engine

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "specs/kimi-k2.5-eagle3.yaml"
LLAMA = ROOT / "specs/llama-3.1-8b-eagle3.yaml"


def _root(engine: str, release: str | None) -> str:
    if release is None:
        return str(installed_engine(engine).root)
    return str(release_engine(engine, release))


def _answer(engine: str, release: str | None, spec_path: Path, pp: int, model_class: str | None = None):
    spec = load_spec(spec_path)
    view = open_engine(engine, None if release is None else _root(engine, release))
    assert view.probe is not None
    cc = view.class_convention(model_class or model_class_for(spec, engine))
    return pipeline_answer(engine, view.probe.root, view.probe.version, cc, spec.fc_points, spec.num_layers, pp)


# -- the partition, evaluated from each release's source -------------------------------------------
@pytest.mark.parametrize(("engine", "release", "expected"), [
    ("vllm", None, [(0, 15), (15, 31), (31, 47), (47, 62)]),  # remainder to all but the last
    ("vllm", "0.11.0", [(0, 15), (15, 31), (31, 47), (47, 62)]),
    ("sglang", None, [(0, 15), (15, 30), (30, 46), (46, 62)]),  # remainder to the last ones
    ("sglang", "0.5.5", [(0, 15), (15, 30), (30, 45), (45, 62)]),  # remainder all to the last
])
def test_partition_is_each_release_own_rule(engine, release, expected):
    stages, where = partition(engine, _root(engine, release), 62, 4)
    assert stages == expected
    assert "get_pp_indices(num_hidden_layers, pp_rank, pp_size)" in where and "PP_LAYER_PARTITION unset" in where


def _vllm_rule(n: int, pp: int) -> list[tuple[int, int]]:
    """vLLM's documented rule, restated: even split, the remainder one each to the partitions
    before the last, nearest the last first."""
    sizes = [n // pp] * pp
    for i in range(n % pp):
        sizes[pp - 2 - i] += 1
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [(s, s + k) for s, k in zip(starts, sizes)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6).flatmap(lambda pp: st.tuples(st.integers(pp, 130), st.just(pp))))
def test_vllm_partition_evaluation_matches_the_rule(case):
    """The evaluator runs the parsed loop, `partitions[-i] += 1` and the slices like Python would."""
    n, pp = case
    stages, _ = partition("vllm", _root("vllm", None), n, pp)
    assert stages == _vllm_rule(n, pp)
    assert stages[0][0] == 0 and stages[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(stages, stages[1:]))


def test_pureeval_refuses_what_it_does_not_model():
    fn = ast.parse("def f(n):\n    return os.environ['X']\n").body[0]
    assert isinstance(fn, ast.FunctionDef)
    with pytest.raises(NotPure):
        call_function(fn, 1)
    fn2 = ast.parse("def f(n):\n    t = (1, 2)\n    t[0] += n\n    return t\n").body[0]
    assert isinstance(fn2, ast.FunctionDef)
    with pytest.raises(NotPure, match="item assignment to a tuple"):
        call_function(fn2, 1)
    fn3 = ast.parse("def f(n):\n    x = envs.X\n    return n if x is None else 0\n").body[0]
    assert isinstance(fn3, ast.FunctionDef)
    assert call_function(fn3, 5, externals={"envs.X": None}) == 5


@pytest.mark.parametrize(("stages", "why"), [
    ([(0, 4), (5, 8)], "rank 1 starts at 5, rank 0 ends at 4"),  # a gap
    ([(0, 5), (4, 8)], "rank 1 starts at 4, rank 0 ends at 5"),  # an overlap
    ([(4, 8), (0, 4)], "rank 0 starts at layer 4"),  # out of order
    ([(0, 4), (4, 7)], "the stages end at 7, not at the 8 layers"),  # short
    ([(0, 4, 1), (4, 8)], "not a (start, end) pair of ints"),
    ([(0, 4.0), (4, 8)], "not a (start, end) pair of ints"),
    ([(0, 6), (6, 4), (4, 8)], "end before start"),
])
def test_partition_result_is_validated(stages, why):
    with pytest.raises(PipelineUnread) as e:
        check_stages(stages, 8, "f.py:1 get_pp_indices")
    assert why in str(e.value) and str(e.value).startswith("f.py:1 get_pp_indices: ")
    assert check_stages([(0, 4), (4, 8)], 8, "x") == [(0, 4), (4, 8)]


def test_a_bad_partition_is_reported_unverified_by_lint(tmp_path):
    """A release whose get_pp_indices leaves a gap: lint says unverified (an error under --strict)."""
    src = tmp_path / "distributed"
    src.mkdir()
    (src / "utils.py").write_text("def get_pp_indices(num_hidden_layers, pp_rank, pp_size):\n"
                                  "    return (pp_rank * 10, pp_rank * 10 + 5)\n")
    with pytest.raises(PipelineUnread, match="rank 1 starts at 10, rank 0 ends at 5"):
        partition("vllm", str(tmp_path), 20, 2)
    spec = load_spec(LLAMA)
    cc = open_engine("vllm").class_convention("LlamaForCausalLM")
    for strict, severity in ((False, "warning"), (True, "error")):
        issues, checked, data = lint_pipeline(spec, "vllm", str(tmp_path), "x", cc, 2, 1, strict=strict)
        assert [i.severity for i in issues] == [severity] and checked == [] and data is None
        assert "vllm: pp 2: unverified: distributed/utils.py:1 get_pp_indices: the evaluated partition" in issues[0].message


def test_pp_larger_than_layers_is_refused():
    with pytest.raises(PipelineUnread, match="exceeds"):
        _answer("vllm", None, KIMI, 99)


# -- forwarding, per engine, release and class ------------------------------------------------------
@pytest.mark.parametrize("release", [None, "0.33.0"])
def test_vllm_deepseek_refused_llama_forwarded(release):
    kimi = _answer("vllm", release, KIMI, 4)
    assert kimi.refused and "supports_aux_hidden_states_over_pp" in kimi.refused
    assert "verify_supports_aux_hidden_states_over_pp raises ValueError" in kimi.refused
    assert [p.stage for p in kimi.placements] == [0, 2, 3]  # layer_out[2], [30], [58]; stages 0..14,15..29,30..45,46..60
    llama = _answer("vllm", release, KIMI, 4, "LlamaForCausalLM")
    assert llama.refused is None and all(p.reaches for p in llama.placements)
    assert "llama.py:358 LlamaModel.supports_aux_hidden_states_over_pp = True" in llama.placements[0].why


def test_vllm_inherited_flag_without_forwarding_is_dropped():
    """qwen3_vl.py's Qwen3LLMModel inherits the flag from qwen2.py's Qwen2Model (so the runner's
    check passes) but overrides forward: its non-last-stage return carries no aux states."""
    ans = _answer("vllm", None, KIMI, 2, "Qwen3VLForConditionalGeneration")
    assert ans.refused is None and ans.placements[0].reaches is False
    why = ans.placements[0].why
    assert "qwen2.py:335 Qwen2Model.supports_aux_hidden_states_over_pp = True" in why
    assert "qwen3_vl.py:1891 the non-last-stage return IntermediateTensors(...) carries no aux states" in why


def test_vllm_011_drops_earlier_stage_captures():
    """Stages 0..30 and 31..60; 0.11's loop index restarts at 0 on stage 1, so indices 31 and 59
    are matched on no stage, and index 3 also matches stage 1's local 3 (global layer 34's entry)."""
    ans = _answer("vllm", "0.11.0", KIMI, 2, "LlamaForCausalLM")
    assert ans.refused is None
    assert [(p.stage, p.reaches) for p in ans.placements] == [(0, False), (None, False), (None, False)]
    assert "carries no aux states" in ans.placements[0].why
    assert "stage 1 (layers 31..60) captures layer_out[33] in its place" in ans.misread[0]
    assert [m.split(":")[0] for m in ans.misread] == [
        "layer_out[2] (capture index 3)", "layer_out[30] (capture index 31)", "layer_out[58] (capture index 59)"]


# -- the loop index: global layer number, or counted from 0 on every stage --------------------------
@pytest.mark.parametrize(("engine", "release", "model_class", "kind", "said"), [
    ("vllm", "0.11.0", "LlamaForCausalLM", "local",
     "llama.py:401 `for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer))`: idx counts "
     "from 0 over the slice starting at self.start_layer: stage-local"),
    ("vllm", None, "LlamaForCausalLM", "global", "llama.py:432 `for idx, layer in enumerate(islice(self.layers, "
     "self.start_layer, self.end_layer), start=self.start_layer)`: enumerate starts at self.start_layer"),
    ("vllm", "0.33.0", "LlamaForCausalLM", "global", "enumerate starts at self.start_layer"),
    ("vllm", None, "Qwen3VLForConditionalGeneration", "global", "it slices enumerate() of all the layers"),
    ("vllm", None, "AfmoeForCausalLM", "local", "afmoe.py:434"),
    ("vllm", None, "Glm5NextForCausalLM", None, "it enumerates something other than a slice of the layers"),
    ("sglang", None, "LlamaForCausalLM", "global", "llama.py:486 `for i in range(self.start_layer, self.end_layer)`"),
    ("sglang", None, "DeepseekV3ForCausalLM", "global",
     "range starts at normal_start_layer = self.start_layer at line 3164"),
    ("sglang", "0.5.5", "DeepseekV3ForCausalLM", "global", "normal_start_layer = self.start_layer at line 2942"),
    ("sglang", None, "Qwen3VLForConditionalGeneration", "global", "line 1233 adds self.start_layer to layer_idx"),
    ("sglang", None, "Qwen3MoeForCausalLM", "global", "tests an attribute of the layer object, not i"),
    ("sglang", None, "LongcatFlashForCausalLM", None, "`for i in range(total_num_layers)`: its shape is not one"),
])
def test_loop_index_is_read_from_the_loop(engine, release, model_class, kind, said):
    view = open_engine(engine, None if release is None else _root(engine, release))
    assert view.probe is not None
    got, how = loop_index(view.probe.root, view.class_convention(model_class))
    assert got == kind and said in how, how


def test_stage_local_index_is_an_error_not_reaches():
    """vLLM 0.11 llama at pp 2 (layers 0..15, 16..31): ids 2, 16, 29 are tested against an index
    counted from 0 on each stage: stage 1 captures layer_out[17] for index 2; 16 and 29 never match."""
    res = CliRunner().invoke(main, ["lint", str(LLAMA), "--engine", "vllm", "--engine-root",
                                    _root("vllm", "0.11.0"), "--pp", "2"])
    assert res.exit_code == 2
    assert re.search(r"(?<!never )reaches the draft", res.output) is None  # only "never reaches", from the drop
    assert "stage 1 (layers 16..31) captures layer_out[17] in its place" in res.output
    assert "layer_out[15] (capture index 16): no stage captures it: model_executor/models/llama.py:401" in res.output
    assert "layer_out[28] (capture index 29): no stage captures it" in res.output
    ans = _answer("vllm", "0.11.0", LLAMA, 2, "LlamaForCausalLM")
    assert not any(p.reaches for p in ans.placements)
    assert not any("reaches the draft" in line for line in ans.lines())
    printed = PipelineCheck.model_validate(ans, from_attributes=True).model_dump(mode="json")
    assert "misread" not in printed and printed["stages"] == [[0, 16], [16, 32]]  # the issues carry the misreads


@pytest.mark.parametrize("release", [None, "0.33.0"])
def test_vllm_global_index_still_reaches(release):
    ans = _answer("vllm", release, LLAMA, 2, "LlamaForCausalLM")
    assert ans.misread == [] and ans.unverified is None
    assert [(p.stage, p.reaches) for p in ans.placements] == [(0, True), (0, True), (1, True)]
    assert any("enumerate starts at self.start_layer" in n for n in ans.notes)


def test_unread_loop_index_is_unverified():
    spec = load_spec(KIMI)
    view = open_engine("sglang")
    assert view.probe is not None
    cc = view.class_convention("LongcatFlashForCausalLM")
    ans = pipeline_answer("sglang", view.probe.root, view.probe.version, cc, spec.fc_points, spec.num_layers, 2)
    assert ans.unverified is not None
    assert "whether the decoder loop's index is the global layer number was not read" in ans.unverified
    assert "longcat_flash.py:619" in ans.unverified
    assert [p.reaches for p in ans.placements if p.layer is not None] == [None] * 3
    for strict, severity in ((False, "warning"), (True, "error")):
        issues, _, _ = lint_pipeline(spec, "sglang", view.probe.root, view.probe.version, cc, 2, 1, strict=strict)
        assert any(i.severity == severity and "loop's index" in i.message for i in issues)


@pytest.mark.parametrize(("release", "refused"), [(None, False), ("0.5.5", True)])
def test_sglang_setter_returns_early_off_the_last_rank(release, refused):
    ans = _answer("sglang", release, KIMI, 2)
    assert bool(ans.refused) is refused
    assert [(p.stage, p.reaches) for p in ans.placements] == [(0, False), (1, True), (1, True)]
    assert "returns at once `if not self.pp_group.is_last_rank`" in ans.placements[0].why
    if refused:
        assert ans.refused is not None and "srt/server_args.py:" in ans.refused


def test_pp_1_everything_reaches():
    ans = _answer("sglang", None, KIMI, 1)
    assert ans.refused is None and all(p.reaches and p.stage == 0 for p in ans.placements)


def test_tp_reads_are_named_not_guessed():
    """vLLM's deepseek_v2 loop all-gathers tp-sharded tokens around its capture: not modelled, so an
    answer at tp > 1 is unverified (naming the lines); llama's setter and loop read no tp state."""
    spec = load_spec(KIMI)
    view = open_engine("vllm")
    assert view.probe is not None
    ds = view.class_convention("DeepseekV3ForCausalLM")
    ans = pipeline_answer("vllm", view.probe.root, view.probe.version, ds, spec.fc_points, spec.num_layers, 2, 8)
    assert ans.unverified == "the capture code reads tensor-parallel state"
    assert "deepseek_v2.py:1564 tensor_model_parallel_all_gather" in ans.notes[-1]
    llama = _answer("vllm", None, KIMI, 2, "LlamaForCausalLM")
    assert llama.unverified is None and "read no tensor-parallel rank or size" in llama.notes[-1]


# -- lint ------------------------------------------------------------------------------------------
def test_lint_pp_errors_at_the_fc_input():
    spec = load_spec(KIMI)
    res = lint_spec(spec, engines=["sglang"], pp=2)
    errors = [i for i in res.issues if i.severity == "error" and "pp 2" in i.message]
    assert len(errors) == 1 and "layer_out[2] is captured on stage 0" in errors[0].message
    assert (errors[0].line, errors[0].col) == (13, 33)
    assert res.pipeline and res.pipeline[0].pp == 2
    ok = lint_spec(load_spec(LLAMA), engines=["vllm"], pp=2)
    assert ok.ok and any("reaches the draft" in c for c in ok.checked)


def test_cli_lint_pp_json():
    res = CliRunner().invoke(main, ["lint", str(KIMI), "--engine", "vllm", "--pp", "4", "--tp", "8", "--json"])
    assert res.exit_code == 2, res.output
    data = json.loads(res.stdout)
    OUTPUTS["lint"].model_validate(data)  # the documented, closed JSON shape
    [check] = data["specs"][0]["pipeline"]
    assert check["pp"] == 4 and check["tp"] == 8 and check["refused"]
    assert any(n.startswith("tp 8: the capture code reads tensor-parallel state") for n in check["notes"])
    assert check["unverified"] == "the capture code reads tensor-parallel state"
    assert CliRunner().invoke(main, ["lint", str(LLAMA), "--engine", "vllm", "--pp", "2"]).exit_code == 0


# -- a capture before the decoder loop that every rank makes ----------------------------------------
VL_SPEC = """\
spec: 1
name: vl
target: {architecture: ARCH, num_layers: 36, hidden_size: 4096}
captures:
  e: embed
  mid: layer_out[17]
  high: layer_out[32]
  last: final_norm
draft: {kind: eagle3, fc_input: [e, mid, high]}
"""


def _vl_answer(tmp_path, arch: str, root: str | None = None):
    f = tmp_path / f"{arch}.yaml"
    f.write_text(VL_SPEC.replace("ARCH", arch))
    spec = load_spec(f)
    view = open_engine("vllm", root)
    assert view.probe is not None
    cc = view.class_convention(arch)
    return view, cc, pipeline_answer("vllm", view.probe.root, view.probe.version, cc, spec.fc_points, 36, 2)


@pytest.mark.parametrize(("arch", "file"), [("Qwen3VLForConditionalGeneration", "qwen3_vl.py"),
                                            ("Gemma4ForCausalLM", "gemma4.py")])
def test_vllm_embed_capture_on_every_rank_is_placed_as_the_source_does(tmp_path, arch, file):
    """vLLM 0.32's qwen3_vl and gemma4 call ``_maybe_add_hidden_state([], 0, ...)`` outside any
    ``is_first_rank`` test: stage 0 captures embed, and stage 1 (the draft's) captures at the same
    index the state it received from stage 0, layer_out[17], in its place. llama captures it only on
    the first rank."""
    installed_engine("vllm")
    view, cc, ans = _vl_answer(tmp_path, arch)
    every = every_rank_capture(view.probe.root, cc, 0, 36)
    assert every is not None and every[0].startswith(f"model_executor/models/{file}:")
    site_line = (Path(view.probe.root) / every[0].split(":")[0]).read_text().splitlines()[int(every[0].split(":")[1]) - 1]
    assert "_maybe_add_hidden_state(" in site_line and "is_first_rank" not in site_line
    received = every[1]
    assert received is not None
    line = (Path(view.probe.root) / received.split(":")[0]).read_text().splitlines()[int(received.split(":")[1]) - 1]
    assert 'intermediate_tensors["hidden_states"]' in line
    assert any(m.startswith("embed (capture index 0): the draft's stage captures another state") and
               "stage 1 (layers 18..35) captures layer_out[17] in its place" in m for m in ans.misread)
    assert ans.placements[0].stage == 0 and "every rank" in ans.placements[0].why
    lview, lcc, llama = _vl_answer(tmp_path, "LlamaForCausalLM")
    assert every_rank_capture(lview.probe.root, lcc, 0, 36) is None
    assert not any(m.startswith("embed") for m in llama.misread) and llama.placements[0].reaches is True


def test_a_first_rank_guard_moves_the_embed_capture_back_to_stage_0(engine_copy, tmp_path):
    """Before: a copy of vLLM's qwen3_vl.py captures index 0 on every rank (an error at pp 2).
    After: the same call put under ``if get_pp_group().is_first_rank:`` -> stage 0 only, no error."""
    root = engine_copy("vllm")  # model files, and the partition function the placement evaluates
    (root / "distributed").mkdir(exist_ok=True)
    shutil.copy(installed_engine("vllm").root / "distributed" / "utils.py", root / "distributed" / "utils.py")
    _, cc, before = _vl_answer(tmp_path, "Qwen3VLForConditionalGeneration", str(root))
    assert any(m.startswith("embed (capture index 0)") for m in before.misread)
    f = root / "model_executor" / "models" / "qwen3_vl.py"
    text = f.read_text()
    old = "        aux_hidden_states = self._maybe_add_hidden_state([], 0, hidden_states, residual)\n"
    assert text.count(old) == 1
    guarded = ("        aux_hidden_states = []\n        if get_pp_group().is_first_rank:\n"
               "            aux_hidden_states = self._maybe_add_hidden_state([], 0, hidden_states, residual)\n")
    f.write_text(text.replace(old, guarded))
    view, cc, after = _vl_answer(tmp_path, "Qwen3VLForConditionalGeneration", str(root))
    assert every_rank_capture(view.probe.root, cc, 0, 36) is None
    assert not any(m.startswith("embed") for m in after.misread)
    assert after.placements[0].stage == 0 and "every rank" not in after.placements[0].why


def _guarded_qwen3_vl(engine_copy, tmp_path, guard: str):
    """A copy (under a fresh folder) of the installed vLLM with qwen3_vl.py's index-0 capture put
    under ``guard`` (``{call}`` stands for the capture, indented under the guard's branch)."""
    root = engine_copy("vllm", tmp_path / f"site-{len(list(tmp_path.glob('site-*')))}")
    (root / "distributed").mkdir(exist_ok=True)
    shutil.copy(installed_engine("vllm").root / "distributed" / "utils.py", root / "distributed" / "utils.py")
    f = root / "model_executor" / "models" / "qwen3_vl.py"
    text = f.read_text()
    old = "        aux_hidden_states = self._maybe_add_hidden_state([], 0, hidden_states, residual)\n"
    assert text.count(old) == 1
    call = "            aux_hidden_states = self._maybe_add_hidden_state([], 0, hidden_states, residual)\n"
    f.write_text(text.replace(old, "        aux_hidden_states = []\n" + guard.format(call=call)))
    return root


@pytest.mark.parametrize("guard", ["        if not get_pp_group().is_first_rank:\n{call}",
                                   "        if get_pp_group().is_first_rank:\n            pass\n        else:\n{call}"])
def test_a_capture_only_later_ranks_make_is_not_placed_on_stage_0(engine_copy, tmp_path, guard):
    """Before (the first-rank guard): stage 0 only, no error. After: the same capture under ``if
    not ...is_first_rank`` or in the ``else`` of ``if ...is_first_rank`` -> the first rank skips
    it, and the draft's stage captures at index 0 the state it received (layer_out[17]): an error,
    not "stage 0"."""
    root = _guarded_qwen3_vl(engine_copy, tmp_path, "        if get_pp_group().is_first_rank:\n{call}")
    view, cc, before = _vl_answer(tmp_path, "Qwen3VLForConditionalGeneration", str(root))
    assert before.placements[0].stage == 0 and not any(m.startswith("embed") for m in before.misread)
    root = _guarded_qwen3_vl(engine_copy, tmp_path, guard)
    view, cc, after = _vl_answer(tmp_path, "Qwen3VLForConditionalGeneration", str(root))
    assert every_rank_capture(view.probe.root, cc, 0, 36) is None
    assert after.placements[0].stage == 1 and "later ranks only" in after.placements[0].why
    errors = [m for m in after.misread if m.startswith("embed (capture index 0): the draft's stage captures another")]
    assert len(errors) == 1 and "stage 0 (layers 0..17) does not make it" in errors[0]
    assert "stage 1 (layers 18..35) captures layer_out[17] in its place" in errors[0]


def test_a_capture_under_an_undecided_rank_test_is_unverified(engine_copy, tmp_path):
    """After: ``if get_pp_group().is_first_rank or self.some_flag:`` -> which ranks make the capture
    is not decided by the rank alone: unverified (was: stage 0, verified)."""
    root = _guarded_qwen3_vl(engine_copy, tmp_path, "        if get_pp_group().is_first_rank or self.some_flag:\n{call}")
    _, _, after = _vl_answer(tmp_path, "Qwen3VLForConditionalGeneration", str(root))
    assert after.placements[0].reaches is None and not any(m.startswith("embed") for m in after.misread)
    assert after.unverified is not None and "which pipeline ranks make the capture" in after.unverified
