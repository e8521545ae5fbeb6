"""Identification on real (tiny, random) HF models: every seeded wiring bug is named with the
point the slot really holds, correct wiring is never flagged, fingerprints agree with full
references, and fingerprint files stream."""

from __future__ import annotations

import math

import pytest
import torch

from surgeon.core.errors import BadInput
from surgeon.core.points import EMBED, FINAL_NORM, Point, all_points, layer_out
from surgeon.run.tinymodels import GAP_SCALES, make_tiny_model
from surgeon.verify.fingerprint import (
    Fingerprint,
    effective_dim,
    fingerprint,
    fingerprint_file,
    load_fingerprint,
    projection_matrix,
    save_fingerprint,
)
from surgeon.verify.identify import MAX_REL_ERR, MIN_MARGIN, identify
from surgeon.verify.reference import capture_reference, save_reference

L = 6
IDS = list(range(3, 35))
_g = torch.Generator().manual_seed(123)
STALE_IDS = [(i + 1 + int(torch.randint(0, 200, (1,), generator=_g))) % 320 for i in IDS]  # differs everywhere
assert all(a != b for a, b in zip(IDS, STALE_IDS))
DTYPES = [torch.float32, torch.bfloat16]


def delta(k: int) -> Point:
    return Point("layer_delta", k)


def adjacent_gaps(ref) -> list[float]:
    st = ref.states
    return [float((st[layer_out(k)] - st[layer_out(k - 1)]).norm() / st[layer_out(k - 1)].norm())
            for k in range(ref.num_layers)[1:]] + \
           [float((st[layer_out(0)] - st[EMBED]).norm() / st[EMBED].norm())]


class Model:
    def __init__(self, root, kind: str, seed: int, family: str = "llama", layers: int = L):
        scale = GAP_SCALES[family] if kind == "gap" else None
        path = make_tiny_model(family, root / f"{family}-{kind}-{seed}", num_layers=layers, seed=seed,
                               residual_scale=scale)
        self.kind = kind
        self.ref = capture_reference(path, IDS)
        self.stale = capture_reference(path, STALE_IDS) if family == "llama" else None
        self.fp = fingerprint(self.ref)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {(kind, seed): Model(root, kind, seed) for kind in ("plain", "gap") for seed in (0, 1, 2)}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """The case that started the project, scaled: 61 layers, DeepSeek-V3 (the Kimi-K2.5 family),
    residual branches scaled so adjacent layers are ~1-2% apart."""
    return Model(tmp_path_factory.mktemp("kimi"), "gap", 1, family="deepseek_v3", layers=61)


def test_the_models_have_the_layer_gaps_the_thresholds_are_for(models):
    for seed in (0, 1, 2):
        gaps = adjacent_gaps(models[("gap", seed)].ref)
        assert all(0.01 <= g <= 0.03 for g in gaps), gaps
        assert min(adjacent_gaps(models[("plain", seed)].ref)) > 0.2  # big gaps without scaling
    # bf16 rounding of a state is well under the adjacent-layer gap: what MIN_MARGIN relies on
    st = models[("gap", 0)].ref.states
    noise = max(float((t.bfloat16().float() - t).norm() / t.norm()) for t in st.values())
    assert noise < 0.003


