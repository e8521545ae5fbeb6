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


def _columns(H: int) -> slice:
    """About :data:`HASH_COLUMNS` evenly spaced columns (a strided view: nothing is gathered)."""
    return slice(None, None, max(1, H // HASH_COLUMNS))


def row_hashes(x):
    """[T] int64: a hash of the bits of each row's :func:`_hash_view`, read as int64 words (int64
    arithmetic wraps, which is what a hash wants). Bit-identical rows hash the same; two rows of a
    continuous state that differ do so in every column, so a subset tells them apart as well as
    the whole row would."""
    import torch

    xs = _hash_view(x).contiguous()
    if (xs.shape[1] * xs.element_size()) % 8 == 0:
        xi = xs.view(torch.int64)
    else:
        xi = xs.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[xs.element_size()]).to(torch.int64)
    h = (xi * _weights(xi.shape[1])).sum(1)
    return h ^ (h >> 31)


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


def norm_stats(sv: SlotValues, norms) -> None:
    """Mean, spread, extremes of the finite norms; quantiles of log of the positive ones (one sort)."""
    import torch

    good = norms[torch.isfinite(norms)]
    if good.numel():
        sv.norm_mean = float(good.mean())
        sv.norm_std = float(good.std()) if good.numel() > 1 else 0.0
        sv.norm_min, sv.norm_max = float(good.min()), float(good.max())
        logs = good[good > 0].log().sort().values
        n = logs.numel()
        if n:
            q = [float(logs[min(n - 1, int(f * (n - 1) + 0.5))]) for f in QUANTILES]
            sv.log_norm_q10, sv.log_norm_median, sv.log_norm_q90 = q


def _hash_view(x):
    """[T, <=64] about :data:`HASH_COLUMNS` columns in 4 contiguous blocks of 16 (4 cache lines a
    row, where a strided pick touches every line); a strided pick where H does not split in 4."""
    H = x.shape[1]
    if H % 4 == 0 and H >= 64:
        return x.reshape(x.shape[0], 4, H // 4)[:, :, :16].reshape(x.shape[0], 64)
    return x[:, _columns(H)]


def _constant_rows(x, zero, finite):
    """Rows holding one value repeated (not zero): 4 columns first, then the candidates whole."""
    import torch

    H = x.shape[1]
    sub = x[:, [0, H // 3, (2 * H) // 3, H - 1]]
    maybe = torch.nonzero((sub.amax(1) == sub.amin(1)) & ~zero & finite).reshape(-1)
    const = torch.zeros_like(zero)
    if maybe.numel():
        const[maybe] = x[maybe].amax(1) == x[maybe].amin(1)
    return const


def slot_values(name: str, declared: Point | None, x, norms=None) -> tuple[SlotValues, Any, Any]:
    """The values of one slot ``x`` [T, H], its row hashes ([T] int64) and a float32 sample of its
    good rows (for the per-channel identity statistics). ``norms``: its per-row L2 norms when the
    caller computed them for several slots in one pass."""
    import torch

    sv = SlotValues(name, None if declared is None else str(declared), str(x.dtype).replace("torch.", ""))
    if norms is None:  # the slot's own dtype: torch accumulates half types in float32 (converting first: ~10x slower)
        norms = torch.linalg.vector_norm(x, dim=1)
    norms = norms.float()
    finite_rows = torch.isfinite(norms)  # NaN/Inf rows give NaN/Inf
    if not bool(finite_rows.all()):  # which of them hold NaN/Inf, and which only overflowed their dtype
        bad = torch.nonzero(~finite_rows).reshape(-1)
        finite_rows[bad] = torch.isfinite(x[bad]).all(1)
        norms[bad[finite_rows[bad]]] = torch.linalg.vector_norm(x[bad[finite_rows[bad]]].double(), dim=1).float()
    sv.nonfinite_rows = int((~finite_rows).sum())
    zero = norms == 0
    sv.zero_rows = int(zero.sum())
    const = _constant_rows(x, zero, finite_rows)
    sv.constant_rows = int(const.sum())
    norm_stats(sv, torch.where(finite_rows, norms, torch.full_like(norms, math.nan)))
    T = x.shape[0]
    if sv.nonfinite_rows:
        sv.findings.append(f"nonfinite: {sv.nonfinite_rows} of {T} rows hold NaN or Inf")
    if sv.zero_rows:
        sv.findings.append(f"zero: {sv.zero_rows} of {T} rows are all zeros" + (" (the whole slot)" if sv.zero_rows == T else ""))
    if sv.constant_rows:
        sv.findings.append(f"constant: {sv.constant_rows} of {T} rows hold one value repeated")
    good = finite_rows & ~zero & ~const
    h = row_hashes(x)
    return sv, torch.where(good, h, torch.zeros_like(h)), sample_rows(x, good)


def sample_rows(x, good, n: int = SAMPLE_ROWS):
    """float32 [<=n, H]: ``n`` evenly spaced good rows of ``x``, the first row (often a BOS sink) left out."""
    import torch

    idx = torch.nonzero(good).reshape(-1)
    if idx.numel() > 1:
        idx = idx[1:]
    if idx.numel() > n:
        idx = idx[torch.linspace(0, idx.numel() - 1, n).round().long()]
    return x[idx].float()


def repeated_across_slots(names: list[str], hashes: list) -> list[tuple[str, str]]:
    """(slot, finding) for rows one slot shares bit for bit with another slot of the same file
    (two different points are never bit-identical; bad rows, hashed 0, are reported already)."""
    import torch

    live = [torch.unique(h[h != 0]) for h in hashes]
    allh = torch.cat(live) if live else torch.empty(0, dtype=torch.int64)
    if allh.numel() == torch.unique(allh).numel():  # no hash in two slots: the usual case, one pass
        return []
    out = []
    for i in range(len(hashes)):
        for j in range(i + 1, len(hashes)):
            a, b = hashes[i][hashes[i] != 0], hashes[j][hashes[j] != 0]
            n = int(torch.isin(b, a).sum()) if a.numel() and b.numel() else 0
            if n:
                out.append((names[j], f"repeated: {n} of its rows are bit-identical to rows of slot {names[i]} "
                                      "(a stale or shared buffer)"))
    return out


def sampled_rows(declared: list[Point | None], hashes: list, ids) -> list[list[int]]:
    """[slot, row hash, context hash, token] of the :data:`KEEP` smallest-hash rows of each slot,
    the context being what the row may depend on: the token for ``embed``, the prefix otherwise."""
    import torch

    if ids is None:
        return []
    ids = ids.reshape(-1).to(torch.int64)
    pre = prefix_hashes(ids)
    out = []
    for s, (d, h) in enumerate(zip(declared, hashes)):
        nz = torch.nonzero(h != 0).reshape(-1)
        if not nz.numel():
            continue
        order = torch.argsort(h[nz], stable=True)[:KEEP]
        ctx = ids if d == EMBED else pre
        for t in nz[order].tolist():
            out.append([s, int(h[t]), int(ctx[t]), t])
    return out
