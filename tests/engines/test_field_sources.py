"""NVIDIA Model Optimizer probed from its real wheel (scripts/fetch-engines unpacks it into
.engines/nvidia-modelopt-0.47.0, never imported), and the cited tables of TensorRT-LLM and of Model
Optimizer's collection scripts (not pip-downloadable: see surgeon/engines/facts/field_tables.py).

Expected answers were read by hand from nvidia-modelopt 0.47.0:
- torch/speculative/plugins/hf_eagle.py:63 `return sorted({1, max(0, num_layers // 2 - 1), max(0, num_layers - 4)})`
- torch/speculative/plugins/hf_eagle.py:405-406 a forward hook on decoder layer k for each listed k
- torch/speculative/plugins/modeling_dflash.py:158-169 build_target_layer_ids; hf_dflash.py:1073 documents
  [1, 9, 17, 25, 33] for a 36-layer target and a 5-layer draft
- torch/speculative/plugins/hf_dflash.py:982-983 `offset = 1`, `hidden_states[lid + offset]`
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from surgeon.core.conventions import NotExpressible
from surgeon.core.errors import BadInput
from surgeon.core.points import FINAL_NORM, Point, layer_out
from surgeon.engines.facts import modelopt as modelopt_module
from surgeon.engines.facts.field_tables import (
    MODELOPT,
    MODELOPT_HF,
    MODELOPT_TRTLLM,
    TRTLLM,
    TRTLLM_CONV,
    Cite,
    check_against_source,
)
from surgeon.engines.facts.modelopt import EAGLE_FILE, open_modelopt
from surgeon.engines.source.pureeval import NotPure, call_function

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
WHEEL = ROOT / ".engines" / "nvidia-modelopt-0.47.0"


@pytest.fixture(scope="module")
def package() -> Path:
    if not (WHEEL / ".complete").exists():
        pytest.fail(f"nvidia-modelopt 0.47.0 sources are not in {WHEEL}: run ./scripts/setup", pytrace=False)
    return WHEEL / "modelopt"


def _line(package: Path, read) -> str:
    rel = read.path.removeprefix("modelopt/")
    return (package / rel).read_text().splitlines()[read.line - 1]


def test_the_fetched_wheel_is_found_and_read_with_file_lines(package):
    src = open_modelopt(package)
    assert src is not None and src.version == "0.47.0"
    assert str(src.reads["eagle_default"]).startswith("modelopt/torch/speculative/plugins/hf_eagle.py:63:")
    assert "max(0, num_layers // 2 - 1)" in _line(package, src.reads["eagle_default"])
    assert src.reads["eagle_hook"].line == 405
    assert "eagle_aux_hidden_state_layer_ids" in _line(package, src.reads["eagle_hook"])
    assert src.reads["dflash_offset"].line == 983 and "offset = 1" in src.reads["dflash_offset"].says
    assert "lid + offset" in _line(package, src.reads["dflash_offset"])
    assert src.reads["dflash_preset"].path.endswith("modeling_dflash.py")


def test_the_presets_are_what_the_source_computes(package):
    src = open_modelopt(package)
    assert src.eagle_default(61) == [1, 29, 57]  # Kimi-K2.5
    assert src.eagle_default(32) == [1, 15, 28]
    assert src.eagle_default(6) == [1, 2]  # the set merges L//2-1 == L-4
    assert src.dflash_preset(36) == [1, 9, 17, 25, 33]  # hf_dflash.py:1073's own example
    assert src.dflash_preset(61) == [1, 15, 30, 44, 58]
    with pytest.raises(BadInput, match="build_target_layer_ids.*raises"):
        src.dflash_preset(3)  # fewer target layers than draft layers: the source raises


def test_a_preset_value_cites_the_return_that_produced_it(package):
    """build_target_layer_ids returns early for one draft layer (modeling_dflash.py:164-165): the
    value is cited by the return executed, not by the body's last one."""
    src = open_modelopt(package)
    ids, read = src.dflash_preset_cited(36, 1)
    assert ids == [18] and read.line == 165 and "return [num_target_layers // 2]" in _line(package, read)
    ids, read = src.dflash_preset_cited(36)
    assert ids == [1, 9, 17, 25, 33] and read.line == 169 and "for i in range(num_draft_layers)" in _line(package, read)
    assert "build_target_layer_ids(36, 5) = [1, 9, 17, 25, 33]" in read.says
    ids, read = src.eagle_default_cited(61)
    assert ids == [1, 29, 57] and read.line == 63 and read.path.endswith("hf_eagle.py")
    static = src.reads["dflash_preset"]  # no arguments: every return, each with its line
    assert static.line == 158 and "165: `return [num_target_layers // 2]`" in static.says
    assert "169: `return [round(" in static.says


