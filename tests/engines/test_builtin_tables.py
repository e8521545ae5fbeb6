"""The built-in convention tables (used where an engine is not installed) against the probe of the
installed engines, which are the versions the tables were read from: every warning the probe gives
(a path that runs layers without captures) and every field that decides what ids capture must be
the table's too, so the two cannot drift apart silently."""

from __future__ import annotations

from pathlib import Path

import pytest

import surgeon.wiring.lint as lint_module
from surgeon.core.conventions import BUILTIN
from surgeon.core.spec import load_spec
from surgeon.engines.view import EngineView, open_engine

pytestmark = pytest.mark.engine
SPECS = Path(__file__).resolve().parents[2] / "specs"
# "*" rows stand for every class without a row of its own; each is checked on the class it was read from
REPRESENTATIVE = {"sglang": "LlamaForCausalLM", "vllm": "LlamaForCausalLM"}
FIELDS = ("id_rule", "default", "default_through_rule", "sorts", "dedups", "emit_order", "capture_site", "captured_value")


@pytest.mark.parametrize("key", sorted(BUILTIN), ids=lambda k: f"{k[0]}-{k[1]}")
def test_builtin_rows_give_what_the_probe_gives(key):
    engine, cls = key
    table = BUILTIN[key]
    view = open_engine(engine, None)
    assert view.probe is not None, f"{engine} is not installed: run ./scripts/setup"
    probed = view.class_convention(REPRESENTATIVE[engine] if cls == "*" else cls)
    assert table.bypasses == probed.bypasses, f"{engine} {cls}: warnings differ from the probe's"
    for f in FIELDS:
        assert getattr(table, f) == getattr(probed, f), (engine, cls, f)


def test_the_deepseek_two_batch_overlap_warning_is_in_the_table():
    (bypass,) = BUILTIN[("sglang", "DeepseekV3ForCausalLM")].bypasses
    assert bypass.path == "srt/models/deepseek_v2.py" and "model_forward_stages" in bypass.description


def _warnings(spec_file: Path) -> list[str]:
    return [i.message for i in lint_module.lint_spec(load_spec(spec_file)).issues if i.severity == "warning"]


@pytest.mark.parametrize("spec_file", sorted(SPECS.glob("*.yaml")), ids=lambda p: p.stem)
def test_lint_warns_the_same_with_and_without_the_engines(spec_file, monkeypatch):
    with_engines = _warnings(spec_file)
    monkeypatch.setattr(lint_module, "open_engine", lambda engine, root=None: EngineView(engine, None, None))
    without = _warnings(spec_file)
    assert without == with_engines
    if spec_file.stem.startswith("kimi"):
        assert any("model_forward_stages" in w for w in without), without  # the case the table once dropped
