"""The identity pass: a per-point profile of the target that does not depend on the tokens, and
each slot of each file matched to the points whose profile it fits.

Statistics (of one slot of one file, or of one reference prompt at one point):

* the 10%, 50% and 90% quantiles over tokens of ``log ||h_t||`` (the per-token L2 norm): the
  residual stream's norm grows with depth and the final norm resets it to ~``sqrt(H) * |w|``,
  whatever the text (the Kimi-K2.5 mislabelling was found by hand exactly so, from per-token
  norms); quantiles ignore the few huge "attention sink" tokens;
* the per-channel mean direction (the unit mean of :data:`~surgeon.audit.values.SAMPLE_ROWS`
  sampled rows) and the per-channel RMS profile (log RMS per channel, centred), compared with the
  point's by cosine: real models carry massive activations in a few channels that move from
  layer to layer, which a scalar norm does not see.

These statistics move with a sample's length: its first positions (right after the BOS sink) weigh
more in a short sample, and a long one reaches positions a short one never has. With
:data:`MIN_PROMPTS` prompts or more the profile is a *ladder* of profiles, one per rung of sample
lengths (``n`` to ``2n - 1`` rows, ``n`` a power of two), each measured exactly on the prompts'
prefixes of those lengths: a causal model's first ``n`` states of a prompt are its states on the
``n``-token prefix. A sample is judged against the rung of its length (:meth:`Profile.at`); one
longer than the longest rung, against that rung (the reference prompts are the set's longest files,
:mod:`surgeon.audit.reference`); each scalar's spread is at least the rung below's over sqrt(2)
(:func:`_floored`). Measured on 400 clean samples of 8 to 1024 tokens of a tiny Llama (hidden 256,
8 layers, ``benchmarks/audit_lengths.py``): the same prompts' profile of whole prompts flagged 9,
the ladder none (``tests/audit/test_edges.py`` holds a smaller case). Its direction tolerances are
measured out of sample (:func:`_vector_centre`). A profile of fewer prompts (a reference file: one)
has no ladder: a sample shorter than its prompts is judged with its tolerance widened instead
(:meth:`Profile.distances_of`).

A point's profile holds each statistic's centre and its spread from sample to sample, measured
on the reference prompts (files of the set itself when the reference is a model): scalars, the
median of the prompts' values and their standard deviation, tolerance ``max(MIN_TOL, K *
spread)``; directions, the normalised mean of the prompts' and, as tolerance, ``VK`` times the
largest cosine distance of a prompt from it (at least :data:`MIN_VTOL`). With fewer than
:data:`MIN_PROMPTS` prompts (a reference file holds one) the spreads are measured over chunks of
:data:`CHUNK` tokens, which vary more than whole samples (conservative: fewer false alarms, less
power). A statistic that varies as much within a point as between points gets a wide tolerance:
it tells nothing apart, and flags nothing.

A slot *fits* a point when every statistic lies within its tolerance of the point's (its
distance, the largest of the statistics' in tolerances, is <= 1). Verdicts:

* ``ok``: it fits its declared point and no other;
* ``unresolved``: it fits its declared point and another one too: the statistics cannot tell
  these points apart for this slot; not a failure, and said so (the exact identification on a
  sample of files is what decides);
* ``mismatch``: it does not fit its declared point but fits another (``nearest`` names it);
* ``no_match``: it fits no point (a foreign state, a scaled or broken buffer);
* ``not_run``: no finite rows, no declared point, or no profile.

Only ``mismatch`` and ``no_match`` fail an audit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from surgeon.core.errors import BadInput
from surgeon.core.points import Point

K = 8.0
MIN_PROMPTS = 6  # fewer reference prompts: the spread is measured over CHUNK-token chunks of them
CHUNK = 32
K_CHUNKS = 10.0  # chunks of one prompt vary less than whole samples do at some depths: a wider band
MIN_TOL = 0.03  # log units: 3% in norm
VK = 2.0  # direction tolerance: this many times the largest distance of a reference prompt
MIN_VTOL = 0.02  # cosine distance
# good sampled rows a slot needs for the per-channel statistics: fewer lean on the first positions of
# a sample (states right after the BOS sink), whose direction is not the one of a long sample's rows
MIN_VECTOR_ROWS = 32
LADDER_FROM = 2  # the shortest rung of the ladder of sample lengths (rows)
ANCHOR_TOL = 0.02  # cosine distance within which a first row is the point's (engines' numerics differ a little)
SCALARS = ("log_norm_median", "log_norm_width")
VECTORS = ("direction", "rms_profile")


@dataclass(frozen=True)
class Stats:
    """One slot's (or one reference prompt's) identity statistics."""

    scalars: tuple[float | None, ...]  # SCALARS
    vectors: tuple[Any, ...] = (None, None)  # VECTORS: unit float32 [H] tensors, or None
    first_token: int | None = None  # the anchor: the sample's first token and its row (unit float32 [H])
    first_row: Any = None
    tokens: int | None = None  # the rows behind the scalars (finite, nonzero); None: not known


def file_stats(svs: list, moments=None, first_token: int | None = None, first_rows: list | None = None,
               min_rows: int = MIN_VECTOR_ROWS, tokens: int | None = None) -> list[Stats]:
    """The statistics of a file's slots from their :class:`~surgeon.audit.values.SlotValues`, the
    :class:`~surgeon.audit.values.Moments` of their good sampled rows and their first rows (the
    state of position 0, which depends on the first token only), every slot in the same few array
    ops; the per-channel ones where a slot has ``min_rows`` good sampled rows. ``tokens``: the
    slots' row count."""
    import numpy as np
    import torch

    S = len(svs)
    vecs: list[tuple[Any, ...]] = [(None, None)] * S
    if moments is not None and len(moments):  # numpy: a file's few small arrays cost numpy's per-op time, not torch's
        cnt = moments.count
        per = np.maximum(cnt, 1).astype(np.float32)[:, None]
        mean = moments.sum / per
        with np.errstate(divide="ignore", invalid="ignore"):
            rms = np.log(np.maximum(np.sqrt(moments.sumsq / per), np.float32(1e-30)))
            both = np.stack([mean, rms - rms.mean(1, keepdims=True)], 1)  # [S, 2, H]
            both = both / np.maximum(np.linalg.norm(both, axis=2, keepdims=True), np.float32(1e-30))
        usable = ((cnt >= max(2, min_rows)) & np.isfinite(both).all((1, 2))).tolist()
        vecs = [(torch.from_numpy(b[0]), torch.from_numpy(b[1])) if u else (None, None) for b, u in zip(both, usable)]
    firsts: list[Any] = [None] * S
    if first_token is not None and first_rows is not None:
        F = torch.stack([r.float() for r in first_rows]).numpy()
        with np.errstate(invalid="ignore", over="ignore"):
            n = np.linalg.norm(F, axis=1)
            ok = (np.isfinite(n) & (n > 0)).tolist()
            F = F / np.maximum(n, np.float32(1e-30))[:, None]
        firsts = [torch.from_numpy(f) if o else None for f, o in zip(F, ok)]
    out = []
    for sv, vec, row in zip(svs, vecs, firsts):
        width = None if sv.log_norm_q90 is None else sv.log_norm_q90 - sv.log_norm_q10
        n = None if tokens is None else tokens - sv.nonfinite_rows - sv.zero_rows
        out.append(Stats((sv.log_norm_median, width), vec, first_token if row is not None else None, row, n))
    return out