@pytest.mark.parametrize(("body", "found"), [
    ("offset = 1\n    return [out.hidden_states[lid + offset] for lid in self.target_layer_ids]", True),
    ("offset = 1\n    xs = []\n    for lid in self.target_layer_ids:\n        xs.append(out.hidden_states[lid + offset])"
     "\n    return xs", True),
    ("offset = 1\n    return [out.hidden_states[i + offset] for i in range(3)]", False),  # not the target ids
    ("offset = 1\n    return [out.hidden_states[k + offset] for lid in self.target_layer_ids]", False),  # not its loop variable
    ("offset = 1\n    offset = 2\n    return [out.hidden_states[lid + offset] for lid in self.target_layer_ids]", False),
    ("offset = n\n    return [out.hidden_states[lid + offset] for lid in self.target_layer_ids]", False),  # not a literal
])
def test_the_dflash_offset_is_read_only_where_it_indexes_target_layer_ids(body, found):
    tree = ast.parse(f"def forward(self, out, n):\n    {body}\n")
    read = modelopt_module._dflash_offset(tree, "modelopt/x.py")
    assert (read is not None) == found
    if found:
        assert read is not None and "for lid in target_layer_ids, with offset = 1" in read.says


def test_the_working_directory_does_not_choose_the_source(package, tmp_path, monkeypatch):
    """A .engines under the directory the command runs from is not a candidate: the answer is the
    repository's fetched wheel wherever surgeon runs."""
    decoy = tmp_path / ".engines" / "nvidia-modelopt-99.0.0"
    shutil.copytree(package / "torch/speculative/plugins", decoy / "modelopt/torch/speculative/plugins")
    (decoy / ".complete").write_text("")
    monkeypatch.chdir(tmp_path)
    assert all(tmp_path not in p.parents for p in modelopt_module.candidates())
    src = open_modelopt()
    assert src is not None and src.version == "0.47.0" and src.root == package.resolve()


def test_the_probe_follows_the_source_not_a_copy(package, tmp_path):
    """A release whose default differs gives a different answer: the body is evaluated."""
    fake = tmp_path / "modelopt"
    shutil.copytree(package / "torch/speculative/plugins", fake / "torch/speculative/plugins")
    path = fake / EAGLE_FILE
    text = path.read_text()
    assert "max(0, num_layers - 4)" in text
    path.write_text(text.replace("max(0, num_layers - 4)", "max(0, num_layers - 3)"))
    modelopt_module._read.cache_clear()
    src = open_modelopt(tmp_path)
    assert src is not None and src.eagle_default(61) == [1, 29, 58]


def test_a_root_that_is_not_model_optimizer_is_refused(tmp_path):
    with pytest.raises(BadInput, match="not a Model Optimizer source"):
        open_modelopt(tmp_path)


