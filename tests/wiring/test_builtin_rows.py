"""Without an engine installed, surgeon answers from its built-in table: never looser than the probe
of the engine it was read from. Every row is what the probe reads for that class (file:line, sites,
evidence, warnings), a class the table has no row for is refused (never another class's row), and
the provenance names the row used, at its line."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

import surgeon.engines.view as view_module
from surgeon.core.conventions import BUILTIN, BUILTIN_READ_FROM, ENGINE_INSTALL
from surgeon.core.errors import BadInput
from surgeon.core.spec import SpecError, load_spec
from surgeon.engines.view import EngineView, open_engine
from surgeon.wiring.lint import lint_spec
from surgeon.wiring.render import render
from tests.conftest import release_engine

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"


@pytest.fixture
def no_engines(monkeypatch):
    """Every engine command as where neither engine is installed: views without a probe."""
    def missing(*_a, **_k):
        raise view_module.ProbeError("not installed in this environment")

    monkeypatch.setattr(view_module, "locate_engine", missing)


@pytest.mark.parametrize("key", sorted(BUILTIN), ids=lambda k: f"{k[0]}-{k[1]}")
def test_each_row_is_what_the_probe_reads_in_the_release_it_names(key):
    engine, cls = key
    row = BUILTIN[key]
    probed = open_engine(engine).class_convention(cls)  # the installed engine: the release the table names
    assert probed.engine == engine and replace(probed, reason=row.reason) == row, (engine, cls)
    assert row.line > 0 and f"{row.path}:{row.line} {cls}" in row.reason and BUILTIN_READ_FROM[engine] in row.reason
    if engine == "vllm":  # vllm 0.33.0 gives the same answers (its interfaces.py setter lines moved)
        newer = open_engine(engine, release_engine("vllm", "0.33.0")).class_convention(cls)
        assert replace(newer, reason=row.reason, evidence=row.evidence) == row, cls


def test_a_class_the_table_has_no_row_for_is_refused_with_advice_a_wheel_user_can_follow():
    for engine in ("sglang", "vllm"):
        view = EngineView(engine, None, None)
        for cls in ("Qwen4ForCausalLM", "Gemma3ForCausalLM"):  # made up; real, but not in the table
            with pytest.raises(BadInput) as e:
                view.convention(cls)
            msg = str(e.value)
            assert f"no row for {cls}" in msg and ENGINE_INSTALL[engine] in msg and "--engine-root" in msg
            assert "scripts/" not in msg and "REFERENCE" not in msg
        assert view.convention("LlamaForCausalLM").cc is BUILTIN[(engine, "LlamaForCausalLM")]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_origin_names_the_row_used_at_its_line(engine):
    conv = EngineView(engine, None, None).convention("DeepseekV3ForCausalLM")
    row = BUILTIN[(engine, "DeepseekV3ForCausalLM")]
    assert f"{row.path}:{row.line} DeepseekV3ForCausalLM" in conv.origin and "deepseek_v2.py" in conv.origin
    assert "llama.py" not in conv.origin and not re.search(r":0\b", conv.origin)


def _variants(spec_file: Path) -> list[tuple[str, str]]:
    """The spec and edge variants of its fc input: the embedding first, the last layer's output."""
    text = spec_file.read_text().split("engines:")[0]  # no pins: the architecture decides the class
    text = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("dumps:"))
    spec = load_spec(spec_file)
    last = f"layer_out[{spec.num_layers - 1}]"
    first = spec.fc_names[0]
    out = [("as is", text)]
    out.append(("embed", re.sub(rf"(\n  {first}: )\S+", r"\1embed", text, count=1)))
    out.append(("last layer", re.sub(rf"(\n  {spec.fc_names[-1]}: )\S+", rf"\g<1>{last}", text, count=1)))
    return out


def _outcome(spec, engine: str) -> tuple:
    try:
        r = render(spec, engine)
    except BadInput as e:
        return ("refused", re.sub(r"^.*?cannot render for \w+: ", "", str(e)))
    return ("ids", r.ids, [c.captured for c in r.captures], r.evidence)


@pytest.mark.parametrize("spec_file", sorted(SPECS.glob("*.yaml")), ids=lambda p: p.stem)
def test_render_without_the_engines_answers_as_the_probe_does(spec_file, tmp_path, monkeypatch):
    """Same ids, same replayed captures and evidence, or the same refusal, on the built-in table as
    on the installed engines, for each example spec and its edge variants (an embed slot: vLLM's
    deepseek_v2.py cannot capture it; the last layer's output: SGLang's entry captures cannot)."""
    checked = 0
    for label, text in _variants(spec_file):
        f = tmp_path / f"{spec_file.stem}-{label.replace(' ', '-')}.yaml"
        f.write_text(text)
        try:
            spec = load_spec(f)
        except SpecError:  # e.g. the point is captured under another name already
            continue
        checked += 1
        for engine in ("sglang", "vllm"):
            with_engine = _outcome(spec, engine)
            with monkeypatch.context() as m:
                m.setattr(view_module, "locate_engine",
                          lambda *a, **k: (_ for _ in ()).throw(view_module.ProbeError("not installed")))
                without = _outcome(spec, engine)
            assert without == with_engine, (spec_file.stem, label, engine)
    assert checked >= 2


def test_lint_without_engines_refuses_an_architecture_the_table_does_not_know(tmp_path, no_engines):
    text = (SPECS / "llama-3.1-8b-eagle3.yaml").read_text().split("engines:")[0]
    f = tmp_path / "q.yaml"
    f.write_text(text.replace("LlamaForCausalLM", "Qwen4ForCausalLM"))
    res = lint_spec(load_spec(f))
    errors = [i for i in res.issues if i.severity == "error"]
    assert not res.ok and {i.path for i in errors} == {"target.architecture"} and len(errors) == 2
    line_no = next(n for n, line in enumerate(text.splitlines(), 1) if "architecture:" in line)
    assert all(i.line == line_no and i.col == text.splitlines()[line_no - 1].index("LlamaForCausalLM") + 1 for i in errors)
    assert all("no row for Qwen4ForCausalLM" in i.message for i in errors)
    for strict in (False, True):  # the same with --strict: not a warning that --strict alone turns into an error
        assert not lint_spec(load_spec(f), strict=strict).ok
    f.write_text(text)  # the same spec on an architecture the table has: fine
    assert lint_spec(load_spec(f)).ok