def stats_of(sv, moments=None, first_token: int | None = None, first_row=None, min_rows: int = MIN_VECTOR_ROWS,
             tokens: int | None = None) -> Stats:
    """:func:`file_stats` of one slot, from the :class:`~surgeon.audit.values.Moments` of its good
    sampled rows (:func:`~surgeon.audit.values.slot_values` gives them) and its first row."""
    return file_stats([sv], moments, first_token, None if first_row is None else [first_row], min_rows, tokens)[0]


def _unit(v):
    import torch

    return v / torch.linalg.vector_norm(v).clamp_min(1e-30)


def _cos_distance(a, b) -> float:
    """1 - the dot product of two unit float32 [H] torch vectors (numpy's: ~10x less per-call time)."""
    import numpy as np

    return float(1.0 - np.dot(a.float().numpy(), b.float().numpy()))


@dataclass(frozen=True)
class PointProfile:
    point: str
    centre: float  # median over prompts of the median log per-token norm (the statistic the report plots)
    spread: float  # its std over prompts (or CHUNK-token chunks of too few prompts)
    k: float = K  # tolerance in spreads
    centres: tuple[float, ...] = ()  # SCALARS
    spreads: tuple[float, ...] = ()
    vectors: tuple[Any, ...] = (None, None)  # VECTORS' centres
    vtols: tuple[float, ...] = (math.inf, math.inf)
    first_token: int | None = None  # the anchor's token and this point's state there (unit), if any
    first_row: Any = None
    tokens: float = 0.0  # rows behind a sample whose spread the tolerances are (the median); 0: not known

    @property
    def tol(self) -> float:
        return max(MIN_TOL, self.k * self.spread)

    def anchored(self, s: Stats) -> bool | None:
        """Whether the slot's first row is this point's (None: no anchor to compare on)."""
        if s.first_row is None or self.first_row is None or s.first_token != self.first_token \
                or s.first_row.shape != self.first_row.shape:
            return None
        return _cos_distance(s.first_row, self.first_row) <= ANCHOR_TOL


