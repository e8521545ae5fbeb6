"""map_forked: the same answers as a plain loop, in order, whatever the split and whatever the child
does; and the probe gives the same conventions in one process or two."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from surgeon.commands.outputs import json_output
from surgeon.engines.probes.probe import probe_engine
from surgeon.engines.source import forked
from tests.conftest import release_engine

PARENT = os.getpid()


@given(st.lists(st.tuples(st.integers(1, 1000), st.integers(0, 6)), max_size=40))
def test_split_covers_every_item_once_and_keeps_groups_together(pairs: list[tuple[int, int]]) -> None:
    weights = [w for w, _ in pairs]
    groups = [g for _, g in pairs]
    mine, theirs = forked.split(weights, groups)
    assert sorted(mine + theirs) == list(range(len(pairs)))
    assert not {groups[i] for i in mine} & {groups[i] for i in theirs}
    if pairs:  # greedy over groups, heaviest first: the gap is at most the heaviest group
        heaviest = max(sum(w for w, g in pairs if g == grp) for grp in set(groups))
        assert abs(sum(weights[i] for i in mine) - sum(weights[i] for i in theirs)) <= heaviest


def _square(x: int) -> int:
    return x * x


def test_results_in_order_progress_and_child_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SURGEON_JOBS", "2")
    if forked.jobs() < 2:
        pytest.fail("this machine has fork and two cores (CI too): the two-process path must run here")
    items = list(range(40))
    seen: list[int] = []
    out, state, extra = forked.map_forked(items, _square, weights=[1] * 40, groups=[i % 7 for i in items],
                                          progress=seen.append, child_state=os.getpid, alongside=os.getpid,
                                          alongside_weight=10)
    assert out == [x * x for x in items] and extra == os.getpid()
    assert seen[-1] == 40 and seen == sorted(seen)
    assert isinstance(state, int) and state != os.getpid()  # evaluated in the child


def _fails_in_child(x: int) -> int:
    if os.getpid() != PARENT:
        raise RuntimeError("the child breaks")
    return x + 1


def test_a_failing_child_costs_time_not_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SURGEON_JOBS", "2")
    items = list(range(30))
    out, state, _ = forked.map_forked(items, _fails_in_child, weights=[1] * 30, groups=items, child_state=lambda: "x")
    assert out == [x + 1 for x in items]
    assert state is None  # no child's state: its share ran here


def test_one_job_runs_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SURGEON_JOBS", "1")
    out, state, extra = forked.map_forked(list(range(30)), _fails_in_child, weights=[1] * 30, groups=[0] * 30,
                                          child_state=lambda: "x", alongside=lambda: "y")
    assert out == list(range(1, 31)) and state is None and extra == "y"


@pytest.mark.engine
@pytest.mark.slow
def test_probe_in_one_process_or_two_says_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    root = release_engine("vllm", "0.11.0")
    answers = []
    for n in ("1", "2"):
        monkeypatch.setenv("SURGEON_JOBS", n)
        probe = probe_engine("vllm", root, cache=False)
        answers.append(json.dumps(json_output("conventions", probe), sort_keys=True))
    assert answers[0] == answers[1]
    assert len(probe.classes) >= forked.MIN_ITEMS  # the two-process path ran (files are the items: more than classes)
