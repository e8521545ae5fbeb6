"""The synthetic target and drafts the draft tests share (trained once, cached on disk by
``surgeon.draft.synthetic``; ~35 s cold for the target and the seed draft on 2 busy cores, seconds warm)."""

from __future__ import annotations

import pytest

SEED_WIRING = ["layer_out[1]", "layer_out[2]", "layer_out[3]"]  # what the seed-case draft was trained on
SEED_LABELS = ["embed", "layer_out[1]", "layer_out[2]"]  # its labels, shifted by one slot


@pytest.fixture(scope="session")
def synthetic_target():
    from surgeon.draft.synthetic import synthetic_target as build

    return build()


@pytest.fixture(scope="session")
def seed_draft(synthetic_target):
    """The scaled-down seed case: trained on three layer outputs (SpecForge ids 1, 2, 3 in its config)."""
    from surgeon.draft.synthetic import train_draft

    return train_draft(synthetic_target, SEED_WIRING)


@pytest.fixture(scope="session")
def induction_prompts():
    """32 held-out prompts of the target's language (seeded apart from training)."""
    import torch

    from surgeon.draft.synthetic import induction_batch

    return list(induction_batch(32, generator=torch.Generator().manual_seed(11)))