# -- seeded wiring bugs -------------------------------------------------------------------------------
#: case -> [(slot name, declared point, what the slot really holds)]; "what it holds" is a Point
#: of the reference or one of "zeros", "noise", ("stale", point), ("shift", point)
LAST = layer_out(L - 1)
CASES = {
    "off_by_one_up": [("a", layer_out(1), layer_out(2)), ("b", layer_out(3), layer_out(4)), ("c", FINAL_NORM, FINAL_NORM)],
    "off_by_one_down": [("a", layer_out(2), layer_out(1)), ("b", layer_out(4), layer_out(3)), ("c", FINAL_NORM, FINAL_NORM)],
    "embed_for_layer": [("a", EMBED, layer_out(1)), ("b", layer_out(2), EMBED), ("c", layer_out(4), layer_out(4))],
    "swapped": [("a", layer_out(1), layer_out(4)), ("b", layer_out(4), layer_out(1)), ("c", FINAL_NORM, FINAL_NORM)],
    "pre_norm_for_post": [("a", layer_out(2), layer_out(2)), ("final", FINAL_NORM, LAST)],
    "post_norm_for_pre": [("a", layer_out(2), layer_out(2)), ("last", LAST, FINAL_NORM)],
    "residual_missing": [("a", layer_out(2), delta(2)), ("b", layer_out(4), layer_out(4))],
    "zero_buffer": [("a", layer_out(1), layer_out(1)), ("b", layer_out(3), "zeros")],
    "stale_buffer": [("a", layer_out(1), layer_out(1)), ("b", layer_out(3), ("stale", layer_out(3))),
                     ("c", FINAL_NORM, ("stale", FINAL_NORM))],
    "random_noise": [("a", layer_out(1), layer_out(1)), ("b", layer_out(3), "noise")],
    "duplicate": [("a", layer_out(1), layer_out(3)), ("b", layer_out(3), layer_out(3))],
}
EXPECTED_KINDS = {
    "off_by_one_up": {"off_by_k"}, "off_by_one_down": {"off_by_k"}, "embed_for_layer": {"embed_for_layer"},
    "swapped": {"swapped"}, "pre_norm_for_post": {"norm_position"}, "post_norm_for_pre": {"norm_position"},
    "residual_missing": {"residual_missing"}, "zero_buffer": {"no_match"}, "stale_buffer": {"no_match"},
    "random_noise": {"no_match"}, "duplicate": {"off_by_k", "duplicate"},
}


def build(model: Model, holds, dtype) -> torch.Tensor:
    st = model.ref.states
    if isinstance(holds, Point):
        t = st[holds]
    elif holds == "zeros":
        t = torch.zeros_like(st[EMBED])
    elif holds == "noise":
        ref = st[layer_out(3)]
        t = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7)) * float(ref.std())
    elif holds[0] == "stale":
        t = model.stale.states[holds[1]]
    else:
        raise AssertionError(holds)
    return t.to(dtype)


def run_case(model: Model, case: str, dtype, reference=None):
    slots = [(n, d, build(model, h, dtype)) for n, d, h in CASES[case]]
    return identify(slots, reference if reference is not None else model.ref, num_layers=L)


def check_case(report, case: str) -> None:
    kinds = {d.kind for d in report.diagnosis}
    assert EXPECTED_KINDS[case] <= kinds, (case, [(d.kind, d.detail) for d in report.diagnosis])
    for (name, declared, holds), s in zip(CASES[case], report.slots):
        assert s.name == name and s.declared == declared
        if isinstance(holds, Point):
            assert s.matched == holds, (case, name, s.matched, s.ranking[:3])
            assert s.verdict == ("ok" if holds == declared else "mismatch"), (case, name, s.verdict)
            assert s.rel_err < 0.01 and s.margin >= MIN_MARGIN
            if s.verdict == "mismatch":  # named, with its true point, in a diagnosis
                assert any(repr(name) in d.detail and str(holds) in d.detail for d in report.diagnosis), \
                    (case, name, [d.detail for d in report.diagnosis])
            assert report.suggested_captures[name] == holds
        else:
            assert s.matched is None and s.verdict == "no_match", (case, name, s.matched, s.rel_err, s.margin)
            assert s.rel_err > MAX_REL_ERR
            assert any(d.kind == "no_match" and repr(name) in d.detail for d in report.diagnosis)
            assert name not in report.suggested_captures
    assert report.errors.shape == (len(CASES[case]), len(report.candidates))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", ["plain", "gap"])
def test_every_seeded_bug_is_named_with_its_true_point(models, case, kind):
    model = models[(kind, 0)]
    for dtype in DTYPES:
        for reference in (model.ref, model.fp):
            report = run_case(model, case, dtype, reference)
            check_case(report, case)


def test_diagnosis_details_say_what_happened(models):
    m = models[("gap", 0)]

    def details(case, dtype=torch.bfloat16):
        return {d.kind: d.detail for d in run_case(m, case, dtype).diagnosis}

    up = details("off_by_one_up")["off_by_k"]
    assert "k = +1" in up and "SGLang" in up and "vLLM" in up
    assert "k = -1" in details("off_by_one_down")["off_by_k"]
    assert "before the final norm" in details("pre_norm_for_post")["norm_position"]
    assert "after the final norm" in details("post_norm_for_pre")["norm_position"]
    assert "without the residual" in details("residual_missing")["residual_missing"]
    assert "all zeros" in details("zero_buffer")["no_match"]
    stale = [d.detail for d in run_case(m, "stale_buffer", torch.bfloat16).diagnosis]
    assert len(stale) == 2 and all("stale" in d for d in stale)
    dup = details("duplicate")["duplicate"]
    assert "'a'" in dup and "'b'" in dup and "layer_out[3]" in dup
    swapped = details("swapped")["swapped"]
    assert "'a'" in swapped and "'b'" in swapped and "off_by_k" not in details("swapped")


