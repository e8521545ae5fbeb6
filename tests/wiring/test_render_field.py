"""`surgeon render` for the cited-table targets (trtllm, modelopt-hf|trtllm|vllm, zlab) and the
DFlash ids of the trainer configs (specforge, speculators): each convention checked against its
cited table, and the same points compared across targets where the answers differ."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from surgeon.commands.outputs import RenderOutput
from surgeon.core.conventions import HF
from surgeon.core.errors import BadInput
from surgeon.core.points import FINAL_NORM, layer_out, parse_point
from surgeon.core.spec import load_spec
from surgeon.engines.facts.dflash_trainers import SPECFORGE, TABLES, ZLAB, ZLAB_CONV
from surgeon.engines.facts.field_tables import TRTLLM, TRTLLM_CONV, check_against_source
from surgeon.engines.probes.sglang import DFLASH_SETTER
from surgeon.wiring import render_field
from surgeon.wiring.render import RENDER_TARGETS, explain, render
from tests.conftest import cli_run, installed_engine, tiny_spec

KIMI = Path(__file__).resolve().parents[2] / "specs" / "kimi-k2.5-eagle3.yaml"


def _spec(tmp_path, points=("layer_out[1]", "layer_out[3]", "layer_out[5]"), kind="dflash", fc="[low, mid, high]"):
    """A tiny 8-layer Llama spec; ``fc`` may name ``last`` (final_norm)."""
    return load_spec(tiny_spec(tmp_path, fc=fc, points=points, kind=kind))


# -- TensorRT-LLM ---------------------------------------------------------------------------------
def test_trtllm_renders_the_kimi_layer_outputs_as_eagle_decoding_config():
    spec = load_spec(KIMI)
    r = render(spec, "trtllm")
    assert r.ids == [2, 30, 58] and r.verified
    cfg = r.draft_config["speculative_config"]
    assert cfg["eagle3_layers_to_capture"] == [2, 30, 58] and cfg["decoding_type"] == "Eagle"
    # every key written is a field the cited source declares
    assert "eagle3_layers_to_capture" in TRTLLM["fields"].needle and "speculative_model_dir" in TRTLLM["model_dir"].needle
    assert "eagle3_one_model=True" in TRTLLM["one_model_only"].needle and cfg["eagle3_one_model"] is True
    assert r.launch_flags == ["--extra_llm_api_options", "<OPTIONS>.yaml"]
    assert any("not read from an installed source" in n for n in r.notes)
    assert str(TRTLLM["one_model_sorts"]) in r.evidence and str(TRTLLM["fields"]) in r.evidence
    # the same points: SGLang and vLLM name them one higher, TensorRT-LLM by the layer itself
    assert render(spec, "vllm").ids == [3, 31, 59] and render(spec, "sglang").ids == [3, 31, 59]


@pytest.mark.parametrize(("points", "fc", "kind", "why"), [
    (("embed", "layer_out[3]", "layer_out[5]"), "[low, mid, high]", "eagle3", "nothing captures before layer 0"),
    (("layer_out[5]", "layer_out[1]", "layer_out[3]"), "[low, mid, high]", "eagle3", "ascending layer order"),
    (("layer_out[1]", "layer_out[3]", "layer_out[5]"), "[low, mid, high]", "dflash", "DFlash path .* not modelled"),
])
def test_trtllm_refuses_what_it_cannot_express(tmp_path, points, fc, kind, why):
    with pytest.raises(BadInput, match=why):
        render(_spec(tmp_path, points, kind, fc), "trtllm")


def test_trtllm_ids_follow_the_tables_order_rule(tmp_path, monkeypatch):
    """TensorRT-LLM takes a set and sorts it (TRTLLM['sorted']): fc_input out of layer order is
    refused, citing that line. After: the same table with an order-keeping rule (and the cite moved)
    -> the same spec renders its ids in fc order and the refusal cites the new line: the answer
    follows the table, not a constant in the renderer."""
    spec = _spec(tmp_path, ("layer_out[5]", "layer_out[1]", "layer_out[3]"), "eagle3")
    with pytest.raises(BadInput) as before:
        render(spec, "trtllm")
    assert str(TRTLLM["sorted"]) in str(before.value) and f"{TRTLLM['sorted'].path}:139" in str(before.value)
    monkeypatch.setitem(TRTLLM, "sorted", dataclasses.replace(TRTLLM["sorted"], line=140))
    with pytest.raises(BadInput, match=f"{TRTLLM['sorted'].path}:140"):
        render(spec, "trtllm")
    monkeypatch.setattr(render_field, "TRTLLM_CONV", dataclasses.replace(TRTLLM_CONV, keeps_order=True))
    r = render(spec, "trtllm")
    assert r.ids == [5, 1, 3] and r.draft_config["speculative_config"]["eagle3_layers_to_capture"] == [5, 1, 3]
    # -1 is the post-norm state (llm_args.py): it decodes to final_norm, and layer ids are the layer itself
    assert TRTLLM_CONV.to_point(-1, 8) == FINAL_NORM and TRTLLM_CONV.encode([layer_out(1), layer_out(7)], 8) == [1, 7]


def test_trtllm_refusal_is_one_line_exit_2(tmp_path):
    spec = _spec(tmp_path, ("embed", "layer_out[3]", "layer_out[5]"), "eagle3")
    err = cli_run("render", spec.file, "--engine", "trtllm", code=2).stderr
    assert err.count("\n") == 1 and "cannot render for trtllm" in err


# -- Model Optimizer's collection backends ---------------------------------------------------------
def test_modelopt_targets_render_the_lists_explain_shows():
    spec = load_spec(KIMI)
    ex = explain(spec)
    got = {t: render(spec, t) for t in ("modelopt-hf", "modelopt-trtllm", "modelopt-vllm")}
    for t, r in got.items():
        assert r.ids == ex.fc_lists[t].ids and r.launch_flags == ["--aux-layers", ",".join(map(str, r.ids))]
    # one list, two meanings: through vLLM the same points need ids one higher (the hazard explain lints)
    assert got["modelopt-hf"].ids == got["modelopt-trtllm"].ids == [2, 30, 58]
    assert got["modelopt-vllm"].ids == [3, 31, 59]
    assert any("hazard" in n for n in got["modelopt-vllm"].notes)
    last = {t: (r.dump or {}).get("hidden_states") for t, r in got.items()}
    assert last == {"modelopt-hf": "final_norm", "modelopt-trtllm": "final_norm", "modelopt-vllm": "layer_out[60]"}


# -- DFlash: z-lab, SpecForge, speculators ---------------------------------------------------------
def test_zlab_ids_are_the_cited_hidden_states_offset(tmp_path, monkeypatch):
    """dflash/model.py:43-44 reads hidden_states[layer_id + offset], offset = 1: the convention is
    HF's index minus the cited offset. After: the table citing ``offset = 0`` -> the same points
    render one higher (HF's own indices), so the ids follow the cited line."""
    assert render(_spec(tmp_path), "zlab").ids == [1, 3, 5]
    with monkeypatch.context() as m:
        m.setitem(ZLAB, "offset", dataclasses.replace(ZLAB["offset"], needle="offset = 0"))
        after = render(_spec(tmp_path), "zlab")
        assert after.ids == [2, 4, 6] and [c.captured for c in after.captures] == ["layer_out[1]", "layer_out[3]",
                                                                                      "layer_out[5]"]
    for p in ("embed", "layer_out[0]", "layer_out[6]", "final_norm"):
        point = parse_point(p)
        assert HF.to_point(ZLAB_CONV.to_id(point, 8) + 1, 8) == point
    r = render(_spec(tmp_path), "zlab")
    assert r.draft_config == {"dflash_config": {"target_layer_ids": [1, 3, 5]}} and r.launch_flags == []
    # a list, not a set: z-lab keeps the order
    assert render(_spec(tmp_path, ("layer_out[5]", "layer_out[1]", "layer_out[3]")), "zlab").ids == [5, 1, 3]


def test_zlab_renders_embed_with_the_engines_hazard_and_refuses_the_last_layer(tmp_path):
    r = render(_spec(tmp_path, ("embed", "layer_out[3]", "layer_out[5]")), "zlab")
    assert r.ids == [-1, 3, 5] and [c.captured for c in r.captures][0] == "embed"
    assert any("hazard: id -1" in n for n in r.notes)
    with pytest.raises(BadInput, match="final norm's output"):
        render(_spec(tmp_path, ("layer_out[1]", "layer_out[3]", "layer_out[7]")), "zlab")
    with pytest.raises(BadInput, match="DFlash drafts only"):
        render(_spec(tmp_path, kind="eagle3"), "zlab")


def _sglang_with_dflash_offset(engine_copy, tmp_path, offset: int) -> Path:
    """A copy of the installed SGLang (models and the DFlash runner) whose llama DFlash setter adds
    ``offset`` to each id (the installed one adds 1)."""
    root = engine_copy("sglang", tmp_path / f"sglang-{offset}")
    src = installed_engine("sglang").root
    for sub in ("srt/speculative", "srt/model_executor"):
        shutil.copytree(src / sub, root / sub, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    f = root / "srt" / "models" / "llama.py"
    head, sep, tail = f.read_text().partition(f"def {DFLASH_SETTER}")
    old = "self.model.layers_to_capture = [val + 1 for val in layer_ids]"
    assert sep and old in tail
    f.write_text(head + sep + tail.replace(old, old.replace("+ 1", f"+ {offset}"), 1))
    return root


def test_specforge_dflash_ids_follow_sglangs_setter(engine_copy, tmp_path):
    """SpecForge captures DFlash through SGLang's set_dflash_layers_to_capture (capture.py:99), so
    its ids are SGLang's as probed. Before: a copy of the installed SGLang -> [1, 3, 5]. After: the
    copy's llama setter adds 2 instead of 1 -> SpecForge's ids move with SGLang's, to [0, 2, 4]."""
    spec = _spec(tmp_path)
    assert render(spec, "specforge", engine_root=str(_sglang_with_dflash_offset(engine_copy, tmp_path, 1))).ids == [1, 3, 5]
    root = str(_sglang_with_dflash_offset(engine_copy, tmp_path, 2))
    after = render(spec, "specforge", engine_root=root)
    assert after.ids == render(spec, "sglang", engine_root=root).ids == [0, 2, 4]
    assert after.draft_config == {"dflash_config": {"target_layer_ids": [0, 2, 4]}}


def test_specforge_dflash_ids_are_sglangs(tmp_path):
    """The installed SGLang's DFlash ids, rendered as SpecForge's config."""
    spec = _spec(tmp_path, ("layer_out[0]", "layer_out[2]", "layer_out[6]"))
    r = render(spec, "specforge")
    assert r.ids == render(spec, "sglang").ids == [0, 2, 6]
    assert r.draft_config == {"dflash_config": {"target_layer_ids": [0, 2, 6]}}
    assert str(SPECFORGE["key"]) in r.evidence and any("set_dflash_layers_to_capture" in e for e in r.evidence)
    assert r.launch_flags[0] == "scripts/prepare_hidden_states.py"
    # SGLang's runner decides, not SpecForge's EAGLE rule: embed is refused with SGLang's reason
    with pytest.raises(BadInput, match="val < 0"):
        render(_spec(tmp_path, ("embed", "layer_out[3]", "layer_out[5]")), "specforge")


def test_speculators_dflash_ids_come_from_the_probed_vllm(engine_copy, tmp_path):
    """speculators' DFlash ids are vLLM aux ids, read from the vLLM source, not a table of its own.
    Before: a copy of the installed vLLM -> [2, 4, 6]. After: the copy's llama captures under
    ``idx + 2`` -> the probe cannot tell what the ids mean, and speculators is refused with that
    reason (a renderer that ignored vLLM would still say [2, 4, 6])."""
    spec = _spec(tmp_path)
    root = engine_copy("vllm")
    assert render(spec, "speculators", engine_root=str(root)).ids == [2, 4, 6]
    f = root / "model_executor" / "models" / "llama.py"
    old = "aux_hidden_states, idx + 1, hidden_states, residual"
    assert f.read_text().count(old) == 1
    f.write_text(f.read_text().replace(old, old.replace("+ 1", "+ 2")))
    with pytest.raises(BadInput, match="cannot tell what its ids mean.*idx[ ]?\\+[ ]?2"):
        render(spec, "speculators", engine_root=str(root))


def test_speculators_dflash_ids_are_vllm_aux_ids_one_above_zlab(tmp_path):
    spec = _spec(tmp_path)
    r = render(spec, "speculators")
    zlab = render(spec, "zlab").ids
    assert r.ids == [i + 1 for i in zlab] == [2, 4, 6]  # the converter's i + 1 (converter.py:125)
    assert r.draft_config == {"aux_hidden_state_layer_ids": [2, 4, 6]}
    assert r.launch_flags == ["--target-layer-ids", "2", "4", "6"]
    assert r.dump and r.dump["slots"][-1] == "layer_out[7]"
    # vLLM's own DFlash config names the same points by output-of-layer ids (it adds 1 itself)
    assert render(spec, "vllm").draft_config == {"dflash_config": {"target_layer_ids": zlab}}
    with pytest.raises(BadInput, match="verifier's last state"):
        render(_spec(tmp_path, ("layer_out[1]", "layer_out[3]", "layer_out[7]")), "speculators")


# -- tables, CLI and output schema -----------------------------------------------------------------
def test_trainer_tables_cite_lines_and_the_checker_finds_a_moved_fact(tmp_path):
    for table in TABLES.values():
        for cite in table.values():
            assert cite.line and cite.needle and len(cite.commit) == 40
    cite = ZLAB["offset"]
    (tmp_path / "dflash").mkdir()
    (tmp_path / cite.path).write_text("\n" * (cite.line - 1) + "    offset = 1\n")
    assert check_against_source({"offset": cite}, tmp_path) == []
    (tmp_path / cite.path).write_text("    offset = 1\n")
    assert "found at line 1" in check_against_source({"offset": cite}, tmp_path)[0]


def test_cli_offers_every_render_target_and_the_json_fits_the_schema(tmp_path):
    from surgeon.cli import render as render_command

    choice = next(p for p in render_command.params if p.name == "target")
    assert tuple(choice.type.choices) == RENDER_TARGETS
    for target in ("trtllm", "modelopt-hf", "modelopt-trtllm", "modelopt-vllm"):
        RenderOutput.model_validate(json.loads(cli_run("render", KIMI, "--engine", target, "--json").output))
    for target in ("zlab", "specforge", "speculators"):
        RenderOutput.model_validate(json.loads(cli_run("render", _spec(tmp_path).file, "--engine", target, "--json").output))


@pytest.mark.parametrize("target", ["trtllm", "modelopt-hf", "modelopt-trtllm", "zlab"])
@pytest.mark.parametrize("flag", ["--engine-root", "--model-class"])
def test_table_targets_refuse_engine_flags_they_would_ignore(tmp_path, target, flag):
    """A cited-table target reads no engine: --engine-root / --model-class are refused (one line,
    exit 2), not silently ignored (trtllm and zlab ignored both, modelopt-hf|trtllm --model-class)."""
    spec = _spec(tmp_path) if target == "zlab" else load_spec(KIMI)
    value = str(tmp_path) if flag == "--engine-root" else "SomeOtherForCausalLM"
    err = cli_run("render", spec.file, "--engine", target, flag, value, code=2).stderr
    assert err.count("\n") == 1 and f"{flag} does not apply to {target}" in err
    with pytest.raises(BadInput, match=f"{flag} does not apply to {target}"):
        render(spec, target, **{flag.removeprefix("--").replace("-", "_"): value})


def _cited_tree(root: Path, table: dict) -> None:
    """Under ``root``, each cited file holding each cited line's text (the needle, which is that
    line as read at the cited commit) at its cited line; a fact with no recorded line goes after."""
    files: dict[str, dict[int, str]] = {}
    loose: dict[str, list[str]] = {}
    for cite in table.values():
        if cite.line is None:
            loose.setdefault(cite.path, []).append(cite.needle)
        else:
            files.setdefault(cite.path, {})[cite.line] = cite.needle
    for path in {*files, *loose}:
        lines = files.get(path, {})
        body = [lines.get(i, "") for i in range(1, max(lines, default=0) + 1)] + loose.get(path, [])
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("\n".join(body) + "\n")


@pytest.mark.parametrize(("module", "name", "key", "old", "new"), [
    ("surgeon.engines.facts.field_tables", "trtllm", "sorted", "sorted(list(self.layers_to_capture))",
     "list(self.layers_to_capture)"),
    ("surgeon.engines.facts.field_tables", "modelopt", "hf_aux", "[lid + 1]", "[lid]"),
    ("surgeon.engines.facts.dflash_trainers", "specforge", "setter", "set_dflash_", "set_eagle3_"),
    ("surgeon.engines.facts.dflash_trainers", "speculators", "zlab", "i + 1 for i", "i for i"),
    ("surgeon.engines.facts.dflash_trainers", "zlab", "offset", "offset = 1", "offset = 0")])
def test_the_table_checker_confirms_the_cited_lines_and_reports_an_edited_one(tmp_path, module, name, key, old, new):
    """``python -m MODULE NAME DIR`` on a tree holding every cited line where the table cites it:
    exit 0, all facts confirmed. After: one cited line edited (its text changed) -> exit 3, naming
    that fact and where else its text is (nowhere); after a line inserted above it -> "found at"."""
    import subprocess
    import sys

    from surgeon.engines.facts.field_tables import MODELOPT

    table = {"trtllm": TRTLLM, "modelopt": MODELOPT, **TABLES}[name]
    _cited_tree(tmp_path, table)

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", module, name, str(tmp_path)], capture_output=True, text=True,
                              env={"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PATH": ""})
    ok = check()
    assert ok.returncode == 0 and f"{len(table)} of {len(table)} facts confirmed" in ok.stdout, ok.stdout + ok.stderr
    cite = table[key]
    f = tmp_path / cite.path
    lines = f.read_text().splitlines()
    assert old in lines[cite.line - 1]
    lines[cite.line - 1] = lines[cite.line - 1].replace(old, new)
    f.write_text("\n".join(lines) + "\n")
    edited = check()
    assert edited.returncode == 3 and f"{key}: {cite.path}:{cite.line} does not hold" in edited.stdout
    assert "(not in the file)" in edited.stdout and f"{len(table) - 1} of {len(table)} facts confirmed" in edited.stdout
    _cited_tree(tmp_path, table)
    f.write_text("# a line inserted above\n" + f.read_text())
    moved = check_against_source({key: cite}, tmp_path)
    assert moved == [f"{key}: {cite.path}:{cite.line} does not hold {cite.needle!r} (found at line {cite.line + 1})"]
