"""The driver's cross-file index of sampled rows: the same stale findings as a plain dict of the
first file to sample each row, in a fraction of its memory."""

from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from surgeon.audit.aggregate import Aggregate, RowIndex


def _reference(results: list[dict]) -> list[list[tuple[str, str]]]:
    """The stale findings a dict of (context, path, slot) by row hash gives: what the index replaced."""
    index: dict[int, tuple[int, str, int]] = {}
    out = []
    for r in results:
        names = [s["name"] for s in r["slots"]]
        seen: dict[int, tuple[str, str]] = {}
        for slot, h, ctx, _tok in r["hashes"]:
            hit = index.get(h)
            if hit is not None and hit[0] != ctx and hit[1] != r["path"] and slot not in seen:
                seen[slot] = (hit[1], names[hit[2]])
            elif hit is None:
                index[h] = (ctx, r["path"], slot)
        out.append([(names[s], src) for s, (src, _) in sorted(seen.items())])
    return out


_rows = st.lists(st.tuples(st.integers(0, 2), st.integers(-3, 3), st.integers(0, 2), st.just(0)), max_size=8)


@settings(max_examples=200, deadline=None)
@given(st.lists(_rows, min_size=1, max_size=12), st.sampled_from([1, 2, 5, 1 << 16]))
def test_stale_findings_are_the_ones_a_dict_of_first_rows_gives(files, buffer):
    """Few hash values over many files (collisions everywhere, a row twice in one file), merged
    into the sorted arrays every ``buffer`` entries."""
    results = [{"path": f"f{i}", "slots": [{"name": n} for n in "abc"], "hashes": [list(r) for r in rows],
                "findings": []} for i, rows in enumerate(files)]
    want = _reference(results)
    old, RowIndex.BUFFER = RowIndex.BUFFER, buffer
    try:
        agg = Aggregate()
        got = []
        for r in results:
            agg.stale_check(r)
            got.append([(f["slot"], f["detail"].split("rows of ")[1].split(" (slot")[0]) for f in r["findings"]])
    finally:
        RowIndex.BUFFER = old
    assert got == want


def _peak(check, files: int) -> int:
    """The peak memory of ``files`` stale checks of 16 sampled rows each (4 slots x KEEP)."""
    import numpy as np

    rng = np.random.default_rng(0)
    tracemalloc.start()
    try:
        for i in range(files):
            hs = rng.integers(-(2**62), 2**62, 16).tolist()
            check({"path": f"/data/set/sample_{i:06d}.ckpt", "slots": [{"name": n} for n in "abcd"],
                   "hashes": [[k % 4, h, i, 0] for k, h in enumerate(hs)], "findings": []})
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_index_takes_a_fraction_of_the_memory_of_a_dict_of_rows():
    """20k files, 320k rows: the peak (its merges' copies and its newest entries' dict included)
    against the dict of tuples it replaced."""
    index: dict[int, tuple[int, str, int]] = {}

    def by_dict(r: dict) -> None:
        for slot, h, ctx, _tok in r["hashes"]:
            index.setdefault(h, (ctx, r["path"], slot))

    agg = Aggregate()
    ours, theirs = _peak(agg.stale_check, 20_000), _peak(by_dict, 20_000)
    assert len(agg._index) == len(index) == 320_000
    assert ours * 3 < theirs, (ours, theirs)


def test_a_slot_past_int16_is_named_as_it_is_after_a_merge():
    old, RowIndex.BUFFER = RowIndex.BUFFER, 1
    try:
        agg = Aggregate()
        names = [{"name": f"s{i}"} for i in range(40_001)]
        agg.stale_check({"path": "a", "slots": names, "hashes": [[40_000, 7, 1, 0]], "findings": []})
        r = {"path": "b", "slots": names, "hashes": [[3, 7, 2, 0]], "findings": []}
        agg.stale_check(r)
    finally:
        RowIndex.BUFFER = old
    assert "(slot s40000)" in r["findings"][0]["detail"]
