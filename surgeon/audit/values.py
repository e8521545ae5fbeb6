"""The value pass over one file's slots: bad values, per-slot norm statistics, and row hashes.

Per slot ``[T, H]`` (any float dtype; statistics in float32):

* rows holding NaN or Inf, all-zero rows, constant rows (every element equal, not zero);
* per-token L2 norms (:func:`surgeon.audit.norms.row_norms`: float32 sums of squares, several slots
  of one tensor at once):
  mean, spread, min, max over the finite rows, and the 10%, 50% and 90% quantiles of their
  logarithm (identity statistics: quantiles are not moved by the few huge "attention sink"
  tokens real models have); the float32 sum and sum of squares per channel of a sample of
  :data:`SAMPLE_ROWS` good rows (:class:`Moments`), from which the identity pass takes the
  per-channel statistics (:mod:`surgeon.audit.profile`);
* a 64-bit hash of the *bits* of 64 columns of every row (the dtype's integer view, so only bit-identical rows
  share a hash): rows one slot shares with another slot of the same file are reported here;
  a few rows per slot (the :data:`KEEP` smallest hashes: the same rows are kept from two
  identical copies, whatever file they sit in) go to the driver, keyed by what the row depends
  on (its token for ``embed``, the hash of the whole token prefix otherwise), so that a row seen
  in another file on other tokens (a stale buffer) is found without keeping any file.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from surgeon.core.points import EMBED, Point

if TYPE_CHECKING:
    from surgeon.audit.rows import RowPlan

KEEP = 4  # rows per slot sent to the cross-file index
HASH_COLUMNS = 64
_SEED = 0x5EED_A0D1


@dataclass
class SlotValues:
    """One slot's value pass in one file; its fields (:func:`dataclasses.asdict`) are the slot's row
    of the file's result, which the driver folds and the resume state records."""

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


_WEIGHTS: dict[int, Any] = {}


def _weights(n: int):
    """int64 [n] odd weights (numpy; drawn once per width from a seeded torch generator)."""
    import torch

    if n not in _WEIGHTS:
        g = torch.Generator().manual_seed(_SEED + n)
        _WEIGHTS[n] = (torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64) | 1).numpy()
    return _WEIGHTS[n]


def _words(blocks):
    """The bits of ``blocks`` ([..., T, W] torch) as int64 words (numpy): 8-byte words where the row's
    bytes split so."""
    import numpy as np
    import torch

    xs = blocks.contiguous()
    if (xs.shape[-1] * xs.element_size()) % 8 == 0:
        return xs.view(torch.int64).numpy()
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[xs.element_size()]
    return xs.view(ints).numpy().astype(np.int64)


def row_hashes(blocks, raw: bool = False):
    """[..., T] int64: a hash of the bits of each row of ``blocks`` ([..., T, W], :func:`_block` of
    the slots; numpy, whose int64 arithmetic wraps, which is what a hash wants). Bit-identical rows
    hash the same; two rows of a continuous state that differ do so in every column, so a block
    tells them apart as well as the whole row would. ``raw``: also whether each row may be constant
    (every word the same gives ``word x sum(weights)``, before the final mix; the whole row decides)."""
    xi = _words(blocks)
    w = _weights(xi.shape[-1])
    h = xi @ w
    mixed = h ^ (h >> 31)
    return (mixed, h == xi[..., 0] * w.sum()) if raw else mixed


def _mix(x):
    """splitmix64's finaliser on int64 numpy arrays (wrapping arithmetic)."""
    import numpy as np

    x = x ^ (x >> 30)
    x = x * np.int64(-4658895280553007687)  # 0xBF58476D1CE4E5B9 as int64
    x = x ^ (x >> 27)
    x = x * np.int64(-7723592293110705685)  # 0x94D049BB133111EB as int64
    return x ^ (x >> 31)


def _int64(ids):
    """A flat int64 numpy array of token ids (a torch tensor or anything numpy takes)."""
    import numpy as np

    return np.asarray(ids.numpy() if hasattr(ids, "numpy") else ids).reshape(-1).astype(np.int64, copy=False)


