"""accept's first line: whether the spec's wiring is told apart from every other wiring it measured
(position-1 acceptance, two standard errors of the difference of two proportions)."""

from __future__ import annotations

from surgeon.commands.outputs import json_output
from surgeon.core.points import layer_out
from surgeon.draft.accept import AcceptReport, Wiring, WiringResult
from surgeon.draft.model import DraftInfo

INFO = DraftInfo("draft", "specforge", "eagle3", hidden_size=8, n_slots=2, target_vocab_size=16, draft_vocab_size=16,
                 stated_ids={"eagle_aux_hidden_state_layer_ids": [1, 3]})


def _row(name, points, p1, chains=400):
    return WiringResult(Wiring(name, "why", points), [p1, p1 / 2], p1, chains)


def _report(*rows):
    return AcceptReport("s.yaml", "draft", "hf:t", 2, "rule", 8, 32, INFO, list(rows), [])


SPEC = [layer_out(1), layer_out(3)]


def test_a_wiring_the_prompts_cannot_tell_from_the_spec_is_undecided():
    r = _report(_row("spec", SPEC, 0.50), _row("off by one", [layer_out(2), layer_out(3)], 0.47),
                _row("reversed", SPEC[::-1], 0.10))
    assert r.verdict == "undecided"
    assert r.headline.startswith("undecided: off by one accepts as much") and "reversed" not in r.headline
    data = json_output("accept", r)
    assert data["verdict"] == "undecided" and data["headline"] == r.headline and data["min"] is None
    assert data["draft_info"]["target_hidden_size"] == 8 and data["draft_info"]["notes"] == []
    assert data["wirings"][0]["points"] == ["layer_out[1]", "layer_out[3]"] and data["wirings"][0]["accept_length"] == 1.5


def test_the_spec_separated_from_every_other_and_one_better():
    sep = _report(_row("spec", SPEC, 0.50), _row("off by one", [layer_out(2), layer_out(3)], 0.30),
                  _row("same points", SPEC, 0.50))  # the same points as the spec's are no rival
    assert sep.verdict == "separated" and sep.headline.startswith("separated:")
    better = _report(_row("spec", SPEC, 0.30), _row("off by one", [layer_out(2), layer_out(3)], 0.50))
    assert better.verdict == "better" and better.headline.startswith("better: off by one accepts more")
    few = _report(_row("spec", SPEC, 0.50, chains=10), _row("off by one", [layer_out(2), layer_out(3)], 0.30, chains=10))
    assert few.verdict == "undecided"  # 10 chains: 0.5 against 0.3 is within the noise
