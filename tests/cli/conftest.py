"""Fixtures of the CLI tests: a tiny random model's reference and a dump written from it."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "specs" / "demo-tiny-llama-eagle3.yaml"
IDS = list(range(3, 30))


@pytest.fixture(scope="session")
def harness(tmp_path_factory):
    """The demo spec's tiny random Llama, its HF reference, and a dump holding the spec's points."""
    import torch

    from surgeon.capture.dumps import write_dump
    from surgeon.core.spec import load_spec
    from surgeon.run.tinymodels import make_tiny_model
    from surgeon.verify.reference import capture_reference, save_reference

    work = tmp_path_factory.mktemp("contract")
    spec = load_spec(DEMO)
    model = make_tiny_model("llama", work / "model", num_layers=spec.num_layers, hidden_size=spec.hidden_size)
    ref = capture_reference(model, torch.tensor(IDS))
    save_reference(ref, work / "ref.safetensors")
    caps = [(n, spec.captures[n], ref.states[spec.captures[n]]) for n in spec.dump_slots]
    write_dump(work / "dump.safetensors", caps, input_ids=torch.tensor(IDS), num_layers=spec.num_layers, spec=spec,
               engine="vllm", engine_version="0.32.0", model=str(model))
    return work
