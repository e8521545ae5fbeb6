"""The audit's per-file statistics and the identity verdicts they give: bad rows of every kind
found in one pass over all slots, and a slot resolved to one point only when its statistics fit
that point alone (or the first-row anchor picks it), "unresolved" when they fit several."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from surgeon.audit.output import AuditProfile, dump
from surgeon.audit.profile import ANCHOR_TOL, PointProfile, Profile, Stats, match_slot, profile_from_states
from surgeon.audit.values import file_values, repeated_across_slots, sampled_rows
from surgeon.core.points import layer_out


def _slots(T=40, H=128, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, H, generator=g).to(dtype) for _ in range(3)]


def test_bad_rows_of_every_kind_in_one_pass():
    xs = _slots()
    xs[0][3] = float("nan")
    xs[0][4, 7] = float("inf")
    xs[1][5] = 0
    xs[1][6] = 0.75
    xs[2][7, :] = xs[2][7, 0]  # constant, not zero
    svs, hashes, moments = file_values(["a", "b", "c"], [None] * 3, xs)
    assert [(s.nonfinite_rows, s.zero_rows, s.constant_rows) for s in svs] == [(2, 0, 0), (0, 1, 1), (0, 0, 1)]
    assert [f.split(":")[0] for f in svs[0].findings] == ["nonfinite"]
    assert sorted(f.split(":")[0] for f in svs[1].findings) == ["constant", "zero"]
    assert hashes.shape == (3, 40) and int((hashes == 0).sum()) == 2 + 2 + 1  # bad rows are not hashed
    # the sampled rows' moments (rows 1-39 sampled) leave the bad rows out, NaN included
    assert moments.count.tolist() == [37, 37, 38] and moments.sum.shape == moments.sumsq.shape == (3, 128)
    for s, bad in enumerate(({3, 4}, {5, 6}, {7})):
        good = torch.stack([xs[s][t].float() for t in range(1, 40) if t not in bad])
        assert torch.allclose(torch.from_numpy(moments.sum[s]), good.sum(0), rtol=1e-5, atol=1e-4)
        assert torch.allclose(torch.from_numpy(moments.sumsq[s]), (good * good).sum(0), rtol=1e-5, atol=1e-4)
    assert svs[2].norm_min is not None and math.isfinite(svs[2].log_norm_median)


def test_a_half_row_whose_norm_overflows_is_not_a_bad_row():
    xs = [torch.full((8, 64), 1.0, dtype=torch.float16) for _ in range(2)]
    xs[0] = torch.randn(8, 64).half()
    xs[0][2] = 60000.0 * torch.sign(torch.randn(64)).half()  # each value finite, the float16 norm is not
    svs, _, _ = file_values(["a", "b"], [None, None], xs)
    assert svs[0].nonfinite_rows == 0 and svs[0].norm_max == pytest.approx(60000.0 * 8, rel=1e-3)
    assert svs[1].constant_rows == 8


def test_rows_repeated_across_slots_and_the_sampled_rows():
    xs = _slots()
    xs[2][10:20] = xs[0][10:20]
    _, hashes, _ = file_values(["a", "b", "c"], [None] * 3, xs)
    found = repeated_across_slots(["a", "b", "c"], hashes)
    assert found == [("c", "repeated: 10 of its rows are identical to rows of slot a on the 64 hashed columns, "
                           "bit for bit (a stale or shared buffer)")]
    within = _slots()
    within[1][5:9] = within[1][0]  # rows repeated inside one slot (an embed slot's repeated token): not across slots
    _, h2, _ = file_values(["a", "b", "c"], [None] * 3, within)
    assert repeated_across_slots(["a", "b", "c"], h2) == []
    rows = sampled_rows([None] * 3, hashes, torch.arange(40))
    assert len(rows) == 12 and {r[0] for r in rows} == {0, 1, 2}
    for s, h, _ctx, t in rows:
        assert int(hashes[s, t]) == h != 0
    xs[2][10:20] = xs[2][10:20] + 0.5  # a copy that differs: no finding
    assert repeated_across_slots(["a", "b", "c"], file_values(["a", "b", "c"], [None] * 3, xs)[1]) == []


def _point(name, centre, spread, row=None, token=None):
    return PointProfile(name, centre, spread, 8.0, (centre, 0.1), (spread, 0.0), (None, None), (math.inf, math.inf),
                        token, row)


def test_verdicts_say_unresolved_where_statistics_overlap_and_the_anchor_decides():
    a, b = torch.zeros(16), torch.zeros(16)
    a[0], b[1] = 1.0, 1.0
    prof = Profile((_point("layer_out[5]", 4.30, 0.01, a, 1), _point("layer_out[6]", 4.34, 0.01, b, 1),
                    _point("layer_out[9]", 6.0, 0.01, None, None)), "test", 12, 100)
    plain = Stats((4.32, 0.1))
    assert match_slot(prof, "layer_out[5]", plain)["verdict"] == "unresolved"  # fits both bands
    assert match_slot(prof, "layer_out[5]", Stats((4.32, 0.1), first_token=1, first_row=a))["verdict"] == "ok"
    got = match_slot(prof, "layer_out[5]", Stats((4.32, 0.1), first_token=1, first_row=b))
    assert got["verdict"] == "mismatch" and got["nearest"] == "layer_out[6]"
    # a first row that is neither point's (a sample cut mid-sequence), or after another first token: decides nothing
    c = torch.zeros(16)
    c[2] = 1.0
    assert match_slot(prof, "layer_out[5]", Stats((4.32, 0.1), first_token=1, first_row=c))["verdict"] == "unresolved"
    assert match_slot(prof, "layer_out[5]", Stats((4.32, 0.1), first_token=7, first_row=b))["verdict"] == "unresolved"
    # the anchor never rescues a slot whose statistics fit no point, nor condemns one that fits only its own
    assert match_slot(prof, "layer_out[5]", Stats((5.0, 0.1), first_token=1, first_row=a))["verdict"] == "no_match"
    assert match_slot(prof, "layer_out[9]", Stats((6.0, 0.1), first_token=1, first_row=b))["verdict"] == "ok"
    assert 1 - float((a * a).sum()) <= ANCHOR_TOL < 1 - float((a * b).sum())


def test_the_direction_statistics_separate_what_the_norm_does_not():
    """Two points with the same norm distribution but massive activations in other channels (what
    real models have): the median norm fits both, the mean direction and RMS profile only one."""
    g = torch.Generator().manual_seed(0)

    def states(channel):
        x = torch.randn(256, 64, generator=g)
        x[:, channel] += 20.0
        return x * (10.0 / torch.linalg.vector_norm(x, dim=1, keepdim=True))  # every row of norm 10

    pts = (layer_out(0), layer_out(1))
    prof = profile_from_states([{pts[0]: states(3), pts[1]: states(40)} for _ in range(8)], 4, "test", [5] * 8)
    from surgeon.audit.profile import stats_of
    from surgeon.audit.values import slot_values

    x = states(3)
    sv, _, sample = slot_values("s", pts[0], x)
    got = match_slot(prof, str(pts[0]), stats_of(sv, sample))
    assert got["verdict"] == "ok", got
    norm_only = Stats(stats_of(sv, sample).scalars)  # the same slot with its norm statistics only
    assert match_slot(prof, str(pts[0]), norm_only)["verdict"] == "unresolved"


def test_a_sample_is_judged_against_the_rung_of_its_length_measured_on_the_prompts_prefixes():
    """A point whose norm grows with the position (what causal models' states do near the start):
    the whole prompts' median is a long sample's; a short sample of the same point lies far from it.
    The ladder measures each rung on the prompts' prefixes, so both lengths fit their own rung."""
    g = torch.Generator().manual_seed(1)

    def prompt(T=512):
        x = torch.randn(T, 64, generator=g)
        return x * torch.linspace(1.0, 8.0, T)[:, None]  # norm x8 from the first position to the last

    pt = layer_out(0)
    prof = profile_from_states([{pt: prompt()} for _ in range(12)], 4, "test")
    assert [n for n, _ in prof.ladder] == [2, 4, 8, 16, 32, 64, 128, 256, 512]
    from surgeon.audit.profile import stats_of
    from surgeon.audit.values import slot_values

    for T in (5, 40, 100, 300, 512):
        sv, _, sample = slot_values("s", pt, prompt()[:T])
        s = stats_of(sv, sample, tokens=T)
        assert prof.at(T).distances(s)[str(pt)] <= 1.0, T  # its own rung: fits
        assert prof.at(T) is prof.at(T)  # made once
    sv, _, sample = slot_values("s", pt, prompt()[:40])
    assert prof.distances(stats_of(sv, sample, tokens=40))[str(pt)] > 1.0  # the whole prompts' profile: "mismatch"
    assert prof.at(1).points == prof.ladder[0][1] and prof.at(10**6).points == prof.ladder[-1][1]
    assert prof.at(None) is prof and prof.at(40).at(40) is prof.at(40)  # a rung has no ladder of its own
    assert dump(AuditProfile, prof)["ladder"] == [n for n, _ in prof.ladder]
    assert prof.digest() != dataclasses.replace(prof, ladder=prof.ladder[:-1]).digest()
    few = profile_from_states([{pt: prompt()} for _ in range(2)], 4, "test")  # too few prompts to measure rungs
    assert few.ladder == () and few.at(40) is few


def test_a_profiles_digest_is_the_one_a_resume_state_recorded_before():
    """A resume state records the profile's digest and refuses another: the digest of a fixed
    profile is pinned (the value its JSON form and statistics gave when it was a hand-built dict),
    so a change in how the profile is serialized cannot strand the states already written."""
    P = PointProfile
    inf = math.inf
    pts = (P("embed", 1.5, 0.25, 8.0, (1.5, 0.5), (0.25, 0.125), (None, None), (inf, inf), None, None, 64.0),
           P("layer_out[0]", 2.0, 0.001, 8.0, (2.0, 0.75), (0.001, 0.0), (torch.ones(4) / 2, None), (0.01, inf), 0,
             torch.ones(4) / 2, 32.0))
    prof = Profile(pts, "hf:x", 3, 96, ("a", "b"), ((2, (P("embed", 1.25, 0.5), P("layer_out[0]", 1.75, 0.0))),))
    assert prof.digest() == "5884d46b3aa408e1505d6b8af871dae7202dbe69919bf69402824c5358aab73a"


def test_a_rungs_spread_is_at_least_the_rung_belows_over_sqrt2():
    """Prompts that share one state from their 9th row on, their first 8 rows far larger and their
    own: the median of a 32-row prefix is the shared state's in every prompt (a spread of 0, which
    would flag any sample that differs at all), of a 16-row prefix a row of its own. The 32 rung's
    spread is floored by the 16 rung's over sqrt(2)."""
    g = torch.Generator().manual_seed(3)
    pt = layer_out(0)
    base = 0.1 * torch.randn(32, generator=g)

    def prompt():
        x = base.repeat(64, 1)
        x[:8] += 3.0 * torch.randn(8, 32, generator=g)
        return x

    prof = profile_from_states([{pt: prompt()} for _ in range(8)], 4, "test")
    rung = dict(prof.ladder)
    assert rung[16][0].spreads[0] > 0.01
    assert rung[32][0].spreads[0] == pytest.approx(rung[16][0].spreads[0] / math.sqrt(2))
    assert rung[32][0].spread == rung[32][0].spreads[0]
    for n in (4, 8, 16, 32, 64):
        assert all(a >= b / math.sqrt(2) - 1e-12 for a, b in zip(rung[n][0].spreads, rung[n // 2][0].spreads))


def test_a_direction_of_no_structure_gets_a_tolerance_measured_out_of_sample():
    """Unit mean directions of random rows: each prompt's lies ~1 - 1/sqrt(n) from the mean of all n
    (itself among them), ~1 from a new sample's. The tolerance is measured out of sample, each
    prompt against the others' mean: a new sample of the same point fits it."""
    g = torch.Generator().manual_seed(2)
    pt = layer_out(0)
    prof = profile_from_states([{pt: torch.randn(128, 256, generator=g)} for _ in range(6)], 4, "test")
    from surgeon.audit.profile import VK, stats_of
    from surgeon.audit.values import slot_values

    assert prof.points[0].vtols[0] > VK * 0.9  # ~VK x 1, where in-sample distances gave VK x (1 - 1/sqrt(6)) = 1.18
    fits = 0
    for _ in range(40):
        sv, _, sample = slot_values("s", pt, torch.randn(128, 256, generator=g))
        fits += prof.distances(stats_of(sv, sample, tokens=128))[str(pt)] <= 1.0
    assert fits == 40


def test_a_files_distances_at_once_are_each_slots_own_and_a_missing_statistic_decides_nothing():
    prof = Profile((_point("layer_out[5]", 4.30, 0.01), _point("layer_out[9]", 6.0, 0.01)), "test", 12, 100)
    slots = [Stats((4.30, 0.1)), Stats((6.0, None)), Stats((None, 0.1)), Stats((math.inf, 0.1))]
    together = prof.distances_of(slots)
    assert together == [prof.distances_of([s])[0] for s in slots]
    assert together[0]["layer_out[5]"] == 0.0 and together[0]["layer_out[9]"] == pytest.approx(1.7 / 0.08)
    assert together[1]["layer_out[9]"] == 0.0  # no width: the median alone decides
    assert together[2] == {"layer_out[5]": 0.0, "layer_out[9]": 0.0}  # nothing to compare: nothing decided
    assert together[3]["layer_out[5]"] == math.inf  # an infinite gap stays infinite


def test_a_short_samples_scalars_are_judged_with_a_tolerance_widened_as_its_rows_are_few():
    p = PointProfile("layer_out[5]", 4.3, 0.01, 8.0, (4.3, 0.1), (0.01, 0.0), (None, None), (math.inf, math.inf),
                     tokens=128.0)
    prof = Profile((p,), "test", 12, 1536)
    off = 4.3 + 2 * p.tol  # two tolerances off, as measured on samples of 128 rows

    def dist(tokens):
        return prof.distances(Stats((off, 0.1), tokens=tokens))["layer_out[5]"]

    assert dist(128) == pytest.approx(2.0)
    assert dist(8) == pytest.approx(2.0 * (8 / 128) ** 0.5)  # a median of 8 rows varies 4x as much
    assert dist(4096) == pytest.approx(2.0) and dist(None) == pytest.approx(2.0)  # never narrower; unknown: as is
    bare = PointProfile("layer_out[5]", 4.3, 0.01, 8.0, (4.3, 0.1), (0.01, 0.0), (None, None), (math.inf, math.inf))
    assert Profile((bare,), "test", 12, 1536).distances(Stats((off, 0.1), tokens=8))["layer_out[5]"] == pytest.approx(2.0)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.integers(2, 300), st.integers(0, 2**31 - 1))
def test_the_norm_table_of_good_rows_takes_its_short_path_to_the_same_figures(S, T, seed):
    """Slots whose rows are all good take a path of fewer ops; a file with one more slot holding a
    NaN row takes the general one: the good slots' figures are the same either way."""
    import numpy as np

    from surgeon.audit.values import _norm_table

    N = np.random.default_rng(seed).lognormal(2.0, 1.5, (S, T)).astype(np.float32)
    bad = np.concatenate([N, N[:1]])
    bad[-1, 0] = np.nan
    short, general = _norm_table(N, np.isfinite(N)), _norm_table(bad, np.isfinite(bad))[:S]
    for a, b in zip(short, general):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-12), k
