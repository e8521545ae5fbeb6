"""The value pass over one file's slots: bad values, per-slot norm statistics, and row hashes.

Per slot ``[T, H]`` (any float dtype; statistics in float32):

* rows holding NaN or Inf, all-zero rows, constant rows (every element equal, not zero);
* per-token L2 norms (one pass in the slot's own dtype, several slots of one tensor at once):
  mean, spread, min, max over the finite rows, and the 10%, 50% and 90% quantiles of their
  logarithm (identity statistics: quantiles are not moved by the few huge "attention sink"
  tokens real models have); a float32 sample of :data:`SAMPLE_ROWS` good rows, from which the
  identity pass takes the per-channel statistics (:mod:`surgeon.audit.profile`);
* a 64-bit hash of the *bits* of 64 columns of every row (the dtype's integer view, so only bit-identical rows
  share a hash): rows one slot shares with another slot of the same file are reported here;
  a few rows per slot (the :data:`KEEP` smallest hashes: the same rows are kept from two
  identical copies, whatever file they sit in) go to the driver, keyed by what the row depends
  on (its token for ``embed``, the hash of the whole token prefix otherwise), so that a row seen
  in another file on other tokens (a stale buffer) is found without keeping any file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from surgeon.core.points import EMBED, Point

KEEP = 4  # rows per slot sent to the cross-file index
HASH_COLUMNS = 64
_SEED = 0x5EED_A0D1


@dataclass
class SlotValues:
    name: str
    declared: str | None
    dtype: str
    nonfinite_rows: int = 0
    zero_rows: int = 0
    constant_rows: int = 0
    norm_mean: float | None = None
    norm_std: float | None = None
    norm_min: float | None = None
    norm_max: float | None = None
    log_norm_median: float | None = None
    log_norm_q10: float | None = None
    log_norm_q90: float | None = None
    findings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


_WEIGHTS: dict[int, Any] = {}


def _weights(n: int):
    import torch

    if n not in _WEIGHTS:
        g = torch.Generator().manual_seed(_SEED + n)
        _WEIGHTS[n] = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64) | 1
    return _WEIGHTS[n]


def _words(blocks):
    """The bits of ``blocks`` ([..., T, W]) as int64 words: 8-byte words where the row's bytes split so."""
    import torch

    xs = blocks.contiguous()
    if (xs.shape[-1] * xs.element_size()) % 8 == 0:
        return xs.view(torch.int64)
    return xs.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[xs.element_size()]).to(torch.int64)


def row_hashes(blocks, raw: bool = False):
    """[..., T] int64: a hash of the bits of each row of ``blocks`` ([..., T, W], :func:`_block` of
    the slots; int64 arithmetic wraps, which is what a hash wants). Bit-identical rows hash the
    same; two rows of a continuous state that differ do so in every column, so a block tells them
    apart as well as the whole row would. ``raw``: also whether each row may be constant (every
    word the same gives ``word x sum(weights)``, before the final mix; the whole row decides)."""
    xi = _words(blocks)
    w = _weights(xi.shape[-1])
    h = (xi * w).sum(-1)
    mixed = h ^ (h >> 31)
    return (mixed, h == xi[..., 0] * w.sum()) if raw else mixed