def test_the_explanation_covering_the_most_slots_comes_first(models):
    """The demo's mis-wiring (there on 8 layers: labels [embed, 1, 3] on data [1, 3, 5]), on 6: labels
    [embed, layer_out[0], layer_out[2]] on data [0, 2, 4]. Off by +2 layers explains two slots and
    embed-for-a-layer the third; labels shifted by one slot explain all three: that diagnosis, alone."""
    m = models[("gap", 0)]
    labels = [EMBED, layer_out(0), layer_out(2), FINAL_NORM]
    truth = [layer_out(0), layer_out(2), layer_out(4), FINAL_NORM]
    for reference in (m.ref, m.fp):
        slots = [(n, d, m.ref.states[t].to(torch.bfloat16)) for n, d, t in zip(("low", "mid", "high", "last"), labels, truth)]
        r = identify(slots, reference)
        assert [d.kind for d in r.diagnosis] == ["labels_shifted"], [d.detail for d in r.diagnosis]
        text = r.diagnosis[0].detail
        assert "'low' holds layer_out[0], the label of 'mid'" in text and "'mid' holds layer_out[2]" in text
        assert "'high' holds layer_out[4], whose label was pushed off the end" in text
    # an off-by-one stays an off-by-one: the neighbour's label is no closer than the slot's own
    spaced = [("a", layer_out(1), layer_out(2)), ("b", layer_out(3), layer_out(4)), ("c", layer_out(5), FINAL_NORM)]
    r = identify([(n, d, m.ref.states[t]) for n, d, t in spaced], m.ref)
    assert [d.kind for d in r.diagnosis][0] == "off_by_k" and "labels_shifted" not in {d.kind for d in r.diagnosis}
    # two swaps and an off-by-k: each slot explained once
    mixed = [("a", layer_out(1), layer_out(3)), ("b", layer_out(3), layer_out(1)), ("c", layer_out(4), layer_out(5))]
    r = identify([(n, d, m.ref.states[t]) for n, d, t in mixed], m.ref)
    assert [d.kind for d in r.diagnosis] == ["swapped", "off_by_k"]


def test_no_match_says_why_when_it_can(models):
    m = models[("gap", 0)]
    x = m.ref.states[layer_out(3)]
    shifted = torch.cat([x[:1], x[:-1]])  # slot token t holds reference token t-1
    halfway = (m.ref.states[layer_out(2)] + m.ref.states[layer_out(3)]) / 2
    nan = x.clone()
    nan[3, 5] = float("nan")
    slots = [("nan", layer_out(3), nan), ("const", layer_out(3), torch.full_like(x, 0.25)),
             ("shift", layer_out(3), shifted), ("halfway", layer_out(3), halfway)]
    for reference in (m.ref, m.fp):
        r = identify(slots, reference)
        assert [s.verdict for s in r.slots] == ["no_match"] * 4
        why = {d.detail.split("'")[1]: d.detail for d in r.diagnosis}
        assert "NaN" in why["nan"] and "constant" in why["const"]
        assert "shifted by -1" in why["shift"] and "layer_out[3]" in why["shift"]
        assert "about equally" in why["halfway"] and "layer_out[2]" in why["halfway"]
    assert math.isinf(identify(slots[:1], m.ref).slots[0].rel_err)


@pytest.mark.parametrize("kind", ["plain", "gap"])
def test_correct_wiring_is_never_flagged(models, kind):
    for seed in (0, 1, 2):
        m = models[(kind, seed)]
        points = all_points(L)  # every residual-stream point and final_norm
        for dtype in DTYPES:
            slots = [(str(p), p, m.ref.states[p].to(dtype)) for p in points]
            for reference in (m.ref, m.fp):
                r = identify(slots, reference)
                assert [s.verdict for s in r.slots] == ["ok"] * len(points), (kind, seed, dtype,
                    [(s.name, s.matched, s.rel_err, s.margin) for s in r.slots if s.verdict != "ok"])
                assert r.diagnosis == []
                assert min(s.margin for s in r.slots) >= 1.5 * MIN_MARGIN  # headroom, not luck
        unlabelled = identify([(str(p), None, m.ref.states[p]) for p in points], m.ref)
        assert [s.verdict for s in unlabelled.slots] == ["unlabelled"] * len(points)
        assert [s.matched for s in unlabelled.slots] == points and unlabelled.diagnosis == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.slow  # builds the Kimi-depth model (module fixture used only here)
