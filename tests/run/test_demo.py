"""`surgeon demo` as a newcomer runs it: the real vLLM engine, a tiny model, a verified dump, a
mis-wiring caught with its heatmap, and the engine left byte-identical."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from surgeon.patch.apply import patch_status

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # end-to-end: real vLLM runs and the demo


def test_demo_runs_end_to_end_and_leaves_the_engine_as_it_was(tmp_path: Path):
    assert not patch_status(engine="vllm")
    work = tmp_path / "demo"
    p = subprocess.run([sys.executable, "-m", "surgeon", "demo", "--workdir", str(work), "--json"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["ok"] and r["reverted_byte_identical"]
    assert [s["verdict"] for s in r["right"]["slots"]] == ["ok"] * 4
    wrong = {s["name"]: (s["declared"], s["matched"], s["verdict"]) for s in r["wrong"]["slots"]}
    assert wrong == {"low": ("embed", "layer_out[1]", "mismatch"), "mid": ("layer_out[1]", "layer_out[3]", "mismatch"),
                     "high": ("layer_out[3]", "layer_out[5]", "mismatch"), "last": ("final_norm", "final_norm", "ok")}
    for key in ("heatmap", "heatmap_right"):
        assert Path(r[key]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert r["route"] == "plugin"  # what `surgeon plan` recommends for the demo spec's dump on vLLM 0.32
    assert "[3/8] planning the capture route" in p.stderr and "[4/8] building the plugin" in p.stderr
    assert "[8/8]" in p.stderr  # progress throughout
    d = r["draft"]  # step 8, offline: the synthetic draft's wiring named and its acceptance measured
    assert d["ok"] and d["infer_wiring"]["wiring"] == d["trained_on"] and d["infer_wiring"]["decided"] and d["drop"] > 0
    assert not patch_status(engine="vllm")


def test_demo_refuses_a_folder_that_is_not_empty(tmp_path: Path):
    (tmp_path / "keep.txt").write_text("mine")
    p = subprocess.run([sys.executable, "-m", "surgeon", "demo", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "not empty" in p.stderr and (tmp_path / "keep.txt").read_text() == "mine"


def test_relabelling_a_self_describing_dump_is_said_in_the_notes(tmp_path: Path):
    """The mis-wired spec checked against a surgeon dump made under the right one: verify checks the
    spec's labels (that is its job) and says they replace the dump's own."""
    import torch

    from surgeon.capture.dumps import write_dump
    from surgeon.core.data import data_file
    from surgeon.core.spec import load_spec
    from surgeon.run.demo import DEMO_SPEC_NAME, _wrong_spec_text
    from surgeon.run.tinymodels import GAP_SCALES, make_tiny_model
    from surgeon.verify.harness import match
    from surgeon.verify.reference import capture_reference, save_reference

    demo_spec = data_file("specs", DEMO_SPEC_NAME)
    right = load_spec(demo_spec)
    model = make_tiny_model("llama", tmp_path / "m", num_layers=8, hidden_size=128, residual_scale=GAP_SCALES["llama"])
    ids = torch.arange(1, 17)
    ref = capture_reference(model, ids)
    save_reference(ref, tmp_path / "ref.safetensors")
    dump = write_dump(tmp_path / "d.safetensors", [(n, right.captures[n], ref.states[right.captures[n]])
                                                    for n in right.dump_slots],
                      input_ids=ids, num_layers=8, spec=right, engine="test", model="tiny")
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(_wrong_spec_text(demo_spec.read_text()))
    r = match(dump, str(tmp_path / "ref.safetensors"), spec=load_spec(wrong))
    assert not r.ok
    assert any("replace the subject's own: low: layer_out[1] -> low: embed" in n for n in r.notes), r.notes
