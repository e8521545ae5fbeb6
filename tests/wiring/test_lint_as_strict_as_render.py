"""`lint` is at least as strict as `render`: what render refuses for an engine (on the real
installed engines), lint reports as an error for that engine, whether or not the engine was asked
for and with or without --strict; --strict adds the answers render gives but marks unverified."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from surgeon.core.errors import BadInput
from surgeon.core.spec import load_spec
from surgeon.wiring.lint import lint_spec
from surgeon.wiring.render import render

SPECS = Path(__file__).resolve().parents[2] / "specs"


def _example(name: str) -> str:
    """An example spec without its pins (both engines checked) or dump layout (any fc point allowed)."""
    text = (SPECS / name).read_text().split("engines:")[0]
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("dumps:"))


LLAMA, KIMI = _example("llama-3.1-8b-eagle3.yaml"), _example("kimi-k2.5-eagle3.yaml")

# Real cases, each refused by render for at least one engine (asserted below), read from the installed source.
CASES = {
    # SGLang 0.5.23 registers Gemma3ForCausalLM with EAGLE-3 capture; vLLM 0.32.0's has none
    "gemma3 (vLLM has no capture)": LLAMA.replace("LlamaForCausalLM", "Gemma3ForCausalLM"),
    # an architecture neither engine has
    "unknown architecture": LLAMA.replace("LlamaForCausalLM", "Qwen4ForCausalLM"),
    # SGLang's llama_eagle3.py never reads norm_before_residual: it would serve the draft without it
    "a norm flag SGLang ignores": LLAMA.replace("fc_in_features: 12288}", "fc_in_features: 12288, "
                                                "norms: {norm_before_residual: true}}"),
    # SGLang captures at a layer's entry: the last layer's output is never captured
    "the last layer's output": LLAMA.replace("high: layer_out[28]", "high: layer_out[31]"),
    # vLLM's deepseek_v2.py adds the residual unguarded before layer 0: the embedding raises
    "embed on vLLM's DeepSeek": KIMI.replace("low: layer_out[2]", "low: embed"),
    "as is": LLAMA,
}


def _refused(spec, engine: str) -> str | None:
    try:
        render(spec, engine)
    except BadInput as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_render_refuses_lint_reports_as_an_error_for_that_engine(case, tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text(CASES[case])
    spec = load_spec(f)
    refused = {e: why for e in ("sglang", "vllm") if (why := _refused(spec, e)) is not None}
    assert bool(refused) == (case != "as is"), refused  # each case is a real refusal of the installed engines
    for strict in (False, True):
        res = lint_spec(spec, strict=strict)  # no engine asked for, none pinned: both checked
        for engine in ("sglang", "vllm"):
            mine = [i for i in res.issues if re.match(rf"{engine}[: ]", i.message)]
            errors = [i for i in mine if i.severity == "error"]
            if engine in refused:
                assert errors, (case, engine, refused[engine], [str(i) for i in mine])
            else:
                assert not errors, (case, engine, [str(i) for i in errors])
        assert res.ok is (not refused)


def test_strict_still_turns_what_render_marks_unverified_into_an_error(tmp_path):
    """SGLang 0.5.23's Gemma4ForCausalLM captures the last layer's output after its loop, in a value
    the probe does not read to the end: render gives ids marked unverified (not a refusal), so lint
    warns, and --strict makes that warning an error."""
    f = tmp_path / "s.yaml"
    f.write_text(LLAMA.replace("LlamaForCausalLM", "Gemma4ForCausalLM").replace("high: layer_out[28]", "high: layer_out[31]"))
    spec = load_spec(f)
    r = render(spec, "sglang")
    assert r.ids == [1, 15, 31] and not r.verified and "gemma4_causal.py" in (r.unverified_reason or "")
    lax = lint_spec(spec, engines=["sglang"])
    strict = lint_spec(spec, engines=["sglang"], strict=True)
    warned = [i.message for i in lax.issues if i.severity == "warning" and "unverified" in i.message]
    assert lax.ok and warned, [str(i) for i in lax.issues]
    assert not strict.ok and warned == [i.message for i in strict.issues if i.severity == "error"]