def test_the_case_that_started_the_project(kimi, dtype):
    truth = [layer_out(2), layer_out(30), layer_out(58), FINAL_NORM]
    labels = [EMBED, layer_out(3), layer_out(31), FINAL_NORM]
    assert max(adjacent_gaps(kimi.ref)) < 0.03
    slots = [(f"hs[{i}]", labels[i], kimi.ref.states[truth[i]].to(dtype)) for i in range(4)]
    for reference in (kimi.ref, kimi.fp):
        r = identify(slots, reference, num_layers=61)
        assert [s.matched for s in r.slots] == truth
        assert [s.verdict for s in r.slots] == ["mismatch", "mismatch", "mismatch", "ok"]
        kinds = [d.kind for d in r.diagnosis]
        assert kinds == ["labels_shifted"], r.diagnosis  # one explanation for all three slots, not three
        text = " ".join(d.detail for d in r.diagnosis)
        for i in range(3):
            assert f"'hs[{i}]'" in text and str(truth[i]) in text
        assert "pushed off the end" in text
        assert r.suggested_captures == {f"hs[{i}]": truth[i] for i in range(4)}
        assert len(r.candidates) == 2 * 61 + 2


# -- fingerprints ------------------------------------------------------------------------------------------


def test_projection_is_pinned_and_norm_preserving():
    P = projection_matrix(64, 8, 0)
    assert P.dtype == torch.float32 and P.shape == (64, 8)
    assert torch.equal(P, projection_matrix(64, 8, 0)) and not torch.equal(P, projection_matrix(64, 8, 1))
    # golden: a fingerprint written anywhere must be readable everywhere
    assert int(((P > 0).long().flatten() * torch.arange(512)).sum()) == 68408
    assert int(((projection_matrix(7168, 64, 0) > 0).long().flatten() * torch.arange(7168 * 64)).sum()) == 52607168857
    x = torch.randn(4000, 512, generator=torch.Generator().manual_seed(0))
    ratio = float((x @ projection_matrix(512, 64, 3)).norm() / x.norm())
    assert abs(ratio - 1) < 0.01
    assert effective_dim(7168, 64) == 64 and effective_dim(64, 64) == 8 and effective_dim(4096, 16) == 16


def test_fingerprint_round_trip_and_size(models, tmp_path):
    m = models[("gap", 0)]
    f = tmp_path / "m.fp.safetensors"
    save_fingerprint(m.fp, f)
    back = load_fingerprint(f)
    assert (back.seed, back.dim, back.first_k, back.num_layers, back.hidden_size, back.source) == \
        (m.fp.seed, m.fp.dim, m.fp.first_k, m.fp.num_layers, m.fp.hidden_size, m.fp.source)
    assert torch.equal(back.input_ids, m.fp.input_ids) and back.points == m.fp.points
    for field in ("proj", "norms", "first"):
        a, b = getattr(back, field), getattr(m.fp, field)
        assert a.keys() == b.keys() and all(torch.equal(a[p], b[p]) for p in a)
    assert torch.allclose(back.norms[layer_out(2)], m.ref.states[layer_out(2)].norm(dim=1))
    assert torch.equal(back.first[FINAL_NORM], m.ref.states[FINAL_NORM][:, :5])
    ref_file = tmp_path / "ref.safetensors"
    save_reference(m.ref, ref_file)
    assert f.stat().st_size < ref_file.stat().st_size / 4
    # identification from the loaded fingerprint = from the full reference
    for case in CASES:
        a, b = run_case(m, case, torch.bfloat16, back), run_case(m, case, torch.bfloat16, m.ref)
        assert [(s.matched, s.verdict) for s in a.slots] == [(s.matched, s.verdict) for s in b.slots]
        assert sorted(d.kind for d in a.diagnosis) == sorted(d.kind for d in b.diagnosis)