def _mix(x):
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic)."""
    x = x ^ (x >> 30)
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
    x = x ^ (x >> 27)
    x = x * -7723592293110705685  # 0x94D049BB133111EB as int64
    return x ^ (x >> 31)


def prefix_hashes(ids):
    """[T] int64: a hash of the token prefix ``ids[:t+1]`` for each t (the same prefix hashes the
    same in files of any length)."""
    import torch

    ids = ids.reshape(-1).to(torch.int64)
    pos = _mix(torch.arange(1, ids.numel() + 1, dtype=torch.int64) * -7046029254386353131) | 1
    return _mix(torch.cumsum(_mix(ids + 0x9E37) * pos, 0))


QUANTILES = (0.1, 0.5, 0.9)
SAMPLE_ROWS = 64  # rows per slot for the per-channel statistics (mean direction, RMS profile)


def _norm_table(N, finite) -> list[dict[str, float | None]]:
    """Per row of ``N`` [S, T] (float32 norms): mean, std, min, max over its ``finite`` entries and the
    :data:`QUANTILES` of log of the finite positive ones, for every slot in a few ops."""
    import torch

    cnt = finite.sum(1)
    safe = torch.where(finite, N, torch.zeros_like(N)).double()
    mean = safe.sum(1) / cnt.clamp_min(1)
    var = (torch.where(finite, safe - mean[:, None], torch.zeros_like(safe)) ** 2).sum(1) / (cnt - 1).clamp_min(1)
    lo = torch.where(finite, N, torch.full_like(N, math.inf)).amin(1)
    hi = torch.where(finite, N, torch.full_like(N, -math.inf)).amax(1)
    pos = finite & (N > 0)
    logs = torch.where(pos, N.clamp_min(1e-38).log(), torch.full_like(N, math.inf)).sort(1).values
    n = pos.sum(1)
    at = torch.stack([(f * (n - 1).clamp_min(0) + 0.5).floor().long() for f in QUANTILES], 1)
    qs = logs.gather(1, at.clamp_max(N.shape[1] - 1)).tolist()
    out = []
    for s, (c, m, v, a, b, k) in enumerate(zip(cnt.tolist(), mean.tolist(), var.tolist(), lo.tolist(), hi.tolist(),
                                              n.tolist())):
        row: dict[str, float | None] = dict.fromkeys(("norm_mean", "norm_std", "norm_min", "norm_max", "log_norm_q10",
                                                      "log_norm_median", "log_norm_q90"))
        if c:
            row.update(norm_mean=m, norm_std=math.sqrt(v) if c > 1 else 0.0, norm_min=a, norm_max=b)
        if k:
            row.update(log_norm_q10=qs[s][0], log_norm_median=qs[s][1], log_norm_q90=qs[s][2])
        out.append(row)
    return out


def norm_stats(sv: SlotValues, norms) -> None:
    """Mean, spread, extremes of the finite norms ``[T]``; quantiles of log of the positive ones."""
    import torch

    N = norms.float().reshape(1, -1)
    for k, x in _norm_table(N, torch.isfinite(N))[0].items():
        setattr(sv, k, x)


def _block(x):
    """[T, <=64] the :data:`HASH_COLUMNS` contiguous columns in the middle of each row: one page of a
    memory-mapped file a row (scattered columns cost a TLB miss each, ~10x the arithmetic)."""
    H = x.shape[1]
    a = max(0, H // 2 - HASH_COLUMNS // 2)
    return x[:, a:a + HASH_COLUMNS]


def _bad_rows(xs: list, N, finite) -> None:
    """For the rows whose norm is not finite: which hold NaN/Inf, and which only overflowed their
    dtype (their norm recomputed in float64), in place."""
    import torch

    for s in torch.nonzero(~finite.all(1)).reshape(-1).tolist():
        x = xs[s]
        bad = torch.nonzero(~finite[s]).reshape(-1)
        finite[s, bad] = torch.isfinite(x[bad]).all(1)
        fixed = bad[finite[s, bad]]
        N[s, fixed] = torch.linalg.vector_norm(x[fixed].double(), dim=1).float()


def _constant(xs: list, maybe, zero, finite):
    """[S, T] rows holding one value repeated (not zero): the candidates ``maybe`` checked whole."""
    import torch

    const = maybe & ~zero & finite
    for s in torch.nonzero(const.any(1)).reshape(-1).tolist():
        rows = torch.nonzero(const[s]).reshape(-1)
        const[s, rows] = xs[s][rows].amax(1) == xs[s][rows].amin(1)
    return const


def _findings(sv: SlotValues, T: int) -> None:
    if sv.nonfinite_rows:
        sv.findings.append(f"nonfinite: {sv.nonfinite_rows} of {T} rows hold NaN or Inf")
    if sv.zero_rows:
        sv.findings.append(f"zero: {sv.zero_rows} of {T} rows are all zeros" + (" (the whole slot)" if sv.zero_rows == T else ""))
    if sv.constant_rows:
        sv.findings.append(f"constant: {sv.constant_rows} of {T} rows hold one value repeated")


def file_values(names: list[str], declared: list[Point | None], xs: list, norms: list | None = None):
    """The values of a file's slots ``xs`` (each [T, H], one T and H): per slot its
    :class:`SlotValues`, the row hashes ``[S, T]`` int64 (0 for bad rows) and a float32 sample of
    its good rows (for the per-channel identity statistics). ``norms``: per slot its row norms
    where the caller computed several slots' in one pass (None: computed here)."""
    import torch

    # the slot's own dtype: torch accumulates half types in float32 (converting first: ~10x slower)
    N = torch.stack([(torch.linalg.vector_norm(x, dim=1) if n is None else n).float()
                     for x, n in zip(xs, norms or [None] * len(xs))])
    finite = torch.isfinite(N)  # NaN/Inf rows give NaN/Inf
    if not bool(finite.all()):
        _bad_rows(xs, N, finite)
    zero = N == 0
    blocks = torch.stack([_block(x) for x in xs])  # [S, T, 64]: one page a row of each slot
    h, maybe = row_hashes(blocks, raw=True)
    const = _constant(xs, maybe, zero, finite)
    good = finite & ~zero & ~const
    table = _norm_table(N, finite)
    counts = torch.stack([(~finite).sum(1), zero.sum(1), const.sum(1)], 1).tolist()
    T = N.shape[1]
    out = []
    for name, d, x, row, (nf, nz, nc) in zip(names, declared, xs, table, counts):
        sv = SlotValues(name, None if d is None else str(d), str(x.dtype).replace("torch.", ""), nf, nz, nc)
        for k, val in row.items():
            setattr(sv, k, val)
        _findings(sv, T)
        out.append(sv)
    return out, torch.where(good, h, torch.zeros_like(h)), [sample_rows(x, g) for x, g in zip(xs, good)]


