"""Identification: which physical point does each captured slot really hold?

Every slot ``[T, H]`` (token-aligned with the reference, any float dtype, compared in float32) is
compared with every point of the reference, layer deltas included, by relative error
``||s - r||_F / ||r||_F``. Against a :class:`~surgeon.verify.fingerprint.Fingerprint` the same error is
estimated in the fingerprint's projected space (``||(s - r)P||_F`` over the exact ``||r||_F`` from
the stored per-token norms).

Thresholds (a slot is *matched* only when all four hold for its best candidate):

=========================  ======  =========================================================
``MAX_REL_ERR``            0.20    close in absolute terms. A correct capture sits at the
                                   noise of its dtype: bf16 rounding is ~0.2-0.3% relative,
                                   a bf16 engine against an fp32 reference a few percent at
                                   depth. Wrong buffers sit far above: all zeros is exactly
                                   1.0, noise or a stale capture of other tokens ~1.4
                                   (``sqrt(2)`` for independent states of equal scale), a
                                   scaled or foreign state >= 0.5.
``MIN_MARGIN``             2.0     clearly better than the runner-up (runner-up error / best
                                   error). With adjacent layers a relative gap ``d`` apart
                                   and subject noise ``n``, the expected margin is
                                   ``sqrt(1 + (d/n)^2)``: 3.5 at the hardest case we support
                                   (d = 1%, n = 0.3%), ~7 on the tiny test models (d >= 1.2%,
                                   bf16 n ~ 0.18%). 2.0 keeps that case with room for the
                                   projection spread of a fingerprint (a few percent on each
                                   estimate) and still refuses a slot halfway between two
                                   points (margin ~1).
``TOKEN_REL_ERR``          0.5     per-token relative error under which a token "matches";
``MIN_TOKEN_FRACTION``     0.9     the share of tokens that must match. A Frobenius error is
                                   dominated by the largest tokens (a BOS with massive
                                   activations can carry most of the energy of a short
                                   sequence): a stale buffer that shares only that token
                                   would pass the first two tests, not this one.
=========================  ======  =========================================================

Speed. Against a Fingerprint each slot costs one pass over the subject (convert + project,
chunked so no buffer larger than ~8 MB is allocated) and a ``[C, T, dim]`` comparison. Against a
full Reference, screening then confirmation: every candidate is first compared on
``SCREEN_TOKENS`` evenly spaced token rows at full width (a strided view of the reference, by
direct differences, so an exact match screens as 0), then the ``CONFIRM_TOP`` best
candidates of each slot (and its declared point) are recomputed exactly over all tokens, chunk by
chunk, giving the per-token errors the token test needs. A Kimi-sized problem (124 candidates x
2048 tokens x 7168, 4 bf16 slots; 7.3 GB of float32 reference) reads ~6% of the reference to
screen and ~10% to confirm; ``benchmarks/identify.py`` measures it. ``MatchReport.errors`` holds the
confirmed values where confirmed and the screened values elsewhere. The work runs as independent
single-threaded streams, one per torch thread (see :func:`surgeon.verify.streams.run_streams`), so a busy neighbour on a
small machine slows it down in proportion instead of stalling every op at a barrier.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from surgeon.core.errors import BadInput
from surgeon.core.points import EMBED, FINAL_NORM, Point, layer_out
from surgeon.verify.streams import run_streams

MAX_REL_ERR = 0.20
MIN_MARGIN = 2.0
TOKEN_REL_ERR = 0.5
MIN_TOKEN_FRACTION = 0.9
SCREEN_TOKENS = 128
CONFIRM_TOP = 2  # best and runner-up, exactly (plus the declared point)
SHIFTS = 4  # token shifts tried when diagnosing a buffer that matches nothing
# A slot whose best candidates fit it about equally (within MIN_MARGIN of the best, each close in
# absolute terms) with its declared point among them, or with none declared: the reference cannot
# tell those points apart on these tokens, so the slot is neither "ok" nor "mismatch". A declared
# point outside that tie is a decided fault ("no_match": it is not what was declared).
UNDECIDED = "undecided"
_CHUNK_BYTES = 8 << 20


@dataclass
class SlotResult:
    name: str
    declared: Point | None
    matched: Point | None  # None: nothing fits
    rel_err: float  # of the best candidate
    margin: float  # runner-up rel_err / best rel_err (>= 1; larger = surer; inf for an exact match)
    verdict: str  # "ok" | "mismatch" | "no_match" | "unlabelled" | "undecided" (see UNDECIDED)
    ranking: list[tuple[Point, float]]  # all candidates, best first
    token_fraction: float = 0.0  # share of tokens whose own error vs the best candidate is small

    @property
    def exact(self) -> bool:
        """The slot equals its best candidate bit for bit (rel err 0): no margin to speak of."""
        return self.rel_err == 0.0

    @property
    def margin_text(self) -> str:
        """The margin for people: ``exact``, or the ratio (``12.3x``)."""
        return "exact" if self.exact else f"{self.margin:.1f}x"


@dataclass
class Diagnosis:
    kind: str
    detail: str


@dataclass
class MatchReport:
    slots: list[SlotResult]
    diagnosis: list[Diagnosis]
    candidates: list[Point]
    errors: torch.Tensor  # [n_slots, n_candidates] relative errors, for a heatmap
    suggested_captures: dict[str, Point] = field(default_factory=dict)  # name -> matched point

    @property
    def ok(self) -> bool:
        return all(s.verdict == "ok" for s in self.slots)

    @property
    def undecided(self) -> list[SlotResult]:
        """The slots the evidence does not decide (:data:`UNDECIDED`)."""
        return [s for s in self.slots if s.verdict == "undecided"]


# -- subjects -------------------------------------------------------------------------------------


@dataclass
class _Subject:
    name: str
    declared: Point | None
    x: torch.Tensor  # [T, H], any float dtype, CPU
    norms: torch.Tensor = None  # [T] float64 per-token L2 norms, set by _scan before anything reads them
    nonfinite: int = 0
    proj: torch.Tensor | None = None  # [T, dim] in the fingerprint's space
    tok_rel: dict[int, torch.Tensor] = field(default_factory=dict)  # candidate -> [T]


def _rows(H: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * H))


def _as_subject(name: str, declared: Point | None, t: object, T: int, H: int, candidates: set[Point], L: int) -> _Subject:
    if not isinstance(t, torch.Tensor):
        raise BadInput(f"slot {name!r} is a {type(t).__name__}, not a tensor")
    x = t.detach()
    while x.dim() > 2 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 2 or tuple(x.shape) != (T, H):
        raise BadInput(f"slot {name!r} has shape {list(t.shape)}; the reference is [{T}, {H}] (tokens x hidden): "
                       "align the tokens first, or it is another model")
    if not x.is_floating_point():
        raise BadInput(f"slot {name!r} has dtype {x.dtype}: hidden states are floating point")
    if declared is not None and declared not in candidates:
        raise BadInput(f"slot {name!r} is declared {declared}, which the reference ({L} layers) does not have")
    return _Subject(name, declared, x.cpu())


def _scan(s: _Subject, P: torch.Tensor | None = None) -> None:
    """One chunked pass: per-token norms, non-finite count, and the projection if asked."""
    x = s.x
    T, H = x.shape
    rows = _rows(H)
    buf = None if x.dtype == torch.float32 else torch.empty(min(rows, T), H, dtype=torch.float32)
    norms = torch.empty(T, dtype=torch.float32)
    proj = None if P is None else torch.empty(T, P.shape[1], dtype=torch.float32)
    for a in range(0, T, rows):
        b = min(T, a + rows)
        c = x[a:b] if buf is None else buf[: b - a].copy_(x[a:b])
        torch.linalg.vector_norm(c, dim=1, out=norms[a:b])
        if proj is not None:
            torch.mm(c, P, out=proj[a:b])
    s.norms = norms.double()
    if not bool(torch.isfinite(norms).all()):
        s.nonfinite = int((~torch.isfinite(x)).sum())
        if s.nonfinite == 0:  # finite values whose squares overflow float32
            s.norms = torch.linalg.vector_norm(x.double(), dim=1)
    s.proj = proj


def _rel(e2: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """sqrt(e2 / r2) with NaN -> inf and a zero reference -> inf (nothing matches a zero state)."""
    out = torch.sqrt(e2 / r2)
    out = torch.where(r2 > 0, out, torch.full_like(out, math.inf))
    return torch.nan_to_num(out, nan=math.inf, posinf=math.inf)


def _tok_rel(e2: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    r = torch.sqrt(r2)
    floor = max(float(r.max()) * 1e-6, 1e-30) if r.numel() else 1e-30
    return torch.nan_to_num(torch.sqrt(e2) / r.clamp_min(floor), nan=math.inf, posinf=math.inf)


# -- backends -------------------------------------------------------------------------------------




def _vs_reference(subjects: list[_Subject], ref, cands: list[Point]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(errors [n, C] float64, per-candidate token RMS norm [C])`` against full states."""
    errs, scale = _screen(subjects, ref, cands)

    # confirm: the top candidates of each slot (and its declared point), exactly, every token;
    # again if confirming reordered a slot so that its best or runner-up was only screened
    pos = {p: j for j, p in enumerate(cands)}
    need: list[set[int]] = []
    for i, s in enumerate(subjects):
        top = set(torch.argsort(errs[i], stable=True)[:CONFIRM_TOP].tolist())
        if s.declared is not None:
            top.add(pos[s.declared])
        need.append(top)
    for _ in range(3):
        _confirm(subjects, ref, cands, errs, need)
        need = [set(torch.argsort(errs[i], stable=True)[:CONFIRM_TOP].tolist()) - set(s.tok_rel)
                for i, s in enumerate(subjects)]
        if not any(need):
            break
    return errs, scale