@pytest.mark.parametrize("damage, needle", [
    ("garbage", "not a readable safetensors"),
    ("reference", "surgeon.kind is 'reference'"),
    ("version", "version"),
    ("points", "'points'"),
    ("shape", "proj is"),
    ("missing", "no 'first' tensor"),
])
def test_malformed_fingerprints_are_one_line_bad_input(models, tmp_path, damage, needle):
    from safetensors.torch import load_file, save_file

    m = models[("plain", 0)]
    f = tmp_path / "x.safetensors"
    if damage == "garbage":
        f.write_bytes(b"\x00\x01not safetensors")
    elif damage == "reference":
        save_reference(m.ref, f)
    else:
        save_fingerprint(m.fp, f)
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as h:
            meta = dict(h.metadata())
        tensors = load_file(str(f))
        if damage == "version":
            meta["surgeon.fingerprint_version"] = "99"
        elif damage == "points":
            meta["points"] = '["layer_out[99]"]'
        elif damage == "shape":
            tensors["proj"] = tensors["proj"][:, :-1].contiguous()
        elif damage == "missing":
            del tensors["first"]
        save_file(tensors, str(f), metadata=meta)
    with pytest.raises(BadInput) as e:
        load_fingerprint(f)
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(BadInput):
        load_fingerprint(tmp_path / "absent.safetensors")


def test_fingerprint_file_streams_in_bounded_chunks(models, tmp_path, monkeypatch):
    import safetensors

    m = models[("gap", 1)]
    ref_file = tmp_path / "ref.safetensors"
    save_reference(m.ref, ref_file)
    real_open = safetensors.safe_open
    reads: list[tuple[str, int, int]] = []
    opens = []

    class Slice:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def __getitem__(self, key):
            assert isinstance(key, slice) and key.step is None
            t = self.inner[key]
            reads.append((self.name, key.start, t.shape[0]))
            return t

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

    class Spy:
        def __init__(self, *a, **k):
            self.inner = real_open(*a, **k)
            opens.append(1)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_slice(self, name):
            return Slice(name, self.inner.get_slice(name))

        def get_tensor(self, name):
            assert name == "input_ids", f"fingerprint_file loaded all of {name}"
            return self.inner.get_tensor(name)

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    chunk = 5
    window = 3 * chunk * 64 * 4  # reopen after three chunks
    fp = fingerprint_file(ref_file, chunk_tokens=chunk, window_bytes=window, workers=2)
    monkeypatch.setattr(safetensors, "safe_open", real_open)

    T = len(IDS)
    assert max(n for _, _, n in reads) <= chunk  # no read larger than a chunk, whatever T is
    covered = {}
    for name, a, n in reads:
        covered.setdefault(name, []).extend(range(a, a + n))
    assert all(sorted(rows) == list(range(T)) for rows in covered.values())  # every row once
    assert len(covered) == len(m.ref.states)
    assert len(reads) == len(m.ref.states) * math.ceil(T / chunk)
    assert len(opens) >= len(reads) // 4  # each reader reopens its mapping every ~3 chunks
    whole = fingerprint(m.ref)
    assert fp.points == whole.points and fp.dim == whole.dim
    for p in fp.points:
        assert torch.allclose(fp.proj[p], whole.proj[p], rtol=1e-5, atol=1e-7)
        assert torch.allclose(fp.norms[p], whole.norms[p], rtol=1e-6)
        assert torch.equal(fp.first[p], whole.first[p])
    r = identify([("x", layer_out(2), m.ref.states[layer_out(3)].bfloat16())], fp)
    assert r.slots[0].matched == layer_out(3)
    save_fingerprint(whole, tmp_path / "x.fp")
    with pytest.raises(BadInput, match="not a surgeon reference"):
        fingerprint_file(tmp_path / "x.fp")


# -- inputs ------------------------------------------------------------------------------------------------


def test_bad_inputs_are_refused_in_one_line(models):
    m = models[("plain", 0)]
    x = m.ref.states[layer_out(1)]
    for slots, needle in [
        ([("a", layer_out(1), x[:-1])], "shape"),
        ([("a", layer_out(1), x.long())], "dtype"),
        ([("a", layer_out(40), x)], "does not have"),
        ([("a", None, [1, 2])], "not a tensor"),
    ]:
        with pytest.raises(BadInput) as e:
            identify(slots, m.ref)
        assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(BadInput, match="num_layers"):
        identify([("a", None, x)], m.ref, num_layers=L + 1)
    r = identify([("a", layer_out(1), x[None])], m.fp)  # a batch of one is fine
    assert r.slots[0].verdict == "ok"
    assert identify([], m.ref).slots == []
    assert isinstance(m.fp, Fingerprint)