def slot_values(name: str, declared: Point | None, x, norms=None) -> tuple[SlotValues, Any, Any]:
    """:func:`file_values` of one slot: its values, row hashes ([T]) and row sample."""
    svs, h, samples = file_values([name], [declared], [x], [norms])
    return svs[0], h[0], samples[0]


def sample_rows(x, good, n: int = SAMPLE_ROWS):
    """float32 [<=n, H]: about ``n`` evenly spaced rows of ``x``, those of them that are good, the
    first row (often a BOS sink) left out."""
    import torch

    T = x.shape[0]
    idx = torch.arange(1, T, max(1, (T - 1) // n))[:n] if T > 1 else torch.zeros(1, dtype=torch.long)
    return x[idx[good[idx]]].float()


def repeated_across_slots(names: list[str], hashes) -> list[tuple[str, str]]:
    """(slot, finding) for rows one slot shares bit for bit with another slot of the same file
    (two different points are never bit-identical; bad rows, hashed 0, are reported already).
    ``hashes``: [S, T]."""
    import torch

    # each slot's distinct hashes (an embed slot repeats a row wherever its token repeats): no hash
    # in two slots is the usual case, settled with one sort
    per_slot = [torch.unique(h[h != 0]) for h in hashes]
    live = torch.cat(per_slot) if per_slot else hashes.reshape(-1)
    if live.numel() == torch.unique(live).numel():
        return []
    out = []
    for i in range(len(hashes)):
        for j in range(i + 1, len(hashes)):
            a, b = hashes[i][hashes[i] != 0], hashes[j][hashes[j] != 0]
            n = int(torch.isin(b, a).sum()) if a.numel() and b.numel() else 0
            if n:
                out.append((names[j], f"repeated: {n} of its rows are identical to rows of slot {names[i]} on the "
                                      f"{HASH_COLUMNS} hashed columns, bit for bit (a stale or shared buffer)"))
    return out


def sampled_rows(declared: list[Point | None], hashes, ids) -> list[list[int]]:
    """[slot, row hash, context hash, token] of the :data:`KEEP` smallest-hash rows of each slot
    (``hashes`` [S, T]), the context being what the row may depend on: the token for ``embed``,
    the prefix otherwise."""
    import torch

    if ids is None or not hashes.numel():
        return []
    ids = ids.reshape(-1).to(torch.int64)
    pre = prefix_hashes(ids)
    top = torch.iinfo(torch.int64).max
    vals, rows = torch.where(hashes == 0, torch.full_like(hashes, top), hashes).topk(
        min(KEEP, hashes.shape[1]), dim=1, largest=False, sorted=True)
    out: list[list[int]] = []
    for s, (d, vs, ts) in enumerate(zip(declared, vals.tolist(), rows.tolist())):
        ctx = ids if d == EMBED else pre
        out.extend([s, v, int(ctx[t]), t] for v, t in zip(vs, ts) if v != top)
    return out