def _screen(subjects: list[_Subject], ref, cands: list[Point]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every candidate on evenly spaced token rows (a strided view: nothing is copied from the
    reference), full width, by direct differences (exact: no cancellation); also scans each subject.
    Its own function so the stacked screen rows are freed when it returns."""
    n, C = len(subjects), len(cands)
    T = subjects[0].x.shape[0]
    sel = slice(None, None, max(1, -(-T // SCREEN_TOKENS)))
    S = torch.stack([s.x[sel].to(torch.float32) for s in subjects])  # [n, m, H]
    m = S.shape[1]
    errs = torch.empty(n, C, dtype=torch.float64)
    scale = torch.empty(C, dtype=torch.float64)
    per_task = max(1, C // 16)

    def screen(c0: int) -> None:
        d = torch.empty_like(S)
        for c in range(c0, min(C, c0 + per_task)):
            r = ref.states[cands[c]][sel]
            if r.dtype != torch.float32:
                r = r.to(torch.float32)
            rn2 = torch.linalg.vector_norm(r).double().square()
            torch.sub(S, r, out=d)
            e2 = torch.linalg.vector_norm(d.view(n, -1), dim=1).double().square()
            errs[:, c] = _rel(e2, rn2.expand_as(e2))
            scale[c] = torch.sqrt(rn2 / m)

    tasks: list[Callable[[], None]] = [partial(_scan, s) for s in subjects]
    run_streams(tasks + [partial(screen, c0) for c0 in range(0, C, per_task)])
    return errs, scale


def _confirm(subjects: list[_Subject], ref, cands: list[Point], errs: torch.Tensor, need: list[set[int]]) -> None:
    """Exact errors of the ``need``-ed (slot, candidate) pairs over all tokens, chunk by chunk;
    per-token errors into ``subject.tok_rel``."""
    T, H = subjects[0].x.shape
    union = sorted({c for top in need for c in top})
    if not union:
        return
    ref2 = {c: torch.zeros(T, dtype=torch.float64) for c in union}
    err2 = {(i, c): torch.zeros(T, dtype=torch.float64) for i, top in enumerate(need) for c in top}
    rows = _rows(H)

    def chunk(a: int) -> None:
        b = min(T, a + rows)
        xbuf = torch.empty(b - a, H, dtype=torch.float32)
        dbuf = torch.empty(b - a, H, dtype=torch.float32)
        nbuf = torch.empty(b - a, dtype=torch.float32)
        chunks = {}
        for c in union:
            rc = ref.states[cands[c]][a:b]
            if rc.dtype != torch.float32:
                rc = rc.to(torch.float32)
            chunks[c] = rc
            torch.linalg.vector_norm(rc, dim=1, out=nbuf)
            ref2[c][a:b] = nbuf.double().square()
        for i, s in enumerate(subjects):
            if not need[i]:
                continue
            xc = s.x[a:b] if s.x.dtype == torch.float32 else xbuf.copy_(s.x[a:b])
            for c in need[i]:
                torch.linalg.vector_norm(torch.sub(xc, chunks[c], out=dbuf), dim=1, out=nbuf)
                err2[(i, c)][a:b] = nbuf.double().square()

    run_streams([partial(chunk, a) for a in range(0, T, rows)])
    for (i, c), e2 in err2.items():
        errs[i, c] = _rel(e2.sum().reshape(1), ref2[c].sum().reshape(1))[0]
        subjects[i].tok_rel[c] = _tok_rel(e2, ref2[c])


def _vs_fingerprint(subjects: list[_Subject], fp, cands: list[Point]) -> tuple[torch.Tensor, torch.Tensor]:
    from surgeon.verify.fingerprint import projection_matrix

    n, C = len(subjects), len(cands)
    T, _ = subjects[0].x.shape
    P = projection_matrix(fp.hidden_size, fp.dim, fp.seed)
    Rp = torch.stack([fp.proj[p].to(torch.float32) for p in cands])  # [C, T, dim]
    Rn2 = torch.stack([fp.norms[p] for p in cands]).to(torch.float64).square()  # [C, T]
    den = Rn2.sum(1)
    errs = torch.empty(n, C, dtype=torch.float64)
    block = max(1, (16 << 20) // max(1, T * fp.dim))  # candidates per [block, T, dim] difference
    pos = {p: j for j, p in enumerate(cands)}

    def slot(i: int) -> None:
        s = subjects[i]
        _scan(s, P)
        proj = s.proj
        assert proj is not None  # _scan with a projection matrix always sets it
        e2 = torch.empty(C, T, dtype=torch.float64)
        for c0 in range(0, C, block):
            d = Rp[c0 : c0 + block] - proj[None]
            e2[c0 : c0 + block] = d.square().sum(-1).double()
        errs[i] = _rel(e2.sum(1), den)
        top = set(torch.argsort(errs[i], stable=True)[:CONFIRM_TOP].tolist())
        if s.declared is not None:
            top.add(pos[s.declared])
        for c in top:
            s.tok_rel[c] = _tok_rel(e2[c], Rn2[c])

    run_streams([partial(slot, i) for i in range(n)])
    return errs, torch.sqrt(den / T)


# -- identify ------------------------------------------------------------------------------------


def identify(slots: Sequence[tuple[str, Point | None, torch.Tensor]], reference, *,
             num_layers: int | None = None) -> MatchReport:
    """Name the point each slot holds, judge it against its declared point, and diagnose."""
    from surgeon.verify.fingerprint import Fingerprint

    is_fp = isinstance(reference, Fingerprint)
    store = reference.proj if is_fp else getattr(reference, "states", None)
    if not isinstance(store, dict) or not store:
        raise BadInput("the reference holds no states")
    L = int(reference.num_layers)
    if num_layers is not None and int(num_layers) != L:
        raise BadInput(f"num_layers {num_layers} differs from the reference's {L}")
    cands = sorted(store, key=lambda p: p.depth(L))
    first = store[cands[0]]
    T = int(first.shape[0])
    H = int(reference.hidden_size)
    subjects = [_as_subject(str(name), declared, t, T, H, set(cands), L) for name, declared, t in slots]
    if not subjects:
        return MatchReport([], [], cands, torch.empty(0, len(cands)), {})
    errs, scale = (_vs_fingerprint if is_fp else _vs_reference)(subjects, reference, cands)

    results: list[SlotResult] = []
    for i, s in enumerate(subjects):
        e = errs[i]
        order = torch.argsort(e, stable=True).tolist()
        best = order[0]
        best_err = float(e[best])
        runner = float(e[order[1]]) if len(order) > 1 else math.inf
        if not math.isfinite(best_err):
            margin = 1.0
        elif best_err == 0.0:
            margin = math.inf if runner > 0.0 else 1.0  # exact; two candidates both exact tell nothing apart
        else:
            margin = max(1.0, runner / best_err)
        tr = s.tok_rel.get(best)
        frac = float((tr <= TOKEN_REL_ERR).double().mean()) if tr is not None and tr.numel() else 0.0
        fits = (s.nonfinite == 0 and best_err <= MAX_REL_ERR and margin >= MIN_MARGIN
                and frac >= MIN_TOKEN_FRACTION)
        matched = cands[best] if fits else None
        tied = {cands[j] for j in order if float(e[j]) <= best_err * MIN_MARGIN}
        if matched is None and s.nonfinite == 0 and best_err <= MAX_REL_ERR and margin < MIN_MARGIN \
                and (s.declared is None or s.declared in tied) \
                and not _between(best_err, runner, _gap(reference, is_fp, cands[best], cands[order[1]])):
            verdict = UNDECIDED
        elif matched is None:
            verdict = "no_match"
        elif s.declared is None:
            verdict = "unlabelled"
        else:
            verdict = "ok" if matched == s.declared else "mismatch"
        results.append(SlotResult(
            name=s.name, declared=s.declared, matched=matched, rel_err=best_err, margin=margin, verdict=verdict,
            ranking=[(cands[j], float(e[j])) for j in order], token_fraction=frac,
        ))

    diagnosis = _diagnose(results, subjects, errs, scale, cands, reference, is_fp, L)
    suggested = {r.name: r.matched for r in results if r.matched is not None}
    return MatchReport(results, diagnosis, cands, errs.to(torch.float32), suggested)


def _gap(reference, is_fp: bool, a: Point, b: Point) -> float:
    """The reference's own relative distance between points ``a`` and ``b`` (over ``b``'s norm;
    estimated in the projected space against a fingerprint)."""
    store = reference.proj if is_fp else reference.states
    x, y = store[a].double(), store[b].double()
    den = float(reference.norms[b].double().square().sum().sqrt()) if is_fp else float(y.norm())
    return float((x - y).norm()) / den if den > 0 else math.inf


def _between(err_a: float, err_b: float, gap: float) -> bool:
    """The slot lies between two points it fits about equally (inside the sphere on their segment:
    ``err_a^2 + err_b^2 < gap^2``), as a mix of the two would: a decided "neither", not noise that
    hides which one it is (noise adds to both errors: ``err_b^2 ~ err_a^2 + gap^2``)."""
    return err_a * err_a + err_b * err_b < gap * gap


# -- diagnosis -----------------------------------------------------------------------------------


def _ranges(idx: list[int]) -> str:
    """``0..3, 5, 7..8``: the runs of consecutive indices, the first six of them."""
    runs: list[list[int]] = []  # [first, last] of each run
    for i in idx:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    out = [f"{a}" if a == b else f"{a}..{b}" for a, b in runs]
    return ", ".join(out[:6]) + (", ..." if len(out) > 6 else "")


def _no_match_reason(r: SlotResult, s: _Subject, scale: torch.Tensor, cands: list[Point], reference, is_fp: bool,
                     L: int) -> str:
    T = s.x.shape[0]
    if s.nonfinite:
        return f"it holds NaN/Inf ({s.nonfinite} of {s.x.numel()} values): an uninitialised or overflowed buffer"
    if float(s.norms.max()) == 0.0:
        return "it is all zeros: a buffer that was never written (a capture that did not happen)"
    lo, hi = s.x.min(), s.x.max()
    if bool(lo == hi):
        return f"it is constant ({float(lo):.4g} everywhere): a filled buffer, not a captured state"
    best = cands.index(r.ranking[0][0])
    if r.rel_err <= MAX_REL_ERR and r.margin < MIN_MARGIN:
        second = r.ranking[1]
        return (f"it fits {r.ranking[0][0]} (rel err {r.rel_err:.3g}) and {second[0]} ({second[1]:.3g}) about "
                f"equally (margin {r.margin:.2f} < {MIN_MARGIN}): the two are too close to tell apart here")
    tr = s.tok_rel.get(best)
    if tr is not None:  # the strict per-token test: a projected estimate of ~1 does not pass it by chance
        good = (tr <= MAX_REL_ERR).nonzero().flatten().tolist()
        if good and len(good) < T:
            return (f"only {len(good)} of {T} tokens match {cands[best]} (tokens {_ranges(good)}): a stale or partly "
                    "overwritten buffer (a capture of other tokens from those positions on)")
    shifted = _shift_probe(s, scale, cands, reference, is_fp)
    if shifted is not None:
        point, k, err = shifted
        return (f"it matches {point} with tokens shifted by {k:+d} (slot token t holds reference token t{k:+d}, "
                f"rel err {err:.3g}): a misaligned capture (a missing BOS, or the previous step's buffer)")
    rms = float(torch.sqrt(s.norms.square().mean()))
    ratio = rms / scale.clamp_min(1e-30)
    near = int(torch.argmin(ratio.log().abs()))
    where = f"no point comes closer than rel err {r.rel_err:.2g} ({r.ranking[0][0]})"
    if 0.8 <= float(ratio[near]) <= 1.25:
        alike = int(((ratio > 0.95) & (ratio < 1.05)).sum()) - 1
        also = f" (and {alike} other point{'s' if alike > 1 else ''} of that scale)" if alike > 0 else ""
        return (f"its per-token norms (~{rms:.4g}) are those of {cands[near]}{also}, but the values are not: a stale "
                f"buffer (a capture of other tokens or another batch) or data of that scale from elsewhere; {where}")
    return (f"its per-token norm (~{rms:.4g}) is that of no point of the reference (nearest scale: {cands[near]}, "
            f"~{float(scale[near]):.4g}): a foreign buffer (another model, random data or another tensor); {where}")


def _shift_probe(s: _Subject, scale: torch.Tensor, cands: list[Point], reference, is_fp: bool):
    """``(point, shift, rel)`` when the slot matches a point with its tokens shifted, else None.
    Tried on the few candidates nearest in scale, in a projected space (cheap at any size)."""
    from surgeon.verify.fingerprint import effective_dim, projection_matrix

    T, H = s.x.shape
    if T < 4:
        return None
    rms = float(torch.sqrt(s.norms.square().mean()))
    near = torch.argsort((rms / scale.clamp_min(1e-30)).log().abs(), stable=True)[:3].tolist()
    if is_fp:
        sp, rps = s.proj, {c: reference.proj[cands[c]].to(torch.float32) for c in near}
    else:
        P = projection_matrix(H, effective_dim(H, 64), 0)
        scratch = _Subject(s.name, None, s.x)
        _scan(scratch, P)
        sp = scratch.proj
        rps = {}
        for c in near:
            r = reference.states[cands[c]]
            rps[c] = torch.cat([r[a : a + _rows(H)].to(torch.float32) @ P for a in range(0, T, _rows(H))])
    assert sp is not None  # both paths above scanned the slot with a projection
    best = None
    for c, rp in rps.items():
        for k in range(-SHIFTS, SHIFTS + 1):
            if k == 0 or T - abs(k) < 4:
                continue
            a, b = (sp[: T - k], rp[k:]) if k > 0 else (sp[-k:], rp[: T + k])
            den = float(b.square().sum())
            if den <= 0:
                continue
            err = math.sqrt(float((a - b).square().sum()) / den)
            if err <= MAX_REL_ERR and (best is None or err < best[2]):
                best = (cands[c], k, err)
    return best


def _is_layer(p: Point | None) -> bool:
    return p is not None and p.kind == "layer_out"


def _layer_index(p: Point | None) -> int | None:
    """k for ``layer_out[k]``, else None."""
    return p.index if p is not None and p.kind == "layer_out" else None


def _depth_gap(a: Point | None, b: Point | None, L: int) -> float | None:
    """How far apart two points sit in the forward pass; None when either is missing."""
    return None if a is None or b is None else abs(a.depth(L) - b.depth(L))


def _diagnose(results: list[SlotResult], subjects: list[_Subject], errs, scale, cands, reference, is_fp, L) -> list[Diagnosis]:
    """Name what went wrong, the explanation that covers the most mismatched slots first, each slot
    explained once: a slot explained by a swap or by shifted labels is not also reported as off by
    k. Of explanations covering as many slots, a swap comes before shifted labels, and those before
    off by k (the one that says what happened rather than what it amounts to)."""
    mism = [i for i, r in enumerate(results) if r.verdict == "mismatch"]
    covered: set[int] = set()
    out: list[Diagnosis] = []
    while True:
        left = [i for i in mism if i not in covered]
        options = _swaps(results, left) + _labels_shifted(results, left, L) + _off_by_k(results, left)
        if not options:
            break
        diagnosis, slots = max(options, key=lambda o: len(o[1]))  # max keeps the first of equals
        out.append(diagnosis)
        covered |= slots
    out += _diagnose_wrong_points(results, mism, covered, L)
    out += _diagnose_duplicates(results)
    for i, r in enumerate(results):
        if r.verdict == "no_match":
            label = f" (declared {r.declared})" if r.declared is not None else ""
            why = _no_match_reason(r, subjects[i], scale, cands, reference, is_fp, L)
            out.append(Diagnosis("no_match", f"slot {r.name!r}{label} matches no point: {why}."))
        elif r.verdict == UNDECIDED:
            out.append(Diagnosis(UNDECIDED, _undecided_reason(r)))
    return out


def _undecided_reason(r: SlotResult) -> str:
    best = r.rel_err
    tied = [f"{p} ({e:.3g})" for p, e in r.ranking if e <= best * MIN_MARGIN]
    label = f", declared {r.declared}," if r.declared is not None else ""
    return (f"slot {r.name!r}{label} fits {', '.join(tied)} about equally (margin {r.margin:.2f} < {MIN_MARGIN}): "
            "the reference cannot tell these points apart on these tokens, so the slot is not judged; use more or "
            "longer prompts, or a reference whose points separate")


Option = tuple[Diagnosis, set[int]]  # a diagnosis and the mismatched slots it explains


def _swap_cycle(results: list[SlotResult], left: list[int], taken: set[int], start: int) -> list[int]:
    """Mismatched slots from ``start`` on, each holding the next one's declared point, back to
    ``start``; empty when the chain does not close."""
    path, cur = [start], start
    while True:
        m = results[cur].matched
        if len(path) >= 2 and m == results[start].declared:
            return path
        nxt = next((j for j in left if j not in path and j not in taken and results[j].declared == m), None)
        if nxt is None:
            return []
        path.append(nxt)
        cur = nxt


def _swaps(results: list[SlotResult], left: list[int]) -> list[Option]:
    """Swapped: slots whose matches are a permutation of their declared points."""
    out: list[Option] = []
    taken: set[int] = set()
    for start in left:
        if start in taken:
            continue
        path = _swap_cycle(results, left, taken, start)
        if path:
            taken.update(path)
            parts = [f"{results[j].name!r} (declared {results[j].declared}) holds {results[j].matched}" for j in path]
            names = " and ".join(repr(results[j].name) for j in path) if len(path) == 2 else \
                ", ".join(repr(results[j].name) for j in path)
            what = "are swapped" if len(path) == 2 else "hold a permutation of their declared points"
            out.append((Diagnosis("swapped", f"slots {names} {what}: " + "; ".join(parts)
                                  + ". The captures are right, their order is not: fix the slot order (or the labels)."),
                        set(path)))
    return out


def _off_by_k(results: list[SlotResult], left: list[int]) -> list[Option]:
    """Off by k: layer for layer, grouped by k."""
    out: list[Option] = []
    by_k: dict[int, list[int]] = {}
    for i in left:
        declared, matched = _layer_index(results[i].declared), _layer_index(results[i].matched)
        if declared is not None and matched is not None:
            by_k.setdefault(matched - declared, []).append(i)
    for k, idx in sorted(by_k.items()):
        parts = "; ".join(f"{results[i].name!r} is declared {results[i].declared} but holds {results[i].matched}" for i in idx)
        layers = "layer" if abs(k) == 1 else "layers"
        if abs(k) == 1:
            why = ("An off-by-one is the usual engine-numbering slip: SGLang adds 1 to EAGLE-3 layer ids (id k "
                   "captures at the entry of layer k+1 = layer_out[k]), vLLM's aux ids count residual-stream "
                   "positions (id j = layer_out[j-1], the entry of layer j); ids written for one engine and read "
                   "by the other land one layer off.")
        else:
            why = "Too far for a numbering convention: a wrong id list, or labels that do not belong to these tensors."
        out.append((Diagnosis("off_by_k", f"off by {k:+d} {layers} (k = {k:+d}): {parts}. {why}"), set(idx)))
    return out


def _diagnose_wrong_points(results: list[SlotResult], mism: list[int], covered: set[int], L: int) -> list[Diagnosis]:
    """Each remaining mismatched slot on its own: a known confusion, else a plain wrong point."""
    out: list[Diagnosis] = []
    for i in mism:
        if i in covered:
            continue
        out.append(_wrong_point(results[i], layer_out(L - 1)))
        covered.add(i)
    return out


def _wrong_point(r: SlotResult, last: Point) -> Diagnosis:
    """A mismatched slot explained by a known confusion (residual missing, embed for a layer,
    either side of the final norm), else a plain wrong point."""
    d, m = r.declared, r.matched
    n = repr(r.name)
    if m is not None and m.kind == "layer_delta" and m.index is not None:  # a mismatch always has a match
        k = m.index
        same = d == layer_out(k)
        return Diagnosis("residual_missing",
            f"slot {n} holds {m}: layer {k}'s output without the residual added (an engine's hidden_states "
            f"before `hidden_states + residual`)" + (f"; it is declared {d}, the right layer, so add the residual "
            "back at the capture" if same else f"; it is declared {d}") + " (sgl-project/sglang#39286).")
    if (d == EMBED and _is_layer(m)) or (_is_layer(d) and m == EMBED):
        if d == EMBED:
            text = (f"slot {n} is declared embed but holds {m}: no embedding was captured in this slot "
                    "(SGLang id -1, vLLM id 0 and HF hidden_states[0] are the embedding)")
        else:
            text = (f"slot {n} is declared {d} but holds the embedding (embed): an id that means the entry of "
                    "layer 0 (vLLM id 0, SGLang -1, HF hidden_states[0]) where a layer output was meant")
        return Diagnosis("embed_for_layer", text + ".")
    if (d == FINAL_NORM and m == last) or (d == last and m == FINAL_NORM):
        if d == FINAL_NORM:
            text = (f"slot {n} is declared final_norm but holds {last}, the last layer's output before the "
                    "final norm (speculators' last slot is pre-norm; HF hidden_states[-1] is post-norm)")
        else:
            text = (f"slot {n} is declared {last} but holds final_norm, the output after the final norm "
                    "(HF hidden_states[-1] and SpecForge's hidden_state are post-norm; speculators' last slot "
                    "is pre-norm)")
        return Diagnosis("norm_position", text + ".")
    return Diagnosis("wrong_point", f"slot {n} is declared {d} but holds {m}.")


def _diagnose_duplicates(results: list[SlotResult]) -> list[Diagnosis]:
    """Duplicates: two slots holding the same point (unless all of them say so and are right)."""
    out: list[Diagnosis] = []
    holders: dict[Point, list[int]] = {}
    for i, r in enumerate(results):
        if r.matched is not None:
            holders.setdefault(r.matched, []).append(i)
    for point, idx in holders.items():
        if len(idx) > 1 and not all(results[i].verdict == "ok" for i in idx):
            names = ", ".join(repr(results[i].name) for i in idx)
            decl = "; ".join(f"{results[i].name!r} " + (f"declared {results[i].declared}" if results[i].declared
                                                         else "unlabelled") for i in idx)
            out.append(Diagnosis("duplicate", f"slots {names} all hold {point} ({decl}): the same capture written "
                                              "twice, or one slot never got its own state."))
    return out


def _labels_shifted(results: list[SlotResult], left: list[int], L: int) -> list[Option]:
    """Slot i holds about what slot i+s is labelled (depth gap <= 1, closer than its own label) for
    all but one mismatched slot: the labels belong to a list one longer or shorter than the dump
    (the case that started this project: an uncaptured embed at the front). The one slot left at
    the end the labels moved away from is explained too: its own label fell off the list."""
    if len(left) < 2:
        return []
    out: list[Option] = []
    for s in (1, -1):
        hits = []
        for i in left:
            if not 0 <= i + s < len(results):
                continue
            near = _depth_gap(results[i].matched, results[i + s].declared, L)
            own = _depth_gap(results[i].matched, results[i].declared, L)
            if near is not None and own is not None and near <= 1 and near < own:
                hits.append(i)
        if len(hits) < 2 or len(hits) < len(left) - 1:
            continue
        rest = [i for i in left if i not in hits]
        edge = [i for i in rest if (i > max(hits) if s == 1 else i < min(hits))]
        parts = [f"{results[i].name!r} holds {results[i].matched}, the label of {results[i + s].name!r} "
                 f"({results[i + s].declared})" for i in hits]
        for i in edge:
            parts.append(f"{results[i].name!r} holds {results[i].matched}, "
                         + ("whose label was pushed off the end of the list" if s == 1 else "a tensor with no label"))
        cause = ("a label with no tensor behind it near the front of the list (e.g. an embed that was never "
                 "captured) moved every later label one slot down" if s == 1 else
                 "a tensor with no label near the front of the list moved every later label one slot up")
        out.append((Diagnosis("labels_shifted",
            f"the labels are shifted by one slot against the data: {'; '.join(parts)}. Likely {cause}: relabel from "
            "the matches (suggested captures)."), set(hits) | set(edge)))
    return out