def prefix_hashes(ids):
    """[T] int64 (numpy): a hash of the token prefix ``ids[:t+1]`` for each t (the same prefix hashes
    the same in files of any length)."""
    import numpy as np

    ids = _int64(ids)
    with np.errstate(over="ignore"):
        pos = _mix(np.arange(1, ids.size + 1, dtype=np.int64) * np.int64(-7046029254386353131)) | 1
        return _mix(np.cumsum(_mix(ids + 0x9E37) * pos))


QUANTILES = (0.1, 0.5, 0.9)
SAMPLE_ROWS = 64  # rows per slot for the per-channel statistics (mean direction, RMS profile)


def _norm_table(N, finite) -> list[dict[str, float | None]]:
    """Per row of ``N`` [S, T] (float32 norms, numpy): mean, std, min, max over its ``finite``
    entries and the :data:`QUANTILES` of log of the finite positive ones, for every slot in a few
    numpy ops (a file's slots are small arrays: numpy's per-op cost is a fraction of torch's)."""
    import numpy as np

    S, T = N.shape
    if T > 1 and finite.all() and (N > 0).all():  # the usual slot: every row good, the same figures in fewer ops
        d = N.astype(np.float64)
        at = [int(math.floor(f * (T - 1) + 0.5)) for f in QUANTILES]
        return _table_rows([T] * S, d.mean(1).tolist(), d.var(1, ddof=1).tolist(), N.min(1).tolist(), N.max(1).tolist(),
                           [T] * S, np.log(np.partition(N, at, axis=1)[:, at]).tolist())
    cnt = finite.sum(1)
    safe = np.where(finite, N, 0).astype(np.float64)
    mean = safe.sum(1) / np.maximum(cnt, 1)
    var = (np.where(finite, safe - mean[:, None], 0) ** 2).sum(1) / np.maximum(cnt - 1, 1)
    lo = np.where(finite, N, np.inf).min(1)
    hi = np.where(finite, N, -np.inf).max(1)
    pos = finite & (N > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.sort(np.where(pos, np.log(np.maximum(N, 1e-38)), np.inf), 1)
    n = pos.sum(1)
    at = np.stack([np.floor(f * np.maximum(n - 1, 0) + 0.5).astype(np.int64) for f in QUANTILES], 1)
    qs = np.take_along_axis(logs, np.minimum(at, T - 1), 1).tolist()
    return _table_rows(cnt.tolist(), mean.tolist(), var.tolist(), lo.tolist(), hi.tolist(), n.tolist(), qs)


def _table_rows(cnt: list, mean: list, var: list, lo: list, hi: list, n: list, qs: list) -> list[dict[str, float | None]]:
    """:func:`_norm_table`'s rows from its per-slot figures (``cnt`` finite rows, ``n`` of them
    positive: the statistics of none are None)."""
    out = []
    for s, (c, m, v, a, b, k) in enumerate(zip(cnt, mean, var, lo, hi, n)):
        row: dict[str, float | None] = dict.fromkeys(("norm_mean", "norm_std", "norm_min", "norm_max", "log_norm_q10",
                                                      "log_norm_median", "log_norm_q90"))
        if c:
            row.update(norm_mean=m, norm_std=math.sqrt(v) if c > 1 else 0.0, norm_min=float(a), norm_max=float(b))
        if k:
            row.update(log_norm_q10=float(qs[s][0]), log_norm_median=float(qs[s][1]), log_norm_q90=float(qs[s][2]))
        out.append(row)
    return out


def norm_stats(sv: SlotValues, norms) -> None:
    """Mean, spread, extremes of the finite norms ``[T]``; quantiles of log of the positive ones."""
    import numpy as np

    N = norms.float().reshape(1, -1).numpy()
    for k, x in _norm_table(N, np.isfinite(N))[0].items():
        setattr(sv, k, x)


def _hashed(H: int) -> slice:
    """The :data:`HASH_COLUMNS` contiguous columns in the middle of a row of ``H`` (all of a shorter
    one): one page of the file a row (scattered columns cost a TLB miss each, ~10x the arithmetic)."""
    a = max(0, H // 2 - HASH_COLUMNS // 2)
    return slice(a, min(H, a + HASH_COLUMNS))


def _block(x):
    """[T, <=64] the hashed columns (:func:`_hashed`) of each row of ``x`` [T, H]."""
    return x[:, _hashed(x.shape[1])]


def _bad_rows(g: Gathered, N, finite) -> None:
    """For the rows whose norm is not finite: which hold NaN/Inf, and which only overflowed their
    dtype (their norm recomputed in float64), in place (torch [S, T])."""
    import torch

    for s in torch.nonzero(~finite.all(1)).reshape(-1).tolist():
        bad = torch.nonzero(~finite[s]).reshape(-1)
        x = g.rows_of(s, bad)
        ok = torch.isfinite(x).all(1)
        finite[s, bad] = ok
        # a norm past float32's range (finite values near the dtype's limit) is held at its largest:
        # the statistics stay numbers (an infinite mean, a NaN spread, in the state and the report)
        N[s, bad[ok]] = torch.linalg.vector_norm(x[ok].double(), dim=1).clamp_max(torch.finfo(torch.float32).max).float()


def _zero_rows(g: Gathered, N) -> None:
    """For the rows whose norm is 0: those whose hashed columns hold a nonzero value (values so small
    that their squares vanish in float32) are read again and get their norm in float64, at least
    float32's smallest normal, in place (torch [S, T]). The others hold zeros: a row of such values
    that is zero in 64 contiguous columns is taken for zeros (no hidden state either way; not
    reading it again keeps a slot of zeros, a common fault, from costing a second read of the slot)."""
    import torch

    for s in torch.nonzero((N == 0).any(1)).reshape(-1).tolist():
        rows = torch.nonzero(N[s] == 0).reshape(-1)
        rows = rows[(g.blocks[s].index_select(0, rows) != 0).any(1)]
        if rows.numel():
            N[s, rows] = torch.linalg.vector_norm(g.rows_of(s, rows).double(), dim=1).float().clamp_min(
                torch.finfo(torch.float32).tiny)


def _constant(g: Gathered, maybe, zero, finite):
    """[S, T] rows holding one value repeated (not zero): the candidates ``maybe`` checked whole."""
    import numpy as np
    import torch

    const = maybe & ~zero & finite
    for s in np.flatnonzero(const.any(1)).tolist():
        rows = np.flatnonzero(const[s])
        x = g.rows_of(s, torch.from_numpy(rows))
        const[s, rows] = (x.amax(1) == x.amin(1)).numpy()
    return const


def _findings(sv: SlotValues, T: int) -> None:
    if sv.nonfinite_rows:
        sv.findings.append(f"nonfinite: {sv.nonfinite_rows} of {T} rows hold NaN or Inf")
    if sv.zero_rows:
        sv.findings.append(f"zero: {sv.zero_rows} of {T} rows are all zeros" + (" (the whole slot)" if sv.zero_rows == T else ""))
    if sv.constant_rows:
        sv.findings.append(f"constant: {sv.constant_rows} of {T} rows hold one value repeated")


def sample_index(T: int, n: int = SAMPLE_ROWS):
    """The rows sampled for the per-channel statistics: about ``n`` evenly spaced rows of ``T`` (the
    first row, often a BOS sink, left out where there is another); int64 numpy, ascending."""
    import numpy as np

    return np.arange(1, T, max(1, (T - 1) // n))[:n] if T > 1 else np.zeros(1, dtype=np.int64)


@dataclass(frozen=True)
class Moments:
    """What the identity pass takes of the rows :func:`sample_index` picks of each of a file's ``S``
    slots, their good rows only: ``count`` [S] int64, ``sum`` and ``sumsq`` [S, H] float32 (numpy),
    their sum and the sum of their squares per channel."""

    count: Any
    sum: Any
    sumsq: Any

    def __len__(self) -> int:
        return len(self.count)


def sample_moments(samples, good) -> Moments:
    """:class:`Moments` of ``samples`` ([S, n, H] torch, any float dtype) over the rows ``good``
    ([S, n] numpy bool) holds (the others, NaN included, left out exactly): half rows in one pass of
    the norm kernel's module (:func:`surgeon.audit.norms.half_moments`, ~3x what follows), wider
    ones zeroed in a float32 copy and summed, every slot in two matrix products (with the copy,
    ~1.6x faster than torch's ``sum`` over the middle axis)."""
    import torch

    from surgeon.audit.norms import half_moments

    if (sums := half_moments(samples, good)) is not None:  # half rows: one pass, widened as they are read
        return Moments(good.sum(1), *sums)
    x = samples.to(torch.float32, copy=True)  # this function's own: written in place, one array a file
    if not good.all():
        x.masked_fill_(torch.from_numpy(~good)[..., None], 0)
    ones = torch.ones(x.shape[0], 1, x.shape[1])
    total = torch.bmm(ones, x)[:, 0].numpy()
    return Moments(good.sum(1), total, torch.bmm(ones, x.square_())[:, 0].numpy())


@dataclass
class Gathered:
    """What the value pass takes from every row of a file's ``S`` slots of ``T`` rows, in one read:
    ``norms`` [S, T] float32 (:func:`surgeon.audit.norms.row_norms`), ``blocks`` [S, T, <=64] (the hashed
    columns, :func:`_block`), ``samples`` [S, n, H] in the slots' dtype (the rows :func:`sample_index`
    picks) and ``first`` [S, H] float32 (row 0); ``rows_of(slot, rows)`` reads rows again (ascending int64
    torch indices) for the few a check looks at whole."""

    norms: Any
    blocks: Any
    samples: Any
    first: Any
    rows_of: Callable[[int, Any], Any]
    dtype: str


def gather_tensors(xs: list, norms: list | None = None) -> Gathered:
    """:class:`Gathered` of slots held as tensors (each [T, H], one T, H and dtype). ``norms``: per
    slot its row norms where the caller computed several slots' in one pass (None: computed here)."""
    import torch

    from surgeon.audit.norms import row_norms

    N = torch.stack([(row_norms(x) if n is None else n) for x, n in zip(xs, norms or [None] * len(xs))])
    at = torch.from_numpy(sample_index(xs[0].shape[0]))
    samples = torch.stack([x.index_select(0, at) for x in xs])  # index_select: ~6x faster than x[at] on a strided view
    return Gathered(N, torch.stack([_block(x) for x in xs]), samples, torch.stack([x[0].float() for x in xs]),
                    lambda s, rows: xs[s].index_select(0, rows), str(xs[0].dtype).replace("torch.", ""))


def gather_file(rp: RowPlan, chunk_bytes: int | None = None) -> Gathered:
    """:class:`Gathered` of the slots a :class:`~surgeon.audit.rows.RowPlan` locates, read in chunks
    (:func:`surgeon.audit.rows.chunks`): each chunk's norms, hashed columns and sampled rows copied
    into the file's slot-major arrays while it is in the cache, one
    :func:`~surgeon.audit.norms.scan_chunk` a chunk whatever its slot count (each region's slots are
    consecutive: views of the arrays, in row-major order, take a chunk's ``[n, m, ...]`` results as
    they come)."""
    import torch

    from surgeon.audit.norms import scan_chunk
    from surgeon.audit.rows import CHUNK_BYTES, chunks, rows_of

    S, T, H = rp.slots, rp.tokens, rp.hidden
    cols = _hashed(H)
    idx = sample_index(T)
    picks = idx.tolist()
    norms = torch.empty(S, T, dtype=torch.float32)
    blocks = torch.empty(S, T, cols.stop - cols.start, dtype=getattr(torch, rp.dtype))
    samples = torch.empty(S, idx.size, H, dtype=blocks.dtype)  # as read: no conversion a chunk
    first = torch.empty(S, H, dtype=torch.float32)
    for reg, r0, X in chunks(rp, chunk_bytes or CHUNK_BYTES):
        at, n = slice(reg.slots[0], reg.slots[0] + len(reg.slots)), X.shape[0]
        lo, hi = bisect.bisect_left(picks, r0), bisect.bisect_left(picks, r0 + n)  # a list's bisect: ~17x numpy's per call
        scan_chunk(X, r0, norms[at], blocks[at], cols.start, idx, lo, hi, samples[at])  # every slot of the region at once
        if r0 == 0:
            first[at].copy_(X[0])
    return Gathered(norms, blocks, samples, first, lambda s, rows: rows_of(rp, s, rows.tolist()), rp.dtype)


def file_values(names: list[str], declared: list[Point | None], xs: list, norms: list | None = None):
    """:func:`gathered_values` of slots held as tensors ``xs`` (each [T, H], one T and H)."""
    return gathered_values(names, declared, gather_tensors(xs, norms))


def gathered_values(names: list[str], declared: list[Point | None], g: Gathered):
    """The values of a file's slots from what :class:`Gathered` took of them: per slot its
    :class:`SlotValues`, the row hashes ``[S, T]`` int64 (numpy; 0 for bad rows) and the
    :class:`Moments` of its good sampled rows (for the per-channel identity statistics)."""
    import numpy as np
    import torch

    N = g.norms.numpy()  # [S, T] small arrays: numpy's per-op cost, a fraction of torch's
    finite = np.isfinite(N)  # NaN/Inf rows give NaN/Inf
    if not finite.all():
        _bad_rows(g, g.norms, torch.from_numpy(finite))  # in place, through views of the same memory
    zero = N == 0
    if zero.any():
        _zero_rows(g, g.norms)
        zero = N == 0
    h, maybe = row_hashes(g.blocks, raw=True)
    const = _constant(g, maybe, zero, finite)
    good = finite & ~zero & ~const
    table = _norm_table(N, finite)
    counts = np.stack([(~finite).sum(1), zero.sum(1), const.sum(1)], 1).tolist()
    T = N.shape[1]
    out = []
    for name, d, row, (nf, nz, nc) in zip(names, declared, table, counts):
        sv = SlotValues(name, None if d is None else str(d), g.dtype, nf, nz, nc)
        for k, val in row.items():
            setattr(sv, k, val)
        _findings(sv, T)
        out.append(sv)
    return out, np.where(good, h, 0), sample_moments(g.samples, good[:, sample_index(T)])


def slot_values(name: str, declared: Point | None, x, norms=None) -> tuple[SlotValues, Any, Any]:
    """:func:`file_values` of one slot: its values, row hashes ([T]) and sampled rows' :class:`Moments`."""
    svs, h, moments = file_values([name], [declared], [x], [norms])
    return svs[0], h[0], moments


def repeated_rows(names: list[str], declared: list[Point | None], hashes, ids) -> list[tuple[str, str]]:
    """(slot, finding) for rows repeated where a state cannot repeat: in two slots of the file
    (:func:`repeated_across_slots`), or in one slot at positions that hold other tokens
    (:func:`repeated_within_slots`). ``hashes``: [S, T] (numpy); ``ids``: [T] or None."""
    import numpy as np

    hashes = np.asarray(hashes)
    srt = np.sort(hashes, 1)  # sorted once for both checks
    return repeated_within_slots(names, declared, hashes, ids, srt) + repeated_across_slots(names, hashes, srt)


def repeated_within_slots(names: list[str], declared: list[Point | None], hashes, ids, srt=None) -> list[tuple[str, str]]:
    """(slot, finding) for a slot declared a state after the embedding whose row at one position is
    bit for bit its row at a position holding another token (one buffer written at every position,
    a stale last-token state): a residual state depends on its token, so two tokens never share one.
    An embed slot repeats wherever its token does, and is left out; so is a slot with no declared
    point, or a file without one token id a row. ``srt``: ``hashes`` sorted along rows, if at hand."""
    import numpy as np

    hashes = np.asarray(hashes)
    srt = np.sort(hashes, 1) if srt is None else srt
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != 0)  # no repeated row in any slot: the usual case
    ids = None if ids is None else _int64(ids)
    if ids is None or ids.size != hashes.shape[1] or not bool(dup.any()):
        return []
    out = []
    for s in np.flatnonzero(dup.any(1)).tolist():
        if declared[s] is None or declared[s] == EMBED:
            continue
        live = hashes[s] != 0
        h, t = hashes[s][live], ids[live]
        order = np.lexsort((t, h))
        h, t = h[order], t[order]
        starts = np.flatnonzero(np.r_[True, h[1:] != h[:-1]])
        mixed = np.minimum.reduceat(t, starts) != np.maximum.reduceat(t, starts)  # a hash seen on two tokens
        n = int(np.diff(np.r_[starts, h.size])[mixed].sum())
        if n:
            out.append((names[s], f"repeated: {n} of its rows repeat, bit for bit on the {HASH_COLUMNS} hashed columns, "
                                  "at positions holding other tokens (one state written at several positions: a "
                                  "broadcast or stale buffer)"))
    return out


def repeated_across_slots(names: list[str], hashes, srt=None) -> list[tuple[str, str]]:
    """(slot, finding) for rows one slot shares bit for bit with another slot of the same file
    (two different points are never bit-identical; bad rows, hashed 0, are reported already).
    ``hashes``: [S, T] (numpy); ``srt``: it sorted along rows, if at hand."""
    import numpy as np

    hashes = np.asarray(hashes)
    # each slot's distinct hashes (an embed slot repeats a row wherever its token repeats): no hash
    # in two slots is the usual case, settled with two sorts
    srt = np.sort(hashes, 1) if srt is None else srt
    first = np.ones(srt.shape, dtype=bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    live = np.sort(srt[first & (srt != 0)], kind="stable")  # runs already sorted: timsort merges them, ~15x quicksort
    if not bool((live[1:] == live[:-1]).any()):
        return []
    per_slot = [np.unique(h[h != 0]) for h in hashes]
    out = []
    for i in range(len(hashes)):
        for j in range(i + 1, len(hashes)):
            n = int(np.isin(hashes[j][hashes[j] != 0], per_slot[i]).sum())
            if n:
                out.append((names[j], f"repeated: {n} of its rows are identical to rows of slot {names[i]} on the "
                                      f"{HASH_COLUMNS} hashed columns, bit for bit (a stale or shared buffer)"))
    return out


def sampled_rows(declared: list[Point | None], hashes, ids) -> list[list[int]]:
    """[slot, row hash, context hash, token] of the :data:`KEEP` smallest-hash rows of each slot
    (``hashes`` [S, T]), the context being what the row may depend on: the token for ``embed``,
    the prefix otherwise."""
    import numpy as np

    hashes = np.asarray(hashes)
    ids = None if ids is None else _int64(ids)
    if ids is None or not hashes.size or ids.size != hashes.shape[1]:  # no ids, or not one a row: no context to key by
        return []
    pre = prefix_hashes(ids)
    top = np.iinfo(np.int64).max
    keyed = np.where(hashes == 0, top, hashes)
    k = min(KEEP, keyed.shape[1])
    rows = np.argpartition(keyed, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(keyed, rows, 1)
    # in hash order, then row order; which of several equal hashes at the k-th place is kept is the
    # partition's choice, the same for the same array (two copies of a file keep the same rows)
    order = np.lexsort((rows, vals), axis=1)
    rows, vals = np.take_along_axis(rows, order, 1), np.take_along_axis(vals, order, 1)
    out: list[list[int]] = []
    for s, (d, vs, ts) in enumerate(zip(declared, vals.tolist(), rows.tolist())):
        ctx = ids if d == EMBED else pre
        out.extend([s, v, int(ctx[t]), t] for v, t in zip(vs, ts) if v != top)
    return out