def test_the_evaluator_refuses_what_it_does_not_model():
    fn = ast.parse("def f(n):\n    import os\n    return n\n").body[0]
    assert isinstance(fn, ast.FunctionDef)
    with pytest.raises(NotPure, match="Import is not modelled"):
        call_function(fn, 3)
    fn = ast.parse("def f(n):\n    return open(n)\n").body[0]
    assert isinstance(fn, ast.FunctionDef)
    with pytest.raises(NotPure, match="open"):
        call_function(fn, "x")


@pytest.mark.parametrize("L", range(8, 130))
def test_trtllm_default_equals_model_optimizers_eagle_preset(package, L):
    """Model Optimizer's trtllm backend relies on its preset being TensorRT-LLM's default
    (1, N//2-1, N-4): the table against the real wheel (equal from 8 layers; below, TRT-LLM's
    tuple keeps a duplicate that the preset's set merges)."""
    src = open_modelopt(package)
    table = [p.index for p in TRTLLM_CONV.decode(None, L)]
    assert table == src.eagle_default(L)


def test_trtllm_ids_are_layer_outputs_sorted_and_minus_one_is_the_last_state():
    L = 61
    assert TRTLLM_CONV.encode([layer_out(2), layer_out(30), layer_out(60)], L) == [2, 30, 60]
    assert TRTLLM_CONV.to_id(FINAL_NORM, L) == -1 and TRTLLM_CONV.to_point(-1, L) == FINAL_NORM
    with pytest.raises(NotExpressible, match="ascending layer order"):
        TRTLLM_CONV.encode([layer_out(30), layer_out(2)], L)  # eagle3.py:139 sorts the set
    with pytest.raises(NotExpressible, match="nothing captures before layer 0"):
        TRTLLM_CONV.to_id(Point("embed"), L)


def test_model_optimizer_hf_backend_reads_hidden_states_k_plus_one():
    """compute_hidden_states_hf.py:187 hidden_states[lid + 1]: id L-1 is the final norm's output."""
    L = 61
    assert MODELOPT_HF.encode([layer_out(2), layer_out(30), layer_out(58)], L) == [2, 30, 58]
    assert MODELOPT_HF.to_point(60, L) == FINAL_NORM
    with pytest.raises(NotExpressible):
        MODELOPT_HF.to_id(layer_out(60), L)  # not in the HF tuple
    with pytest.raises(NotExpressible, match="0 <= i < L"):
        MODELOPT_TRTLLM.to_id(FINAL_NORM, L)
    assert MODELOPT_TRTLLM.to_id(layer_out(60), L) == 60  # TRT-LLM captures the last layer's output


def test_every_cite_names_a_file_and_a_needle():
    for cite in [*TRTLLM.values(), *MODELOPT.values()]:
        assert cite.path.endswith(".py") and cite.needle and cite.commit
        assert str(cite).startswith(cite.repo)


def test_the_source_check_finds_moved_and_missing_facts(tmp_path):
    src = tmp_path / "a.py"
    src.write_text("x = 1\nreturn hidden_states[lid + 1]\n")
    cites = {
        "ok": Cite("r", "c", "a.py", 2, "hidden_states[lid + 1]", ""),
        "moved": Cite("r", "c", "a.py", 1, "hidden_states[lid + 1]", ""),
        "gone": Cite("r", "c", "a.py", None, "hidden_states[-1]", ""),
        "absent": Cite("r", "c", "b.py", 3, "x", ""),
    }
    problems = check_against_source(cites, tmp_path)
    assert [p.split(":")[0] for p in problems] == ["moved", "gone", "absent"]
    assert "found at line 2" in problems[0]


def test_the_table_checker_command(tmp_path, capsys):
    from surgeon.engines.facts.field_tables import main

    assert main(["nope", str(tmp_path)]) == 2
    (tmp_path / "examples/speculative_decoding/collect_hidden_states").mkdir(parents=True)
    assert main(["modelopt", str(tmp_path)]) == 3  # an empty checkout confirms nothing
    out = capsys.readouterr().out
    assert f"modelopt: 0 of {len(MODELOPT)} facts confirmed" in out
