"""The synthetic target learns its induction rule, and a draft trained on a known wiring is
measurably hurt by the miswirings bugs produce (the evidence the draft tests rest on)."""

from __future__ import annotations

import json

import pytest
import torch

from surgeon.core.points import parse_point
from surgeon.draft.accept import PromptStates, bug_wirings, measure_one_thread
from surgeon.draft.model import load_draft
from surgeon.draft.synthetic import PERIOD, induction_batch, load_lean, train_draft

SEED_WIRING = ["layer_out[1]", "layer_out[2]", "layer_out[3]"]  # as in conftest.py

pytestmark = pytest.mark.slow


def test_target_learns_the_copy_rule(synthetic_target):
    assert json.loads((synthetic_target / "copy_accuracy.json").read_text())["copy_accuracy"] >= 0.95


def test_transformers_loads_the_target_with_the_same_logits(synthetic_target):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(synthetic_target), local_files_only=True).eval()
    lean = load_lean(synthetic_target)
    ids = induction_batch(2, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits, lean.states(ids)[1], atol=1e-4)


def test_the_trained_wiring_beats_the_miswirings(synthetic_target, seed_draft):
    draft = load_draft(seed_draft)
    assert draft.info.stated_ids["eagle_config.eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    lean = load_lean(synthetic_target)
    seqs = induction_batch(16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        states, logits = lean.states(seqs)
    prompts = [PromptStates(seqs[b], PERIOD, {p: v[b] for p, v in states.items()}, logits[b].argmax(-1)) for b in range(16)]
    wiring = [parse_point(p, 4) for p in SEED_WIRING]
    rows = {r.wiring.name: r for r in measure_one_thread(draft, prompts, bug_wirings(wiring, 4), 3)}
    spec = rows["spec"]
    assert spec.per_position is not None and spec.per_position[0] >= 0.95
    best = max(r.expected_accepted for r in rows.values() if r.expected_accepted is not None)
    assert spec.expected_accepted == pytest.approx(best)  # nothing beats the trained wiring
    for name in ("labels shifted +1", "labels shifted -1", "reversed"):
        row = rows[name]
        assert row.per_position is not None and spec.per_position[0] - row.per_position[0] >= 0.05, name
        assert spec.expected_accepted - row.expected_accepted >= 0.3, name


def test_drafts_are_cached_by_their_parameters(synthetic_target, seed_draft):
    assert train_draft(synthetic_target, SEED_WIRING) == seed_draft
    assert (seed_draft / "trained_on.json").is_file()


def test_the_divergence_orders_what_greedy_acceptance_ties(synthetic_target, seed_draft):
    """Greedy acceptance saturates at K for the trained wiring and several single-slot neighbours;
    the divergence column still separates them (measured, 16 prompts: trained wiring 0.238 nats,
    its layer neighbours 0.261-0.347 at the same 3.00 accepted). The exception is the final norm
    in place of the last layer's output (a per-token rescaling of it): 0.221, a near-tie that
    infer-wiring's paired test over whole prompts reports as its runner-up."""
    from surgeon.draft.accept import target_states

    draft = load_draft(seed_draft)
    seqs = induction_batch(16, generator=torch.Generator().manual_seed(7))
    prompts, _ = target_states(synthetic_target, [row[:2 * PERIOD].tolist() for row in seqs], seqs.shape[1])
    wiring = [parse_point(p, 4) for p in SEED_WIRING]
    rows = {r.wiring.name: r for r in measure_one_thread(draft, prompts, bug_wirings(wiring, 4), 3)}
    spec = rows["spec"]
    assert spec.divergence is not None
    tied = [r for name, r in rows.items() if name != "spec" and r.expected_accepted == spec.expected_accepted]
    assert tied, "no neighbour ties on greedy acceptance any more: this test's premise is gone"
    for r in rows.values():
        if r is spec or r.divergence is None:
            continue
        if "final_norm" in [str(p) for p in r.wiring.points] and r.wiring.points[:2] == spec.wiring.points[:2]:
            assert abs(r.divergence - spec.divergence) < 0.15 * spec.divergence, r.wiring.name
        else:
            assert r.divergence > spec.divergence * 1.05, r.wiring.name
