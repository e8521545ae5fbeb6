"""Engine pins (issue 7): the ids and offset a deployment relies on, checked against the real
installed engine sources, and against a copy of them whose setter was edited to the other
convention (the kind of change sgl-project/sglang#25454 made)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from surgeon.cli import main
from surgeon.core.conventions import parse_offset
from surgeon.core.spec import SpecError, load_spec
from surgeon.engines.view import open_engine
from surgeon.wiring.lint import lint_files
from surgeon.wiring.pins import check_pins, pin_values, write_pins

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))

DEEPSEEK_RULE = """            if layer_ids and layer_ids[0] == 1:
                self.model.layers_to_capture = [val + 1 for val in layer_ids]
            else:
                self.model.layers_to_capture = list(layer_ids)"""
PLUS_ONE = "            self.model.layers_to_capture = [val + 1 for val in layer_ids]"


def cli(*args, code=None):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in res.output
    if code is not None:
        assert res.exit_code == code, (res.exit_code, res.output)
    return res


@pytest.mark.parametrize("offset", ["+1", "+0", "-2", "+1 if ids[0] == 1 else +0", "+0 if max(ids) == L else +1",
                                    "+1 if max(ids) == L//2-1 else +0"])
def test_offset_names_round_trip(offset):
    assert parse_offset(offset).name == offset


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
def test_every_example_spec_is_pinned_and_its_pins_hold_on_the_real_engines(spec):
    s = load_spec(spec)
    for engine in ("sglang", "vllm"):
        assert s.pin(engine) is not None, f"{spec.name} has no engines.{engine} pin"
        issues, checked = check_pins(s, engine, open_engine(engine))
        assert issues == [], [str(i) for i in issues]
        assert any("capture the spec's fc input on" in c for c in checked), checked


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
def test_example_pins_are_what_render_pin_writes(spec):
    s = load_spec(spec)
    for engine in ("sglang", "vllm"):
        want = pin_values(s, engine)
        pin = s.pin(engine)
        assert {k: getattr(pin, k) for k in want} == want


def test_render_pin_keeps_comments_and_order(tmp_path):
    src = ROOT / "specs/kimi-k2.5-eagle3.yaml"
    f = tmp_path / "kimi.yaml"
    text = src.read_text()
    # strip the pins, then let render --pin write them back
    f.write_text(text.split("engines:")[0])
    cli("render", f, "--engine", "sglang", "--pin", code=0)
    cli("render", f, "--engine", "vllm", "--pin", code=0)
    out = f.read_text()
    assert out.startswith(text.split("spec: 1")[0])  # the header comment survives
    assert "# ordered: name -> physical point" in out and "# the LM head's input" in out
    s = load_spec(f)
    assert list(s.captures) == ["low", "mid", "high", "last"]
    assert s.pin("sglang").ids == [3, 31, 59] and s.pin("sglang").offset == "+1 if ids[0] == 1 else +0"
    assert s.pin("vllm").ids == [3, 31, 59] and s.pin("vllm").offset == "+0"
    # idempotent
    before = f.read_text()
    cli("render", f, "--engine", "sglang", "--pin", code=0)
    assert f.read_text() == before


def test_inconsistent_pins_fail_without_any_engine(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text((ROOT / "specs/kimi-k2.5-eagle3.yaml").read_text().replace(
        "ids: [3, 31, 59], offset: '+1 if ids[0] == 1 else +0'", "ids: [2, 30, 58], offset: '+1 if ids[0] == 1 else +0'", 1))
    s = load_spec(f)
    issues, _ = check_pins(s, "sglang", open_engine("sglang"))
    assert issues and "'low' (fc slot 0, layer_out[2]) would be layer_out[1]" in str(issues[0])


def test_changing_only_the_engines_convention_fails_lint_and_restoring_it_passes(tmp_path, engine_copy):
    site = engine_copy("sglang").parent  # site-packages-like: the package (model files) and its dist-info
    model = site / "sglang/srt/models/deepseek_v2.py"
    original = model.read_text()
    spec = ROOT / "specs/kimi-k2.5-eagle3.yaml"

    res = cli("lint", spec, "--engine", "sglang", "--engine-root", site, code=0)

    assert DEEPSEEK_RULE in original
    model.write_text(original.replace(DEEPSEEK_RULE, PLUS_ONE))
    res = cli("lint", spec, "--engine", "sglang", "--engine-root", site, code=2)
    msg = res.stderr
    assert "sglang 0.5.23 DeepseekV3ForCausalLM" in msg
    assert "turns ids into capture indices by '+1', the pin says '+1 if ids[0] == 1 else +0'" in msg
    for name, was, now in (("low", 2, 3), ("mid", 30, 31), ("high", 58, 59)):
        assert f"'{name}' (fc slot" in msg and f"layer_out[{was}]) would be layer_out[{now}]" in msg
    r = json.loads(cli("lint", spec, "--engine", "sglang", "--engine-root", site, "--json", code=2).stdout)
    assert {i["path"] for i in r["specs"][0]["issues"]} >= {"engines.sglang.offset", "engines.sglang.ids"}

    model.write_text(original)
    cli("lint", spec, "--engine", "sglang", "--engine-root", site, code=0)


def test_an_engine_outside_the_pinned_range_is_an_error(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text((ROOT / "specs/kimi-k2.5-eagle3.yaml").read_text().replace("version: ==0.5.23", "version: '>=0.6'", 1))
    results = lint_files([f], engines=["sglang"])
    assert not results[0].ok
    assert "outside the pinned range '>=0.6'" in str(results[0].issues[0])


def test_without_the_engine_lint_says_the_engine_check_did_not_run(tmp_path, monkeypatch):
    import surgeon.engines.view as engines

    monkeypatch.setattr(engines, "locate_engine", lambda *a, **k: (_ for _ in ()).throw(engines.ProbeError("not installed")))
    r = lint_files([ROOT / "specs/kimi-k2.5-eagle3.yaml"])[0]
    assert r.ok
    assert any("engine check did not run" in c for c in r.checked)


def test_write_pins_refuses_to_write_a_broken_spec(tmp_path):
    f = tmp_path / "s.yaml"
    text = (ROOT / "specs/llama-3.1-8b-eagle3.yaml").read_text()
    f.write_text(text)
    with pytest.raises(SpecError, match="not a PEP 440 version range"):
        write_pins(f, "sglang", {"version": "not a range!"})
    assert f.read_text() == text


def test_review_shows_pin_changes_as_their_own_section(tmp_path):
    old = tmp_path / "old.yaml"
    new = ROOT / "specs/kimi-k2.5-eagle3.yaml"
    old.write_text(new.read_text().replace("ids: [3, 31, 59], offset: '+1 if ids[0] == 1 else +0'",
                                           "ids: [2, 30, 58], offset: '+1'"))
    md = cli("review", old, new, code=0).output
    section = md.split("#### Engine pins")[1]
    assert "| sglang | `ids` | `[2, 30, 58]` | `[3, 31, 59]` |" in section
    assert "| sglang | `offset` | `+1` | `+1 if ids[0] == 1 else +0` |" in section
    assert "[!WARNING]" not in md  # the captures did not change, only the pins


def test_an_offset_dividing_by_zero_is_bad_input(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text((ROOT / "specs/llama-3.1-8b-eagle3.yaml").read_text().replace(
        "offset: '+1'", "offset: '+1 if max(ids) == L//0 else +0'", 1))
    res = cli("lint", f, code=2)
    assert "engines.sglang.offset" in res.stderr and "divides by zero" in res.stderr