@dataclass(frozen=True)
class Profile:
    points: tuple[PointProfile, ...]  # forward-pass order
    source: str
    prompts: int
    tokens: int
    files: tuple[str, ...] = ()  # the set's files whose ids the target ran on (an hf: profile)
    # (n, the points measured on the prompts' prefixes of n to 2n-1 rows), n ascending; () : one profile
    ladder: tuple[tuple[int, tuple[PointProfile, ...]], ...] = ()

    def at(self, tokens: int | None) -> Profile:
        """The profile a sample of ``tokens`` rows is judged against: the longest rung of the ladder
        at most that long (the shortest rung for a shorter sample), made once per rung; this one
        where there is no ladder or the length is not known."""
        if not self.ladder or tokens is None:
            return self
        n, points = self.ladder[0]
        for m, pts in self.ladder:
            if m <= tokens:
                n, points = m, pts
        rungs = self.__dict__.setdefault("_rungs", {})  # a cache, not a field (frozen: its dict is written)
        if n not in rungs:
            import dataclasses

            rungs[n] = dataclasses.replace(self, points=points, ladder=())
        return rungs[n]

    def describe(self) -> str:
        """Which statistics this profile compares (a reference of norms only has no others)."""
        has = ["the median and the 10-90% width of log per-token norms"]
        if any(v is not None for p in self.points for v in p.vectors):
            has.append("the per-channel mean direction and RMS profile")
        tok = next((p.first_token for p in self.points if p.first_row is not None), None)
        if tok is not None:
            has.append(f"the first row of samples that start with token {tok} (its state depends on that token only)")
        return "identity statistics: " + ", ".join(has)

    def distances(self, s: Stats) -> dict[str, float]:
        """Every point's distance from ``s`` (:meth:`distances_of` of one slot)."""
        return self.distances_of([s])[0]

    def distances_of(self, stats: list[Stats]) -> list[dict[str, float]]:
        """Per slot, every point's distance (the largest of its statistics' in tolerances), all the
        slots of a file against the whole profile in a few numpy ops (small arrays)."""
        import numpy as np

        m = self._matrices()
        x = np.array([[math.nan if v is None else v for v in s.scalars] for s in stats], dtype=np.float64)
        with np.errstate(invalid="ignore"):
            gap = np.abs(x[:, None, :] - m["centres"][None]) / m["tols"][None]
        # a statistic over fewer rows than the spread was measured on varies more (as 1/sqrt(rows)): its
        # tolerance widened so, or a short sample of the right point would not fit it
        n = np.array([math.inf if s.tokens is None else s.tokens for s in stats], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            gap = gap * np.sqrt(np.minimum(1.0, n[:, None] / m["tokens"][None]))[..., None]
        gap = np.where(np.isnan(gap), 0.0, gap)  # a statistic the slot lacks decides nothing (inf stays inf)
        d = np.maximum(gap.max(2), 0.0)  # [S, P]
        for i in range(len(VECTORS)):
            c = m["vectors"][i]
            have = [j for j, s in enumerate(stats) if s.vectors[i] is not None and c is not None
                    and c.shape[1] == s.vectors[i].shape[0]]
            if have:
                v = np.stack([np.asarray(stats[j].vectors[i], dtype=np.float32) for j in have])
                with np.errstate(invalid="ignore"):
                    cos = (1.0 - v @ c.T).astype(np.float64) / m["vtols"][i]
                cos = np.where(np.isnan(cos), 0.0, cos)  # a point without this vector decides nothing
                d[have] = np.maximum(d[have], cos)
        names = [p.point for p in self.points]
        return [dict(zip(names, row)) for row in d.tolist()]

    def _matrices(self) -> dict[str, Any]:
        """The profile as numpy matrices (points x statistics), made once."""
        cached = self.__dict__.get("_mats")
        if cached is None:
            import numpy as np

            pts = self.points
            vectors = []
            for i in range(len(VECTORS)):
                vs = [p.vectors[i] for p in pts]
                shapes = {tuple(v.shape) for v in vs if v is not None}
                vectors.append(None if len(shapes) != 1 else np.stack(
                    [np.full(next(iter(shapes)), math.nan, dtype=np.float32) if v is None
                     else np.asarray(v, dtype=np.float32) for v in vs]))
            cached = {"centres": np.array([p.centres for p in pts], dtype=np.float64),
                      "tols": np.array([[max(MIN_TOL, p.k * sp) for sp in p.spreads] for p in pts], dtype=np.float64),
                      "tokens": np.array([p.tokens for p in pts], dtype=np.float64),
                      "vectors": vectors,
                      "vtols": [np.array([p.vtols[i] for p in pts], dtype=np.float64) for i in range(len(VECTORS))]}
            object.__setattr__(self, "_mats", cached)
        return cached

    def digest(self) -> str:
        """A sha256 of every statistic's centre and tolerance (what a resume state must agree on): the
        profile as the JSON reports it (:class:`surgeon.audit.output.AuditProfile`, its Python dump:
        the digest a state recorded before stays the same), then every point's statistics."""
        import hashlib

        from surgeon.audit.output import AuditProfile, dump

        h = hashlib.sha256(repr(dump(AuditProfile, self, mode="python")).encode())
        for points in (self.points, *(pts for _, pts in self.ladder)):
            for p in points:
                h.update(repr((p.centres, p.spreads, p.vtols, p.k, p.first_token, p.tokens)).encode())
                for v in (*p.vectors, p.first_row):
                    if v is not None:
                        h.update(v.numpy().tobytes())
        return h.hexdigest()


def _norm_stats(norms, min_rows: int = MIN_VECTOR_ROWS) -> Stats:
    from surgeon.audit.values import SlotValues, norm_stats

    sv = SlotValues("", None, "")
    norm_stats(sv, norms.float().reshape(-1))
    return stats_of(sv, tokens=int(norms.numel()))


def _state_stats(x, min_rows: int = MIN_VECTOR_ROWS) -> Stats:
    from surgeon.audit.values import slot_values

    sv, _, moments = slot_values("", None, x.float())
    return stats_of(sv, moments, min_rows=min_rows, tokens=int(x.shape[0]))


def _vector_centre(vs: list, pieces: list, groups: list | None = None) -> tuple[Any, float]:
    """A vector statistic's centre (the unit mean of ``vs``) and tolerance: :data:`VK` times the
    largest cosine distance of a piece from it. ``groups``: the prompt of each piece; then each
    prompt's pieces are measured out of sample, from the centre of the other prompts' (a centre made
    with a piece lies nearer to it than to a new sample: a direction of no structure over ``n``
    prompts lies ``1 - 1/sqrt(n)`` from its own mean, ~1 from a new one's)."""
    import torch

    if not vs or len(pieces) < 2 or (groups is not None and len(set(groups)) < 2):
        return None, math.inf
    c = _unit(torch.stack(vs).mean(0))
    if groups is None:
        return c, max(MIN_VTOL, VK * max(_cos_distance(v, c) for v in pieces))
    P = torch.stack(pieces)
    total = P.sum(0)
    far = 0.0
    for g in set(groups):
        own = [j for j, x in enumerate(groups) if x == g]
        rest = _unit(total - P[own].sum(0))
        far = max(far, *(_cos_distance(P[j], rest) for j in own))
    return c, max(MIN_VTOL, VK * far)


def _point(p: str, whole: list[Stats], pieces: list[Stats], k: float, anchor: tuple[int | None, Any],
           groups: list[int] | None = None) -> PointProfile:
    """A point's profile: its statistics' centres over ``whole`` and their spreads over ``pieces``
    (``groups``: each piece's prompt, for the vectors' out-of-sample tolerance)."""
    import torch

    centres, spreads = [], []
    for i in range(len(SCALARS)):
        xs = torch.tensor([s.scalars[i] for s in whole if s.scalars[i] is not None], dtype=torch.float64)
        ps = torch.tensor([s.scalars[i] for s in pieces if s.scalars[i] is not None], dtype=torch.float64)
        if not xs.numel():
            raise BadInput(f"the reference's {p} holds no finite nonzero rows: no profile")
        sd = float(ps.std()) if ps.numel() > 1 else 0.0
        centres.append(float(xs.median()))
        spreads.append(sd if math.isfinite(sd) else 0.0)
    vecs = []
    for i in range(len(VECTORS)):
        have = [j for j, s in enumerate(pieces) if s.vectors[i] is not None]
        vecs.append(_vector_centre([s.vectors[i] for s in whole if s.vectors[i] is not None],
                                   [pieces[j].vectors[i] for j in have],
                                   None if groups is None else [groups[j] for j in have]))
    rows = sorted(s.tokens for s in pieces if s.tokens)
    return PointProfile(p, centres[0], spreads[0], k, tuple(centres), tuple(spreads), tuple(v for v, _ in vecs),
                        tuple(t for _, t in vecs), *anchor, tokens=float(rows[len(rows) // 2]) if rows else 0.0)


def _chunks(x, n: int) -> list:
    return [x[a:a + CHUNK] for a in range(0, n, CHUNK) if min(CHUNK, n - a) >= CHUNK // 2]


def _anchor(states: list, first_tokens: list[int] | None) -> tuple[int | None, Any]:
    """The most common first token of the prompts and the point's unit state there (their mean)."""
    import torch

    if not first_tokens or states[0].dim() != 2:
        return None, None
    tok = max(set(first_tokens), key=first_tokens.count)
    rows = [x[0].float() for x, t in zip(states, first_tokens) if t == tok]
    row = _unit(torch.stack(rows).mean(0))
    return (tok, row) if bool(torch.isfinite(row).all()) and bool(row.any()) else (None, None)


def _profile(prompts: list[dict[Point, Any]], num_layers: int, source: str, stats,
             first_tokens: list[int] | None = None) -> Profile:
    if not prompts:
        raise BadInput("no reference states to build the identity profile from")
    points = [p for p in sorted(prompts[0], key=lambda p: p.depth(num_layers)) if p.kind != "layer_delta"]
    few = len(prompts) < MIN_PROMPTS  # too few prompts to measure a spread: chunks of them, conservatively
    out = []
    for p in points:
        whole = [stats(x[p]) for x in prompts]
        # chunks measure the spread only, each of CHUNK rows or fewer: per-channel statistics of them all
        pieces = [stats(c, 2) for x in prompts for c in _chunks(x[p], x[p].shape[0])] if few else whole
        out.append(_point(str(p), whole, pieces, K_CHUNKS if few else K, _anchor([x[p] for x in prompts], first_tokens),
                          None if few else list(range(len(prompts)))))
    tokens = sum(int(x[points[-1]].shape[0]) for x in prompts) if points else 0
    ladder = () if few or not points else _ladder(prompts, points, stats, out)
    return Profile(tuple(out), source, len(prompts), tokens, ladder=ladder)


def _cuts(n: int, t: int) -> list[int]:
    """The prefix lengths rung ``n`` is measured on in a prompt of ``t`` rows: the rung's shortest
    and longest samples (``n``, ``2n - 1``) and, where the per-channel statistics start inside the
    rung, its shortest sample that has them; none longer than the prompt."""
    return sorted({min(t, m) for m in (n, max(n, MIN_VECTOR_ROWS + 1), 2 * n - 1) if m < 2 * n})


def _ladder(prompts: list[dict[Point, Any]], points: list[Point], stats,
            whole: list[PointProfile]) -> tuple[tuple[int, tuple[PointProfile, ...]], ...]:
    """The profile of each rung ``n`` (samples of ``n`` to ``2n - 1`` rows; ``n`` from
    :data:`LADDER_FROM`, doubling) up to the longest that :data:`MIN_PROMPTS` prompts reach, on the
    prefixes :func:`_cuts` names of the prompts that long: the statistics' centres and spreads over
    those lengths (a sample anywhere in the rung lies within them); the anchor as the whole's (the
    state at position 0 does not depend on the length)."""
    lengths = [int(x[points[0]].shape[0]) for x in prompts]
    rungs: list[tuple[int, tuple[PointProfile, ...]]] = []
    n = LADDER_FROM
    while sum(t >= n for t in lengths) >= MIN_PROMPTS:
        cuts = [(i, m) for i, t in enumerate(lengths) if t >= n for m in _cuts(n, t)]
        try:
            pts = []
            for j, (p, w) in enumerate(zip(points, whole)):
                pieces = [stats(prompts[i][p][:m]) for i, m in cuts]
                pt = _point(str(p), pieces, pieces, K, (w.first_token, w.first_row), [i for i, _ in cuts])
                pts.append(_floored(pt, rungs[-1][1][j] if rungs else None))
            rungs.append((n, tuple(pts)))
        except BadInput:  # a point with no good row in prefixes this short: its samples take the next rung
            pass
        n *= 2
    return tuple(rungs)


def _floored(pt: PointProfile, below: PointProfile | None) -> PointProfile:
    """``pt`` with each scalar's spread at least the rung below's over sqrt(2): a statistic of twice
    the rows varies at best half as much (the variance of a quantile of independent rows falls as
    1/rows; correlated rows fall slower). The spread of a rung is measured over its prompts, a
    dozen: where they happen to agree more closely than samples do (the longest rung, one prefix
    of each prompt), the floor keeps a sample of the right point from lying outside them."""
    import dataclasses

    if below is None:
        return pt
    spreads = tuple(max(sp, lo / math.sqrt(2)) for sp, lo in zip(pt.spreads, below.spreads))
    return dataclasses.replace(pt, spreads=spreads, spread=spreads[0])


def profile_from_norms(prompts: list[dict[Point, object]], num_layers: int, source: str) -> Profile:
    """A profile from per-token norms ``{point: [T]}`` of one or more prompts (deltas ignored): the
    norm statistics only."""
    return _profile(prompts, num_layers, source, _norm_stats)


def profile_from_states(prompts: list[dict[Point, Any]], num_layers: int, source: str,
                        first_tokens: list[int] | None = None) -> Profile:
    """A profile from reference states ``{point: [T, H]}`` of one or more prompts: every statistic,
    and the first-row anchor when ``first_tokens`` (each prompt's first token id) are given."""
    return _profile(prompts, num_layers, source, _state_stats, first_tokens)


def match_slot(profile: Profile | None, declared: str | None, stats: Stats | None,
               dist: dict[str, float] | None = None) -> dict:
    """The identity of one slot against the profile: nearest point, verdict, distance (in tolerances).

    The points whose statistics the slot fits are the candidates; when several are, the first-row
    anchor (where the slot's sample starts with the profile's first token) keeps those whose state
    at position 0 the slot's first row is; a first row that is no candidate's (a sample cut from
    the middle of a sequence: its position 0 has context) decides nothing. ``dist``: the slot's
    :meth:`Profile.distances` where the caller computed a whole file's at once."""
    if profile is None or declared is None or stats is None or stats.scalars[0] is None \
            or not math.isfinite(stats.scalars[0]):
        return {"nearest": None, "verdict": "not_run", "distance": None}
    dist = profile.distances(stats) if dist is None else dist
    if declared not in dist:
        return {"nearest": min(dist, key=lambda k: dist[k]), "verdict": "not_run", "distance": None}
    fits = [p for p in profile.points if dist[p.point] <= 1.0]
    by_anchor = False
    if len(fits) > 1:
        anchored = [p for p in fits if p.anchored(stats)]
        by_anchor = bool(anchored) and len(anchored) < len(fits)
        fits = anchored or fits
    names = [p.point for p in fits]
    nearest = min(names, key=lambda k: dist[k]) if names else None
    if declared in names:
        verdict = "ok" if len(names) == 1 else "unresolved"
        nearest = declared if len(names) == 1 else nearest
    else:
        verdict = "mismatch" if names else "no_match"
    return {"nearest": nearest, "verdict": verdict, "distance": dist[declared], "by_anchor": by_anchor}
