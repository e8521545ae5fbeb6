"""A tiny target and synthetic training sets with seeded faults, made once per test session."""

from __future__ import annotations

import pytest

from surgeon.audit.synthetic import make_synthetic_set
from surgeon.run.tinymodels import make_tiny_model


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """An 8-layer Llama, hidden 128, residual branches x4: its early layers' norms differ by many
    times their spread over samples, which the identity profile needs."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("target"), num_layers=8, hidden_size=128, seed=0,
                           residual_scale=4.0)


@pytest.fixture(scope="session")
def reference_file(tmp_path_factory, tiny_target):
    """One reference prompt of 256 tokens, starting with the BOS every sample starts with."""
    import torch

    from surgeon.verify.reference import capture_reference, save_reference

    ids = torch.randint(2, 300, (256,), generator=torch.Generator().manual_seed(9))
    ids[0] = 0
    path = tmp_path_factory.mktemp("reference") / "ref.safetensors"
    save_reference(capture_reference(tiny_target, ids), path)
    return path


@pytest.fixture(scope="session")
def specforge_set(tmp_path_factory, tiny_target):
    return make_synthetic_set(tmp_path_factory.mktemp("specforge"), tiny_target, files=160, layout="specforge",
                              count=2, seed=1)


@pytest.fixture(scope="session")
def speculators_set(tmp_path_factory, tiny_target):
    return make_synthetic_set(tmp_path_factory.mktemp("speculators"), tiny_target, files=60, layout="speculators",
                              count=1, seed=2)


@pytest.fixture(scope="session")
def dump_set(tmp_path_factory, tiny_target):
    return make_synthetic_set(tmp_path_factory.mktemp("dumps"), tiny_target, files=60, layout="surgeon",
                              count=1, seed=3)


@pytest.fixture(scope="session")
def flat_target(tmp_path_factory):
    """The same Llama with residual branches scaled to a ~2% adjacent-layer gap (GAP_SCALES): its
    points' norm statistics do not separate, so the identity statistics leave every aux slot
    "unresolved" and only exact identification can tell its layers apart."""
    from surgeon.run.tinymodels import GAP_SCALES

    return make_tiny_model("llama", tmp_path_factory.mktemp("flat"), num_layers=8, hidden_size=128, seed=0,
                           residual_scale=GAP_SCALES["llama"])


@pytest.fixture(scope="session")
def flat_set(tmp_path_factory, flat_target):
    """40 speculators samples of the flat target, 2 with labels shifted by a slot and 2 off by one layer
    (faults only the identity pass can see)."""
    return make_synthetic_set(tmp_path_factory.mktemp("flat-set"), flat_target, files=40, layout="speculators",
                              count=2, seed=4, kinds=("shifted", "off_by_one"))
