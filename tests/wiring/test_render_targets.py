"""One dispatch for the render targets: every target in RENDER_TARGETS gives ids or a clean reason
(never "unknown render target"), render and the fc-ids function agree because they are one entry,
and the text reports built from the reasons (explain, render, lint) say each thing once: no doubled
"not expressible", no Python None, no ":0" lines, no citation of a file the package does not ship."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from surgeon.cli import main
from surgeon.core.errors import BadInput
from surgeon.core.spec import load_spec
from surgeon.draft.infer import engine_ids
from surgeon.wiring.render import RENDER_TARGETS, TARGETS, fc_ids, render, target_ids
from tests.conftest import cli_run

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))

# What no text output may hold. None: Python's None as a value ("reads None", "x, None"), not engine
# code quoted in backticks or described ("`residual is not None`", "the setter gets None").
BAD = {
    "unknown render target": re.compile(r"unknown render target"),
    "doubled 'not expressible'": re.compile(r"not expressible\b.*\bnot expressible", re.IGNORECASE),
    "'expressible in' stutter": re.compile(r"expressible in \S+: .*expressible", re.IGNORECASE),
    "a :0 line": re.compile(r"\.py:0\b"),
    "a file the package does not ship": re.compile(r"REFERENCE\.md"),
    "checkout-only advice": re.compile(r"scripts/(fetch-engines|setup)|\./scripts/"),
}
NONE = re.compile(r"(?<![\w.])None(?![\w(])")
CODE_NONE = re.compile(r"(?:\bis not|\bis|\bgets|==|!=|=) None\b")


def bad_patterns(text: str) -> list[str]:
    """(pattern name: the line) for every line of ``text`` that holds one."""
    found = []
    for line in text.splitlines():
        found.extend(f"{name}: {line}" for name, rx in BAD.items() if rx.search(line))
        prose = CODE_NONE.sub("", re.sub(r"`[^`]*`", "", line))
        if NONE.search(prose):
            found.append(f"None in text: {line}")
    return found


def test_the_scan_finds_what_the_issue_reported():
    """The patterns catch the messages seen before (so a clean scan below means something)."""
    seen = ["  trtllm: unknown render target 'trtllm'; expected one of sglang, vllm, trtllm",
            "x: not expressible: not expressible in vllm:X: the engine emits captures in ascending layer order",
            "  stated ids, specforge: reads None -> : not checked",
            "  stated ids, sglang: reads [2, 3, 4] -> layer_out[2], None, None: disagrees",
            "sglang cannot capture layer_out[31]: srt/models/llama.py:0: captures at the entry of a layer",
            "eagle (SpecForge and SafeAILab/EAGLE source, as reported in REFERENCE.md: id k = layer_out[k])",
            "modelopt: its source is not on this machine (run scripts/fetch-engines): presets not evaluated"]
    assert all(bad_patterns(line) for line in seen), [line for line in seen if not bad_patterns(line)]
    fine = ["`hidden_states + residual if residual is not None else hidden_states` in _maybe_add_hidden_state",
            "where the config has none the setter gets None (the model's setter default)",
            "  [1] last / vllm: not expressible: aux ids name residual-stream states"]
    assert not any(bad_patterns(line) for line in fine)


def _dflash_spec(tmp_path: Path):
    f = tmp_path / "dflash.yaml"
    f.write_text(textwrap.dedent("""\
        spec: 1
        name: tiny-dflash
        target: {architecture: LlamaForCausalLM, num_layers: 8, hidden_size: 64}
        captures: {low: 'layer_out[1]', mid: 'layer_out[3]', high: 'layer_out[7]'}
        draft: {kind: dflash, fc_input: [low, mid, high], fc_in_features: 192}
        """))
    return load_spec(f)


def _inferred_spec():
    """What infer-wiring writes for the demo's draft (4 layers, layer_out[1..3]): a wiring several
    targets cannot name (SGLang and EAGLE ids stop before the last layer's output)."""
    return load_spec("<inferred spec>", text=textwrap.dedent("""\
        spec: 1
        name: d-inferred
        target: {architecture: LlamaForCausalLM, num_layers: 4, hidden_size: 64}
        captures: {slot0: 'layer_out[1]', slot1: 'layer_out[2]', slot2: 'layer_out[3]'}
        draft: {kind: eagle3, fc_input: [slot0, slot1, slot2], fc_in_features: 192}
        """))


def _specs(tmp_path: Path) -> list:
    return [load_spec(f) for f in SPECS] + [_dflash_spec(tmp_path), _inferred_spec()]


def test_every_target_has_one_entry_and_gives_ids_or_a_clean_reason(tmp_path):
    assert tuple(TARGETS) == RENDER_TARGETS
    kinds = set()
    for spec in _specs(tmp_path):
        for target in RENDER_TARGETS:
            lst = target_ids(spec, target)
            kinds.add(lst.kind)
            if lst.ids is None:
                assert lst.error and lst.kind in ("not_expressible", "refused"), (spec.name, target, lst)
                assert not bad_patterns(lst.error), (spec.name, target, lst.error)
                assert not lst.error.startswith((spec.file, "cannot render")), lst.error  # the reason alone
                with pytest.raises(BadInput) as refused:  # render takes the same entry: it refuses, saying why
                    render(spec, target)
                assert lst.error in str(refused.value) and not bad_patterns(str(refused.value))
            else:
                assert lst.kind is None and lst.error is None
                assert render(spec, target).ids == lst.ids, (spec.name, target)
    assert kinds == {None, "not_expressible", "refused"}  # the cases above reach every kind


def test_infer_wiring_lists_every_target_from_the_dispatch():
    spec = _inferred_spec()
    ids = engine_ids(spec)
    assert list(ids) == list(RENDER_TARGETS)
    for target, row in ids.items():
        assert row == target_ids(spec, target)
        assert (row.ids is None) == (row.error is not None) and not bad_patterns(row.error or "")
    # the demo's draft: vLLM names all three, SGLang cannot capture layer_out[3], z-lab runs DFlash only
    assert ids["vllm"].ids == [2, 3, 4] and ids["trtllm"].ids == [1, 2, 3]
    assert ids["sglang"].kind == "not_expressible" and "layer_out[3]" in (ids["sglang"].error or "")
    assert ids["zlab"].kind == "refused" and "DFlash drafts only" in (ids["zlab"].error or "")


def test_an_unlisted_target_is_bad_input_naming_the_listed_ones(tmp_path):
    spec = load_spec(SPECS[0])
    for ids in (fc_ids, target_ids):
        with pytest.raises(BadInput, match="unknown render target 'tensorrt'; expected one of sglang, vllm"):
            ids(spec, "tensorrt")
    with pytest.raises(BadInput, match="unknown render target"):
        render(spec, "tensorrt")


@pytest.mark.parametrize("spec_file", SPECS, ids=lambda p: p.stem)
def test_text_outputs_of_the_example_specs_hold_none_of_the_bad_patterns(spec_file):
    outputs = {"explain": cli_run("explain", spec_file).output, "lint": cli_run("lint", spec_file).output}
    for target in RENDER_TARGETS:  # zlab refuses the EAGLE-3 specs (exit 2, one line): its text is scanned too
        res = CliRunner().invoke(main, ["render", str(spec_file), "--engine", target])
        assert res.exit_code in (0, 2) and "Traceback" not in res.output, (target, res.output)
        outputs[f"render {target}"] = res.output
    found = {name: bad_patterns(text) for name, text in outputs.items()}
    assert not any(found.values()), {k: v[:3] for k, v in found.items() if v}
